"""Argument checks shared by every public entry point, run before anything is allocated or launched.

Each error names the argument and what was expected, so a user can fix the call without reading our code.
Checks that depend on the kernel (dtype support, the GPU's shared memory) live in ``ops``; this module only
enforces what every path (kernel and PyTorch fallback) requires.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from . import ScoreSpec
from .score_functions import check_value

__all__ = [
    "check_window",
    "check_score",
    "score_spec",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "Problem",
    "check_key_range",
    "check_last_dim_contiguous",
    "check_tensor",
    "validate",
]

#: Largest head dimension any kernel is instantiated for; the fallback enforces the same limit so that
#: code tested on CPU does not fail later on a GPU.
MAX_HEAD_DIM = 256

#: Dtypes accepted at the API. fp16/bf16 may run on the kernel; float32/float64 always use the fallback.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_SHAPES = {
    "q": "(batch, seqlen_q, heads_q, head_dim)",
    "k": "(batch, seqlen_k, heads_kv, head_dim)",
    "v": "(batch, seqlen_k, heads_kv, head_dim_v)",
    "out": "(batch, seqlen_q, heads_q, head_dim_v)",
}


@dataclass(frozen=True)
class Problem:
    """The shape of one attention call, with the softmax scale resolved to a float."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    scale: float
    causal: bool
    # v's head_dim, the output's (DeepSeek's multi-head latent attention prefills with q/k 192, v 128);
    # 0: head_dim's, as for most models. The softmax scale follows head_dim (q . k's).
    head_dim_v: int = 0

    @property
    def value_dim(self) -> int:
        """The head_dim of v and of the output."""
        return self.head_dim_v or self.head_dim

    @property
    def group(self) -> int:
        """Query heads per kv head (1: multi-head, heads_q: multi-query)."""
        return self.heads_q // self.heads_kv

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to launch: no output element, or no key to attend to."""
        return self.batch == 0 or self.seqlen_q == 0 or self.heads_q == 0 or self.seqlen_k == 0


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_tensor(name: str, t: object, shape: str, dense_hint: str = "") -> None:
    """``t`` must be a dense torch.Tensor; the errors name the argument and the ``shape`` it should have."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}; got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor of shape {shape}; got a "
            f"{'nested' if t.is_nested else str(t.layout)} tensor{dense_hint}"
        )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels read and write whole 16-byte vectors along head_dim; other strides are free, so a
    (batch, heads, seqlen, head_dim) tensor transposed to our layout needs no copy."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension ({name}.stride(-1) == 1); "
            f"got strides {tuple(t.stride())} for shape {_shape(t)}"
        )


def _check_tensor(name: str, t: object) -> None:
    check_tensor(name, t, _SHAPES[name], " (pad the sequences to one length, with key_range for the padding)")


def _resolve_scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        # head_dim is validated positive before this is called.
        return 1.0 / math.sqrt(head_dim)
    # bool is an int subclass; True as a scale is almost certainly a mistaken argument.
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"softmax_scale must be a finite nonzero number; got {softmax_scale!r}")
    return scale


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    out: torch.Tensor | None,
    key_range: torch.Tensor | None = None,
) -> Problem:
    """Check the arguments of an attention call; return its :class:`Problem` or raise TypeError/ValueError."""
    named = {"q": q, "k": k, "v": v}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        _check_tensor(name, t)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")

    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape {_SHAPES[name]}; got {_shape(t)}")

    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64; got {q.dtype}")
    for name in ("k", "v"):
        if named[name].dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {named[name].dtype}")
    if out is not None and out.dtype != q.dtype:
        raise TypeError(f"out must have the dtype of q ({q.dtype}); got {out.dtype}")

    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")

    batch, seqlen_q, heads_q, head_dim = _shape(q)
    _, seqlen_k, heads_kv, _ = _shape(k)
    if k.shape[0] != batch:
        raise ValueError(f"k must have the batch size of q ({batch}); got shape {_shape(k)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have the head_dim of q ({head_dim}); got shape {_shape(k)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must have the batch, length and heads of k {_shape(k)[:3]} (its head_dim may differ); got "
            f"{_shape(v)}"
        )
    if heads_kv == 0:
        raise ValueError(f"k must have at least one head (heads_kv >= 1); got shape {_shape(k)}")
    if heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k's and v's heads ({heads_kv}): "
            f"query head h reads kv head h // (heads_q // heads_kv); got q {_shape(q)}, k {_shape(k)}"
        )
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[3]) must be between 1 and {MAX_HEAD_DIM}; got {head_dim}")
    head_dim_v = v.shape[3]
    if head_dim_v < 1 or head_dim_v > MAX_HEAD_DIM:
        raise ValueError(f"v's head_dim (v.shape[3]) must be between 1 and {MAX_HEAD_DIM}; got {head_dim_v}")
    out_shape = (*q.shape[:3], head_dim_v)
    if out is not None and tuple(out.shape) != out_shape:
        raise ValueError(f"out must have the shape {out_shape} (q's, with v's head_dim); got {_shape(out)}")

    for name, t in named.items():
        check_last_dim_contiguous(name, t)

    scale = _resolve_scale(softmax_scale, head_dim)
    if key_range is not None:
        check_key_range(key_range, batch, q.device)
    dv = 0 if head_dim_v == head_dim else head_dim_v
    return Problem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, scale, causal, dv)


def check_key_range(key_range: object, batch: int, device: torch.device) -> None:
    """``key_range`` must be an integer tensor of shape (batch, 2) on ``device``: per batch row, the
    [start, end) of the keys it attends. Its values are not read here (that would synchronise with the GPU):
    the kernel clamps them to [0, seqlen_k] and end to at least start."""
    if not isinstance(key_range, torch.Tensor):
        raise TypeError(
            f"key_range must be a torch.Tensor of shape (batch, 2) or None; got {type(key_range).__name__}"
        )
    if key_range.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"key_range must be int32 or int64; got {key_range.dtype}")
    if tuple(key_range.shape) != (batch, 2):
        raise ValueError(f"key_range must have shape (batch, 2) = ({batch}, 2); got {tuple(key_range.shape)}")
    if key_range.device != device:
        raise ValueError(f"key_range must be on the device of q ({device}); got {key_range.device}")


def check_window(window: object) -> tuple[int, int] | None:
    """``window`` must be None or a (left, right) pair of ints, each >= 0 or -1 (unbounded on that side);
    returned as a tuple, or None for (-1, -1), which bounds nothing: the two spellings of "no window" are
    then one spec, so one plan and one repeat signature serve both."""
    if window is None:
        return None
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) for w in window)
    ):
        raise TypeError(f"window must be a (left, right) pair of ints or None; got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded; got {tuple(window)}")
    left, right = int(window[0]), int(window[1])
    return None if left == right == -1 else (left, right)


def alibi_per_row(alibi_slopes: object, segments: tuple | None) -> bool:
    """Whether a call's ALiBi slopes are one per query row: a packed batch's (batch 1) table with more than
    one row (a (1, heads_q) table is the batch's, the same for every row)."""
    return (
        segments is not None
        and isinstance(alibi_slopes, torch.Tensor)
        and alibi_slopes.dim() == 2
        and alibi_slopes.shape[0] > 1
    )


def score_spec(
    alibi_slopes: object,
    q: torch.Tensor,
    segments: tuple | None = None,
    causal: bool = False,
    **values: object,
) -> ScoreSpec:
    """The score function of a call (:class:`flash_attention.spec.ScoreSpec`), checked by
    :func:`check_score`. A packed batch's ALiBi measures from each row's entry of the segments' table of
    diagonals where they carry one, else, for ``causal`` sequences, from each row's run end (any query and
    key counts per sequence), otherwise from the packed row's own index (packed self-attention without
    causal, where it is each sequence's own)."""
    check_score(alibi_slopes, q, segments, **values)
    if alibi_slopes is None:
        return ScoreSpec.of(**values)
    if segments is None:
        return ScoreSpec.of(alibi=True, **values)
    origin = "table" if len(segments) == 3 else "runs" if causal else "diagonal"
    rows = alibi_per_row(alibi_slopes, segments)
    return ScoreSpec.of(alibi=True, alibi_origin=origin, alibi_rows=rows, **values)


def check_score(
    alibi_slopes: object, q: torch.Tensor, segments: tuple | None = None, **values: object
) -> None:
    """Check a call's score-function arguments, naming the argument: each of ``values`` a scalar function of
    spec.score_functions by name with a finite float >= 0 (0: none); ``alibi_slopes``
    None or a contiguous float32 tensor of shape (heads_q,) or (batch, heads_q) on q's device; a packed
    batch's call (``segments``, batch 1) may also give a slope per query row, (seqlen_q, heads_q)
    (flash_attention.api.varlen's per-sequence slopes). Builds nothing: torch.compile's traces call it,
    where dynamo (torch 2.11) refuses to build the spec's frozen dataclasses."""
    for name, value in values.items():
        check_value(name, value)
    if alibi_slopes is None:
        return
    batch, seqlen_q, heads_q, _ = q.shape
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor of shape (heads_q,) or (batch, heads_q)")
    shape = tuple(alibi_slopes.shape)
    per_row = segments is not None and shape == (seqlen_q, heads_q)
    if not per_row and shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, heads_q) = ({batch}, "
            f"{heads_q}); got {shape}"
        )
    if alibi_slopes.device != q.device or not alibi_slopes.is_contiguous():
        raise ValueError(f"alibi_slopes must be contiguous and on the device of q ({q.device})")
