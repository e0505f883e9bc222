"""Hugging Face transformers integration: ``attn_implementation="fa_scratch"``.

.. code-block:: python

    from flash_attention.integrations.transformers import register

    register()  # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa_scratch", dtype=torch.bfloat16)

:func:`register` adds two functions under one name: the attention function to transformers'
``AttentionInterface`` and the mask function to its ``AttentionMaskInterface``. The mask function decides
what the attention function receives as ``attention_mask``; an implementation registered without one gets
no mask at all (transformers then skips mask creation), which silently drops padding and every mask other
than the model's ``is_causal`` flag.

The name has no "flash" in it on purpose: transformers treats any implementation whose name contains "flash"
as its FlashAttention-2/3 integration (``is_flash_attention_requested``) and changes how models prepare
masks and positions for it.

What the attention function receives as ``attention_mask``, and what it does with it:

* ``None`` -- no padding, and (for causal models) the queries are the last ``q_length`` of the keys, which
  is exactly the kernel's bottom-right causal alignment: ``flash_attention.attention`` on the whole batch.
  This covers training-free prefill, decoding with the default ``DynamicCache``, and any batch without
  padding.
* a 2-D boolean (batch, kv_length) tensor, True = real token -- plain causal or bidirectional attention
  with padding. Valid keys that form one run per row (left padding, as batched generation uses, or right
  padding) run on the kernel in one call with per-batch key ranges (``attention(..., key_range=)``, the
  kernel skips the padding itself; causal stays aligned to the last key, which is where the queries are).
  Other 2-D masks (holes in the middle) go through transformers' own SDPA function with the equivalent
  4-D mask. The mask function reads the 2-D mask on the host once per forward pass
  (:func:`flash_attention.nn.functional.key_ranges`); the ranges and their device tensor are remembered on
  the mask, which every layer receives, so the layers read nothing more.
* a 4-D mask -- everything else (sliding windows, static caches whose offsets break the alignment, packed
  sequences, custom mask functions, a 4-D mask passed by the user): transformers' SDPA function with it,
  exactly as ``attn_implementation="sdpa"`` would compute it.

Gradients (the kernel has no backward pass yet), attention dropout, ``softcap``, attention sinks and
position biases also go to transformers' SDPA function (with the equivalent mask). The results match
``"sdpa"`` within the accuracy rule on every route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._validate import MAX_HEAD_DIM
from ..interface import attention
from ..nn import functional as fn
from ..reference import causal_allowed

__all__ = ["NAME", "attention_forward", "attention_mask", "register"]

#: The ``attn_implementation`` name :func:`register` uses by default.
NAME = "fa_scratch"

# Keyword arguments of transformers' attention functions that change the function computed; we leave
# such calls to SDPA.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")


def register(name: str = NAME) -> str:
    """Register our attention and mask functions with transformers under ``name``; returns ``name``.

    Afterwards ``from_pretrained``/``from_config(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` work. Idempotent. Raises ImportError when transformers is not
    installed (it is an optional dependency: ``pip install flash_attention[transformers]``).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "flash_attention.integrations.transformers needs the transformers package "
            "(pip install 'flash_attention[transformers]')"
        ) from exc
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(
            f"name must be a non-empty string without 'flash' (transformers treats such names as its own "
            f"FlashAttention integration); got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# ------------------------------------------------------------------------------------------------------
# The mask function


def _mask_functions() -> tuple[Callable, Callable, Callable]:
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

    return causal_mask_function, bidirectional_mask_function, sdpa_mask


def attention_mask(**kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with ``AttentionMaskInterface`` (called by ``create_causal_mask`` and
    friends with keyword arguments). Returns None, a 2-D boolean (batch, kv_length) key mask, or -- whenever
    the mask is more than causal/bidirectional plus padding -- the 4-D boolean mask of transformers'
    ``sdpa_mask``; the module docstring says which and why.
    """
    causal_fn, bidirectional_fn, sdpa_mask = _mask_functions()
    mask_function = kwargs.get("mask_function", causal_fn)
    causal = mask_function is causal_fn

    if "q_length" in kwargs:
        q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    else:  # transformers < 5.x took the query positions instead of their count and offset
        cache_position = kwargs["cache_position"]
        q_length = cache_position.shape[0]
        q_offset = int(cache_position[0]) if q_length else 0
    kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)

    may_skip = (
        kwargs.get("allow_is_causal_skip", True)
        if causal
        else kwargs.get("allow_is_bidirectional_skip", False)
    )
    simple = (
        (causal or mask_function is bidirectional_fn)
        and may_skip
        and kwargs.get("local_size") is None
        # Static caches pass tensor offsets (to avoid graph breaks); reading them would force a sync and
        # their keys include empty slots: the 4-D mask handles that.
        and not isinstance(q_offset, torch.Tensor)
        and not isinstance(kv_offset, torch.Tensor)
    )
    if simple and causal:
        # The kernel aligns causal masks to the last key: the queries must be the last q_length keys.
        simple = q_offset - kv_offset == kv_length - q_length
    if not simple:
        return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})

    padding = kwargs.get("attention_mask")
    if padding is None:
        return None
    # The 2-D mask covers absolute positions 0..N-1 (True = real token); positions past it are not
    # attendable (transformers pads it with False); the keys are positions kv_offset..kv_offset+kv_length-1.
    padding = padding.to(dtype=torch.bool)
    missing = kv_offset + kv_length - padding.shape[-1]
    if missing > 0:
        padding = torch.nn.functional.pad(padding, (0, missing), value=False)
    valid = padding[:, kv_offset : kv_offset + kv_length]
    # The one host read of the mask per forward pass: whether there is padding at all, and if so the key
    # ranges the layers' calls will use, remembered on `valid` (which every layer receives).
    ranges = fn.key_ranges(valid)
    if ranges is not None and ranges.is_full(kv_length):
        return None
    return valid


# ------------------------------------------------------------------------------------------------------
# The attention function


def _sdpa_equivalent_mask(
    mask: torch.Tensor | None, q_length: int, kv_length: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """What transformers' SDPA function needs to compute what our function computes for ``mask``."""
    if mask is not None and mask.dim() != 2:
        return mask
    allowed = None
    if causal and q_length > 1 and (mask is not None or q_length != kv_length):
        # transformers' SDPA function aligns is_causal to the top-left (and crops the keys): say bottom-right
        # explicitly.
        allowed = causal_allowed(q_length, kv_length, device=device)[None, None]
    if mask is not None:
        valid = mask[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _check_dropout(dropout: object) -> None:
    # The kernel would reject a bad value too, but under the name of its own argument (dropout_p).
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1]; got {type(dropout).__name__}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must be a float in [0, 1]; got {dropout!r}")


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with ``AttentionInterface``.

    Same signature and result as transformers' ``sdpa_attention_forward``: ``query`` (batch, heads,
    q_length, head_dim), ``key``/``value`` (batch, kv_heads, kv_length, head_dim) with ``module.
    num_key_value_groups`` query heads per kv head (read in place, never repeated, on the kernel path);
    returns ``(output of shape (batch, q_length, heads, head_dim), None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _check_dropout(dropout)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length, kv_length = query.shape[2], key.shape[2]
    head_dim = query.shape[-1]
    # The library's layout, as views: (batch, seqlen, heads, head_dim); the kernel takes these strides.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    kernel_ok = (
        (attention_mask is None or attention_mask.dim() == 2)
        and not any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS)
        and kwargs.get("cache") is None  # a paged cache: transformers' function updates it
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and value.shape[-1] == head_dim
        and query.dtype == key.dtype == value.dtype
        and dropout < 1.0  # the kernels take p in [0, 1); p == 1 (everything dropped) goes to SDPA
        and not fn.needs_pytorch_path(q, k, v, dropout_p=dropout, stacklevel=5)
    )
    if kernel_ok:
        if attention_mask is None:
            return attention(q, k, v, causal=causal, softmax_scale=scaling, dropout_p=dropout), None
        # A 2-D key mask: one kernel call with per-batch key ranges when each row's valid keys are one run.
        ranges = (
            fn.plan_padded(attention_mask)
            if attention_mask.dtype == torch.bool
            and attention_mask.shape == (query.shape[0], kv_length)
            and attention_mask.device == query.device
            else None
        )
        if ranges is not None:
            out = fn.key_range_attention(q, k, v, ranges, causal=causal, scale=scaling, dropout_p=dropout)
            return out, None

    mask = _sdpa_equivalent_mask(attention_mask, q_length, kv_length, causal, query.device)
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
    )
