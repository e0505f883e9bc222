"""Attention computed through PyTorch: the float64 truth the kernels are tested against, and the fallback.

Both functions take the layout of the FlashAttention library:

* ``q``: (batch, seqlen_q, heads_q, head_dim)
* ``k``, ``v``: (batch, seqlen_k, heads_kv, head_dim), with heads_q a multiple of heads_kv; query head ``h``
  reads key/value head ``h // (heads_q // heads_kv)`` (MQA when heads_kv == 1, GQA otherwise).

Causal masking is aligned to the bottom-right corner of the score matrix, as in FlashAttention 2.1+: query
``i`` attends key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. A query row with no key to attend to (seqlen_q >
seqlen_k under causal, or seqlen_k == 0) has output 0 and log-sum-exp -inf, never NaN.

:func:`attention_reference` is written to be obviously correct, not fast: it materialises the full score
matrix in float64. :func:`attention_torch` is the fallback with the kernel's exact semantics (float32
softmax, output in the input dtype, float32 LSE) and bounded memory.
"""

from __future__ import annotations

import math

import torch

from ..dropout import dropout_key, dropout_threshold, keep_elements, seed_pair
from ..spec.score_functions import apply_scores, apply_scores_with_slope, values_of

__all__ = [
    "alibi_bias",
    "runs_alibi_diagonal",
    "attention_backward_torch",
    "attention_kvcache_reference",
    "attention_reference",
    "attention_torch",
    "causal_allowed",
    "key_range_allowed",
    "window_allowed",
]

#: Upper bound on the bytes of one block of scores the fallback materialises. The fallback walks over
#: (batch, kv head, query row) in chunks so that long sequences do not need seqlen_q x seqlen_k memory.
#: Read at every call (not bound as a default argument) so tests can shrink it to force chunking.
_SCORE_BUDGET_BYTES = 256 * 1024 * 1024


def causal_allowed(seqlen_q: int, seqlen_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) matrix, True where query ``i`` may attend key ``j`` (bottom-right)."""
    return _causal_allowed_rows(0, seqlen_q, seqlen_q, seqlen_k, device)


def key_range_allowed(key_range: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """(batch, seqlen_k) boolean, True where batch row b may attend key j: ``start <= j < end`` for
    ``key_range[b] = (start, end)``, clamped as the kernel clamps them (start to [0, seqlen_k], end to
    [start, seqlen_k])."""
    start = key_range[:, 0:1].clamp(0, seqlen_k)
    end = torch.maximum(key_range[:, 1:2].clamp(max=seqlen_k), start)
    j = torch.arange(seqlen_k, device=key_range.device)
    return (j >= start) & (j < end)


def _causal_allowed_rows(
    row_start: int, row_end: int, seqlen_q: int, seqlen_k: int, device: torch.device | str | None
) -> torch.Tensor:
    rows = torch.arange(row_start, row_end, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def _rows_allowed(
    row_start: int, row_end: int, seqlen_q: int, seqlen_k: int, causal: bool, window, device
) -> torch.Tensor | None:
    """(rows, seqlen_k) boolean mask of query rows [row_start, row_end) under ``causal`` and a sliding
    ``window`` (:func:`window_allowed`'s rule), or, with ``window`` a (seqlen_q, 2) integer tensor, each
    row's run of keys [window[i, 0], window[i, 1]) (a packed batch's segments, flash_attention.api.varlen);
    None when nothing is masked."""
    allowed = _causal_allowed_rows(row_start, row_end, seqlen_q, seqlen_k, device) if causal else None
    if isinstance(window, torch.Tensor):
        runs = window[row_start:row_end].to(device=device, dtype=torch.int64)
        cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
        seg = (cols >= runs[:, :1]) & (cols < runs[:, 1:])
        return seg if allowed is None else allowed & seg
    if window is not None:
        rows = torch.arange(row_start, row_end, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
        cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
        left, right = window
        win = torch.ones(row_end - row_start, seqlen_k, dtype=torch.bool, device=device)
        if left >= 0:
            win &= cols >= rows - left
        if right >= 0:
            win &= cols <= rows + right
        allowed = win if allowed is None else allowed & win
    return allowed


def _score_args(
    score_values: dict, alibi_slopes, batch: int, heads_q: int, cdtype, alibi_diagonal=None
) -> tuple | None:
    """(the active scalar functions as spec.score_functions.values_of gives them, ALiBi slopes in ``cdtype``
    or None, the rows' ALiBi diagonals or None, whether the slopes are per query row) of a call with a score
    function, else None. The slopes are (batch, heads_q), or (a packed batch, batch 1) a (seqlen_q, heads_q)
    table of more than one row: a slope per query row."""
    values = values_of(**score_values)
    if not values and alibi_slopes is None:
        return None
    slopes = None
    per_row = False
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(cdtype)
        slopes = slopes.unsqueeze(0).expand(batch, -1) if slopes.dim() == 1 else slopes
        per_row = slopes.shape[0] != batch  # (checked by the callers: then batch 1, one per query row)
    return values, slopes, alibi_diagonal, per_row


def _apply_score(
    s: torch.Tensor, score: tuple | None, bounds: tuple, group: int, seqlen_q: int
) -> torch.Tensor:
    """The score functions on a chunk's scaled scores ``s`` (b, h_kv, group, rows, seqlen_k), out of place:
    the scalar functions (soft-capping), then ALiBi's bias (:func:`attention_reference`'s order)."""
    if score is None:
        return s
    values, slopes, diagonal, per_row = score
    s = apply_scores(s, values)
    if slopes is None:
        return s
    b0, b1, h0, h1, i0, i1 = bounds
    seqlen_k = s.shape[-1]
    if diagonal is None:
        rows = torch.arange(i0, i1, device=s.device).unsqueeze(1) + (seqlen_k - seqlen_q)
    else:  # each row's own diagonal key (a packed batch's: flash_attention.api.varlen)
        rows = diagonal[i0:i1].to(device=s.device, dtype=torch.int64).unsqueeze(1)
    distance = (rows - torch.arange(seqlen_k, device=s.device).unsqueeze(0)).abs().to(s.dtype)
    if per_row:  # (seqlen_q, heads_q): each query row's own slopes (batch 1)
        slopes = slopes[i0:i1, h0 * group : h1 * group].T.reshape(1, h1 - h0, group, i1 - i0, 1)
    else:
        slopes = slopes[b0:b1, h0 * group : h1 * group].reshape(b1 - b0, h1 - h0, group, 1, 1)
    return s - slopes * distance


def _resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is not None:
        return float(softmax_scale)
    # With head_dim 0 every score is 0 whatever the scale; 1.0 avoids dividing by zero.
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """Minimal shape checks (full validation lives in spec.validate); returns (heads_kv, group)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k and v must have rank 4 (batch, seqlen, heads, head_dim); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv == 0:
        if heads_q != 0:
            raise ValueError(
                f"k must have at least one head when q has {heads_q}; got shape {tuple(k.shape)}"
            )
        return 0, 1
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    return heads_kv, heads_q // heads_kv


def window_allowed(
    seqlen_q: int, seqlen_k: int, window: tuple[int, int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) matrix of a sliding window ``(left, right)``, aligned like the causal
    mask (bottom-right): query ``i`` sees key ``j`` iff ``i + shift - left <= j <= i + shift + right`` with
    ``shift = seqlen_k - seqlen_q``; a negative bound is unbounded on that side. ``(-1, 0)`` is the causal
    mask, ``(-1, -1)`` no mask."""
    left, right = window
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return allowed


def alibi_bias(
    slopes: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """ALiBi's bias, (batch, heads, seqlen_q, seqlen_k): ``-slope * |i + shift - j|`` with ``shift =
    seqlen_k - seqlen_q`` (aligned like the causal mask); ``slopes`` (heads,) or (batch, heads)."""
    slopes = slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0).expand(batch, -1)
    rows = torch.arange(seqlen_q, device=slopes.device).unsqueeze(1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=slopes.device).unsqueeze(0)
    distance = (rows - cols).abs().to(dtype)
    return -slopes[:, :, None, None] * distance


def runs_alibi_diagonal(row_keys: torch.Tensor | None, causal: bool, alibi_slopes) -> torch.Tensor | None:
    """ALiBi's diagonal key of each row of a packed batch (``row_keys``, flash_attention.api.varlen.segments)
    when it is not the row's own index: for causal sequences, each row's run ends just past its diagonal, so
    the diagonal is the run's end - 1, whatever the sequences' query and key counts (the kernels' AlibiRuns,
    the form spec.validate.score_spec picks). None where the packed row's own index is the distance's origin
    (no runs, no ALiBi, or packed self-attention without causal)."""
    if row_keys is None or alibi_slopes is None or not causal:
        return None
    return row_keys[:, 1] - 1


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    key_range: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in ``compute_dtype`` (float64 by default), materialising every score.

    The score of query i and key j is ``s = softmax_scale * q_i . k_j``, then, in this order: the scalar
    score functions of ``score_values`` (spec.score_functions, by name and value; 0: off), e.g. soft-capping's
    ``c * tanh(s / c)``; ``alibi_slopes``: plus :func:`alibi_bias`; the
    masks (``causal``, ``window`` (:func:`window_allowed`), ``key_range``): -inf where a key is not seen.
    ``key_range`` (batch, 2): batch row b attends only keys ``key_range[b, 0] <= j < key_range[b, 1]``.
    ``sinks`` (heads_q,): a logit per head that joins every row's softmax denominator without a value
    (attention sinks), so a row's probabilities sum to less than one.
    ``dropout_keep`` (batch, heads_q, seqlen_q, seqlen_k) bool (:func:`flash_attention.dropout.keep_mask`,
    the kernels' mask) with ``dropout_p``: the probabilities are multiplied by ``keep / (1 - dropout_p)``
    before the values (the LSE is of the scores, before dropout, as the kernels return it).

    Returns:
        ``(out, lse)``: ``out`` of q's shape (batch, seqlen_q, heads_q, head_dim) and ``lse`` of shape
        (batch, heads_q, seqlen_q), the natural-log log-sum-exp of the final scores (and of the sink, when
        there is one); both in ``compute_dtype``.
    """
    _, group = _check_shapes(q, k, v)
    head_dim = q.shape[-1]
    scale = _resolve_scale(softmax_scale, head_dim)
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k = k.shape[1]

    qf = q.to(compute_dtype)
    # GQA by explicit repetition: the reference values obviousness over memory.
    kf = k.to(compute_dtype).repeat_interleave(group, dim=2)
    vf = v.to(compute_dtype).repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    scores = apply_scores(scores, values_of(**score_values))  # (spec.score_functions' math)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, compute_dtype)
    if causal:
        allowed = causal_allowed(seqlen_q, seqlen_k, device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if window is not None:
        allowed = window_allowed(seqlen_q, seqlen_k, window, device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if key_range is not None:
        allowed = key_range_allowed(key_range, seqlen_k)[:, None, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no key (including seqlen_k == 0)
    if sinks is not None:
        sink = sinks.to(compute_dtype)[None, :, None].expand(batch, heads_q, seqlen_q)
        lse = torch.logaddexp(lse, sink)
    # exp(-inf - -inf) is NaN; subtracting 0 instead for empty rows makes their probabilities exactly 0.
    lse_finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_finite.unsqueeze(-1))
    if dropout_keep is not None:
        if dropout_keep.shape != probs.shape:
            want, got = tuple(probs.shape), tuple(dropout_keep.shape)
            raise ValueError(f"dropout_keep must be (batch, heads_q, seqlen_q, seqlen_k) = {want}, got {got}")
        probs = probs * dropout_keep.to(compute_dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse


def _row_slopes(alibi_slopes: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Batch row b's ALiBi slopes: a (heads,) table is every row's; a (batch, heads) one gives row b's."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b : b + 1]


def attention_kvcache_reference(
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
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 truth of :func:`flash_attention.attention_with_kvcache`, one batch row at a time.

    Batch row ``b`` first writes its new tokens ``k[b, t]``, ``v[b, t]`` at cache position
    ``cache_seqlens[b] + t``, then its queries attend cache positions ``0 .. n_b - 1`` with
    ``n_b = cache_seqlens[b] + seqlen_new``, causal aligned to the bottom-right corner of that row's own
    (seqlen_q, n_b) score matrix, as are a sliding ``window``, ``alibi_slopes`` and the ``score_values``
    (:func:`attention_reference`'s).
    Position ``p`` of row ``b`` lives at ``k_cache[b, p]`` (contiguous) or at
    ``k_cache[block_table[b, p // page_size], p % page_size]`` (paged, page_size = k_cache.shape[1]).

    The caches are not modified: the appended copies are returned.

    Returns:
        ``(out, lse, k_cache_after, v_cache_after)``, ``out`` and ``lse`` in float64 as
        :func:`attention_reference` returns them.
    """
    kc, vc = k_cache.clone(), v_cache.clone()
    batch = q.shape[0]
    lengths = [int(cache_seqlens)] * batch if isinstance(cache_seqlens, int) else cache_seqlens.tolist()
    seqlen_new = 0 if k is None else k.shape[1]

    def where(b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first index, second index) into the cache of row b's positions."""
        if block_table is None:
            return torch.full_like(positions, b), positions
        page_size = kc.shape[1]
        return block_table[b].long()[positions // page_size], positions % page_size

    outs, lses = [], []
    for b in range(batch):
        if seqlen_new:
            idx = where(b, torch.arange(lengths[b], lengths[b] + seqlen_new))
            kc[idx] = k[b]
            vc[idx] = v[b]
        idx = where(b, torch.arange(lengths[b] + seqlen_new))
        o, lse = attention_reference(
            q[b : b + 1], kc[idx][None], vc[idx][None], causal=causal, softmax_scale=softmax_scale,
            window=window, alibi_slopes=_row_slopes(alibi_slopes, b), **score_values,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    if not batch:
        o, lse = attention_reference(q, kc[:0, :0], vc[:0, :0], causal=causal, softmax_scale=softmax_scale)
        return o, lse, kc, vc
    return torch.cat(outs), torch.cat(lses), kc, vc


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # The kernels keep the softmax and accumulators in fp32; float64 inputs deserve float64 arithmetic.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_sizes(batch: int, heads_kv: int, group: int, seqlen_q: int, seqlen_k: int, elem: int) -> tuple:
    """(batch, kv-head, query-row) chunk sizes whose score block stays within the budget.

    One unit is one query row of one kv head's whole query group: ``group * seqlen_k`` scores. Chunks grow
    query rows first (long contiguous matmuls), then kv heads, then batch.
    """
    unit = max(1, group * seqlen_k * elem)
    n = max(1, _SCORE_BUDGET_BYTES // unit)
    if n < seqlen_q:
        return 1, 1, n
    if n < seqlen_q * heads_kv:
        return 1, n // seqlen_q, seqlen_q
    return max(1, n // (seqlen_q * heads_kv)), heads_kv, seqlen_q


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    key_range: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention through PyTorch with the kernel's semantics, on any device PyTorch supports.

    ``dropout_p`` > 0 drops attention probabilities exactly as the kernels do for the same ``dropout_seed``
    (a :func:`flash_attention.dropout.draw_seed` pair; the same elements on every device), scaling the kept
    ones by 1 / (1 - p); the LSE is that of the undropped softmax.

    ``key_range`` (batch, 2): batch row b attends only keys ``key_range[b, 0] <= j < key_range[b, 1]``.
    ``window`` (left, right): the sliding window of :func:`window_allowed` (-1: unbounded on that side).
    ``score_values`` and ``alibi_slopes``: the score functions of :func:`attention_reference`;
    ``alibi_diagonal`` (seqlen_q,) integers, ALiBi's distance measured from each row's own diagonal key
    instead of ``i + seqlen_k - seqlen_q`` (a packed batch's rows:
    :func:`flash_attention.api.varlen.segments`).
    A packed batch (batch 1) may give ``alibi_slopes`` as (seqlen_q, heads_q), a slope per query row (the
    packed sequences' own slopes).

    Scores, softmax and accumulation are float32 (float64 for float64 inputs); ``out`` has q's dtype and is
    written in place when given; the LSE is float32 of shape (batch, heads_q, seqlen_q). At most about
    ``_SCORE_BUDGET_BYTES`` of scores exist at once (without autograd; when gradients are recorded, every
    chunk's intermediates are kept for the backward pass). K and V are never repeated across the query
    heads of a GQA group: each group's queries are stacked into one matmul against its kv head.

    Returns:
        ``(out, lse)`` with ``lse`` None unless ``return_lse``.
    """
    heads_kv, group = _check_shapes(q, k, v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = _resolve_scale(softmax_scale, head_dim)
    cdtype = _compute_dtype(q.dtype)

    if out is None:  # (q's shape with v's head_dim, which may differ from q's and k's)
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
    lse = (
        torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    )

    if batch == 0 or seqlen_q == 0 or heads_q == 0:
        return out, lse
    if seqlen_k == 0:
        # No keys at all: every row is empty. Written explicitly so no matmul over an empty dim is needed.
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse

    # In-place softmax halves the peak memory of a chunk but would corrupt tensors autograd saved.
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    elem = torch.finfo(cdtype).bits // 8
    b_step, h_step, q_step = _chunk_sizes(batch, heads_kv, group, seqlen_q, seqlen_k, elem)
    keys_allowed = None if key_range is None else key_range_allowed(key_range, seqlen_k)
    drop = _dropout_args(dropout_p, dropout_seed, heads_q)
    score = _score_args(score_values, alibi_slopes, batch, heads_q, cdtype, alibi_diagonal)

    for b0 in range(0, batch, b_step):
        b1 = min(batch, b0 + b_step)
        for h0 in range(0, heads_kv, h_step):
            h1 = min(heads_kv, h0 + h_step)
            # (b, h, seqlen_k, d), contiguous, in the compute dtype: one copy per (batch, head) chunk, reused
            # by every query chunk (a strided view would make matmul copy it again for each query chunk).
            # K enters the matmul as a transposed view, which BLAS reads without a copy.
            kc = k[b0:b1, :, h0:h1].permute(0, 2, 1, 3).to(cdtype).contiguous()
            vc = v[b0:b1, :, h0:h1].permute(0, 2, 1, 3).to(cdtype).contiguous()
            for i0 in range(0, seqlen_q, q_step):
                i1 = min(seqlen_q, i0 + q_step)
                _attend_chunk(
                    q,
                    kc,
                    vc,
                    out,
                    lse,
                    b0,
                    b1,
                    h0,
                    h1,
                    i0,
                    i1,
                    group,
                    scale,
                    causal,
                    cdtype,
                    needs_grad,
                    None if keys_allowed is None else keys_allowed[b0:b1],
                    drop,
                    window,
                    score,
                )
    return out, lse


def _attend_chunk(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    b0: int,
    b1: int,
    h0: int,
    h1: int,
    i0: int,
    i1: int,
    group: int,
    scale: float,
    causal: bool,
    cdtype: torch.dtype,
    needs_grad: bool,
    keys_allowed: torch.Tensor | None = None,
    drop: tuple | None = None,
    window: tuple[int, int] | None = None,
    score: tuple | None = None,
) -> None:
    nb, nh, rows = b1 - b0, h1 - h0, i1 - i0
    seqlen_q, head_dim = q.shape[1], q.shape[3]
    seqlen_k = kc.shape[2]
    # Query heads h0*group .. h1*group belong to kv heads h0 .. h1, `group` consecutive ones each.
    qc = q[b0:b1, i0:i1, h0 * group : h1 * group].reshape(nb, rows, nh, group, head_dim)
    # -> (b, h_kv, group * rows, d): all queries sharing a kv head form one matmul operand.
    qc = qc.permute(0, 2, 3, 1, 4).to(cdtype).reshape(nb, nh, group * rows, head_dim)

    s = torch.matmul(qc, kc.transpose(-1, -2)).view(nb, nh, group, rows, seqlen_k)
    # Scale before masking (a negative scale would turn a -inf mask into +inf) and before the row max.
    s = s * scale if needs_grad else s.mul_(scale)
    s = _apply_score(s, score, (b0, b1, h0, h1, i0, i1), group, seqlen_q)
    allowed = _rows_allowed(i0, i1, seqlen_q, seqlen_k, causal, window, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf")) if needs_grad else s.masked_fill_(~allowed, float("-inf"))
    if keys_allowed is not None:
        allowed = keys_allowed[:, None, None, None, :]  # (b, 1, 1, 1, seqlen_k)
        s = s.masked_fill(~allowed, float("-inf")) if needs_grad else s.masked_fill_(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    # Rows with every score -inf (no key allowed) would give -inf - -inf = NaN; use 0 there so their
    # probabilities are exp(-inf) = 0 and their LSE is 0 + log(0) = -inf.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    if needs_grad:
        p = torch.exp(s - m)
    else:
        p = s.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    row_lse = m + torch.log(denom)
    # Empty rows have denom 0: divide by 1 instead so they stay exactly 0.
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    p = p / safe if needs_grad else p.div_(safe)
    if drop is not None:
        keep = _chunk_keep(drop, (b0, b1, h0, h1, i0, i1), group, seqlen_k, q.device)
        p = p * keep * drop[2] if needs_grad else p.mul_(keep).mul_(drop[2])

    o = torch.matmul(p.view(nb, nh, group * rows, seqlen_k), vc)  # (b, h_kv, group * rows, d_v)
    dv = vc.shape[3]
    o = o.view(nb, nh, group, rows, dv).permute(0, 3, 1, 2, 4).reshape(nb, rows, nh * group, dv)
    out[b0:b1, i0:i1, h0 * group : h1 * group] = o.to(out.dtype)
    if lse is not None:
        lse[b0:b1, h0 * group : h1 * group, i0:i1] = row_lse.view(nb, nh * group, rows).to(torch.float32)


def attention_backward_torch(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    key_range: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention_torch` from its saved ``out`` and ``lse``.

    With dropout (mask Z from ``dropout_seed``, rp = 1 / (1 - p)): dV = (P Z rp)^T dO and
    dS = P * (dP Z rp - D); D = rowsum(dO * O) as without it.

    The FlashAttention-2 backward, with P recomputed from the LSE instead of stored::

        P  = exp(S * scale - lse)        D  = rowsum(dO * O)
        dV = P^T dO                      dP = dO V^T
        dS = P * (dP - D)                dQ = scale * dS K,   dK = scale * dS^T Q

    ``dout`` and ``out`` have q's shape, ``lse`` is (batch, heads_q, seqlen_q) as :func:`attention_torch`
    returns it; ``causal``, ``softmax_scale``, ``key_range``, ``window`` and the score function's
    arguments must be those of the forward call. The arithmetic is float32 (float64 for float64 inputs) in
    the same (batch, kv head, query row) chunks as the forward, sized so that the two score-sized blocks
    alive at once (P and dP, which becomes dS in place) stay within ``_SCORE_BUDGET_BYTES`` together. dK
    and dV of a kv head sum its whole query group's contributions through one matmul (the group's queries
    are stacked), so K and V are never repeated. A row whose LSE is -inf (it attended no key) has P = 0:
    it contributes nothing and gets dQ = 0, never NaN.

    float64 inputs: the LSE is stored in float32, whose rounding (about 6e-8 relative) would cap the
    gradients' precision far above float64's; each recomputed row of P is therefore divided by its own sum,
    which restores P's float64 accuracy and changes nothing else. With attention ``sinks`` (heads_q,) (``out``
    and ``lse`` then the forward's with the sinks, :mod:`flash_attention.sinks`), a row's probabilities sum
    to less than one: its sum then counts the sink's term, ``exp(sink - lse)``, and ``sinks`` must be given
    (without them the rows would be forced to sum to one: gradients off by the sinks' share).

    Returns new contiguous tensors with the shapes and dtypes of q, k and v. Not differentiable itself (it
    is a backward pass): it runs without recording autograd.
    """
    heads_kv, group = _check_shapes(q, k, v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = _resolve_scale(softmax_scale, head_dim)
    cdtype = _compute_dtype(q.dtype)

    if batch == 0 or seqlen_q == 0 or heads_q == 0 or seqlen_k == 0 or head_dim == 0:
        # No (query, key) pair at all: every gradient is zero (and no matmul over an empty dim is needed).
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))

    # Every element is written below: dq per query chunk, dk/dv per (batch, kv head) chunk.
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    elem = torch.finfo(cdtype).bits // 8
    b_step, h_step, q_step = _chunk_sizes(batch, heads_kv, group, seqlen_q, seqlen_k, 2 * elem)
    keys_allowed = None if key_range is None else key_range_allowed(key_range, seqlen_k)
    drop = _dropout_args(dropout_p, dropout_seed, heads_q)
    score = _score_args(score_values, alibi_slopes, batch, heads_q, cdtype, alibi_diagonal)

    with torch.no_grad():
        for b0 in range(0, batch, b_step):
            b1 = min(batch, b0 + b_step)
            for h0 in range(0, heads_kv, h_step):
                h1 = min(heads_kv, h0 + h_step)
                # (b, h_kv, seqlen_k, d) in the compute dtype, shared by every query chunk, as in the forward.
                kc = k[b0:b1, :, h0:h1].permute(0, 2, 1, 3).to(cdtype).contiguous()
                vc = v[b0:b1, :, h0:h1].permute(0, 2, 1, 3).to(cdtype).contiguous()
                # dK/dV accumulate over the query chunks in the compute dtype, rounded once at the end.
                dkc = torch.zeros_like(kc)
                dvc = torch.zeros_like(vc)
                for i0 in range(0, seqlen_q, q_step):
                    i1 = min(seqlen_q, i0 + q_step)
                    _backward_chunk(
                        (dout, q, out, lse),
                        kc,
                        vc,
                        dq,
                        dkc,
                        dvc,
                        (b0, b1, h0, h1, i0, i1),
                        group,
                        scale,
                        causal,
                        cdtype,
                        None if keys_allowed is None else keys_allowed[b0:b1],
                        drop,
                        window,
                        score,
                        sinks,
                    )
                dk[b0:b1, :, h0:h1] = dkc.permute(0, 2, 1, 3).to(dk.dtype)
                dv[b0:b1, :, h0:h1] = dvc.permute(0, 2, 1, 3).to(dv.dtype)
    return dq, dk, dv


def _backward_chunk(
    row_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kc: torch.Tensor,
    vc: torch.Tensor,
    dq: torch.Tensor,
    dkc: torch.Tensor,
    dvc: torch.Tensor,
    bounds: tuple[int, int, int, int, int, int],
    group: int,
    scale: float,
    causal: bool,
    cdtype: torch.dtype,
    keys_allowed: torch.Tensor | None,
    drop: tuple | None = None,
    window: tuple[int, int] | None = None,
    score: tuple | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One (batch, kv head, query row) chunk of :func:`attention_backward_torch`: writes its rows of dq and
    adds its contributions to the chunk's dK/dV accumulators ``dkc``/``dvc`` (b, h_kv, seqlen_k, d)."""
    dout, q, out, lse = row_tensors
    b0, b1, h0, h1, i0, i1 = bounds
    nb, nh, rows = b1 - b0, h1 - h0, i1 - i0
    seqlen_q, head_dim = q.shape[1], q.shape[3]
    seqlen_k = kc.shape[2]

    def stacked(t: torch.Tensor) -> torch.Tensor:
        # (b, rows, h_kv * group, d) -> (b, h_kv, group * rows, d): a kv head's queries form one operand
        # (d: q's head_dim, or v's for dO and O)
        d = t.shape[3]
        t = t[b0:b1, i0:i1, h0 * group : h1 * group].reshape(nb, rows, nh, group, d)
        return t.permute(0, 2, 3, 1, 4).to(cdtype).reshape(nb, nh, group * rows, d)

    qc, doc, oc = stacked(q), stacked(dout), stacked(out)
    row_lse = lse[b0:b1, h0 * group : h1 * group, i0:i1].to(cdtype).reshape(nb, nh, group * rows, 1)
    # A row with no visible key has LSE -inf and every score -inf; -inf - -inf would be NaN. Subtracting
    # +inf instead gives exp(-inf) = 0 for every score, so the row contributes nothing.
    row_lse = torch.where(torch.isneginf(row_lse), torch.full_like(row_lse, float("inf")), row_lse)

    s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)  # scale before masking, as in the forward
    grad = None  # the scalar functions' derivative (soft-capping's 1 - (capped / cap)^2; ALiBi's is 1)
    if score is not None:
        values, slopes, diagonal, per_row = score
        view = s.view(nb, nh, group, rows, seqlen_k)
        if values:
            view, grad = apply_scores_with_slope(view, values)
            grad = grad.reshape(s.shape)
        s = _apply_score(view, ((), slopes, diagonal, per_row), bounds, group, seqlen_q).reshape(s.shape)
    masked = s.view(nb, nh, group, rows, seqlen_k)
    allowed = _rows_allowed(i0, i1, seqlen_q, seqlen_k, causal, window, q.device)
    if allowed is not None:
        masked.masked_fill_(~allowed, float("-inf"))
    if keys_allowed is not None:
        masked.masked_fill_(~keys_allowed[:, None, None, None, :], float("-inf"))
    p = s.sub_(row_lse).exp_()
    if cdtype == torch.float64:
        denom = p.sum(dim=-1, keepdim=True)
        if sinks is not None:  # (the row's sink, query head h = h_kv * group + j: stacked as the rows are)
            sink = sinks[h0 * group : h1 * group].to(cdtype).view(1, nh, group, 1).expand(nb, nh, group, rows)
            denom = denom + torch.exp(sink.reshape(nb, nh, group * rows, 1) - row_lse)
        p.div_(torch.where(denom == 0, torch.ones_like(denom), denom))

    d = (doc * oc).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O), (b, h_kv, group * rows, 1)
    if drop is None:
        dvc.add_(torch.matmul(p.transpose(-1, -2), doc))
        ds = torch.matmul(doc, vc.transpose(-1, -2)).sub_(d).mul_(p)  # dS = P * (dP - D), in dP's memory
    else:
        zr = _chunk_keep(drop, bounds, group, seqlen_k, q.device).to(cdtype).mul_(drop[2])
        zr = zr.view(nb, nh, group * rows, seqlen_k)
        dvc.add_(torch.matmul((p * zr).transpose(-1, -2), doc))
        ds = torch.matmul(doc, vc.transpose(-1, -2)).mul_(zr).sub_(d).mul_(p)
    if grad is not None:
        ds.mul_(grad)
    dkc.add_(torch.matmul(ds.transpose(-1, -2), qc), alpha=scale)
    dqc = torch.matmul(ds, kc).mul_(scale).view(nb, nh, group, rows, head_dim)
    dqc = dqc.permute(0, 3, 1, 2, 4).reshape(nb, rows, nh * group, head_dim)
    dq[b0:b1, i0:i1, h0 * group : h1 * group] = dqc.to(dq.dtype)


def _dropout_args(dropout_p: float, dropout_seed, heads_q: int) -> tuple | None:
    """(key, threshold, 1 / (1 - p), heads_q) of a dropout call, or None without dropout."""
    if not dropout_p:
        return None
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (flash_attention.dropout.draw_seed())")
    key = dropout_key(*seed_pair(dropout_seed))
    return key, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), heads_q


def _chunk_keep(drop: tuple, bounds: tuple, group: int, seqlen_k: int, device) -> torch.Tensor:
    """The kernels' keep mask of one chunk, shaped (b, h_kv, group, rows, seqlen_k)."""
    key, threshold, _, heads_q = drop
    b0, b1, h0, h1, i0, i1 = bounds
    b = torch.arange(b0, b1, device=device, dtype=torch.int64).view(-1, 1, 1, 1, 1)
    qh = torch.arange(h0 * group, h1 * group, device=device, dtype=torch.int64).view(1, h1 - h0, group, 1, 1)
    i = torch.arange(i0, i1, device=device, dtype=torch.int64).view(1, 1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device, dtype=torch.int64).view(1, 1, 1, 1, -1)
    return keep_elements(key, threshold, b * heads_q + qh, i, j)
