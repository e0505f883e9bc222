"""V for the FP8 forward kernel: transposed, with its keys in the order P's register fragment holds them.

Why a layout of its own (docs/fp8-study.md, A.3): an 8-bit wgmma reads both operands K-major, so O += P V
needs V with the keys contiguous (V^T, head_dim rows), where V arrives with head_dim contiguous. And P, the
register A operand, comes from S's accumulator, in which a thread holds keys 2t, 2t + 1, 8 + 2t and 9 + 2t
of each 16-key half of a 32-key k-step (t = lane % 4), while the 8-bit A fragment gives a thread the four
consecutive positions 4t .. 4t + 3 of that half. Packing each thread's four keys, in that order, into the
register of those four positions costs nothing, if the V^T tile puts at position p of every 16-key group the
key KEY_ORDER_16[p] that P's position p holds: P V sums over the keys, so any order both operands share is
exact. FlashAttention-3 transposes V inside its kernel; this first form does it here, one pass over V's bytes
(1 byte an element, a few percent of the forward's time at 4k tokens), and a later kernel may take it
inside.
"""

from __future__ import annotations

import torch

from ..configs.values_transpose import KEY_GROUP, KEY_ORDER_16

__all__ = ["KEY_GROUP", "KEY_ORDER_16", "transposed_values"]


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """V (batch, seqlen_k, heads_kv, head_dim) as the FP8 forward reads it: (batch, heads_kv, head_dim,
    keys) contiguous, keys rounded up to a multiple of 16 with zeros (finite, so a masked key's P of 0 times
    them is 0), each group of 16 in KEY_ORDER_16. Any dtype; the bytes are moved, never converted."""
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D (batch, seqlen_k, heads_kv, head_dim); got shape {tuple(v.shape)}")
    b, s, h, d = v.shape
    keys = -(-s // KEY_GROUP) * KEY_GROUP
    padded = torch.zeros(b, keys, h, d, dtype=v.dtype, device=v.device)
    padded[:, :s] = v
    order = torch.tensor(KEY_ORDER_16, device=v.device)
    grouped = padded.view(b, keys // KEY_GROUP, KEY_GROUP, h, d).index_select(2, order)
    return grouped.view(b, keys, h, d).permute(0, 2, 3, 1).contiguous()
