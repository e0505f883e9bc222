"""The PyTorch fallback: attention with the kernels' semantics wherever our CUDA kernels do not run.

Two ways to compute it, chosen per call:

* **PyTorch's fused attention kernel on the tensors' device**, the one
  ``torch.nn.functional.scaled_dot_product_attention`` runs there and that returns the LSE our backward
  needs: on CPU ``aten::_scaled_dot_product_flash_attention_for_cpu`` (tiled, memory-bounded,
  multi-threaded), on CUDA ``aten::_scaled_dot_product_efficient_attention`` (the memory-efficient kernel
  SDPA picks for float32, and for float16/bfloat16 on GPUs or toolchains our kernels cannot use), each
  with its backward. Our semantics on top of it:

  - bottom-right causal: with seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see no key (out 0,
    LSE -inf) and the rest are a square, where top-left and bottom-right agree; with seqlen_q < seqlen_k
    every row sees the first seqlen_k - seqlen_q keys in full and the last seqlen_q causally, two calls
    merged through their LSEs (the backward runs both parts with the merged output and LSE, which is
    exact: each part's probabilities are the merged softmax's, and D = rowsum(dO * O) is the merged one);
  - GQA without copying K/V: one call per member of a query group (query heads j, j + group, ... against
    every K/V head), the backward summing the members' dK and dV in float32;
  - ``key_range``: a (batch, 1, 1, seqlen_k) additive mask (0 or -inf) beside the causal flag; rows that
    see no key get LSE -inf (the fused kernels report 0 or NaN for them) and out 0.

* **The chunked path** (:func:`flash_attention.fallback.reference.attention_torch`), for what the fused
  kernels cannot express: dropout (the kernels' keep masks are ours, not PyTorch's), float64 (the saved LSE is
  float32, and only the chunked backward restores float64 precision from it; the CUDA kernel has no
  float64 either), a negative ``softmax_scale`` (the fused CPU kernel's causal mask breaks under it: NaN),
  ``key_range`` together with causal when seqlen_q < seqlen_k (the merged parts would each need their own
  empty-row bookkeeping), a CUDA call PyTorch's own rules keep off its memory-efficient kernel (e.g. a
  head_dim it does not support), and every other device (MPS, meta).

:func:`fused_path_blocker` says which path a call takes, and why not the fused one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import AttentionSpec
from .reference import (
    _resolve_scale,
    attention_backward_torch,
    attention_torch,
    key_range_allowed,
    runs_alibi_diagonal,
)

__all__ = ["backward", "forward", "fused_path_blocker"]


def _cpu_ops():
    """The fused CPU forward and backward ops, or None on a torch without them."""
    aten = torch.ops.aten
    try:
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    except AttributeError:
        return None


def _cuda_ops():
    """The memory-efficient CUDA forward and backward ops, or None on a torch without them."""
    aten = torch.ops.aten
    try:
        return (
            aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_efficient_attention_backward,
        )
    except AttributeError:
        return None


#: _cuda_refusal's verdicts by call layout (the forward and the backward of a call ask alike, and a model
#: asks with the same few layouts every step; the check builds PyTorch's parameter object each time).
_REFUSALS: dict[tuple, str | None] = {}


def _cuda_refusal(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why PyTorch's own rules keep this CUDA call off its memory-efficient kernel (dtype and head_dim
    support, alignment, the GPU), checked on one query-group member as the fused calls see it; None if
    they allow it."""
    key = (q.shape, q.stride(), k.shape, k.stride(), q.dtype, q.device, q.data_ptr() % 16, k.data_ptr() % 16)
    if key not in _REFUSALS:
        if len(_REFUSALS) > 256:
            _REFUSALS.clear()
        _REFUSALS[key] = _check_cuda_refusal(q, k)
    return _REFUSALS[key]


def _check_cuda_refusal(q: torch.Tensor, k: torch.Tensor) -> str | None:
    try:
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention
    except ImportError:
        return "this torch cannot say whether its memory-efficient CUDA kernel takes the call"
    group = q.shape[2] // k.shape[2]
    qm, km = q[:, :, ::group].transpose(1, 2), k.transpose(1, 2)
    try:
        params = SDPAParams(qm, km, km, None, 0.0, False, False)
    except TypeError:  # torch before enable_gqa joined the parameters
        params = SDPAParams(qm, km, km, None, 0.0, False)
    if not can_use_efficient_attention(params, False):
        return (
            f"PyTorch's memory-efficient CUDA kernel does not take this call ({q.dtype}, head_dim "
            f"{q.shape[3]}, strides {q.stride()})"
        )
    return None


def fused_path_blocker(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, key_range, dropout_p: float
) -> str | None:
    """None when the call runs on PyTorch's fused kernel of its device, else why it takes the chunked
    path."""
    if q.device.type not in ("cpu", "cuda"):
        return f"{q.device.type} tensors (the fused paths are the CPU and CUDA kernels)"
    if q.dtype == torch.float64:
        return "float64 (the saved LSE is float32; the chunked backward renormalises P to stay float64-exact)"
    if scale < 0:
        return "a negative softmax_scale (PyTorch's fused CPU kernel returns NaN for it under causal masking)"
    if dropout_p > 0:
        return "dropout (the kernels' keep masks are not PyTorch's)"
    if causal and key_range is not None and q.shape[1] < k.shape[1]:
        return "key_range with causal and seqlen_q < seqlen_k"
    if q.device.type == "cpu":
        return None if _cpu_ops() is not None else "this torch has no fused CPU attention op"
    if _cuda_ops() is None:
        return "this torch has no memory-efficient CUDA attention op"
    return _cuda_refusal(q, k)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A (batch, heads, rows, head_dim) view over dense (batch, rows, heads, head_dim) memory: ``t`` itself
    when it is one, else a copy. The memory-efficient CUDA backward computed wrong dQ in half precision from
    the gapped views of a query-group member (heads j, j + group, ...; measured on an H100, torch 2.11),
    while float32 and dense views were right."""
    if t.stride(1) == t.shape[3] and t.stride(2) == t.shape[1] * t.shape[3] and t.stride(3) == 1:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


class _Fused:
    """The fused forward and backward of one device behind one calling convention. Tensors come as
    (batch, heads, rows, head_dim) views; ``mask`` is the additive (batch, 1, 1, keys) mask or None.

    ``forward(q, k, v, causal, mask, scale, need_lse) -> (out, lse)``: out (batch, heads, rows, head_dim), lse
    float32 (batch, heads, rows), or None when not needed and the kernel can skip it (CUDA).
    ``backward(dout, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv)``, each (batch, heads, rows,
    head_dim)."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"
        self._fwd, self._bwd = _cuda_ops() if self.cuda else _cpu_ops()

    @staticmethod
    def _bias(mask, q, k):
        # The CUDA kernel takes the bias at its full (batch, heads, rows, keys) shape: broadcast, no copy.
        return None if mask is None else mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

    def forward(self, q, k, v, causal, mask, scale, need_lse=True):
        if not self.cuda:
            return self._fwd(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        out, lse, _, _ = self._fwd(q, k, v, self._bias(mask, q, k), need_lse, 0.0, causal, scale=scale)
        # The kernel's LSE rows are padded to a multiple of 32: the view keeps the call's rows.
        return out, (lse[:, :, : q.shape[2]] if need_lse else None)

    def backward(self, dout, q, k, v, out, lse, causal, mask, scale):
        if not self.cuda:
            return self._bwd(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
        # The backward reads the LSE in the forward's layout, rows padded to a multiple of 32.
        rows = q.shape[2]
        if rows % 32 or lse.stride(2) != 1:
            lse = F.pad(lse, (0, -(-rows // 32) * 32 - rows))
        # No dropout: the Philox seed and offset are never read (the forward's are empty CPU scalars too).
        unused = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = self._bwd(
            _dense(dout), _dense(q), k, v, self._bias(mask, q, k), _dense(out), lse, unused, unused, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class _Plan:
    """How one call maps onto the fused kernel's calls (shared by the forward and the backward)."""

    def __init__(self, q, k, causal, key_range):
        self.batch, self.seqlen_q, self.heads_q, self.head_dim = q.shape
        self.seqlen_k, self.heads_kv = k.shape[1], k.shape[2]
        self.group = self.heads_q // self.heads_kv
        self.causal = causal
        # Bottom-right causal: rows before `row0` see no key; keys before `prefix` are seen by every row.
        self.row0 = max(0, self.seqlen_q - self.seqlen_k) if causal else 0
        self.prefix = max(0, self.seqlen_k - self.seqlen_q) if causal else 0
        self.mask = None  # additive, in q's dtype, (batch, 1, 1, seqlen_k)
        self.empty_rows = None  # (batch, seqlen_q) bool: rows with no visible key under key_range
        if key_range is not None:
            allowed = key_range_allowed(key_range.to(q.device), self.seqlen_k)  # (batch, seqlen_k)
            # Rows padded to a multiple of 16 keys: the CUDA kernel reads the mask in aligned vectors, so
            # its batch stride must be a multiple of 16 elements (the padding is never read).
            padded = -(-self.seqlen_k // 16) * 16
            self.mask = torch.zeros((self.batch, padded), dtype=q.dtype, device=q.device)[:, : self.seqlen_k]
            self.mask.masked_fill_(~allowed, float("-inf"))
            self.mask = self.mask[:, None, None, :]
            # The allowed keys are one interval; row i sees none of them when its first one lies beyond
            # the row's last visible key (i + seqlen_k - seqlen_q under causal), or there is none (first =
            # seqlen_k).
            first = torch.where(allowed.any(1), allowed.int().argmax(1), self.seqlen_k)[:, None]
            rows = torch.arange(self.seqlen_q, device=q.device)[None, :]
            last = rows + (self.seqlen_k - self.seqlen_q) if causal else self.seqlen_k - 1
            self.empty_rows = first > last

    def parts(self):
        """(key slice, causal flag) of each fused call for one query-group member."""
        if self.prefix:
            return [(slice(0, self.prefix), False), (slice(self.prefix, self.seqlen_k), True)]
        return [(slice(0, self.seqlen_k), self.causal)]

    def part_mask(self, keys: slice):
        return None if self.mask is None else self.mask[..., keys]

    def member(self, t: torch.Tensor, j: int) -> torch.Tensor:
        """Query-group member j of a (batch, seqlen_q, heads_q, ...) tensor, as the fused op takes it: heads
        j, j + group, ... (one per K/V head) of the rows from row0, as (batch, heads_kv, rows, ...)."""
        return t[:, self.row0 :, j :: self.group].transpose(1, 2)


def _fused(q, k, causal, scale, key_range, dropout_p) -> bool:
    """Whether a call runs on the fused kernel: nothing blocks it and there is a (query, key) pair."""
    return (
        fused_path_blocker(q, k, causal, scale, key_range, dropout_p) is None
        and q.numel() > 0
        and k.shape[1] > 0
    )


def _sdpa_expresses(q, k, causal, scale, key_range, dropout_p, deterministic) -> bool:
    """:func:`plain_sdpa_call`'s conditions on the call itself, before the fused-path check."""
    return (
        q.shape[2] == k.shape[2]
        and (not causal or q.shape[1] == k.shape[1])
        and key_range is None
        and not dropout_p
        and scale > 0
        and not deterministic
        and not torch.are_deterministic_algorithms_enabled()
    )


def plain_sdpa_call(q, k, causal, scale, key_range, dropout_p, deterministic) -> bool:
    """Whether ``scaled_dot_product_attention`` itself computes this call exactly as we define it, with the
    fused kernel this module would call: no LSE wanted (the caller's business), one K/V head per query head,
    causal only on a square (where its top-left mask is our bottom-right one), no key range, no dropout, a
    positive scale, and no promise of repeatable gradients to keep. Such a call costs PyTorch's own host
    path, not this module's (plans, views, one op call per part; about 80 us per call more on an H100
    host, docs/kernel-log/host.md, "The PyTorch fallback on float32 GPU tensors")."""
    return _sdpa_expresses(q, k, causal, scale, key_range, dropout_p, deterministic) and _fused(
        q, k, causal, scale, key_range, dropout_p
    )


def sdpa(q, k, v, *, causal, scale):
    """The call :func:`plain_sdpa_call` allows, through ``scaled_dot_product_attention`` (differentiable by
    PyTorch's autograd): our (batch, seqlen, heads, head_dim) layout in and out."""
    scale = _resolve_scale(scale, q.shape[-1])
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
    )
    return o.transpose(1, 2).contiguous()  # (no copy: the fused kernels write our layout)


def _plain(options: dict, spec: AttentionSpec, alibi_slopes, q, v) -> bool:
    """Whether a call is plain attention the fused ops can take: no window (or packed runs), no score
    function, and v's head_dim q's (a pair of their own takes the chunked path, exact for any pair)."""
    return (
        options["window"] is None
        and not spec.score.values
        and alibi_slopes is None
        and v.shape[3] == q.shape[3]
    )


def _options(spec: AttentionSpec, head_dim: int, row_keys, alibi_slopes, alibi_diagonal) -> dict:
    """The chunked path's keywords of a call's spec (:func:`attention_torch` takes them one by one): a packed
    batch's per-row key runs (``row_keys``) stand in for the window, and carry causal per sequence; ALiBi's
    diagonals then come from the runs where the caller has no table of them."""
    if row_keys is not None and alibi_diagonal is None:
        alibi_diagonal = runs_alibi_diagonal(row_keys, spec.causal, alibi_slopes)
    return dict(
        causal=spec.causal and row_keys is None,
        softmax_scale=_resolve_scale(spec.scale, head_dim),
        dropout_p=spec.dropout_p,
        window=spec.window if row_keys is None else row_keys,
        alibi_slopes=alibi_slopes,
        alibi_diagonal=alibi_diagonal,
        **dict(spec.score.values),
    )


def forward(
    q, k, v, spec: AttentionSpec, *, return_lse=True, out=None, key_range=None, dropout_seed=None,
    alibi_slopes=None, alibi_diagonal=None, row_keys=None,
):  # fmt: skip
    """(out, lse) of attention with the kernels' semantics (``lse`` None unless ``return_lse``); ``out`` is
    written in place when given. ``spec``: the call's checked options (spec.AttentionSpec: causal, the
    resolved scale, the window, the score function, dropout); the tensors beside it as
    :func:`flash_attention.fallback.reference.attention_torch` takes them; ``row_keys``: a packed batch's
    per-row key runs (flash_attention.api.varlen), read in place of the window. A window, a score function or
    runs take the chunked path (the fused kernels take no such mask without materialising it)."""
    options = _options(spec, q.shape[-1], row_keys, alibi_slopes, alibi_diagonal)
    causal, scale, dropout_p = options["causal"], options["softmax_scale"], spec.dropout_p
    fused_ok = _plain(options, spec, alibi_slopes, q, v) and _fused(q, k, causal, scale, key_range, dropout_p)
    if fused_ok and not return_lse and out is None:
        if _sdpa_expresses(q, k, causal, scale, key_range, dropout_p, False):
            return sdpa(q, k, v, causal=causal, scale=scale), None
    if not fused_ok:
        return attention_torch(
            q, k, v, return_lse=return_lse, out=out, key_range=key_range, dropout_seed=dropout_seed, **options
        )
    fused = _Fused(q.device.type)
    plan = _Plan(q, k, causal, key_range)
    r0, g = plan.row0, plan.group
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads_kv, seqlen_k, head_dim) views
    parts = plan.parts()
    single = out is None and g == 1 and r0 == 0 and len(parts) == 1
    # Without autograd and return_lse, one fused call with nothing to merge or fix needs no LSE, and the CUDA
    # kernel then skips computing it (as SDPA does for inference calls).
    need_lse = return_lse or not single or plan.empty_rows is not None
    if not single:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = torch.empty(plan.batch, plan.heads_q, plan.seqlen_q, dtype=torch.float32, device=q.device)
        if r0:
            out[:, :r0].zero_()
            lse[:, :, :r0] = float("-inf")
    for j in range(g):
        qj = plan.member(q, j)
        results = [
            fused.forward(
                qj, kt[:, :, keys], vt[:, :, keys], part_causal, plan.part_mask(keys), scale, need_lse
            )
            for keys, part_causal in parts
        ]
        if len(results) == 1:
            oj, lj = results[0]
        else:
            (oa, la), (ob, lb) = results
            lj = torch.logaddexp(la, lb)
            wa, wb = torch.exp(la - lj).unsqueeze(-1), torch.exp(lb - lj).unsqueeze(-1)
            oj = (oa.to(wa.dtype) * wa + ob.to(wb.dtype) * wb).to(q.dtype)
        if single:
            # Both fused kernels lay their output out as (batch, seqlen, heads, head_dim): our layout, so
            # this contiguous() is a no-op. Their LSE is not ours ((batch, seqlen, heads) in memory on
            # CPU, rows padded to 32 on CUDA): that one is copied.
            out = oj.transpose(1, 2).contiguous()
            lse = None if lj is None else lj.to(torch.float32).contiguous()
        else:
            out[:, r0:, j::g] = oj.transpose(1, 2)
            lse[:, j::g, r0:] = lj
    if plan.empty_rows is not None:
        lse.masked_fill_(plan.empty_rows[:, None, :], float("-inf"))
        out.masked_fill_(plan.empty_rows[:, :, None, None], 0)
    return out, (lse if return_lse else None)


def backward(
    dout, q, k, v, out, lse, spec: AttentionSpec, *, key_range=None, dropout_seed=None, alibi_slopes=None,
    alibi_diagonal=None, row_keys=None, sinks=None,
):  # fmt: skip
    """(dq, dk, dv) of :func:`forward` (the same ``spec`` and tensors) from its saved ``out`` and ``lse``. A
    ``deterministic`` spec on CUDA takes the chunked path: PyTorch does not promise bitwise-repeatable
    gradients from its memory-efficient backward (it may split the keys and add dQ atomically); the CPU
    kernel's are repeatable. ``sinks``: the forward's (heads_q,) attention sinks when ``out`` and ``lse`` are
    the forward's with them (the float64 chunked path counts them in its rows' sums)."""
    options = _options(spec, q.shape[-1], row_keys, alibi_slopes, alibi_diagonal)
    causal, scale, dropout_p = options["causal"], options["softmax_scale"], spec.dropout_p
    deterministic = spec.deterministic or torch.are_deterministic_algorithms_enabled()
    repeatable = not deterministic or q.device.type == "cpu"
    plain = _plain(options, spec, alibi_slopes, q, v)
    if not repeatable or not plain or not _fused(q, k, causal, scale, key_range, dropout_p):
        return attention_backward_torch(
            dout, q, k, v, out, lse, key_range=key_range, dropout_seed=dropout_seed, sinks=sinks, **options
        )
    fused = _Fused(q.device.type)
    plan = _Plan(q, k, causal, key_range)
    r0, g = plan.row0, plan.group
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    # Rows with no key have LSE -inf; the fused backward recomputes P = exp(S - lse), and with S = -inf
    # there an LSE of 0 gives P = 0 (and dq = 0) where -inf would give NaN.
    # Only key_range leaves such rows among those the fused calls see (causal's empty rows are cut off).
    lse_c = lse if key_range is None else torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    if q.dtype == torch.float64:
        lse_c = lse_c.to(torch.float64)  # the fused op takes the LSE in the compute dtype
    parts = plan.parts()
    single = g == 1 and r0 == 0 and len(parts) == 1  # one fused call: its dq is the answer
    dq = None if single else (torch.zeros if r0 else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dk = torch.zeros(k.shape, dtype=acc, device=k.device) if g > 1 or len(parts) > 1 else None
    dv = torch.zeros(v.shape, dtype=acc, device=v.device) if dk is not None else None
    for j in range(g):
        qj, doj, oj = plan.member(q, j), plan.member(dout, j), plan.member(out, j)
        lj = lse_c[:, j::g, r0:]
        dqj = None
        for keys, part_causal in parts:
            dq_p, dk_p, dv_p = fused.backward(
                doj, qj, kt[:, :, keys], vt[:, :, keys], oj, lj, part_causal, plan.part_mask(keys), scale
            )
            dqj = dq_p if dqj is None else dqj + dq_p
            if dk is None:  # one member, one part: the op's own tensors are the answer
                dk, dv = dk_p.transpose(1, 2), dv_p.transpose(1, 2)
            else:
                dk[:, keys] += dk_p.transpose(1, 2)
                dv[:, keys] += dv_p.transpose(1, 2)
        if single:  # (batch, seqlen, heads, head_dim) in memory on both devices: no copy
            dq = dqj.transpose(1, 2).contiguous()
        else:
            dq[:, r0:, j::g] = dqj.transpose(1, 2)
    return dq, dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
