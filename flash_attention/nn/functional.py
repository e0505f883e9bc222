"""How the modules of :mod:`flash_attention.nn` (and the transformers integration) compute attention.

Tensors here are in the library's layout: ``q`` (batch, seqlen_q, heads_q, head_dim), ``k``/``v`` (batch,
seqlen_k, heads_kv, head_dim). A call takes one of three routes:

1. **kernel** -- :func:`flash_attention.attention` (our CUDA kernel for fp16/bf16 CUDA tensors; its own
   chunked PyTorch fallback elsewhere): no mask, or bottom-right causal.
2. **ranged kernel** -- key padding whose valid keys form one contiguous range per batch row (right padding,
   left padding): rows that share a range are run as :func:`~flash_attention.attention` calls over slices
   of K/V (:func:`ranged_attention`), because the kernel has no per-batch key lengths yet. Each distinct
   range costs a launch, so this route is taken only when the cost model in :func:`ranged_is_faster`
   expects it to beat route 3.
3. **PyTorch** -- :func:`sdpa_attention` (``torch.nn.functional.scaled_dot_product_attention`` with an
   explicit boolean mask): whatever the kernel cannot do yet -- gradients (the kernel has no backward pass),
   attention dropout, padding that is not worth splitting, and, in the modules, arbitrary masks.

Every route computes the same function: bottom-right causal alignment (query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``), padding masks applied on top of it without shifting it, and a query row
that sees no key gets an output of 0 (never NaN).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..interface import attention
from ..reference import causal_allowed

__all__ = [
    "KERNEL_HAS_BACKWARD",
    "KeyRanges",
    "key_ranges",
    "memo",
    "needs_pytorch_path",
    "plan_padded",
    "ranged_attention",
    "ranged_is_faster",
    "sdpa_attention",
    "warn_once",
]

#: Whether :func:`flash_attention.attention` is differentiable on the kernel path. It is not yet (the
#: backward pass is the next issue), so a call that must record gradients runs through PyTorch (route 3).
#: When the backward lands, setting this to True is the one change the modules need.
KERNEL_HAS_BACKWARD = False

_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"flash_attention.nn: {message}", RuntimeWarning, stacklevel=stacklevel)


def kernel_expected(t: torch.Tensor) -> bool:
    """Whether a caller would expect our CUDA kernel for ``t``: the slow-path warnings are only useful there.

    On the CPU every route is PyTorch anyway, so saying "this call is slow" would be noise. (A seam the CPU
    tests replace.)
    """
    return t.is_cuda


def needs_pytorch_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float, stacklevel: int = 4
) -> bool:
    """True (with a one-time warning on CUDA) when this call cannot use the kernel: gradients or dropout.

    ``q``, ``k`` and ``v`` are the projected tensors, so they require grad when any input or parameter does.
    """
    if dropout_p > 0.0:
        if kernel_expected(q):
            warn_once(
                "dropout",
                "attention dropout runs through PyTorch's scaled_dot_product_attention: the CUDA kernel has "
                "no dropout yet (set dropout=0.0 or call .eval() to use the kernel)",
                stacklevel=stacklevel,
            )
        return True
    if (
        not KERNEL_HAS_BACKWARD
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        if kernel_expected(q):
            warn_once(
                "grad",
                "gradients are needed, and the CUDA kernel has no backward pass yet: this call runs through "
                "PyTorch's scaled_dot_product_attention (inference under torch.no_grad() or "
                "torch.inference_mode() uses the kernel)",
                stacklevel=stacklevel,
            )
        return True
    return False


# ------------------------------------------------------------------------------------------------------
# Route 3: PyTorch


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_valid: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention through ``scaled_dot_product_attention`` with the semantics of the module docstring.

    ``key_valid`` is a (batch, seqlen_k) boolean mask, True where a key may be attended. Differentiable;
    ``dropout_p`` is applied to the attention probabilities. Returns (batch, seqlen_q, heads_q, head_dim).
    """
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if heads_kv != heads_q:
        # The fallback may copy K/V per query head; `enable_gqa` would need torch >= 2.5.
        group = heads_q // heads_kv
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)

    mask = None if key_valid is None else key_valid[:, None, None, :]
    is_causal = False
    if causal:
        if mask is None and seqlen_q == seqlen_k:
            is_causal = True  # top-left == bottom-right for a square; lets SDPA pick its fastest backend
        else:
            allowed = causal_allowed(seqlen_q, seqlen_k, device=q.device)
            mask = allowed if mask is None else mask & allowed
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    if mask is not None:
        # A row with no visible key: SDPA's backends disagree (0 or NaN); ours is 0 on every path.
        has_key = mask.any(dim=-1, keepdim=True)
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------------
# Route 2: key padding as one range of valid keys per batch row


@dataclass(frozen=True)
class KeyRanges:
    """For each batch row ``b``, the keys it may attend are exactly ``starts[b] <= j < ends[b]``."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def groups(self) -> dict[tuple[int, int], list[int]]:
        """Batch rows by range, in first-seen order: each group is computed by one set of launches."""
        out: dict[tuple[int, int], list[int]] = {}
        for b, r in enumerate(zip(self.starts, self.ends, strict=True)):
            out.setdefault(r, []).append(b)
        return out

    def is_full(self, seqlen_k: int) -> bool:
        """True when no key is masked at all (the mask can be ignored)."""
        return all(s == 0 and e == seqlen_k for s, e in zip(self.starts, self.ends, strict=True))


def memo(owner: torch.Tensor, tag: str, compute):
    """``compute()``, remembered on the tensor ``owner`` until it is modified in place (its version counter).

    Used for facts read from a mask on the host (a device-to-host copy, a synchronisation on CUDA): the
    layers of a model share one mask tensor, so they pay for the copy once per forward pass.
    """
    memos = getattr(owner, "_flash_attention_memo", None)
    if memos is not None and tag in memos and memos[tag][0] == owner._version:
        return memos[tag][1]
    value = compute()
    try:
        if memos is None:
            memos = {}
            owner._flash_attention_memo = memos
        memos[tag] = (owner._version, value)
    except (AttributeError, RuntimeError):  # tensor subclasses that refuse attributes: just don't remember
        pass
    return value


def key_ranges(key_valid: torch.Tensor, *, cache_on: torch.Tensor | None = None) -> KeyRanges | None:
    """The range of valid keys of each row of a (batch, seqlen_k) boolean mask, or None when a row's valid
    keys are not one contiguous run.

    Reads the mask on the host (one device-to-host copy); the result is remembered on ``cache_on``
    (default: the mask itself) by :func:`memo`.
    """
    return memo(key_valid if cache_on is None else cache_on, "key_ranges", lambda: _key_ranges(key_valid))


def _key_ranges(key_valid: torch.Tensor) -> KeyRanges | None:
    batch, seqlen_k = key_valid.shape
    if seqlen_k == 0:
        return KeyRanges((0,) * batch, (0,) * batch)
    # +1 where a run of valid keys starts, -1 one past where it ends (zero-padded at both sides).
    edges = torch.diff(F.pad(key_valid.to(torch.int8), (1, 1)), dim=1)
    starts_at, ends_at = (edges == 1).to(torch.int32), (edges == -1).to(torch.int32)
    # argmax returns the first maximum: the first start and the first end of each row.
    runs, starts, ends = torch.stack([starts_at.sum(1), starts_at.argmax(1), ends_at.argmax(1)]).tolist()
    if any(n > 1 for n in runs):
        return None
    starts = [s if n else 0 for n, s in zip(runs, starts, strict=True)]
    ends = [e if n else 0 for n, e in zip(runs, ends, strict=True)]
    return KeyRanges(tuple(starts), tuple(ends))


#: Host cost of one attention() call (validation, config lookup, launch through ctypes; docs/design.md
#: measures 20-40 us) plus the slicing around it. Each distinct key range costs one or two of them.
_LAUNCH_SECONDS = 40e-6
#: Forward throughput of our kernel and of PyTorch's masked SDPA (its memory-efficient backend: the flash
#: backends take no mask) at long sequences, bf16, from the README's benchmark table on H200
#: (flash_attention 270-370 TFLOP/s, sdpa_efficient 120-175). Only their ratio and the launch cost decide.
_KERNEL_FLOPS = 300e12
_SDPA_MASKED_FLOPS = 150e12


def _attention_flops(rows: int, seqlen_q: int, keys: int, heads: int, head_dim: int) -> float:
    return 4.0 * rows * heads * seqlen_q * keys * head_dim


def ranged_is_faster(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    head_dim: int,
    ranges: KeyRanges | None,
    *,
    causal: bool,
) -> bool:
    """Whether the ranged kernel route is expected to beat masked SDPA for this call.

    With ``ranges`` None, the best case (one launch, no key skipped) is judged: False then means no ranges
    need to be read at all. The model: SDPA computes every (query, key) pair at its masked speed; the ranged
    route computes only the valid keys at the kernel's speed but pays a host launch per distinct range (two
    when causal). Causal halving applies to both alike and is left out.
    """
    sdpa_s = _attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim) / _SDPA_MASKED_FLOPS
    if ranges is None:
        return _LAUNCH_SECONDS + sdpa_s * _SDPA_MASKED_FLOPS / _KERNEL_FLOPS < sdpa_s
    groups = ranges.groups()
    launches = len(groups) * (2 if causal else 1)
    work = sum(
        _attention_flops(len(rows), seqlen_q, e - s, heads, head_dim) for (s, e), rows in groups.items()
    )
    return launches * _LAUNCH_SECONDS + work / _KERNEL_FLOPS < sdpa_s


def plan_padded(
    key_valid: torch.Tensor,
    *,
    seqlen_q: int,
    heads: int,
    head_dim: int,
    causal: bool,
    cache_on: torch.Tensor | None = None,
) -> KeyRanges | None:
    """The key ranges to run a padded call on the kernel (route 2), or None for the PyTorch route.

    ``key_valid`` is (batch, seqlen_k) boolean, True where a key may be attended. Off CUDA there is no
    kernel to win with, so the answer is None without reading the mask.
    """
    batch, seqlen_k = key_valid.shape
    shape = (batch, seqlen_q, seqlen_k, heads, head_dim)
    if not kernel_expected(key_valid) or not ranged_is_faster(*shape, None, causal=causal):
        return None
    ranges = key_ranges(key_valid, cache_on=cache_on)
    if ranges is None or not ranged_is_faster(*shape, ranges, causal=causal):
        return None
    return ranges


def ranged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: KeyRanges,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention where batch row ``b`` attends only keys ``ranges.starts[b] <= j < ranges.ends[b]``.

    Runs :func:`flash_attention.attention` on slices of K/V, one group of batch rows per distinct range
    (views when the rows are consecutive, gathered copies otherwise). Causal alignment stays bottom-right
    on the *full* key axis: query ``i`` sees key ``j`` iff ``j <= i + off`` with ``off = seqlen_k -
    seqlen_q``. On a slice ``[s, e)`` the kernel aligns to the slice's end instead, so a group is split:
    the first ``r = e - off`` query rows (whose last visible key lies inside the slice) run causal on it,
    where the kernel's alignment ``i + (e - s) - r`` is exactly ``i + off - s``; the rows below see the
    whole slice and run non-causal. Returns a new (batch, seqlen_q, heads_q, head_dim) tensor.
    """
    seqlen_q = q.shape[1]
    offset = k.shape[1] - seqlen_q
    # Without autograd every group writes into one output buffer (attention(out=) on views, no extra
    # copy). A kernel's autograd function cannot differentiate into a caller's out= buffer, so with
    # autograd recording (once attention() is differentiable) each group is computed out of place.
    track = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out = (torch.zeros if track else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    for (start, end), rows in ranges.groups().items():
        # Query rows [0, causal_rows) see only part of the slice: causal on it; the rest see all of it.
        causal_rows = min(max(end - offset, 0), seqlen_q) if causal else 0
        consecutive = rows[-1] - rows[0] == len(rows) - 1
        # Consecutive rows are views (no copies); others are gathered.
        sel = slice(rows[0], rows[-1] + 1) if consecutive else torch.tensor(rows, device=q.device)
        qg, kg, vg = q[sel], k[sel, start:end], v[sel, start:end]
        if track:
            index = torch.arange(rows[0], rows[-1] + 1, device=q.device) if consecutive else sel
            out = out.index_copy(0, index, _group_attention(qg, kg, vg, None, causal_rows, scale))
        elif consecutive:
            _group_attention(qg, kg, vg, out[sel], causal_rows, scale)
        else:
            out.index_copy_(0, sel, _group_attention(qg, kg, vg, torch.empty_like(qg), causal_rows, scale))
    return out


def _group_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    causal_rows: int,
    scale: float | None,
) -> torch.Tensor:
    """One group of :func:`ranged_attention` on its key slice: query rows ``[0, causal_rows)`` causal (the
    kernel's bottom-right alignment on the slice), the others non-causal. Writes into ``out`` when given,
    else returns a new tensor (differentiable when attention() is)."""
    seqlen_q = q.shape[1]
    if k.shape[1] == 0:  # no key at all
        return out.zero_() if out is not None else torch.zeros_like(q)
    parts = []
    for lo, hi, causal in ((0, causal_rows, True), (causal_rows, seqlen_q, False)):
        if hi > lo:
            part_out = None if out is None else out[:, lo:hi]
            parts.append(attention(q[:, lo:hi], k, v, causal=causal, softmax_scale=scale, out=part_out))
    if out is not None:
        return out
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# ------------------------------------------------------------------------------------------------------
# The dispatcher of flash_attention.nn.FlashAttention


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention by the best route (module docstring). ``key_padding_mask`` is (batch, seqlen_k) boolean,
    True for keys to ignore (PyTorch's convention). Returns (batch, seqlen_q, heads_q, head_dim)."""
    key_valid = None if key_padding_mask is None else ~key_padding_mask
    if needs_pytorch_path(q, k, v, dropout_p=dropout_p, stacklevel=5):
        return sdpa_attention(q, k, v, causal=causal, key_valid=key_valid, dropout_p=dropout_p, scale=scale)
    if key_valid is None:
        return attention(q, k, v, causal=causal, softmax_scale=scale)
    ranges = plan_padded(
        key_valid,
        seqlen_q=q.shape[1],
        heads=q.shape[2],
        head_dim=q.shape[3],
        causal=causal,
        cache_on=key_padding_mask,
    )
    if ranges is None:
        return sdpa_attention(q, k, v, causal=causal, key_valid=key_valid, scale=scale)
    if ranges.is_full(k.shape[1]):
        return attention(q, k, v, causal=causal, softmax_scale=scale)
    return ranged_attention(q, k, v, ranges, causal=causal, scale=scale)
