"""The autotuner's search spaces: every candidate configuration of each kernel family, and the rules that
prune the forward space before anything is compiled."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from flash_attention.configs import (
    BwdConfig,
    KernelConfig,
    default_bwd_config,
    default_config,
    estimated_registers,
    hopper_bwd_config,
    is_hopper,
    padded_head_dim,
    validity_errors,
    wgmma_config,
    ws_config,
)
from flash_attention.configs.forward import block_registers, register_split
from flash_attention.ops.winners import SEQLEN_BUCKETS

from ..report import occupancy

__all__ = [
    "PRUNING_RULES",
    "bwd_candidate_space",
    "candidate_space",
    "occupancy_problem",
    "prune",
    "search_space",
]


#: The warp-specialized kernel's (block_q, block_kv) tiles the tuner tries. One consumer warpgroup only with
#: 128-key tiles (it lost to two at every shape of the step-28 sweep); two with key tiles from 64 to 176
#: (any multiple of 16 is valid; these bracket what fits beside a 3- or 2-deep ring at head_dim 64-256);
#: three (head_dim 64, 160 registers per consumer thread) with up to 128 keys, whose S and P beside O
#: already reach that budget.
_WS_TILES = ((64, 128), (128, 64), (128, 80), (128, 112), (128, 128), (128, 176), (192, 64), (192, 128))

#: Consumer schedules: in order, overlapped, and overlapped with ping-pong and/or the persistent grid (the
#: latter also with each tile's epilogue under the next tile's first S, tile_overlap).
#: Ping-pong or a persistent grid without overlap is left out: both measured 10-35% below the in-order
#: or overlapped schedule at every shape (docs/kernel-log.md, steps 29-30).
_WS_SCHEDULES = (
    dict(),
    dict(overlap=True),
    dict(overlap=True, pingpong=True),
    dict(overlap=True, persistent=True),
    dict(overlap=True, persistent=True, tile_overlap=True),
    dict(overlap=True, pingpong=True, persistent=True),
)


def candidate_space(dtype: str, head_dim: int, causal: bool, arch: str = "sm_80") -> list[KernelConfig]:
    """Every structurally valid combination of the knobs the tuner varies, before pruning.

    Fixed on: cp.async, eager K/V loading, swizzled shared memory and the exp2-folded softmax. Each is a
    step of ``bench --progression``, measured to help on every shape we run (docs/kernel-log.md); varying
    them would only multiply the space by configurations known to lose. Fixed off: reverse K/V order,
    measured within 1% of forward order for causal at head_dim 128 (kernel-log, step 4), so not worth
    doubling the causal space for. K/V fragment groups of 1, 2 or 4 slices: 4 already spans all of
    head_dim 64 and half of 128, and longer groups only hold more registers for the same loads.

    On sm_90 (``arch``) the space is the wgmma kernel's configs instead: one or two warpgroups per block,
    32- to 128-key tiles and a K/V ring 1 to 3 deep (its other knobs are fixed by the kernel). The sm80
    kernel's configs cannot win there: its tuned defaults measured 11-42% below the best wgmma config at every
    point of a scratch sweep on an H100 (docs/kernel-log.md, steps 17-18), so timing them is wasted.
    The warp-specialized kernel's configs join them: the tiles of ``_WS_TILES`` (one to three consumer
    warpgroups), a TMA ring 2 or 3 deep, and the schedules of ``_WS_SCHEDULES``, all with the output's TMA
    stores (fixed on: +1-4% or level at every point measured, docs/kernel-log.md step 62). Not the forward's
    polynomial exponentials (``exp_poly``): 1.06-1.24x the time at every bf16 point measured (kernel log
    139), so they are not timed.
    """
    d = padded_head_dim(head_dim)
    dk = d // 16
    out: list[KernelConfig] = []
    if is_hopper(arch):
        for block_q, block_kv, stages in itertools.product((64, 128), (32, 64, 128), (1, 2, 3)):
            if not validity_errors(wgmma_config(dtype, d, block_q, block_kv, stages, check=False)):
                out.append(wgmma_config(dtype, d, block_q, block_kv, stages))
        for block_q, block_kv in _WS_TILES:
            for stages, knobs in itertools.product((2, 3), _WS_SCHEDULES):
                cfg = ws_config(dtype, d, block_q, block_kv, stages, **knobs, tma_store=True, check=False)
                if not validity_errors(cfg):
                    out.append(ws_config(dtype, d, block_q, block_kv, stages, **knobs, tma_store=True))
        return out
    for block_q, warps, block_kv in itertools.product((64, 128, 256), (4, 8), (32, 64, 128)):
        for q_frags, k_frags, v_frags, buffered in itertools.product(
            (0, 1, 2, 4), (1, 2, 4), (1, 2), (False, True)
        ):
            for reverse in (False,):
                if (q_frags and dk % q_frags) or dk % k_frags:
                    continue
                cfg = KernelConfig.unchecked(
                    dtype,
                    d,
                    block_q,
                    block_kv,
                    warps,
                    q_frags=q_frags,
                    k_frags=k_frags,
                    v_frags=v_frags,
                    double_buffer=buffered,
                    reverse_kv=reverse,
                )
                if not validity_errors(cfg):
                    out.append(KernelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}))
    return out


def _rule_rows_per_warp(cfg: KernelConfig) -> str | None:
    # One or two 16-row mma tiles per warp. Three or more need 48+ rows of O and S accumulators per warp,
    # over the 255-register limit at every head_dim we ship.
    if cfg.rows_per_warp not in (16, 32):
        return "rows per warp must be 16 or 32"
    return None


def _register_budget(cfg: KernelConfig) -> int:
    # A warp-specialized consumer thread gets what setmaxnreg grants it (or the block's even split).
    if cfg.warp_specialized:
        return register_split(cfg)[1] or block_registers(cfg)
    return 255


def _rule_registers(cfg: KernelConfig) -> str | None:
    # The accumulators, Q (if resident) and the K/V fragment buffers must fit in 255 registers; a config
    # that does not would spill in its inner loop. (The compiler's report is checked again after the build.)
    if estimated_registers(cfg) > _register_budget(cfg):
        return "estimated registers above 255"
    return None


def _rule_occupancy(cfg: KernelConfig) -> str | None:
    # A block must leave room for a second block on the SM: with a single resident block, its softmax
    # phase leaves the tensor cores idle (measured: 128x128x8 at head_dim 64 ran 20% slower than 128x64x4).
    # A wgmma block of two warpgroups is the exception: its second warpgroup is that other party. Checked
    # here against the shared memory of Hopper (227 KB) and the estimated registers; after the build, again
    # against the compiler's actual register count (prepare_candidates).
    return occupancy_problem(cfg, estimated_registers(cfg))


def occupancy_problem(cfg: KernelConfig, registers: int) -> str | None:
    blocks = blocks_per_sm(cfg, registers)
    if cfg.wgmma:
        return None if blocks * cfg.num_warps >= 8 else "fewer than 2 warpgroups per SM"
    return None if blocks >= 2 else "fewer than 2 blocks per SM"


def blocks_per_sm(cfg: KernelConfig, registers: int) -> int:
    if cfg.warp_specialized:
        # Compiled for one block per SM whatever its consumers hold (setmaxnreg redistributes that budget).
        registers = block_registers(cfg)
    return occupancy("sm_90", cfg.threads, registers, cfg.smem_bytes).blocks


def _rule_fragment_order(cfg: KernelConfig) -> str | None:
    # Q and K slices are consumed together in the k-step loop: loading Q in groups other than K's (when Q
    # is not resident) only reorders the same loads, so one grouping per K grouping is tried.
    if cfg.q_frags not in (0, cfg.k_frags):
        return "q_frags must be 0 (resident) or equal to k_frags"
    return None


def _rule_resident_q(cfg: KernelConfig) -> str | None:
    # Q resident in registers costs rows x head_dim / 64 registers for the whole kernel: worth it only when
    # that is small next to the accumulators (head_dim 64 with 16 rows per warp: 16 registers).
    if not cfg.wgmma and cfg.q_frags == 0 and cfg.rows_per_warp * cfg.head_dim // 64 > 32:
        return "resident Q would take more than 32 registers"
    return None


PRUNING_RULES: tuple[Callable[[KernelConfig], str | None], ...] = (
    _rule_rows_per_warp,
    _rule_fragment_order,
    _rule_resident_q,
    _rule_registers,
    _rule_occupancy,
)


def prune(cands: Iterable[KernelConfig]) -> tuple[list[KernelConfig], dict[str, int]]:
    """The candidates no rule rejects, and how many each rule rejected (first matching rule)."""
    kept: list[KernelConfig] = []
    rejected: dict[str, int] = {}
    for cfg in cands:
        for rule in PRUNING_RULES:
            why = rule(cfg)
            if why:
                rejected[why] = rejected.get(why, 0) + 1
                break
        else:
            kept.append(cfg)
    return kept, rejected


def search_space(dtype: str, head_dim: int, causal: bool, arch: str = "sm_80") -> list[KernelConfig]:
    """The surviving candidates, with the heuristic's choices (at every length bucket) always among them."""
    kept, _ = prune(candidate_space(dtype, head_dim, causal, arch))
    for n in SEQLEN_BUCKETS:
        heuristic = default_config(dtype, head_dim, causal, n, n, arch)
        if heuristic not in kept:
            kept.append(heuristic)
    return kept


def bwd_candidate_space(dtype: str, head_dim: int, arch: str = "sm_80") -> list[BwdConfig]:
    """Every valid backward config of the varied knobs, plus the defaults.

    Varied: the query step (64 or 128 rows), the key block (64 or 128), 4 or 8 warps, the column split and
    the Q/dO double buffer. Key blocks below 64 are left out: each block re-reads every query block, so
    halving it doubles the Q/dO traffic for no gain in parallelism at the benchmark shapes (thousands of
    blocks already). On sm_90 the two Hopper kernels' configs join (their shapes are fixed by the kernels).
    """
    d = padded_head_dim(head_dim)
    out: list[BwdConfig] = []
    for bq, bkv, warps, split, buf in itertools.product(
        (64, 128), (64, 128), (4, 8), (1, 2, 3, 4), (False, True)
    ):
        try:
            out.append(BwdConfig(dtype, d, bq, bkv, warps, split, buf))
        except ValueError:
            continue
    extra = [default_bwd_config(dtype, d), default_bwd_config(dtype, d, arch)]
    if is_hopper(arch) and d in (64, 128, 192, 256):
        # The warp-specialized kernels in their producer's forms (cp.async rows, TMA loads, and at 64 and 128
        # TMA with dQ's writer warps; at 128 also with a quarter or half of P's exponentials on the FMA pipe,
        # exp_poly, which measured 0.97x at 4k non-causal and level elsewhere, where at 64 it spills and
        # measured 1.02-1.18x the time: kernel log 138), and the kernel each replaced (the sm90 kernel at 64
        # and 128, the wide kernel at 192 and 256).
        extra += [hopper_bwd_config(dtype, d, tma_loads=tma, dq_writer=False) for tma in (False, True)]
        if d == 192:  # and the warp-specialized wide kernel on both its key blocks (kernel log 140)
            extra += [
                hopper_bwd_config(dtype, d, tma_loads=tma).replace(block_kv=n)
                for tma in (False, True)
                for n in (64, 96)
            ]
        if d <= 128:
            writer = hopper_bwd_config(dtype, d, tma_loads=True, dq_writer=True)
            extra += [writer] + [writer.replace(exp_poly=e) for e in ((2, 4) if d == 128 else ())]
        extra.append(hopper_bwd_config(dtype, d, warp_specialized=False))
    for cfg in extra:
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out
