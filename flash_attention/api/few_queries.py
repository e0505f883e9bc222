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

``attention_varlen`` calls with about one query per sequence (a decoding step over sequences of different
lengths) take the same kernels through :func:`route_varlen`: each packed query row becomes a row of a
contiguous cache whose rows all read the packed keys, from their sequence's first key on (the kernels'
``cache_starts``), and see as many keys as causal alignment gives them, so the result is exact for any
spread of the queries over the sequences, read from the offsets on the device without a host read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..configs.decode import cache_length_bucket
from ..ops import dispatch
from ..ops.repeat import PLAIN_NUMBERS, bound_layout
from ..sinks import apply_sinks
from ..spec.validate_kvcache import validate_kvcache

__all__ = ["MAX_ROWS", "MIN_KEYS", "RoutedCall", "route", "route_varlen", "takes_shape", "varlen_rows"]

#: The most packed query rows (seqlen_q x group) the route takes: one decode tile of 64 rows per key/value
#: head, as the transformers integration sends its decoding steps (STATIC_CACHE_MAX_QUERIES).
MAX_ROWS = 64
#: The fewest keys the route takes: under a key tile or two the forward kernel has nothing to split.
MIN_KEYS = 256
#: attention_varlen's route: at most this many query rows per sequence on average (each row reads its
#: sequence's keys on its own, so more queries per sequence would read them that many times over).
QUERIES_PER_SEQUENCE = 2


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
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    key: tuple | None,
    **score_values: float,
) -> RoutedCall | None:
    """The decode kernels' call for a validated ``attention()`` call that is not recorded and has no key
    range, dropout or packed batch (the caller checks those), or None when the call keeps its usual path:
    too many query rows, too few keys, layouts or a GPU the decode kernels cannot take. ``key``: the call's
    repeat signature (the decode plan is kept under it), or None; ``score_values``: the scalar score
    functions' values by name."""
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
            num_splits=0, out=out, window=window, alibi_slopes=alibi_slopes, **score_values,
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
        problem.causal, problem.scale, problem.window, problem.score, problem.alibi, needs_lse, layout,
    )  # fmt: skip


# attention_varlen's routed signatures: (the checked problem, its plan's key), or False where the cache API
# refuses the layout. A few hundred bytes each; the oldest goes past _VARLEN_CALLS_KEPT.
_VARLEN_CALLS: dict[tuple, tuple | bool] = {}
_VARLEN_CALLS_KEPT = 64


def _varlen_call(rows, cache_k, cache_v, lens, scale, window, alibi_slopes, needs_lse, bucket, score_values):
    """(the validated CacheProblem, the decode plan's key) of a routed attention_varlen signature, or False
    where the cache API refuses its layout."""
    try:
        problem = validate_kvcache(
            rows, cache_k, cache_v, None, None, cache_seqlens=lens, block_table=None, causal=False,
            softmax_scale=scale, num_splits=0, out=None, window=window, alibi_slopes=alibi_slopes,
            **dict(score_values),
        )  # fmt: skip
    except (TypeError, ValueError):
        return False
    key = (
        "varlen", rows.shape, rows.stride(), rows.dtype, rows.device, cache_k.stride()[1:],
        cache_v.stride()[1:], dataclasses.replace(problem, capacity=0), needs_lse, bucket,
    )  # fmt: skip
    return problem, key


def varlen_rows(cu_q, cu_k, seqused_k, total_q: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (total_q,) each packed query row's key count and its sequence's first key row, for
    :func:`route_varlen`: row i of a sequence with n_q queries and n_k keys (``seqused_k``'s, where given)
    sees keys [0, n_k - n_q + i] under causal (bottom-right aligned, none when that is negative), all n_k
    otherwise; a row past the last sequence sees none. Device operations only (no host read)."""
    n_seq = cu_q.numel() - 1
    cq, ck = cu_q.long(), cu_k.long()
    r = torch.arange(total_q, device=cu_q.device)
    if seqused_k is not None:  # (clamped to the sequence's keys, as the usual path's runs clamp it)
        seqused_k = torch.minimum(seqused_k.long().clamp_min(0), ck[1:] - ck[:-1])
    seq = torch.searchsorted(cq[1:], r, right=True)  # (the first sequence that ends past row r; n_seq: none)
    owned = seq < n_seq
    s = seq.clamp(max=n_seq - 1)
    n_q = cq[s + 1] - cq[s]
    n_k = seqused_k.long()[s] if seqused_k is not None else ck[s + 1] - ck[s]
    n = (n_k - n_q + (r - cq[s]) + 1).clamp(min=0) if causal else n_k
    zero = torch.zeros_like(n)
    return torch.where(owned, n, zero).int(), torch.where(owned, ck[s], zero).int()


def route_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_seq: int,
    row_tables: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
    return_lse: bool,
    window: tuple[int, int] | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    score_values: tuple = (),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``attention_varlen``'s result from the decode kernels for a packed batch with about one query per
    sequence against many keys (a decoding step over sequences of different lengths: at most
    QUERIES_PER_SEQUENCE rows per sequence on average, MIN_KEYS keys), or None when the
    call keeps its usual path. Each packed query row is one row of a contiguous cache whose rows share the
    packed keys at their sequence's offset (the kernels' ``cache_starts``), its key count the keys it sees
    (:func:`varlen_rows`, causal folded in), so any spread of queries over the sequences is exact, and a
    call of at most one query per sequence reads each sequence's keys once per key/value head, as
    ``attention_with_kvcache`` does. Taken for calls autograd does not record, without dropout, on the
    kernels' GPU; not for a window or ALiBi without causal (their diagonal is the sequence's, which a row of
    one query cannot place). ``n_seq``: the batch's sequence count; ``row_tables``: :func:`varlen_rows` of
    the call, made once per offsets by the caller (asked only when the route is taken); ``score_values``: the
    scalar score functions' (name, value) pairs as the call gave them (a tuple: this runs every step)."""
    total_q, heads_q, head_dim = q.shape
    total_k, heads_kv = k.shape[0], k.shape[1]
    for _, value in score_values:  # (a value of a type the checks refuse: the usual path names it)
        if type(value) not in PLAIN_NUMBERS:
            return None
    # Few queries per sequence: by the caller's hint where it gives one (a hint off the real counts costs
    # speed only: every row is exact), else at most one per sequence on average.
    few = max_seqlen_q <= QUERIES_PER_SEQUENCE if max_seqlen_q else total_q <= n_seq
    if (
        not (0 < n_seq and 0 < total_q and few and total_k >= MIN_KEYS * n_seq)
        or heads_q // max(heads_kv, 1) > MAX_ROWS
        or (not causal and (window is not None or alibi_slopes is not None))
        or not dispatch.wants_kernel(q)
        or torch.compiler.is_compiling()
        or (k.data_ptr() | v.data_ptr()) % 16
        # (what the signature below cannot hold, the usual path checks and names: v's own length, and a
        # scale or score value of a type the checks refuse; a bool hashes as the number it is)
        or v.shape[0] != total_k
        or not (scale is None or type(scale) in PLAIN_NUMBERS)
        or bound_layout(alibi_slopes) is False
    ):
        return None
    if window is not None:
        # Clipped as route() clips it (a huge side must not wrap the params' int32), to a bound that moves
        # only with the keys' bucket: one that grew with every step's key count would miss the signature's
        # cache each step.
        far = total_q + cache_length_bucket(total_k)
        window = tuple(w if w < 0 else min(w, far) for w in window)
    rows = q.unsqueeze(1)  # (total_q, 1, heads_q, head_dim): a cache row per packed query row
    cache_k, cache_v = (t.unsqueeze(0).expand(total_q, *t.shape) for t in (k, v))  # (one buffer: stride 0)
    lens, starts = row_tables()
    needs_lse = return_lse or sinks is not None  # (the sinks rescale O by the sink-free LSE)
    # The splits are sized for a typical sequence's keys (the hint, else the mean); the plan serves every
    # packed length of its bucket (it fills the buffer's geometry per call), so a decoding loop whose
    # sequences grow plans once per bucket.
    bucket = cache_length_bucket(max_seqlen_k or -(-total_k // n_seq))
    # The checks' answer and the plan's key depend on the layouts and options only, not on the packed key
    # count, which grows every step of a decoding loop: kept per signature, so a step pays neither the
    # checks nor the key (a third of a routed call's host time, tools/host_time_cpu.py).
    signature = (
        q.shape, q.stride(), q.dtype, q.device, k.shape[1:], k.stride(), k.dtype, k.device, v.shape[1:],
        v.stride(), v.dtype, v.device, causal, scale, window, score_values,
        bound_layout(alibi_slopes), needs_lse, bucket,
    )  # fmt: skip
    known = _VARLEN_CALLS.get(signature)
    if known is None:
        known = _varlen_call(
            rows, cache_k, cache_v, lens, scale, window, alibi_slopes, needs_lse, bucket, score_values
        )
        _VARLEN_CALLS[signature] = known
        if len(_VARLEN_CALLS) > _VARLEN_CALLS_KEPT:
            _VARLEN_CALLS.pop(next(iter(_VARLEN_CALLS)))
    if not known:
        return None  # (a layout the cache API refuses: the usual path takes it)
    problem, key = known
    plan = dispatch.backend().decode_plan(
        problem, rows, cache_k, cache_v, None, None, lens, None, 0, None, needs_lse, key, starts=True,
        row_keys=bucket,
    )  # fmt: skip
    if isinstance(plan, str) or not plan.runnable(cache_k, cache_v):
        return None
    o, lse = plan(rows, cache_k, cache_v, None, None, lens, None, None, alibi_slopes, cache_starts=starts)
    if sinks is not None:
        o, lse = apply_sinks(o, lse, sinks)
    out = o.squeeze(1)
    if return_lse:  # (total_q, heads_q, 1) -> varlen's (heads_q, total_q)
        return out, lse.view(total_q, heads_q).t().contiguous()
    return out
