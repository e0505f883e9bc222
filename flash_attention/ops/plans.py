"""What the forward and backward launches share: the plan cache, the launch itself, and the parts of the
params structs both fill the same way (strides, scale, dropout) from the same device facts.

A plan holds everything a call's signature decides (configuration, loaded kernels, grids, shared memory,
a params struct with every field but the pointers); a call then fills in its pointers and launches. Working
all of that out per call cost more host time than a short kernel runs (docs/kernel-log.md, step 23).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

import torch

from ..dropout import dropout_threshold
from ..jit import driver
from ..jit.params import SCORE_VALUES
from ..jit.sources import SEGMENTS
from ..spec import AttentionSpec, ScoreSpec
from ..spec.validate import check_window, score_spec
from .device import current_stream, device_arch, gpu_name, smem_limit
from .query_tiles import sequence_bucket
from .select import NoKernel

__all__ = [
    "KernelBuild",
    "kernel_build",
    "LOG2E",
    "Launch",
    "PlanCache",
    "device_facts",
    "feature_list",
    "fill_common",
    "fill_strides",
    "launch",
    "launch_all",
    "launch_fields",
    "launch_spec",
    "mask_bounds",
    "programmatic_launches",
    "trial_switch",
    "bind_alibi",
    "check_segments",
    "segment_lengths",
    "window_bounds",
]

LOG2E = 1.4426950408889634

P = TypeVar("P")


class PlanCache(Generic[P]):
    """Plans by call signature, least recently used dropped beyond ``limit`` (decoding with a growing cache
    makes a new signature per step, so the cache must not grow without bound)."""

    def __init__(self, limit: int = 512) -> None:
        self._plans: OrderedDict[tuple, P] = OrderedDict()
        self._limit = limit
        self._derived: list[PlanCache] = []  # caches of things made from these plans: cleared with them

    def get(self, key: tuple, make: Callable[[], P]) -> P:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            if len(self._plans) > self._limit:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def find(self, key: tuple) -> P | None:
        """The plan of ``key``, or None (nothing is made)."""
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:
                pass  # dropped by another thread in between: the caller still has it
        return plan

    def derive(self, cache: PlanCache) -> None:
        """``cache`` holds things made from these plans: :meth:`clear` clears it too."""
        self._derived.append(cache)

    def clear(self) -> None:
        self._plans.clear()
        for cache in self._derived:
            cache.clear()


def feature_list(**flags: object) -> list[str]:
    """The names of the features a call needs (configs.families) from keyword flags:
    ``feature_list(key_range=False, dropout=0.1)`` is ``["dropout"]``."""
    return [name for name, on in flags.items() if on]


def check_segments(
    segments: object, q: torch.Tensor, k: torch.Tensor, key_range: object, window: object
) -> None:
    """Raise unless ``segments`` is (row_keys, key_rows): contiguous int32 tensors of shapes (seqlen_q, 2) and
    (seqlen_k, 2) on q's device, for a batch of one, without ``key_range`` or ``window`` (the runs carry
    both); or (row_keys, key_rows, alibi_diagonal) with each row's ALiBi diagonal key, a contiguous int32
    (seqlen_q,) tensor (flash_attention.api.varlen.alibi_diagonals: sequences without causal whose diagonal
    the runs do not give). Their values are the caller's (flash_attention.api.varlen builds them); the kernels
    clamp the rows they read, not the values."""
    if key_range is not None or window is not None:
        raise ValueError("segments carry the key ranges and the window: pass neither key_range nor window")
    if not isinstance(segments, tuple) or len(segments) not in (2, 3):
        raise TypeError("segments must be a tuple (row_keys, key_rows[, alibi_diagonal])")
    if q.shape[0] != 1:
        raise ValueError(f"segments run on a batch of one (packed sequences); got batch {q.shape[0]}")
    shapes = (("row_keys", (q.shape[1], 2)), ("key_rows", (k.shape[1], 2)), ("alibi_diagonal", (q.shape[1],)))
    for (name, shape), t in zip(shapes, segments, strict=False):
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.int32
            or tuple(t.shape) != shape
            or t.device != q.device
            or not t.is_contiguous()
        ):
            raise ValueError(f"segments' {name} must be a contiguous int32 {shape} tensor on {q.device}")


def segment_lengths(segments: tuple | None) -> tuple[int, int] | None:
    """The (seqlen_q, seqlen_k) a packed batch's configurations are chosen by: its sequences' typical
    lengths, which flash_attention.api.varlen notes on the runs (``_typical_lengths``: the max_seqlen hints,
    else the mean), where the packed lengths would pick tiles for one long sequence. None: q's and k's own."""
    return None if segments is None else getattr(segments[0], "_typical_lengths", None)


def segment_count(segments: tuple | None) -> int | None:
    """A packed batch's sequence count, rounded up to a power of two (query_tiles.sequence_bucket: one plan
    for many counts), when its runs carry the offsets its tile tables are cut by (the warp-specialized
    forward's query tiles, the warp-specialized dK/dV kernel's key tiles and the backward workspace's
    units: ops.query_tiles); None otherwise."""
    cu_q = None if segments is None else getattr(segments[0], "_cu_q", None)
    return None if cu_q is None else sequence_bucket(cu_q.numel() - 1)


def window_bounds(window: object, causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[int, int] | None:
    """The kernels' (left, right) of a sliding ``window`` = (left, right) (-1: unbounded on that side; query i
    sees keys i + shift - left .. i + shift + right, shift = seqlen_k - seqlen_q), with causal's right bound
    0 folded in; None when the window bounds nothing that ``causal`` does not (the plain or causal build
    runs then). An unbounded side becomes seqlen_q + seqlen_k, which no row reaches (fa/visible_keys.cuh)."""
    window = check_window(window)
    if window is None:
        return None
    far = seqlen_q + seqlen_k
    left, right = (far if w == -1 else min(w, far) for w in window)
    if causal:
        right = 0
    if left >= far and right >= (0 if causal else far):
        return None
    return left, right


def check_value_dim(q: torch.Tensor, v: torch.Tensor) -> None:
    """NoKernel unless v's head_dim is q's and k's: a plan's kernels read one head_dim for the three (the
    warp-specialized forward's value_dim builds are planned by ops.forward itself; ops.cuda_backward pads a
    narrower v to q's head_dim first). A v wider than q has no kernel: the dispatch then runs the PyTorch
    fallback, with its warning."""
    if v.shape[-1] != q.shape[-1]:
        raise NoKernel(
            f"v's head_dim ({v.shape[-1]}) differs from q's and k's ({q.shape[-1]}), which no kernel of ours "
            "takes yet"
        )


def bind_score_values(params: ctypes.Structure, score: ScoreSpec) -> None:
    """The params' ``score_values``: the numbers of ``score``'s active scalar functions, in the order of
    spec.score_functions, from slot 0 (what each C++ policy reads; fa::kScoreValues slots)."""
    if len(score.values) > SCORE_VALUES:
        raise ValueError(
            f"{len(score.values)} scalar score functions in one call ({score.build}); the params hold "
            f"{SCORE_VALUES} (jit.params.SCORE_VALUES, fa::kScoreValues)"
        )
    for slot, (_, value) in enumerate(score.values):
        params.score_values[slot] = value


def bind_alibi(params: ctypes.Structure, alibi_slopes: torch.Tensor) -> None:
    """ALiBi's fields of FwdParams / BwdParams for one launch: its slopes and their stride between batch rows
    (0: one (heads_q,) table). The scalar functions' numbers are the plan's (bind_score_values)."""
    params.alibi_slopes = alibi_slopes.data_ptr()
    params.alibi_batch_stride = alibi_slopes.shape[-1] if alibi_slopes.dim() == 2 else 0


def device_facts(index: int) -> dict:
    """The device arguments of select.forward_config / backward_config for GPU ``index``."""
    return {"arch": device_arch(index), "gpu": gpu_name(index), "smem_limit": smem_limit(index)}


def fill_strides(params: ctypes.Structure, prefix: str, t: torch.Tensor) -> None:
    """``<prefix>_{batch,row,head}_stride`` of a (batch, seqlen, heads, head_dim) tensor."""
    s = t.stride()
    setattr(params, f"{prefix}_batch_stride", s[0])
    setattr(params, f"{prefix}_row_stride", s[1])
    setattr(params, f"{prefix}_head_stride", s[2])


def launch_spec(
    q: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None,
    alibi_slopes: torch.Tensor | None,
    key_range: object,
    dropout_p: float,
    deterministic: bool = False,
    sinks: object = None,
    segments: tuple | None = None,
    **score_values: float,
) -> AttentionSpec:
    """The spec.AttentionSpec of a launch-layer call given option by option (cuda_forward, cuda_backward,
    training_forward: the custom ops' and the tools' entries), its other arguments checked by the caller;
    its score function (spec.validate.score_spec: ALiBi and the scalar functions' ``score_values`` by name,
    spec.score_functions) checked and built here."""
    return AttentionSpec(
        bool(causal),
        float(scale),
        None if window is None else tuple(window),
        score_spec(alibi_slopes, q, segments, causal, **score_values),
        key_range is not None,
        float(dropout_p),
        bool(deterministic),
        sinks is not None,
        0 if segments is None else len(segments),
    )


def mask_bounds(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> tuple[int, int] | str | None:
    """The mask build of ``spec``'s kernels at these lengths: SEGMENTS for a packed batch (its runs carry
    causal and any window), the kernels' (left, right) of its window (window_bounds), or None (the plain or
    causal build)."""
    if spec.segments:
        return SEGMENTS
    return window_bounds(spec.window, spec.causal, seqlen_q, seqlen_k)


class KernelBuild(NamedTuple):
    """Which build of a family's translation unit a call runs, and which of its entry points: ``causal`` (the
    entry point's mask; a window's or a packed batch's build has one entry point, named as not causal: the
    window's bounds or the runs carry it), ``ranged`` (key ranges), ``dropout``, ``window`` (False, True for
    the sliding window's build, or SEGMENTS) and ``score`` (spec.ScoreSpec.build). In the order the configs'
    ``symbol`` takes them after the kernel's kind."""

    causal: bool
    ranged: bool
    dropout: bool
    window: bool | str
    score: str | None

    @property
    def variant(self) -> dict:
        """The JIT's keywords of the build (jit.loader, jit.cache: everything but the entry point)."""
        return dict(ranged=self.ranged, dropout=self.dropout, window=self.window, score=self.score)


def kernel_build(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> KernelBuild:
    """The build of ``spec``'s kernels at these lengths: the one place a call's options become a kernel
    build (its translation unit's name, cache key and entry point), for the forward, the backward and the
    ahead-of-time catalog alike."""
    bounds = mask_bounds(spec, seqlen_q, seqlen_k)
    window = SEGMENTS if bounds == SEGMENTS else bounds is not None
    return KernelBuild(
        spec.causal and bounds is None, spec.ranged, bool(spec.dropout_p), window, spec.score.build
    )


def fill_common(
    params: ctypes.Structure, q: torch.Tensor, k: torch.Tensor, block_q: int, scale: float, dropout_p: float
) -> None:
    """The fields FwdParams and BwdParams share: problem sizes, the query block count, the scale (also as
    scale * log2(e), the kernels' exp2 form) and the dropout threshold and rescale."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    params.batch, params.heads_q, params.heads_kv = batch, heads_q, heads_kv
    params.seqlen_q, params.seqlen_k, params.head_dim = seqlen_q, seqlen_k, head_dim
    params.group = heads_q // heads_kv
    params.num_m_blocks = -(-seqlen_q // block_q)
    params.scale, params.scale_log2 = scale, scale * LOG2E
    if dropout_p:
        params.dropout_threshold = dropout_threshold(dropout_p)
        params.dropout_rp = 1.0 / (1.0 - dropout_p)


def fill_contiguous_strides(params: ctypes.Structure, prefix: str, shape: tuple[int, ...]) -> None:
    """:func:`fill_strides` of a contiguous (batch, seqlen, heads, head_dim) tensor of ``shape``."""
    _, seqlen, heads, head_dim = shape
    setattr(params, f"{prefix}_batch_stride", seqlen * heads * head_dim)
    setattr(params, f"{prefix}_row_stride", heads * head_dim)
    setattr(params, f"{prefix}_head_stride", head_dim)


class Launch(NamedTuple):
    """One kernel launch of a plan: the kernel, its grid, threads per block and dynamic shared memory, and
    whether it is queued programmatically (it may start before the kernel ahead of it on the stream has
    finished, and waits for that kernel itself: fa/grid_dependency.cuh; only on compute capability 9.0+,
    see :func:`programmatic_launches`)."""

    kernel: driver.Kernel
    grid: tuple[int, int, int]
    threads: int
    smem: int
    programmatic: bool = False


def trial_switch(name: str, default: bool = False) -> bool:
    """Whether the launch-layer change behind ``FLASH_ATTENTION_<name>`` is on (``=1``) or off (``=0``), else
    ``default``: a change stays off until a GPU measurement turns it on by default, and the switch stays to
    A/B it against the previous behaviour. Kernel log 122 (``PDL``: programmatic launches, on since the
    measurement) and 123 (``CAUSAL_ORDER``: the causal backward's block order, off: measured slower)."""
    value = os.environ.get(f"FLASH_ATTENTION_{name}")
    return default if value is None else value == "1"


def programmatic_launches(arch: str) -> bool:
    """Whether a plan's later launches on a GPU of ``arch`` (``"sm_90"``) are queued programmatically: unless
    ``FLASH_ATTENTION_PDL=0`` (trial_switch), on compute capability 9.0+, where the kernels' griddepcontrol is
    (fa/grid_dependency.cuh), and a driver of CUDA 12.3 or later, the first whose CUDA graphs capture such
    launches (PyTorch's graphs and torch.compile's capture ours; an older driver would refuse the launch
    inside a capture)."""
    hopper_or_later = int(arch.removeprefix("sm_").rstrip("a")) >= 90
    return trial_switch("PDL", default=True) and hopper_or_later and driver_version() >= 12030


@functools.cache
def driver_version() -> int:
    """The installed driver's CUDA version (jit.driver.driver_version; 0 where it cannot be asked)."""
    try:
        return driver.driver_version()
    except Exception:  # noqa: BLE001 - no usable driver: no programmatic launches
        return 0


def launch_fields(launches) -> list[int]:
    """``launches`` (:class:`Launch`) as the host library's programs take them (csrc/host/driver.h,
    launches_from): seven integers each, the kernel handle, the grid, threads, dynamic shared memory and
    whether it is queued programmatically."""
    fields: list[int] = []
    for kernel, grid, threads, smem, programmatic in launches:
        fields += [kernel.handle.value, *grid, threads, smem, int(programmatic)]
    return fields


def launch_all(launches, index: int, params, stream: int) -> None:
    """Queue ``launches`` (:class:`Launch`) in order, all with ``params``, on ``stream`` (PyTorch's current
    stream of device ``index``, queried by the caller): one context switch for all."""
    previous = driver.make_primary_current(index)
    try:
        for kernel, grid, threads, smem, programmatic in launches:
            kernel.launch(grid, (threads, 1, 1), smem, stream, params, programmatic)
    finally:
        if previous is not None:
            driver.set_current(previous)


def launch(kernel: driver.Kernel, grid, threads: int, smem: int, index: int, params) -> None:
    """Launch on PyTorch's current stream of device ``index``, in that device's primary context (made
    current for the launch and the caller's context put back after, see driver.make_primary_current)."""
    launch_all((Launch(kernel, grid, threads, smem),), index, params, current_stream(index))
