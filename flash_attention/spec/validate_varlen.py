"""Argument checks of :func:`flash_attention.attention_varlen`'s offsets: their shapes and dtypes, on the host
for free, and their values, with tensor ops wherever the offsets live.

The values (``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``) are the caller's promise: offsets that break
it give wrong rows, never out-of-bounds accesses (the kernels clamp what they read). On the CPU reading them
costs nothing, so there they are checked whenever runs are built from them (attention_varlen caches the
runs by the offsets tensors' address and version: offsets it has seen pass again for free). On a GPU a read
is a synchronisation, which a CUDA graph cannot capture and ``torch.compile`` would break its graph on, so
there the values are checked only on request (:data:`ENV`), and never while a graph is captured or traced.
Both cases run the same function, :func:`check_offset_values`: tensor ops on the offsets' device whose
verdict is read back once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["ENV", "check_offset_values", "check_offsets_tensor", "checks_offset_values", "reads_are_free"]

#: Set to 1 to check the offsets' values on a GPU too (one synchronisation per new offsets tensor).
ENV = "FLASH_ATTENTION_CHECK_OFFSETS"


def check_offsets_tensor(name: str, t: object, device: torch.device, meaning: str) -> int:
    """The length of a 1-D int32 (or int64) tensor on ``device``, or an error naming it and its ``meaning``.
    (Not converted here: the runs read either, and a converted copy would be a new tensor at every call,
    missing the runs' cache.)"""
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor ({meaning})")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 (or int64); got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {t.device}")
    return t.numel()


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor on ``device`` on the host costs no synchronisation (a seam the CPU tests
    replace to take a GPU's path)."""
    return device.type == "cpu"


def checks_offset_values(device: torch.device, capturing: bool) -> bool:
    """Whether a call with offsets on ``device`` checks their values: where reading them is free always,
    elsewhere only with ``FLASH_ATTENTION_CHECK_OFFSETS=1``; never while torch.compile traces (the values are
    not known) or a CUDA graph is ``capturing`` (the read would fail the capture)."""
    if torch.compiler.is_compiling() or capturing or device.type == "meta":
        return False
    return reads_are_free(device) or os.environ.get(ENV, "") not in ("", "0")


# A rule: a 1-D bool tensor (True where the rule is broken) and the message for its first True's index.
_Rule = tuple[torch.Tensor, Callable[[int], str]]


def _offset_rules(name: str, cu: torch.Tensor, total: int, tensor: str, unit: str) -> list[_Rule]:
    """Offsets (int64) of ``total`` packed tokens: from 0, non-decreasing, none past the tensor. (The last may
    stop short of it: the rows after it attend nothing, the keys after it are attended by none.)"""
    return [
        (cu[:1] != 0, lambda i: f"{name} must start at 0; got {name}[0] = {int(cu[0])}"),
        (
            cu[1:] < cu[:-1],
            lambda i: (
                f"{name} must be non-decreasing; {name}[{i + 1}] = {int(cu[i + 1])} < {name}[{i}] = "
                f"{int(cu[i])}"
            ),
        ),
        (
            cu > total,
            lambda i: (
                f"{name}[{i}] = {int(cu[i])} is past the end of {tensor} ({tensor}.shape[0] = {total} {unit})"
            ),
        ),
    ]


def _used_rules(used: torch.Tensor, cu_k: torch.Tensor) -> list[_Rule]:
    """seqused_k (int64): each sequence's keys in use, from 0 to its own key count."""
    keys = cu_k[1:] - cu_k[:-1]
    return [
        (used < 0, lambda b: f"seqused_k[{b}] = {int(used[b])} must be >= 0"),
        (
            used > keys,
            lambda b: (
                f"seqused_k[{b}] = {int(used[b])} exceeds sequence {b}'s {int(keys[b])} keys "
                f"(cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}])"
            ),
        ),
    ]


def check_offset_values(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    seqused_k: torch.Tensor | None = None,
) -> None:
    """Raise ValueError naming the argument and its first bad index unless the offsets keep attention_varlen's
    contract: ``cu_seqlens_q`` and ``cu_seqlens_k`` start at 0, never decrease and never pass ``total_q`` /
    ``total_k`` tokens; ``seqused_k[b]`` is within [0, cu_seqlens_k[b+1] - cu_seqlens_k[b]]. Shapes and
    dtypes already checked (:func:`check_offsets_tensor`).

    Every rule is evaluated with tensor ops on the offsets' device, and the first broken one's index is read
    back: one host read (on a GPU, one synchronisation), and a few more to word an error."""
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
    rules = _offset_rules("cu_seqlens_q", cu_q, total_q, "q", "rows")
    rules += _offset_rules("cu_seqlens_k", cu_k, total_k, "k", "keys")
    if seqused_k is not None:
        rules += _used_rules(seqused_k.to(torch.int64), cu_k)
    # The rules' verdicts end to end: the first True is the first broken rule's first bad index. (Never
    # empty: cu_seqlens_q's first rule has one entry.)
    bad = torch.cat([broken for broken, _ in rules])
    first = int(torch.where(bad, torch.arange(bad.numel(), device=bad.device), bad.numel()).amin())
    for broken, message in rules:
        if first < broken.numel():
            raise ValueError(message(first))
        first -= broken.numel()
