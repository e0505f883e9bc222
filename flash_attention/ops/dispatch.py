"""Kernel or fallback: the one decision every entry point shares, and its once-per-reason warning.

A call runs on our CUDA kernels when its tensors are on a CUDA device (:func:`wants_kernel`) and the kernels
can run there (:func:`flash_attention.ops.cuda_unavailable_reason`: the dtype, the GPU's architecture, the
driver, a compiler); otherwise the PyTorch fallback of :mod:`flash_attention.fallback.reference` computes the
same function. A CUDA call that falls back says why, once per distinct reason per process. So does a call that
reaches the launch layer and finds no kernel of ours fits this GPU (:class:`flash_attention.ops.NoKernel`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from .. import ops

__all__ = ["backend", "kernel_backend", "run_or_fallback", "usable_backend", "wants_kernel", "warn_fallback"]

T = TypeVar("T")

# Reasons already reported by the fallback warning; one warning per distinct reason per process.
_warned_reasons: set[str] = set()
_warn_lock = threading.Lock()


def wants_kernel(q: torch.Tensor) -> bool:
    """Whether our CUDA kernels are the intended path for ``q`` (a seam the CPU tests replace)."""
    return q.is_cuda


def backend() -> ModuleType:
    """The launch layer the kernel path calls (a seam the CPU tests replace with a fake)."""
    return ops


def warn_fallback(reason: str, stacklevel: int = 4) -> None:
    """The fallback warning, once per distinct ``reason``."""
    with _warn_lock:
        if reason in _warned_reasons:
            return
        _warned_reasons.add(reason)
    warnings.warn(
        f"flash_attention: using the PyTorch fallback (same results, slower, memory-bounded by chunking) "
        f"because {reason}",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def usable_backend(q: torch.Tensor, *, warn: bool = False) -> ModuleType | None:
    """The launch layer when our kernels should and can compute on ``q``; None for the PyTorch fallback,
    after the once-per-reason warning when ``warn`` and ``q`` is on a CUDA device (a caller whose fallback
    path warns itself passes False)."""
    if not wants_kernel(q):
        return None
    b = backend()
    reason = b.cuda_unavailable_reason(q)
    if reason is None:
        return b
    if warn:
        warn_fallback(reason)
    return None


def kernel_backend(q: torch.Tensor) -> ModuleType | None:
    """:func:`usable_backend` with the warning."""
    return usable_backend(q, warn=True)


def run_or_fallback(kernel: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``kernel()``, or ``fallback()`` (with the warning) when the launch layer finds no kernel that fits."""
    try:
        return kernel()
    except ops.NoKernel as exc:
        warn_fallback(str(exc))
        return fallback()
