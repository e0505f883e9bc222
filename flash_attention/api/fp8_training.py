"""FP8 attention with a backward (issue 51; docs/fp8-study.md, 4.2's first form).

Two entry points, one backward:

* ``attention(q, k, v, fp8=True)`` on bf16 tensors, where the e4m3 forward kernel takes the call
  (ops.fp8_forward.kernel_takes): q, k and v quantized per (batch, kv head) (spec.fp8.quantize's rule),
  the e4m3 kernel's output and LSE, and, for autograd, the e4m3 tensors and their descales kept (a byte an
  element where a bf16 call keeps two). Its gradients reach the bf16 tensors with the quantization passed
  through (the derivative of the round trip taken as 1, as FP8 training recipes treat their GEMMs).
* :func:`attention_fp8_backward` for e4m3 inputs (the call that holds quantized tensors already, e.g. a
  recipe's own autograd function): the bf16 gradients with respect to the dequantized q, k and v of
  ``attention(q8, k8, v8, q_descale=..., ...)``'s output, given that output and its LSE.

The casts are ops.fp8_cast's kernels where they take the tensors (spec.fp8's forms, bit for bit, elsewhere).
The backward: the e4m3 tensors dequantized to bf16 (spec.fp8.dequantize: the exact product rounded once,
as PyTorch's FP8-input practice does before its bf16 attention), then our bf16 backward (or the PyTorch
fallback off CUDA) with the forward's output and LSE. So it costs the bf16 backward's time plus three
dequantizing passes; the FP8 products in the backward (4.2's later forms) are what would make it faster.
Where it rounds beyond the bf16 backward: the forward's output carries P's e4m3 rounding into delta
(rowsum(dO O)), and the backward recomputes P from the dequantized q and k (exact in bf16 with fp8=True's
power-of-two descales, rounded to bf16 with others) against the LSE the e4m3 forward took from its FP8
products, whose accumulator keeps fewer bits than fp32 (tests/fp8_bounds.py bounds both).
"""

from __future__ import annotations

import torch

from ..ops import fp8_cast as _fp8_cast
from ..spec import OpOptions
from ..spec import fp8 as _fp8
from ..spec.validate import validate
from ..torch_ops.attention import backward_impl

__all__ = ["attention_fp8_backward", "e4m3_training"]


def _dequantized_backward(
    dout: torch.Tensor,
    e4m3: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    descales: tuple,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: OpOptions,
    powers_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in bf16 with respect to the dequantized tensors: the bf16 backward on them.
    ``powers_of_two``: the descales are spec.fp8.quantize's (spec.fp8.dequantize then works in bf16)."""
    heads_kv = e4m3[1].shape[-2]
    q, k, v = (
        _fp8_cast.dequantize(t, d, heads_kv, powers_of_two=powers_of_two)
        for t, d in zip(e4m3, descales, strict=True)
    )
    dq, dk, dv = backward_impl(dout, q, k, v, out, lse, options)
    return dq, dk, dv


class _E4m3Attention(torch.autograd.Function):
    """attention(q, k, v, fp8=True) on the e4m3 forward kernel: bf16 q, k, v in, (out, lse) out."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, deterministic: bool):
        from ..ops.fp8_forward import cuda_forward_e4m3  # (here: only FP8 calls pay for its import)

        heads_kv = k.shape[2]
        e4m3, descales = zip(*(_fp8_cast.quantize(t, heads_kv) for t in (q, k, v)), strict=True)
        out, lse = cuda_forward_e4m3(
            *e4m3, causal=causal, softmax_scale=scale, q_descale=descales[0], k_descale=descales[1],
            v_descale=descales[2], return_lse=True,
        )  # fmt: skip
        ctx.save_for_backward(*e4m3, *descales, out, lse)
        ctx.options = OpOptions(causal, scale, deterministic)
        # The LSE never carries a gradient (as the bf16 call's: torch_ops.attention.EagerAttention).
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # (only the LSE was used: no gradient reaches q, k or v)
            return None, None, None, None, None, None
        q8, k8, v8, dq8, dk8, dv8, out, lse = ctx.saved_tensors
        grads = _dequantized_backward(
            dout, (q8, k8, v8), (dq8, dk8, dv8), out, lse, ctx.options, powers_of_two=True
        )
        return (*grads, None, None, None)


def e4m3_training(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention(q, k, v, fp8=True) on the e4m3 kernel, its backward recorded: what
    attention() runs once its checks are done and ops.fp8_forward.kernel_takes said yes."""
    return _E4m3Attention.apply(q, k, v, causal, scale, deterministic)


def attention_fp8_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of an FP8 call's output with respect to its dequantized inputs.

    ``out, lse = attention(q, k, v, q_descale=..., k_descale=..., v_descale=..., causal=...,
    softmax_scale=..., return_lse=True)`` with e4m3 q, k and v (no other option) computes attention of
    ``float(q) * q_descale`` (and k's, v's). Given the gradient ``dout`` of its output, this returns
    ``(dq, dk, dv)``, bfloat16 tensors of q's, k's and v's shapes: the gradients with respect to those
    dequantized tensors. A training recipe that quantizes inside its own autograd function returns them as
    the gradients of the tensors it quantized (the quantization's derivative taken as 1). The arguments
    after ``lse`` must be the forward call's. How it computes, and where it rounds: the module's docstring.
    """
    descales = (q_descale, k_descale, v_descale)
    _fp8.check_fp8(q, k, v, descales)
    problem = validate(
        *(torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for t in (q, k, v)),
        causal=causal,
        softmax_scale=softmax_scale,
        out=None,
    )
    want_out = (*q.shape[:3], v.shape[3])
    for name, t, shape, dtype in (
        ("dout", dout, want_out, torch.bfloat16),
        ("out", out, want_out, torch.bfloat16),
        ("lse", lse, (q.shape[0], q.shape[2], q.shape[1]), torch.float32),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name} must be {dtype} of shape {shape} (the FP8 call's); got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    if problem.is_empty:
        return tuple(torch.zeros(t.shape, dtype=torch.bfloat16, device=t.device) for t in (q, k, v))
    # (the argument or PyTorch's switch, as attention()'s backward takes it)
    options = OpOptions(
        problem.causal, problem.scale, deterministic or torch.are_deterministic_algorithms_enabled()
    )
    return _dequantized_backward(dout, (q, k, v), descales, out, lse, options)
