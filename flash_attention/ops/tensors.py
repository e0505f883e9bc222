"""Tensors as the kernels read them: 16-byte aligned rows with a contiguous last dimension, head_dim a
multiple of 8, grid dimensions in range. Helpers shared by the forward and backward launches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "MAX_GRID_YZ",
    "aligned_copy",
    "check_grid",
    "kernel_ready",
    "pad_head_dim",
    "padded_to_8",
    "strides_usable",
    "usable_in_place",
]

#: The largest y and z dimensions of a CUDA grid (heads and batch ride on them).
MAX_GRID_YZ = 65535


def strides_usable(t: torch.Tensor) -> bool:
    """The stride half of :func:`usable_in_place`: the last dimension contiguous, every row/head/batch step a
    multiple of 8 elements (16 bytes). For a caller that checks the address separately (a plan kept across
    calls whose tensors may sit at other addresses)."""
    s = t.stride()
    return s[3] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and s[2] % 8 == 0 and max(s[0], s[1], s[2]) < 2**62


def usable_in_place(t: torch.Tensor) -> bool:
    """Whether the kernels can read or write ``t`` as it is: cp.async and the vector stores move 16 bytes,
    so the base and every row/head/batch start must be 16-byte aligned (strides multiples of 8 elements),
    and the last dimension contiguous."""
    return t.data_ptr() % 16 == 0 and strides_usable(t)


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy at a fresh (allocator-aligned) address. Not ``t.contiguous()``: that returns a
    contiguous view itself, whatever its address (``base[1:].view(shape)`` is contiguous and 2 bytes off)."""
    return t.clone(memory_format=torch.contiguous_format)


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel can read it in place, else an aligned contiguous copy (correct, one extra
    pass)."""
    return t if usable_in_place(t) else aligned_copy(t)


def padded_to_8(head_dim: int) -> int:
    return -(-head_dim // 8) * 8


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``t`` with its last dimension zero-padded to ``head_dim`` (a new contiguous tensor). Zero columns add
    nothing to Q K^T, and the output columns they produce from V are dropped again."""
    return F.pad(t, (0, head_dim - t.shape[-1]))


def check_grid(batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """Raise ValueError for problems outside what one launch can index."""
    if heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"batch and heads must be at most {MAX_GRID_YZ}; got batch={batch}, heads={heads}")
    if seqlen_q >= 2**31 or seqlen_k >= 2**31:
        raise ValueError("sequence lengths must be below 2**31")
