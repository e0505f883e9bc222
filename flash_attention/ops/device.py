"""What the launch layer needs to know about a GPU, read once per device: its architecture and name, its
shared-memory limit, and whether our kernels can run on it at all (and if not, why, in words)."""

from __future__ import annotations

import re
from functools import cache

import torch

from ..jit import compiler as _compiler
from ..jit import driver

__all__ = [
    "KERNEL_DTYPES",
    "cuda_unavailable_reason",
    "device_unavailable_reason",
    "current_stream",
    "device_arch",
    "dtype_name",
    "gpu_name",
    "sm_count",
    "smem_limit",
]

#: The dtypes the kernels take, by their config name.
KERNEL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@cache
def device_arch(index: int) -> str:
    """``"sm_90"`` for device ``index``."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@cache
def gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@cache
def sm_count(index: int) -> int:
    """The multiprocessors of device ``index`` (a persistent grid launches one block on each)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def smem_limit(index: int) -> int:
    """The dynamic shared memory one block may opt into on device ``index`` (bytes)."""
    return driver.device_attribute(driver.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, index)


@cache
def _device_problem(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return (
            f"{gpu_name(index)} (sm_{major}{minor}) is older than sm_80, which the kernels' instructions need"
        )
    try:
        driver.libcuda()
    except Exception as exc:  # noqa: BLE001 - any driver failure means the PyTorch path
        return f"the CUDA driver API is unusable: {exc}"
    return None


@cache
def _driver_problem() -> str | None:
    """Whether the driver can load what the compiler makes: the library API the launch layer uses
    (cuLibraryLoadData: a driver of CUDA 12.0 or later), and cubins of the compiler's CUDA major version (a
    driver of that major version or later; CUDA's minor-version compatibility stops at the major)."""
    try:
        version = driver.driver_version()
    except Exception as exc:  # noqa: BLE001 - any driver failure means the PyTorch path
        return f"the CUDA driver API is unusable: {exc}"
    needed, compiler = 12000, "the launch layer (cuLibraryLoadData)"
    kind = _compiler.choose_compiler()
    if kind is not None:
        cid = _compiler.compiler_id(kind)
        major = re.match(r"\S+ (\d+)\.", cid)
        if major and int(major[1]) * 1000 > needed:
            needed, compiler = int(major[1]) * 1000, f"the kernels' compiler ({cid})"
    if version >= needed:
        return None
    have = f"{version // 1000}.{version % 1000 // 10}"
    advice = "update the NVIDIA driver"
    if version >= 12000:  # (the compiler is what is too new: one of the driver's CUDA version would do)
        advice += f", or use a PyTorch (with its NVRTC) built for CUDA {version // 1000}"
    return f"the CUDA driver supports CUDA {have}, and {compiler} needs {needed // 1000}.0 or later: {advice}"


@cache
def _compiler_problem() -> str | None:
    if _compiler.choose_compiler() is None:
        return "no CUDA compiler was found (NVRTC from PyTorch's CUDA wheels, or nvcc from a CUDA toolkit)"
    return None


def cuda_unavailable_reason(q: torch.Tensor) -> str | None:
    """None when our kernels can run on ``q``'s device and dtype; otherwise why not, in words."""
    if not q.is_cuda:
        return "the tensors are on the CPU"
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernels take float16 or bfloat16, not {q.dtype}"
    return device_unavailable_reason(q.get_device())


def device_unavailable_reason(index: int) -> str | None:
    """None when kernels can be built and launched on GPU ``index`` whatever the dtype (the dtype-free
    kernels', such as the LSE merge's); otherwise why not."""
    return _device_problem(index) or _compiler_problem() or _driver_problem()


def dtype_name(t: torch.Tensor) -> str:
    return KERNEL_DTYPES[t.dtype]


# torch._C._cuda_getCurrentRawStream is what torch.compile's generated code calls for the raw stream handle;
# the public torch.cuda.current_stream(device).cuda_stream builds a Stream object on every call, which cost
# more than the rest of a launch on the host (profile of a training step, docs/kernel-log.md step 23).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """The handle of PyTorch's current stream on device ``index``."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream
