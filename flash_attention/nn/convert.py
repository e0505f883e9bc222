"""``replace_attention``: swap every ``torch.nn.MultiheadAttention`` of a model for ours, weights kept."""

from __future__ import annotations

from torch import nn

from .mha import MultiheadAttention

__all__ = ["replace_attention"]


def _convert(old: nn.MultiheadAttention) -> MultiheadAttention:
    new = MultiheadAttention(
        old.embed_dim,
        old.num_heads,
        dropout=old.dropout,
        bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None,
        add_zero_attn=old.add_zero_attn,
        kdim=old.kdim,
        vdim=old.vdim,
        batch_first=old.batch_first,
        device="meta",  # no memory and no initialisation: every parameter is replaced below
    )
    # The very Parameter objects move over (not copies): same device, dtype and requires_grad, no extra
    # memory, and an optimizer built before the conversion still updates them.
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    new.out_proj = old.out_proj
    new.train(old.training)
    return new


def replace_attention(model: nn.Module) -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` in ``model`` by :class:`MultiheadAttention`, in place.

    The new modules take over the old ones' parameters themselves (same tensors, so same device, dtype and
    ``requires_grad``), and compute the same function; see :class:`MultiheadAttention` for which calls run
    on our kernel. Hooks registered on the old attention modules are not carried over. A module shared by
    several parents is converted once. ``model`` itself may be a ``MultiheadAttention``: the converted
    module is returned (there is no parent to hold it). Returns ``model`` (or its replacement).

    Two of PyTorch's inference fast paths would bypass the converted modules, and are turned off:

    * ``nn.TransformerEncoderLayer`` computes attention in fused C++ without calling ``self_attn.forward``
      unless a forward hook is attached; our module carries a do-nothing pre-hook for that reason.
    * ``nn.TransformerEncoder`` with ``enable_nested_tensor`` turns a padded batch into a nested tensor
      (when given ``src_key_padding_mask`` in inference), which the layers then hand to ``self_attn`` only
      through that fused path. Its ``use_nested_tensor`` is set to False, so the padding reaches our module
      as a mask. The encoder's output at padded positions is then what its layers compute for those rows
      (as PyTorch's own encoder gives in training mode or without nested tensors), not the 0.0 of the
      nested-tensor path; the valid positions agree.
    """
    if isinstance(model, nn.MultiheadAttention) and not isinstance(model, MultiheadAttention):
        return _convert(model)
    converted: dict[int, MultiheadAttention] = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention) and not isinstance(child, MultiheadAttention):
                if id(child) not in converted:
                    converted[id(child)] = _convert(child)
                setattr(module, name, converted[id(child)])
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            isinstance(m, MultiheadAttention) for m in module.modules()
        ):
            module.use_nested_tensor = False
    return model
