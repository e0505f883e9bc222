"""Attention dropout's random numbers, shared by the CUDA kernels and the PyTorch paths.

The kernels decide keep/drop for element (batch, head, query i, key j) with a counter-based hash
(``csrc/include/fa/dropout.cuh``): nothing is stored between the forward and the backward, and every
kernel regenerates the same decision in its own register layout. Keys j and j + 8 (bit 3 of j clear) share
one hash, 16 bits each: the kernels hold both in one thread and draw one finaliser for the two.
:func:`keep_mask` is the same function in PyTorch (uint32 arithmetic emulated in int64): the CPU fallback
uses it, so a seeded call drops the same elements on every device, and the tests compare the kernels
against it bit for bit.

A call's ``(seed, offset)`` pair travels as a small CPU tensor (:func:`draw_seed`) from the forward to the
backward, which regenerates the forward's decisions from it.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_DROPOUT_P",
    "draw_seed",
    "dropout_key",
    "dropout_threshold",
    "keep_elements",
    "keep_mask",
    "seed_pair",
]

#: The largest dropout_p a call takes. The kernels resolve p in steps of 2^-16 (a 16-bit half of a hash per
#: element), so a p above 1 - 2^-16 would round to dropping everything (its threshold is then kept below that,
#: at 2^-16 of the elements kept, more than 1 - p, while the kept ones are scaled by 1 / (1 - p)). And fp16
#: holds at most 65504: a kept probability near 1 scaled by 1 / (1 - p) = 2^16 packs to inf for P V (the
#: forward) and dV (the backward), so the bound is one step lower, 1 / (1 - p) <= 2^15.
MAX_DROPOUT_P = 1.0 - 2.0**-15

_M32 = 0xFFFFFFFF
_C0, _C1, _C2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def _mix(x):
    # uint32 values in a Python int or an int64 tensor (whose products wrap modulo 2^64 and keep their low
    # 32 bits right).
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def dropout_key(seed: int, offset: int) -> int:
    """The per-call 32-bit key the kernels hash with (``FwdParams::dropout_key``)."""
    s = seed & ((1 << 64) - 1)
    o = offset & ((1 << 64) - 1)
    k = _mix((s & _M32) ^ _mix(s >> 32))
    return _mix(k ^ _mix((o & _M32) ^ _C0) ^ _mix(o >> 32))


def dropout_threshold(p: float) -> int:
    """The kernels' 32-bit threshold: an element whose 16-bit half of its pair's hash, moved to the top 16
    bits, is below this is dropped: ``round(p * 2^16) * 2^16`` (``p`` in [0, 1); at most (2^16 - 1) 2^16)."""
    return min(int(round(p * 2.0**16)), 0xFFFF) << 16


def keep_mask(
    seed: int, offset: int, p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device=None
) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) bool, True where the kernels keep the element."""
    bh = torch.arange(batch * heads, device=device, dtype=torch.int64).view(batch, heads, 1, 1)
    i = torch.arange(seqlen_q, device=device, dtype=torch.int64).view(1, 1, seqlen_q, 1)
    j = torch.arange(seqlen_k, device=device, dtype=torch.int64).view(1, 1, 1, seqlen_k)
    return keep_elements(dropout_key(seed, offset), dropout_threshold(p), bh, i, j)


def draw_seed(seed: int | None = None) -> torch.Tensor:
    """A call's (seed, offset) as a 2-element int64 CPU tensor: the caller's seed with offset 0, or two
    draws from PyTorch's default CPU generator (so ``torch.manual_seed`` makes runs reproducible; a CPU
    tensor keeps it free of GPU synchronisation and traceable by ``torch.compile``)."""
    if seed is not None:
        return torch.tensor([int(seed), 0], dtype=torch.int64)
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def keep_elements(
    key: int, threshold: int, bh: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    """The kernels' keep decision for broadcastable int64 index tensors ``bh`` (batch * heads_q + head),
    ``i`` (query row) and ``j`` (key): the hash of j's pair (j with bit 3 clear), its low 16 bits for that
    key and its high 16 for the key 8 after it."""
    head_hash = _mix(key ^ ((bh * _C0) & _M32))
    row_hash = _mix(head_hash ^ ((i * _C1) & _M32))
    upper = (j & 8) != 0
    pair = _mix(row_hash ^ (((j - (j & 8)) * _C2) & _M32))
    return torch.where(upper, pair, (pair << 16) & _M32) >= threshold


def seed_pair(dropout_seed) -> tuple[int, int]:
    """(seed, offset) from a :func:`draw_seed` tensor (or any 2-sequence)."""
    seed, offset = (
        int(x) for x in (dropout_seed.tolist() if torch.is_tensor(dropout_seed) else dropout_seed)
    )
    return seed, offset
