"""``MultiheadAttention``: a drop-in ``torch.nn.MultiheadAttention`` that runs on our kernel when it can."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec.validate import MAX_HEAD_DIM
from . import functional as fn

__all__ = ["MultiheadAttention"]


def _keep_module_forward(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing; its presence is what matters (see ``MultiheadAttention``)."""
    return None


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` computed by flash_attention when the call allows it.

    Same constructor, ``forward`` signature and defaults, parameters and ``state_dict`` keys as PyTorch's
    module (it is a subclass), so ``load_state_dict`` from a stock module works, and
    :func:`flash_attention.nn.replace_attention` converts a model in place.

    A call runs on our kernel when all of these hold, and otherwise goes to PyTorch's own implementation
    (``super().forward``), which computes the same function:

    * ``need_weights=False`` (note: PyTorch's default is True; ``nn.TransformerEncoderLayer`` and
      ``nn.TransformerDecoderLayer`` pass False);
    * no attention dropout is active (``dropout > 0`` in training mode runs PyTorch's module, so that a
      drop-in replacement draws the same random masks as the module it replaces; a one-time warning on
      CUDA says so). Training without dropout runs on the kernels, the backward pass included;
    * ``kdim == vdim == embed_dim``, no ``add_bias_kv``, no ``add_zero_attn``, ``head_dim`` at most 256
      (one that is not a multiple of 8 runs zero-padded), the inputs' dtype that of the parameters;
    * ``attn_mask`` is None, or is declared causal with ``is_causal=True`` on a square (seqlen_q ==
      seqlen_k) problem -- PyTorch's own contract: ``is_causal`` is a hint that ``attn_mask`` *is* the causal
      mask. Any other mask is an arbitrary mask or bias: PyTorch path, with a one-time warning;
    * ``key_padding_mask`` is None, or boolean (True = ignore that key, PyTorch's convention) or a float mask
      of 0 and -inf (what ``nn.TransformerEncoder`` passes down), whose valid keys form one run per batch row
      (right or left padding): the kernel then applies it itself, as per-batch key ranges (one call with
      ``key_range``; no mask is materialised). Deciding reads the mask once on the host; that and the key
      range tensor are remembered on the mask, so the layers of a model sharing it pay once per forward.
      A mask with holes (valid keys not one run) goes to PyTorch's implementation.

    Wrong shapes or mask types reach PyTorch's implementation, so they raise exactly PyTorch's errors.

    ``nn.TransformerEncoderLayer`` has a fused inference fast path that reads ``self_attn``'s weights and
    never calls ``self_attn.forward``. It is skipped when a forward hook is attached to any submodule, so this
    module registers a do-nothing forward pre-hook: a layer holding it always calls our ``forward``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_forward_pre_hook(_keep_module_forward)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``torch.nn.MultiheadAttention.forward``; the class docstring says which calls use the kernel."""
        self._check_masks(query, key, value, key_padding_mask, attn_mask, is_causal)
        plan = self._kernel_plan(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if plan is None:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        return self._kernel_forward(query, key, value, *plan), None

    def _check_masks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> None:
        """Raise a clear error, naming the argument, for a mask of the wrong shape or dtype.

        PyTorch rejects the same masks, but one of its messages names no argument ("For mask_type == 1 mask
        shape should be (B, L)"). Only checked when query/key/value are consistent: otherwise PyTorch's own
        error about them comes first, as from the stock module. With ``is_causal``, PyTorch's fast path
        accepts a 3-D ``attn_mask`` of any (batch, ...) shape and never reads it, so that one is not checked
        (a drop-in must not reject what works).
        """
        tensors = (query, key, value)
        if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in tensors):
            return
        shapes = self._shapes(query, key, value)
        if shapes is None:
            return
        batch, seqlen_q, seqlen_k = shapes
        batched = query.dim() == 3
        for name, mask, shapes_ok, text in (
            (
                "key_padding_mask",
                key_padding_mask,
                [(batch, seqlen_k)] if batched else [(seqlen_k,)],
                "(batch, seqlen_k)" if batched else "(seqlen_k,) for unbatched inputs",
            ),
            (
                "attn_mask",
                attn_mask,
                [(seqlen_q, seqlen_k), ((batch if batched else 1) * self.num_heads, seqlen_q, seqlen_k)],
                "(seqlen_q, seqlen_k) or (batch * num_heads, seqlen_q, seqlen_k)",
            ),
        ):
            if mask is None:
                continue
            if not isinstance(mask, torch.Tensor) or not (
                mask.dtype == torch.bool or mask.is_floating_point()
            ):
                got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise TypeError(f"{name} must be a bool or floating-point tensor; got {got}")
            if tuple(mask.shape) not in shapes_ok and not (
                name == "attn_mask" and is_causal and mask.dim() == 3
            ):
                raise ValueError(
                    f"{name} must have shape {text} = {' or '.join(map(str, shapes_ok))}; "
                    f"got {tuple(mask.shape)}"
                )

    # --------------------------------------------------------------------------------------------------
    # Deciding: every check is cheap and host-side, except reading a key_padding_mask (one copy per mask).

    def _kernel_plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> tuple[bool, fn.KeyRanges | None] | None:
        """``(causal, key_ranges)`` when the kernel can compute this call, else None (PyTorch's path)."""
        if need_weights or not self._module_supported():
            return None
        tensors = (query, key, value)
        if not all(isinstance(t, torch.Tensor) for t in tensors) or any(t.is_nested for t in tensors):
            return None
        shapes = self._shapes(query, key, value)
        if shapes is None:
            return None
        batch, seqlen_q, seqlen_k = shapes
        weight = self.in_proj_weight
        if any(t.dtype != weight.dtype or t.device != weight.device for t in tensors):
            return None

        causal = False
        if attn_mask is not None or is_causal:
            if not (is_causal and attn_mask is not None and seqlen_q == seqlen_k):
                # Without is_causal, attn_mask is arbitrary (PyTorch does not look inside it either);
                # is_causal without attn_mask, PyTorch raises; non-square causal, PyTorch aligns top-left.
                if attn_mask is not None and not is_causal:
                    kind = "float (additive bias)" if torch.is_floating_point(attn_mask) else "boolean"
                    fn.warn_once(
                        f"attn_mask-{kind}",
                        f"an arbitrary {kind} attn_mask runs through PyTorch's MultiheadAttention (the slow "
                        "path; the kernel takes no mask). If it is the causal mask, pass is_causal=True too.",
                        stacklevel=4,
                    )
                return None
            causal = True  # (the mask's shape and dtype were checked by _check_masks)

        # Gradients and dropout: checked on the parameters and inputs, before any projection is computed.
        requires_grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors) or any(p.requires_grad for p in self.parameters())
        )
        if requires_grad and not fn.KERNEL_HAS_BACKWARD:
            if fn.kernel_expected(query):
                fn.warn_once(
                    "grad",
                    "gradients are needed and the kernels' backward pass is switched off "
                    "(flash_attention.nn.functional.KERNEL_HAS_BACKWARD = False): this call runs through "
                    "PyTorch's MultiheadAttention (inference under torch.no_grad() or "
                    "torch.inference_mode() uses the kernel)",
                    stacklevel=4,
                )
            return None
        if self.training and self.dropout > 0.0:
            if fn.kernel_expected(query):
                fn.warn_once(
                    "dropout",
                    "attention dropout runs through PyTorch's MultiheadAttention, so a drop-in replacement "
                    "draws the same random masks as the stock module (the kernels' own dropout uses a "
                    "different generator; flash_attention.nn.FlashAttention uses it)",
                    stacklevel=4,
                )
            return None

        if key_padding_mask is None:
            return causal, None
        if not isinstance(key_padding_mask, torch.Tensor):
            return None
        expected = (batch, seqlen_k) if query.dim() == 3 else (seqlen_k,)
        if key_padding_mask.shape != expected or key_padding_mask.device != query.device:
            return None
        if key_padding_mask.dtype == torch.bool:
            key_valid = ~key_padding_mask
        elif torch.is_floating_point(key_padding_mask):
            # PyTorch adds a float mask to the scores; only 0 (keep) and -inf (drop) mean padding.
            key_valid = key_padding_mask == 0
        else:
            return None  # PyTorch raises: only bool and float masks are supported
        key_valid = key_valid.reshape(batch, seqlen_k)
        if not fn.kernel_expected(query):
            return None  # no kernel to win with: PyTorch's implementation, without reading the mask
        if torch.is_floating_point(key_padding_mask) and not fn.memo(
            key_padding_mask,
            "zero_or_neg_inf",
            lambda: bool(((key_padding_mask == 0) | key_padding_mask.isneginf()).all()),
        ):
            fn.warn_once(
                "kpm-float",
                "a float key_padding_mask with values other than 0 and -inf is an additive bias: it runs "
                "through PyTorch's MultiheadAttention (the slow path)",
                stacklevel=4,
            )
            return None
        ranges = fn.plan_padded(key_valid, cache_on=key_padding_mask)
        if ranges is None:
            return None
        return causal, ranges

    def _module_supported(self) -> bool:
        return (
            self._qkv_same_embed_dim
            and self.bias_k is None
            and self.bias_v is None
            and not self.add_zero_attn
            and self.in_proj_weight is not None
            and self.head_dim <= MAX_HEAD_DIM
            and self.head_dim * self.num_heads == self.embed_dim
        )

    def _shapes(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[int, int, int] | None:
        """(batch, seqlen_q, seqlen_k) when the inputs are consistent; None lets PyTorch judge (and raise)."""
        e = self.embed_dim
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            return None
        if (
            query.shape[-1] != e
            or key.shape[-1] != e
            or value.shape[-1] != e
            or key.shape[:-1] != value.shape[:-1]
        ):
            return None
        if not torch.is_floating_point(query):
            return None
        if query.dim() == 2:
            return 1, query.shape[0], key.shape[0]
        b = 0 if self.batch_first else 1
        s = 1 - b
        if key.shape[b] != query.shape[b]:
            return None
        return query.shape[b], query.shape[s], key.shape[s]

    # --------------------------------------------------------------------------------------------------
    # Computing

    def _kernel_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        causal: bool,
        ranges: fn.KeyRanges | None,
    ) -> torch.Tensor:
        e, h, d = self.embed_dim, self.num_heads, self.head_dim
        unbatched = query.dim() == 2
        seq_first = not unbatched and not self.batch_first
        w, b = self.in_proj_weight, self.in_proj_bias

        def heads(x: torch.Tensor, n: int) -> torch.Tensor:
            # (..., n*e) -> (batch, seqlen, n, heads, head_dim) as a view: the kernel takes any strides but
            # the last, so seq-first inputs need no transposed copy.
            x = x.unflatten(-1, (n, h, d))
            if unbatched:
                return x.unsqueeze(0)
            return x.transpose(0, 1) if seq_first else x

        def proj(x: torch.Tensor, rows: slice) -> torch.Tensor:
            return F.linear(x, w[rows], None if b is None else b[rows])

        # The same grouping of the in-projection as PyTorch's (_in_projection_packed): one matmul for
        # self-attention, two when key is value.
        if query is key and key is value:
            q, k, v = heads(proj(query, slice(None)), 3).unbind(2)
        elif key is value:
            q = heads(proj(query, slice(0, e)), 1)[:, :, 0]
            k, v = heads(proj(key, slice(e, None)), 2).unbind(2)
        else:
            q = heads(proj(query, slice(0, e)), 1)[:, :, 0]
            k = heads(proj(key, slice(e, 2 * e)), 1)[:, :, 0]
            v = heads(proj(value, slice(2 * e, None)), 1)[:, :, 0]

        if ranges is None:
            o = fn.attention(q, k, v, causal=causal)
        else:
            o = fn.key_range_attention(q, k, v, ranges, causal=causal)
        if seq_first:
            o = o.transpose(0, 1)  # the layout PyTorch returns: contiguous (seqlen, batch, embed_dim)
        out = self.out_proj(o.reshape(*o.shape[:2], e))
        return out.squeeze(0) if unbatched else out
