"""Each implementation at one shape, ready to time: ours (the very choice ``attention()`` makes), SDPA held
to each of its backends, ``torch.compile(flex_attention)`` and FlashAttention-4 (``fa4``, bench/fa4.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import flash_attention
from flash_attention import configs, ops

from ...spec.score_functions import SCORE_FUNCTIONS
from .fa4 import FA4, fa4_dense
from .results import DEFAULT_IMPLS, OURS, OURS_DETERMINISTIC, OURS_FP8
from .skip import Skip

__all__ = ["Runner", "Shape", "Skip", "make_inputs", "make_runner", "one_line"]


#: (config name, causal) -> why its compile failed, so a sweep tries each failing kernel once.
_COMPILE_FAILURES: dict[tuple[str, bool], str] = {}


def one_line(exc: BaseException, limit: int = 600) -> str:
    """An exception as one line: compiler errors span lines, and the second line is the useful one."""
    text = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return (text or type(exc).__name__)[:limit]


_SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


@dataclass
class Shape:
    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    #: K/V heads (grouped-query attention: query head h reads kv head h // (heads // kv_heads)); 0: heads.
    kv_heads: int = 0
    #: A causal sliding window: each query sees itself and the ``window`` keys before it; 0: none.
    window: int = 0
    #: The scalar score functions on the scores and their values (spec.score_functions, attention()'s keywords
    #: of the same names), in the table's order; (): none.
    score: tuple[tuple[str, float], ...] = ()
    #: ALiBi with the usual geometric slopes per head (``alibi_slopes=``).
    alibi: bool = False
    #: Attention sinks, one logit per query head (``sinks=``).
    sinks: bool = False
    #: v's own head_dim (``--head-dim-v``; the output's and dO's too, q and k keep ``head_dim``); 0: head_dim.
    head_dim_v: int = 0

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dv(self) -> int:
        """v's head_dim (the output's)."""
        return self.head_dim_v or self.head_dim


def _torch_dtype(name: str) -> Any:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _sdpa_backend(impl: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, _SDPA_BACKENDS[impl])


_FLEX_COMPILED: Any = None


def _flex() -> Any:
    """``torch.compile(flex_attention)``, compiled once per process, with room for a recompile per shape."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # Each sweep point is a new static shape (dynamic=False: the papers' numbers are for specialised
        # kernels). Dynamo's default limit of 8 recompiles would silently drop the later shapes to eager
        # flex_attention, which is an order of magnitude slower and would be reported as flex's speed.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4096))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


@dataclass
class Runner:
    """One implementation at one shape, ready to time.

    ``call(i)`` runs it on input set ``i``; ``context`` is entered around warm-up and timing (``sdpa_kernel``
    costs host time, so it is entered once, not per call); ``output(i)`` returns the output of set ``i`` in
    (batch, seqlen, heads, head_dim) layout for the correctness check; ``config`` is our kernel's name.
    """

    call: Callable[[int], Any]
    output: Callable[[int], Any]
    context: Callable[[], Any] = contextlib.nullcontext
    config: str | None = None


def make_inputs(shape: Shape, n_sets: int, device: Any) -> list[tuple[Any, Any, Any]]:
    dt = _torch_dtype(shape.dtype)
    q_size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    kv_size = (shape.batch, shape.seqlen, shape.kv, shape.head_dim)
    v_size = (shape.batch, shape.seqlen, shape.kv, shape.dv)  # (v's own head_dim: --head-dim-v)
    # Fresh random data for every shape: zeros or constants would let a kernel skip work or hide errors.
    return [
        tuple(torch.randn(size, device=device, dtype=dt) for size in (q_size, kv_size, v_size))
        for _ in range(n_sets)
    ]


def _autograd_call(
    f: Callable[[Any, Any, Any], Any], inputs: list[tuple[Any, Any, Any]], mode: str
) -> Callable[[int], Any]:
    """Wrap a forward ``f`` into the timed call of a backward mode (fwd_bwd: both; bwd: backward alone)."""
    leaves = [tuple(t.detach().requires_grad_(True) for t in s) for s in inputs]
    # dO has the output's shape: v's head_dim where v has its own (--head-dim-v).
    if mode == "fwd_bwd":

        def call(i: int) -> Any:
            out = f(*leaves[i])
            return torch.autograd.grad(out, leaves[i], torch.ones_like(out))

        return call
    # bwd: the forward (and its saved tensors) is built once per set; only the backward is timed.
    outs = [f(*s) for s in leaves]
    grads = [torch.randn_like(o) for o in outs]
    return lambda i: torch.autograd.grad(outs[i], leaves[i], grads[i], retain_graph=True)


def alibi_slopes(heads: int, device: Any) -> Any:
    """ALiBi's slopes as its paper sets them for a power-of-two head count: 2^(-8 (h + 1) / heads)."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


def _variant_args(shape: Shape, device: Any = None) -> dict:
    """attention()'s variant arguments of a shape: its window, score functions and ALiBi slopes (none
    without)."""
    extra: dict = {"window": (shape.window, 0)} if shape.window else {}
    extra.update(shape.score)
    if shape.alibi:
        extra["alibi_slopes"] = alibi_slopes(shape.heads, device)
    if shape.sinks:
        # Fixed logits near a 4k row's LSE, so the rescale is not a no-op (the time does not depend on them).
        extra["sinks"] = torch.linspace(2.0, 6.0, shape.heads, device=device)
    return extra


def _alibi_bias(shape: Shape, device: Any, dtype: Any) -> Any:
    """ALiBi as the additive (heads, seqlen, seqlen) mask a model without our kernels hands SDPA."""
    i = torch.arange(shape.seqlen, device=device)
    distance = (i[:, None] - i[None, :]).abs().float()
    return (-alibi_slopes(shape.heads, device)[:, None, None] * distance).to(dtype)


def _window_mask(shape: Shape, device: Any) -> Any:
    """The (seqlen, seqlen) boolean mask of a shape's causal sliding window."""
    i = torch.arange(shape.seqlen, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance <= shape.window)


def _flex_score_mod(shape: Shape, device: Any) -> Callable | None:
    """FlexAttention's score_mod of a shape's score functions, then its ALiBi, on the scaled score, as ours
    applies them (spec.score_functions' math). (Before, a shape with both got the score function alone.)"""
    if not shape.score and not shape.alibi:
        return None
    functions = [(SCORE_FUNCTIONS[name].apply, value) for name, value in shape.score]
    slopes = alibi_slopes(shape.heads, device) if shape.alibi else None

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        for apply, value in functions:
            score = apply(score, value)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


def _our_kernel_device(inputs: list[tuple[Any, Any, Any]]) -> Any:
    """The first set's q, whose device our CUDA kernels can run on, or raise :class:`Skip` with the reason:
    timing the PyTorch fallback under our name would be a lie."""
    q0 = inputs[0][0]
    reason = ops.cuda_unavailable_reason(q0)
    if reason is not None:
        raise Skip(f"our CUDA kernel cannot run: {reason}")
    return q0


def _attention_config(shape: Shape, inputs: list[tuple[Any, Any, Any]]) -> Any:
    """The forward config attention() picks for the first set of a shape's bf16/fp16 tensors (defaults, and
    tuned winners once they exist)."""
    return ops.chosen_config(
        inputs[0][0],
        inputs[0][1],
        inputs[0][2],
        causal=shape.causal,
        softmax_scale=shape.head_dim**-0.5,
        window=(shape.window, 0) if shape.window else False,  # (the sweep's windows are causal: (W, 0))
        alibi=shape.alibi,
        **{name: True for name, _ in shape.score},
    )


def make_runner(
    impl: str, shape: Shape, inputs: list[tuple[Any, Any, Any]], mode: str, config: Any = None
) -> Runner:
    """The runner of ``impl`` on ``inputs`` (given in our (B, S, H, D) layout), or raise :class:`Skip`."""
    if shape.dv > shape.head_dim:
        # (our forward stages O in the Q tile: v may be narrower than q and k, not wider; the sweep's
        # --head-dim-v is for MLA-style shapes, q/k 192 against v 128)
        raise Skip(f"v's head_dim ({shape.dv}) is wider than q's and k's ({shape.head_dim})")
    if impl == OURS:
        q0 = _our_kernel_device(inputs)
        variant = _variant_args(shape, q0.device)
        if config is not None:
            cfg = configs.parse_config(config)
            if cfg.dtype != shape.dtype or cfg.head_dim != configs.padded_head_dim(shape.head_dim):
                raise Skip(f"--config {cfg.name()} is not for {shape.dtype} head_dim {shape.head_dim}")
            if shape.dv != shape.head_dim:
                raise Skip(
                    f"--config runs flash_attention.forward(), which takes no v of its own head_dim "
                    f"({shape.dv} against {shape.head_dim})"
                )
        else:
            # The very choice attention() makes for this call (defaults, and tuned winners once they exist),
            # so our rows time what a user gets; forward() then runs it without any fallback. (v's own
            # head_dim: the config with its value dim, or NoKernel, a skip, where no forward takes it.)
            cfg = _attention_config(shape, inputs)
        if mode == "fwd":
            key = (cfg.name(), shape.causal)
            if key in _COMPILE_FAILURES:
                raise Skip(_COMPILE_FAILURES[key])  # the same source fails the same way; don't compile again
            try:
                # Compile/load now, with the JIT's progress, so no compile lands inside warm-up or timing.
                ops.prepare(cfg, shape.causal, q0.device)
            except Exception as exc:
                _COMPILE_FAILURES[key] = f"compile of {cfg.name()} failed: {one_line(exc)}"
                raise Skip(_COMPILE_FAILURES[key]) from exc
            outs: dict[int, Any] = {}

            def call(i: int) -> Any:
                q, k, v = inputs[i]
                if config is None:
                    # What a user calls, so that host-bound points time the user's path (repeat calls
                    # included); the kernel is the config named above, attention()'s own choice.
                    return flash_attention.attention(q, k, v, causal=shape.causal, **variant)
                return flash_attention.forward(cfg, q, k, v, causal=shape.causal, **variant)

            def output(i: int) -> Any:
                return outs.setdefault(i, call(i))

            return Runner(call, output, config=cfg.name())
        # Backward modes go through attention() and its autograd; the config is the one it picks. Sinks are
        # learnable there, as in training, so their gradient is part of the time.
        if "sinks" in variant:
            variant["sinks"].requires_grad_()
        f = lambda q, k, v: flash_attention.attention(q, k, v, causal=shape.causal, **variant)  # noqa: E731
        return Runner(_autograd_call(f, inputs, mode), lambda i: f(*inputs[i]), config=cfg.name())

    if impl == OURS_FP8:
        if shape.dtype != "bf16":
            raise Skip("FP8 rows quantize the sweep's bf16 tensors (--dtype bf16)")
        from flash_attention.ops import fp8_forward
        from flash_attention.spec import fp8

        q0 = _our_kernel_device(inputs)
        variant = _variant_args(shape, q0.device)
        if mode != "fwd":
            # Training: attention(q, k, v, fp8=True) on the bf16 tensors, its quantizing pass timed with it
            # (the form a training loop switches on; api.fp8_training: the e4m3 forward where the kernel
            # takes the call, the bf16 backward on the dequantized tensors).
            if "sinks" in variant:
                variant["sinks"].requires_grad_()
            options = (None, None, 0.0, variant.get("window"), shape.score or None,
                       variant.get("alibi_slopes"), variant.get("sinks"), None)  # fmt: skip
            routed = fp8_forward.kernel_takes(*inputs[0], *options, scale=shape.head_dim**-0.5)
            f = lambda q, k, v: flash_attention.attention(q, k, v, causal=shape.causal, fp8=True, **variant)  # noqa: E731
            name = (
                f"{fp8_forward.e4m3_config(shape.head_dim).name()}, backward on the dequantized bf16"
                if routed
                else "quantized round trip, then " + _attention_config(shape, inputs).name()
            )
            return Runner(_autograd_call(f, inputs, mode), lambda i: f(*inputs[i]), config=name)
        # Quantized once per set, outside the timing: e4m3 tensors and their (batch, kv head) descales.
        quantized = []
        for q, k, v in inputs:
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, shape.kv) for t in (q, k, v))
            quantized.append(((q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)))
        (q8, k8, v8), _ = quantized[0]
        options = (None, None, 0.0, variant.get("window"), shape.score or None, variant.get("alibi_slopes"),
                   variant.get("sinks"), None)  # fmt: skip
        if fp8_forward.kernel_takes(q8, k8, v8, *options, scale=shape.head_dim**-0.5):
            name = fp8_forward.e4m3_config(shape.head_dim).name()
        else:
            name = "dequantized to bf16, then " + _attention_config(shape, inputs).name()

        def call(i: int) -> Any:
            tensors, descales = quantized[i]
            return flash_attention.attention(*tensors, causal=shape.causal, **descales, **variant)

        return Runner(call, call, config=name)

    if impl == OURS_DETERMINISTIC:
        if mode == "fwd":
            raise Skip("deterministic=True changes only the backward")
        q0 = _our_kernel_device(inputs)
        variant = _variant_args(shape, q0.device)
        if "sinks" in variant:  # (learnable, as in training)
            variant["sinks"].requires_grad_()
        f = lambda q, k, v: flash_attention.attention(  # noqa: E731
            q, k, v, causal=shape.causal, deterministic=True, **variant
        )
        return Runner(_autograd_call(f, inputs, mode), lambda i: f(*inputs[i]))

    if impl in _SDPA_BACKENDS:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(impl)
        # SDPA's native layout is (B, H, S, D) contiguous; giving it a transposed view would time a copy or a
        # slower strided path, so each set is laid out for it once, outside the timing.
        native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]

        gqa = shape.kv != shape.heads
        if shape.score:
            names = ", ".join(name for name, _ in shape.score)
            raise Skip(f"SDPA has no {names} (no mask expresses a function of the score)")
        if shape.sinks:
            raise Skip("SDPA has no attention sinks")
        if impl == "sdpa_flash" and shape.dv != shape.head_dim:
            # PyTorch's FlashAttention-2 requires q, k and v of one head_dim (sdp_utils'
            # check_head_dim_size_flash). cuDNN takes v's own (on sm90: up to 256 each with cuDNN 9.22+ and
            # the frontend's d256 support, else 192/128 alone; its backward 192/128, or both <= 128), and so
            # does the memory-efficient kernel (q and k equal, v 8-aligned); where one refuses a shape at run
            # time, the bench records the skip with SDPA's reason.
            raise Skip(
                f"SDPA's FlashAttention-2 requires one head_dim for q, k and v (v has {shape.dv}, "
                f"q and k {shape.head_dim})"
            )
        device = inputs[0][0].device
        # A sliding window and ALiBi have no SDPA flag: an explicit mask, as a model without our kernels
        # passes one (boolean for the window, additive for ALiBi; the backends that take no mask refuse it
        # and the row is skipped).
        mask = _window_mask(shape, device) if shape.window else None
        if shape.alibi:
            keep = mask
            if keep is None and shape.causal:
                keep = torch.ones(shape.seqlen, shape.seqlen, dtype=torch.bool, device=device).tril()
            bias = _alibi_bias(shape, device, inputs[0][0].dtype)
            mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
        extra = {"enable_gqa": True} if gqa else {}
        if mask is not None:
            extra["attn_mask"] = mask

        def f(q: Any, k: Any, v: Any) -> Any:
            # seqlen_q == seqlen_k in the sweep, so SDPA's top-left causal mask equals our bottom-right one.
            # Grouped-query shapes pass K/V with their own head count (enable_gqa), as a model would.
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal and mask is None, **extra)

        def context() -> Any:
            return sdpa_kernel(backend)

        call = (lambda i: f(*native[i])) if mode == "fwd" else None

        def output(i: int) -> Any:
            with context():
                return f(*native[i]).transpose(1, 2)

        if call is None:
            with context():
                call = _autograd_call(f, native, mode)
        return Runner(call, output, context)

    if impl == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as exc:
            raise Skip(f"FlexAttention is not in torch {torch.__version__}") from exc
        if shape.sinks:
            raise Skip("FlexAttention has no attention sinks")
        flex = _flex()
        native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]
        block_mask = None
        if shape.causal:
            window = shape.window

            def causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                if window:  # a sliding window: FlexAttention skips the blocks outside it too
                    return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
                return q_idx >= kv_idx

            block_mask = create_block_mask(
                causal_mask,
                B=None,
                H=None,
                Q_LEN=shape.seqlen,
                KV_LEN=shape.seqlen,
                device=inputs[0][0].device,
            )

        gqa = shape.kv != shape.heads
        score_mod = _flex_score_mod(shape, inputs[0][0].device)
        # (flex_attention takes v's own head_dim, Ev: q and k must share theirs, v need not)

        def f(q: Any, k: Any, v: Any) -> Any:
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

        call = (lambda i: f(*native[i])) if mode == "fwd" else _autograd_call(f, native, mode)
        return Runner(call, lambda i: f(*native[i]).transpose(1, 2))

    if impl == FA4:
        # (flash_attn_func takes v's own head_dim, e.g. MLA's 192/128; a pair its kernels lack on this GPU
        # fails at run time and the row is skipped with FlashAttention-4's reason)
        variant = _variant_args(shape, inputs[0][0].device)
        sinks = variant.get("sinks")
        if sinks is not None and mode != "fwd":
            sinks.requires_grad_()  # learnable, as in training (and as ours is timed)
        f = fa4_dense(
            causal=shape.causal, window=shape.window, score=shape.score, sinks=sinks, alibi=shape.alibi
        )
        call = (lambda i: f(*inputs[i])) if mode == "fwd" else _autograd_call(f, inputs, mode)
        return Runner(call, lambda i: f(*inputs[i]))

    raise Skip(f"unknown implementation {impl!r}; known: {', '.join(DEFAULT_IMPLS)}")
