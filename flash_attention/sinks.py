"""Attention sinks (gpt-oss): a learnable logit per query head that joins every row's softmax without a value.

Row i's softmax runs over its scaled scores and the head's sink logit ``sink``; the sink takes probability
``exp(sink - lse'_i)`` and contributes nothing to the output. Both the output and the LSE are therefore the
sink-free ones, rescaled:

    lse'_i = logaddexp(lse_i, sink)          O'_i = O_i * exp(lse_i - lse'_i) = O_i * sigmoid(lse_i - sink)

The forward kernels apply this in their epilogue, once per row (``fa/softmax.cuh``, ``sink_row``; the
params' ``sinks`` pointer, read by every build, so sinks add no kernel instantiation). The PyTorch fallback
and the decode kernels' path apply it afterwards with :func:`apply_sinks`, one elementwise pass over O
(as a pass after the prefill kernels it cost 17-31% of a 4k d128 forward on an H100: kernel log step 81).
The backward needs nothing new from the kernels: with O' and lse' saved, the standard backward is exact
(the sink is a key whose value is 0, so its dP is 0 and D = dO . O' already sums over it), and the sink's
own gradient is

    d sink = -sum over batch and rows of exp(sink - lse'_i) * D_i,   D_i = dO_i . O'_i

(:func:`sinks_gradient`, one pass over dO and O'). A row that sees no key keeps O' = 0 and lse' = sink.
On the kernels D is the backward's preprocessing output: training's compiled node
(csrc/host/training_node.cpp) and the Python autograd function (:func:`sinks_gradient_from_delta`) both read
it from the workspace, with the same operations, so the two paths agree bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["check_sinks", "apply_sinks", "sinks_gradient", "sinks_gradient_from_delta"]


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """Raise naming ``sinks`` unless it is None or a floating tensor of shape (heads_q,) on q's device."""
    if sinks is None:
        return
    heads_q = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor of shape (heads_q,) = ({heads_q},)")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},); got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on the device of q ({q.device}); got {sinks.device}")


def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale a sink-free ``out`` (batch, seqlen_q, heads_q, head_dim) in place and return it with the new
    LSE (float32 (batch, heads_q, seqlen_q)): the attention of the same call with ``sinks``."""
    sink = sinks.detach().to(torch.float32)[None, :, None]
    new_lse = torch.logaddexp(lse, sink)
    # (In float32: the product is computed in the factor's precision and rounded once to out's dtype.)
    factor = torch.exp(lse - new_lse)
    out.mul_(factor.transpose(1, 2).unsqueeze(-1))
    return out, new_lse


def sinks_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """d loss / d sinks, in the sinks' dtype, from the output gradient and the call's O' and lse' (with the
    sinks applied, as the forward saved them). One pass over dO and O' in float32; the backward kernels'
    path takes D from their own preprocessing instead (:func:`sinks_gradient_from_delta`)."""
    d = (dout.to(torch.float32) * out.to(torch.float32)).sum(-1)  # (batch, seqlen_q, heads_q)
    return sinks_gradient_from_delta(d.transpose(1, 2), lse, sinks)


def sinks_gradient_from_delta(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from D = rowsum(dO * O') as (batch, heads_q, seqlen_q) float32 (any strides) and
    the call's lse' (same shape)."""
    p_sink = torch.exp(sinks.detach().to(torch.float32)[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
