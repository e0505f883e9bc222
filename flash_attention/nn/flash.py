"""``FlashAttention``: a multi-head attention layer with its own projections, on our kernel."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..spec.validate import MAX_HEAD_DIM, check_window
from . import functional as fn

__all__ = ["FlashAttention"]


class FlashAttention(nn.Module):
    """Multi-head (or grouped-query) attention with Q/K/V/output projections, computed by flash_attention.

    Args:
        d_model: width of the inputs and of the output.
        num_heads: query heads; ``head_dim = d_model // num_heads`` must be at most 256 (the largest the
            kernels are built for; the PyTorch path keeps the same rule so a model that runs on the CPU also
            runs on the GPU). A head_dim that is not a multiple of 8 runs on the kernels zero-padded.
        num_kv_heads: key/value heads (grouped-query attention; 1 is multi-query). Default ``num_heads``.
            K/V are never copied per query head on the kernel path.
        dropout: dropout on the attention probabilities, in training mode only.
        bias: whether the four projections have a bias.
        causal: mask out future keys, aligned to the bottom-right corner (query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``): for self-attention, the usual ``j <= i``.
        window: a sliding window ``(left, right)`` as :func:`flash_attention.attention` takes it (with
            ``causal``, ``(W, 0)`` attends the W keys before each query and itself); default none.
        alibi_slopes: ALiBi, one slope per query head (a float tensor of shape (num_heads,), kept as a
            buffer); as :func:`flash_attention.attention` takes it. Default none.
        softcap: soft-capping of the scaled scores (``softcap * tanh(s / softcap)``); 0: none.
        device, dtype: of the parameters.

    Parameters: ``q_proj`` (d_model -> d_model), ``k_proj`` and ``v_proj`` (d_model -> num_kv_heads *
    head_dim), ``out_proj`` (d_model -> d_model), all ``nn.Linear``.

    Which computation runs (:mod:`flash_attention.nn.functional`):

    * fp16/bf16 CUDA tensors, inference or training: our kernels;
    * a ``key_padding_mask`` whose valid keys are one run per row (right or left padding): the kernel, which
      applies it as per-batch key ranges (one call with ``key_range``; the mask is read on the host once
      and remembered on the mask tensor, so layers sharing it pay once); a mask with holes: PyTorch's SDPA
      with the mask;
    * training (gradients, and attention dropout in training mode) runs the same kernel routes: the backward
      kernels and the kernels' own dropout (a counter-based mask, so it is not PyTorch's random stream);
    * ``need_weights=True``: an explicit softmax that materialises the (seqlen_q, seqlen_k) weights -- slow
      and quadratic in memory, for inspection only;
    * CPU or float32/float64: PyTorch, the same function.

    A query row that sees no key (all its keys padded, or causal with seqlen_q > seqlen_k) gets an attention
    output of 0, so its layer output is ``out_proj.bias``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = False,
        window: tuple[int, int] | None = None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = d_model // num_heads
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"d_model // num_heads (head_dim) must be at most {MAX_HEAD_DIM}; got {head_dim} "
                f"(d_model={d_model}, num_heads={num_heads})"
            )
        if not (isinstance(dropout, int | float) and 0.0 <= dropout <= 1.0):
            raise ValueError(f"dropout must be a probability in [0, 1]; got {dropout!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
        self.window = check_window(window)
        if alibi_slopes is not None:
            if not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) != (num_heads,):
                raise ValueError(f"alibi_slopes must be a tensor of shape (num_heads,) = ({num_heads},)")
            if alibi_slopes.is_complex() or not alibi_slopes.is_floating_point():
                raise TypeError(f"alibi_slopes must be a floating tensor; got {alibi_slopes.dtype}")
        if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0.0 <= softcap < math.inf:
            raise ValueError(f"softcap must be a finite number >= 0 (0: none); got {softcap!r}")
        self.softcap = float(softcap)
        # A buffer in float32 (the kernels read float32 slopes), moved with the module, never trained.
        self.register_buffer(
            "alibi_slopes",
            None if alibi_slopes is None else alibi_slopes.detach().to(device=device, dtype=torch.float32),
        )

        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = (
            d_model,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.dropout = float(dropout)
        self.causal = causal
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"dropout={self.dropout}, causal={self.causal}"
            + (f", window={self.window}" if self.window is not None else "")
            + (", alibi" if self.alibi_slopes is not None else "")
            + (f", softcap={self.softcap}" if self.softcap else "")
        )

    def _check_input(self, name: str, x: object, batch: int | None = None) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor of shape (batch, seqlen, {self.d_model}); "
                f"got {type(x).__name__}"
            )
        if x.dim() != 3 or x.shape[-1] != self.d_model or (batch is not None and x.shape[0] != batch):
            b = "batch" if batch is None else str(batch)
            raise ValueError(
                f"{name} must have shape ({b}, seqlen, d_model={self.d_model}); got {tuple(x.shape)}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (batch, seqlen_q, d_model).
            key: (batch, seqlen_k, d_model); default ``query`` (self-attention).
            value: (batch, seqlen_k, d_model); default ``key``.
            key_padding_mask: optional (batch, seqlen_k) bool, True for keys to ignore (PyTorch's convention,
                as in ``nn.MultiheadAttention``; the opposite of SDPA's boolean ``attn_mask``).
            need_weights: also return the attention probabilities (slow: materialised; see the class doc).

        Returns:
            ``(output, weights)``: output (batch, seqlen_q, d_model); weights None, or (batch, num_heads,
            seqlen_q, seqlen_k) in the output's dtype when ``need_weights`` (before dropout).
        """
        self._check_input("query", query)
        key = query if key is None else key
        value = key if value is None else value
        batch = query.shape[0]
        self._check_input("key", key, batch)
        self._check_input("value", value, batch)
        if value.shape[1] != key.shape[1]:
            raise ValueError(
                f"value must have the seqlen of key ({key.shape[1]}); got shape {tuple(value.shape)}"
            )
        seqlen_q, seqlen_k = query.shape[1], key.shape[1]
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                got = (
                    key_padding_mask.dtype
                    if isinstance(key_padding_mask, torch.Tensor)
                    else type(key_padding_mask).__name__
                )
                raise TypeError(f"key_padding_mask must be a bool tensor (True = ignore that key); got {got}")
            if key_padding_mask.shape != (batch, seqlen_k):
                raise ValueError(
                    f"key_padding_mask must have shape (batch, seqlen_k) = {(batch, seqlen_k)}; "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.device != query.device:
                raise ValueError(
                    f"key_padding_mask must be on the device of query ({query.device}); "
                    f"got {key_padding_mask.device}"
                )

        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.head_dim))
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        variants = dict(
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
            softcap=self.softcap,
        )
        if need_weights:
            o, weights = fn.materialized_attention(q, k, v, **variants)
        else:
            o = fn.attend(q, k, v, **variants)
        out = self.out_proj(o.reshape(batch, seqlen_q, self.d_model))
        return out, weights
