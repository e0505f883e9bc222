"""Repeat calls: an ``attention()`` call whose signature was validated and planned before goes straight to
its launch.

A model calls attention with the same shapes, strides, dtypes and options on every layer and every step, and
at small sizes the host time of the call is the whole time (a training step of a (1, 128, 16, 64) problem is
host-bound on an H100). The first call of a signature runs the whole path (``spec.validate.validate``, the
kernel-or-fallback choice, the plans); when that path ends in one launch of a forward plan with nothing
per-call to work out but pointers, it leaves a :class:`RepeatCall` under the call's signature
(:func:`signature`). A later call with an equal signature allocates its output, fills in its pointers,
launches, and, in eager training, records the compiled autograd node: what the first call did, without
deciding any of it again.

The signature holds everything the checks and the plans depend on: each tensor's exact type, shape, strides,
dtype and device, the options, whether autograd records the call, and the deterministic-algorithms switch.
What a signature cannot fix is checked per call: the addresses' 16-byte alignment, and the debug build's
environment variable. A signature whose call cannot be a plain launch (a head_dim, q's or v's, that is not a
multiple of 8, strides the kernels cannot read in place, no host library in training, v's own head_dim in
training where no backward kernel reads it) is remembered as such, so its calls take the whole path without
trying again. A call with v's own head_dim repeats, allocating its output with v's head_dim (in training,
where ops.backward.value_dim_config names the kernel reading it: the node runs that one). A persistent
grid's tile counter is the current stream's, bound per call as the whole path's launch finds it.
A sliding window and soft-capping are values the plans hold (the kernels' bounds and cap are fields of the
params template), so their calls repeat as plain ones do: Mistral's, Gemma's and Qwen2's sliding layers.
ALiBi's slopes, the sinks and a packed batch's runs are tensors each launch binds (the signature holds their
layouts; a repeat writes their addresses, with the runs' query-tile table; in training the node binds the
slopes, the runs and the backward's key tiles and workspace units, all made once per runs, and takes the
sinks as an input it differentiates); dropout, ``out=`` and torch.compile always take the whole path.

Two forms of the launch itself: :class:`NativeRepeatCall` (the default), which hands the whole of it
(allocations, pointers, tensor maps, launch, the node) to the host library's ``repeat_call``
(``csrc/host/repeat_call.cpp``) in one dispatch, and :class:`RepeatCall` in Python, which the native form
falls back to where the host library cannot be built. ``FLASH_ATTENTION_REPEAT_CALLS`` (read at import)
picks: unset, ``1`` or ``native`` the host library's form where it is available, ``python`` the Python
form, ``0`` neither: every call takes the whole path (for measuring what repeat calls save, and for ruling
them out when something looks wrong). On an H100 host the native form made a (1, 128, 16, 64) training
step 0.89x cuDNN's time where the Python form made it 0.99x (docs/kernel-log.md, step 55).
"""

from __future__ import annotations

import os

import torch

from ..jit import driver, host
from ..jit.params import FwdParams, FwdTmaParams
from ..spec import AttentionSpec
from . import backward, forward, training
from . import trace as _trace
from .plans import Launch, PlanCache, launch_fields, segment_count, segment_lengths
from .query_tiles import query_tiles
from .select import NoKernel
from .tensors import strides_usable

__all__ = [
    "ENV",
    "MODE",
    "PLAIN_NUMBERS",
    "WHOLE_PATH",
    "NativeRepeatCall",
    "RepeatCall",
    "clear",
    "first_call",
    "lookup",
    "prepare",
    "remember",
    "bound_layout",
    "signature",
]

ENV = "FLASH_ATTENTION_REPEAT_CALLS"
#: "native", "python" or "off" (the module docstring); the tests switch it by assignment.
MODE = {"0": "off", "python": "python"}.get(os.environ.get(ENV, "native"), "native")

#: Types a plain option may have in a signature: anything else (a numpy scalar, a tensor) takes the whole
#: path, whose checks accept or reject it (``True == 1 == 1.0`` would make them equal keys otherwise).
PLAIN_NUMBERS = (float, int)
_STRIDED = torch.strided


class RepeatCall:
    """One signature's launch: the forward plan, the shape of the LSE to allocate (None: the call returns
    none and the kernel writes none), the output's shape where v's head_dim is its own (None: q's shape;
    the signature fixes both) and, in training, the backward plan whose program the node runs (held here:
    the node is recorded by the program's address, which must outlive the plan cache's eviction)."""

    __slots__ = ("_backward", "_host_ops", "_lse_shape", "_out_shape", "_plan", "_program")

    def __init__(self, plan, lse_shape: tuple[int, int, int] | None, backward_plan=None, host_ops=None,
                 program: int = 0, out_shape: tuple[int, int, int, int] | None = None):  # fmt: skip
        self._plan, self._lse_shape, self._host_ops = plan, lse_shape, host_ops
        self._backward, self._program, self._out_shape = backward_plan, program, out_shape

    def __call__(self, q, k, v, key_range, alibi_slopes=None, sinks=None, segments=None):
        """``(out, lse)``, or None when this call must take the whole path (a misaligned address: the whole
        path copies such a tensor; the debug build asked for by the environment). ``alibi_slopes``,
        ``sinks`` and a packed batch's runs (``segments``): the call's, of the layouts its signature holds."""
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 or _trace.ENV in os.environ:
            return None
        if self._out_shape is None:
            # empty_like with an explicit format: contiguous whatever q's strides (the plan's output strides).
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
        else:  # (v's own head_dim, inference only: contiguous, the shape made once)
            o = q.new_empty(self._out_shape)
        lse = None if self._lse_shape is None else q.new_empty(self._lse_shape, dtype=torch.float32)
        forward.launch_plan(self._plan, q, k, v, o, lse, key_range, 0, alibi_slopes, sinks, segments)
        if self._program:
            bound = training.bound(alibi_slopes, segments, self._backward)
            rows = training.sink_rows(sinks, segments, self._backward)
            self._host_ops.record_training(q, k, v, o, lse, key_range, 0, self._program, bound, sinks, rows)
        return o, lse


class NativeRepeatCall:
    """:class:`RepeatCall` as one op of the host library: ``program`` is its ForwardProgram (kept alive here),
    which holds the forward plan's params, launch and tensor-map layouts and, in training, the node's
    backward program."""

    __slots__ = ("_address", "_backward", "_counter", "_lib", "_program", "_q_tiles")

    def __init__(self, lib, program, q_tiles=None, counter=False, backward_plan=None):
        """``q_tiles``: for a packed batch's plan, its query-tile height (0: no tile table); else None.
        ``counter``: the plan's persistent grid takes the current stream's tile counter. ``backward_plan``:
        in training, the node's (whose key tiles a packed batch binds)."""
        self._lib, self._program, self._address = lib, program, program.address()
        self._q_tiles, self._counter, self._backward = q_tiles, counter, backward_plan

    def __call__(self, q, k, v, key_range, alibi_slopes=None, sinks=None, segments=None):
        """``(out, lse)``, or None when this call must take the whole path (as RepeatCall's)."""
        if _trace.ENV in os.environ:
            return None
        if alibi_slopes is None and sinks is None and segments is None and not self._counter:
            result = self._lib.repeat_call(q, k, v, key_range, self._address)
        else:
            # (the program's bound offsets: the slopes', the sinks', a packed batch's runs and its
            # query-tile table, then a persistent grid's tile counter, as _native lists them; the node's,
            # in training: the slopes, then a packed batch's runs and its backward tables,
            # training.bound_fields)
            slopes = [] if alibi_slopes is None else [alibi_slopes]
            bound = [*slopes] if sinks is None else [*slopes, sinks]  # (a list of its own: appended below)
            node, node_sinks, rows = slopes, None, None
            if self._backward is not None:  # (training: the node's bound tensors and the sinks it takes)
                node = training.bound(alibi_slopes, segments, self._backward)
                node_sinks, rows = sinks, training.sink_rows(sinks, segments, self._backward)
            if segments is not None:
                bound = [*bound, *segments]
                if self._q_tiles:  # (made once per runs, held by them: launch_plan's)
                    bound.append(query_tiles(segments, self._q_tiles))
            if self._counter:  # (as the whole path's launch: the stream's own, fresh while captured)
                bound.append(forward.stream_tile_counter(q.device))
            result = self._lib.repeat_call_bound(
                q, k, v, key_range, bound, node, self._address, node_sinks, rows
            )
        if not result:
            return None  # a misaligned address
        return result[0], (result[1] if len(result) == 2 else None)


# The FwdParams pointer fields the host library writes, in the order of repeat_call.cpp's ForwardSlot enum.
_FORWARD_SLOTS = ("q", "k", "v", "o", "lse", "key_range")


def _native(
    lib, plan, lse_shape, program: int, alibi=None, sinks=False, packed=0, backward_plan=None
) -> NativeRepeatCall:
    """The host library's form of a repeat call of ``plan`` (``program``: the node's, 0 for inference, made
    from ``backward_plan``;
    ``alibi``: ALiBi's slopes' stride between batch rows, or None without ALiBi; ``sinks``: whether the call
    binds sinks; ``packed``: how many tensors a packed batch's segments are (0: none; 2: the runs; 3: and
    the ALiBi diagonals), bound with the query-tile table if the plan has one)."""
    base = 0 if plan.maps is None else FwdTmaParams.p.offset
    offsets = [base + getattr(FwdParams, name).offset for name in _FORWARD_SLOTS]
    bound = [name for name, on in (("alibi_slopes", alibi is not None), ("sinks", sinks)) if on]
    if packed:
        bound += ["row_keys", "key_rows", "alibi_diagonal"][:packed] + (["q_tiles"] if plan.q_tiles else [])
    bound_offsets = [base + getattr(FwdParams, name).offset for name in bound]
    if plan.tile_counter:  # (a field of the TMA params, beside FwdParams)
        bound_offsets.append(FwdTmaParams.tile_counter.offset)
    template = plan.template
    if alibi is not None:  # (a field of the params, set per call by the whole path's bind_alibi)
        made = (FwdTmaParams if plan.maps is not None else FwdParams).from_buffer_copy(template)
        (made.p if plan.maps is not None else made).alibi_batch_stride = alibi
        template = bytes(made)
    maps = []
    if plan.maps is not None:
        for name, layout in zip(("q_map", "k_map", "v_map", "o_map"), plan.maps, strict=False):
            maps += [getattr(FwdTmaParams, name).offset, *layout.dims, *layout.strides, *layout.box]
    forward_program = torch.classes.flash_attention_host.ForwardProgram(
        torch.frombuffer(bytearray(template), dtype=torch.uint8),
        offsets,
        launch_fields([Launch(plan.kernel, plan.grid, plan.threads, plan.smem)]),
        plan.kernel.name,
        driver.primary_context(plan.index),
        list(lse_shape or ()),
        maps,
        list(driver.TENSOR_MAP_ENCODE_FLAGS),
        program,
        bound_offsets,
    )
    return NativeRepeatCall(
        lib, forward_program, plan.q_tiles if packed else None, bool(plan.tile_counter), backward_plan
    )


#: What :func:`lookup` gives for a signature whose calls take the whole path every time (the module
#: docstring says which).
WHOLE_PATH = object()

_calls: PlanCache[object] = PlanCache()
# A repeat call holds a forward plan and a backward plan's program: it goes when they go (a tuned-winners
# table changed; a test's stand-in for a device fact).
forward.derive_from_plans(_calls)
backward.derive_from_plans(_calls)


def clear() -> None:
    """Forget every signature (with the plans they hold: after a tuned-winners table changed)."""
    _calls.clear()


# Signatures first seen while the host library was being built in the background kept the Python form (or,
# recording, the whole path): forgotten once it is loaded, so their next calls make the native one.
host.when_ready(clear)


def signature(
    q, k, v, causal, softmax_scale, return_lse, key_range, deterministic, dropout_p, dropout_seed,
    window=None, alibi_slopes=None, sinks=None, segments=None, score_values=(),
):  # fmt: skip
    """The key of a call that may repeat an earlier one's launch, or None for a call that takes the whole path
    (dropout, a caller's ``out``, torch.compile, arguments of types the checks must see). Raises nothing: an
    argument without the attributes read here (not a tensor, a sparse tensor) gives None. ``window``,
    ``alibi_slopes``, ``sinks`` and the scalar score functions' ``score_values``, (name, value) pairs, as
    attention() takes them (a tuple or list of two ints, tensors: sinks only as the kernels read them,
    float32 and contiguous; floats or ints; a pair tuple, not keywords: this runs on every call);
    ``segments``, a packed batch's runs (flash_attention.api.varlen): the signature holds their layouts and
    what the plans are chosen by (the sequences' typical lengths and their count's bucket), and each call
    binds its own runs and tile tables."""
    if (
        MODE == "off"
        or dropout_seed is not None
        or type(dropout_p) not in PLAIN_NUMBERS
        or dropout_p != 0
        or type(causal) is not bool
        or type(deterministic) is not bool
        or (softmax_scale is not None and type(softmax_scale) is not float)
        or torch.compiler.is_compiling()
    ):
        return None
    if window is not None:
        # (as spec.validate.check_window reads it: a tuple and a list of the same ints are the same window)
        if type(window) not in (tuple, list) or len(window) != 2 or any(type(w) is not int for w in window):
            return None
        window = tuple(window)
    try:
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return None
        if q.layout is not _STRIDED or k.layout is not _STRIDED or v.layout is not _STRIDED:
            return None  # (a sparse tensor reads as strides of zeros)
        scores = ()
        for name, value in score_values:  # (a loop, not generators: this runs on every call)
            if type(value) not in PLAIN_NUMBERS:
                return None
            if value:
                scores += ((name, float(value)),)  # (float: an int too large for one overflows, below)
        differentiated = q.requires_grad or k.requires_grad or v.requires_grad
        records = torch.is_grad_enabled() and (differentiated or (sinks is not None and sinks.requires_grad))
        variant = None if window is None and not scores else (window, scores)
        if alibi_slopes is not None or sinks is not None:
            variant = (variant, bound_layout(alibi_slopes), bound_layout(sinks))
            if False in variant[1:]:
                return None
            if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
                return None  # converted per call by the whole path
        packed = None
        if segments is not None:
            if type(segments) is not tuple or len(segments) not in (2, 3):
                return None
            layouts = tuple(bound_layout(t) for t in segments)  # (the runs, and any table of diagonals)
            if False in layouts:
                return None
            packed = (layouts, segment_lengths(segments), segment_count(segments))
        if key_range is None:
            ranged = None
        elif type(key_range) is torch.Tensor:
            ranged = (key_range.shape, key_range.stride(), key_range.dtype, key_range.device)
        else:
            return None
        return (
            q.shape, q.stride(), q.dtype, q.device,
            k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device,
            causal, softmax_scale, not return_lse, ranged, records,
            # The backward's mode (training only): the argument or PyTorch's deterministic switch.
            records and (deterministic or torch.are_deterministic_algorithms_enabled()),
            variant, packed,
        )  # fmt: skip
    except (AttributeError, RuntimeError, TypeError, OverflowError):  # (Overflow: an int cap past a float)
        return None


def bound_layout(t) -> tuple | None | bool:
    """A bound tensor's part of a signature: None for none, False for an argument the checks must see."""
    if t is None:
        return None
    if type(t) is not torch.Tensor or t.layout is not _STRIDED:
        return False
    return (t.shape, t.stride(), t.dtype, t.device)


def lookup(key) -> RepeatCall | NativeRepeatCall | object | None:
    """The repeat call of ``key``, :data:`WHOLE_PATH`, or None for a signature not seen yet."""
    return _calls.find(key)


def remember(key, call: RepeatCall | NativeRepeatCall | None) -> None:
    """Keep ``call`` for ``key`` (None: calls of ``key`` take the whole path)."""
    _calls.get(key, lambda: WHOLE_PATH if call is None else call)


def first_call(key, backend, q, k, v, spec: AttentionSpec, **options):
    """The first call of signature ``key``, validated (``spec``: its options; ``options``: prepare's keyword
    arguments, the call's tensors and how it runs): make its repeat call, keep it (or keep that it has
    none) and run it; None when the whole path must run this call. ``backend`` is the launch layer the call
    would run on (None: the fallback's); it makes the repeat call with its ``prepare_repeat`` (the CPU tests'
    stand-in launch layers have none, so their calls take the whole path)."""
    make = getattr(backend, "prepare_repeat", None)
    if make is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        # The plan encodes its tensor maps on this call's addresses, which the driver refuses unless 16-byte
        # aligned: this call takes the whole path (which copies), and the signature's next call, usually
        # aligned, makes the repeat call. Remembering nothing keeps the signature open for it.
        return None
    call = None
    if make is not None:
        try:
            call = make(q, k, v, spec, **options)
        except NoKernel:
            call = None  # the whole path falls back, with its warning
    remember(key, call)
    if call is None:
        return None
    return call(
        q,
        k,
        v,
        options["key_range"],
        options.get("alibi_slopes"),
        options.get("sinks"),
        options.get("segments"),
    )


def prepare(
    q, k, v, spec: AttentionSpec, *, key_range, records: bool, return_lse, alibi_slopes=None, sinks=None,
    segments=None,
):  # fmt: skip
    """The repeat call of a validated call of ``spec`` (attention()'s, built by its checks) that the kernels
    run (the caller decided that), or None when its calls cannot be a plain launch. Raises what planning
    raises (``NoKernel``: the whole path then falls back, with its warning). The call's tensors
    (``key_range``, ``alibi_slopes``, ``sinks``, a packed batch's runs ``segments``) are bound per call; the
    plans are those ops.cuda_forward and, in training, ops.training.training_forward make."""
    if q.shape[3] % 8 or v.shape[3] % 8:
        return None  # zero-padded inputs (v to its own multiple of 8): the whole path makes them
    if not (strides_usable(q) and strides_usable(k) and strides_usable(v)):
        return None  # copied inputs: the whole path makes them
    out_shape = (*q.shape[:3], v.shape[3]) if v.shape[3] != q.shape[3] else None  # (None: q's)
    bwd_config = None
    if out_shape is not None and records:
        # v's own head_dim in training: the node runs the backward kernel reading it, where there is one;
        # else the whole path runs the backward's on v, out and dO padded to q's head_dim (ops.cuda_backward).
        bwd_config = backward.value_dim_config(q, v.shape[3], spec.causal, spec.dropout_p, spec.deterministic)
        if bwd_config is None:
            return None
    if key_range is not None and (key_range.dtype != torch.int32 or not key_range.is_contiguous()):
        return None  # converted per call by the whole path
    host_ops = host.ops_or_none() if records else None
    if records and host_ops is None:
        return None  # the Python autograd function's path
    # The output as each repeat allocates it (the plan holds its strides): contiguous, of v's head_dim.
    if out_shape is None:
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        o = q.new_empty(out_shape)
    lengths, sequences = segment_lengths(segments), segment_count(segments)
    plan = forward.plan_for(q, k, v, o, spec, None, lengths, sequences)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    # ALiBi's slopes: their stride between batch rows (0: one (heads,) table), as plans.bind_alibi sets it.
    alibi = None if alibi_slopes is None else (alibi_slopes.shape[-1] if alibi_slopes.dim() == 2 else 0)
    bwd, program = None, 0
    if records:
        lse = q.new_empty(lse_shape, dtype=torch.float32)
        # As training.training_forward: the backward reads dO laid out as out, so the plan is out's; the
        # node binds the slopes.
        bwd = backward.plan_for(q, k, v, o, o, lse, spec, bwd_config, lengths, sequences)
        program = training.program(bwd, training.bound_fields(alibi is not None, segments, bwd), alibi or 0)
    elif not return_lse:
        lse_shape = None
    if MODE == "native":
        lib = host_ops or host.ops_or_none()
        if lib is not None:
            # (The ForwardProgram takes its own reference to the backward program.)
            packed = 0 if segments is None else len(segments)
            return _native(lib, plan, lse_shape, program, alibi, sinks is not None, packed, bwd)
    return RepeatCall(plan, lse_shape, bwd, host_ops, program, out_shape)
