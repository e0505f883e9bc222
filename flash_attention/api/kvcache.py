"""The public KV-cache entry point: :func:`attention_with_kvcache`, attention of new queries against a cache
that the call first appends the new keys and values to, in place (contiguous or paged)."""

from __future__ import annotations

import dataclasses

import torch

from ..configs.decode import cache_length_bucket
from ..ops.decode import repeat_plan
from ..ops.plans import PlanCache
from ..sinks import apply_sinks, check_sinks
from ..spec import pack_options
from ..spec.validate_kvcache import CacheProblem, validate_kvcache
from ..torch_ops import kvcache as kvcache_op

__all__ = ["attention_with_kvcache"]

# Validated call signatures and their problems. A decode loop calls with the same shapes step after step; its
# validation (~15 us of Python per call) then runs once, and the signature doubles as the key of the launch
# plan (ops.decode.decode_plan). A call that fails validation raises before anything is kept. A contiguous
# cache enters the signature with its capacity's bucket (configs.decode.cache_length_bucket) and without its
# strides, so a cache that grows every step (a new, longer tensor each time) keeps its plan; what
# validation reads of the capacity is checked per call (_checked_capacity).
_validated: PlanCache[CacheProblem] = PlanCache()


def _signature(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits, out, return_lse,
    window=None, softcap=0.0, alibi_slopes=None,
) -> tuple | None:  # fmt: skip
    """Everything :func:`validate_kvcache` and the launch plan read of a call: each tensor's shape, strides,
    dtype and device, and the options with their types (True == 1 to a dict, not to the validation). A
    contiguous cache whose strides the kernels can read enters as (batch, its capacity's bucket, heads,
    head_dim, dtype, device): the plan writes its capacity and strides per call. An int cache_seqlens enters
    as its type (its value is checked per call). None for a call that is not cached (an argument of another
    type, or a sparse or nested tensor, which the validation will name).

    This runs on every decode step, so it is spelled out rather than looped: q, then the two caches, then
    the optional tensors, each read once (a host-bound decode call's time is its host's; kernel log 160)."""
    if window is not None:
        if not (type(window) in (tuple, list) and all(type(w) is int for w in window)):
            return None  # (an odd window: validation names it)
        window = tuple(window)
    if type(softcap) not in _NUMBERS:
        return None
    if type(q) is not _TENSOR or q.layout is not _STRIDED or q.is_nested:
        return None
    key = [
        type(causal), causal, type(softmax_scale), softmax_scale, type(num_splits), num_splits, return_lse,
        type(window), window, type(softcap), softcap, q.shape, q.stride(), q.dtype, q.device,
    ]  # fmt: skip
    contiguous = block_table is None
    for t in (k_cache, v_cache):
        if type(t) is not _TENSOR or t.layout is not _STRIDED or t.is_nested:
            return None
        n, s = t.shape, t.stride()
        if contiguous and _readable_cache(n, s):
            key += (n[0], cache_length_bucket(n[1]), n[2], n[3], t.dtype, t.device)
        else:
            key += (n, s, t.dtype, t.device)
    for t in (k, v, cache_seqlens, block_table, out, alibi_slopes):
        if t is None:
            key.append(None)
        elif type(t) is _TENSOR and t.layout is _STRIDED and not t.is_nested:
            key += (t.shape, t.stride(), t.dtype, t.device)
        elif type(t) is int and t is cache_seqlens:
            key.append(int)
        else:
            return None
    return tuple(key)


_TENSOR = torch.Tensor
_STRIDED = torch.strided
_NUMBERS = (int, float)


def _readable_cache(n: torch.Size, s: tuple[int, ...]) -> bool:
    """ops.decode.layout_ok on a cache's shape and strides, spelled out: this runs on every call, at a
    fraction of that function's host time (tests/test_kvcache.py holds the two to the same answers)."""
    return (
        len(s) == 4
        and s[3] == 1
        and not (s[0] % 8 or s[1] % 8 or s[2] % 8)
        and (s[0] != 0 or n[0] <= 1)
        and (s[1] != 0 or n[1] <= 1)
        and (s[2] != 0 or n[2] <= 1)
        and max(s) < 2**62
    )


def _records_grad(q, k_cache, v_cache, k, v) -> bool:
    """Whether autograd would record this call (grad mode on and an input requiring grad)."""
    return torch.is_grad_enabled() and (
        q.requires_grad
        or k_cache.requires_grad
        or v_cache.requires_grad
        or (k is not None and (k.requires_grad or v.requires_grad))
    )


def _checked_capacity(problem: CacheProblem, k_cache, v_cache, cache_seqlens, block_table) -> bool:
    """Whether this call agrees with its signature's validated ``problem`` on what validation reads of the
    capacity: a contiguous cache's length (the signature has its bucket) shared by v_cache and with room for
    the new tokens, and an int length in range. False: validate the call afresh (which raises, naming the
    argument, or gives the call's own problem)."""
    capacity = problem.capacity
    if block_table is None:
        capacity = k_cache.shape[1]
        if v_cache.shape[1] != capacity or problem.seqlen_new > capacity:
            return False
    return not isinstance(cache_seqlens, int) or 0 <= cache_seqlens <= capacity - problem.seqlen_new


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor | int,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against a KV cache, after appending ``k``/``v`` to it in place (decoding).

    The names follow the FlashAttention library's ``flash_attn_with_kvcache``, so code written for it ports
    by changing the import (the rotary arguments are not taken here; ``window_size`` is ``window``).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim): the new queries, one token per row when decoding, a few
            for speculative decoding or a chunk of a prompt (chunked prefill).
        k_cache, v_cache: the cache, written in place when ``k``/``v`` are given. Contiguous: (batch,
            max_seqlen, heads_kv, head_dim), row b's position p at ``k_cache[b, p]``. Paged (``block_table``
            given): (num_pages, page_size, heads_kv, head_dim), row b's position p at
            ``k_cache[block_table[b, p // page_size], p % page_size]``; any page_size >= 1. heads_q must be
            a multiple of heads_kv (grouped-query attention, K/V never copied per query head). v_cache may
            have a head_dim of its own (the output's), which the PyTorch path computes for now.
        k, v: optional (batch, seqlen_new, heads_kv, head_dim) (v: v_cache's head_dim): the new tokens' keys
            and values, written at
            positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of each row before the
            attention, which then sees them.
        cache_seqlens: each row's current cache length (before the append): an int32 tensor of shape (batch,)
            on q's device, or an int for all rows (passed to the kernels by value: a CUDA graph that captures
            the call replays that value; give a tensor to change lengths between replays). It is read, never
            advanced: after the call the caller adds seqlen_new to it (serving engines keep their own
            lengths).
        block_table: int32 (batch, max_pages) page indices into k_cache/v_cache for a paged cache; None for a
            contiguous one. Only the entries a row uses (its first ``ceil((cache_seqlens[b] + seqlen_new) /
            page_size)``) are read.
        causal: query i of row b (of seqlen_q) sees cache position j iff ``j <= i + n_b - seqlen_q`` with
            ``n_b = cache_seqlens[b] + seqlen_new``: the bottom-right corner of the row's own score matrix,
            so the new tokens see the cache and each other causally. With ``causal=False`` every query sees
            all ``n_b`` positions. Rows that see no key (n_b == 0) get out 0 and LSE -inf.
        softmax_scale: default ``1 / sqrt(head_dim)``.
        num_splits: how many thread blocks share one row's keys in the decode kernel (0: chosen by a
            heuristic, configs.decode.num_splits_heuristic, from the cache's capacity and the GPU's
            occupancy); capped at the number of the kernel's K/V tiles (64 or 32 keys). The composed path
            ignores it.
        return_lse: also return the float32 (batch, heads_q, seqlen_q) log-sum-exp of each row's scores.
        out: optional preallocated output of q's shape and dtype (last dimension contiguous).
        sinks: attention sinks (gpt-oss), a floating tensor of shape (heads_q,) on q's device: as in
            :func:`flash_attention.attention` (each head's logit joins every row's softmax without a value;
            the LSE includes it).
        window: a sliding window ``(left, right)`` about each query's diagonal (query i of row b sees cache
            positions ``i + n_b - seqlen_q - left .. i + n_b - seqlen_q + right``; -1 unbounded on that side),
            as :func:`flash_attention.attention` takes it, with ``causal``'s bound on the right. The decode
            kernels read only the keys inside it: a 4k window over a 128k cache costs about what a 4k cache
            costs (docs/kernel-log.md, step 86).
        softcap: > 0 caps each scaled score, ``softcap * tanh(s / softcap)`` (Gemma 2), as
            :func:`flash_attention.attention` does.
        alibi_slopes: ALiBi, float32 (heads_q,) or (batch, heads_q) on q's device, as
            :func:`flash_attention.attention` takes them: each score gets
            ``-slope * |i + n_b - seqlen_q - j|`` (aligned like causal, to each row's own length); with
            ``softcap``, added to the capped score.

    Returns:
        ``out`` of q's shape and dtype, or ``(out, lse)`` with ``return_lse=True``.

    Values of ``cache_seqlens`` and ``block_table``: every row must have room for its new tokens
    (``cache_seqlens[b] + seqlen_new <= capacity``, the capacity being max_seqlen, or max_pages *
    page_size) and every page index a row uses must be a page of the cache. On CUDA with fp16/bf16 the
    decode kernels (:mod:`flash_attention.ops.decode`) never read them on the host, so a call can be
    captured in a CUDA graph: a row whose length or page index is out of range gets a NaN output (and LSE)
    and nothing outside the cache is read or written. Elsewhere (CPU, float32/float64, a head_dim that is
    not a multiple of 8, strides the kernels cannot read) the composed path
    (:mod:`flash_attention.fallback.kvcache`: PyTorch indexing for the append, then dense attention per
    row) reads both on the host and raises ValueError naming the entry before anything is written.

    Not differentiable (inference only): a call that autograd would record (grad mode on and q, k or v
    requiring grad) raises RuntimeError. Under ``torch.compile`` the call is one custom op,
    ``flash_attention::fwd_kvcache``, that declares its writes to the caches.

    Raises:
        TypeError, ValueError: on invalid arguments, naming the argument and what was expected, before
            anything is written.
    """
    if sinks is not None:
        # The sink-free call and its LSE, then the rescale every kernel shares (flash_attention.sinks).
        check_sinks(sinks, q)
        o, lse = attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=causal,
            softmax_scale=softmax_scale,
            num_splits=num_splits,
            return_lse=True,
            out=out,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
        )
        o, lse = apply_sinks(o, lse, sinks)
        return (o, lse) if return_lse else o
    key = _signature(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        block_table,
        causal,
        softmax_scale,
        num_splits,
        out,
        return_lse,
        window,
        softcap,
        alibi_slopes,
    )

    compiling = torch.compiler.is_compiling()
    if key is not None and out is None and not compiling:
        # A repeat of a signature whose plan launches from the host library: its validated problem is the
        # plan's, and what a signature cannot fix is checked here as on the whole path (the capacity's
        # rules, gradients); the launch layers between are skipped. None: the whole path. Never while
        # torch.compile traces: Dynamo would guard on the plan cache's entries.
        plan = repeat_plan(key)
        if (
            plan is not None
            and _checked_capacity(plan.problem, k_cache, v_cache, cache_seqlens, block_table)
            and not _records_grad(q, k_cache, v_cache, k, v)
        ):
            result = plan.repeat(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
            if result is not None:
                return result if return_lse else result[0]

    def validate() -> CacheProblem:
        return validate_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=causal,
            softmax_scale=softmax_scale,
            num_splits=num_splits,
            out=out,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
        )

    if key is None:
        problem = validate()
    else:
        problem = _validated.get(key, validate)
        if not _checked_capacity(problem, k_cache, v_cache, cache_seqlens, block_table):
            problem = validate()
        elif block_table is None and problem.capacity != k_cache.shape[1]:
            problem = dataclasses.replace(problem, capacity=k_cache.shape[1])
    if _records_grad(q, k_cache, v_cache, k, v):
        raise RuntimeError(
            "attention_with_kvcache() is for inference and has no backward, but an input requires grad; call "
            "it under torch.no_grad() or torch.inference_mode(), or use attention() for training"
        )
    if compiling:
        if isinstance(cache_seqlens, int):  # the op's schema takes a tensor
            cache_seqlens = torch.full((problem.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
        # (the ops' packed numbers: spec.OpOptions)
        options = pack_options(causal, problem.scale, window=problem.window, **problem.score_values)
        if k is None:  # nothing to append: the op that declares no write to the caches
            o, lse = torch.ops.flash_attention.fwd_kvcache_read(
                q, k_cache, v_cache, cache_seqlens, block_table, num_splits, *options, alibi_slopes
            )
        else:
            o, lse = torch.ops.flash_attention.fwd_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, *options, alibi_slopes
            )
        if out is not None:
            out.copy_(o)  # custom ops return new tensors; the caller's buffer gets a copy
            o = out
    else:
        o, lse = kvcache_op.run(
            problem, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, out, return_lse, key,
            alibi_slopes,
        )  # fmt: skip
    return (o, lse) if return_lse else o
