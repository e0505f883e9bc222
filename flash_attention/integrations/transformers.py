"""Hugging Face transformers integration: ``attn_implementation="fa_scratch"``.

.. code-block:: python

    from flash_attention.integrations.transformers import precompile_model, register

    register()  # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa_scratch", dtype=torch.bfloat16)
    precompile_model(model)  # optional: its kernels compiled now, in parallel, not inside the first calls

:func:`register` adds two functions under one name: the attention function to transformers'
``AttentionInterface`` and the mask function to its ``AttentionMaskInterface``. The mask function decides
what the attention function receives as ``attention_mask``; an implementation registered without one gets
no mask at all (transformers then skips mask creation), which silently drops padding and every mask other
than the model's ``is_causal`` flag.

The name has no "flash" in it on purpose: transformers treats any implementation whose name contains "flash"
as its FlashAttention-2/3 integration (``is_flash_attention_requested``) and changes how models prepare
masks and positions for it.

What the attention function receives as ``attention_mask``, and what it does with it (the same in
inference and in training: the kernels have a backward pass, and attention dropout runs in them; with
:data:`flash_attention.nn.functional.KERNEL_HAS_BACKWARD` switched off, calls that record gradients go to
transformers' SDPA function instead):

* ``None`` -- no padding, and (for causal models) the queries are the last ``q_length`` of the keys, which
  is exactly the kernel's bottom-right causal alignment: ``flash_attention.attention`` on the whole batch.
  This covers prefill, training on unpadded batches, decoding with the default ``DynamicCache``, and any
  batch without padding. A causal inference call of at most ``STATIC_CACHE_MAX_QUERIES`` queries against
  more keys than that (a decoding step on a ``DynamicCache``, whose keys are the whole cache) runs on the
  split-KV decode kernels instead: :func:`flash_attention.attention_with_kvcache` with ``cache_seqlens`` =
  the key length, the cache read in place and nothing appended (transformers has added the step's keys).
* a 2-D boolean (batch, kv_length) tensor, True = real token -- plain causal or bidirectional attention
  with padding. Valid keys that form one run per row (left padding, as batched generation uses, or right
  padding) run on the kernel in one call with per-batch key ranges (``attention(..., key_range=)``, the
  kernel skips the padding itself; causal stays aligned to the last key, which is where the queries are).
  Other 2-D masks (holes in the middle) go through transformers' own SDPA function with the equivalent
  4-D mask. A key mask of n < kv_length columns says the keys are the first n, the last query being the
  last of them: the keys after it (a static cache's empty slots past its prefill), which causality hides
  from every query, are left out by the mask function and read by no route. The mask function reads the
  2-D mask on the host once per forward pass (:func:`flash_attention.nn.functional.key_ranges`); the
  ranges and their device tensor are remembered on the mask, which every layer receives, so the layers
  read nothing more.
* a 1-D int32 (batch,) tensor -- decoding from a static cache (``StaticCache``, ``cache_implementation=
  "static"``): each row's number of filled cache slots after this step's update, ``q_offset + q_length``,
  computed on the device from the cache's offset tensor (never read on the host, so a compiled decoding
  step keeps its graph). The keys are the whole static cache, whose slots past that length are empty, and
  the queries are the last ``q_length`` filled positions: exactly
  :func:`flash_attention.attention_with_kvcache` with ``cache_seqlens`` = the lengths (the cache already
  updated, so no append), causal aligned to each row's own length, on the split-KV decode kernels. Taken for
  causal calls without padding (a 2-D padding mask is read on the host once per forward pass, as below, to
  see that it has none) of at most 64 new queries (decoding, speculative decoding) in inference. A padded
  batch's decoding step (one new query per row, each row's real tokens one run) has its lengths carry each
  row's key range, from its first real token to its filled length (computed on the device), and runs
  ``attention(..., key_range=)`` on the forward kernel: the one query sees exactly those keys (the decode
  kernels take no first key per row). A longer prefill, a padded one and training take the 2-D key mask of
  the filled slots (above: on the kernel, the empty slots unread); padded speculative steps take the 4-D
  mask. A sliding layer's window-sized cache
  takes it while it fills (its lengths marked with the window, ``attention_with_kvcache(window=)``); once
  full, its queries are the last of its keys and the call is a plain one (below: transformers vetoes that
  skip for compileable caches' one-token steps, for its own SDPA route's sake, and the veto is not needed
  here).
* a causal sliding window of W keys (``create_sliding_window_causal_mask``: Mistral, the sliding layers of
  Qwen2, Gemma 2/3 and gpt-oss), recognised by what its mask function answers at the window's edges: the
  2-D key mask as above (all True without padding), marked with the kernel's window (W - 1, 0), so the
  layers run ``attention(..., window=)`` (with key ranges when padded), the kernel skipping the keys
  outside the window. A window that cuts no key (a cache no longer than it) is plain causal, and decoding
  steps then take the decode kernels. The ``sliding_window`` argument models also pass is not read: the
  mask says what the layer attends, as it does for ``"eager"`` and ``"sdpa"``.
* packed sequences -- one row of several documents, ``position_ids`` restarting at each (as
  ``DataCollatorWithFlattening`` makes them; no padding, no cache): transformers builds a 4-D mask, causal
  within each document (and its window on a sliding layer). When the mask is exactly that (compared once
  with the documents' runs: one host read per mask, which every layer of its kind shares and which
  remembers the verdict), the layer runs one :func:`flash_attention.attention_varlen` call over the
  documents (with its window, soft-capping or sinks), forward and backward, never materialising the mask
  in the kernel. Here (unlike the other routes) the ``sliding_window`` argument picks the window compared.
* a 4-D mask -- everything else (a static cache's padded speculative steps, packed sequences whose mask is
  not the documents' causal one, chunked or bidirectional windows, custom mask functions, a 4-D mask
  passed by the user): transformers' SDPA function with it, which computes that mask exactly.

Attention dropout (``dropout``, which transformers' models pass only in training mode) runs on every
route: in the kernels (their mask drawn from PyTorch's CPU generator, so ``torch.manual_seed`` repeats
it), in SDPA, in the eager functions.

Logit soft-capping (``softcap``: Gemma 2) runs on the kernel routes above with ``attention(..., softcap=)``,
and attention sinks (``s_aux``: gpt-oss; ``sinks``; a (heads,) tensor) with ``sinks=``, the decoding steps too
(``attention_with_kvcache(..., softcap=, sinks=)``); where no kernel route takes such a call (4-D masks: SDPA
computes neither) it goes where the rest of this paragraph says. Calls with something the kernels do not
compute -- additive position biases (``position_bias``: T5 and relatives), sinks of another shape -- run
through the calling model's own eager attention function: the ``eager_attention_forward`` of the modeling
module that defines the attention module's class (or a base class), which is what
``attn_implementation="eager"`` runs; a private generic one only when that module has none. It gets the mask
as ``"eager"`` would (additive, with the bottom-right causal mask and the padding made explicit), and the
first such call per reason warns once (a ``RuntimeWarning``). transformers' SDPA function cannot take these
calls: 5.23 raises on ``softcap``, 5.0 and 5.17 drop it without a word, and none computes sinks. Sparse
attention's ``indices``/``block_indices`` raise ``NotImplementedError``: the models that pass them build the
equivalent mask only for ``"eager"``/``"sdpa"``.

Every route computes what ``attn_implementation="eager"`` computes for the model, within floating-point
rounding (tests: Llama and GPT-2 against ``"sdpa"``; Gemma 2, Gemma 3, Mistral and gpt-oss, with sliding
windows, soft-capping and sinks, against ``"eager"``: logits, greedy ``generate()``, a training step).
The one difference is in query rows that may attend no key at all (padding before a row's first token,
whose outputs predict nothing): eager fills them with the mean of all values, the kernel with 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ..api.attention import attention
from ..api.kvcache import attention_with_kvcache
from ..api.varlen import attention_varlen, segments
from ..fallback.reference import causal_allowed, window_allowed
from ..nn import functional as fn
from ..spec.validate import MAX_HEAD_DIM

__all__ = ["NAME", "attention_forward", "attention_mask", "precompile_model", "register"]

#: The ``attn_implementation`` name :func:`register` uses by default.
NAME = "fa_scratch"

# Keyword arguments of transformers' attention functions that change the function computed in ways SDPA
# cannot, with what they are: logit soft-capping (Gemma 2) and attention sinks (gpt-oss passes them as s_aux,
# others as sinks), which our kernel routes take (_kernel_variants), and additive position biases (T5 and
# relatives).
# transformers' SDPA function does not compute them (5.23 raises on softcap, 5.0 and 5.17 silently drop it),
# so where no kernel route takes such a call it runs through the model's own eager function, which does.
_EAGER_KWARGS = {
    "softcap": "logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks (sinks)",
    "position_bias": "an additive position bias (position_bias)",
}
# Sparse attention's selected keys: the models add them to the mask only for "eager"/"sdpa" and otherwise
# hand them to a kernel that reads them; no route here does.
_UNSUPPORTED_KWARGS = ("indices", "block_indices")
#: New queries per row up to which a static cache's call runs on the decode kernels (decoding, speculative
#: decoding); a static cache's prefill takes the 4-D mask route.
STATIC_CACHE_MAX_QUERIES = 64


def register(name: str = NAME) -> str:
    """Register our attention and mask functions with transformers under ``name``; returns ``name``.

    Afterwards ``from_pretrained``/``from_config(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` work. Idempotent. Raises ImportError when transformers is not
    installed (it is an optional dependency: ``pip install "fa-scratch[transformers]"``, or
    ``pip install -e ".[transformers]"`` in a checkout). Once the model exists, :func:`precompile_model`
    compiles what it will run, in parallel, so that its first ``generate()`` or training step compiles
    nothing.
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "flash_attention.integrations.transformers needs the transformers package "
            "(pip install transformers, or the extra: pip install 'fa-scratch[transformers]')"
        ) from exc
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(
            f"name must be a non-empty string without 'flash' (transformers treats such names as its own "
            f"FlashAttention integration); got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


#: Query tokens per row of the decoding calls precompile_model covers: one (greedy decoding), and the
#: packed-row sizes whose decode configs differ (16 and 64 rows of speculative or chunked steps; the
#: static cache sends up to STATIC_CACHE_MAX_QUERIES new tokens to the decode kernels).
_DECODE_QUERIES = (1, 16, STATIC_CACHE_MAX_QUERIES)


def precompile_model(
    model: Any,
    *,
    training: bool | None = None,
    generate: bool | None = None,
    padded: bool = True,
    seqlens: Any = None,
    device: Any = None,
    workers: int | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Compile, in parallel and before the first forward, the kernels ``model`` (a transformers model, or
    its config) will run on through :func:`register`'s implementation; returns their names
    (:func:`flash_attention.precompile` says how they are chosen).

    Read from the (text) config: head_dim (a multi-head latent attention's, DeepSeek's: q's and k's
    ``qk_nope_head_dim + qk_rope_head_dim``, v's ``v_head_dim``), the query and key/value head counts, the
    sliding window of the layers that have one (``layer_types``, ``use_sliding_window``), logit
    soft-capping, attention dropout; the dtype from the model's parameters (a config's ``dtype``, else
    bfloat16). ``training`` (default: the model's mode; False for a config) adds the backward's kernels and
    dropout's; ``generate`` (default: not training) adds the decode kernels of ``generate()`` (a dynamic or
    static cache). ``padded`` adds the kernels of padded batches (a padding mask: key ranges). ``seqlens``,
    ``device``, ``workers`` and ``dry_run`` as :func:`flash_attention.precompile` takes them. Attention
    sinks (gpt-oss) need no kernel of their own.
    """
    from ..api.precompile import jobs_for_calls
    from ..ops.precompile import compile_jobs

    is_module = isinstance(model, torch.nn.Module)
    config = getattr(model, "config", model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads_q = getattr(text, "num_attention_heads", None)
    if not isinstance(heads_q, int):
        raise ValueError(f"model: its config has no num_attention_heads ({type(config).__name__})")
    heads_kv = getattr(text, "num_key_value_heads", None) or heads_q
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads_q
    head_dim_v = None
    nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
    if isinstance(nope, int) and isinstance(rope, int):  # (its head_dim is the rotary part's alone)
        head_dim, head_dim_v = nope + rope, getattr(text, "v_head_dim", None)
    if is_module:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    else:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"model: its dtype is {dtype}; the kernels run float16 and bfloat16 (float32 runs the fallback, "
            "which compiles nothing)"
        )
    training = (is_module and model.training) if training is None else training
    generate = not training if generate is None else generate
    softcap = float(getattr(text, "attn_logit_softcapping", None) or 0.0)
    dropout_p = float(getattr(text, "attention_dropout", 0.0) or 0.0) if training else 0.0
    # Which layers attend within a window: layer_types where the config has them (Gemma 2/3, gpt-oss,
    # Qwen), else every layer when sliding_window is set and not switched off (Mistral).
    sliding = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or []
    if sliding and getattr(text, "use_sliding_window", True) is not False:
        has_window = not layer_types or "sliding_attention" in layer_types
        has_full = bool(layer_types) and any(t != "sliding_attention" for t in layer_types)
    else:
        has_window, has_full = False, True
    jobs = []
    # A layer of W keys runs window=(W - 1, 0) (_sliding_window_left); at lengths it covers whole, the plain
    # causal build (the choice is the calls' own: ops.precompile.kernel_jobs).
    common = dict(
        dtype=dtype, heads_q=heads_q, heads_kv=heads_kv, softcap=softcap, seqlens=seqlens, device=device,
        head_dim_v=head_dim_v,
    )  # fmt: skip
    for window in ([(int(sliding) - 1, 0)] if has_window else []) + ([None] if has_full else []):
        for key_range in (False, True) if padded else (False,):
            jobs += jobs_for_calls(
                head_dim, causal=True, window=window, key_range=key_range, dropout_p=dropout_p,
                training=training, decode=generate, decode_queries=_DECODE_QUERIES, **common,
            )  # fmt: skip
        if generate and padded:
            # A padded static cache's decoding step: its own queries against the cache's valid keys, as
            # key ranges, without causal (attention_forward's explicit-mask route).
            jobs += jobs_for_calls(
                head_dim, causal=False, window=window, key_range=True, decode=True, decode_queries=(1,),
                **common,
            )  # fmt: skip
    jobs = list(dict.fromkeys(jobs))
    if not dry_run:
        compile_jobs(jobs, workers)
    return [job.describe() for job in jobs]


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
    # A causal sliding window (create_sliding_window_causal_mask: local_size is the window W, and a key is
    # seen iff q - W < k <= q): the kernel's window (W - 1, 0), marked on the 2-D key mask returned below.
    left = _sliding_window_left(mask_function, kwargs.get("local_size"))
    if left is not None:
        causal = True

    if "q_length" in kwargs:
        q_length, q_offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    else:  # transformers < 5.x took the query positions instead of their count and offset
        cache_position = kwargs["cache_position"]
        q_length = cache_position.shape[0]
        q_offset = int(cache_position[0]) if q_length else 0
    kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)

    lengths = _static_cache_lengths(kwargs, causal, q_length, q_offset, kv_length, kv_offset, left)
    if lengths is not None:
        return lengths

    # transformers vetoes skipping the mask for a compileable (static) cache's one-token steps, so that its
    # own SDPA route keeps one mask shape; the kernels need none when the query is the last of the keys
    # (checked below; a static cache's sliding layer decoding over its full window). Only that veto is
    # overridden: the others (packed sequences, and/or mask functions) mean the mask is more than causal.
    may_skip = (
        (kwargs.get("allow_is_causal_skip", True) or q_length == 1)
        if causal
        else kwargs.get("allow_is_bidirectional_skip", False)
    )
    simple = (
        (causal or mask_function is bidirectional_fn)
        and may_skip
        and (kwargs.get("local_size") is None or left is not None)
        # Static caches pass tensor offsets (to avoid graph breaks); reading them would force a sync and
        # their keys include empty slots: the 4-D mask handles that.
        and not isinstance(q_offset, torch.Tensor)
        and not isinstance(kv_offset, torch.Tensor)
    )
    width = kv_length  # the keys the layers read: the first `width`
    if simple and causal:
        # The kernel aligns causal masks to the last key it reads: the queries must be the last q_length of
        # those keys. Keys after the last query (a static cache's empty slots past its prefill) no query
        # sees; the key mask leaves them out, and the attention function does not read them.
        width = q_offset - kv_offset + q_length
        simple = q_length <= width <= kv_length
    if not simple:
        return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
    if left is not None and width - 1 <= left:
        left = None  # no query is far enough from the first key for the window to hide one: plain causal

    padding = kwargs.get("attention_mask")
    if padding is None and (left is not None or width < kv_length):
        # The window, or the keys left out, travel on the 2-D key mask (all True), which every layer receives.
        batch = kwargs["batch_size"]
        valid = torch.ones(batch, width, dtype=torch.bool, device=kwargs.get("device"))
        # Its ranges are known: remembered, so no layer reads this mask back from the device.
        fn.memo(valid, "key_ranges", lambda: fn.KeyRanges((0,) * batch, (width,) * batch))
        return valid if left is None else _with_window(valid, left)
    if padding is None:
        return None
    valid = _padding_keys(padding, kv_offset, width)
    if left is not None:
        return _with_window(valid, left)
    # The one host read of the mask per forward pass: whether there is padding at all, and if so the key
    # ranges the layers' calls will use, remembered on `valid` (which every layer receives).
    ranges = fn.key_ranges(valid)
    if ranges is not None and ranges.is_full(width) and width == kv_length:
        return None
    return valid


def _padding_keys(padding: torch.Tensor, kv_offset: int, kv_length: int) -> torch.Tensor:
    """The (batch, kv_length) boolean key mask of a 2-D padding mask: it covers absolute positions 0..N-1
    (True = real token); positions past it are not attendable (transformers pads it with False); the keys
    are positions kv_offset..kv_offset+kv_length-1."""
    padding = padding.to(dtype=torch.bool)
    missing = kv_offset + kv_length - padding.shape[-1]
    if missing > 0:
        padding = torch.nn.functional.pad(padding, (0, missing), value=False)
    return padding[:, kv_offset : kv_offset + kv_length]


def _sliding_window_left(mask_function: Callable, local_size: object) -> int | None:
    """W - 1 when ``mask_function`` is a causal sliding window of ``local_size`` = W keys (a key k is seen
    from query q iff q - W < k <= q), else None. transformers builds that function as a closure, so it is
    recognised by what it answers at the window's edges (one call on 24 index pairs, as the 1-D index
    tensors transformers' own non-vmap mask construction passes), never by name."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        return None
    w = local_size
    pairs = [
        (q, k)
        for q in (w - 1, w, w + 5, 3 * w + 2)
        for k in (q - w - 1, q - w, q - w + 1, q - 1, q, q + 1)
        if k >= 0
    ]
    q_idx = torch.tensor([q for q, _ in pairs])
    kv_idx = torch.tensor([k for _, k in pairs])
    want = (kv_idx > q_idx - w) & (kv_idx <= q_idx)
    zero = torch.zeros_like(q_idx)
    try:
        got = mask_function(zero, zero, q_idx, kv_idx)
        same = isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got.bool(), want)
    except Exception:  # a mask function that indexes other tensors (padding, packing): not a plain window
        return None
    return w - 1 if same else None


def _static_cache_lengths(
    kwargs: dict, causal: bool, q_length: int, q_offset, kv_length: int, kv_offset, left: int | None
):
    """The static-cache route's mask (the module docstring): each row's filled length as an int32 (batch,)
    device tensor, None when the call is not one the route takes, or -- for lengths this function made
    earlier that the route cannot take now -- their 4-D mask. A sliding layer's (``left``: its window's
    W - 1) lengths are a tensor of their own, marked with the window as the 2-D key masks are."""
    padding = kwargs.get("attention_mask")
    # generate() makes a static cache's masks ahead of the model's forward and hands them to it as its
    # attention_mask, so the model's own mask creation sees the lengths made here: they are this step's.
    ours = isinstance(padding, torch.Tensor) and padding.dim() == 1
    static = (
        isinstance(q_offset, torch.Tensor)  # a static cache's offset while decoding
        or (ours or q_offset + q_length < kv_length)  # its prefill: keys past the queries
    )
    takes = (
        causal
        and static
        and not isinstance(kv_offset, torch.Tensor)
        and kv_offset == 0
        and (kwargs.get("local_size") is None or left is not None)
        and 0 < q_length <= STATIC_CACHE_MAX_QUERIES
        and not torch.is_grad_enabled()
    )
    if ours:
        if not takes:
            return _static_cache_mask(padding, q_length, kv_length, left)
        return padding if left is None else _with_window(padding.clone(), left)
    if not takes:
        return None
    runs = None
    if padding is not None:
        valid = padding.to(dtype=torch.bool)
        ranges = fn.key_ranges(valid)  # the one host read of the mask per forward pass
        if ranges is None:
            return None  # holes in the padding: the 4-D mask
        if not ranges.is_full(valid.shape[-1]):
            # Padding: a decoding step's one query sees its row's run of real tokens up to itself, a key
            # range. Padded prefills (int offsets) take the 2-D key mask; speculative steps the 4-D mask.
            if q_length != 1 or left is not None or not isinstance(q_offset, torch.Tensor):
                return None
            runs = ranges.tensor(valid.device)
    batch = kwargs["batch_size"]
    if isinstance(q_offset, torch.Tensor):
        lengths = (q_offset.reshape(1).to(torch.int32) + q_length).expand(batch).contiguous()
    else:
        device = kwargs.get("device", "cpu")
        lengths = torch.full((batch,), q_offset + q_length, dtype=torch.int32, device=device)
    if runs is not None:
        # Each row's keys: from its first real token to the end of its run or of the filled slots, computed
        # on the device (the filled length is there, never read).
        ends = torch.minimum(runs[:, 1], lengths.to(runs.device))
        lengths._flash_attention_key_range = torch.stack((runs[:, 0], ends), dim=1)
    return lengths if left is None else _with_window(lengths, left)


def _with_window(mask: torch.Tensor, left: int) -> torch.Tensor:
    """``mask`` marked with a causal sliding window of ``left`` + 1 keys (the kernels' (left, 0)), which
    every layer of the kind receives with it."""
    mask._flash_attention_window = (left, 0)
    return mask


def _static_cache_mask(
    lengths: torch.Tensor, q_length: int, kv_length: int, left: int | None = None
) -> torch.Tensor:
    """The 4-D boolean mask (True = attend) of the static-cache route's call: row b's query i sees slot j iff
    ``j <= i + lengths[b] - q_length`` (which also keeps the empty slots out), with a sliding window of
    ``left`` + 1 keys also ``j >= i + lengths[b] - q_length - left``, and for padded rows (the lengths'
    key ranges) only ``start[b] <= j < end[b]``."""
    slots = torch.arange(kv_length, device=lengths.device)
    last = torch.arange(q_length, device=lengths.device)[:, None] + (lengths[:, None, None] - q_length)
    seen = slots[None, None, :] <= last
    if left is not None:
        seen &= slots[None, None, :] >= last - left
    key_range = getattr(lengths, "_flash_attention_key_range", None)
    if key_range is not None:
        starts, ends = key_range[:, 0, None, None], key_range[:, 1, None, None]
        seen &= (slots[None, None, :] >= starts) & (slots[None, None, :] < ends)
    return seen[:, None]


# ------------------------------------------------------------------------------------------------------
# The attention function


def _explicit_mask(
    mask: torch.Tensor | None,
    q_length: int,
    kv_length: int,
    causal: bool,
    device: torch.device,
    *,
    square_causal_flag: bool,
) -> torch.Tensor | None:
    """What our function computes for ``mask``, as the 4-D boolean mask (True = attend) or None that a
    function taking transformers' 4-D masks needs: a 4-D mask as it is; for None or a 2-D key mask, the
    bottom-right causal mask and the key mask. ``square_causal_flag``: the function applies ``is_causal``
    itself when there is no mask and q_length == kv_length (SDPA does; eager functions have no such flag)."""
    if mask is not None and mask.dim() != 2:
        return mask
    allowed = None
    window = getattr(mask, "_flash_attention_window", None)  # our mask function's sliding window
    if causal and q_length > 1 and not (square_causal_flag and mask is None and q_length == kv_length):
        # transformers' SDPA function aligns is_causal to the top-left (and crops the keys), and eager
        # functions know no causality but the mask's: say bottom-right explicitly.
        allowed = causal_allowed(q_length, kv_length, device=device)[None, None]
    if window is not None:
        band = window_allowed(q_length, kv_length, window, device=device)[None, None]
        allowed = band if allowed is None else allowed & band
    if mask is not None:
        valid = mask[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one eager functions add to the scores: 0 where True, the dtype's
    minimum elsewhere (exactly transformers' ``eager_mask``). Float masks are additive already."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def _eager_function(module: torch.nn.Module) -> Callable | None:
    """The ``eager_attention_forward`` of the modeling module that defines the attention module's class (or
    one of its bases): what ``attn_implementation="eager"`` runs for this module. None if there is none."""
    for cls in type(module).__mro__:
        found = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(found):
            return found
    return None


def _generic_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with everything transformers' attention functions pass: the fallback for attention
    modules whose modeling module defines no ``eager_attention_forward``.

    Scores ``query @ key^T * scaling`` (GQA: query head ``h`` uses kv head ``h // group``), soft-capped to
    ``softcap * tanh(scores / softcap)``, plus ``position_bias``, plus the additive ``attention_mask``; the
    sinks (``s_aux`` of shape (heads,) as gpt-oss passes them, or ``sinks`` broadcastable to (batch, heads,
    q_length, 1)) as one extra logit per row that takes part in the softmax and is then dropped; softmax in
    float32, dropout when the module is training, times ``value``. Returns ``(output of shape (batch,
    q_length, heads, head_dim), the attention weights)``, like the modeling modules' eager functions.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    sink = s_aux if s_aux is not None else sinks
    if sink is not None:
        sink = sink.reshape(1, -1, 1, 1) if sink.dim() == 1 else sink
        sink = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores.float(), dim=-1)
    weights = torch.nn.functional.dropout(weights.to(query.dtype), p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    needs: list[str],
    *,
    dropout: float,
    scaling: float | None,
    causal: bool,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call through the model's own eager attention function, with the mask it expects."""
    eager = _eager_function(module)
    if eager is not None:
        which = f"the model's eager attention function ({eager.__module__}.{eager.__qualname__})"
    else:
        eager = _generic_eager_attention
        which = (
            f"flash_attention's generic eager attention ({type(module).__module__} defines no "
            "eager_attention_forward)"
        )
    what = ", ".join(_EAGER_KWARGS[name] for name in needs)
    fn.warn_once(
        f"transformers-eager:{','.join(needs)}",
        f"no kernel route takes this call with {what} (a position bias, a mask the kernels cannot express, "
        f"or tensors they cannot read): such calls run through {which}, "
        "which computes it exactly but materialises the attention scores (slower, more memory)",
        stacklevel=4,
        source="flash_attention.integrations.transformers",
    )
    mask = _explicit_mask(
        attention_mask, query.shape[2], key.shape[2], causal, query.device, square_causal_flag=False
    )
    if scaling is None:  # not every eager function has a default (gpt-oss's requires it)
        scaling = query.shape[-1] ** -0.5
    return eager(
        module, query, key, value, _additive(mask, query.dtype), dropout=dropout, scaling=scaling, **kwargs
    )


def _check_dropout(dropout: object) -> None:
    # The kernel would reject a bad value too, but under the name of its own argument (dropout_p).
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1]; got {type(dropout).__name__}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must be a float in [0, 1]; got {dropout!r}")


def _check_mask(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (1, 2, 4):
        got = f"a {mask.dim()}-D tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            "attention_mask must be None, a 1-D int32 (batch,) tensor of static-cache lengths or a 2-D "
            "boolean (batch, kv_length) key mask (our mask function's), or a 4-D mask (transformers'); "
            f"got {got}"
        )
    if mask.dim() == 1 and (mask.dtype != torch.int32 or tuple(mask.shape) != (query.shape[0],)):
        raise ValueError(
            f"a 1-D attention_mask must be the int32 static-cache lengths of shape (batch,) = "
            f"({query.shape[0]},); got {mask.dtype} of shape {tuple(mask.shape)}"
        )
    if mask.dim() == 2 and (
        mask.dtype != torch.bool or mask.shape[0] != query.shape[0] or mask.shape[1] > key.shape[2]
    ):
        raise ValueError(
            f"a 2-D attention_mask must be boolean of shape (batch, n) with batch = {query.shape[0]} and "
            f"n <= kv_length = {key.shape[2]} (True = attend; the keys are the first n); got "
            f"{mask.dtype} of shape {tuple(mask.shape)}"
        )


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered with ``AttentionInterface``.

    Same signature and result as transformers' ``sdpa_attention_forward``: ``query`` (batch, heads,
    q_length, head_dim), ``key``/``value`` (batch, kv_heads, kv_length, head_dim) with ``module.
    num_key_value_groups`` query heads per kv head (read in place, never repeated, on the kernel path);
    returns ``(output of shape (batch, q_length, heads, head_dim), None)`` -- or, on the eager route, the
    eager function's ``(output, attention weights)``. ``attention_mask`` is what our mask function made
    (None, a 2-D boolean key mask, a 4-D mask) or a 4-D mask the caller passed. ``dropout`` (in [0, 1]) is
    applied as given: transformers' models pass 0.0 outside training. The module docstring says which
    route each call takes.

    Raises:
        ValueError, TypeError: ``dropout`` or ``attention_mask`` of the wrong kind, naming it.
        NotImplementedError: sparse-attention ``indices``/``block_indices`` (no route here computes them).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _check_dropout(dropout)
    _check_mask(attention_mask, query, key)
    unsupported = [name for name in _UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(
            f"attention_forward got {', '.join(unsupported)} (sparse attention: the keys each query may "
            "attend), which neither our kernel nor transformers' eager/SDPA functions compute; such models "
            "add them to the mask only for attn_implementation='eager' or 'sdpa': use one of those"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    needs_eager = [name for name in _EAGER_KWARGS if kwargs.get(name) is not None]
    # Soft-capping and sinks the kernels compute (attention(softcap=, sinks=), the decode kernels too) on
    # their own routes; where none takes the call (SDPA computes neither), the eager function does. None:
    # an argument no kernel computes.
    extra = _kernel_variants(needs_eager, kwargs, query.shape[1])
    if attention_mask is not None and attention_mask.dim() == 1:
        # Decoding from a static cache (the module docstring): the decode kernels, or the explicit mask; a
        # sliding layer's lengths carry its window.
        window = getattr(attention_mask, "_flash_attention_window", None)
        key_range = getattr(attention_mask, "_flash_attention_key_range", None)
        if (
            extra is not None
            and causal
            and (key_range is None or query.shape[2] == 1)
            and dropout == 0.0
            and kwargs.get("cache") is None
            and query.shape[-1] <= MAX_HEAD_DIM
            and value.shape[-1] == query.shape[-1]
            and query.dtype == key.dtype == value.dtype
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        ):
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            if key_range is not None:
                # A padded batch's decoding step: its one query sees its row's key range, which the forward
                # kernel takes (the decode kernels have no first key per row).
                out = attention(q, k, v, causal=False, softmax_scale=scaling, key_range=key_range, **extra)
                return out, None
            out = attention_with_kvcache(
                q, k, v, cache_seqlens=attention_mask, causal=True, softmax_scale=scaling, window=window,
                **extra,
            )  # fmt: skip
            return out, None
        left = None if window is None else window[0]
        attention_mask = _static_cache_mask(attention_mask, query.shape[2], key.shape[2], left)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < key.shape[2]:
        # Our mask function left out the keys after the last query (a static cache's empty slots past its
        # prefill), which no query sees: every route reads only the mask's keys, causal aligned to the last.
        width = attention_mask.shape[1]
        key, value = key[:, :, :width], value[:, :, :width]
    if extra is None:
        return _eager_route(
            module, query, key, value, attention_mask, needs_eager, dropout, scaling, causal, kwargs
        )

    q_length, kv_length = query.shape[2], key.shape[2]
    head_dim = query.shape[-1]
    # The library's layout, as views: (batch, seqlen, heads, head_dim); the kernel takes these strides.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    packed = _packed_sequences(attention_mask, query, key, value, causal, kwargs)
    if packed is not None and extra is not None:
        # Packed sequences (position_ids restarting, no padding, no cache): one varlen call. (squeeze, not
        # [0]: select's backward would fill and copy a batched gradient for each of q, k and v.)
        cu, window, longest = packed
        out = attention_varlen(
            q.squeeze(0), k.squeeze(0), v.squeeze(0), cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
            causal=True, window=window, softmax_scale=scaling, dropout_p=dropout, **extra,
        )  # fmt: skip
        return out.unsqueeze(0), None

    kernel_ok = (
        (attention_mask is None or attention_mask.dim() == 2)
        and kwargs.get("cache") is None  # a paged cache: transformers' function updates it
        and head_dim <= MAX_HEAD_DIM
        and value.shape[-1] == head_dim
        and query.dtype == key.dtype == value.dtype
        and dropout < 1.0  # the kernels take p in [0, 1); p == 1 (everything dropped) goes to SDPA
        and not fn.needs_pytorch_path(q, k, v, dropout_p=dropout, stacklevel=5)
    )
    if kernel_ok:
        if attention_mask is None:
            if (
                causal
                and dropout == 0.0
                and 0 < q_length <= STATIC_CACHE_MAX_QUERIES < kv_length
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
            ):
                # A decoding step on a DynamicCache (the keys are the whole cache, the queries its last
                # q_length positions): the split-KV decode kernels, the cache read in place, no append.
                out = attention_with_kvcache(
                    q, k, v, cache_seqlens=kv_length, causal=True, softmax_scale=scaling, **extra
                )
                return out, None
            return attention(q, k, v, causal=causal, softmax_scale=scaling, dropout_p=dropout, **extra), None
        # A 2-D key mask: one kernel call with per-batch key ranges when each row's valid keys are one run,
        # and the sliding window our mask function marked on it.
        window = getattr(attention_mask, "_flash_attention_window", None)
        ranges = fn.plan_padded(attention_mask) if attention_mask.device == query.device else None
        if ranges is not None:
            out = fn.key_range_attention(
                q, k, v, ranges, causal=causal or window is not None, scale=scaling, dropout_p=dropout,
                window=window, **extra,
            )  # fmt: skip
            return out, None
    if needs_eager:  # soft-capping or sinks that no kernel route took
        return _eager_route(
            module, query, key, value, attention_mask, needs_eager, dropout, scaling, causal, kwargs
        )

    # A 4-D mask, key padding with holes, or what the kernel cannot take (a marked sliding window
    # included, whose band _explicit_mask adds): transformers' SDPA function, which computes exactly that
    # mask.
    if fn.kernel_expected(query):  # (on the CPU every route is PyTorch: nothing to say)
        reason = _sdpa_reason(attention_mask, query, key, value, dropout, kwargs)
        fn.warn_once(
            f"transformers-sdpa:{reason}",
            f"attention calls with {reason} run through transformers' SDPA function with the equivalent "
            "mask, not our kernels",
            stacklevel=3,
            source="flash_attention.integrations.transformers",
        )
    mask = _explicit_mask(attention_mask, q_length, kv_length, causal, query.device, square_causal_flag=True)
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
    )


def _sdpa_reason(attention_mask, query, key, value, dropout, kwargs) -> str:
    """Why a call took the SDPA route, in words for its one-time warning."""
    if kwargs.get("cache") is not None:
        return "a paged cache (cache=, which transformers' function updates)"
    if query.shape[-1] > MAX_HEAD_DIM or value.shape[-1] != query.shape[-1]:
        return f"head_dim {query.shape[-1]} (values {value.shape[-1]}; the kernels take up to {MAX_HEAD_DIM})"
    if not query.dtype == key.dtype == value.dtype:
        return "q, k and v of different dtypes"
    if dropout >= 1.0:
        return "dropout 1 (everything dropped)"
    if attention_mask is not None and attention_mask.dim() == 2:
        return "key padding with holes (valid keys not one run per row)"
    return (
        "a 4-D mask (a static cache's padded speculative steps, a chunked or "
        "bidirectional window, a custom mask function, or packed documents whose mask is not causal per "
        "document)"
    )


def _packed_sequences(attention_mask, query, key, value, causal, kwargs) -> tuple | None:
    """``(cu_seqlens, window, longest)`` when this call is a packed batch that attention_varlen computes
    exactly: one row of several sequences (``position_ids`` restarting, as DataCollatorWithFlattening makes
    them), whose 4-D boolean mask transformers built as causal within each sequence (and, on a sliding
    layer, its window). The mask is compared once with the sequences' runs (one host read per mask: every
    layer of a kind receives the same tensor, which remembers the verdict); anything else is None."""
    if (
        attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[0] != 1
        or attention_mask.shape[1] != 1
        or not causal
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]
        or kwargs.get("cache") is not None
        or query.shape[-1] > MAX_HEAD_DIM
        or value.shape[-1] != query.shape[-1]
        or not query.dtype == key.dtype == value.dtype
        or tuple(attention_mask.shape[-2:]) != (query.shape[2], key.shape[2])
    ):
        return None
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != query.shape[2]:
        return None
    sliding = kwargs.get("sliding_window")
    window = (int(sliding) - 1, 0) if isinstance(sliding, int) and sliding > 0 else None
    memo = getattr(attention_mask, "_flash_attention_packed", {})
    # (The memo holds position_ids too: an address and a version name its contents only while it lives.)
    key_ = (window, position_ids.data_ptr(), position_ids._version)
    if key_ in memo:
        return memo[key_][0]
    positions = position_ids.reshape(-1).to(attention_mask.device)
    length = positions.numel()
    # A sequence starts wherever the position does not follow the previous one (transformers' own rule).
    starts = torch.ones(length, dtype=torch.bool, device=positions.device)
    starts[1:] = positions[1:] != positions[:-1] + 1
    first = starts.nonzero().flatten()  # (the host read)
    cu = torch.cat((first, first.new_tensor([length]))).to(torch.int32)
    verdict = None
    if first.numel() > 1:
        row_keys, _ = segments(cu, cu, length, length, causal=True, window=window)
        cols = torch.arange(length, device=cu.device)
        runs = (cols[None, :] >= row_keys[:, :1]) & (cols[None, :] < row_keys[:, 1:])
        if torch.equal(runs, attention_mask[0, 0].to(runs.device)):
            verdict = (cu, window, int((cu[1:] - cu[:-1]).max()))
    memo[key_] = (verdict, position_ids)
    attention_mask._flash_attention_packed = memo
    return verdict


def _kernel_variants(needs_eager: list[str], kwargs: dict, heads_q: int) -> dict | None:
    """attention()'s arguments for the keyword arguments in ``needs_eager`` (soft-capping: ``softcap=``; a
    (heads,) tensor of sink logits, as gpt-oss passes ``s_aux``: ``sinks=``), or None when one of them is
    something the kernels do not compute (a position bias, sinks of another shape)."""
    extra: dict = {}
    for name in needs_eager:
        value = kwargs[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name == "softcap" and number and value > 0:
            extra["softcap"] = float(value)
        elif (
            name in ("s_aux", "sinks")
            and "sinks" not in extra
            and isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and tuple(value.shape) == (heads_q,)
        ):
            extra["sinks"] = value
        else:
            return None
    return extra


def _eager_route(module, query, key, value, attention_mask, needs_eager, dropout, scaling, causal, kwargs):
    """The calling model's own eager attention function, for what no kernel route computes."""
    if kwargs.get("cache") is not None:
        raise NotImplementedError(
            f"attention_forward got {', '.join(needs_eager)} with a paged cache (cache=): the eager "
            "route that computes them cannot update a paged cache; use attn_implementation='paged|eager'"
        )
    return _eager_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        needs_eager,
        dropout=dropout,
        scaling=scaling,
        causal=causal,
        kwargs=kwargs,
    )
