"""The public API: :func:`attention`, and the low-level :func:`forward` / :func:`forward_timed`.

Everything here validates first (``spec.validate``), handles empty problems without launching anything, then
hands the work to our CUDA kernels (:mod:`flash_attention.ops`) or to
:func:`flash_attention.fallback.forward` (the PyTorch fallback, same semantics); the choice is
:mod:`flash_attention.ops.dispatch`'s.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal, overload

import torch

from .. import fallback as _fallback
from ..configs import KernelConfig, parse_config
from ..dropout import MAX_DROPOUT_P, draw_seed
from ..ops import dispatch
from ..ops import repeat as _repeat
from ..ops.plans import check_segments
from ..sinks import apply_sinks, check_sinks
from ..spec import AttentionSpec, launch_variants, pack_options
from ..spec import fp8 as _fp8
from ..spec.validate import Problem, check_score, check_window, score_spec, validate
from ..torch_ops.attention import eager_training
from . import few_queries as _few_queries

__all__ = ["attention", "forward", "forward_timed"]


def _empty_result(
    q: torch.Tensor, problem: Problem, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of a problem with no output element or no key: out 0, lse -inf (no launch)."""
    if out is None:
        out = torch.zeros((*q.shape[:3], problem.value_dim), dtype=q.dtype, device=q.device)
    else:
        out.zero_()
    lse = torch.full(
        (problem.batch, problem.heads_q, problem.seqlen_q),
        float("-inf"),
        dtype=torch.float32,
        device=q.device,
    )
    return out, lse


def _check_fp8_true(q, k, v, fp8, descales) -> None:
    """``fp8=True``'s arguments: bf16 q, k and v and no descales, else TypeError or ValueError naming them."""
    if fp8 is not True:
        raise TypeError(f"fp8 must be a bool; got {fp8!r}")
    given = [n for n, d in zip(_fp8.DESCALE_NAMES, descales, strict=True) if d is not None]
    if given:
        raise ValueError(f"fp8=True quantizes bf16 inputs itself: {', '.join(given)} is for e4m3 inputs")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 4:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"fp8=True takes 4-D bfloat16 q, k and v; {name} is {got}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")


def _quantized_through(q, k, v):
    """``fp8=True`` off the e4m3 kernel: bf16 q, k and v quantized to e4m3 per (batch, kv head) and
    dequantized back (spec.fp8), the values the FP8 call computes on, each with the gradient of its bf16
    tensor passed through."""
    return [_QuantizedThrough.apply(t, k.shape[2]) for t in (q, k, v)]


class _QuantizedThrough(torch.autograd.Function):
    """t's e4m3 round trip (spec.fp8: quantize, then dequantize to bf16), with the gradient passed through
    unchanged (t + (round trip - t).detach() would round the value in bf16's additions)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, heads_kv: int) -> torch.Tensor:
        from ..ops import fp8_cast  # (here: only FP8 calls pay for its import)

        return fp8_cast.dequantize(*fp8_cast.quantize(t, heads_kv), heads_kv, powers_of_two=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _result(
    out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not return_lse:
        return out
    assert lse is not None, "the op was asked for the LSE and returned none"
    return out, lse


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[False] = ...,
    out: torch.Tensor | None = ...,
    key_range: torch.Tensor | None = ...,
    deterministic: bool = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    window: tuple[int, int] | None = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ...,
    q_descale: torch.Tensor | None = ...,
    k_descale: torch.Tensor | None = ...,
    v_descale: torch.Tensor | None = ...,
    fp8: bool = ...,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[True],
    out: torch.Tensor | None = ...,
    key_range: torch.Tensor | None = ...,
    deterministic: bool = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    window: tuple[int, int] | None = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ...,
    q_descale: torch.Tensor | None = ...,
    k_descale: torch.Tensor | None = ...,
    v_descale: torch.Tensor | None = ...,
    fp8: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    key_range: torch.Tensor | None = None,
    deterministic: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    fp8: bool = False,
    _segments: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, computed tile by tile on CUDA.

    Args:
        q: queries, shape (batch, seqlen_q, heads_q, head_dim) -- the layout of the FlashAttention library.
        k: keys, shape (batch, seqlen_k, heads_kv, head_dim).
        v: values, shape (batch, seqlen_k, heads_kv, head_dim_v): head_dim_v is head_dim for most models;
            another (1 to 256: DeepSeek's multi-head latent attention prefills with q/k 192 and v 128)
            runs on Hopper's warp-specialized forward where v is narrower than q, and the backward on q's
            head_dim's kernels with v padded to it; elsewhere on the PyTorch fallback, with its one-time
            warning on CUDA (as does a KV cache whose v_cache has its own head_dim,
            :func:`attention_with_kvcache`).
            q, k and v share one dtype (float16, bfloat16, float32 or float64) and one device. head_dim is
            any size from 1 to 256 (on the kernels, one that is not a multiple of 8 runs zero-padded to
            the next multiple, at the cost of a copy of q, k and v). Any other stride is allowed as long as
            the last dimension is contiguous, so (batch, heads, seqlen, head_dim) tensors passed as
            ``x.transpose(1, 2)`` need no copy. heads_q must be a multiple of heads_kv: query head ``h``
            attends with kv head ``h // (heads_q // heads_kv)`` (grouped-query attention; heads_kv == 1 is
            multi-query), and K/V are never copied to expand the heads.
        causal: mask out keys "in the future", aligned to the bottom-right corner as in FlashAttention
            2.1+: query ``i`` attends key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. When seqlen_q >
            seqlen_k the first ``seqlen_q - seqlen_k`` query rows see no key at all. PyTorch's
            ``scaled_dot_product_attention(is_causal=True)`` is top-left aligned (``j <= i``): the two
            differ whenever seqlen_q != seqlen_k. SDPA's equivalent of this mask is
            ``attn_mask=torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)``.
        softmax_scale: multiplier of the scores before the softmax; default ``1 / sqrt(head_dim)``. Any
            finite nonzero float.
        return_lse: also return the log-sum-exp of each row's scaled scores.
        out: optional preallocated output of q's shape with v's head_dim, and q's dtype (last dimension
            contiguous), written in
            place and returned. Not allowed while autograd records the call (grad mode on and q, k or v
            requiring grad): as with PyTorch's own ``out=`` variants, that raises RuntimeError, because a
            gradient cannot flow through a caller's buffer.
        key_range: optional integer tensor of shape (batch, 2) on q's device: batch row ``b`` attends only
            keys ``key_range[b, 0] <= j < key_range[b, 1]`` -- key padding on the right, the left or both,
            handled inside the kernel (no mask is materialised, nothing is read back to the host). It
            combines with ``causal``, whose alignment stays on the full key axis. Values are clamped to
            [0, seqlen_k] (and end to at least start); a row whose range is empty gets 0, like any row
            with no visible key.
        deterministic: only affects the backward pass. True makes the gradients bitwise identical from
            run to run (same inputs, same GPU), at a cost in speed; the default may accumulate dQ with
            atomic additions, whose order varies, so repeated backward passes can differ in the last bits.
            ``torch.use_deterministic_algorithms(True)`` selects it too. The PyTorch fallback is
            deterministic either way.
        dropout_p: attention dropout: each probability is dropped with probability ``dropout_p`` (in
            [0, 1)) and the kept ones are scaled by ``1 / (1 - dropout_p)``; the LSE stays that of the
            full softmax. The kernels draw the decisions from a counter-based hash of (seed, batch, head,
            query, key), so nothing is stored: the backward regenerates the forward's mask, and the CPU
            fallback drops exactly the same elements for the same seed. 0 (the default) runs kernels
            without any dropout code.
        dropout_seed: the seed of the mask (reproducible calls); default: drawn from PyTorch's CPU
            generator, so ``torch.manual_seed`` makes runs reproducible.
        window: a sliding window ``(left, right)`` around the bottom-right-aligned diagonal (as in the
            FlashAttention library's ``window_size``; -1 leaves a side unbounded): query ``i`` attends key
            ``j`` iff ``i + shift - left <= j <= i + shift + right`` with ``shift = seqlen_k - seqlen_q``,
            in addition to ``causal`` (which makes ``right`` 0) and ``key_range``. The kernels skip the
            key blocks outside the window, so the cost grows with the window, not the sequence (Mistral:
            ``window=(4095, 0)`` with ``causal=True``).
        softcap: > 0 caps the scaled scores before the softmax, ``softcap * tanh(s / softcap)`` (Gemma 2,
            Grok), with its exact gradient; the LSE is that of the capped scores. 0 (the default): none.
        alibi_slopes: ALiBi, a float32 tensor of shape (heads_q,) or (batch, heads_q) on q's device: the
            score of query ``i`` and key ``j`` gets ``-slope * |i + seqlen_k - seqlen_q - j|`` (aligned like
            causal, as in the FlashAttention library). With ``softcap``, added to the capped score (the
            FlashAttention library's order).
        sinks: attention sinks (gpt-oss), a floating tensor of shape (heads_q,) on q's device: head ``h``'s
            logit ``sinks[h]`` joins every row's softmax denominator (on the scale of the scaled scores)
            without a value, so a row's probabilities sum to less than one; the returned LSE includes it.
            Differentiable: with ``sinks.requires_grad`` its gradient is returned too
            (:mod:`flash_attention.sinks` says how every kernel computes it).
        q_descale, k_descale, v_descale: FP8 inputs. With q, k and v of dtype ``torch.float8_e4m3fn``, the
            call computes attention of the dequantized tensors ``float(q) * q_descale`` (and k's, v's), every
            option applying as for a bf16 call, and returns a bfloat16 output (and a float32 LSE). Each
            descale is None (1), a float32 tensor of one element (per tensor), or of shape (batch, heads_kv)
            (per kv head; a query head takes its group's, as in FlashAttention-3). On Hopper at head_dim 64,
            128 or 256 with no option beyond ``causal``, the e4m3 kernel (P rounded to e4m3 for P V:
            docs/usage.md); elsewhere the inputs dequantized to bfloat16 on the bf16 path. No autograd on
            e4m3 tensors: :func:`flash_attention.attention_fp8_backward` gives the gradients with respect
            to the dequantized tensors.
        fp8: with bfloat16 q, k and v, quantize each to e4m3 first (a descale per (batch, kv head): its amax
            over 448 rounded up to a power of two, q's over its GQA group) and compute as for e4m3 inputs;
            gradients flow to the bf16 tensors with the quantization passed through (its derivative taken
            as 1, as FP8 training recipes do for their GEMMs), from the bf16 backward on the dequantized
            tensors.

    Returns:
        ``out`` of q's shape (with v's head_dim) and dtype; with ``return_lse=True``, ``(out, lse)`` where
        ``lse`` is float32 of shape (batch, heads_q, seqlen_q), the natural logarithm of
        ``sum_j exp(scale * q_i · k_j)`` over the keys row i attends. A row with no key to attend to (causal
        with seqlen_q > seqlen_k, or seqlen_k == 0) gets an output of 0 and an LSE of -inf, never NaN. Empty
        inputs give empty results.

    The softmax and accumulation are float32 on every path. float16/bfloat16 CUDA tensors run on our
    kernels (compiled on first use and cached on disk). Everything else -- CPU tensors, float32/float64
    inputs, or a GPU/toolchain the kernels cannot use -- computes the same result through PyTorch
    (:mod:`flash_attention.fallback`: PyTorch's fused CPU kernel where it expresses our semantics, else in
    chunks of query rows; bounded memory either way), with a one-time warning on CUDA saying why. An
    inference call with a few queries per row against many keys (at most 64 packed query rows, seqlen_q x
    the query group, and at least 256 keys; no ``key_range``, dropout or packed batch) runs on the split-KV
    decode kernels of :func:`attention_with_kvcache`, k and v read as a contiguous cache: the same results.

    Gradients: the result is differentiable with respect to q, k and v (``key_range`` gets none, and the
    LSE is returned as a non-differentiable tensor: a loss that uses it gets no gradient through it). When
    autograd records the call, or under ``torch.compile``, it runs as the custom op ``flash_attention::fwd``
    whose backward is ``flash_attention::bwd`` (the FlashAttention-2 backward, recomputing the
    probabilities from the saved LSE; on the same kernel-or-fallback choice as the forward), so
    ``torch.compile(fullgraph=True)`` sees one node, without a graph break. Plain inference calls skip the
    op's dispatch and call the kernel directly; eager training calls record the compiled autograd node of
    :mod:`flash_attention.ops.training` (or, without a C++ compiler, a Python autograd function).

    Raises:
        TypeError, ValueError: on invalid arguments, naming the argument and what was expected, before
            anything is launched.
    """
    if fp8 is not False:
        # (checked here; quantized below, once every option is checked as for a bf16 call)
        _check_fp8_true(q, k, v, fp8, (q_descale, k_descale, v_descale))
    elif (
        getattr(q, "dtype", None) is _fp8.E4M3
        or q_descale is not None
        or k_descale is not None
        or v_descale is not None
    ):  # (spec.fp8.is_fp8_call written out: no call or tuple on every call's path)
        # e4m3 inputs: checked, then on Hopper at head_dim 64, 128 or 256 without other options the e4m3
        # kernel (ops.fp8_forward); else dequantized to bf16, the call going on as a bf16 call (spec.fp8)
        descales = (q_descale, k_descale, v_descale)
        _fp8.check_fp8(q, k, v, descales)
        from ..ops import fp8_forward as _fp8_kernel  # (here: only FP8 calls pay for its import)

        options = (out, key_range, dropout_p, window, softcap, alibi_slopes, sinks, _segments)
        # (the shapes' checks first, on bf16 stand-ins on the meta device: validate takes no e4m3 dtype;
        # kernel_takes checks the devices, which the stand-ins drop)
        problem = validate(
            *(torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for t in (q, k, v)),
            causal=causal,
            softmax_scale=softmax_scale,
            out=None,
        )
        # (an empty problem keeps the dequantizing path's zeros and -inf LSE)
        if not problem.is_empty and _fp8_kernel.kernel_takes(q, k, v, *options, scale=problem.scale):
            o, lse = _fp8_kernel.cuda_forward_e4m3(
                q, k, v, causal=problem.causal, softmax_scale=problem.scale, q_descale=q_descale,
                k_descale=k_descale, v_descale=v_descale, return_lse=return_lse,
            )  # fmt: skip
            return _result(o, lse, return_lse)
        from ..ops import fp8_cast

        heads_kv = k.shape[2]
        q, k, v = (fp8_cast.dequantize(t, d, heads_kv) for t, d in zip((q, k, v), descales, strict=True))
    # A call whose signature ran before and ended in one planned launch repeats that launch, skipping every
    # decision below (ops.repeat says what a signature holds and why; kernel-log step 52).
    key = None
    if out is None and fp8 is False:  # (an fp8=True call is not repeated: its tensors are quantized first)
        key = _repeat.signature(
            q, k, v, causal, softmax_scale, return_lse, key_range, deterministic, dropout_p, dropout_seed,
            window, alibi_slopes, sinks, _segments, (("softcap", softcap),),
        )  # fmt: skip
        if key is not None:
            call = _repeat.lookup(key)
            if call is not None:
                result = (
                    None
                    if call is _repeat.WHOLE_PATH
                    else call(q, k, v, key_range, alibi_slopes, sinks, _segments)
                )
                if result is not None:
                    return _result(*result, return_lse)
                key = None  # this signature's verdict stands; this call takes the whole path

    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, key_range=key_range)
    window = check_window(window)
    # Under torch.compile the checks only: dynamo (torch 2.11) refuses to build the spec's frozen dataclasses
    # inside a trace (a graph break), and a traced call needs no spec (it has no repeat signature or prefetch,
    # and its op takes the options as they are).
    compiling = torch.compiler.is_compiling()
    if compiling:
        check_score(alibi_slopes, q, _segments, softcap=softcap)
    else:
        score = score_spec(alibi_slopes, q, _segments, problem.causal, softcap=softcap)
    check_sinks(sinks, q)
    if _segments is not None:
        check_segments(_segments, q, k, key_range, window)
    softcap = float(softcap)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    # The backward's mode: the argument or PyTorch's switch (repeat.signature keys on the same).
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    seed = _dropout_seed(dropout_p, dropout_seed)
    # Every option, checked, as the launch layer's plans read it (the tensors travel beside it).
    spec = None
    if not compiling:
        spec = AttentionSpec(
            problem.causal,
            problem.scale,
            window,
            score,
            key_range is not None,
            float(dropout_p),
            deterministic,
            sinks is not None,
            0 if _segments is None else len(_segments),
        )
    records = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )
    # The launch layer this call may run on (None: the fallback's), asked once for the two uses below.
    # (v's own head_dim: the backward kernel reading it, or q's head_dim's kernels on v padded to it,
    # ops.cuda_backward; a v wider than q's has none)
    prefetches = records and not torch.compiler.is_compiling() and problem.head_dim_v <= q.shape[3]
    backend = None
    if not problem.is_empty and (key is not None or prefetches):
        backend = dispatch.usable_backend(q)
    prefetch = getattr(backend, "prefetch_backward", None) if prefetches else None  # (stand-ins lack it)
    if prefetch is not None:
        # A training call: its backward's kernels start compiling now, beside the forward's (first calls).
        prefetch(q, k, spec, _segments, value_dim=v.shape[3])
    if fp8 is not False:
        # Where the e4m3 kernel takes the call (ops.fp8_forward.kernel_takes: Hopper, head_dim 64, 128 or
        # 256, no option beyond causal), it runs it, its backward the bf16 one on the dequantized tensors
        # (api.fp8_training, whose backward kernels the prefetch above is compiling); elsewhere the bf16 call
        # on the quantized tensors' round trip, the same attention of the dequantized tensors up to rounding.
        from ..ops import fp8_forward as _fp8_kernel

        options = (out, key_range, dropout_p, window, softcap, alibi_slopes, sinks, _segments)
        if not problem.is_empty and _fp8_kernel.kernel_takes(q, k, v, *options, scale=problem.scale):
            from .fp8_training import e4m3_training

            return _result(*e4m3_training(q, k, v, problem.causal, problem.scale, deterministic), return_lse)
        q, k, v = _quantized_through(q, k, v)
    if not records and key_range is None and not dropout_p and _segments is None and not problem.is_empty:
        # A few queries per row against many keys: the split-KV decode kernels
        # (flash_attention.api.few_queries),
        # and the signature's later calls straight to them.
        routed = _few_queries.route(
            q, k, v, causal=problem.causal, scale=problem.scale, return_lse=return_lse, out=out,
            window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, key=key,
        )  # fmt: skip
        if routed is not None:
            result = routed.run(q, k, v, alibi_slopes, sinks, out)
            if result is not None:
                if key is not None:
                    _repeat.remember(key, routed)
                return _result(*result, return_lse)
    if key is not None:
        # The first call of its signature: make its repeat call (or note that it has none) and run it.
        result = _repeat.first_call(
            key,
            backend,
            q,
            k,
            v,
            spec,
            key_range=key_range,
            records=records,
            return_lse=return_lse,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            segments=_segments,
        )
        if result is not None:
            return _result(*result, return_lse)
    if records or torch.compiler.is_compiling():
        return _attention_op(
            q,
            k,
            v,
            problem,
            return_lse,
            out,
            key_range,
            deterministic,
            records,
            float(dropout_p),
            seed,
            window,
            {"softcap": softcap},
            alibi_slopes,
            sinks,
            _segments,
        )
    # (segments: flash_attention.api.varlen's runs of a packed batch, for the kernels' segments build)
    windowed = launch_variants(window, alibi_slopes, _segments, softcap=softcap)

    if problem.is_empty:
        o, lse = _empty_result(q, problem, out)
        if sinks is not None and lse.numel():
            o, lse = apply_sinks(o, lse, sinks)
        return _result(o, lse, return_lse)

    def fallback() -> tuple[torch.Tensor, torch.Tensor | None]:
        # (a packed batch: the chunked path reads the rows' runs as each row's keys, and the segments' table
        # of ALiBi diagonals where they carry one)
        runs = (None, None) if _segments is None else _segments
        o, lse = _fallback.forward(
            q, k, v, spec,
            return_lse=return_lse or sinks is not None,  # (the sinks rescale O by the sink-free LSE)
            out=out, key_range=key_range, dropout_seed=seed, alibi_slopes=alibi_slopes,
            alibi_diagonal=runs[2] if len(runs) == 3 else None, row_keys=runs[0],
        )  # fmt: skip
        return (o, lse) if sinks is None else apply_sinks(o, lse, sinks)

    ops = dispatch.kernel_backend(q)
    if ops is None:
        o, lse = fallback()
    else:
        o, lse = dispatch.run_or_fallback(
            lambda: ops.cuda_forward(
                q,
                k,
                v,
                causal=causal,
                softmax_scale=problem.scale,
                return_lse=return_lse,
                out=out,
                config=None,
                key_range=key_range,
                dropout_p=float(dropout_p),
                dropout_seed=seed,
                **windowed,
                **({} if sinks is None else {"sinks": sinks}),  # (in the kernels' epilogue)
            ),
            fallback,
        )
    return _result(o, lse, return_lse)


def _dropout_seed(dropout_p: object, dropout_seed: object) -> torch.Tensor | None:
    """Validate the dropout arguments; the call's (seed, offset) tensor, or None without dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if float(dropout_p) > MAX_DROPOUT_P:
        raise ValueError(
            "dropout_p must be at most 1 - 2**-15 (1 / (1 - p), the kept elements' scale, within fp16's "
            f"range); got {dropout_p!r}"
        )
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int)):
        raise TypeError(f"dropout_seed must be an int or None; got {type(dropout_seed).__name__}")
    if dropout_seed is not None and not -(2**63) <= dropout_seed < 2**63:
        # It travels as an int64 tensor (saved for the backward, traced by torch.compile).
        raise ValueError(f"dropout_seed must be in [-2**63, 2**63) (a 64-bit integer); got {dropout_seed}")
    if not dropout_p:
        return None
    return draw_seed(dropout_seed)


def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: Problem,
    return_lse: bool,
    out: torch.Tensor | None,
    key_range: torch.Tensor | None,
    deterministic: bool,
    records: bool,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    score_values: dict[str, float] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` through the custom op ``flash_attention::fwd``: differentiable, and one opaque
    node for torch.compile. The op makes the same kernel-or-fallback choice as the direct path.
    ``score_values``: the scalar score functions' checked values by name."""
    score_values = score_values or {}
    if out is not None and records:
        raise RuntimeError(
            "attention(): out= does not support automatic differentiation, but q, k or v requires grad; "
            "call attention() without out= (it returns a new tensor), or under torch.no_grad()"
        )
    # The op's arguments (torch_ops.attention): the options packed, then the tensors beside them.
    options, values = pack_options(
        problem.causal, problem.scale, deterministic, dropout_p, window, **score_values
    )
    row_keys = key_rows = alibi_diagonal = None
    if segments is not None:  # (a packed batch's runs, and each row's ALiBi diagonal where they carry one)
        row_keys, key_rows, alibi_diagonal = (*segments, None)[:3]
    args = (q, k, v, options, values, key_range, dropout_seed, alibi_slopes, row_keys, key_rows,
            alibi_diagonal, sinks)  # fmt: skip
    if records and not torch.compiler.is_compiling():
        # A fallback call that PyTorch's attention computes exactly as we define it (CPU tensors, float32 on
        # CUDA; fallback.plain_sdpa_call says which) goes to it whole, forward and autograd, at PyTorch's
        # own host cost. Half precision on CUDA is our kernels' unless they cannot run here (the first test,
        # so a call on our kernels pays nothing for this branch).
        if (
            (q.dtype == torch.float32 or q.device.type == "cpu")
            and out is None
            and not return_lse
            and window is None
            and not any(score_values.values())
            and alibi_slopes is None
            and v.shape[3] == q.shape[3]
            and sinks is None
            and segments is None
            and _fallback.plain_sdpa_call(
                q, k, problem.causal, problem.scale, key_range, dropout_p, deterministic
            )
            and dispatch.kernel_backend(q) is None
        ):
            return _fallback.sdpa(q, k, v, causal=problem.causal, scale=problem.scale)
        # Eager training: the compiled training node, or the ops' implementations without the custom-op
        # dispatch (torch_ops.attention says why).
        o, lse = eager_training(*args)
    else:
        o, lse = torch.ops.flash_attention.fwd(*args)
    if out is not None:
        # Only without autograd (torch.compile tracing an inference call): the op cannot write into a
        # caller's buffer (custom ops return new tensors), so the result is copied.
        out.copy_(o)
        o = out
    return _result(o, lse, return_lse)


def _kernel_path(
    config: KernelConfig | str, q: torch.Tensor, caller: str, problem: Problem
) -> tuple[ModuleType, KernelConfig]:
    """The ops module and parsed config for a call that must run our kernel, or RuntimeError why not."""
    cfg = parse_config(config)
    if problem.head_dim_v:  # (before any compile: no kernel reads two head dims, ops.plans.check_value_dim)
        raise RuntimeError(
            f"{caller}() runs kernel config {cfg}, and no kernel takes v's head_dim ({problem.head_dim_v}) "
            f"apart from q's and k's ({problem.head_dim})"
        )
    if not dispatch.wants_kernel(q):
        raise RuntimeError(f"{caller}() runs a CUDA kernel and needs CUDA tensors; got q on {q.device}")
    ops = dispatch.backend()
    reason = ops.cuda_unavailable_reason(q)
    if reason is not None:
        raise RuntimeError(f"{caller}() cannot run kernel config {cfg}: {reason}")
    return ops, cfg


def forward(
    config: KernelConfig | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    key_range: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run one named kernel configuration (a :class:`KernelConfig` or its name) on CUDA tensors.

    Arguments and results are those of :func:`attention`; there is no fallback: if the kernel cannot run,
    RuntimeError says why.
    """
    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, key_range=key_range)
    window = check_window(window)
    check_score(alibi_slopes, q, softcap=softcap)  # (naming the argument)
    variant = launch_variants(window, alibi_slopes, softcap=softcap)
    ops, cfg = _kernel_path(config, q, "forward", problem)
    if problem.is_empty:
        o, lse = _empty_result(q, problem, out)
        return _result(o, lse, return_lse)
    o, lse = ops.cuda_forward(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=problem.scale,
        return_lse=return_lse,
        out=out,
        config=cfg,
        key_range=key_range,
        **variant,
    )
    return _result(o, lse, return_lse)


def forward_timed(
    config: KernelConfig | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, float]:
    """Run one kernel configuration once and return ``(out, milliseconds)`` measured with CUDA events.

    The kernel is compiled/loaded first (``ops.prepare``) so the time covers only the launch and the
    kernel itself, on the current stream of q's device. This is the only place in the package that times.
    One call is one sample: benchmarks warm up and take the median of many calls.
    """
    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=None)
    ops, cfg = _kernel_path(config, q, "forward_timed", problem)
    if problem.is_empty:
        o, _ = _empty_result(q, problem, None)
        return o, 0.0
    ops.prepare(cfg, causal=causal, device=q.device)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        o, _ = ops.cuda_forward(
            q, k, v, causal=causal, softmax_scale=problem.scale, return_lse=False, out=None, config=cfg
        )
        end.record(stream)
        end.synchronize()
        return o, start.elapsed_time(end)
