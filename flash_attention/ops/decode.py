"""The decode launch: a KV-cache call -> DecodeParams -> the append, decode and combine kernels.

Nothing here reads a device value on the host: the cache lengths and the page table stay on the GPU and
the kernels check them (csrc/include/fa/kv_cache.cuh), so a decode step can be captured in a CUDA graph.
The split count therefore depends on the cache's capacity, not on the rows' actual lengths (which only the
GPU knows): splits past a row's keys cost a block that writes an empty partial.

A contiguous cache's plan serves every capacity of its bucket (configs.decode.cache_length_bucket, at most
1/8 above the capacity): its splits cover the bucket's largest capacity, and the capacity and the caches'
strides are written per call. A cache that grows by a token per step (transformers' DynamicCache, a new
tensor each step) then makes a plan every eighth of an octave, not every step: a plan costs ~100 us of
host time, a planned call ~15-30.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..configs.decode import DecodeConfig, cache_length_bucket, default_decode_config, num_splits_heuristic
from ..jit import driver, host
from ..jit.loader import get_decode_kernels
from ..jit.params import DecodeParams
from ..jit.sources import DECODE_AUX_THREADS
from ..spec.score_functions import SCORE_FUNCTIONS, decode_fields
from ..spec.validate_kvcache import CacheProblem
from . import repeat
from .device import KERNEL_DTYPES, cuda_unavailable_reason, current_stream, device_arch, dtype_name, sm_count
from .plans import (
    Launch,
    PlanCache,
    fill_contiguous_strides,
    fill_strides,
    launch_all,
    launch_fields,
    programmatic_launches,
    trial_switch,
)
from .tensors import MAX_GRID_YZ, aligned_copy, strides_usable

__all__ = [
    "DecodePlan",
    "clear_plans",
    "decode_config",
    "decode_plan",
    "decode_unavailable_reason",
    "layout_ok",
    "repeat_plan",
    "splits_for",
]


def decode_unavailable_reason(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared_rows: bool = False
) -> str | None:
    """None when the decode kernels can take this call; otherwise why not, in words. ``shared_rows``: the
    cache's rows are one buffer (batch stride 0, rows placed by ``cache_starts``), which a call that appends
    nothing may read."""
    reason = cuda_unavailable_reason(q)
    if reason is not None:
        return reason
    if q.shape[3] % 8:
        # The cache is written in place, so it cannot be padded to whole 16-byte chunks as q can.
        return (
            f"the decode kernels need head_dim a multiple of 8 (the cache is read in place); got {q.shape[3]}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not layout_ok(t[:1] if shared_rows else t):  # (a shared buffer: its one row's strides)
            return f"{name}'s strides are not multiples of 8 elements with the last one 1 ({t.stride()})"
    if k_cache.shape[2] > MAX_GRID_YZ or q.shape[0] > MAX_GRID_YZ:
        return f"batch and heads_kv must be at most {MAX_GRID_YZ}"
    return None


def decode_config(q: torch.Tensor, problem: CacheProblem) -> DecodeConfig:
    """The decode config of a call on q's GPU."""
    index = q.get_device()
    rows = problem.seqlen_q * problem.group
    cfg = default_decode_config(dtype_name(q), problem.head_dim, rows, device_arch(index))
    # The main loop that refills before it waits (fa/decode_block.cuh PageRing) is the wgmma kernel's default
    # (configs.decode, kernel log 159); FLASH_ATTENTION_DECODE_REFILL_FIRST=1 or =0 sets it for both kernels.
    return cfg.replace(refill_first=trial_switch("DECODE_REFILL_FIRST", default=cfg.refill_first))


def splits_for(
    cfg: DecodeConfig, problem: CacheProblem, num_splits: int, sms: int, blocks_per_sm: int = 1
) -> tuple[int, int]:
    """``(num_splits, keys_per_split)``: the caller's count (0: the heuristic's), each split a whole number
    of K/V tiles, and no split starting past the capacity."""
    rows = problem.seqlen_q * problem.group
    m_blocks = -(-rows // cfg.block_m)
    tiles = max(1, -(-problem.capacity // cfg.block_kv))
    if num_splits == 0:
        num_splits = num_splits_heuristic(
            problem.batch * problem.heads_kv * m_blocks, problem.capacity, cfg.block_kv, sms, blocks_per_sm
        )
    num_splits = max(1, min(num_splits, tiles))
    per_split = -(-tiles // num_splits) * cfg.block_kv
    return -(-problem.capacity // per_split) if problem.capacity else 1, per_split


class DecodePlan:
    """A decode call's launches, prepared once per call signature (shapes, strides, dtypes, device, options;
    a contiguous cache's capacity as its bucket, with any strides the kernels can read): the config, the
    loaded kernels, grids, split count and a DecodeParams with every stride and size filled. Calling it with
    that signature's tensors fills in their addresses (and a contiguous cache's capacity and strides, and an
    int length) and queues the kernels -- a decode step's host cost is then a few attribute reads and the
    launches (measured on an H100 host before plans: 105 us per call without an append, 140 with, where sdpa
    takes 20).

    Built from the validated call (:func:`flash_attention.spec.validate_kvcache.validate_kvcache`), the
    kernels able to take it (:func:`decode_unavailable_reason`: strides; the addresses are checked per call,
    as a later call of the same signature may bring differently aligned tensors)."""

    def __init__(
        self,
        problem: CacheProblem,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache_seqlens: torch.Tensor | int,
        block_table: torch.Tensor | None,
        num_splits: int,
        out: torch.Tensor | None,
        return_lse: bool,
        starts: bool = False,
        row_keys: int = 0,
    ):
        """``starts``: the calls bind each row's first cache row (``cache_starts`` of :meth:`__call__`: a
        contiguous cache whose rows share one buffer at other offsets, a packed batch's keys); ``row_keys``:
        with starts, the keys a row typically has, which the splits are sized for (a longer row's last split
        takes the rest: fa/decode_block.cuh)."""
        assert q.dtype in KERNEL_DTYPES
        assert not (starts and block_table is not None), "row starts are a contiguous cache's"
        self.index = index = q.get_device()
        self.device = q.device
        cfg = decode_config(q, problem)
        arch = device_arch(index)
        kernels = get_decode_kernels(cfg, arch)
        paged = block_table is not None
        self.problem, self.return_lse, self.starts = problem, return_lse, starts

        p = DecodeParams()
        for prefix, t in (("q", q), ("k", k_cache), ("v", v_cache)):
            fill_strides(p, prefix, t)
        # The output: the caller's buffer when the kernels can write it, else a new contiguous one.
        self.out_in_place = out is not None and layout_ok(out)
        if self.out_in_place:
            fill_strides(p, "o", out)
        else:
            fill_contiguous_strides(p, "o", q.shape)
        if return_lse:
            p.lse_batch_stride, p.lse_head_stride = problem.heads_q * problem.seqlen_q, problem.seqlen_q
        self.lens_copy = isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.stride(0) != 1
        self.table_copy = paged and block_table.stride(1) != 1
        if paged:
            p.block_table_stride = block_table.shape[1] if self.table_copy else block_table.stride(0)
            p.num_pages = k_cache.shape[0]
        p.batch, p.heads_q, p.heads_kv, p.seqlen_q = (
            problem.batch,
            problem.heads_q,
            problem.heads_kv,
            problem.seqlen_q,
        )
        p.head_dim, p.group, p.seqlen_new = problem.head_dim, problem.group, problem.seqlen_new
        p.capacity, p.page_size = problem.capacity, problem.page_size
        p.rows = problem.seqlen_q * problem.group
        p.num_m_blocks = -(-p.rows // cfg.block_m)
        p.scale = problem.scale
        p.window_left, p.window_right = problem.window or (-1, -1)
        # (a score function the decode kernels take is a run-time value in its own fields, not a policy)
        for name, value in decode_fields(problem.score):
            setattr(p, name, value)
        # ALiBi's slopes are a per-call pointer (__call__); a (heads_q,) table repeats for every row.
        p.alibi_batch_stride = problem.heads_q if problem.alibi == 2 else 0

        # Inputs the kernels read in place when their layout allows (q, and the new tokens k/v), else as
        # contiguous copies, whose strides are then filled per call.
        self.q_in_place = layout_ok(q)
        self.new_in_place = problem.seqlen_new == 0 or (layout_ok(k) and layout_ok(v))
        if problem.seqlen_new:
            fill_strides(p, "kn", k)
            fill_strides(p, "vn", v)

        self.launches: list[Launch] = []
        if problem.seqlen_new:
            append = kernels[cfg.symbol("append", paged=paged)]
            append_grid = (problem.seqlen_new, problem.batch, 1)
            self.launches.append(Launch(append, append_grid, DECODE_AUX_THREADS, 0))
        decode = kernels[cfg.symbol("decode", problem.causal, paged)]
        # The split heuristic's waves: a multiprocessor's co-resident blocks share its bandwidth, so a wave
        # is one block per SM (one row, 32/8 heads, 32k keys on an H100: 16 splits ran in 55.7 us where the
        # 33 of a two-blocks-per-SM wave took 60.3; docs/kernel-log.md, step 65), paged caches included
        # since their page entries arrive by cp.async (step 74: page 16, 188 us with one block per SM
        # against 191 with two, at batch 1 / 128k). Pages smaller than a copy thread's rows, looked up row
        # by row, still want the second block per SM to hide those lookups (page 1: 274 against 195 us).
        # The wgmma kernel's blocks (64 rows) are bound by their own serial math, not by the bytes: two per
        # SM overlap one's S = Q K^T wait and softmax with the other's products (configs.decode.
        # default_decode_config; an H200 at seqlen_q 16, batch 8 / 32k keys: 281 us against 319 at one
        # block per SM). Two, not all the occupancy allows (five at head_dim 64): more only adds splits.
        per_sm = 1
        if cfg.wgmma:
            per_sm = min(2, decode.blocks_per_sm(cfg.threads, cfg.smem_bytes, index))
        elif paged and cfg.looks_up_each_row(problem.page_size):
            per_sm = decode.blocks_per_sm(cfg.threads, cfg.smem_bytes, index)
        # A contiguous cache's splits cover its bucket's largest capacity: every cache of the bucket fits.
        basis = problem
        if not paged:
            rows_fit = row_keys if starts and row_keys else problem.capacity
            basis = dataclasses.replace(problem, capacity=cache_length_bucket(rows_fit))
        if p.window_left >= 0:
            # A window's splits divide the keys from the row's first query's window on (fa/decode_block.cuh):
            # at most seqlen_q + left of them, plus a tile for the start's alignment.
            span = problem.seqlen_q + p.window_left + cfg.block_kv
            basis = dataclasses.replace(basis, capacity=min(basis.capacity, span))
        p.num_splits, p.keys_per_split = splits_for(cfg, basis, num_splits, sm_count(index), per_sm)
        self.fills_geometry = not paged
        decode.ensure_dynamic_smem(cfg.smem_bytes, index)
        grid = (p.num_m_blocks * p.num_splits, problem.heads_kv, problem.batch)
        self.launches.append(Launch(decode, grid, cfg.threads, cfg.smem_bytes))
        # Split partials: an fp32 workspace (_split_buffers), O (splits, batch, heads_q, seqlen_q, kHeadDim)
        # then the LSEs (splits, batch, heads_q, seqlen_q).
        self.partial_rows = (
            p.num_splits * problem.batch * problem.heads_q * problem.seqlen_q if p.num_splits > 1 else 0
        )
        self.partial_o = self.partial_rows * cfg.head_dim
        # Splits are merged by the standalone combine kernel, or, with FLASH_ATTENTION_DECODE_FUSED_COMBINE=1,
        # by the decode kernel's last split block per row block (one launch fewer; slower on the GPU where the
        # merging is much work: fa/decode_combine.cuh).
        self.counters = 0
        if p.num_splits > 1 and os.environ.get("FLASH_ATTENTION_DECODE_FUSED_COMBINE", "0") == "1":
            self.counters = problem.batch * problem.heads_kv * p.num_m_blocks
        elif p.num_splits > 1:
            rows = problem.batch * problem.heads_q * problem.seqlen_q
            per_block = DECODE_AUX_THREADS // (cfg.head_dim // 4)
            combine = kernels[cfg.symbol("combine")]
            self.launches.append(Launch(combine, (-(-rows // per_block), 1, 1), DECODE_AUX_THREADS, 0))
        # On Hopper the launches after the first are queued programmatically: each may start before the kernel
        # ahead of it has finished and waits for it at its start (jit.sources' decode entry points), so the
        # combine's (and, after an append, the decode kernel's) launch latency overlaps the kernel before.
        # The first one is queued so too, overlapping whatever ran before the call (kernel log 158: an H200,
        # one token at batch 1 / 32k keys, 0.984x the time, seqlen_q 16 there 0.977x;
        # FLASH_ATTENTION_DECODE_PDL_FIRST=0 for an ordinary first launch). What it leans on: a first launch
        # after a copy, a memset or an event waits for it as an ordinary launch would
        # (tests/test_gpu_decode_first_launch.py), and every entry point waits before its first access to
        # memory and reads nothing through the non-coherent path (fa/kv_cache.cuh's page table).
        if programmatic_launches(arch):
            first = trial_switch("DECODE_PDL_FIRST", default=True)
            self.launches = [
                launch._replace(programmatic=i > 0 or first) for i, launch in enumerate(self.launches)
            ]
        self.template = p
        self._native = None  # the host library's form of this plan's calls (made at the first call)

    def _make_native(self):
        """``(library, DecodeProgram, its address)`` when this plan's calls may run as the host library's
        ``decode_call`` (csrc/host/decode_call.cpp; the default form, ``FLASH_ATTENTION_REPEAT_CALLS`` in
        ops/repeat.py), else False. It takes plans whose operands the kernels read in place and whose splits
        the standalone combine merges; everything else, and a call with a caller's ``out``, stays in
        Python."""
        if (
            repeat.MODE != "native"
            or self.problem.alibi  # (the host library fills no slopes pointer)
            or self.out_in_place
            or self.counters
            or self.lens_copy
            or self.table_copy
            or not self.q_in_place
            or not self.new_in_place
        ):
            return False
        lib = host.ops_or_none()
        if lib is None:
            return False
        geometry = _NATIVE_GEOMETRY_SLOTS if self.fills_geometry else ()
        offsets = [getattr(DecodeParams, name).offset for name in _NATIVE_SLOTS]
        offsets.append(DecodeParams.cache_starts.offset if self.starts else -1)
        offsets += [
            getattr(DecodeParams, name).offset if name in geometry else -1 for name in _NATIVE_GEOMETRY_SLOTS
        ]
        offsets.append(DecodeParams.cache_seqlen.offset)
        fields = launch_fields(self.launches)
        problem = self.problem
        program = torch.classes.flash_attention_host.DecodeProgram(
            torch.frombuffer(bytearray(bytes(self.template)), dtype=torch.uint8),
            offsets,
            fields,
            "\n".join(kernel.name for kernel, *_ in self.launches),
            driver.primary_context(self.index),
            [problem.batch, problem.heads_q, problem.seqlen_q] if self.return_lse else [],
            self.partial_o,
            self.partial_rows,
        )
        return lib, program, program.address()

    def repeat(
        self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_starts=None
    ) -> tuple | None:
        """A repeat call of this plan's signature straight to the host library: ``(out, lse)``, or None when
        the call must take the plan's whole call (no host library form, a misaligned address)."""
        native = self._native
        if not native:
            return None
        lib, _, address = native
        lens, length = (None, cache_seqlens) if isinstance(cache_seqlens, int) else (cache_seqlens, 0)
        result = lib.decode_call(q, k_cache, v_cache, k, v, lens, length, block_table, address, cache_starts)
        if not result:
            return None
        return result[0], (result[1] if len(result) == 2 else None)

    @staticmethod
    def runnable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether this call's caches are 16-byte aligned, as the kernels need: they are written in place, so
        a misaligned one cannot be copied instead (q, k, v and out can, and are, per call)."""
        return (k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache_seqlens: torch.Tensor | int,
        block_table: torch.Tensor | None,
        out: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None = None,
        cache_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``cache_seqlens``: a tensor, or an int, every row's length (passed to the kernels by value);
        ``alibi_slopes``: the call's, when its problem has ALiBi; ``cache_starts``: int32 (batch,),
        contiguous, each row's first cache row, for a plan made with ``starts``."""
        if (cache_starts is not None) != self.starts:  # (a raise, not an assert: -O must not drop it)
            raise ValueError("cache_starts goes exactly to a plan made with row starts (DecodePlan.starts)")
        one_length = isinstance(cache_seqlens, int)
        if self._native is None:
            self._native = self._make_native()
        if out is None:  # (every call without an out= passes through repeat once: the GPU tests count on it)
            result = self.repeat(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_starts)
            if result is not None:
                return result
        problem = self.problem
        p = DecodeParams.from_buffer_copy(self.template)
        if not (self.q_in_place and q.data_ptr() % 16 == 0):
            q = aligned_copy(q)
            fill_strides(p, "q", q)
        if self.out_in_place and out.data_ptr() % 16 == 0:
            o = out
        else:
            # empty_like with an explicit format: contiguous, at about half the host time of torch.empty
            # with shape, dtype and device (ops/forward.py measured it). The template has these strides
            # unless it was made for a caller's buffer (this call's is misaligned).
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
            if self.out_in_place:
                fill_strides(p, "o", o)
        p.q, p.k, p.v, p.o = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr()
        if problem.alibi:
            p.alibi_slopes = alibi_slopes.data_ptr()
        if self.fills_geometry:  # this call's capacity and strides (the signature admitted readable ones)
            fill_strides(p, "k", k_cache)
            fill_strides(p, "v", v_cache)
            p.capacity = k_cache.shape[1]
        # The lengths and page table as the kernels index them: elements adjacent (a strided view is copied).
        if one_length:
            p.cache_seqlens, p.cache_seqlen = None, cache_seqlens
        else:
            if self.lens_copy:
                cache_seqlens = cache_seqlens.contiguous()
            p.cache_seqlens = cache_seqlens.data_ptr()
        if block_table is not None:
            if self.table_copy:
                block_table = block_table.contiguous()
            p.block_table = block_table.data_ptr()
        if cache_starts is not None:
            p.cache_starts = cache_starts.data_ptr()
        if problem.seqlen_new:
            if not (self.new_in_place and (k.data_ptr() | v.data_ptr()) % 16 == 0):
                k, v = aligned_copy(k), aligned_copy(v)
                fill_strides(p, "kn", k)
                fill_strides(p, "vn", v)
            p.k_new, p.v_new = k.data_ptr(), v.data_ptr()
        lse = None
        if self.return_lse:
            lse = q.new_empty((problem.batch, problem.heads_q, problem.seqlen_q), dtype=torch.float32)
            p.lse = lse.data_ptr()
        stream = current_stream(self.index)
        if self.partial_rows:
            # Held until the launches are queued: a buffer made for a capture and dropped before its kernel
            # is captured would be handed to the next allocation of the capture (the counters, say).
            partials, counters = _split_buffers(
                self.device, stream, self.partial_o + self.partial_rows, self.counters
            )
            p.o_partial = partials.data_ptr()
            p.lse_partial = p.o_partial + 4 * self.partial_o
            if counters is not None:
                p.split_counters = counters.data_ptr()
        launch_all(self.launches, self.index, p, stream)
        if out is not None and o is not out:
            out.copy_(o)
            o = out
        return o, lse


# The DecodeParams fields the host library writes, in the order of decode_call.cpp's DecodeSlot enum: the
# pointers, a contiguous cache's geometry, then the one length of every row (cache_seqlen).
# decode_call.cpp's DecodeSlot order: these pointers, then the row starts' (-1 without them), then the
# geometry's, then the one length's (_make_native's offsets list).
_NATIVE_SLOTS = (
    "q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "cache_seqlens", "block_table",
)  # fmt: skip
_NATIVE_GEOMETRY_SLOTS = (
    "k_batch_stride", "k_row_stride", "k_head_stride", "v_batch_stride", "v_row_stride", "v_head_stride",
    "capacity",
)  # fmt: skip


# Per (device, stream): the split partials' fp32 workspace and the split counters (int32, zero between
# calls: the decode kernel's last split block resets its own), grown on demand. Reusing them is safe because
# the kernels of one stream run in order; a call on another stream gets its own. Under CUDA-graph capture a
# call gets fresh ones (a zeroed counter buffer is a memset node of the graph), never the eager buffers.
_stream_buffers: dict[tuple[torch.device, int, str], torch.Tensor] = {}


def _split_buffers(
    device: torch.device, stream: int, partials: int, counters: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 partials' workspace (``partials`` elements) and the int32 counters (``counters``, zero; None
    when 0) for a call on ``stream``."""
    if _capturing(device):
        return (
            torch.empty(partials, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device) if counters else None,
        )
    work = _grown(device, stream, "partials", partials, torch.float32)
    return work, _grown(device, stream, "counters", counters, torch.int32) if counters else None


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a CUDA graph (torch's check asks of the
    current device's stream, so a call on another device asks under that device)."""
    if device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _grown(device: torch.device, stream: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _stream_buffers.get((device, stream, name))
    if buf is None or buf.numel() < numel:
        size = max(numel, 2 * buf.numel()) if buf is not None else numel
        # Counters start at zero (and the kernels leave them so); the workspace needs no initial value.
        make = torch.zeros if dtype == torch.int32 else torch.empty
        buf = _stream_buffers[(device, stream, name)] = make(size, dtype=dtype, device=device)
    return buf


def layout_ok(t: torch.Tensor) -> bool:
    """The strides the kernels need (tensors.strides_usable; the address is checked per call), and no
    dimension of more than one element broadcast (stride 0): the caches and out are written, and blocks
    writing the same bytes for different positions would race."""
    s, n = t.stride(), t.shape
    return strides_usable(t) and all(s[i] != 0 or n[i] <= 1 for i in range(3))


_plans: PlanCache[DecodePlan | str] = PlanCache()


def clear_plans() -> None:
    """Forget every decode plan (and the host library's programs they hold)."""
    _plans.clear()


# Plans made while the host library was being built in the background took the Python launch for good
# (_make_native answered False): forgotten once it is loaded, so the next calls plan its form.
host.when_ready(clear_plans)


def repeat_plan(key: tuple) -> DecodePlan | None:
    """The plan kept under signature ``key`` when its calls may go straight to :meth:`DecodePlan.repeat`
    (made, its host library form made by an earlier call); None otherwise."""
    plan = _plans.find(key)
    return plan if type(plan) is DecodePlan and plan._native else None


def decode_plan(
    problem: CacheProblem,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    num_splits: int,
    out: torch.Tensor | None,
    return_lse: bool,
    key: tuple | None,
    starts: bool = False,
    row_keys: int = 0,
) -> DecodePlan | str:
    """The :class:`DecodePlan` of a validated call, or why the kernels cannot take it (in words). ``key``,
    when given, is the call's signature (every shape, stride, dtype, device and option): the answer is kept
    under it, so a decode loop builds its plan once."""

    def make() -> DecodePlan | str:
        if problem.head_dim_v:
            dims = f"v's head_dim ({problem.head_dim_v}) differs from q's and k's ({problem.head_dim})"
            return f"{dims}, which no decode kernel takes yet"
        # (the score functions without run-time fields in the decode kernels' params would be dropped, so the
        # composed path takes them)
        other = [name for name, _ in problem.score if not SCORE_FUNCTIONS[name].decode_fields]
        if other:
            return f"the decode kernels have no score function {other[0]!r}"
        # (row starts into one buffer: only a call that appends nothing, which writes no cache row)
        shared = starts and problem.seqlen_new == 0 and k_cache.stride(0) == 0
        reason = decode_unavailable_reason(q, k_cache, v_cache, shared)
        if reason is not None:
            return reason
        return DecodePlan(
            problem, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, out, return_lse,
            starts, row_keys,
        )  # fmt: skip

    return make() if key is None else _plans.get(key, make)
