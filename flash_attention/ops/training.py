"""Eager training calls on the compiled autograd node (``csrc/host/training_node.cpp``).

:func:`training_forward` runs the forward launch (:func:`.forward.cuda_forward`, as inference does) and hands
the output to the host library's ``record_training``, which makes it the output of a C++ autograd node over
q, k and v. That node's backward allocates the gradients and queues the backward plan's launches without
Python: a Python ``autograd.Function`` cost more host time per step than cuDNN's whole step at small shapes
(docs/kernel-log.md, steps 23, 25 and 44). The plan is :mod:`.backward`'s, handed to the node once per
signature as a ``BackwardProgram``.

Calls the node does not take return None, and the caller uses the Python autograd function
(``torch_ops.attention.EagerAttention``), which computes the same thing: inputs the kernels cannot read in
place (a copy would need its own autograd history), a head_dim that is not a multiple of 8 (padded through
autograd ops), v's own head_dim where no backward kernel reads it (ops.cuda_backward pads v, the output and
dO to q's; the node runs :func:`.backward.value_dim_config`'s kernel where there is one), the debug build,
and a machine without the host library (no C++ compiler; warned once).
A variant's pointer fields, ALiBi's slopes and a packed batch's runs, are the program's bound offsets: each
call binds its tensors there (record_training's ``bound``), so one program serves every call of its
signature. Attention sinks are an input of the node: it computes their gradient from the preprocessing
kernel's D rows after the backward's launches (:mod:`flash_attention.sinks` gives the formula).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..dropout import dropout_key, seed_pair
from ..jit import driver, host
from ..jit.params import BwdParams, BwdTmaParams
from ..spec import AttentionSpec
from . import backward
from . import trace as _trace
from .plans import launch_fields, launch_spec, segment_count, segment_lengths
from .query_tiles import key_tiles, query_units, workspace_rows
from .tensors import padded_to_8, usable_in_place

__all__ = [
    "ALIBI_FIELDS", "bound", "bound_fields", "prefetch_backward", "program", "sink_rows", "training_forward",
]  # fmt: skip

# The BwdParams fields the node writes per call, in the order of training_node.h's Slot enum.
_SLOTS = (
    "q", "k", "v", "o", "dout", "lse", "lse_log2", "delta", "dq_accum", "dq", "dk", "dv", "key_range",
    "dropout_key",
)  # fmt: skip
_OFFSETS = [getattr(BwdParams, name).offset for name in _SLOTS]


#: The BwdParams pointer fields a call's variant binds (``bound``, in this order): ALiBi's slopes, then a
#: packed batch's segments (its runs, and each row's ALiBi diagonal where they carry one), then its key
#: tiles and workspace units, where the plan has them: "k_tiles", "q_units".
ALIBI_FIELDS = ("alibi_slopes",)
_SEGMENT_FIELDS = ("row_keys", "key_rows", "alibi_diagonal")


def program(plan, bound_fields: tuple[str, ...] = (), alibi_batch_stride: int = 0) -> int:
    """The address of the node's BackwardProgram of a backward plan (made once per plan and set of bound
    fields, which the plan keeps): ``bound_fields`` the BwdParams pointers each call binds a tensor to,
    ``alibi_batch_stride`` the slopes' stride between batch rows (0: one (heads,) table), a field of the
    params the program carries."""
    key = (bound_fields, alibi_batch_stride)
    for made_key, _, address in plan.host_program:
        if made_key == key:
            return address
    # Made once per key and kept with the plan (whose repeat calls hold these addresses).
    fields = launch_fields(plan.launches)
    names = [launch.kernel.name for launch in plan.launches]
    args, params = backward.plan_params(plan)
    params.alibi_batch_stride = alibi_batch_stride
    template = torch.frombuffer(bytearray(args), dtype=torch.uint8)
    maps = []  # (tma_loads: q's and dO's map layouts, which the node encodes on each call's addresses)
    if plan.maps is not None:
        for name, layout in zip(("q_map", "do_map"), plan.maps, strict=True):
            maps += [getattr(BwdTmaParams, name).offset, *layout.dims, *layout.strides, *layout.box]
    made = torch.classes.flash_attention_host.BackwardProgram(
        template,
        _OFFSETS,
        fields,
        "\n".join(names),
        plan.stats,
        plan.accum,
        driver.primary_context(plan.index),
        [getattr(BwdParams, name).offset for name in bound_fields],
        maps,
        list(driver.TENSOR_MAP_ENCODE_FLAGS) if maps else [],
    )
    plan.host_program.append((key, made, made.address()))
    return plan.host_program[-1][2]


def training_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    key_range: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: torch.Tensor | None,
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    window: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, ...] | None = None,
    **score_values: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` of the forward launch ``forward`` (the launch layer's ``cuda_forward``, as the caller's
    backend has it) with ``out``'s gradient recorded by the compiled node (and the ``sinks``' gradient, where
    the call has them), or None when the node does not take this call (the module docstring says which)."""
    if q.shape[3] % 8 or _trace.ENV in os.environ:
        return None
    # v's own head_dim: the node runs the kernel reading it where there is one (backward.value_dim_config);
    # else ops.cuda_backward pads v, out and dO to q's, which the node does not.
    config = None
    if v.shape[3] != q.shape[3]:
        config = backward.value_dim_config(q, v.shape[3], causal, dropout_p, deterministic)
        if config is None:
            return None
    if not (usable_in_place(q) and usable_in_place(k) and usable_in_place(v)):
        return None
    lib = host.ops_or_none()
    if lib is None:
        return None
    if key_range is not None:  # converted once: the forward reads it, the node keeps it for the backward
        key_range = key_range.to(device=q.device, dtype=torch.int32).contiguous()
    out, lse = forward(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=True,
        out=None,
        key_range=key_range,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        window=window,
        **{name: value for name, value in score_values.items() if value},
        **({"alibi_slopes": alibi_slopes} if alibi_slopes is not None else {}),
        **({"sinks": sinks} if sinks is not None else {}),
        **({"segments": segments} if segments is not None else {}),
    )
    # The backward reads dO laid out as out (the node copies any other layout), so the plan is out's; the
    # window's bounds travel in the plan's parameters, the variant's tensors are bound per call.
    spec = launch_spec(
        q, causal, softmax_scale, window, alibi_slopes, key_range, dropout_p, deterministic, sinks, segments,
        **score_values,
    )  # fmt: skip
    plan = backward.plan_for(
        q, k, v, out, out, lse, spec, config, segment_lengths(segments), segment_count(segments)
    )
    stride = 0 if alibi_slopes is None else (alibi_slopes.shape[-1] if alibi_slopes.dim() == 2 else 0)
    fields = bound_fields(alibi_slopes is not None, segments, plan)
    key = dropout_key(*seed_pair(dropout_seed)) if dropout_p else 0
    lib.record_training(
        q, k, v, out, lse, key_range, key, program(plan, fields, stride), bound(alibi_slopes, segments, plan),
        sinks, sink_rows(sinks, segments, plan),
    )  # fmt: skip
    return out, lse


#: The training calls whose backward prefetch_backward has started already (a set of call shapes, bounded).
_prefetched: set = set()


def prefetch_backward(q, k, spec: AttentionSpec, segments=None, value_dim=None) -> None:
    """Start compiling the backward kernels of a training call of ``spec`` (ops.backward.prefetch) before its
    forward runs, whichever path records it (the compiled node, a repeat call, the Python autograd function):
    a first training step then waits for the longer of its two compiles, not their sum. Once per call shape
    and spec; nothing when the kernels are in the cache already. ``segments``: a packed batch's runs (the
    sequences' lengths choose its configurations: those of its first call); ``value_dim``: v's head_dim."""
    seen = (q.shape, k.shape, value_dim, q.dtype, q.device, spec)
    if seen in _prefetched:
        return
    if len(_prefetched) > 4096:
        _prefetched.clear()
    _prefetched.add(seen)
    # (head_dim: the kernels run on copies padded to a multiple of 8)
    backward.prefetch(
        q, k, spec, segment_lengths(segments), head_dim=padded_to_8(q.shape[3]), value_dim=value_dim
    )


def bound_fields(alibi: bool, segments, plan) -> tuple[str, ...]:
    """The BwdParams pointers a call of ``plan`` binds per call (:func:`bound` gives the tensors, in this
    order): ALiBi's slopes, a packed batch's segments (its runs, and each row's ALiBi diagonal where they
    carry one), and the plan's key tiles and workspace units."""
    fields = ALIBI_FIELDS if alibi else ()
    if segments is not None:
        fields += _SEGMENT_FIELDS[: len(segments)] + (("k_tiles", "q_units") if plan.k_tiles else ())
    return fields


def sink_rows(sinks, segments, plan) -> torch.Tensor | None:
    """The node's ``sink_rows`` for a call with ``sinks``: where the backward's workspace holds each packed
    row's D (a packed batch whose plan lays its workspace out by sequence, ``plan.k_tiles``); None where
    row i is row i, or without sinks."""
    return workspace_rows(segments) if sinks is not None and plan.k_tiles else None


def bound(alibi_slopes, segments, plan) -> list[torch.Tensor]:
    """The tensors of :func:`bound_fields`, for this call: the tables are made once per runs (held by them,
    so a repeat of the same batch makes none)."""
    tensors = [] if alibi_slopes is None else [alibi_slopes]
    if segments is not None:
        tensors += list(segments)
        if plan.k_tiles:
            tensors += [key_tiles(segments, plan.k_tiles), query_units(segments)]
    return tensors
