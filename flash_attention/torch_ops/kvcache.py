"""The custom op ``flash_attention::fwd_kvcache``: :func:`flash_attention.attention_with_kvcache` as one node
for ``torch.compile``.

``fwd_kvcache(q, k_cache!, v_cache!, k?, v?, cache_seqlens, block_table?, num_splits, options, values,
alibi_slopes?) -> (out, lse)``, the call's numbers packed in ``options`` and ``values`` (spec.OpOptions). The
schema marks k_cache and v_cache as written (the append), so a compiled graph orders the call after earlier
reads of the cache and before later ones, and functionalisation copies nothing else. A call without new tokens
is ``fwd_kvcache_read`` (the same without k, v and the write).
The arguments were validated by :func:`flash_attention.spec.validate_kvcache.validate_kvcache`;
``cache_seqlens`` is always a tensor here (an int is turned into one before the op), ``scale`` is resolved.
The fake implementation gives the shapes without running anything.

:func:`run` is the op's implementation, which the eager path of attention_with_kvcache calls directly
(skipping the op's dispatch): on CUDA, fp16/bf16, the decode kernels (:func:`flash_attention.ops.decode.
decode_plan`: no host read of the lengths or pages, so graph-capturable); everywhere else, and for calls the
kernels cannot take (a head_dim that is not a multiple of 8, a misaligned cache), the composed path of
:mod:`flash_attention.fallback.kvcache`, with the once-per-reason warning on CUDA.
"""

from __future__ import annotations

import torch

from ..fallback import kvcache as compose
from ..ops import dispatch
from ..spec import OpOptions
from ..spec.validate_kvcache import CacheProblem, validate_kvcache

__all__ = ["fwd_kvcache", "fwd_kvcache_read", "run"]

# Spelled out (mutation annotations included) rather than inferred from annotations, as in
# torch_ops.attention; the call's numbers packed as there (spec.OpOptions: causal, scale, window, soft-cap).
_SCHEMA = (
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor cache_seqlens,"
    " Tensor? block_table, int num_splits, int[] options, float[] values, Tensor? alibi_slopes=None)"
    " -> (Tensor, Tensor)"
)


@torch.library.custom_op("flash_attention::fwd_kvcache", mutates_args=("k_cache", "v_cache"), schema=_SCHEMA)
def fwd_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    num_splits: int,
    options: list[int],
    values: list[float],
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    opt = OpOptions.unpack(options, values)
    problem = validate_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        causal=opt.causal,
        softmax_scale=opt.scale,
        num_splits=num_splits,
        out=None,
        window=opt.window,
        alibi_slopes=alibi_slopes,
        **opt.score_values,
    )
    args = (cache_seqlens, block_table, num_splits, None, True, None, alibi_slopes)
    out, lse = run(problem, q, k_cache, v_cache, k, v, *args)
    return out, lse


def run(
    problem: CacheProblem,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | int,
    block_table: torch.Tensor | None,
    num_splits: int,
    out: torch.Tensor | None,
    return_lse: bool,
    key: tuple | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The validated call on the decode kernels or the composed path. ``cache_seqlens``: a tensor, or an int
    for every row (the kernels take it by value). ``key``: the call's signature, under which the launch
    layer keeps the call's plan (None: plan afresh)."""
    args = (problem, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    empty = problem.batch == 0 or problem.seqlen_q == 0 or problem.heads_q == 0
    if dispatch.wants_kernel(q) and not empty:
        plan = dispatch.backend().decode_plan(*args, num_splits, out, return_lse, key)
        if isinstance(plan, str):
            dispatch.warn_fallback(f"attention_with_kvcache: {plan}")
        elif not plan.runnable(k_cache, v_cache):
            dispatch.warn_fallback(
                "attention_with_kvcache: k_cache or v_cache does not start at a 16-byte aligned address (the "
                "decode kernels write the cache in place and read it 16 bytes at a time)"
            )
        else:
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, alibi_slopes)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((problem.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    return compose.run(
        problem, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, return_lse, alibi_slopes
    )


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, options, values,
                      alibi_slopes=None):  # fmt: skip
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[3]))  # (v_cache's head_dim)
    return out, q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


# A call without new tokens (k = v = None: the cache was written already, as transformers' static cache is
# before its attention runs) writes nothing. Declaring the caches written there would make torch.compile's
# functionalisation treat each call as a write of the whole cache (clones, or a reinplacing pass to undo
# them) and order every other read of the cache around it; this op declares no write.
_READ_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, int num_splits,"
    " int[] options, float[] values, Tensor? alibi_slopes=None) -> (Tensor, Tensor)"
)


@torch.library.custom_op("flash_attention::fwd_kvcache_read", mutates_args=(), schema=_READ_SCHEMA)
def fwd_kvcache_read(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    num_splits: int,
    options: list[int],
    values: list[float],
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (cache_seqlens, block_table, num_splits, options, values, alibi_slopes)
    return fwd_kvcache(q, k_cache, v_cache, None, None, *args)


@fwd_kvcache_read.register_fake
def _fwd_kvcache_read_fake(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, options, values,
                           alibi_slopes=None):  # fmt: skip
    args = (cache_seqlens, block_table, num_splits, options, values)
    return _fwd_kvcache_fake(q, k_cache, v_cache, None, None, *args)
