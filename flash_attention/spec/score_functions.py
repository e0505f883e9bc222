"""The scalar score functions: what a kernel build can do to a scaled score with one number per call, as data.

Soft-capping (``softcap * tanh(s / softcap)``) is one; a new one is a :class:`ScoreFunction` here and a C++
policy of the same name in csrc/include/fa/variant.cuh. Everything else is derived from this table:
:class:`flash_attention.spec.ScoreSpec`'s build and policy names (and so ``jit.sources.SCORE_MODS``, the
kernels' entry points and cache keys), the configuration features of ``configs.families``, the argument
check of the public functions, and the math of the float64 reference, the chunked fallback and the simulator
(:func:`apply_scores`). ALiBi is not one of them: its slopes are a tensor bound per call and its distance has
origins (spec.ALIBI_ORIGINS), so ScoreSpec names it itself, always after these.

A function's value 0 means "off" (the identity), so a call without it is the plain build; the order of this
table is the order a build applies them in, and the order their names join in a build's name.

This module imports nothing of the package (and not torch: the math runs on the tensors it is handed).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "RESERVED_NAMES",
    "SCORE_FUNCTIONS",
    "ScoreFunction",
    "apply_scores",
    "apply_scores_with_slope",
    "check_value",
    "decode_fields",
    "values_of",
]


@dataclass(frozen=True)
class ScoreFunction:
    """One scalar score function: ``name`` is its build token, its configuration feature and the keyword the
    public functions take; ``policy`` the C++ policy's name part (``fa::Softcap``; a build with ALiBi
    composes ``fa::SoftcapAlibi``); ``apply(scores, value)`` its math on scaled scores, in the scores'
    dtype, for every Python path that computes attention itself; ``slope(out, value)`` its derivative at the
    score that gave ``out`` (the backward's chain rule, from the output alone, as the kernels keep it);
    ``doc`` what it does, for messages; ``kernel(s, value, scale, folded)`` the forward kernels' own
    arithmetic on a block of float32 scores, for the simulator (tools/sim.py): ``folded`` (the configs with
    opt_softmax) takes the unscaled scores and returns them in the same units, as the policy's ``folded``
    does, else the scaled ones (None: the simulator refuses calls with it); ``forward_config_d128`` the
    warp-specialized forward config measured to suit the function at head_dim 128 (bf16, non-causal, from 3k
    keys, the call's only feature: ops.select.score_function_config), or None for the plain pick;
    ``typical`` a value the models that use it take, which ``bench --features`` times it at;
    ``decode_fields`` the float32 fields of the decode kernels' params (``fa::DecodeParams``,
    jit.params.DecodeParams, in this table's order) that carry it as a run-time value, and
    ``decode_values(value)`` what they hold (``()``: the decode kernels have no such function, and a call
    with it takes the composed path)."""

    name: str
    policy: str
    apply: Callable
    slope: Callable
    doc: str
    kernel: Callable | None = None
    forward_config_d128: str | None = None
    typical: float = 1.0
    decode_fields: tuple[str, ...] = ()
    decode_values: Callable = lambda value: ()

    def __post_init__(self) -> None:
        # The layers below the public functions take the values as keywords beside their own arguments.
        if not self.name.isidentifier() or self.name in RESERVED_NAMES:
            raise ValueError(
                f"a score function's name must be an identifier outside {sorted(RESERVED_NAMES)}; got "
                f"{self.name!r}"
            )
        # The decode kernels read a run-time value of 0 as off, and every field of every function is filled
        # on every call (decode_fields): off has to be zeros, one per field.
        off = tuple(self.decode_values(0.0))
        if len(off) != len(self.decode_fields) or any(off):
            raise ValueError(
                f"{self.name}: decode_values(0) must be one zero per decode field {self.decode_fields}; "
                f"got {off}"
            )


#: The keywords of the layers that take score values by name (ops.cuda_forward and the others, the fallback,
#: the reference, the simulator), which no score function may take.
RESERVED_NAMES = frozenset(
    {
        "q", "k", "v", "out", "lse", "dout", "causal", "softmax_scale", "scale", "return_lse", "config",
        "trace", "trace_fault", "key_range", "dropout_p", "dropout_seed", "deterministic", "window",
        "alibi_slopes", "alibi_diagonal", "sinks", "segments", "forward", "compute_dtype", "dropout_keep",
        "error_bound", "alibi", "alibi_origin", "alibi_rows", "score_values",
    }
)  # fmt: skip


def _cap(scores, value: float):
    return value * (scores / value).tanh()


def _cap_slope(capped, value: float):
    return 1 - (capped / value) ** 2  # d/ds c tanh(s / c) = 1 - tanh^2


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _cap_kernel(s, value: float, scale: float, folded: bool):
    # fa::Softcap with an exact tanh (the hardware's tanh.approx, about 2^-11 relative, is not modelled):
    # folded, (cap / scale) tanh(s (scale / cap)), both factors rounded to float32 as the policy holds them.
    if folded:
        pre, post = _f32(scale / value), _f32(value / scale)
        return (post * (s * pre).double().tanh()).float()
    return (value * (s / value).double().tanh()).float()


#: Every scalar score function, in the order a build applies them (and joins their names).
SCORE_FUNCTIONS: dict[str, ScoreFunction] = {
    "softcap": ScoreFunction(
        "softcap",
        "Softcap",
        _cap,
        _cap_slope,
        "caps the scaled score, softcap * tanh(s / softcap)",
        _cap_kernel,
        # A tanh and an exp2 per score are as many SFU cycles as the tensor cores' products at head_dim 128:
        # three consumer warpgroups of 64 rows over 64-key tiles (three stages) hide the SFU's queue better
        # than two of 128 rows over 128 keys, and shorter tiles shorten each softmax burst. bench (H200): at
        # 4k 0.994 / 0.995 ms against 1.026 / 1.028 in two rounds of one call (-3.1%), 0.976 against 1.021
        # in another (-4.4%); at 8k and 16k -9.4% and -7.9% against the 176-key pick. Causal it is 0.5%
        # slower and plain attention 5% slower with it, so both keep their picks (docs/kernel-log.md, steps
        # 106 and 115).
        forward_config_d128="(BF16, 128, 192, 64, 16): wgmma+ws+overlap+tma_store+stages_3",
        typical=30.0,  # (Grok-1's attention cap; Gemma 2 takes 50)
        # A run-time branch in the decode kernels, not a policy (their builds are per head_dim only): the cap
        # and its reciprocal, 0 for off.
        decode_fields=("softcap", "softcap_inv"),
        decode_values=lambda cap: (cap, 1.0 / cap if cap else 0.0),
    ),
}


def check_value(name: str, value: object) -> float:
    """``value`` as the float a call's ``name`` function takes, or TypeError / ValueError naming the
    argument: a finite number >= 0, 0 meaning off. TypeError too for a name the table lacks (a keyword no
    function of the call takes)."""
    if name not in SCORE_FUNCTIONS:
        raise TypeError(
            f"unexpected keyword argument {name!r}: no score function of that name (there are "
            f"{', '.join(SCORE_FUNCTIONS)})"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float (0: none); got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (0: none); got {value!r}")
    return float(value)


def values_of(**values: float) -> tuple[tuple[str, float], ...]:
    """The active functions of keyword values (``softcap=30.0``; 0: off) as a ScoreSpec holds them: (name,
    value) pairs in the table's order. TypeError for a name the table lacks, ValueError for a negative
    value."""
    unknown = set(values) - set(SCORE_FUNCTIONS)
    if unknown:
        raise TypeError(f"no score function named {sorted(unknown)}; there are {tuple(SCORE_FUNCTIONS)}")
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (0: none); got {value!r}")
    return tuple((name, float(values[name])) for name in SCORE_FUNCTIONS if values.get(name))


def decode_fields(values: tuple[tuple[str, float], ...] = ()) -> list[tuple[str, float]]:
    """The decode kernels' run-time score fields, (field, value) in the table's order, every field of every
    function that has them: zeros where ``values`` (a ScoreSpec's) leaves the function off (its
    ``decode_values(0)``, which an entry must make zeros, as the kernels read 0 as off)."""
    given = dict(values)
    return [
        pair
        for fn in SCORE_FUNCTIONS.values()
        for pair in zip(fn.decode_fields, fn.decode_values(given.get(fn.name, 0.0)), strict=True)
    ]


def apply_scores(scores, values: tuple[tuple[str, float], ...]):
    """``scores`` through each active function of ``values`` (a ScoreSpec's), in the table's order."""
    for name, value in values:
        scores = SCORE_FUNCTIONS[name].apply(scores, value)
    return scores


def apply_scores_with_slope(scores, values: tuple[tuple[str, float], ...]):
    """(:func:`apply_scores`, the derivative of the whole chain at ``scores``, or None where ``values`` is
    empty): what a backward multiplies dP's softmax gradient by."""
    slope = None
    for name, value in values:
        fn = SCORE_FUNCTIONS[name]
        scores = fn.apply(scores, value)
        step = fn.slope(scores, value)
        slope = step if slope is None else slope * step
    return scores, slope
