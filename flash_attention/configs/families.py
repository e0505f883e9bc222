"""Which kernel family computes which feature: the one table the launch layer consults.

A family is (direction, kernel kind): the portable sm80-instruction kernels run on every GPU from sm_80 on;
the wgmma kernels (the sm90 kernel, and the warp-specialized one whose TMA loads need tensor-map-addressable
layouts) run on sm_90 only and do not (yet) have every instantiation. When a call needs a
feature its config's family lacks, the launch layer runs the portable family instead (never a wrong or
missing result); with an explicitly named config it raises, naming the feature.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..spec import SCORE_FEATURES
from .backward import BwdConfig
from .forward import KernelConfig

__all__ = ["FEATURES", "is_wgmma", "supports", "unsupported"]

#: Every feature a call can ask of a kernel.
#: causal: the bottom-right causal mask; key_range: per-batch key ranges (key padding); dropout: attention
#: dropout; deterministic: a backward without atomics; trace: the debug build (fa/trace.cuh);
#: negative_scale: a softmax scale below zero (the folded exp2 softmax assumes a positive one);
#: untileable: a q/k/v layout a TMA tensor map cannot describe (e.g. a zero stride from ``expand``);
#: window: a sliding window (fa/variant.cuh, WindowMask); the score functions, one feature each
#: (spec.SCORE_FEATURES: each scalar function of spec.score_functions, then alibi; fa/variant.cuh's
#: policies);
#: segments: per-row key runs of a packed batch (varlen; fa/variant.cuh, SegmentMask).
FEATURES = (
    "causal",
    "key_range",
    "dropout",
    "deterministic",
    "trace",
    "negative_scale",
    "untileable",
    "window",
    *SCORE_FEATURES,
    "segments",
    "value_dim",
)
# (Every family that takes a score function takes them all: a policy composes with any mask and kernel.)
_SCORES = frozenset(SCORE_FEATURES)

_SUPPORTED = {
    # (backward?, kind) -> features
    (False, "portable"): frozenset(
        {"causal", "key_range", "dropout", "trace", "negative_scale", "untileable", "window", "segments"}
        | _SCORES
    ),
    (False, "wgmma"): frozenset(
        {"causal", "key_range", "dropout", "untileable", "window", "segments"} | _SCORES
    ),
    # The debug build of the warp-specialized kernel records from a consumer warp, whose 16 rows of the
    # wgmma accumulators are laid out as one mma.sync tile (fa/frag.cuh); the sm90 kernel has none.
    # value_dim: v's head_dim apart from q's and k's (KernelConfig.head_dim_v; the others load V with
    # head_dim's column bound).
    (False, "ws"): frozenset(
        {"causal", "key_range", "dropout", "trace", "window", "segments", "value_dim"} | _SCORES
    ),
    (True, "portable"): frozenset(
        {"causal", "key_range", "dropout", "deterministic", "untileable", "window", "segments"} | _SCORES
    ),
    # The sm90 kernel: causal and GQA only.
    (True, "wgmma"): frozenset({"causal", "untileable"}),
    # The wide one (head_dim 192/256, csrc/kernels/sm90/bwd_wide): the mask policy's key-range build,
    # dropout, and a deterministic kernel (a third warpgroup adds dQ in the order of fa/dq_turns.cuh).
    (True, "wide"): frozenset(
        {"causal", "key_range", "dropout", "deterministic", "untileable", "window", "segments"} | _SCORES
    ),
    # The warp-specialized wide one (head_dim 192 and 256; csrc/kernels/sm90/bwd_wide_ws): the mask policies
    # and score functions; dropout and the deterministic mode run the wide kernel
    # (ops.select.backward_config).
    (True, "wide_ws"): frozenset({"causal", "key_range", "untileable", "window", "segments"} | _SCORES),
    # The warp-specialized backward copies with cp.async (no tensor maps): any layout the sm90 one takes;
    # its key-range build is the mask policy's (fa/variant.cuh), as in the forward, it has dropout, and a
    # deterministic kernel (dQ reductions in a fixed order, fa/dq_turns.cuh).
    (True, "ws"): frozenset(
        {"causal", "key_range", "dropout", "deterministic", "untileable", "window", "segments"} | _SCORES
    ),
}
#: Features a family has one by one but not together: the deterministic Hopper backwards order their dQ
#: additions by turns that assume every key block between a query block's first and last visits it
#: (fa/dq_turns.cuh); segments can leave key blocks no row of a query block sees (a sequence's unused
#: keys, seqused_k), whose turn would never come. The portable deterministic backward (a dQ kernel per
#: query block, no turns) takes them.
_EXCLUSIVE = {(kind, frozenset({"segments", "deterministic"})) for kind in ("ws", "wide")}


def _kind(cfg: KernelConfig | BwdConfig) -> str:
    if getattr(cfg, "wide_ws", False):
        return "wide_ws"
    if getattr(cfg, "warp_specialized", False):
        return "ws"
    if getattr(cfg, "wide", False):
        return "wide"
    return "wgmma" if is_wgmma(cfg) else "portable"


def is_wgmma(cfg: KernelConfig | BwdConfig) -> bool:
    """Whether ``cfg`` belongs to a Hopper (wgmma, sm_90a) family."""
    return bool(getattr(cfg, "wgmma", False))


def supports(cfg: KernelConfig | BwdConfig, feature: str) -> bool:
    """Whether the family of ``cfg`` has an instantiation for ``feature``."""
    if feature not in FEATURES:
        raise ValueError(f"feature must be one of {FEATURES}; got {feature!r}")
    return feature in _SUPPORTED[(isinstance(cfg, BwdConfig), _kind(cfg))]


def unsupported(cfg: KernelConfig | BwdConfig, features: Iterable[str]) -> list[str]:
    """The ``features`` the family of ``cfg`` lacks, in order (for a pair the family has only one by one,
    the later of the two)."""
    features = list(features)
    missing = [f for f in features if not supports(cfg, f)]
    if isinstance(cfg, BwdConfig):
        kind = _kind(cfg)
        for k, pair in _EXCLUSIVE:
            if k == kind and pair <= set(features):
                missing.append(max(pair, key=features.index))
    return missing
