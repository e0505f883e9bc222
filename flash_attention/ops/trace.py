"""The debug (trace) build's side of a launch: which warp to trace, its buffer, and the last trace taken.

``FLASH_ATTENTION_TRACE=batch,head,row_block,warp`` (or ``trace=`` of
:func:`flash_attention.ops.cuda_forward`) runs the forward's debug build instead of the normal one
(csrc/include/fa/trace.cuh); the traced warp writes its intermediates into a buffer kept here, which
``python -m flash_attention debug`` decodes and compares with the tile simulator. Debugging only: it
synchronizes and allocates.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from ..configs import KernelConfig
from ..jit.params import TRACE_FAULTS, TraceLayout

__all__ = ["TraceTarget", "last_trace", "record", "trace_buffer", "trace_from_env"]

ENV = "FLASH_ATTENTION_TRACE"


class TraceTarget(NamedTuple):
    """Which warp the debug build traces (flash_attention.tools.sim.TraceSpec has the same fields)."""

    batch: int
    head: int
    row_block: int
    warp: int


#: The raw trace of the last traced launch (flash_attention.tools.debug decodes it), or None.
_last_trace: dict | None = None


def last_trace() -> dict | None:
    """The last traced launch: its device buffer and everything needed to decode it (tools/debug.py)."""
    return _last_trace


def record(trace: dict) -> None:
    global _last_trace
    _last_trace = trace


def trace_from_env() -> tuple[TraceTarget, str] | None:
    """``FLASH_ATTENTION_TRACE=batch,head,row_block,warp`` (and ``FLASH_ATTENTION_TRACE_FAULT``), parsed."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        target = TraceTarget(*(int(x) for x in text.split(",")))
    except (TypeError, ValueError):
        raise ValueError(
            f"FLASH_ATTENTION_TRACE must be 'batch,head,row_block,warp' (four integers); got {text!r}"
        ) from None
    return target, os.environ.get("FLASH_ATTENTION_TRACE_FAULT", "none")


def trace_buffer(cfg: KernelConfig, target, fault: str, shape: tuple, device) -> tuple[torch.Tensor, int]:
    """A NaN-filled trace buffer for the debug build (unwritten entries stay NaN), and the fault's code."""
    batch, heads_q, seqlen_q, seqlen_k = shape
    checks = [
        ("batch", target.batch, batch),
        ("head", target.head, heads_q),
        ("row_block", target.row_block, math.ceil(seqlen_q / cfg.block_q)),
        ("warp", target.warp, cfg.compute_warps),
    ]
    for name, value, limit in checks:
        if not 0 <= value < limit:
            raise ValueError(f"trace {name} must be in [0, {limit}) for this problem and config; got {value}")
    if fault not in TRACE_FAULTS:
        raise ValueError(f"trace fault must be one of {sorted(TRACE_FAULTS)}; got {fault!r}")
    steps = max(1, math.ceil(seqlen_k / cfg.block_kv))
    buf = torch.full((TraceLayout.of(cfg).size(steps),), float("nan"), dtype=torch.float32, device=device)
    return buf, TRACE_FAULTS[fault]
