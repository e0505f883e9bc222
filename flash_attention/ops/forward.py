"""The forward launch: tensors -> :class:`~flash_attention.jit.params.FwdParams` -> one kernel launch.

Everything a call's shape, strides and options decide (the configuration, the loaded kernel, the grid, the
shared memory, every size and stride field of the params struct) is worked out once per signature and kept
in a plan (:mod:`.plans`); a call then only fills in its pointers (and its dropout key) and launches.

Inputs were validated by :func:`flash_attention.spec.validate.validate`; this layer re-checks every assumption
the compiled kernel makes (dtype, head_dim within the compiled size, 16-byte aligned rows, grid limits,
shared memory that fits this GPU).
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..configs import KernelConfig, parse_config
from ..dropout import dropout_key, seed_pair
from ..jit import driver
from ..jit.loader import get_kernel
from ..jit.params import FwdParams, FwdTmaParams
from ..jit.sources import SEGMENTS
from ..spec import NO_SCORE, AttentionSpec
from ..spec.validate import check_window
from . import tma
from . import trace as _trace
from .device import device_arch, dtype_name, sm_count
from .plans import (
    PlanCache,
    bind_alibi,
    bind_score_values,
    check_segments,
    device_facts,
    feature_list,
    fill_common,
    fill_strides,
    kernel_build,
    launch,
    launch_spec,
    mask_bounds,
    segment_count,
    segment_lengths,
    window_bounds,
)
from .query_tiles import query_tiles, tile_count
from .select import forward_config
from .tensors import check_grid, kernel_ready, pad_head_dim, padded_to_8, usable_in_place

__all__ = ["chosen_config", "cuda_forward", "derive_from_plans", "launch_plan", "plan_for", "prepare"]


@dataclass(frozen=True)
class _Plan:
    cfg: KernelConfig
    kernel: driver.Kernel
    grid: tuple[int, int, int]
    threads: int
    smem: int
    index: int
    template: bytes  # FwdParams (FwdTmaParams for a TMA kernel) with all but the pointers and dropout key
    # q, k, v (and o, for a config with tma_store): TMA kernels only
    maps: tuple[tma.MapLayout, ...] | None = None
    # TMA kernels: the template with q's, k's and v's maps encoded, by their addresses. A training loop
    # or a decoder hands the same few addresses back (PyTorch's caching allocator), and three encodes
    # cost more host time than the rest of the launch.
    encoded: OrderedDict = field(default_factory=OrderedDict)
    # tma_store: o's map, by o's address (kept apart from the triples: a fresh output each call would
    # otherwise cost all four encodes whenever the allocator hands out another address).
    encoded_o: OrderedDict = field(default_factory=OrderedDict)
    # A persistent grid with fewer blocks than tiles: its blocks take tiles from the stream's counter.
    tile_counter: bool = False
    # The call's options the kernel was built for (the launch's observers read them: tests, tools).
    causal: bool = False
    dropout_p: float = 0.0
    # A packed batch on the warp-specialized forward: the tile height of its query-tile table
    # (ops.query_tiles, bound at each launch); 0: none (tiles of the packed row).
    q_tiles: int = 0


#: Encoded map triples kept per plan (the oldest dropped).
_ENCODED_PER_PLAN = 16


_plans: PlanCache[_Plan] = PlanCache()


def derive_from_plans(cache: PlanCache) -> None:
    """Clear ``cache`` whenever these plans are cleared (it holds things made from them)."""
    _plans.derive(cache)


def clear_plans() -> None:
    """Forget every plan (after something a plan was derived from changed: a tuned-winners table, or a
    test's stand-in for a device fact)."""
    _plans.clear()


def _config(q, k, causal, needs, config=None, lengths=None, v=None, window=None) -> KernelConfig:
    """The forward config of a call on q's GPU (named, tuned or the heuristic's: select.forward_config);
    ``lengths``: the (seqlen_q, seqlen_k) to choose by instead of q's and k's (a packed batch's sequences);
    ``v``: the call's values, whose head_dim may differ from q's; ``window``: a sliding window's bounds."""
    seqlen_q, seqlen_k = lengths or (q.shape[1], k.shape[1])
    return forward_config(
        dtype_name(q),
        padded_to_8(q.shape[3]),
        causal,
        seqlen_q,
        seqlen_k,
        q.shape[2] // k.shape[2],
        **device_facts(q.get_device()),
        features=needs,
        config=config,
        head_dim_v=0 if v is None else padded_to_8(v.shape[3]),
        window=window,
    )


def _params(q, k, v, o, cfg: KernelConfig, scale: float, dropout_p: float) -> FwdParams:
    """FwdParams with every field but the pointers, the dropout key and the trace fields."""
    p = FwdParams()
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        fill_strides(p, prefix, t)
    # The LSE is a new contiguous (batch, heads_q, seqlen_q) tensor whenever one is asked for.
    p.lse_batch_stride, p.lse_head_stride = q.shape[2] * q.shape[1], q.shape[1]
    fill_common(p, q, k, cfg.block_q, scale, dropout_p)
    # O's column bound in the store helpers every forward family shares (fa/epilogue.cuh): v's head_dim,
    # at most the kernel's kHeadDimV (the tail is masked, as head_dim's is for Q and K).
    p.head_dim_v = v.shape[3]
    return p


def _make_plan(
    q, k, v, o, spec: AttentionSpec, config, needs, trace=False, lengths=None, sequences=None
) -> _Plan:
    """The plan of a call of ``spec`` (``trace``: with the debug build's kernel, fa/trace.cuh; ``lengths``:
    _config's; ``sequences``: a packed batch's sequence count, when its runs carry a query-tile table). The
    kernel is the build of the spec's mask (plans.mask_bounds: a window's bounds carry causal) and score
    function; the params carry the window's bounds and the cap."""
    batch, seqlen_q, heads_q = q.shape[:3]
    check_grid(batch, heads_q, seqlen_q, k.shape[1])
    index = q.get_device()
    causal, score, dropout_p = spec.causal, spec.score, spec.dropout_p
    window = mask_bounds(spec, seqlen_q, k.shape[1])
    cfg = _config(q, k, causal, needs, config, lengths, v, None if window == SEGMENTS else window)
    windowed = window is not None
    build = kernel_build(spec, seqlen_q, k.shape[1])
    kernel = get_kernel(cfg, build.causal, device_arch(index), trace, **build.variant)
    kernel.ensure_dynamic_smem(cfg.smem_bytes, index)
    p = _params(q, k, v, o, cfg, spec.scale, dropout_p)
    if windowed and window != SEGMENTS:
        p.window_left, p.window_right = window
    bind_score_values(p, score)  # (ALiBi's slopes are a per-call pointer: launch_plan)
    # A packed batch on the warp-specialized forward: one tile per table entry (the table itself is bound at
    # each launch). The other families tile the packed row.
    packed_tiles = build.window == SEGMENTS and cfg.warp_specialized and sequences is not None
    q_tiles = cfg.block_q if packed_tiles else 0
    if q_tiles:
        p.num_m_blocks = tile_count(seqlen_q, sequences, q_tiles)
    grid = (p.num_m_blocks, heads_q, batch)
    if cfg.persistent:
        # One block per multiprocessor (the kernel runs one per SM), each looping over query tiles.
        grid = (min(p.num_m_blocks * heads_q * batch, sm_count(index)), 1, 1)
    options = {"causal": causal, "dropout_p": dropout_p}
    if not cfg.warp_specialized:
        return _Plan(cfg, kernel, grid, cfg.threads, cfg.smem_bytes, index, bytes(p), **options)
    tp = FwdTmaParams()
    tp.p = p
    with driver.primary_current(index):  # (an encode needs a current context, as a launch does)
        maps = _map_layouts(q, k, v, o, cfg, tp)
    counted = cfg.persistent and grid[0] < p.num_m_blocks * heads_q * batch
    plan = _Plan(
        cfg,
        kernel,
        grid,
        cfg.threads,
        cfg.smem_bytes,
        index,
        bytes(tp),
        maps,
        tile_counter=counted,
        q_tiles=q_tiles,
        **options,
    )
    # The trial encode was of these tensors' own addresses: the call that made the plan reuses it.
    plan.encoded[(q.data_ptr(), k.data_ptr(), v.data_ptr())] = plan.template
    if cfg.tma_store:
        plan.encoded_o[o.data_ptr()] = bytes(tp.o_map)
    return plan


def _encode_checked(map_field, layout: tma.MapLayout, ptr: int) -> None:
    status = tma.encode_into(map_field, layout, ptr)
    if status != 0:  # the plan encoded this layout once; only an address could differ, and kernel_ready
        driver.check(status, "cuTensorMapEncodeTiled")  # and usable_in_place keep those 16-byte aligned


def _remember(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > _ENCODED_PER_PLAN:  # oldest first (no reordering on a hit: safe for threads)
        cache.popitem(last=False)


def _tma_args(plan: _Plan, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int) -> FwdTmaParams:
    """The plan's FwdTmaParams with the tensor maps of these addresses (encoded once per address triple,
    and o's, for a config with tma_store, once per address)."""
    key = (q_ptr, k_ptr, v_ptr)
    ready = plan.encoded.get(key)
    if ready is not None:
        args = FwdTmaParams.from_buffer_copy(ready)
    else:
        args = FwdTmaParams.from_buffer_copy(plan.template)
        with driver.primary_current(plan.index):  # (an encode needs a current context, as a launch does)
            fields = (args.q_map, args.k_map, args.v_map)
            for map_field, layout, ptr in zip(fields, plan.maps[:3], key, strict=True):
                _encode_checked(map_field, layout, ptr)
        _remember(plan.encoded, key, bytes(args))
    if len(plan.maps) == 4:
        o_map = plan.encoded_o.get(o_ptr)
        if o_map is None:
            with driver.primary_current(plan.index):
                _encode_checked(args.o_map, plan.maps[3], o_ptr)
            _remember(plan.encoded_o, o_ptr, bytes(args.o_map))
        else:
            ctypes.memmove(args.o_map, o_map, len(o_map))
    return args


#: The persistent grid's tile counters, one per (device, stream): two int32 that every launch leaves zero.
_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def stream_tile_counter(device: torch.device) -> torch.Tensor:
    """The tile counter of the current stream on ``device`` (zero-filled in stream order at first use).
    While a CUDA graph is being captured, a fresh one: its fill is captured with the launch and replays
    with it, and no graph's private memory ends up in the cache."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # (not CUDA: the host tests' stubs)
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def _call_args(plan: _Plan, q_, k_, v_, o, lse):
    """The plan's params with this call's tensors: ``(args, p, tile_counter)``, the struct to launch with,
    its FwdParams (``args`` itself, or ``args.p`` for a TMA kernel) for the caller's remaining fields, and
    the persistent grid's tile counter (or None), to be kept alive until the launch is queued."""
    tile_counter = None
    if plan.maps is None:
        args = p = FwdParams.from_buffer_copy(plan.template)
    else:
        args = _tma_args(plan, q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), o.data_ptr())
        p = args.p
        if plan.tile_counter:
            # The persistent grid's tile counter: the current stream's, which every launch leaves zeroed
            # for the next (the kernel says how). One per stream, since launches on two streams may run at
            # once; a fresh torch.zeros per call cost a fill kernel ahead of every launch.
            tile_counter = stream_tile_counter(q_.device)
            args.tile_counter = tile_counter.data_ptr()
    p.q, p.k, p.v, p.o = q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), o.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    return args, p, tile_counter


def _map_layouts(q, k, v, o, cfg: KernelConfig, into: FwdTmaParams) -> tuple[tma.MapLayout, ...]:
    """The tensor map layouts of q (boxes of block_q rows), k and v (block_kv rows) and, for a config with
    tma_store, o (boxes of one consumer warpgroup's 64 rows), encoded once on these tensors' own addresses
    into ``into``'s maps, so a layout the TMA unit refuses is known before anything launches."""
    operands = [
        ("loads q", q, cfg.block_q, into.q_map),
        ("loads k", k, cfg.block_kv, into.k_map),
        ("loads v", v, cfg.block_kv, into.v_map),
    ]
    if cfg.tma_store:
        operands.append(("stores the output", o, 64, into.o_map))
    return tuple(tma.encode_operand(cfg.name(), what, t, rows, field) for what, t, rows, field in operands)


def chosen_config(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    causal: bool,
    softmax_scale: float,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | tuple[int, int] = False,
    alibi: bool = False,
    **score_functions: bool,
) -> KernelConfig:
    """The configuration :func:`cuda_forward` runs for these inputs when none is named: what ``attention()``
    runs (the tools name it in their output). ``v`` defaults to ``k``'s layout; its strides count, as
    ``q``'s and ``k``'s, when a TMA kernel could not address them (feature ``untileable``). ``window``,
    ``alibi`` and ``score_functions`` (by name, spec.score_functions: ``name=True``): whether the call has
    them (a score function may have a config of its own at head_dim 128: select.score_function_config);
    ``window`` as attention()'s (left, right) also sizes the tiles (select.narrow_window_config)."""
    needs = feature_list(
        key_range=ranged,
        dropout=dropout,
        negative_scale=softmax_scale < 0,
        untileable=tma.untileable(q, k, k if v is None else v),
        window=bool(window),
        alibi=alibi,
        **score_functions,
    )
    bounds = window_bounds(window, causal, q.shape[1], k.shape[1]) if isinstance(window, tuple) else None
    return _config(q, k, causal, needs, v=v, window=bounds)


def plan_for(q, k, v, o, spec: AttentionSpec, config=None, lengths=None, sequences=None) -> _Plan:
    """The plan of a call of ``spec`` on kernel-ready tensors (made on a miss); ``config``: a named
    configuration, or None; ``lengths``: plans.segment_lengths; ``sequences``: a packed batch's sequence
    count when its runs carry the offsets of a query-tile table (plans.segment_count)."""
    spec = spec.forward
    key = (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        v.shape[3],  # (v's head_dim may be its own: feature value_dim)
        o.stride(),
        q.dtype,
        q.device,
        spec,
        config,
        lengths,
        sequences,
    )

    def make() -> _Plan:
        # The feature list is built only on a miss: a hit is the hot path of every call.
        bounds = mask_bounds(spec, q.shape[1], k.shape[1])
        needs = feature_list(
            key_range=spec.ranged,
            dropout=spec.dropout_p,
            negative_scale=spec.scale < 0,
            untileable=tma.untileable(q, k, v),
            window=bounds is not None and bounds != SEGMENTS,
            **spec.score.features,
            segments=bounds == SEGMENTS,
        )
        return _make_plan(q, k, v, o, spec, config, needs, lengths=lengths, sequences=sequences)

    return _plans.get(key, make)


def cuda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    out: torch.Tensor | None,
    config: KernelConfig | str | None = None,
    trace=None,
    trace_fault: str = "none",
    key_range: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, ...] | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel; returns ``(out, lse)`` (``lse`` None unless ``return_lse``).

    ``config`` names the configuration (else the tuned winner or the heuristic:
    :func:`flash_attention.ops.select.forward_config`). ``key_range`` (batch, 2) integers runs the
    key-padding build: batch row b attends only keys ``key_range[b, 0] <= j < key_range[b, 1]`` (clamped in
    the kernel, so any values are safe). ``dropout_p`` > 0 runs the dropout build with the keep mask of
    ``dropout_seed`` (:mod:`flash_attention.dropout`). ``window`` = (left, right) is a sliding window around
    the bottom-right diagonal (-1: unbounded on that side): query i sees keys i + shift - left ..
    i + shift + right (shift = seqlen_k - seqlen_q), within causal's bound and the key range, and the K/V
    blocks outside it are skipped. ``score_values`` are the scalar score functions' numbers by name
    (spec.score_functions; 0: off), applied to the scaled scores in that table's order (the LSE is of the
    modified scores); ``alibi_slopes`` (heads_q,) or (batch, heads_q) float32 adds ALiBi's
    ``-slope * |i + shift - j|`` to them. ``sinks`` (heads_q,) floats are attention sinks, joined to each
    row's softmax denominator in the kernel's epilogue (the LSE includes them). A head_dim that is not a
    multiple of 8 runs on inputs zero-padded to the next one (a copy; multiples of 8 are read in place).
    ``segments`` = (row_keys, key_rows), contiguous int32 (seqlen_q, 2) and (seqlen_k, 2) tensors on q's
    device, runs the segments build on a batch of one: query row i sees keys [row_keys[i, 0],
    row_keys[i, 1]) (flash_attention.api.varlen builds them; they carry causal and any window, and exclude
    ``key_range`` and ``window``); a third, int32 (seqlen_q,), gives each row's ALiBi diagonal key.

    ``trace`` (an object with ``batch``, ``head``, ``row_block``, ``warp``, e.g. a
    :class:`flash_attention.tools.sim.TraceSpec`), or the environment variable ``FLASH_ATTENTION_TRACE``,
    runs the debug build instead: that warp's intermediates land in a buffer kept in
    :func:`flash_attention.ops.trace.last_trace`, and ``trace_fault`` (or ``FLASH_ATTENTION_TRACE_FAULT``)
    plants a known bug. Debugging only: it synchronizes and allocates.
    """
    if trace is None and _trace.ENV in os.environ:
        env = _trace.trace_from_env()
        if env is not None:
            trace, trace_fault = env
    if dropout_p and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (flash_attention.dropout.draw_seed())")
    window = check_window(window)
    if segments is not None:
        check_segments(segments, q, k, key_range, window)
    spec = launch_spec(
        q, causal, softmax_scale, window, alibi_slopes, key_range, dropout_p, sinks=sinks, segments=segments,
        **score_values,
    )  # fmt: skip
    bounds = mask_bounds(spec, q.shape[1], k.shape[1])
    head_dim = q.shape[3]
    if head_dim % 8 or v.shape[3] % 8:
        return _padded_forward(
            q, k, v, causal, softmax_scale, return_lse, out, config, trace, trace_fault, key_range, dropout_p,
            dropout_seed, window, alibi_slopes, sinks, segments, **score_values,
        )  # fmt: skip
    if trace is not None:
        variant = key_range is not None or dropout_p or bounds is not None or spec.score != NO_SCORE
        if variant or sinks is not None or v.shape[3] != head_dim:
            raise ValueError(
                "the debug (trace) build takes no key_range, dropout, window, score function, sinks or v of "
                "its own head_dim"
            )
        return _traced_forward(q, k, v, causal, softmax_scale, return_lse, out, config, trace, trace_fault)

    q_, k_, v_ = kernel_ready(q), kernel_ready(k), kernel_ready(v)
    if out is not None and usable_in_place(out) and not tma.untileable(out):  # (a TMA store's map of it)
        o = out
    else:
        # empty_like with an explicit format: a contiguous tensor of q's shape whatever q's strides, and
        # about half the host time of torch.empty(shape, dtype=, device=) (measured on an H100 host).
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        if v.shape[3] != q.shape[3]:  # (the output has v's head_dim)
            o = q.new_empty((*q.shape[:3], v.shape[3]))
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32) if return_lse else None
    if o.numel() == 0:
        if out is not None and o is not out:
            out.copy_(o)
        return (out if out is not None else o), lse

    ranged = key_range is not None
    plan = plan_for(q_, k_, v_, o, spec, config, segment_lengths(segments), segment_count(segments))
    if ranged:
        # The kernel reads two int32 per batch row, contiguous; kept alive until the launch is queued.
        key_range = key_range.to(device=q.device, dtype=torch.int32).contiguous()
    key = dropout_key(*seed_pair(dropout_seed)) if dropout_p else 0
    if sinks is not None:  # float32 and contiguous as the kernel reads them; kept alive until the launch
        sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    launch_plan(plan, q_, k_, v_, o, lse, key_range, key, alibi_slopes, sinks, segments)
    if out is not None and o is not out:
        out.copy_(o)
        o = out
    return o, lse


def launch_plan(
    plan: _Plan, q_, k_, v_, o, lse, key_range=None, key: int = 0, alibi_slopes=None, sinks=None,
    segments=None,
) -> None:  # fmt: skip
    """Launch ``plan`` on kernel-ready q, k and v into ``o`` (and ``lse``, or None), with ``key_range`` (None,
    or the int32 contiguous (batch, 2) tensor of a ranged plan), the dropout ``key`` of a dropout plan,
    ALiBi's slopes and the sinks (float32 contiguous (heads_q,), or None) of a call that has them."""
    args, p, tile_counter = _call_args(plan, q_, k_, v_, o, lse)  # (the counter held until the launch)
    if key_range is not None:
        p.key_range = key_range.data_ptr()
    if key:
        p.dropout_key = key
    if alibi_slopes is not None:
        bind_alibi(p, alibi_slopes)
    if sinks is not None:
        p.sinks = sinks.data_ptr()
    if segments is not None:
        p.row_keys, p.key_rows = segments[0].data_ptr(), segments[1].data_ptr()
        if len(segments) == 3:  # (each row's ALiBi diagonal: the "..._table" builds)
            p.alibi_diagonal = segments[2].data_ptr()
        if plan.q_tiles:  # (held by the runs, which outlive the launch's queuing)
            p.q_tiles = query_tiles(segments, plan.q_tiles).data_ptr()
    launch(plan.kernel, plan.grid, plan.threads, plan.smem, plan.index, args)


def _padded_forward(
    q, k, v, causal, scale, return_lse, out, config, trace, trace_fault, key_range, dropout_p, dropout_seed,
    window=None, alibi_slopes=None, sinks=None, segments=None, **score_values,
):  # fmt: skip
    """A head_dim that is not a multiple of 8: the kernels read whole 16-byte chunks of a row, so q and k
    are zero-padded to the next multiple of 8, and v to its own (the scale stays the caller's), and the
    output sliced back to v's."""
    d8, dv8 = padded_to_8(q.shape[3]), padded_to_8(v.shape[3])
    o, lse = cuda_forward(
        pad_head_dim(q, d8),
        pad_head_dim(k, d8),
        pad_head_dim(v, dv8),
        causal=causal,
        softmax_scale=scale,
        return_lse=return_lse,
        out=None,
        config=config,
        trace=trace,
        trace_fault=trace_fault,
        key_range=key_range,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        window=window,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        segments=segments,
        **score_values,
    )
    o = o[..., : v.shape[3]]
    if out is not None:
        return out.copy_(o), lse
    return o.contiguous(), lse


def _traced_forward(q, k, v, causal, scale, return_lse, out, config, trace, trace_fault):
    """The debug build (fa/trace.cuh) of the sm80 or the warp-specialized kernel, launched as the normal
    build is (the same plan: grid, and for the warp-specialized kernel its tensor maps and tile counter):
    the traced warp's intermediates land in a buffer kept for :func:`flash_attention.ops.trace.last_trace`.
    A call the warp-specialized kernel cannot take (a layout TMA cannot address, a negative scale) runs the
    sm80 kernel's debug build: the sm90 kernel the normal build would run instead has none."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    q_, k_, v_ = kernel_ready(q), kernel_ready(k), kernel_ready(v)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = (
        torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    )
    needs = feature_list(trace=True, negative_scale=scale < 0, untileable=tma.untileable(q_, k_, v_))
    # Not kept among the plans: a debug call is rare, and its kernel is another build.
    plan = _make_plan(q_, k_, v_, o, AttentionSpec(bool(causal), scale), config, needs, trace=True)
    args, p, tile_counter = _call_args(plan, q_, k_, v_, o, lse)  # (the counter held until the launch)
    buf, p.trace_fault = _trace.trace_buffer(
        plan.cfg, trace, trace_fault, (batch, heads_q, seqlen_q, seqlen_k), q.device
    )
    p.trace = buf.data_ptr()
    p.trace_batch, p.trace_head = trace.batch, trace.head
    p.trace_m_block, p.trace_warp = trace.row_block, trace.warp
    launch(plan.kernel, plan.grid, plan.threads, plan.smem, plan.index, args)
    _trace.record(
        {
            "buffer": buf,
            "config": plan.cfg,
            "target": _trace.TraceTarget(trace.batch, trace.head, trace.row_block, trace.warp),
            "fault": trace_fault,
            "causal": bool(causal),
            "shape": (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim),
            "scale": scale,
        }
    )
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def prepare(cfg: KernelConfig | str, causal: bool, device) -> None:
    """Compile (or load from the cache) ``cfg`` for ``device`` ahead of a timed call."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    get_kernel(parse_config(cfg), bool(causal), device_arch(index))
