"""FlashAttention-4 (PyPI ``flash-attn-4``, ``from flash_attn.cute import ...``) as a bench baseline, ``fa4``.

The strongest open peer on Hopper: its forward and backward kernels are JIT-compiled by NVIDIA's CuTe DSL on
the first call of each shape. Where it is not importable (a machine without it, a CPU) its rows are skipped
with the reason, like any other implementation that cannot run a point. Its calls take our layout, (batch,
seqlen, heads, head_dim), and grouped K/V heads as they are, so nothing is copied around them.

What it has, by our bench's variants: causal, a sliding window (``window_size=(left, right)``), attention
sinks (``learnable_sink=``, one logit per query head), grouped-query heads, packed documents
(``flash_attn_varlen_func``), and each of our score functions (spec.score_functions) whose name its call takes
as a keyword (read from its signature, so a release that adds one is timed without an edit here). It has no
ALiBi: those rows are skipped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .skip import Skip

__all__ = ["FA4", "fa4_dense", "fa4_varlen"]

FA4 = "fa4"


def _module() -> Any:
    """flash_attn.cute, or raise the bench's Skip with the reason."""
    try:
        import flash_attn.cute as cute
    except Exception as exc:  # ImportError, or a broken install failing inside its import
        raise Skip(
            f"FlashAttention-4 is not importable ({type(exc).__name__}: {exc}); pip install flash-attn-4"
        ) from exc
    return cute


def _first(result: Any) -> Any:
    """The output of a call that returns it alone or as ``(out, lse)``, by version."""
    return result[0] if isinstance(result, tuple) else result


def _keywords(func: Callable) -> frozenset[str]:
    """The optional keyword parameters FlashAttention-4's call names (none where its signature cannot be
    read): a name it only takes through ``**kwargs`` is not one it is known to have."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in keyword and p.default is not p.empty)


def _variant_kwargs(
    func: Callable,
    *,
    causal: bool,
    window: int,
    score: tuple[tuple[str, float], ...],
    sinks: Any,
    alibi: bool,
) -> dict:
    if alibi:
        raise Skip("FlashAttention-4 has no ALiBi")
    # Our score functions by the keyword of the same name (the one they share: its cap is ours, applied to
    # the scaled score); one its call does not take is a variant it lacks.
    missing = [name for name, _ in score if name not in _keywords(func)]
    if missing:
        raise Skip(f"FlashAttention-4 has no {', '.join(missing)}")
    kwargs: dict = {"causal": causal}
    if window:
        # The bench's window is causal: each query sees itself and the `window` keys before it.
        kwargs["window_size"] = (window, 0)
    kwargs.update(score)
    if sinks is not None:
        kwargs["learnable_sink"] = sinks
    return kwargs


def fa4_dense(
    *,
    causal: bool,
    window: int = 0,
    score: tuple[tuple[str, float], ...] = (),
    sinks: Any = None,
    alibi: bool = False,
) -> Callable[[Any, Any, Any], Any]:
    """``f(q, k, v) -> out`` through ``flash_attn_func`` on (batch, seqlen, heads, head_dim) tensors, with the
    variant's arguments (``score``: our score functions' (name, value) pairs); raises Skip where
    FlashAttention-4 is missing or lacks the variant."""
    func = _module().flash_attn_func
    kwargs = _variant_kwargs(func, causal=causal, window=window, score=score, sinks=sinks, alibi=alibi)
    return lambda q, k, v: _first(func(q, k, v, **kwargs))


def fa4_varlen(
    cu_seqlens: Any, max_seqlen: int, *, causal: bool, alibi: bool = False
) -> Callable[[Any, Any, Any], Any]:
    """``f(q, k, v) -> out`` through ``flash_attn_varlen_func`` on packed (total, heads, head_dim) tensors of
    self-attention documents (the same offsets for queries and keys)."""
    func = _module().flash_attn_varlen_func
    kwargs = _variant_kwargs(func, causal=causal, window=0, score=(), sinks=None, alibi=alibi)
    return lambda q, k, v: _first(
        func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            **kwargs,
        )
    )
