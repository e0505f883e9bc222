"""V for the FP8 forward kernel: transposed, with its keys in the order P's register fragment holds them.

Why a layout of its own (docs/fp8-study.md, A.3): an 8-bit wgmma reads both operands K-major, so O += P V
needs V with the keys contiguous (V^T, head_dim rows), where V arrives with head_dim contiguous. And P, the
register A operand, comes from S's accumulator, in which a thread holds keys 2t, 2t + 1, 8 + 2t and 9 + 2t
of each 16-key half of a 32-key k-step (t = lane % 4), while the 8-bit A fragment gives a thread the four
consecutive positions 4t .. 4t + 3 of that half. Packing each thread's four keys, in that order, into the
register of those four positions costs nothing, if the V^T tile puts at position p of every 16-key group the
key KEY_ORDER_16[p] that P's position p holds: P V sums over the keys, so any order both operands share is
exact. FlashAttention-3 transposes V inside its kernel; this first form does it here, in a kernel of its own
(csrc/include/fa/values_transpose.cuh: one pass over V's bytes, read once and written once) on CUDA tensors
whose layout it takes, and a later forward kernel may take it inside. :func:`transposed_values_reference` is
the same in PyTorch ops (three kernels on a GPU: about 320 us at 16k tokens x 16 heads x 128 on an H200, where
reading and writing the bytes once takes some 15-25 us): the kernel's reference in the tests, and the path of
CPU tensors and of the layouts the kernel leaves out.
"""

from __future__ import annotations

import torch

from ..configs.values_transpose import (
    KEY_GROUP,
    KEY_ORDER_16,
    VALUES_TRANSPOSE_HEAD_DIMS,
    ValuesTransposeConfig,
)
from ..jit.loader import get_values_transpose_kernels
from ..jit.params import ValuesTransposeParams
from .device import device_arch, device_unavailable_reason
from .plans import launch

__all__ = ["KEY_GROUP", "KEY_ORDER_16", "transposed_values", "transposed_values_reference"]

_CONFIG = ValuesTransposeConfig()

#: The grid's y (heads) and z (batch) dimensions' limit.
_GRID_YZ = 65535


def _check_4d(v: torch.Tensor) -> None:
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D (batch, seqlen_k, heads_kv, head_dim); got shape {tuple(v.shape)}")


def _padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // KEY_GROUP) * KEY_GROUP


def transposed_values_reference(v: torch.Tensor) -> torch.Tensor:
    """:func:`transposed_values` in PyTorch ops, for any device, dtype and layout."""
    _check_4d(v)
    b, s, h, d = v.shape
    keys = _padded_keys(s)
    padded = torch.zeros(b, keys, h, d, dtype=v.dtype, device=v.device)
    padded[:, :s] = v
    order = torch.tensor(KEY_ORDER_16, device=v.device)
    grouped = padded.view(b, keys // KEY_GROUP, KEY_GROUP, h, d).index_select(2, order)
    return grouped.view(b, keys, h, d).permute(0, 2, 3, 1).contiguous()


def kernel_takes_layout(v: torch.Tensor) -> bool:
    """Whether the kernel reads ``v`` as laid out (its device aside): 1-byte elements; a head_dim it has an
    entry point for (64, 128, 256), its columns contiguous; a 16-byte aligned address and batch, row and head
    strides of whole 16-byte chunks (a dimension of one element has no stride that matters, and a zero
    stride, as ``expand`` makes, is read as given); heads, batch and keys within the grid and int32."""
    b, s, h, d = v.shape
    return (
        v.element_size() == 1
        and d in VALUES_TRANSPOSE_HEAD_DIMS
        and v.stride(3) == 1
        and all(stride % 16 == 0 or n == 1 for n, stride in zip(v.shape[:3], v.stride()[:3], strict=True))
        and v.data_ptr() % 16 == 0
        and b <= _GRID_YZ
        and h <= _GRID_YZ
        and _padded_keys(s) < 2**31
    )


def _kernel_can_transpose(v: torch.Tensor) -> bool:
    return (
        v.is_cuda
        and v.numel() > 0
        and kernel_takes_layout(v)
        and device_unavailable_reason(v.get_device()) is None
    )


def transposed_values(v: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """V (batch, seqlen_k, heads_kv, head_dim) as the FP8 forward reads it: (batch, heads_kv, head_dim,
    keys) contiguous, keys rounded up to a multiple of 16 with zeros (finite, so a masked key's P of 0 times
    them is 0), each group of 16 in KEY_ORDER_16. Any dtype; the bytes are moved, never converted.

    On a CUDA tensor of a layout the kernel takes (:func:`kernel_takes_layout`) one launch of the
    values-transpose kernel on PyTorch's current stream; otherwise :func:`transposed_values_reference`.
    ``out``, if given, receives the result (contiguous, of the result's shape, v's dtype and device) and is
    returned."""
    _check_4d(v)
    b, s, h, d = v.shape
    keys = _padded_keys(s)
    if out is not None and (
        out.shape != (b, h, d, keys)
        or out.dtype != v.dtype
        or out.device != v.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {v.dtype} tensor of shape {(b, h, d, keys)} on {v.device}; got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if not _kernel_can_transpose(v) or (out is not None and out.data_ptr() % 16):
        result = transposed_values_reference(v)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty((b, h, d, keys), dtype=v.dtype, device=v.device)
    p = ValuesTransposeParams()
    p.v, p.vt = v.data_ptr(), out.data_ptr()
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = v.stride()[:3]
    p.batch, p.seqlen_k, p.heads_kv, p.keys = b, s, h, keys
    index = v.get_device()
    kernel = get_values_transpose_kernels(_CONFIG, device_arch(index))[d]
    launch(kernel, (-(-keys // _CONFIG.keys_per_block), h, b), _CONFIG.threads, _CONFIG.smem_bytes, index, p)
    return out
