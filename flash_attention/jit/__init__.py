"""Build layer: KernelConfig -> translation unit -> cubin (NVRTC or nvcc) -> on-disk cache -> loaded kernel.

Torch-free on purpose: kernels are plain cubins loaded through the CUDA driver API, so one cache serves
every installed torch version and no C++ extension ABI has to match.
"""

from .kernels import get_kernel, kernel_source

__all__ = ["get_kernel", "kernel_source"]
