"""How the modules of :mod:`flash_attention.nn` (and the transformers integration) compute attention.

Tensors here are in the library's layout: ``q`` (batch, seqlen_q, heads_q, head_dim), ``k``/``v`` (batch,
seqlen_k, heads_kv, head_dim). A call takes one of three routes:

1. **kernel** -- :func:`flash_attention.attention` (our CUDA kernel for fp16/bf16 CUDA tensors; its own
   chunked PyTorch fallback elsewhere): no mask, or bottom-right causal.
2. **kernel with key ranges** -- key padding whose valid keys form one contiguous run per batch row (right
   padding, left padding, or both): one :func:`~flash_attention.attention` call with ``key_range`` (a
   (batch, 2) int32 tensor of [start, end) per row), which the kernel applies itself (per-batch key
   ranges; no mask is materialised). Deciding needs one device-to-host read of the mask
   (:func:`key_ranges`); it and the ``key_range`` tensor are memoised on the mask tensor (:func:`memo`), so
   the layers of a model that share one mask pay that read once per forward pass.
3. **PyTorch** -- :func:`sdpa_attention` (``torch.nn.functional.scaled_dot_product_attention`` with an
   explicit boolean mask): what the kernel cannot do -- padding whose valid keys are not one run per row
   (holes in the middle) and, in the modules, arbitrary masks. Gradients and attention dropout take
   routes 1 and 2 (the backward kernels and the kernels' own dropout; see :data:`KERNEL_HAS_BACKWARD`).

Every route computes the same function: bottom-right causal alignment (query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``), padding masks applied on top of it without shifting it, and a query row
that sees no key gets an output of 0 (never NaN).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..api.attention import attention
from ..fallback.reference import causal_allowed, window_allowed

__all__ = [
    "KERNEL_HAS_BACKWARD",
    "KeyRanges",
    "key_range_attention",
    "key_ranges",
    "materialized_attention",
    "memo",
    "needs_pytorch_path",
    "plan_padded",
    "sdpa_attention",
    "warn_once",
]

#: Whether :func:`flash_attention.attention` is differentiable on the kernel path: it is (the backward
#: kernels, through the ``flash_attention::fwd``/``bwd`` custom ops), so training runs routes 1 and 2 as
#: they are. Set to False to send every call that records gradients to PyTorch (route 3) instead.
KERNEL_HAS_BACKWARD = True

_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, *, stacklevel: int = 3, source: str = "flash_attention.nn") -> None:
    """Emit ``f"{source}: {message}"`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"{source}: {message}", RuntimeWarning, stacklevel=stacklevel)


def kernel_expected(t: torch.Tensor) -> bool:
    """Whether a caller would expect our CUDA kernel for ``t``: the slow-path warnings are only useful there.

    On the CPU every route is PyTorch anyway, so saying "this call is slow" would be noise. (A seam the CPU
    tests replace.)
    """
    return t.is_cuda


def needs_pytorch_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float, stacklevel: int = 4
) -> bool:
    """True (with a one-time warning on CUDA) when this call cannot use the kernel: gradients with
    :data:`KERNEL_HAS_BACKWARD` switched off. (Attention dropout runs in the kernels: ``dropout_p`` is
    accepted for the signature's sake and needs no other route.)

    ``q``, ``k`` and ``v`` are the projected tensors, so they require grad when any input or parameter does.
    """
    if (
        not KERNEL_HAS_BACKWARD
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        if kernel_expected(q):
            warn_once(
                "grad",
                "gradients are needed and the kernels' backward pass is switched off "
                "(flash_attention.nn.functional.KERNEL_HAS_BACKWARD = False): this call runs through "
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
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention through ``scaled_dot_product_attention`` with the semantics of the module docstring.

    ``key_valid`` is a (batch, seqlen_k) boolean mask, True where a key may be attended; ``window`` a sliding
    window as :func:`flash_attention.attention` takes it. Differentiable; ``dropout_p`` is applied to the
    attention probabilities. Returns (batch, seqlen_q, heads_q, head_dim).
    """
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if heads_kv != heads_q:
        # The fallback may copy K/V per query head; `enable_gqa` would need torch >= 2.5.
        group = heads_q // heads_kv
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)

    mask = None if key_valid is None else key_valid[:, None, None, :]
    if window is not None:
        band = window_allowed(seqlen_q, seqlen_k, window, device=q.device)
        mask = band if mask is None else mask & band
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
# Route 2: key padding as one range of valid keys per batch row, computed by the kernel (key_range=)


@dataclass(frozen=True)
class KeyRanges:
    """For each batch row ``b``, the keys it may attend are exactly ``starts[b] <= j < ends[b]``.

    ``key_range`` is the same as the (batch, 2) int32 tensor :func:`flash_attention.attention` takes,
    on the mask's device (built with the ranges, from the mask on its device: no host-to-device copy); None
    only for ranges written by hand, which :meth:`tensor` then builds.
    """

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    key_range: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def is_full(self, seqlen_k: int) -> bool:
        """True when no key is masked at all (the mask can be ignored)."""
        return all(s == 0 and e == seqlen_k for s, e in zip(self.starts, self.ends, strict=True))

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The (batch, 2) int32 ``key_range`` argument of :func:`flash_attention.attention` on ``device``."""
        if self.key_range is not None and self.key_range.device == device:
            return self.key_range
        rows = list(zip(self.starts, self.ends, strict=True))
        return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), 2)


def memo(owner: torch.Tensor, tag: str, compute):
    """``compute()``, remembered on the tensor ``owner`` until it is modified in place (its version counter).

    Used for facts read from a mask on the host (a device-to-host copy, a synchronisation on CUDA) and for
    what is built from them: the layers of a model share one mask tensor, so they pay once per forward pass.
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
    keys are not one contiguous run. A row without any valid key gets the empty range (0, 0).

    Reads the mask on the host (one device-to-host copy); the result, with its device tensor
    (``KeyRanges.key_range``), is remembered on ``cache_on`` (default: the mask itself) by :func:`memo`.
    """
    return memo(key_valid if cache_on is None else cache_on, "key_ranges", lambda: _key_ranges(key_valid))


def _key_ranges(key_valid: torch.Tensor) -> KeyRanges | None:
    batch, seqlen_k = key_valid.shape
    if seqlen_k == 0:
        zeros = torch.zeros((batch, 2), dtype=torch.int32, device=key_valid.device)
        return KeyRanges((0,) * batch, (0,) * batch, zeros)
    # +1 where a run of valid keys starts, -1 one past where it ends (zero-padded at both sides).
    edges = torch.diff(F.pad(key_valid.to(torch.int8), (1, 1)), dim=1)
    starts_at, ends_at = (edges == 1).to(torch.int32), (edges == -1).to(torch.int32)
    # argmax returns the first maximum: the first start and the first end of each row; 0 and 0 (an empty
    # range) for a row without any valid key.
    device_ranges = torch.stack([starts_at.argmax(1), ends_at.argmax(1)], dim=1).to(torch.int32)
    runs = starts_at.sum(1, dtype=torch.int32)
    # The one device-to-host copy: per row, the number of runs and the range.
    host = torch.cat([runs[:, None], device_ranges], dim=1).tolist()
    if any(n > 1 for n, _, _ in host):
        return None
    return KeyRanges(tuple(s for _, s, _ in host), tuple(e for _, _, e in host), device_ranges)


def plan_padded(key_valid: torch.Tensor, *, cache_on: torch.Tensor | None = None) -> KeyRanges | None:
    """The key ranges to run a padded call on the kernel (route 2), or None for the PyTorch route.

    ``key_valid`` is (batch, seqlen_k) boolean, True where a key may be attended. Off CUDA there is no
    kernel to run, so the answer is None without reading the mask; on CUDA it is None only when some row's
    valid keys are not one contiguous run (holes in the middle). Memoised on ``cache_on`` (default: the
    mask), see :func:`key_ranges`.
    """
    if not kernel_expected(key_valid):
        return None
    return key_ranges(key_valid, cache_on=cache_on)


def key_range_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: KeyRanges,
    *,
    causal: bool,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention where batch row ``b`` attends only keys ``ranges.starts[b] <= j < ranges.ends[b]``: one
    :func:`flash_attention.attention` call with ``key_range`` (the kernel skips the keys outside each
    row's range; nothing is sliced, copied or materialised). Causal alignment stays bottom-right on the
    *full* key axis. Differentiable whenever :func:`flash_attention.attention` is. Without padding at all,
    the plain kernel runs. ``window``, ``softcap`` and ``sinks``: as :func:`flash_attention.attention`
    takes them.
    Returns a new (batch, seqlen_q, heads_q, head_dim) tensor.
    """
    extra = {} if window is None else {"window": window}
    if softcap:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    if ranges.is_full(k.shape[1]):
        return attention(q, k, v, causal=causal, softmax_scale=scale, dropout_p=dropout_p, **extra)
    key_range = ranges.tensor(q.device)
    return attention(
        q, k, v, causal=causal, softmax_scale=scale, key_range=key_range, dropout_p=dropout_p, **extra
    )


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
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention by the best route (module docstring). ``key_padding_mask`` is (batch, seqlen_k) boolean,
    True for keys to ignore (PyTorch's convention); ``window``, ``alibi_slopes`` and ``softcap`` as
    :func:`flash_attention.attention` takes them (a score function never takes SDPA, which has none: on
    the PyTorch path it is :func:`flash_attention.attention`'s own fallback, and a padding mask with holes
    the materialised path). Returns (batch, seqlen_q, heads_q, head_dim)."""
    key_valid = None if key_padding_mask is None else ~key_padding_mask
    scored = alibi_slopes is not None or bool(softcap)
    pytorch = dict(causal=causal, key_valid=key_valid, dropout_p=dropout_p, scale=scale, window=window)
    if not scored and needs_pytorch_path(q, k, v, dropout_p=dropout_p, stacklevel=5):
        return sdpa_attention(q, k, v, **pytorch)
    extra: dict = {} if window is None else {"window": window}
    if alibi_slopes is not None:
        extra["alibi_slopes"] = alibi_slopes.to(q.device)
    if softcap:
        extra["softcap"] = float(softcap)
    if key_valid is None:
        return attention(q, k, v, causal=causal, softmax_scale=scale, dropout_p=dropout_p, **extra)
    ranges = plan_padded(key_valid, cache_on=key_padding_mask)
    if ranges is None:
        if scored:
            out, _ = materialized_attention(
                q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale,
                window=window, alibi_slopes=alibi_slopes, softcap=softcap,
            )  # fmt: skip
            return out
        return sdpa_attention(q, k, v, **pytorch)
    if alibi_slopes is not None:  # (key_range_attention takes the window and softcap by name)
        return attention(
            q, k, v, causal=causal, softmax_scale=scale, dropout_p=dropout_p,
            key_range=ranges.tensor(q.device), **extra,
        )  # fmt: skip
    return key_range_attention(
        q, k, v, ranges, causal=causal, scale=scale, dropout_p=dropout_p, window=window, softcap=softcap
    )


def materialized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that materialises the probabilities, ``(out, probs)``, with the semantics of every other
    route (the score functions as :func:`flash_attention.fallback.reference.attention_reference` applies
    them). fp32 softmax (fp64 for fp64 inputs); ``probs`` (batch, heads_q, seqlen_q, seqlen_k) before
    dropout."""
    from ..fallback.reference import alibi_bias

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, group = k.shape[1], heads_q // k.shape[2]
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qt = q.transpose(1, 2).to(cdtype)
    kt = k.transpose(1, 2).to(cdtype).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).to(cdtype).repeat_interleave(group, dim=1)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), batch, seqlen_q, seqlen_k, cdtype)
    allowed = torch.ones((1, 1, seqlen_q, seqlen_k), dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed & causal_allowed(seqlen_q, seqlen_k, device=q.device)
    if window is not None:
        allowed = allowed & window_allowed(seqlen_q, seqlen_k, window, device=q.device)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows with no visible key: softmax of all -inf is NaN; their weights and output are 0.
    probs = torch.where(
        allowed.any(dim=-1, keepdim=True), probs, torch.zeros((), dtype=cdtype, device=q.device)
    )
    o = torch.matmul(F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs, vt)
    return o.transpose(1, 2).to(q.dtype), probs.to(q.dtype)
