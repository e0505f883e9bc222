"""The backward launch: gradients (dq, dk, dv) of the forward's output from that output and its LSE.

Three launches on PyTorch's current stream: the preprocessing kernel (delta = rowsum(dO * O), the LSE in
base 2, and zeroing the fp32 dQ workspace), the dK/dV kernel (dQ added atomically into that workspace, or in
``deterministic`` mode without atomics), then either the cast of the workspace into q's layout and dtype or
the deterministic dQ kernel. As for the forward, everything a signature decides is worked out once and kept
in a plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..configs import BwdConfig, parse_bwd_config
from ..dropout import dropout_key, seed_pair
from ..jit import cache as jit_cache
from ..jit import driver
from ..jit.loader import get_bwd_kernels
from ..jit.params import BwdParams, BwdTmaParams
from ..jit.sources import SEGMENTS
from ..sinks import sinks_gradient_from_delta
from ..spec import AttentionSpec
from ..spec.validate import check_window
from . import tma
from .device import current_stream, device_arch, dtype_name
from .plans import (
    Launch,
    PlanCache,
    bind_alibi,
    bind_score_values,
    check_segments,
    check_value_dim,
    device_facts,
    feature_list,
    fill_common,
    fill_strides,
    kernel_build,
    launch_all,
    launch_spec,
    mask_bounds,
    programmatic_launches,
    segment_count,
    segment_lengths,
    trial_switch,
)
from .query_tiles import key_tiles, query_units, tile_count, unit_count, workspace_rows
from .select import backward_config, value_dim_backward_config
from .tensors import check_grid, kernel_ready, pad_head_dim, padded_to_8

__all__ = ["cuda_backward", "derive_from_plans", "plan_for"]


@dataclass(frozen=True)
class _Plan:
    cfg: BwdConfig
    pre: driver.Kernel
    convert: driver.Kernel
    dkdv: driver.Kernel
    dq: driver.Kernel | None  # the deterministic dQ kernel
    pre_grid: tuple[int, int, int]
    convert_grid: tuple[int, int, int]
    dkdv_grid: tuple[int, int, int]
    dq_grid: tuple[int, int, int]
    seqlen_q_pad: int
    index: int
    template: bytes  # BwdParams (BwdTmaParams with tma_loads) with every field but the pointers, key and maps
    stats: int  # floats in each of the workspace's base-2 LSE and delta arrays (batch * heads_q * rows)
    accum: int  # floats of the dQ accumulator (and semaphores) after them (0 with the sm80 dQ kernel)
    dkdv_kind: str  # the dK/dV entry point: "dkdv" or "dkdv_det"
    # The compiled training node's copy of this plan (ops.training), made at its first use.
    host_program: list = field(default_factory=list, compare=False)
    # A packed batch on the warp-specialized dK/dV kernel: the tile width of its key-tile table
    # (ops.query_tiles.key_tiles) and so a workspace laid out by sequence (query_units), both bound at each
    # launch; 0: none (tiles of the packed row, workspace rows = packed rows).
    k_tiles: int = 0
    # The dK/dV launch and the one after it queued programmatically (plans.programmatic_launches): each
    # waits for the kernel before it at its start (jit.sources' backward entry points), so its launch
    # latency overlaps the previous kernel's last blocks.
    programmatic: bool = False
    # tma_loads: the layouts of q's and dO's tensor maps (boxes of block_q rows); each call encodes them on
    # its own addresses into BwdTmaParams (bind_maps). None: no maps.
    maps: tuple[tma.MapLayout, tma.MapLayout] | None = None

    @property
    def launches(self) -> tuple[Launch, ...]:
        """The launches in queue order: preprocessing, dK/dV, then dQ's cast or kernel."""
        cfg = self.cfg
        after = self.programmatic
        last = (
            Launch(self.dq, self.dq_grid, cfg.dq_threads, cfg.dq_smem_bytes, after)
            if self.dq is not None
            else Launch(self.convert, self.convert_grid, 128, 0, after)  # the workspace holds scale * dS K
        )
        return (
            Launch(self.pre, self.pre_grid, 128, 0),
            Launch(self.dkdv, self.dkdv_grid, cfg.kernel_threads(self.dkdv_kind), cfg.smem_bytes, after),
            last,
        )


_plans: PlanCache[_Plan] = PlanCache()


def derive_from_plans(cache: PlanCache) -> None:
    """Clear ``cache`` whenever these plans are cleared (it holds things made from them)."""
    _plans.derive(cache)


def clear_plans() -> None:
    """Forget every plan (after something a plan was derived from changed: a tuned-winners table, or a
    test's stand-in for a device fact)."""
    _plans.clear()


def _kernels_of(q, k, spec: AttentionSpec, config, lengths, head_dim=None):
    """``(config, arch, build)`` (plans.KernelBuild) of the backward kernels a call of ``spec`` on
    kernel-ready q and k runs (of ``head_dim``, when given, instead of q's): what :func:`_make_plan` loads
    and :func:`prefetch` compiles ahead."""
    index = q.get_device()
    build = kernel_build(spec, q.shape[1], k.shape[1])
    cfg = backward_config(
        dtype_name(q),
        head_dim or q.shape[3],
        spec.causal,
        *(lengths or (q.shape[1], k.shape[1])),  # (a packed batch's: plans.segment_lengths)
        q.shape[2] // k.shape[2],
        **device_facts(index),
        features=feature_list(
            key_range=spec.ranged,
            dropout=spec.dropout_p,
            deterministic=spec.deterministic,
            window=build.window is True,
            **spec.score.features,
            segments=build.window == SEGMENTS,
        ),
        config=config,
    )
    return cfg, device_arch(index), build


def prefetch(q, k, spec: AttentionSpec, lengths=None, head_dim=None, value_dim=None) -> None:
    """Start compiling the backward kernels of a training call of ``spec`` whose forward is about to run (its
    own compile, if any, then runs beside this one: a first training step waits for the longer of the two
    compiles, not their sum); ``value_dim``: v's head_dim where it is its own (the kernel reading it, where
    :func:`value_dim_config` has one). Best effort: any failure is left to the backward's own build, which
    reports it."""
    try:
        config = None
        if value_dim is not None and value_dim != q.shape[3]:
            config = value_dim_config(q, value_dim, spec.causal, spec.dropout_p, spec.deterministic)
        cfg, arch, build = _kernels_of(q, k, spec, config, lengths, head_dim)
    except Exception:  # noqa: BLE001 - as the docstring says
        return
    jit_cache.prefetch(cfg, arch, **build.variant)


def value_dim_config(q, value_dim: int, causal: bool, dropout_p: float, deterministic: bool):
    """The default config of a call whose v is narrower than q where a kernel reads v's head_dim as it is
    (HOPPER_BWD_READS_VALUE_DIM), else None (the padded path). The eager paths (ops.training's node and
    ops.repeat's calls) plan with it too, so every path of such a call runs the same kernel
    (select.value_dim_backward_config on q's GPU)."""
    return value_dim_backward_config(
        dtype_name(q), q.shape[3], value_dim, causal, device_arch(q.get_device()), bool(dropout_p),
        deterministic,
    )  # fmt: skip


def _reads_value_dim(config, head_dim: int, value_dim: int) -> bool:
    """Whether ``config`` (a BwdConfig or its name) is a kernel that reads v at ``value_dim`` while q and k
    have ``head_dim`` (BwdConfig.head_dim_v: the warp-specialized wide kernel at 192, the default of such
    calls where HOPPER_BWD_READS_VALUE_DIM says), so the call needs no padded copies."""
    if config is None:
        return False
    cfg = parse_bwd_config(config)
    return cfg.head_dim == head_dim and cfg.head_dim_v == value_dim


def _make_plan(q, k, v, o, do, lse, spec: AttentionSpec, config, lengths=None, sequences=None) -> _Plan:
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    check_grid(batch, heads_q, seqlen_q, seqlen_k)
    index = q.get_device()
    causal, deterministic, dropout_p = spec.causal, spec.deterministic, spec.dropout_p
    window, score = mask_bounds(spec, seqlen_q, seqlen_k), spec.score
    cfg, arch, build = _kernels_of(q, k, spec, config, lengths)
    if cfg.tma_loads and tma.untileable(q, do):
        # A layout no tensor map describes (a broadcast output gradient, a stride not a multiple of 16
        # bytes): the same kernel with the cp.async producer, which reads any row stride (and without dQ's
        # writer warps, which need the one-thread TMA producer).
        cfg = dataclasses.replace(cfg, tma_loads=False, dq_writer=False)
    windowed = window is not None
    kerns = get_bwd_kernels(cfg, arch, **build.variant)
    dkdv_kind = "dkdv_det" if deterministic else "dkdv"
    dkdv = kerns[cfg.symbol(dkdv_kind, *build)]
    dkdv.ensure_dynamic_smem(cfg.smem_bytes, index)
    dq = None
    # Deterministic on the sm80 family: dK/dV without atomics, then the dQ kernel. The deterministic forms
    # of the warp-specialized and wide kernels add dQ into the workspace themselves, in a fixed order
    # (turns taken on semaphores after the accumulator), and the cast follows as in the atomic mode.
    det_ws = deterministic and (cfg.warp_specialized or cfg.wide)
    if deterministic and not det_ws:
        dq = kerns[cfg.symbol("dq", *build)]
        dq.ensure_dynamic_smem(cfg.dq_smem_bytes, index)

    p = BwdParams()
    # dq, dk and dv are new contiguous tensors of q's, k's and v's shapes.
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        fill_strides(p, prefix, t)
    for prefix, shape in (("dq", q.shape), ("dk", k.shape), ("dv", v.shape)):
        setattr(p, f"{prefix}_batch_stride", shape[1] * shape[2] * shape[3])
        setattr(p, f"{prefix}_row_stride", shape[2] * shape[3])
        setattr(p, f"{prefix}_head_stride", shape[3])
    p.lse_batch_stride, p.lse_head_stride = lse.stride(0), lse.stride(1)
    fill_common(p, q, k, cfg.block_q, spec.scale, dropout_p)
    p.head_dim_v = v.shape[3]
    p.seqlen_q_pad = -(-seqlen_q // 128) * 128
    # The deterministic Hopper kernels' accumulator lanes (fa/dq_turns.cuh): a causal walk never wraps.
    # (A window's walks, row-dependent, never wrap either.)
    lanes = (1 if causal or windowed else 2) if det_ws else 0
    p.dq_lanes = lanes
    if windowed and window != SEGMENTS:
        p.window_left, p.window_right = window
    bind_score_values(p, score)  # (ALiBi's slopes are a per-call pointer: cuda_backward)
    p.num_n_blocks = math.ceil(seqlen_k / cfg.block_kv)
    # A packed batch on the warp-specialized dK/dV kernel (atomic mode): one block per key tile of its table,
    # each walking its sequence's query blocks from the sequence's first row, over a workspace laid out by
    # sequence (ops.query_tiles: key_tiles, query_units; both bound at each launch). The preprocessing and
    # cast kernels then run over the workspace's units. (The deterministic form's dQ turns assume the
    # packed row's blocks; the other families tile the packed row.)
    k_tiles = 0
    convert_blocks = math.ceil(seqlen_q / 64)
    if (
        build.window == SEGMENTS
        and cfg.warp_specialized
        and not cfg.wide_ws
        and not deterministic
        and sequences is not None
    ):
        k_tiles = cfg.block_kv
        p.num_n_blocks = tile_count(seqlen_k, sequences, k_tiles)
        p.seqlen_q_pad = unit_count(seqlen_q, sequences) * 64
        convert_blocks = p.seqlen_q_pad // 64
    # Causal: the dK/dV blocks start heaviest first within groups of (K/V head, batch row) pairs, so that the
    # grid does not end waiting for one late heavy block (fa/kv_block_order.cuh). The warp-specialized
    # kernel's atomic mode; the deterministic one keeps the order its dQ turns need, the wide one (d192/256)
    # spilled with it, and the sm80 ones have their own grid.
    # (Off: measured 8-12% slower at 1k causal, kernel log 123; FLASH_ATTENTION_CAUSAL_ORDER=1 for a profile.)
    if (
        build.causal
        and not deterministic
        and cfg.warp_specialized
        and not cfg.wide_ws
        and trial_switch("CAUSAL_ORDER")
    ):
        p.kv_block_group = kv_block_group(batch * heads_kv, seqlen_q, cfg.head_dim, heads_q // heads_kv)
    # The fp32 workspace: the base-2 LSE and delta rows (written by the preprocessing kernel), then the dQ
    # accumulator of the atomic mode (padded to whole 128-row blocks and the compiled head_dim, so the
    # atomics need no bounds checks; zeroed by the preprocessing kernel), and for the deterministic
    # Hopper kernels one such accumulator per lane and four int semaphores per 64 query rows
    # (fa/dq_accum.cuh, dq_semaphore).
    stats = batch * heads_q * p.seqlen_q_pad
    accum = 0
    if not deterministic or det_ws:
        accum = stats * cfg.head_dim * max(1, lanes) + stats // 64 * 4 * det_ws
    template, maps = bytes(p), None
    if cfg.tma_loads:
        args = BwdTmaParams(p=p)
        with driver.primary_current(index):  # (an encode needs a current context)
            maps = _map_layouts(q, do, cfg, args)
        template = bytes(args)
    return _Plan(
        cfg,
        kerns["pre"],
        kerns["convert"],
        dkdv,
        dq,
        (p.seqlen_q_pad // 64, heads_q, batch),
        (convert_blocks, heads_q, batch),
        (p.num_n_blocks * cfg.split, heads_kv, batch),
        (p.num_m_blocks * cfg.split, heads_q, batch),
        p.seqlen_q_pad,
        index,
        template,
        stats,
        accum,
        dkdv_kind,
        k_tiles=k_tiles,
        programmatic=programmatic_launches(arch),
        maps=maps,
    )


def _map_layouts(q, do, cfg: BwdConfig, into: BwdTmaParams) -> tuple[tma.MapLayout, tma.MapLayout]:
    """The tensor map layouts of q and dO (boxes of block_q rows), encoded once on these tensors' own
    addresses into ``into``'s maps, so a layout the TMA unit refuses is known before anything launches."""
    return (
        tma.encode_operand(cfg.name(), "loads q", q, cfg.block_q, into.q_map),
        tma.encode_operand(cfg.name(), "loads the output gradient", do, cfg.block_q, into.do_map),
    )


def plan_params(plan: _Plan) -> tuple[BwdParams | BwdTmaParams, BwdParams]:
    """A fresh copy of the plan's template: (what the kernels take, its BwdParams) -- BwdTmaParams and the
    BwdParams view at its start for a plan with tma_loads (the maps follow in the same bytes), else the
    same BwdParams twice."""
    if plan.maps is None:
        p = BwdParams.from_buffer_copy(plan.template)
        return p, p
    args = BwdTmaParams.from_buffer_copy(plan.template)
    return args, args.p


def bind_maps(plan: _Plan, args: BwdTmaParams, q_ptr: int, do_ptr: int) -> None:
    """Encode the plan's q and dO maps on these addresses into ``args`` (a plan with tma_loads)."""
    with driver.primary_current(plan.index):
        for map_field, layout, ptr in zip((args.q_map, args.do_map), plan.maps, (q_ptr, do_ptr), strict=True):
            status = tma.encode_into(map_field, layout, ptr)
            if status != 0:  # the plan encoded this layout once; only an address could differ (kernel_ready
                driver.check(status, "cuTensorMapEncodeTiled")  # keeps those 16-byte aligned)


#: The queries and output gradients (16-bit) that the running dK/dV blocks of one start group read, kept
#: well inside the L2 (50 MB on an H100, 60 on an H200) beside K/V, the statistics and dQ's reductions.
KV_BLOCK_GROUP_L2_BYTES = 24 << 20


def kv_block_group(pairs: int, seqlen_q: int, head_dim: int, group: int) -> int:
    """How many (K/V head, batch row) pairs of a causal dK/dV grid start their blocks together, heaviest
    first (BwdParams.kv_block_group, fa/kv_block_order.cuh): as many as keep their query heads' Q and dO in
    KV_BLOCK_GROUP_L2_BYTES, at least one, at most all ``pairs``."""
    per_pair = 4 * seqlen_q * head_dim * group  # Q and dO of the pair's `group` query heads, 2 bytes each
    return max(1, min(pairs, KV_BLOCK_GROUP_L2_BYTES // per_pair))


def plan_for(
    q_, k_, v_, o_, do_, lse_, spec: AttentionSpec, config=None, lengths=None, sequences=None
) -> _Plan:
    """The plan of a call of ``spec`` on kernel-ready tensors (made on a miss); ``config``: a named
    configuration, or None; ``lengths``: plans.segment_lengths; ``sequences``: a packed batch's sequence
    count when its runs carry the offsets of a key-tile table (plans.segment_count)."""
    if not _reads_value_dim(config, q_.shape[-1], v_.shape[-1]):
        check_value_dim(q_, v_)
    key = (
        q_.shape,
        q_.stride(),
        k_.shape,
        k_.stride(),
        v_.shape[-1],
        v_.stride(),
        o_.stride(),
        do_.stride(),
        lse_.stride(),
        q_.dtype,
        q_.device,
        spec,
        config,
        lengths,
        sequences,
    )
    return _plans.get(key, lambda: _make_plan(q_, k_, v_, o_, do_, lse_, spec, config, lengths, sequences))


def cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,
    key_range: torch.Tensor | None = None,
    config: BwdConfig | str | None = None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, ...] | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv) of :func:`flash_attention.ops.cuda_forward`'s output ``out`` with LSE ``lse``,
    for the output gradient ``dout``: new contiguous tensors of q's, k's and v's shapes and dtype. With the
    forward's ``sinks`` (``out`` and ``lse`` then the forward's, sinks included), also the sinks' gradient
    (a fourth tensor, from the preprocessing kernel's D rows: flash_attention.sinks). ``segments``: the
    forward's (ops.cuda_forward).

    ``config`` names a backward configuration (else the tuned winner or the heuristic:
    :func:`flash_attention.ops.select.backward_config`); ``key_range``, ``dropout_p`` / ``dropout_seed``,
    ``window``, ``alibi_slopes`` and the ``score_values`` (by name) must be the forward's. A head_dim
    that is not a multiple of 8 runs zero-padded, as the forward does, and so does a v narrower than q
    (padded to q's head_dim with the output and dO; dv comes back at v's), unless the config reads v's
    head_dim itself (BwdConfig.head_dim_v; HOPPER_BWD_READS_VALUE_DIM makes such a config the default).
    """
    if dropout_p and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (flash_attention.dropout.draw_seed())")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    value_dim = v.shape[3]
    if value_dim > head_dim:
        check_value_dim(q, v)  # (raises: no kernel family holds a v wider than q)
    window = check_window(window)
    if segments is not None:
        check_segments(segments, q, k, key_range, window)
    spec = launch_spec(
        q, causal, softmax_scale, window, alibi_slopes, key_range, dropout_p, deterministic, sinks, segments,
        **score_values,
    )  # fmt: skip
    if config is None and value_dim != head_dim:
        config = value_dim_config(q, value_dim, causal, dropout_p, deterministic)
    if head_dim % 8 or (value_dim != head_dim and not _reads_value_dim(config, head_dim, value_dim)):
        # The kernels read one head_dim, a multiple of 8, for q, k and v: the call runs on copies zero-padded
        # to it, as the forward does, and the gradients are sliced back. That covers v's own head_dim too
        # where no config reading it runs the call (value_dim_config: every pair but 192 / 128 and 192 / 64
        # without dropout or the deterministic mode on sm_90): v, the output and dO padded to q's width are
        # exact, since the zero columns add nothing to dP = dO V^T nor to delta = rowsum(dO o O), and dV's
        # extra columns, P^T dO's zero columns, are dropped. Its cost: the V-side products and loads at q's
        # width (two of the five products) and the copies.
        d8 = padded_to_8(head_dim)
        grads = cuda_backward(
            *(t if t.shape[-1] == d8 else pad_head_dim(t, d8) for t in (dout, q, k, v, out)),
            lse,
            causal=causal,
            softmax_scale=softmax_scale,
            deterministic=deterministic,
            key_range=key_range,
            config=config,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            window=window,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            segments=segments,
            **score_values,
        )
        dq, dk, dv = (
            g if g.shape[-1] == n else g[..., :n].contiguous()
            for g, n in zip(grads[:3], (head_dim, head_dim, value_dim), strict=True)
        )
        return (dq, dk, dv, *grads[3:])

    device = q.device
    # Contiguous whatever the inputs' strides (the plan's dq/dk/dv strides assume it); empty_like costs
    # about half the host time of torch.empty(shape, dtype=, device=).
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if seqlen_q == 0 or seqlen_k == 0 or heads_q == 0 or batch == 0:
        grads = (dq.zero_(), dk.zero_(), dv.zero_())
        return grads if sinks is None else (*grads, torch.zeros_like(sinks))

    q_, k_, v_, o_, do_ = (kernel_ready(t) for t in (q, k, v, out, dout))
    lse_ = lse if lse.stride(-1) == 1 else lse.contiguous()
    lengths, sequences = segment_lengths(segments), segment_count(segments)
    plan = plan_for(q_, k_, v_, o_, do_, lse_, spec, config, lengths, sequences)
    stats, accum = plan.stats, plan.accum
    ws = torch.empty(2 * stats + accum, dtype=torch.float32, device=device)

    args, p = plan_params(plan)
    p.q, p.k, p.v, p.o, p.dout = (t.data_ptr() for t in (q_, k_, v_, o_, do_))
    if plan.maps is not None:
        bind_maps(plan, args, p.q, p.dout)
    p.lse = lse_.data_ptr()
    p.lse_log2 = ws.data_ptr()
    p.delta = ws.data_ptr() + 4 * stats
    p.dq_accum = ws.data_ptr() + 8 * stats if accum else None
    p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if key_range is not None:
        key_range = key_range.to(device=device, dtype=torch.int32).contiguous()
        p.key_range = key_range.data_ptr()
    if dropout_p:
        p.dropout_key = dropout_key(*seed_pair(dropout_seed))
    if alibi_slopes is not None:
        bind_alibi(p, alibi_slopes)
    if segments is not None:
        p.row_keys, p.key_rows = segments[0].data_ptr(), segments[1].data_ptr()
        if len(segments) == 3:  # (each row's ALiBi diagonal: the "..._table" builds)
            p.alibi_diagonal = segments[2].data_ptr()
        if plan.k_tiles:  # (held by the runs, which outlive the launches' queuing)
            p.k_tiles = key_tiles(segments, plan.k_tiles).data_ptr()
            p.q_units = query_units(segments).data_ptr()

    launch_all(plan.launches, plan.index, args, current_stream(plan.index))
    if sinks is not None:
        delta = ws[stats : 2 * stats].view(batch, heads_q, p.seqlen_q_pad)
        # (laid out by sequence: read back by packed row)
        delta = delta[:, :, workspace_rows(segments)] if plan.k_tiles else delta[:, :, :seqlen_q]
        return dq, dk, dv, sinks_gradient_from_delta(delta, lse, sinks)
    return dq, dk, dv
