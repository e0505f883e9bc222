"""The ``torch.library`` custom ops that make :func:`flash_attention.attention` differentiable and compilable.

* ``flash_attention::fwd(q, k, v, options, values, key_range?, dropout_seed?, alibi_slopes?, row_keys?,
  key_rows?, alibi_diagonal?, sinks?) -> (out, lse)``
* ``flash_attention::bwd(dout, q, k, v, out, lse, options, values, key_range?, dropout_seed?, alibi_slopes?,
  row_keys?, key_rows?, alibi_diagonal?) -> (dq, dk, dv)``

``options`` and ``values`` are a call's numbers packed (:class:`flash_attention.spec.OpOptions`: causal,
scale, deterministic, dropout_p, the window, the soft-cap): a variant that adds an option adds it there, not
to two schemas and every function between them. The tensors travel beside them: ``row_keys``, ``key_rows``
and ``alibi_diagonal`` are a packed batch's segments (flash_attention.api.varlen), and ``dropout_seed`` is
the 2-element int64 CPU tensor of :func:`flash_attention.dropout.draw_seed`; the forward saves it, so the
backward regenerates the forward's keep mask.

Each has a fake (meta) implementation, so ``torch.compile`` traces a call as one opaque node without running
it; a CUDA implementation that runs our kernels (``ops.cuda_forward`` / ``ops.cuda_backward``) and falls back
to PyTorch when they cannot run on the inputs (float32, an old GPU, no compiler); and an implementation for
every other device that is the PyTorch fallback (:func:`flash_attention.fallback.forward` and
:func:`flash_attention.fallback.backward`: PyTorch's fused CPU kernel where it computes our semantics, else
the chunked path of :mod:`flash_attention.fallback.reference`). ``fwd`` has an autograd formula that calls
``bwd``.

Conventions of both ops: the arguments were validated by :func:`flash_attention.spec.validate.validate`
(shapes, dtypes, last dimension contiguous); ``scale`` is resolved (never None). ``deterministic``
changes nothing in the forward: it rides on ``fwd`` so that autograd's saved context carries it to
``bwd``. Outputs are new
contiguous tensors (``out`` and dq/dk/dv with the shapes and dtypes of q, k, v; ``lse`` float32 (batch,
heads_q, seqlen_q)), never views of an input, as custom ops require. ``lse`` is not differentiable:
gradients flow through ``out`` only (as in the FlashAttention library); a loss that uses the LSE gets no
gradient from it.

The CUDA implementations take the kernel-or-fallback decision of :mod:`flash_attention.ops.dispatch`, with
its once-per-reason warning.
"""

from __future__ import annotations

import torch

from .. import fallback
from ..ops import dispatch
from ..sinks import apply_sinks, sinks_gradient
from ..spec import OpOptions, launch_variants

__all__ = ["fwd", "bwd", "EagerAttention", "eager_training"]

# Schemas are spelled out rather than inferred from annotations: inference of ``Tensor | None`` and of
# postponed (string) annotations differs between the torch versions we support.
_TENSORS = (
    "Tensor? key_range=None, Tensor? dropout_seed=None, Tensor? alibi_slopes=None, Tensor? row_keys=None,"
    " Tensor? key_rows=None, Tensor? alibi_diagonal=None"
)
_FWD_SCHEMA = (
    f"(Tensor q, Tensor k, Tensor v, int[] options, float[] values, {_TENSORS}, Tensor? sinks=None)"
    " -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, int[] options, float[] values,"
    f" {_TENSORS}, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
)


def _has_no_pair(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when no (query, key) pair exists: nothing to launch, the fallback returns the answer at once."""
    return q.numel() == 0 or k.shape[1] == 0


def _variants(opt: OpOptions, alibi_slopes, row_keys=None, key_rows=None, alibi_diagonal=None) -> dict:
    """The launch layer's keywords of the op's variants (spec.launch_variants); ``row_keys``, ``key_rows``
    and ``alibi_diagonal`` (None, or each row's ALiBi diagonal): a packed batch's segments."""
    segments = None
    if row_keys is not None:
        segments = (row_keys, key_rows) + (() if alibi_diagonal is None else (alibi_diagonal,))
    return launch_variants(opt.window, alibi_slopes, segments, **opt.score_values)


def _fallback_spec(opt: OpOptions, key_range, alibi_slopes, row_keys, alibi_diagonal, sinks=None):
    """The spec of an op call, for the PyTorch path (OpOptions.attention_spec, with what the tensors say)."""
    segments = 0 if row_keys is None else 2 + (alibi_diagonal is not None)
    return opt.attention_spec(
        ranged=key_range is not None,
        alibi=alibi_slopes is not None,
        sinks=sinks is not None,
        segments=segments,
    )


def _fallback_forward(
    q, k, v, opt: OpOptions, key_range=None, dropout_seed=None, alibi_slopes=None, row_keys=None,
    key_rows=None, alibi_diagonal=None, sinks=None,
):  # fmt: skip
    """The forward op's PyTorch path (every device, and CUDA inputs the kernels cannot take); a packed batch's
    runs go to it as each row's keys (``row_keys``); sinks rescale its result (the kernels join them in their
    epilogue; :mod:`flash_attention.sinks` says why the two agree)."""
    spec = _fallback_spec(opt, key_range, alibi_slopes, row_keys, alibi_diagonal, sinks)
    out, lse = fallback.forward(
        q, k, v, spec, return_lse=True, key_range=key_range, dropout_seed=dropout_seed,
        alibi_slopes=alibi_slopes, alibi_diagonal=alibi_diagonal, row_keys=row_keys,
    )  # fmt: skip
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


def _fallback_backward(
    dout, q, k, v, out, lse, opt: OpOptions, key_range=None, dropout_seed=None, alibi_slopes=None,
    row_keys=None, key_rows=None, alibi_diagonal=None, sinks=None,
):  # fmt: skip
    """The backward op's PyTorch path (segments as in :func:`_fallback_forward`; ``sinks``: the forward's,
    which ``out`` and ``lse`` include)."""
    spec = _fallback_spec(opt, key_range, alibi_slopes, row_keys, alibi_diagonal, sinks)
    return fallback.backward(
        dout, q, k, v, out, lse, spec, key_range=key_range, dropout_seed=dropout_seed,
        alibi_slopes=alibi_slopes, alibi_diagonal=alibi_diagonal, row_keys=row_keys, sinks=sinks,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# flash_attention::fwd


@torch.library.custom_op("flash_attention::fwd", mutates_args=(), schema=_FWD_SCHEMA)
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: list[int],
    values: list[float],
    key_range: torch.Tensor | None = None,
    dropout_seed: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    key_rows: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any device but CUDA: the PyTorch fallback."""
    opt = OpOptions.unpack(options, values)
    return _fallback_forward(q, k, v, opt, key_range, dropout_seed, alibi_slopes, row_keys, key_rows,
                             alibi_diagonal, sinks)  # fmt: skip


@fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, options, values, *tensors):
    return forward_impl(q, k, v, OpOptions.unpack(options, values), *tensors)


def forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    opt: OpOptions,
    key_range: torch.Tensor | None = None,
    dropout_seed: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    key_rows: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fwd`` on CUDA: our kernel when it can run on these inputs, else the PyTorch fallback."""
    tensors = (key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal, sinks)
    ops = None if _has_no_pair(q, k) else dispatch.kernel_backend(q)

    def fallback_forward():
        return _fallback_forward(q, k, v, opt, *tensors)

    if ops is None:
        return fallback_forward()
    return dispatch.run_or_fallback(
        lambda: ops.cuda_forward(
            q,
            k,
            v,
            causal=opt.causal,
            softmax_scale=opt.scale,
            return_lse=True,
            out=None,
            config=None,
            key_range=key_range,
            dropout_p=opt.dropout_p,
            dropout_seed=dropout_seed,
            **_variants(opt, alibi_slopes, row_keys, key_rows, alibi_diagonal),
            **({} if sinks is None else {"sinks": sinks}),
        ),
        fallback_forward,
    )


@fwd.register_fake
def _fwd_fake(q, k, v, options, values, *tensors):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # contiguous, like the kernel's and the fallback's output
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


#: The op's inputs: the index of ``sinks`` (the one optional input with a gradient), after q, k, v,
#: options, values and the six other optional tensors.
_SINKS_INPUT = 11


def _fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, options, values, *tensors = inputs
    key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal, sinks = [
        *tensors,
        *(None,) * (7 - len(tensors)),
    ]
    out, lse = output
    # (out and lse with the sinks applied: the backward kernels are exact on them, sinks.py says why.)
    ctx.save_for_backward(
        q, k, v, out, lse, key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal, sinks
    )
    ctx.options, ctx.values = list(options), list(values)
    ctx.mark_non_differentiable(lse)


def _backward_args(ctx, dout) -> tuple:
    """The arguments of ``bwd`` from what :func:`_fwd_setup_context` saved."""
    q, k, v, out, lse, key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal, sinks = (
        ctx.saved_tensors
    )
    return (dout, q, k, v, out, lse, ctx.options, ctx.values, key_range, dropout_seed, alibi_slopes,
            row_keys, key_rows, alibi_diagonal, sinks)  # fmt: skip


def _needs_sinks_grad(ctx) -> bool:
    return len(ctx.needs_input_grad) > _SINKS_INPUT and ctx.needs_input_grad[_SINKS_INPUT]


def _sinks_grad(ctx, dout) -> torch.Tensor | None:
    """The sinks' gradient, where the forward had sinks that require one."""
    if not _needs_sinks_grad(ctx):
        return None
    _, _, _, out, lse, *_, sinks = ctx.saved_tensors
    return sinks_gradient(dout, out, lse, sinks)


def _no_grads(ctx) -> tuple:
    """None for every input after q, k, v but the sinks (whose gradient the caller puts in place)."""
    return (None,) * (len(ctx.needs_input_grad) - 3)


def _fwd_backward(ctx, dout, dlse):
    # dlse is ignored: lse is marked non-differentiable, so it never carries a gradient.
    dq, dk, dv = torch.ops.flash_attention.bwd(*_backward_args(ctx, dout))
    rest = list(_no_grads(ctx))
    if _needs_sinks_grad(ctx):
        rest[_SINKS_INPUT - 3] = _sinks_grad(ctx, dout)
    return (dq, dk, dv, *rest)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------------------
# flash_attention::bwd


@torch.library.custom_op("flash_attention::bwd", mutates_args=(), schema=_BWD_SCHEMA)
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: list[int],
    values: list[float],
    key_range: torch.Tensor | None = None,
    dropout_seed: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    key_rows: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any device but CUDA: the PyTorch fallback (deterministic on CPU by construction). ``sinks``: the
    forward's, which ``out`` and ``lse`` include (their gradient is the caller's: sinks.sinks_gradient)."""
    opt = OpOptions.unpack(options, values)
    return _fallback_backward(dout, q, k, v, out, lse, opt, key_range, dropout_seed, alibi_slopes, row_keys,
                              key_rows, alibi_diagonal, sinks)  # fmt: skip


@bwd.register_kernel("cuda")
def _bwd_cuda(dout, q, k, v, out, lse, options, values, *tensors):
    return backward_impl(dout, q, k, v, out, lse, OpOptions.unpack(options, values), *tensors)


def backward_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    opt: OpOptions,
    key_range: torch.Tensor | None = None,
    dropout_seed: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    key_rows: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    sinks_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``bwd`` on CUDA: our backward kernels when they can run on these inputs, else the PyTorch fallback.
    ``sinks``: the forward's (``out`` and ``lse`` include them); with ``sinks_grad`` (the eager path's sinks
    that need a gradient) a fourth tensor, the sinks' gradient."""
    tensors = (key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal)
    ops = None if _has_no_pair(q, k) else dispatch.kernel_backend(q)

    def fallback_backward():
        grads = _fallback_backward(dout, q, k, v, out, lse, opt, *tensors, sinks)
        return (*grads, sinks_gradient(dout, out, lse, sinks)) if sinks_grad else grads

    if ops is None:
        return fallback_backward()
    # Autograd hands over whatever layout the next op produced, e.g. a stride-0 expand for out.sum();
    # the kernels read dO in 16-byte vectors along head_dim, as they read q.
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return dispatch.run_or_fallback(
        lambda: ops.cuda_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            causal=opt.causal,
            softmax_scale=opt.scale,
            deterministic=opt.deterministic,
            key_range=key_range,
            dropout_p=opt.dropout_p,
            dropout_seed=dropout_seed,
            **_variants(opt, alibi_slopes, row_keys, key_rows, alibi_diagonal),
            **({"sinks": sinks} if sinks_grad else {}),  # (the kernels need none without its gradient)
        ),
        fallback_backward,
    )


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, options, values, *tensors):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---------------------------------------------------------------------------------------------------------
# The eager training path


class EagerAttention(torch.autograd.Function):
    """``fwd`` and its backward for eager autograd, without the custom-op dispatch.

    The same implementations as the two ops (our kernels on CUDA, the PyTorch fallback elsewhere), called
    directly: on torch 2.11 a custom op's Python dispatch (argument defaults, aliasing checks, the
    dynamo-disable wrapper) cost about 0.6 ms per call in a profile of a training step on an H100, more than
    the kernels themselves at 1k tokens. torch.compile still sees the ops (api.attention._attention_op routes
    traced calls to them), so graphs keep their single fwd / bwd nodes. Its inputs are ``fwd``'s.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, options, values, key_range=None, dropout_seed=None, alibi_slopes=None, row_keys=None,
        key_rows=None, alibi_diagonal=None, sinks=None,
    ):  # fmt: skip
        tensors = (key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal, sinks)
        out, lse = forward_impl(q, k, v, OpOptions.unpack(options, values), *tensors)
        _fwd_setup_context(ctx, (q, k, v, options, values, *tensors), (out, lse))
        # The LSE never carries a gradient: without this autograd would fill a zero tensor for it on every
        # backward (an allocation and a fill kernel per call, for nothing).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # only reachable if autograd ever calls us without a gradient for out
            dout = torch.zeros_like(ctx.saved_tensors[3])
        rest = list(_no_grads(ctx))
        dout, q, k, v, out, lse, options, values, *tensors = _backward_args(ctx, dout)
        opt = OpOptions.unpack(options, values)
        if _needs_sinks_grad(ctx):  # the sinks' gradient from the backward kernels' own D rows
            dq, dk, dv, rest[_SINKS_INPUT - 3] = backward_impl(
                dout, q, k, v, out, lse, opt, *tensors, sinks_grad=True
            )
        else:
            dq, dk, dv = backward_impl(dout, q, k, v, out, lse, opt, *tensors)
        return (dq, dk, dv, *rest)


def eager_training(
    q, k, v, options, values, key_range=None, dropout_seed=None, alibi_slopes=None, row_keys=None,
    key_rows=None, alibi_diagonal=None, sinks=None,
):  # fmt: skip
    """``fwd`` (the same arguments) with its backward recorded, for eager autograd: on our kernels through
    the compiled training node (:mod:`flash_attention.ops.training`: no Python in the backward) when it takes
    the call, else through :class:`EagerAttention`. Returns ``(out, lse)``."""
    ops = None if _has_no_pair(q, k) else dispatch.kernel_backend(q)
    training_forward = getattr(ops, "training_forward", None)  # (the CPU tests' stand-in backends lack it)
    if training_forward is not None:
        opt = OpOptions.unpack(options, values)
        result = dispatch.run_or_fallback(
            lambda: training_forward(
                q,
                k,
                v,
                causal=opt.causal,
                softmax_scale=opt.scale,
                deterministic=opt.deterministic,
                key_range=key_range,
                dropout_p=opt.dropout_p,
                dropout_seed=dropout_seed,
                forward=ops.cuda_forward,
                **_variants(opt, alibi_slopes, row_keys, key_rows, alibi_diagonal),
                **({} if sinks is None else {"sinks": sinks}),
            ),
            lambda: None,
        )
        if result is not None:
            return result
    return EagerAttention.apply(
        q, k, v, options, values, key_range, dropout_seed, alibi_slopes, row_keys, key_rows, alibi_diagonal,
        sinks,
    )  # fmt: skip
