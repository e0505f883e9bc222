"""Variable-length batches: attention over packed sequences (``attention_varlen``).

Sequences of different lengths are packed one after another along the token axis, as training pipelines
pack documents (``DataCollatorWithFlattening``) and serving engines pack prompts: q is (total_q, heads_q,
head_dim), k and v (total_k, heads_kv, head_dim), and ``cu_seqlens_q`` / ``cu_seqlens_k`` (batch + 1 int32
offsets on the device) say where each sequence starts. Sequence b's queries attend only its own keys, with
causal and a sliding window aligned to its own bottom-right corner, exactly as :func:`attention` on that
sequence alone.

How the kernels compute it: the packed tensors are one batch row, and each query row's visible keys are one
contiguous run of that row, [row_keys[i, 0], row_keys[i, 1]) (and each key's visible rows the run
[key_rows[j, 0], key_rows[j, 1])). :func:`segments` builds both arrays on the device from the offsets with a
few elementwise kernels (no host synchronisation: the call can be captured in a CUDA graph or compiled), and
every kernel family's segments build (``csrc/include/fa/visible_keys.cuh``, SegmentKeys) skips the key
blocks outside a tile's runs and masks within the tiles that straddle a run's end. The warp-specialized
Hopper forward also takes a table of query tiles (``flash_attention.ops.query_tiles``): each sequence's
rows cut into tiles of their own, with key blocks starting at the sequence's first key, so that it runs
each sequence as a dense batch would. The other kernels tile the packed row as one sequence: a query tile
that straddles two sequences visits the key blocks of both (masked), about one extra tile per sequence
boundary.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..spec import fp8 as _fp8
from ..spec.validate import check_window
from ..spec.validate_varlen import check_offset_values, check_offsets_tensor, checks_offset_values
from .attention import attention
from .few_queries import route_varlen, varlen_rows

__all__ = ["alibi_diagonals", "attention_varlen", "clear_cache", "row_slopes", "segments"]

#: Segments of recent calls, by their offsets' identity and version (every layer of a model passes the same
#: tensors): a hit skips the dozen small kernels that build them. Each entry holds its offsets tensors too:
#: an address and a version name a tensor's contents only while that tensor lives (a freed tensor's memory
#: goes to the next allocation, whose version starts at 0 again: a new offsets tensor at a recycled address
#: read another batch's runs, kernel log 94).
_CACHE: OrderedDict[tuple, tuple[tuple[torch.Tensor, torch.Tensor], tuple]] = OrderedDict()
_CACHE_SIZE = 8


def clear_cache() -> None:
    """Forget the runs (and tables) built for earlier offsets. They are found again by the offsets tensors'
    address and version, which PyTorch's in-place operations bump; offsets rewritten where PyTorch does not
    see it (another library's kernel writing through the pointer, or a write through ``.data``) keep their
    version, and would find the runs of their old values: call this after such a write, or pass the new
    offsets as a new tensor."""
    _CACHE.clear()


def segments(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of a packed batch: ``(row_keys, key_rows)``, contiguous int32 (total_q, 2) and (total_k, 2).

    Sequence b owns query rows [cu_q[b], cu_q[b+1]) and keys [cu_k[b], cu_k[b] + n_b) with n_b =
    ``seqused_k[b]`` (its keys in use; default all of cu_k[b+1] - cu_k[b]). Its query i (0-based) sees its
    key j iff j - (n_b - m_b) is within the window of i (causal: the window (-1, 0)), m_b its query count:
    the alignment of :func:`flash_attention.attention`. Rows after the last sequence and keys no row sees
    get empty runs placed so that both bounds stay nondecreasing (the kernels' block ranges rely on it).
    """
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
    batch = cu_q.numel() - 1
    if batch == 0:  # no sequence: every row and key has an empty run
        zeros = (torch.zeros(n, 2, dtype=torch.int32, device=device) for n in (total_q, total_k))
        return tuple(zeros)  # type: ignore[return-value]
    left, right = (-1, 0 if causal else -1) if window is None else window
    if causal and window is not None:
        right = 0 if right < 0 else min(right, 0)
    len_q = cu_q[1:] - cu_q[:-1]
    len_k = cu_k[1:] - cu_k[:-1]
    used = _used_keys(len_k, seqused_k)
    shift = used - len_q

    rows, doc, d = _query_rows(cu_q, total_q, shift)
    n = used[doc]
    hi = n if right < 0 else torch.minimum(n, d + right + 1)
    lo = torch.zeros_like(d) if left < 0 else (d - left).clamp_min(0)
    lo = torch.minimum(lo, n)
    hi = torch.maximum(hi, lo)
    # (torch.where, not a boolean index: that would read the count back to the host.)
    outside = rows >= cu_q[-1]  # rows no sequence owns: no key, at the end of the keys
    base = cu_k[doc]
    row_keys = torch.stack((base + lo, base + hi), dim=1)
    row_keys = torch.where(outside.unsqueeze(1), cu_k[-1], row_keys)

    # Each key's sequence and the query rows that see it (the same relation, solved for i).
    keys = torch.arange(total_k, device=device)
    kdoc = _sequence_of_each(cu_k, total_k)
    j = keys - cu_k[kdoc]
    m = len_q[kdoc]
    dk = j - shift[kdoc]  # the row whose diagonal key is j
    qlo = torch.zeros_like(dk) if right < 0 else (dk - right).clamp_min(0)
    qhi = m if left < 0 else torch.minimum(m, dk + left + 1)
    qlo = torch.minimum(qlo, m)
    qhi = torch.maximum(qhi, qlo)
    unused = (j >= used[kdoc]) | (keys >= cu_k[-1])  # keys in no sequence or past its seqused_k
    qlo = torch.where(unused, m, qlo)
    qhi = torch.where(unused, m, qhi)
    qbase = cu_q[kdoc]
    key_rows = torch.stack((qbase + qlo, qbase + qhi), dim=1)
    key_rows = torch.where((keys >= cu_k[-1]).unsqueeze(1), cu_q[-1], key_rows)
    return row_keys.to(torch.int32).contiguous(), key_rows.to(torch.int32).contiguous()


def _sequence_of_each(cu: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each packed position 0..total-1 under int64 offsets ``cu`` of >= 1 sequence: the count
    of sequence ends at or before it, clamped to the last sequence (positions past it: the last one), int64.

    The ends are scattered into a histogram and summed, not looked up with torch.searchsorted: under
    torch.compile, Inductor (torch 2.11 on CUDA) fails to lower searchsorted over a slice of a computed
    buffer (``cu[1:]`` of the int64 offsets: NotImplementedError SliceView.get_stride)."""
    ends = cu[1:].clamp(0, total)  # an end at `total` or past counts for no position
    hist = torch.zeros(total + 1, dtype=torch.int64, device=cu.device)
    hist = hist.scatter_add(0, ends, torch.ones_like(ends))
    return hist[:total].cumsum(0).clamp_max(cu.numel() - 2)


def _query_rows(cu_q: torch.Tensor, total_q: int, shift: torch.Tensor):
    """Each query row's index, its sequence (rows past the last sequence: the last one) and its diagonal key,
    0-based in its sequence (i + shift of its sequence), int64 (total_q,) each, for a batch of >= 1."""
    rows = torch.arange(total_q, device=cu_q.device)
    doc = _sequence_of_each(cu_q, total_q)
    return rows, doc, rows - cu_q[doc] + shift[doc]


def _used_keys(len_k: torch.Tensor, seqused_k: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's keys in use: seqused_k clamped to [0, its keys], else all of them."""
    return len_k if seqused_k is None else torch.minimum(seqused_k.to(torch.int64).clamp_min(0), len_k)


def alibi_diagonals(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query row's ALiBi diagonal key in the packed keys, int32 (total_q,): cu_k[b] + i + n_b - m_b for
    row i (0-based) of sequence b, with n_b its used keys and m_b its queries (the alignment of
    :func:`segments`); rows after the last sequence get cu_k[-1] (they see no key). ALiBi's distance of row
    i to key j is |diagonal - j|. For sequences without causal, whose runs do not end at the diagonal, and
    whose query and key offsets differ (else the packed row's own index is the diagonal)."""
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
    batch = cu_q.numel() - 1
    if batch == 0:
        return torch.zeros(total_q, dtype=torch.int32, device=device)
    len_q = cu_q[1:] - cu_q[:-1]
    used = _used_keys(cu_k[1:] - cu_k[:-1], seqused_k)
    rows, doc, d = _query_rows(cu_q, total_q, used - len_q)
    diagonal = cu_k[doc] + d
    diagonal = torch.where(rows >= cu_q[-1], cu_k[-1], diagonal)  # (torch.where: no host read)
    return diagonal.to(torch.int32).contiguous()


def _check_alibi_slopes(alibi_slopes: torch.Tensor, batch: int, q: torch.Tensor) -> None:
    """attention_varlen's shapes of ALiBi's slopes, (heads_q,) or (batch, heads_q) of the offsets' batch,
    float32 on q's device; raises naming the argument, as attention()'s checks do."""
    heads_q = q.shape[1]
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, heads_q) = ({batch}, "
            f"{heads_q}); got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor of shape (heads_q,) or (batch, heads_q)")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on the device of q ({q.device})")


def row_slopes(
    alibi_slopes: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    total_q: int,
    *,
    row_sequence: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence ALiBi slopes (batch, heads_q) as each query row's: float32 contiguous (total_q, heads_q),
    row i of sequence b holding alibi_slopes[b] (rows after the last sequence: the last sequence's; they see
    no key). The kernels' per-row builds read row i's slope for head h at [i, h]. ``row_sequence``: each
    row's sequence if known (attention_varlen keeps it with the runs), else computed from the offsets."""
    if alibi_slopes.dim() != 2 or alibi_slopes.shape[0] != cu_seqlens_q.numel() - 1:
        raise ValueError(
            f"alibi_slopes must be (batch, heads_q) with batch = {cu_seqlens_q.numel() - 1} (the offsets' "
            f"sequences); got {tuple(alibi_slopes.shape)}"
        )
    heads = alibi_slopes.shape[1]
    if alibi_slopes.shape[0] == 0:  # no sequence: no row sees a key
        return torch.zeros(total_q, heads, dtype=torch.float32, device=alibi_slopes.device)
    if row_sequence is None:
        row_sequence = _sequence_of_each(cu_seqlens_q.to(torch.int64), total_q)
    return alibi_slopes.index_select(0, row_sequence)  # (a new contiguous tensor)


def _held_by_runs(runs: tuple, name: str, make):
    """A tensor made from the offsets once per runs and held by them as attribute ``name`` (the runs are
    cached by the offsets: flash_attention.api.varlen's table of diagonals, each row's sequence). Under
    torch.compile, ops of the graph, uncached."""
    held = getattr(runs[0], name, None)
    if held is None:
        held = make()
        if not torch.compiler.is_compiling():
            setattr(runs[0], name, held)
    return held


def _with_tiles(made: tuple[torch.Tensor, torch.Tensor], cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple:
    """The runs, noting the offsets that ops.query_tiles cuts the rows and keys by (attributes of the
    tensors, as ``_typical_lengths``: they ride through the custom op's eager call; under torch.compile the
    kernels tile the packed row instead)."""
    # Copies, taken with the runs: the tables are made from them at the first launch that needs them (the
    # backward's, after the forward), and must describe the offsets the runs were made from even if the
    # caller refills its offsets tensor in place in between (a new version makes new runs, not new tables
    # for these). (A device copy: no host read.)
    made[0]._cu_q, made[1]._cu_k = cu_q.clone(), cu_k.clone()
    made[0]._query_tiles, made[1]._key_tiles = {}, {}
    return made


def _cached_segments(cu_q, cu_k, total_q, total_k, causal, window, seqused_k, typical):
    def ident(t):
        return None if t is None else (t.data_ptr(), t._version, t.numel(), t.device)

    # While torch.compile traces, the runs are ops of the graph (built from the offsets at every run of it),
    # with no cache and no tensor attributes: an address is data the trace cannot key on, and the kernels
    # then tile the packed row (ops.plans reads no typical lengths or offsets from the runs).
    if torch.compiler.is_compiling():
        return segments(cu_q, cu_k, total_q, total_k, causal=causal, window=window, seqused_k=seqused_k)
    # While a CUDA graph is captured, the runs are built inside it from the offsets' buffers (a replay after
    # new offsets were copied into them must see them), and the graph's private memory is cached nowhere.
    capturing = cu_q.is_cuda and torch.cuda.is_current_stream_capturing()
    # The offsets' values are checked where the runs are built: a cache hit's offsets (the same tensors at
    # the same version) passed when its runs were made, so repeated calls pay nothing. (Whether the check
    # ran is part of the key: turning it on later checks offsets whose runs were made unchecked.)
    checked = checks_offset_values(cu_q.device, capturing)
    key = None
    if not capturing:
        key = (ident(cu_q), ident(cu_k), ident(seqused_k), total_q, total_k, causal, window, typical, checked)
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit[0]
    if checked:
        check_offset_values(cu_q, cu_k, total_q, total_k, seqused_k)
    made = segments(cu_q, cu_k, total_q, total_k, causal=causal, window=window, seqused_k=seqused_k)
    # The lengths the kernels' configurations are chosen by (ops.plans.segment_lengths): a tile shape for
    # the sequences, not for one sequence of the packed length. (An attribute of the tensor, so it rides
    # through the custom op's eager call; under torch.compile the packed lengths choose.)
    made[0]._typical_lengths = typical
    _with_tiles(made, cu_q, cu_k)
    if key is not None:
        _CACHE[key] = (made, (cu_q, cu_k, seqused_k))  # (the offsets held: see _CACHE)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return made


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of sequences of different lengths (the FlashAttention library's
    ``flash_attn_varlen_func``).

    Args:
        q: (total_q, heads_q, head_dim), the sequences' queries one after another.
        k, v: (total_k, heads_kv, head_dim) and (total_k, heads_kv, head_dim_v), their keys and values
            (heads_q a multiple of heads_kv: GQA; v's head_dim may differ from q's and k's, as in
            :func:`flash_attention.attention`).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets on q's device, nondecreasing from 0:
            sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (its keys likewise).
            Sequences of length 0 are allowed. The last offset may stop short of the tensors but not pass
            them (cu_seqlens_q[-1] <= total_q, cu_seqlens_k[-1] <= total_k): rows past cu_seqlens_q[-1]
            attend nothing (output 0), keys past cu_seqlens_k[-1] are attended by none.
        max_seqlen_q, max_seqlen_k: optional hints, the longest sequence's lengths: the kernels' tile shapes
            are chosen by them (else by the mean length). Never needed for correctness, and not checked
            against the offsets (a hint off the real lengths costs speed only).
        seqused_k: optional int32 (batch,): sequence b uses only its first seqused_k[b] keys (a cache
            with room to spare), 0 <= seqused_k[b] <= cu_seqlens_k[b+1] - cu_seqlens_k[b]; causal then
            aligns to that length.
        causal, softmax_scale, window, softcap, sinks, dropout_p, dropout_seed, deterministic: as in
            :func:`flash_attention.attention`, per sequence (causal and the window aligned to each
            sequence's own bottom-right corner).
        alibi_slopes: ALiBi, float32 (heads_q,), or (batch, heads_q) for slopes of each sequence's own:
            each sequence's own ``-slope * |i + shift - j|`` (shift: its used key count minus its query
            count), for any query and key counts, ``seqused_k`` and window. The kernels measure the distance
            from each row's diagonal key: with ``causal`` its run of keys ends just past it; in packed
            self-attention (the same offsets tensor for queries and keys, no ``seqused_k``) it is the row's
            own index; otherwise from a table of each row's diagonal (:func:`alibi_diagonals`, made once
            per runs, which are cached by the offsets). Per-sequence slopes reach the kernels as a
            (total_q, heads_q) table of each row's (:func:`row_slopes`, made at every call: the slopes may
            change between calls).
        return_lse: also return the float32 (heads_q, total_q) log-sum-exp of each row.
        q_descale, k_descale, v_descale: FP8 inputs, as :func:`flash_attention.attention` takes them (e4m3 q,
            k and v; a descale per tensor or per (sequence, kv head), shape (batch, heads_kv); bfloat16
            output).

    Returns:
        (total_q, heads_q, head_dim) output, with ``return_lse`` also the LSE; differentiable with respect
        to q, k, v (and sinks) as :func:`flash_attention.attention` is.

    Not taken: ``key_range`` (``seqused_k`` is the packed form of a key range).

    A call with about one query per sequence and many keys that autograd does not record (a decoding step
    over sequences of different lengths) runs on the split-KV decode kernels, as ``attention_with_kvcache``
    would (flash_attention.api.few_queries.route_varlen); its results agree with the usual kernels' within
    rounding, not bit for bit.

    The offsets' values (``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``): on the CPU they are checked
    against the contract above, and a break raises ValueError naming the argument and its first bad index.
    On a GPU they are not read on the host (no synchronisation: the call is CUDA-graph and
    ``torch.compile`` friendly), and offsets that break it give wrong results, never out-of-bounds accesses
    (the kernels clamp every row and key they read to the packed tensors); ``FLASH_ATTENTION_CHECK_OFFSETS=1``
    checks them there too, with the same ops on the device and one synchronisation per new offsets tensor
    (skipped while a CUDA graph is captured). Under ``torch.compile`` they are never checked (the traced
    graph does not know them). The runs made from them (and the check) are cached by the offsets tensors'
    address and version: after writing new offsets into a tensor behind PyTorch's back (which does not bump
    its version), call :func:`clear_cache`.

    Raises:
        TypeError, ValueError: on invalid arguments (the offsets' values as said above), naming the argument.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a (total_q, heads_q, head_dim) tensor")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            dims = "head_dim_v" if name == "v" else "head_dim"
            raise ValueError(f"{name} must be a (total_k, heads_kv, {dims}) tensor")
    offsets = "batch + 1 offsets"
    n_offsets = check_offsets_tensor("cu_seqlens_q", cu_seqlens_q, q.device, offsets)
    if n_offsets < 1:
        raise ValueError(f"cu_seqlens_q must hold batch + 1 >= 1 offsets; got {n_offsets}")
    if check_offsets_tensor("cu_seqlens_k", cu_seqlens_k, q.device, offsets) != n_offsets:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got {n_offsets} "
            f"and {cu_seqlens_k.numel()}"
        )
    if seqused_k is not None:
        used = check_offsets_tensor("seqused_k", seqused_k, q.device, "each sequence's keys in use")
        if used != n_offsets - 1:
            raise ValueError(f"seqused_k must have shape (batch,) = ({n_offsets - 1},)")
    descales = (q_descale, k_descale, v_descale)
    if _fp8.is_fp8_call(q, descales):
        # e4m3 inputs (as attention()'s): checked and dequantized to bf16 (a per-(batch, kv head) descale by
        # each row's sequence, made on the device from the offsets); the call goes on as a bf16 call.
        _fp8.check_fp8(q, k, v, descales, batch=n_offsets - 1)
        rows = [
            None if n_offsets < 2 else _sequence_of_each(cu.to(torch.int64), t.shape[0])
            for cu, t in ((cu_seqlens_q, q), (cu_seqlens_k, k), (cu_seqlens_k, v))
        ]
        if n_offsets < 2:  # (no sequence: nothing is attended, and a (0, heads_kv) descale scales nothing)
            descales = tuple(d if d is not None and d.numel() == 1 else None for d in descales)
        heads_kv = k.shape[1]
        q, k, v = (
            _fp8.dequantize(t, d, heads_kv, r) for t, d, r in zip((q, k, v), descales, rows, strict=True)
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int or None; got {value!r}")
    per_sequence = isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2
    if isinstance(alibi_slopes, torch.Tensor):  # (the (heads_q,) form's other checks: attention()'s)
        _check_alibi_slopes(alibi_slopes, n_offsets - 1, q)
    window = check_window(window)
    if window is not None and causal:
        window = (window[0], 0 if window[1] < 0 else min(window[1], 0))
    batch = max(1, n_offsets - 1)
    typical = (
        max_seqlen_q or max(1, -(-q.shape[0] // batch)),  # (the hint, else the mean: no host read)
        max_seqlen_k or max(1, -(-k.shape[0] // batch)),
    )
    runs = _cached_segments(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], bool(causal), window, seqused_k, typical
    )
    packed_self = cu_seqlens_q is cu_seqlens_k and seqused_k is None and q.shape[0] == k.shape[0]
    if per_sequence:  # a slope per query row (the "..._rows" builds)
        # Each row's sequence is held by the runs: a call then costs one index_select (made from the offsets
        # at every call, seven small ops: 54 us of host time per training step on the CPU stand-in).
        sequence = _held_by_runs(
            runs, "_row_sequence", lambda: _sequence_of_each(cu_seqlens_q.to(torch.int64), q.shape[0])
        )
        alibi_slopes = row_slopes(alibi_slopes, cu_seqlens_q, q.shape[0], row_sequence=sequence)
    if alibi_slopes is not None and not causal and not packed_self:
        # ALiBi without causal across other query and key offsets: each row's diagonal from a table (the
        # "..._table" builds), made once per runs and held by them. (With causal the runs' ends are the
        # diagonals; in packed self-attention the packed row's own index is.)
        make = lambda: alibi_diagonals(cu_seqlens_q, cu_seqlens_k, q.shape[0], seqused_k)  # noqa: E731
        diagonal = _held_by_runs(runs, "_alibi_diagonal", make)
        runs = (*runs, diagonal)
    records = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )
    if not records and not dropout_p:
        # About one query per sequence against many keys (a decoding step): the split-KV decode kernels
        # (api.few_queries.route_varlen), as attention() routes such calls.
        tables = lambda: varlen_rows(cu_seqlens_q, cu_seqlens_k, seqused_k, q.shape[0], causal)  # noqa: E731
        rows = lambda: _held_by_runs(runs, "_decode_rows", tables)  # noqa: E731
        routed = route_varlen(
            q, k, v, n_offsets - 1, rows, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            causal=bool(causal), scale=softmax_scale, return_lse=return_lse, window=window,
            alibi_slopes=alibi_slopes, sinks=sinks, score_values=(("softcap", softcap),),
        )  # fmt: skip
        if routed is not None:
            return routed
    # The runs carry each sequence's causal bound; the flag only picks the kernels' configurations (the
    # segments builds have no causal entry point, and the fallback's chunked path drops it).
    result = attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        causal=bool(causal),
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        deterministic=deterministic,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        _segments=runs,
    )
    # squeeze, not [0]: a view's backward is a view, where select's allocates zeros of the batched shape
    # and copies the gradient into them (a fill and a copy of q's size per backward: 0.2 ms at 64k tokens,
    # 16 heads, d128, kernel log 98).
    if return_lse:
        return result[0].squeeze(0), result[1].squeeze(0)
    return result.squeeze(0)
