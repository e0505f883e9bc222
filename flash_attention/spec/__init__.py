"""The options of one attention call as frozen values: what the launch layer plans by, and the one place
where a kernel build's score function is named.

:class:`ScoreSpec` is what happens to a scaled score before the softmax (soft-capping, ALiBi and the form
of ALiBi's distance); :class:`AttentionSpec` is every option of a call that a kernel, a plan or a fallback
decides by (no tensors: those travel beside it, bound per call). Both are built once, by the argument
checks of the public functions (``spec.validate``), and read whole below; the build's name of the score
function (``jit.sources.SCORE_MODS``: the C++ policy it instantiates) comes from :attr:`ScoreSpec.build`
and from nowhere else, and no layer reads a feature back out of that name.

This module imports nothing of the package but its table of score functions (spec.score_functions), so every
layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from .score_functions import SCORE_FUNCTIONS, values_of

__all__ = [
    "ALIBI_ORIGINS",
    "NO_SCORE",
    "SCORE_FEATURES",
    "AttentionSpec",
    "OpOptions",
    "ScoreSpec",
    "launch_variants",
    "pack_options",
    "score_builds",
]

#: Where ALiBi measures a query row's distance to a key from (``ScoreSpec.alibi_origin``): "diagonal", the
#: bottom-right-aligned diagonal ``i + seqlen_k - seqlen_q`` (on a packed batch without causal, the packed
#: row's own index); "runs", each query row's run end (a packed batch of causal sequences); "table", each
#: row's entry of the segments' table of diagonals (a packed batch whose query and key counts differ).
ALIBI_ORIGINS = ("diagonal", "runs", "table")


@dataclass(frozen=True)
class ScoreSpec:
    """The score function of a call: ``values``, the active scalar functions of
    :data:`~flash_attention.spec.score_functions.SCORE_FUNCTIONS` and their numbers as (name, value) pairs,
    in that table's order (each entry's ``doc`` says what it does to the scaled score), then
    ``alibi``, ALiBi's ``-slope * distance`` added to it, the distance measured from ``alibi_origin``
    (:data:`ALIBI_ORIGINS`), with a slope per (batch row or) head, or per query row with ``alibi_rows`` (a
    packed batch whose sequences have slopes of their own). The slopes themselves are a tensor bound per
    call. ``ScoreSpec()`` is the identity; :meth:`of` builds one from keywords."""

    values: tuple[tuple[str, float], ...] = ()
    alibi: bool = False
    alibi_origin: str = "diagonal"
    alibi_rows: bool = False

    def __post_init__(self) -> None:
        names = [name for name, _ in self.values]
        order = [name for name in SCORE_FUNCTIONS if name in names]
        if names != order or any(not value for _, value in self.values):
            raise ValueError(
                f"values must name functions of {tuple(SCORE_FUNCTIONS)} once each, in that order, with "
                f"values other than 0 (use ScoreSpec.of); got {self.values!r}"
            )
        if self.alibi_origin not in ALIBI_ORIGINS:
            raise ValueError(f"alibi_origin must be one of {ALIBI_ORIGINS}; got {self.alibi_origin!r}")
        if not self.alibi and (self.alibi_origin != "diagonal" or self.alibi_rows):
            raise ValueError("alibi_origin and alibi_rows describe ALiBi: they need alibi=True")

    @classmethod
    def of(
        cls, *, alibi: bool = False, alibi_origin: str = "diagonal", alibi_rows: bool = False, **values: float
    ) -> ScoreSpec:
        """The spec of the scalar functions given by name (``name=value``, the registry's keywords; 0: off)
        and ALiBi's form."""
        return cls(values_of(**values), alibi, alibi_origin, alibi_rows)

    def value(self, name: str) -> float:
        """The number of the scalar function ``name`` (0: off)."""
        return dict(self.values).get(name, 0.0)

    def _parts(self) -> list[str]:
        # The active scalar functions in the registry's order, then "alibi", its origin ("runs", "table";
        # none for the diagonal) and "rows": what the build's name and the C++ policy's are made of.
        parts = [name for name, _ in self.values]
        if self.alibi:
            parts.append("alibi")
            if self.alibi_origin != "diagonal":
                parts.append(self.alibi_origin)
            if self.alibi_rows:
                parts.append("rows")
        return parts

    @property
    def build(self) -> str | None:
        """The kernel build's score function, a key of ``jit.sources.SCORE_MODS`` (None: none): the features
        joined by "_" (the functions' names, then "alibi", its origin and "rows"). Build names, cache keys and
        entry-point symbols all carry it."""
        return "_".join(self._parts()) or None

    @property
    def policy(self) -> str | None:
        """The C++ policy of csrc/include/fa/variant.cuh the build instantiates (None: none), named from the
        same features: each function's ``policy`` part, then ``Alibi``, its origin and ``Rows``."""
        names = {name: fn.policy for name, fn in SCORE_FUNCTIONS.items()}
        parts = [names.get(p) or p.capitalize() for p in self._parts()]
        return "fa::" + "".join(parts) if parts else None

    @property
    def features(self) -> dict[str, bool]:
        """The configuration features it needs (``configs.families``), as ``ops.plans.feature_list`` flags:
        one per scalar function, and "alibi"."""
        active = dict(self.values)
        return {**{name: name in active for name in SCORE_FUNCTIONS}, "alibi": self.alibi}


#: The identity score function (no scalar function, no ALiBi).
NO_SCORE = ScoreSpec()

#: The configuration features of the score functions (``configs.families.FEATURES``): each scalar one's
#: name, then "alibi".
SCORE_FEATURES = (*SCORE_FUNCTIONS, "alibi")


def score_builds() -> dict[str, str]:
    """Every score function a kernel build can take: its build name -> its C++ policy (``jit.sources``'s
    SCORE_MODS), one per combination of the scalar functions, ALiBi, ALiBi's origin and per-row slopes."""
    out = {}
    names = tuple(SCORE_FUNCTIONS)
    for mask in range(1 << len(names)):
        scalars = {name: 1.0 for i, name in enumerate(names) if mask >> i & 1}
        for alibi, origin, rows in [(False, "diagonal", False)] + [
            (True, o, r) for o in ALIBI_ORIGINS for r in (False, True)
        ]:
            spec = ScoreSpec.of(alibi=alibi, alibi_origin=origin, alibi_rows=rows, **scalars)
            if spec.build is not None:
                out[spec.build] = spec.policy
    return out


@dataclass(frozen=True)
class AttentionSpec:
    """Every option of one attention call that a kernel build, a plan or the fallback decides by, checked
    (``spec.validate``): ``causal``, the resolved softmax ``scale``, the sliding ``window``
    (left, right) as the caller gave it (-1: unbounded; None: none), the ``score`` function, whether the call
    has per-batch key ranges (``ranged``), its ``dropout_p``, whether its backward is ``deterministic``,
    whether it has attention ``sinks``, and ``segments``: the length of a packed batch's runs tuple (0: not
    packed; 2: the rows' and keys' runs; 3: with each row's ALiBi diagonal). Hashable: the plans key on it."""

    causal: bool = False
    scale: float = 1.0
    window: tuple[int, int] | None = None
    score: ScoreSpec = NO_SCORE
    ranged: bool = False
    dropout_p: float = 0.0
    deterministic: bool = False
    sinks: bool = False
    segments: int = 0

    @property
    def forward(self) -> AttentionSpec:
        """The spec without what only the backward reads (``deterministic``): what a forward plan keys on, so
        that a training call and an inference call of one shape share it."""
        return replace(self, deterministic=False) if self.deterministic else self


class OpOptions(NamedTuple):
    """The numbers of a call's spec as the torch ops (``flash_attention::fwd`` / ``bwd``) carry them, the
    tensors (key ranges, the dropout seed, ALiBi slopes, sinks, a packed batch's runs) travelling beside
    them: ``causal``, the resolved ``scale``, whether the backward is ``deterministic``, ``dropout_p``, the
    sliding ``window`` (None: none) and ``score``, the active scalar score functions' (name, value) pairs as
    :attr:`ScoreSpec.values` holds them (``()``: none). An op schema takes them packed, two lists
    (:meth:`pack`, :meth:`unpack`): one argument each, however many options a variant adds. Plain values,
    not a dataclass, so that torch.compile's traces can make them (torch 2.11's dynamo cannot build the
    frozen dataclasses above inside a trace)."""

    causal: bool
    scale: float
    deterministic: bool = False
    dropout_p: float = 0.0
    window: tuple[int, int] | None = None
    score: tuple[tuple[str, float], ...] = ()

    def pack(self) -> tuple[list[int], list[float]]:
        """The schemas' ``int[] options`` and ``float[] values`` (:func:`pack_options`)."""
        return pack_options(
            self.causal, self.scale, self.deterministic, self.dropout_p, self.window, **self.score_values
        )

    @property
    def score_values(self) -> dict[str, float]:
        """The scalar score functions' values by name, as the launch layer's keywords take them."""
        return dict(self.score)

    def attention_spec(
        self, *, ranged: bool = False, alibi: bool = False, sinks: bool = False, segments: int = 0
    ) -> AttentionSpec:
        """The :class:`AttentionSpec` of an op call with these options, given what its tensors say (key
        ranges, ALiBi slopes, sinks, the length of a packed batch's runs tuple): what the op's PyTorch path
        takes.
        Built inside the op, which torch.compile's traces do not enter. (ALiBi's origin and per-row slopes
        are the kernels' concern: the fallback reads the tensors themselves.)"""
        return AttentionSpec(
            self.causal,
            self.scale,
            self.window,
            ScoreSpec(self.score, alibi),
            ranged,
            self.dropout_p,
            self.deterministic,
            sinks,
            segments,
        )

    @classmethod
    def unpack(cls, ints, floats) -> OpOptions:
        """The options :meth:`pack` packed (ints and floats as a schema hands them over: any sequences)."""
        causal, deterministic, windowed, left, right = (int(x) for x in ints)
        scale, dropout_p, *values = (float(x) for x in floats)
        window = (left, right) if windowed else None
        score = tuple((name, value) for name, value in zip(SCORE_FUNCTIONS, values, strict=True) if value)
        return cls(bool(causal), scale, bool(deterministic), dropout_p, window, score)


def pack_options(
    causal: bool,
    scale: float,
    deterministic: bool = False,
    dropout_p: float = 0.0,
    window: tuple[int, int] | None = None,
    **score_values: float,
) -> tuple[list[int], list[float]]:
    """:class:`OpOptions`'s packed form from the values themselves, building no object (what a traced call
    runs): ``ints`` = causal, deterministic, whether there is a window, its left and right sides; ``floats``
    = scale, dropout_p, then each scalar score function's value (``score_values`` by name, 0: off) in the
    order of spec.score_functions."""
    if not score_values.keys() <= SCORE_FUNCTIONS.keys():
        raise TypeError(f"no score function named {sorted(score_values.keys() - SCORE_FUNCTIONS.keys())}")
    left, right = (0, 0) if window is None else window
    ints = [int(causal), int(deterministic), int(window is not None), int(left), int(right)]
    values = [float(score_values.get(name, 0.0)) for name in SCORE_FUNCTIONS]
    return ints, [float(scale), float(dropout_p), *values]


def launch_variants(window=None, alibi_slopes=None, segments=None, **score_values: float) -> dict:
    """The launch layer's keywords of a call's variants (``ops.cuda_forward`` / ``cuda_backward`` /
    ``training_forward``), only those the call has, so that backends without a variant (the CPU tests'
    stand-ins) are called as without it: ``window`` (checked), ``alibi_slopes`` (a tensor), ``segments`` (a
    packed batch's runs, flash_attention.api.varlen) and the scalar score functions' ``score_values`` by
    name (0: none)."""
    kw = {} if window is None else {"window": window}
    if segments is not None:
        kw["segments"] = segments
    for name, value in score_values.items():
        if value:
            kw[name] = float(value)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    return kw
