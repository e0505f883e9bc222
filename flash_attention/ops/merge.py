"""The LSE merge launch: two partial attentions of the same rows over disjoint keys, merged in place.

``lse_merge_`` updates a running fp32 result (out, lse) with a part (part_out, part_lse) in one pass of the
merge kernel (csrc/include/fa/lse_merge.cuh); :func:`lse_merge_reference` is the same in PyTorch ops, what
the kernel replaces and what runs where it cannot (CPU tensors, a head_dim that is not a multiple of 4).
"""

from __future__ import annotations

import torch

from ..configs.merge import MergeConfig
from ..jit.loader import get_merge_kernels
from ..jit.params import LseMergeParams
from .device import device_arch, device_unavailable_reason
from .plans import launch

__all__ = ["lse_merge_", "lse_merge_reference"]

_CONFIG = MergeConfig()
_PART_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def lse_merge_reference(out, lse, part_out, part_lse) -> None:
    """The merge in PyTorch ops, in place on ``out`` (b, n, h, d) and ``lse`` (b, h, n), both fp32: a part's
    row whose keys were all masked has LSE -inf and weighs 0; a row with no key on either side stays."""
    new_lse = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(part_out, w_new)  # (the fused multiply-add promotes the part: no temporary)
    lse.copy_(new_lse)


def _kernel_can_merge(out, lse, part_out, part_lse) -> bool:
    tensors = (out, lse, part_out, part_lse)
    if out.device.type != "cuda" or device_unavailable_reason(out.get_device()):
        return False
    if any(t.device != out.device for t in tensors) or part_out.dtype not in _PART_DTYPES:
        return False
    d = out.shape[-1]
    # float4 / 8-byte vectors of 4 columns: contiguous columns, head_dim and every stride a multiple of 4,
    # 16- and 8-byte aligned bases; the LSE rows contiguous.
    return (
        d % 4 == 0
        and d <= 4 * _CONFIG.threads
        and all(t.stride(-1) == 1 for t in tensors)
        and all(s % 4 == 0 for t in (out, part_out) for s in t.stride()[:3])
        and out.data_ptr() % 16 == 0
        and part_out.data_ptr() % (4 * part_out.element_size()) == 0
    )


def lse_merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out, lse <- the merge of the running result with the part (in place; see the module docstring).

    ``out``: fp32 (batch, rows, heads, head_dim); ``lse``: fp32 (batch, heads, rows); ``part_out``: the same
    shape as ``out`` in fp32, fp16 or bf16; ``part_lse``: the same shape as ``lse``. Views are fine (any
    strides but contiguous columns and rows of the LSE)."""
    if out.dtype != torch.float32 or lse.dtype != torch.float32 or part_lse.dtype != torch.float32:
        dtypes = f"{out.dtype}, {lse.dtype}, {part_lse.dtype}"
        raise TypeError(f"out, lse and part_lse must be float32; got {dtypes}")
    if part_out.shape != out.shape:
        raise ValueError(f"part_out must have out's shape {tuple(out.shape)}; got {tuple(part_out.shape)}")
    b, n, h, d = out.shape
    if lse.shape != (b, h, n) or part_lse.shape != (b, h, n):
        raise ValueError(
            f"lse and part_lse must be (batch, heads, rows) = {(b, h, n)}; got {tuple(lse.shape)}, "
            f"{tuple(part_lse.shape)}"
        )
    if out.numel() == 0:
        lse.copy_(torch.logaddexp(lse, part_lse))
        return
    if not _kernel_can_merge(out, lse, part_out, part_lse):
        lse_merge_reference(out, lse, part_out, part_lse)
        return
    p = LseMergeParams()
    p.out, p.lse, p.part, p.part_lse = (t.data_ptr() for t in (out, lse, part_out, part_lse))
    p.out_batch_stride, p.out_row_stride, p.out_head_stride = out.stride()[:3]
    p.lse_batch_stride, p.lse_head_stride = lse.stride()[:2]
    p.part_batch_stride, p.part_row_stride, p.part_head_stride = part_out.stride()[:3]
    p.part_lse_batch_stride, p.part_lse_head_stride = part_lse.stride()[:2]
    p.batch, p.rows, p.heads, p.head_dim = b, n, h, d
    index = out.get_device()
    kernel = get_merge_kernels(_CONFIG, device_arch(index))[_PART_DTYPES[part_out.dtype]]
    rows_per_block = _CONFIG.threads // (d // 4)
    launch(kernel, (-(-b * n * h // rows_per_block), 1, 1), _CONFIG.threads, 0, index, p)
