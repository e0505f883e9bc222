"""FP8 (e4m3) inputs with descale factors: their checks and their dequantization (docs/fp8-study.md,
sections 1-2: the contract of the FP8 entry forms).

A call with ``torch.float8_e4m3fn`` q, k and v means the dequantized tensors ``Q = float(q) * q_descale``,
``K = float(k) * k_descale``, ``V = float(v) * v_descale``, where a descale is None (1), one number for the
whole tensor (a float32 tensor of one element), or one per (batch, kv head) (float32, shape (batch,
heads_kv)); a query head takes the descale of its group's kv head, as FlashAttention-3's ``q_descale`` does.
Every option then applies to ``softmax_scale * Q K^T`` as for a bf16 call; the output is bfloat16 and the
LSE float32. There is no autograd on e4m3 tensors (it would cast their gradients back to e4m3): a training
recipe quantizes inside its own autograd function and takes the gradients with respect to the dequantized
tensors from flash_attention.attention_fp8_backward, or calls attention(fp8=True) on its bf16 tensors.

Where the e4m3 kernel does not take a call (ops.fp8_forward.kernel_takes), :func:`dequantize` gives the
bfloat16 tensors it runs on instead, PyTorch's own practice for FP8-input attention (dequantize, bf16
compute); :func:`quantize` is the quantizer of attention(fp8=True).
"""

from __future__ import annotations

import torch

__all__ = ["E4M3", "E4M3_MAX", "DESCALE_NAMES", "check_fp8", "dequantize", "is_fp8_call", "quantize"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8_call(q: torch.Tensor, descales: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a call takes the FP8 path: q is e4m3 or a descale is given (checked in full by
    :func:`check_fp8`, which says what is wrong with a half-FP8 call)."""
    return q.dtype is E4M3 or any(d is not None for d in descales)


def check_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple, batch: int | None = None
) -> None:
    """Raise TypeError or ValueError, naming the argument, unless q, k and v are all e4m3 with descales
    that are None, float32 of one element, or float32 of shape (batch, heads_kv), on q's device. ``batch``:
    a packed batch's sequence count (q, k and v then 3-D, (total, heads, head_dim)); None: 4-D tensors
    whose first dimension is the batch."""
    dims = 4 if batch is None else 3
    layout = "(batch, seqlen, heads, head_dim)" if batch is None else "(total, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype is not E4M3:
            given = [n for n, d in zip(DESCALE_NAMES, descales, strict=True) if d is not None]
            why = f"{', '.join(given)} given, so " if given and q.dtype is not E4M3 else ""
            raise TypeError(
                f"{why}{name} must be torch.float8_e4m3fn like the other FP8 inputs; got {t.dtype} "
                "(descales are for e4m3 q, k and v together)"
            )
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {layout}; got shape {tuple(t.shape)}")
        if t.requires_grad:
            raise ValueError(
                f"{name} is an e4m3 tensor that requires grad: gradients with respect to FP8 tensors are not "
                "offered (autograd would cast them to e4m3); differentiate the tensors you quantized from"
            )
    batch, heads_kv = (k.shape[0] if batch is None else batch), k.shape[-2]
    for name, d in zip(DESCALE_NAMES, descales, strict=True):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor or None; got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must be float32; got {d.dtype}")
        if d.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {d.device}")
        if d.numel() != 1 and tuple(d.shape) != (batch, heads_kv):
            raise ValueError(
                f"{name} must hold one number or one per (batch, kv head), shape ({batch}, {heads_kv}); "
                f"got shape {tuple(d.shape)}"
            )


def dequantize(
    t: torch.Tensor,
    descale: torch.Tensor | None,
    heads_kv: int,
    row_batch: torch.Tensor | None = None,
    *,
    powers_of_two: bool = False,
) -> torch.Tensor:
    """``float(t) * descale`` as bfloat16: t e4m3 of shape (batch, seqlen, heads, head_dim), or of a packed
    batch (total, heads, head_dim) with ``row_batch`` each row's sequence (int64, (total,)); heads a multiple
    of ``heads_kv`` (head h takes kv head h // (heads / heads_kv)'s descale). The product is taken in
    float32 and rounded to bfloat16: a 4-bit significand times a 24-bit descale has 28 bits, so a general
    descale's product may round in float32 first, 2^-24 beside bfloat16's 2^-9. ``powers_of_two``: the
    caller knows the descales are powers of two (:func:`quantize`'s), so the product is exact in bfloat16
    itself and is taken there, in a third of the bytes (the same values)."""
    x = t.to(torch.bfloat16 if powers_of_two else torch.float32)
    if descale is not None:
        descale = descale.to(x.dtype)
        if descale.numel() == 1:
            x = x * descale.reshape(())
        else:
            per_head = descale.repeat_interleave(t.shape[-2] // heads_kv, dim=1)  # (batch, heads)
            x = x * (per_head[:, None, :, None] if row_batch is None else per_head[row_batch][:, :, None])
    return x.to(torch.bfloat16)


def quantize(t: torch.Tensor, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``t`` and its float32 descale per (batch, kv head), shape (batch, heads_kv): the least power of
    two at or above the amax of the kv head's elements (for q, over its GQA group's heads) over 448, so that
    the largest element maps into e4m3's top binade (224-448); a kv head whose elements are all zero keeps
    descale 1. t: (batch, seqlen, heads, head_dim), heads a multiple of ``heads_kv``. (docs/fp8-study.md,
    form 2: the current-scaling recipe.)

    Why a power of two rather than amax / 448 itself: an e4m3 value (4 significant bits) times a power of two
    is exact in bfloat16, so the dequantized tensors the backward recomputes P from (api.fp8_training) are
    the very values the e4m3 forward multiplied, and P agrees with the LSE the forward saved. With descales
    of any other form, the backward's P is off by the bf16 rounding of the dequantized inputs, a row factor
    exp(lse~ - lse) (tests/fp8_bounds.py e4m3_backward_terms): on the CPU model of tests/test_fp8_backward.py
    dV's error was 3.7-3.9x PyTorch's practice's with amax / 448 itself, 1.0x with powers of two. The cost:
    the largest element lands anywhere in the top binade, and one binade of range goes at the bottom."""
    b, n, h, d = t.shape
    # bf16 stays bf16: its abs and amax are exact, and so is a product with a power of two (one exponent,
    # the same range as float32), so nothing here rounds before the cast to e4m3, in half the bytes of a
    # float32 copy (its six passes cost ~2 ms a call at 4 x 4096 x 16 x 128 on an H200). fp16 and float32 go
    # through float32 (a power of two would underflow fp16's narrower range).
    x = t.detach()
    if x.dtype is not torch.bfloat16:
        x = x.to(torch.float32)
    x = x.reshape(b, n, heads_kv, h // heads_kv, d)
    amax = x.abs().amax(dim=(1, 3, 4)).to(torch.float32)  # (batch, heads_kv)
    # frexp: amax / 448 = m 2^e with m in [0.5, 1), so 2^e is the least power of two above it, or 2^(e - 1)
    # equals it when m is 0.5: the largest element then lands in [224, 448]. The exponent stays at or above
    # -126 so that 2^-e is a finite float32 (a head whose amax is under ~1e-36 keeps descale 2^-126 and
    # rounds to e4m3's small values); a head holding inf or NaN gets a NaN descale and NaN elements, so an
    # overflow upstream is not hidden as 448.
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)
    exponent = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp(min=-126)
    one = torch.ones_like(amax)
    nan = torch.full_like(amax, float("nan"))
    finite, positive = torch.isfinite(amax), amax > 0
    descale = torch.where(finite, torch.where(positive, torch.ldexp(one, exponent), one), nan)
    inverse = torch.where(finite, torch.where(positive, torch.ldexp(one, -exponent), one), nan).to(x.dtype)
    q8 = (x * inverse[:, None, :, None, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(b, n, h, d)
    return q8, descale
