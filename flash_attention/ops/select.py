"""Which kernel configuration a call runs: the caller's, else this GPU's tuned winner, else the heuristic;
adjusted for what the call needs (configs.families), and checked against the GPU's shared memory.

Torch-free: the launch layer passes the problem's sizes and the device's facts in. The catalog of every kernel
a model can need (``python -m flash_attention build``) is derived from the same choices, so the two cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..configs import (
    DTYPES,
    HEAD_DIMS,
    BwdConfig,
    KernelConfig,
    classic_hopper_config,
    default_bwd_config,
    default_config,
    hopper_bwd_config,
    padded_head_dim,
    parse_bwd_config,
    parse_config,
    portable_config,
    unsupported,
)
from ..configs import backward as backward_configs
from ..configs.decode import DecodeConfig, default_decode_config
from ..spec.score_functions import SCORE_FUNCTIONS
from . import winners

__all__ = [
    "BuildJob",
    "NoKernel",
    "backward_config",
    "catalog",
    "dropout_config",
    "forward_config",
    "value_dim_backward_config",
]


class NoKernel(RuntimeError):
    """No kernel of ours can compute this call on this GPU (the message says why): the caller computes it
    with the PyTorch fallback instead, after a once-per-reason warning."""


#: The most keys per block of the warp-specialized forward's dropout builds, by head_dim (dropout_config).
_DROPOUT_WS_KEYS = {128: 128, 256: 64}


def dropout_config(cfg: KernelConfig) -> KernelConfig:
    """The forward config of a dropout call: the hash adds registers, so an sm80 tile with two 16-row mma
    tiles per warp (up to 255 registers without dropout) runs with one, instead of spilling 112-128 bytes
    (docs/kernel-log.md, step 16). wgmma tiles have one 16-row slice per warp already, but a warp-specialized
    block of three consumer warpgroups (160 registers each) spills 8 bytes with the hash, so it runs with two
    (240 registers each). And a warp-specialized block whose S and O together fill its consumers'
    registers takes fewer keys: 176 at head_dim 128 spilled 68-72 bytes and 80 at 256 8 bytes with the
    paired hash (NVRTC 13.0, kernel log 142), where 128 and 64 spill none."""
    if cfg.warp_specialized:
        if cfg.block_q == 192:
            cfg = cfg.replace(block_q=128, num_warps=12)
        keys = _DROPOUT_WS_KEYS.get(cfg.head_dim)
        return cfg.replace(block_kv=keys) if keys is not None and cfg.block_kv > keys else cfg
    if cfg.block_q // cfg.num_warps > 16:
        return cfg.replace(block_q=cfg.block_q // 2)
    return cfg


def packed_config(cfg: KernelConfig) -> KernelConfig:
    """The forward config of a packed batch (the segments build) from the dense pick at its sequences'
    typical length: at head_dim 128, one block per tile where the dense pick is the persistent grid with the
    epilogue under the next tile (tile_overlap). A packed batch has many tiles of unequal cost, ordered
    longest first (ops.query_tiles), which the hardware's block scheduler balances as well as the atomic
    counter; the persistent grid's overlap did not pay for itself there: bench --varlen's documents
    (typical length 3.6k) non-causal 0.92-0.97x the time with one block per tile, 512..4k-token documents
    causal 0.975x (H100; docs/kernel-log.md, step 97)."""
    if cfg.warp_specialized and cfg.tile_overlap and cfg.head_dim == 128:
        return cfg.replace(persistent=False, tile_overlap=False, block_kv=128)
    return cfg


def _check_explicit(cfg, dtype: str, head_dim: int, missing: list[str], smem: int, limit: int) -> None:
    if cfg.dtype != dtype:
        raise ValueError(f"config {cfg.name()} is for {cfg.dtype}, but q is {dtype}")
    if head_dim > cfg.head_dim:
        raise ValueError(f"config {cfg.name()} is compiled for head_dim <= {cfg.head_dim}; got {head_dim}")
    if missing:
        raise ValueError(f"config {cfg.name()} has no build for {', '.join(missing)}; name another config")
    if smem > limit:
        raise ValueError(
            f"config {cfg.name()} needs {smem} bytes of shared memory per block; this GPU allows {limit}"
        )


def score_function_config(cfg: KernelConfig, features: tuple[str, ...], causal: bool, n: int) -> KernelConfig:
    """The forward config of a call with a scalar score function from the plain pick: the function's own
    (spec.score_functions, ``forward_config_d128``, where the entry says why) at head_dim 128 in bf16,
    non-causal, from 3k keys, where it is the call's one score function and has one. Not with ALiBi (its
    unbounded form), a window, a packed batch or dropout (whose hash takes a 192-row block to 128 rows):
    unmeasured there."""
    others = {"alibi", "window", "segments", "dropout", "key_range"}
    functions = [SCORE_FUNCTIONS[f] for f in features if f in SCORE_FUNCTIONS]
    if (
        len(functions) == 1
        and functions[0].forward_config_d128 is not None
        and not others & set(features)
        and not causal
        and n >= 3072
        and cfg.warp_specialized
        and cfg.dtype == "bf16"
        and cfg.head_dim == 128
    ):
        return parse_config(functions[0].forward_config_d128)
    return cfg


#: A sliding window this narrow or narrower (its left plus right keys) runs on the small-tile config of its
#: head_dim below instead of the plain pick (kernel log 163, 164): a block of Bq queries computes the
#: band's two edge triangles, Bq wide, beside W useful keys a row, so where W is a few times Bq the plain
#: pick's 128- or 192-query blocks (and 128-key tiles) compute mostly masked scores: gpt-oss's 128-key
#: window at d64 on (BF16, 64, 192, 128, 16) keeps about a third of what it computes, 64 x 64 tiles about
#: two thirds. The configs are warp-specialized and non-persistent (a window's blocks cost alike, nothing to
#: balance): at d64 64 x 64 tiles with one consumer warpgroup, small enough for two blocks a
#: multiprocessor; at d128 the 128 x 128 tiles of the 4k pick (16k's plain pick has 176-key tiles). 512
#: keys is the widest window measured faster.
NARROW_WINDOW_MAX_KEYS = 512
# Measured (H200, causal forward, paired against the plain pick): head_dim 64 on 64 x 64 tiles (kernel log
# 163, 4 x 4096 x 16): windows of 128 / 256 / 512 keys 0.74x / 0.83x / 0.95x the time; head_dim 128's own
# 64 x 64 config ran 1.22x / 1.42x (128 / 512 keys): one consumer warpgroup's wgmma rate at 128 columns costs
# more than the edge triangles it saves. Head_dim 128 on the 128 x 128 config (kernel log 164, 1 x 16384 x
# 16, where the plain pick is 128 x 176): 0.79x / 0.76x / 0.81x; at 4k, where the plain pick is that config
# already or its persistent form (two-sided windows of 64 and 200 keys), level.
NARROW_WINDOW_CONFIGS = {
    64: "(BF16, 64, 64, 64, 8): wgmma+ws+overlap+tma_store+stages_2",
    128: "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+tma_store+stages_2",
}


def narrow_window_config(
    cfg: KernelConfig, window: tuple[int, int] | None, features: tuple[str, ...]
) -> KernelConfig:
    """The forward config of a call with a sliding ``window`` (the kernels' (left, right) bounds) from the
    plain pick ``cfg``: NARROW_WINDOW_CONFIGS' for its head_dim and dtype where the window is at most
    NARROW_WINDOW_MAX_KEYS wide, ``cfg`` is warp-specialized and the small config takes every feature the
    call needs; else ``cfg``."""
    # (the kernels' bounds: an unbounded side is already seqlen_q + seqlen_k, ops.plans.window_bounds)
    if window is None or not cfg.warp_specialized or sum(window) > NARROW_WINDOW_MAX_KEYS:
        return cfg
    name = NARROW_WINDOW_CONFIGS.get(cfg.head_dim)
    if name is None or cfg.value_dim != cfg.head_dim:
        return cfg
    small = parse_config(name).replace(dtype=cfg.dtype)
    return cfg if unsupported(small, features) else small


def forward_config(
    dtype: str,
    head_dim: int,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    group: int,
    *,
    arch: str,
    gpu: str,
    smem_limit: int,
    features: Iterable[str] = (),
    config: KernelConfig | str | None = None,
    head_dim_v: int = 0,
    window: tuple[int, int] | None = None,
) -> KernelConfig:
    """The forward configuration of a call (``head_dim_v``: v's head_dim where it is not head_dim's, which
    only the warp-specialized family takes: feature ``value_dim``; ``window``: a sliding window's (left,
    right) bounds, whose width may pick smaller tiles: :func:`narrow_window_config`).

    ``features`` are what the call needs beyond plain attention (``key_range``, ``dropout``, ``trace``,
    ``negative_scale``: configs.families). A named ``config`` runs as named, or raises ValueError saying why
    it cannot; otherwise the tuned winner or the heuristic, moved to the portable family when its own lacks
    a feature. Raises :class:`NoKernel` when nothing of ours fits this GPU.
    """
    features = tuple(features)
    dv = head_dim_v if head_dim_v and head_dim_v != head_dim else 0
    if dv > head_dim:
        # (the warp-specialized forward stages O in the Q tile: V may be narrower than Q, not wider)
        raise NoKernel(
            f"v's head_dim ({dv}) is wider than q's and k's ({head_dim}): no forward kernel takes it"
        )
    if dv:
        features = (*features, "value_dim")
    if config is not None:
        cfg = parse_config(config)
        missing = unsupported(cfg, features)
        if dv and dv > cfg.value_dim:
            missing.append(f"v's head_dim {dv} (its kHeadDimV is {cfg.value_dim})")
        if "negative_scale" in missing and not cfg.wgmma:
            # The folded softmax takes the row max of the unscaled scores, which is the scaled scores' max
            # only for a positive scale; the other softmax of the same kernel handles any sign.
            raise ValueError(
                f"softmax_scale must be positive for config {cfg.name()} (opt_softmax folds the scale into "
                "the exponent after taking the max); use a config without opt_softmax"
            )
        _check_explicit(cfg, dtype, head_dim, missing, cfg.smem_bytes, smem_limit)
        return cfg
    # (the tuned winners are keyed by one head_dim: a call with v's own takes the heuristic's pick)
    tuned = None if dv else winners.lookup(gpu, dtype, head_dim, causal, seqlen_q, seqlen_k, group)
    cfg = tuned or default_config(dtype, head_dim, causal, seqlen_q, seqlen_k, arch)
    if dv:
        cfg = _with_value_dim(cfg, dv)
    elif tuned is None:
        cfg = score_function_config(cfg, features, causal, max(seqlen_q, seqlen_k))
        cfg = narrow_window_config(cfg, window, features)
    if cfg.warp_specialized and unsupported(cfg, features):
        # The sm90 kernel of the same call: it reads any layout the kernels accept (cp.async).
        cfg = classic_hopper_config(dtype, padded_head_dim(head_dim), max(seqlen_q, seqlen_k), causal)
    if unsupported(cfg, features):
        cfg = portable_config(dtype, head_dim, causal, seqlen_q, seqlen_k)
    if "negative_scale" in features and cfg.opt_softmax:
        cfg = cfg.replace(opt_softmax=False)
    if "segments" in features:
        cfg = packed_config(cfg)
    if "dropout" in features:
        cfg = dropout_config(cfg)
    missing = unsupported(cfg, features)
    if missing:  # (only value_dim outlives the portable family: every other feature is one of its builds)
        raise NoKernel(
            f"no forward kernel of ours takes {', '.join(missing)} here (v's head_dim {head_dim_v} against "
            f"q's {head_dim}, {arch}: {cfg.name()})"
        )
    if cfg.smem_bytes > smem_limit:
        raise NoKernel(
            f"the forward kernel {cfg.name()} needs {cfg.smem_bytes} bytes of shared memory per block and "
            f"this GPU ({arch}) allows {smem_limit}"
        )
    return cfg


def _with_value_dim(cfg: KernelConfig, dv: int) -> KernelConfig:
    """``cfg`` with V and O ``dv`` wide where its family takes that: the warp-specialized forward, compiled
    for dv rounded up to a panel (64 columns; the kernel masks the tail at run time, FwdParams.head_dim_v),
    which may be head_dim itself. Else ``cfg`` unchanged (the selection then finds no kernel)."""
    if not cfg.warp_specialized:
        return cfg
    panels = min(-(-dv // 64) * 64, cfg.head_dim)
    try:
        return cfg.replace(head_dim_v=panels)
    except ValueError:  # (a value dim the kernel cannot hold: wider than head_dim)
        return cfg


def _wide_for(cfg: BwdConfig | None, features: tuple[str, ...]) -> BwdConfig | None:
    """``cfg``, or the wide kernel where ``cfg`` is the warp-specialized wide one (head_dim 192, 256) and the
    call needs a feature its family lacks (configs.families: dropout, the deterministic mode): the wide
    kernel's builds are its forms of those. Not a config reading v's own head_dim (BwdConfig.head_dim_v): the
    wide kernel reads one head_dim, so that call is the caller's error (:func:`_check_explicit` names it)."""
    if cfg is not None and cfg.wide_ws and cfg.value_dim == cfg.head_dim and unsupported(cfg, features):
        return hopper_bwd_config(cfg.dtype, cfg.head_dim, warp_specialized=False)
    return cfg


def value_dim_backward_config(
    dtype: str, head_dim: int, value_dim: int, causal: bool, arch: str, dropout: bool, deterministic: bool
) -> BwdConfig | None:
    """The backward config of a call whose v (``value_dim`` wide) is narrower than q and k (``head_dim``)
    where a kernel reads v's head_dim as it is (configs.backward.HOPPER_BWD_READS_VALUE_DIM: the
    warp-specialized wide kernel at 192 with v at 64 or 128, on sm_90, without dropout or the deterministic
    mode, which take the wide kernel), else None: the call runs q's head_dim's kernels on v, the output and
    dO padded to it (ops.cuda_backward)."""
    if not backward_configs.HOPPER_BWD_READS_VALUE_DIM or arch != "sm_90":
        return None
    if value_dim not in backward_configs.WIDE_WS_VALUE_DIMS.get(head_dim, ()):
        return None
    cfg = hopper_bwd_config(dtype, head_dim, causal=causal).replace(head_dim_v=value_dim)
    features = [name for name, on in (("dropout", dropout), ("deterministic", deterministic)) if on]
    return None if unsupported(cfg, features) else cfg  # (configs.families: the wide kernel takes those)


def backward_config(
    dtype: str,
    head_dim: int,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    group: int,
    *,
    arch: str,
    gpu: str,
    smem_limit: int,
    features: Iterable[str] = (),
    config: BwdConfig | str | None = None,
) -> BwdConfig:
    """The backward configuration of a call (``features``: ``key_range``, ``dropout``, ``deterministic``),
    by the rules of :func:`forward_config`."""
    features = tuple(features)
    if config is not None:
        cfg = _wide_for(parse_bwd_config(config), features)
        smem = max(cfg.smem_bytes, cfg.dq_smem_bytes)
        _check_explicit(cfg, dtype, head_dim, unsupported(cfg, features), smem, smem_limit)
        return cfg
    cfg = winners.lookup_bwd(gpu, dtype, head_dim, causal, seqlen_q, seqlen_k, group) or default_bwd_config(
        dtype, head_dim, arch, causal=causal
    )
    cfg = _wide_for(cfg, features)
    if cfg is not None and unsupported(cfg, features):
        cfg = default_bwd_config(dtype, head_dim, arch, portable=True)
    if cfg is None or max(cfg.smem_bytes, cfg.dq_smem_bytes) > smem_limit:
        need = "" if cfg is None else f" ({cfg.name()} needs {max(cfg.smem_bytes, cfg.dq_smem_bytes)} bytes)"
        raise NoKernel(
            f"no backward kernel for head_dim {padded_head_dim(head_dim)} fits the {smem_limit} bytes of "
            f"shared memory per block of this GPU ({arch}){need}"
        )
    return cfg


# ------------------------------------------------------------------------------------------------------
# The catalog: every kernel a model can need, for ahead-of-time builds


@dataclass(frozen=True)
class BuildJob:
    """One translation unit to compile: a config, the GPU architecture, and its variant."""

    cfg: KernelConfig | BwdConfig | DecodeConfig
    arch: str
    ranged: bool = False
    dropout: bool = False

    def describe(self) -> str:
        variant = "+".join(x for x, on in (("key_range", self.ranged), ("dropout", self.dropout)) if on)
        return f"{self.arch} {self.cfg.name()}" + (f" [{variant}]" if variant else "")


#: The lengths the heuristics distinguish (the benchmark's; winners.SEQLEN_BUCKETS).
_LENGTHS = winners.SEQLEN_BUCKETS
_VARIANTS = ((False, False), (True, False), (False, True), (True, True))  # (key_range, dropout)


def catalog(
    arch: str, dtypes: Iterable[str] = DTYPES, head_dims: Iterable[int] = HEAD_DIMS
) -> list[BuildJob]:
    """Every translation unit a default ``attention()`` call and its backward can run on a GPU of ``arch``:
    for each dtype, compiled head_dim, mask and length, the forward and backward configs of plain calls,
    key-padded calls (``key_range``), dropout and both, in both gradient modes (the deterministic kernels
    share the backward's translation unit). Debug (trace) builds and negative softmax scales are not
    included: no model needs them; nor is the cp.async producer the Hopper backward falls back to for a
    layout no tensor map describes (ops.backward: a broadcast output gradient), which compiles on first use.
    The decode kernels of each dtype and head_dim are."""
    jobs: list[BuildJob] = []
    limit = 1 << 30  # the choice below is the heuristic's; fitting the GPU is checked per job by the caller
    for dtype in dtypes:
        for d in head_dims:
            for causal in (False, True):
                for n in _LENGTHS:
                    for ranged, dropout in _VARIANTS:
                        features = [f for f, on in (("key_range", ranged), ("dropout", dropout)) if on]
                        cfg = _heuristic_forward(dtype, d, causal, n, arch, features, limit)
                        jobs.append(BuildJob(cfg, arch, ranged, dropout))
                        for det in (False, True):
                            bwd = _heuristic_backward(dtype, d, causal, n, arch, features, det, limit)
                            if bwd is not None:
                                jobs.append(BuildJob(bwd, arch, ranged, dropout))
            # The decode kernels (attention_with_kvcache): one token per row and a few (a GQA group of up to
            # 16 query heads packed in 16 rows), and more rows (speculative decoding: wgmma on Hopper).
            for rows in (1, 64):
                jobs.append(BuildJob(default_decode_config(dtype, d, rows, arch), arch))
    return list(dict.fromkeys(jobs))


def _heuristic_forward(dtype, d, causal, n, arch, features, limit) -> KernelConfig:
    return forward_config(
        dtype, d, causal, n, n, 1, arch=arch, gpu="", smem_limit=limit, features=features, config=None
    )


def _heuristic_backward(dtype, d, causal, n, arch, features, deterministic, limit) -> BwdConfig | None:
    if deterministic:
        features = [*features, "deterministic"]
    try:
        return backward_config(
            dtype, d, causal, n, n, 1, arch=arch, gpu="", smem_limit=limit, features=features, config=None
        )
    except NoKernel:
        return None
