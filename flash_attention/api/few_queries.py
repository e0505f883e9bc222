"""``attention()`` calls with a few queries per row against many keys, on the split-KV decode kernels.

A forward kernel tiles the queries by 64-192 rows and walks the keys in one block per query tile: a call
with one query per row (a decoding loop written against ``attention()``, a chunk of a speculative draft, a
cache the caller manages) fills one row of each tile and runs ``batch x heads`` blocks over every key, where
the decode kernels pack a key/value head's query rows (seqlen_q x group) into one tile and split the keys
over the multiprocessors (configs.decode). Measured on an H200 before this route (issue 49):
``attention()`` took 1.7-10x cuDNN's time on such calls while ``attention_with_kvcache`` on the same tensors
was level with it. So these calls run as ``attention_with_kvcache`` would with k and v as a contiguous cache
of ``seqlen_k`` keys, nothing appended, every row's length ``seqlen_k`` passed by value (no tensor, no host
read): the same semantics, bottom-right causal alignment, windows, soft-capping, ALiBi and the LSE; sinks
join afterwards as that API joins them (flash_attention.sinks). Calls autograd records, key ranges, dropout,
packed batches and torch.compile's traces keep their usual path (the backward needs nothing of this route:
it runs from the output and LSE either way).
"""

from __future__ import annotations

import torch

from ..ops import dispatch
from ..sinks import apply_sinks
from ..spec.validate_kvcache import validate_kvcache

__all__ = ["MAX_ROWS", "MIN_KEYS", "RoutedCall", "route", "takes_shape"]

#: The most packed query rows (seqlen_q x group) the route takes: one decode tile of 64 rows per key/value
#: head, as the transformers integration sends its decoding steps (STATIC_CACHE_MAX_QUERIES).
MAX_ROWS = 64
#: The fewest keys the route takes: under a key tile or two the forward kernel has nothing to split.
MIN_KEYS = 256


class RoutedCall:
    """A routed signature's repeat call (ops.repeat's protocol: ``call(q, k, v, key_range, alibi_slopes,
    sinks, segments)`` -> ``(out, lse)`` or None for the whole path): the decode plan it was made with,
    launched on this call's tensors."""

    __slots__ = ("plan", "seqlen_k", "return_lse")

    def __init__(self, plan, seqlen_k: int, return_lse: bool):
        self.plan, self.seqlen_k, self.return_lse = plan, seqlen_k, return_lse

    def __call__(self, q, k, v, key_range=None, alibi_slopes=None, sinks=None, segments=None):
        return self.run(q, k, v, alibi_slopes, sinks, None)

    def run(self, q, k, v, alibi_slopes, sinks, out):
        """``(out, lse)`` of the call (``lse`` None unless asked for), or None when this call's k or v does
        not start 16-byte aligned (the usual path copies what it must)."""
        if not self.plan.runnable(k, v):
            return None
        o, lse = self.plan(q, k, v, None, None, self.seqlen_k, None, out, alibi_slopes)
        if sinks is not None:
            o, lse = apply_sinks(o, lse, sinks)
            if out is not None and o is not out:
                out.copy_(o)
                o = out
        return o, (lse if self.return_lse else None)


def takes_shape(batch: int, seqlen_q: int, heads_q: int, seqlen_k: int, heads_kv: int) -> bool:
    """Whether a call of this shape is one the route takes (on a GPU whose kernels it runs, with nothing
    else keeping it on its usual path): a few packed query rows per key/value head against many keys. Its
    output then comes from the decode kernels, equal to the usual path's within rounding, not bitwise."""
    return (
        0 < seqlen_q <= seqlen_k
        and seqlen_q * (heads_q // max(heads_kv, 1)) <= MAX_ROWS
        and seqlen_k >= MIN_KEYS
        and batch > 0
        and heads_q > 0
    )


def route(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    return_lse: bool,
    out: torch.Tensor | None,
    window: tuple[int, int] | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    key: tuple | None,
) -> RoutedCall | None:
    """The decode kernels' call for a validated ``attention()`` call that is not recorded and has no key
    range, dropout or packed batch (the caller checks those), or None when the call keeps its usual path:
    too many query rows, too few keys, layouts or a GPU the decode kernels cannot take. ``key``: the call's
    repeat signature (the decode plan is kept under it), or None."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    if (
        not takes_shape(batch, seqlen_q, heads_q, seqlen_k, k.shape[2])
        or not dispatch.wants_kernel(q)
        or torch.compiler.is_compiling()
    ):
        return None
    if (k.data_ptr() | v.data_ptr()) % 16:
        return None  # (the decode kernels read the cache in place, 16 bytes at a time; the usual path copies)
    if window is not None:
        # A side past every key bounds nothing: clipped as the forward's window_bounds clips it, so that a
        # huge side cannot wrap the decode params' 32-bit fields.
        far = seqlen_q + seqlen_k
        window = tuple(w if w < 0 else min(w, far) for w in window)
    try:
        problem = validate_kvcache(
            q, k, v, None, None, cache_seqlens=seqlen_k, block_table=None, causal=causal, softmax_scale=scale,
            num_splits=0, out=out, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        )  # fmt: skip
    except (TypeError, ValueError):  # (a layout the cache API refuses: the usual path takes it)
        return None
    needs_lse = return_lse or sinks is not None  # (the sinks rescale O by the sink-free LSE)
    # The plan's key: the repeat signature, or (calls without one: out=, sinks in another dtype, repeat
    # calls off) what the plan is made of, so that no call plans afresh (a plan costs about 100 us).
    plan_key = ("attention", key) if key is not None else _plan_signature(q, k, v, problem, needs_lse, out)
    plan = dispatch.backend().decode_plan(
        problem, q, k, v, None, None, seqlen_k, None, 0, out, needs_lse, plan_key
    )
    if isinstance(plan, str):
        return None
    return RoutedCall(plan, seqlen_k, return_lse)


def _plan_signature(q, k, v, problem, needs_lse: bool, out) -> tuple:
    """Everything a decode plan of a routed call is made from, for calls that have no repeat signature."""
    layout = None if out is None else (out.shape, out.stride(), out.dtype, out.device)
    return (
        "attention-direct", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), v.shape, v.stride(),
        problem.causal, problem.scale, problem.window, problem.softcap, problem.alibi, needs_lse, layout,
    )  # fmt: skip
