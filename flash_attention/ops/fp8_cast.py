"""attention(fp8=True)'s casts on the GPU: spec.fp8's quantize and dequantize as kernels
(csrc/include/fa/fp8_cast.cuh), the same bytes.

spec.fp8's PyTorch forms are the contract, and the path of whatever the kernels leave out (CPU tensors,
GPUs without e4m3 conversions, layouts without 8-element alignment, a descale that takes a gradient). On a
GPU those forms are about ten elementwise kernels and reductions a tensor, with a PyTorch dispatch each,
which cost a training step more than its e4m3 forward saved (kernel log 169 has the profile). Here
quantizing a tensor is one host call and two launches (an amax pass and a converting pass, 5 bytes an
element for bf16 against about 15) after a memset of its amax words, dequantizing one launch (3 bytes an
element against 7).
"""

from __future__ import annotations

import torch

from ..configs.fp8_cast import FP8_CAST_SOURCES, Fp8CastConfig
from ..jit.loader import get_fp8_cast_kernels
from ..jit.params import Fp8CastParams
from ..spec import fp8 as _fp8
from .device import current_stream, device_arch, device_unavailable_reason
from .plans import Launch, launch_all

__all__ = ["dequantize", "kernel_takes", "kernel_takes_layout", "quantize"]

_CONFIG = Fp8CastConfig()

#: The grid's y (heads) and z (batch) dimensions' limit.
_GRID_YZ = 65535

#: The quantizer's source dtypes, by their entry points' names.
_SOURCE_NAMES = dict(zip((torch.bfloat16, torch.float16, torch.float32), FP8_CAST_SOURCES, strict=True))

#: The element types the kernels read: the quantizer's sources and e4m3 (the dequantizer's).
_READS = (*_SOURCE_NAMES, _fp8.E4M3)


def _has_e4m3_conversions(index: int) -> bool:
    # cvt to and from e4m3 (PTX ISA 9.7.9.21) needs sm_89 or later.
    return int(device_arch(index)[3:]) >= 89


def kernel_takes_layout(t: torch.Tensor) -> bool:
    """Whether the cast kernels read ``t`` as laid out (its device aside): a non-empty 4-D (batch, seqlen,
    heads, head_dim) tensor of a dtype they read (bf16, fp16 or float32 to quantize, e4m3 to dequantize);
    head_dim a multiple of 8 with its columns contiguous, the other strides multiples of 8 elements (a
    dimension of one aside) and the address 16-byte aligned, so that a thread's eight elements are one
    aligned load; batch and heads within the grid."""
    if not (t.dim() == 4 and t.dtype in _READS and t.numel() > 0):
        return False
    b, _, h, d = t.shape
    return (
        d % 8 == 0
        and t.stride(3) == 1
        and all(stride % 8 == 0 or n == 1 for n, stride in zip(t.shape[:3], t.stride()[:3], strict=True))
        and t.data_ptr() % 16 == 0
        and b <= _GRID_YZ
        and h <= _GRID_YZ
    )


def kernel_takes(t: torch.Tensor) -> bool:
    """Whether the cast kernels take ``t``: a CUDA tensor of a layout they read (:func:`kernel_takes_layout`)
    on a GPU that the kernels can run on and that has e4m3 conversions (sm_89 and later). Never while
    torch.compile traces: its fake tensors have no data pointer, and spec.fp8's forms trace as PyTorch ops
    (as the FP8 forward kernel leaves such calls to them, ops.fp8_forward.kernel_takes)."""
    if torch.compiler.is_compiling() or not (t.is_cuda and kernel_takes_layout(t)):
        return False
    index = t.get_device()
    return device_unavailable_reason(index) is None and _has_e4m3_conversions(index)


def _params(src: torch.Tensor, dst: torch.Tensor, heads_kv: int) -> Fp8CastParams:
    b, n, h, d = src.shape
    p = Fp8CastParams()
    p.src, p.dst = src.data_ptr(), dst.data_ptr()
    p.src_batch_stride, p.src_row_stride, p.src_head_stride = src.stride()[:3]
    p.batch, p.seqlen, p.heads, p.heads_kv, p.head_dim = b, n, h, heads_kv, d
    p.rows_per_block = _CONFIG.rows_per_block(d)
    return p


def _grid(p: Fp8CastParams) -> tuple[int, int, int]:
    return (-(-p.seqlen // p.rows_per_block), p.heads, p.batch)


def quantize(t: torch.Tensor, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.fp8.quantize: e4m3 ``t`` (contiguous) and its float32 descale per (batch, kv head), shape
    (batch, heads_kv). On a tensor the kernels take (:func:`kernel_takes`), the amax and converting passes
    on PyTorch's current stream; otherwise spec.fp8.quantize itself."""
    if t.dtype not in _SOURCE_NAMES or not kernel_takes(t) or t.shape[2] % heads_kv:
        return _fp8.quantize(t, heads_kv)
    b, n, h, d = t.shape
    q8 = torch.empty((b, n, h, d), dtype=_fp8.E4M3, device=t.device)
    descale = torch.empty((b, heads_kv), dtype=torch.float32, device=t.device)
    amax = torch.zeros((b, heads_kv), dtype=torch.int32, device=t.device)  # (the amax pass raises them)
    p = _params(t, q8, heads_kv)
    p.amax, p.descale = amax.data_ptr(), descale.data_ptr()
    index = t.get_device()
    kernels = get_fp8_cast_kernels(_CONFIG, device_arch(index))
    source = _SOURCE_NAMES[t.dtype]
    grid = _grid(p)
    launch_all(
        (
            Launch(kernels[f"amax_{source}"], grid, _CONFIG.threads, 0),
            Launch(kernels[f"quantize_{source}"], grid, _CONFIG.threads, 0),
        ),
        index,
        p,
        current_stream(index),
    )
    return q8, descale


def _descale_takes(descale: torch.Tensor | None, t: torch.Tensor, heads_kv: int) -> bool:
    # The kernel reads one float32 or a contiguous (batch, heads_kv) of them on t's device, and gives a
    # descale no gradient.
    if descale is None:
        return True
    return (
        descale.dtype == torch.float32
        and descale.device == t.device
        and (descale.numel() == 1 or (descale.shape == (t.shape[0], heads_kv) and descale.is_contiguous()))
        and not (descale.requires_grad and torch.is_grad_enabled())
    )


def dequantize(
    t: torch.Tensor, descale: torch.Tensor | None, heads_kv: int, *, powers_of_two: bool = False
) -> torch.Tensor:
    """spec.fp8.dequantize of a 4-D e4m3 tensor: ``float(t) * descale`` as bfloat16 (contiguous). On a
    tensor and descale the kernel takes, one launch on PyTorch's current stream, which takes the float32
    product with either ``powers_of_two`` (the caller's word that the descales are powers of two, for which
    spec.fp8's bf16 product is the same value); otherwise spec.fp8.dequantize itself."""
    if not (t.dtype is _fp8.E4M3 and kernel_takes(t) and _descale_takes(descale, t, heads_kv)):
        return _fp8.dequantize(t, descale, heads_kv, powers_of_two=powers_of_two)
    if t.shape[2] % heads_kv:
        raise ValueError(f"t's {t.shape[2]} heads must be a multiple of heads_kv {heads_kv}")
    out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device)
    p = _params(t, out, heads_kv)
    if descale is not None:
        p.descale = descale.data_ptr()
        p.descale_per_head = int(descale.numel() != 1)
    index = t.get_device()
    kernel = get_fp8_cast_kernels(_CONFIG, device_arch(index))["dequantize"]
    launch_all((Launch(kernel, _grid(p), _CONFIG.threads, 0),), index, p, current_stream(index))
    return out
