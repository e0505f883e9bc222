"""Build layer: config -> translation unit -> cubin (NVRTC or nvcc) -> on-disk cache -> loaded kernel.

Torch-free on purpose: kernels are plain cubins loaded through the CUDA driver API, so one cache serves
every installed torch version and no C++ extension ABI has to match.

* :mod:`.sources` -- the translation unit of a config and its entry-point names;
* :mod:`.compiler` -- NVRTC / nvcc, with the resource report;
* :mod:`.cache` -- the on-disk cache and :func:`build`;
* :mod:`.driver` -- the CUDA driver API calls (load, launch);
* :mod:`.loader` -- loaded entry points by config;
* :mod:`.catalog` -- every kernel a model can need, for ahead-of-time builds;
* :mod:`.params` -- the ctypes twins of the kernels' params structs.
"""

from .cache import build, cache_dir
from .loader import get_bwd_kernels, get_kernel
from .sources import kernel_source

__all__ = ["build", "cache_dir", "get_bwd_kernels", "get_kernel", "kernel_source"]
