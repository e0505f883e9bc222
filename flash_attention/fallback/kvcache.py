"""The KV-cache path composed from PyTorch indexing and dense attention: the decode kernels' fallback.

The path of :func:`flash_attention.attention_with_kvcache` on every device until a decode kernel takes the
call: it reads ``cache_seqlens`` and ``block_table`` on the host (one synchronisation with the GPU per call),
checks them, appends the new tokens with one indexed copy per cache, then runs dense attention once per
batch row on that row's keys (a view of a contiguous cache, a gather of a paged one's pages), or once for
the whole batch when every row of a contiguous cache has the same length. Each of those runs our forward
kernels on CUDA (fp16/bf16) and the PyTorch fallback elsewhere (:func:`_dense`: the kernel-or-fallback
choice of ``attention()``'s inference path, below ``attention()`` itself), with the semantics of
:func:`flash_attention.fallback.reference.attention_kvcache_reference`.

What it costs, and why it is not the serving path: the host read stops CUDA-graph capture and costs a sync
per decode step, and one launch per ragged batch row wastes the GPU at one query token. Both are what the
split-KV decode kernel removes; this path stays the reference behaviour and the fallback.
"""

from __future__ import annotations

import torch

from ..ops import dispatch
from ..spec import launch_variants
from ..spec.validate_kvcache import CacheProblem
from . import forward as fallback_forward

__all__ = ["append_tokens", "attend", "check_cache_values", "run"]


def check_cache_values(
    problem: CacheProblem, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, num_pages: int
) -> list[int]:
    """Each row's current length, read on the host and checked against the cache; ValueError names the
    argument and the row otherwise. Only the pages a row uses after the append are checked: entries past
    them are never read (serving engines leave them -1 or stale)."""
    lengths = cache_seqlens.tolist()
    limit = problem.capacity - problem.seqlen_new
    for b, n in enumerate(lengths):
        if not 0 <= n <= limit:
            raise ValueError(
                f"cache_seqlens[{b}] = {n} must be in [0, {limit}]: the cache holds {problem.capacity} "
                f"keys per "
                f"row and {problem.seqlen_new} new ones are appended after the current ones"
            )
    if block_table is not None:
        table = block_table.tolist()
        for b, n in enumerate(lengths):
            used = -(-(n + problem.seqlen_new) // problem.page_size)
            for i, page in enumerate(table[b][:used]):
                if not 0 <= page < num_pages:
                    raise ValueError(
                        f"block_table[{b}, {i}] = {page} is not a page of k_cache (it has {num_pages}); "
                        f"row {b} "
                        f"uses its first {used} entries"
                    )
    return lengths


def _positions(cache_seqlens: torch.Tensor, seqlen_new: int) -> torch.Tensor:
    """(batch, seqlen_new) int64 cache positions of the new tokens."""
    return cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=cache_seqlens.device)[None, :]


def append_tokens(
    problem: CacheProblem,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Write ``k[b, t]``, ``v[b, t]`` at position ``cache_seqlens[b] + t`` of row b, in place (values
    already checked: every position is inside the cache)."""
    pos = _positions(cache_seqlens, problem.seqlen_new)
    if block_table is None:
        rows = torch.arange(problem.batch, device=pos.device)[:, None].expand_as(pos)
        index = (rows, pos)
    else:
        index = (block_table.long().gather(1, pos // problem.page_size), pos % problem.page_size)
    k_cache[index] = k
    v_cache[index] = v


def _row_keys(
    problem: CacheProblem, cache: torch.Tensor, block_table: torch.Tensor | None, b: int, n: int
) -> torch.Tensor:
    """Row b's first n cache positions as a (1, n, heads_kv, head_dim) tensor (the cache's own head_dim: k's
    or v's): a view of a contiguous cache, a gather of a paged one's pages."""
    if block_table is None:
        return cache[b : b + 1, :n]
    used = -(-n // problem.page_size)
    pages = cache[block_table[b, :used].long()]  # (used, page_size, heads_kv, head_dim)
    return pages.reshape(1, used * problem.page_size, problem.heads_kv, cache.shape[3])[:, :n]


def _dense(
    problem: CacheProblem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of dense attention of ``q`` against these keys, written into ``out`` when given: our
    forward kernels where they run (ops.dispatch's choice, with its once-per-reason warning), else the
    PyTorch fallback, as ``attention()`` runs an inference call (without its repeat calls and its route of
    a few queries to the decode kernels, which are the kernels this path stands in for)."""

    def fallback():
        return fallback_forward(
            q, k, v, problem.attention_spec, return_lse=True, out=out, alibi_slopes=alibi_slopes
        )

    ops = None if q.numel() == 0 or k.shape[1] == 0 else dispatch.kernel_backend(q)
    if ops is None:
        return fallback()
    launch = launch_variants(problem.window, alibi_slopes, **problem.score_values)
    return dispatch.run_or_fallback(
        lambda: ops.cuda_forward(
            q, k, v, causal=problem.causal, softmax_scale=problem.scale, return_lse=True, out=out,
            config=None, **launch,
        ),
        fallback,
    )  # fmt: skip


def attend(
    problem: CacheProblem,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lengths: list[int],
    out: torch.Tensor | None,
    return_lse: bool,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of every row's queries against its ``lengths[b] + seqlen_new`` keys."""
    totals = [n + problem.seqlen_new for n in lengths]
    if block_table is None and len(set(totals)) == 1:
        n = totals[0]
        o, lse = _dense(problem, q, k_cache[:, :n], v_cache[:, :n], out, alibi_slopes)
        return o, (lse if return_lse else None)
    if out is None:
        out = torch.empty((*q.shape[:3], problem.value_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty(problem.batch, problem.heads_q, problem.seqlen_q, dtype=torch.float32, device=q.device)
    for b, n in enumerate(totals):
        keys = _row_keys(problem, k_cache, block_table, b, n)
        values = _row_keys(problem, v_cache, block_table, b, n)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:  # (batch, heads_q): this row's
            slopes = slopes[b : b + 1]
        _, lse[b : b + 1] = _dense(problem, q[b : b + 1], keys, values, out[b : b + 1], slopes)
    return out, (lse if return_lse else None)


def run(
    problem: CacheProblem,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    out: torch.Tensor | None,
    return_lse: bool,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The validated call (cache_seqlens a tensor): append, then attend; the custom op runs this too."""
    lengths = check_cache_values(problem, cache_seqlens, block_table, k_cache.shape[0])
    if problem.seqlen_new and problem.batch:
        append_tokens(problem, k_cache, v_cache, k, v, cache_seqlens, block_table)
    if problem.batch == 0 or problem.seqlen_q == 0 or problem.heads_q == 0:
        shape = (*q.shape[:3], problem.value_dim)
        o = torch.empty(shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = torch.empty(
            problem.batch, problem.heads_q, problem.seqlen_q, dtype=torch.float32, device=q.device
        )
        return o, (lse if return_lse else None)
    return attend(problem, q, k_cache, v_cache, block_table, lengths, out, return_lse, alibi_slopes)
