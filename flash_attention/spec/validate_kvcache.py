"""Argument checks of :func:`flash_attention.attention_with_kvcache`, run before anything is written or
launched.

Shapes, dtypes, devices and strides are checked here, on the host, for free. The *values* of
``cache_seqlens`` and ``block_table`` live on the device: reading them would synchronise with the GPU, which
a decode step replayed as a CUDA graph cannot afford, so they are checked here only when they are known on the
host (``cache_seqlens`` given as an int, or tensors on the CPU). The path that computes the call says what it
does with the device-side values (:mod:`flash_attention.api.kvcache` documents it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AttentionSpec, ScoreSpec
from .score_functions import values_of
from .validate import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    _resolve_scale,
    check_last_dim_contiguous,
    check_score,
    check_tensor,
    check_window,
)

__all__ = ["CacheProblem", "validate_kvcache"]

_SHAPES = {
    "q": "(batch, seqlen_q, heads_q, head_dim)",
    "k_cache": "(batch, max_seqlen, heads_kv, head_dim), or (num_pages, page_size, heads_kv, head_dim) with "
    "block_table",
    "v_cache": "the shape of k_cache",
    "k": "(batch, seqlen_new, heads_kv, head_dim)",
    "v": "the shape of k",
    "out": "(batch, seqlen_q, heads_q, head_dim)",
}


@dataclass(frozen=True)
class CacheProblem:
    """The shape of one KV-cache attention call, with the softmax scale resolved to a float."""

    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_new: int  # tokens appended per batch row (0 without k/v)
    page_size: int  # 0 for a contiguous cache
    capacity: int  # the most keys one batch row can hold: max_seqlen, or max_pages * page_size
    scale: float
    causal: bool
    # A sliding window (left, right) about each query's diagonal, -1 unbounded, as attention() takes it, with
    # causal's right bound folded in (right -1 under causal); None when it bounds nothing.
    window: tuple[int, int] | None = None
    alibi: int = 0  # ALiBi slopes' dims: 0 none, 1 (heads_q,), 2 (batch, heads_q)
    # The active scalar score functions' (name, value) pairs, as spec.ScoreSpec.values holds them.
    score: tuple[tuple[str, float], ...] = ()
    # v_cache's head_dim, the output's, where it is not head_dim's (0: the same, as for most models).
    head_dim_v: int = 0

    @property
    def value_dim(self) -> int:
        """The head_dim of v_cache and of the output."""
        return self.head_dim_v or self.head_dim

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads_q // self.heads_kv

    @property
    def attention_spec(self) -> AttentionSpec:
        """The call's options as attention() takes them (the dense path's, flash_attention.fallback.kvcache,
        runs the fallback with it): causal, the resolved scale, the window, the score functions and whether
        ALiBi is on."""
        return AttentionSpec(self.causal, self.scale, self.window, ScoreSpec(self.score, bool(self.alibi)))

    @property
    def score_values(self) -> dict[str, float]:
        """The scalar score functions' values by name, as the launch layer's keywords take them."""
        return dict(self.score)


def _tensor(name: str, t: object) -> torch.Tensor:
    check_tensor(name, t, _SHAPES[name])
    if t.dim() != 4:
        raise ValueError(f"{name} must have shape {_SHAPES[name]}; got {tuple(t.shape)}")
    check_last_dim_contiguous(name, t)
    return t


def _index_tensor(name: str, t: object, shape: tuple[int, ...], device: torch.device, meaning: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be an int32 torch.Tensor of shape {shape} ({meaning}); got {type(t).__name__}"
        )
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 ({meaning}); got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({meaning}); got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {t.device}")


def validate_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    cache_seqlens: torch.Tensor | int,
    block_table: torch.Tensor | None,
    causal: bool,
    softmax_scale: float | None,
    num_splits: int,
    out: torch.Tensor | None,
    window: object = None,
    alibi_slopes: object = None,
    **score_values: object,
) -> CacheProblem:
    """Check a KV-cache attention call; return its :class:`CacheProblem` or raise TypeError/ValueError.
    ``score_values``: the scalar score functions' values by name (spec.score_functions; 0: none)."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError(
            f"k and v must be given together (the new tokens' keys and values); got k "
            f"{'None' if k is None else 'a tensor'} and v {'None' if v is None else 'a tensor'}"
        )
    if k is not None:
        named.update(k=k, v=v)
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        _tensor(name, t)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(
            f"num_splits must be an int (0: chosen by a heuristic); got {type(num_splits).__name__}"
        )
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: chosen by a heuristic); got {num_splits}")

    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64; got {q.dtype}")
    for name, t in named.items():
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")

    batch, seqlen_q, heads_q, head_dim = q.shape
    pages_or_batch, rows, heads_kv, cache_dim = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"v_cache must have the pages (or batch), rows and heads of k_cache {tuple(k_cache.shape[:3])} "
            f"(its head_dim may differ); got {tuple(v_cache.shape)}"
        )
    value_dim = v_cache.shape[3]
    if value_dim < 1 or value_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"v_cache's head_dim (v_cache.shape[3]) must be between 1 and {MAX_HEAD_DIM}; got {value_dim}"
        )
    if cache_dim != head_dim:
        raise ValueError(
            f"k_cache must have the head_dim of q ({head_dim}); got shape {tuple(k_cache.shape)}"
        )
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[3]) must be between 1 and {MAX_HEAD_DIM}; got {head_dim}")
    if heads_kv == 0:
        raise ValueError(
            f"k_cache must have at least one head (heads_kv >= 1); got shape {tuple(k_cache.shape)}"
        )
    if heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k_cache's heads ({heads_kv}): query head h reads "
            f"kv head h // (heads_q // heads_kv); got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    out_shape = (*q.shape[:3], value_dim)
    if out is not None and tuple(out.shape) != out_shape:
        raise ValueError(
            f"out must have the shape {out_shape} (q's, with v_cache's head_dim); got {tuple(out.shape)}"
        )

    if block_table is None:
        page_size = 0
        capacity = rows
        if pages_or_batch != batch:
            raise ValueError(
                f"k_cache must have the batch size of q ({batch}) when block_table is None (a contiguous "
                f"cache "
                f"(batch, max_seqlen, heads_kv, head_dim)); got shape {tuple(k_cache.shape)}"
            )
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            got = (
                tuple(block_table.shape)
                if isinstance(block_table, torch.Tensor)
                else type(block_table).__name__
            )
            raise ValueError(f"block_table must have shape (batch, max_pages); got {got}")
        _index_tensor(
            "block_table",
            block_table,
            (batch, block_table.shape[1]),
            q.device,
            "each row's page indices into k_cache",
        )
        page_size = rows
        if page_size < 1:
            raise ValueError(
                f"k_cache's page_size (k_cache.shape[1]) must be >= 1; got shape {tuple(k_cache.shape)}"
            )
        if pages_or_batch < 1:
            raise ValueError(f"k_cache must hold at least one page; got shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * page_size

    seqlen_new = 0
    if k is not None:
        if k.shape[0] != batch or k.shape[2] != heads_kv or k.shape[3] != head_dim:
            raise ValueError(
                f"k must have shape (batch, seqlen_new, heads_kv, head_dim) = "
                f"({batch}, seqlen_new, {heads_kv}, "
                f"{head_dim}); got {tuple(k.shape)}"
            )
        if v.shape[:3] != k.shape[:3] or v.shape[3] != value_dim:
            raise ValueError(
                f"v must have shape (batch, seqlen_new, heads_kv, v_cache's head_dim) = "
                f"{(*k.shape[:3], value_dim)}; got {tuple(v.shape)}"
            )
        seqlen_new = k.shape[1]
        if seqlen_new > capacity:
            raise ValueError(
                f"k has {seqlen_new} new tokens per row but the cache holds at most {capacity} per row "
                f"({'max_pages * page_size' if page_size else 'k_cache.shape[1]'})"
            )

    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an int or an int32 tensor of shape (batch,); got bool")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(
                f"cache_seqlens ({cache_seqlens}) must be in [0, {capacity - seqlen_new}]: the cache holds "
                f"{capacity} keys per row and {seqlen_new} new ones are appended after the current ones"
            )
    else:
        _index_tensor("cache_seqlens", cache_seqlens, (batch,), q.device, "each row's current cache length")

    window = check_window(window)
    if window is not None:
        left, right = window
        if causal:
            right = -1  # (causal already stops each row at its diagonal)
        window = None if left == right == -1 else (left, right)
    # Each score value a finite float >= 0; alibi_slopes float32 (heads_q,) or (batch, heads_q); they compose
    # (the decode kernels cap each score, then add the bias: the prefill kernels' order).
    check_score(alibi_slopes, q, **score_values)
    alibi = 0 if alibi_slopes is None else alibi_slopes.dim()

    scale = _resolve_scale(softmax_scale, head_dim)
    return CacheProblem(
        batch, seqlen_q, heads_q, heads_kv, head_dim, seqlen_new, page_size, capacity, scale, causal, window,
        alibi, values_of(**score_values), 0 if value_dim == head_dim else value_dim,
    )  # fmt: skip
