"""The FP8 calls' backward (flash_attention.api.fp8_training; docs/fp8-study.md 4.2's first form), off the
GPU: attention(q, k, v, fp8=True) routed to the e4m3 kernel (here a stand-in that records its calls and
computes attention of the dequantized tensors) keeps the e4m3 tensors for its backward and returns the
gradients of the bf16 backward on the dequantized tensors; attention_fp8_backward gives e4m3 inputs the
gradients with respect to their dequantized tensors, against float64 autograd on those; its checks name the
bad argument. The GPU tests are tests/test_gpu_fp8_backward.py."""

from __future__ import annotations

import pytest
import torch
from fp8_bounds import assert_within_backward_bound, p_rounded_to, practice_grads

import flash_attention as fa
from flash_attention.api.fp8_training import _dequantized_backward
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import fp8_forward
from flash_attention.spec import OpOptions, fp8

E4M3 = torch.float8_e4m3fn


def _bf16_inputs(seed, b=2, sq=37, sk=53, hq=4, hkv=2, d=64):
    gen = torch.Generator().manual_seed(seed)
    scales = (3.0, 2.0, 1.0)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    return [
        (torch.randn(s, generator=gen) * c).to(torch.bfloat16) for s, c in zip(shapes, scales, strict=True)
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_true_on_the_e4m3_kernel_keeps_e4m3_and_takes_the_bf16_backward(causal, monkeypatch):
    calls = []

    def stand_in(q8, k8, v8, *, causal, softmax_scale, q_descale, k_descale, v_descale, return_lse):
        # The e4m3 kernel's contract (ops.fp8_forward.cuda_forward_e4m3): attention of the dequantized
        # tensors.
        calls.append((q8.dtype, tuple(q_descale.shape), return_lse))
        hkv = k8.shape[2]
        deq = [fp8.dequantize(t, s, hkv) for t, s in ((q8, q_descale), (k8, k_descale), (v8, v_descale))]
        return fa.attention(*deq, causal=causal, softmax_scale=softmax_scale, return_lse=True)

    monkeypatch.setattr(fp8_forward, "kernel_takes", lambda *a, **kw: True)
    monkeypatch.setattr(fp8_forward, "cuda_forward_e4m3", stand_in)
    q, k, v = _bf16_inputs(5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got, lse = fa.attention(*leaves, causal=causal, fp8=True, return_lse=True)
    assert calls == [(E4M3, (2, 2), True)]  # (routed: one kernel call on e4m3 tensors, per-kv-head descales)
    # What autograd keeps: the three e4m3 tensors (a byte an element), their descales, out and the LSE.
    saved = got.grad_fn.saved_tensors
    assert [t.dtype for t in saved[:3]] == [E4M3] * 3 and not lse.requires_grad
    quantized = [fp8.quantize(t, 2) for t in (q, k, v)]
    for (t8, s), kept8, kept_s in zip(quantized, saved[:3], saved[3:6], strict=True):
        assert torch.equal(t8.view(torch.uint8), kept8.view(torch.uint8)) and torch.equal(s, kept_s)
    deq = [fp8.dequantize(t8, s, 2).requires_grad_() for t8, s in quantized]
    want = fa.attention(*deq, causal=causal)
    assert torch.equal(got, want)
    do = torch.randn(got.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    grads = torch.autograd.grad(got, leaves, do)
    # The bf16 backward on the dequantized tensors with the forward's out and LSE: here the same as autograd
    # through the bf16 call on them (the stand-in's out and LSE are that call's).
    for g, w in zip(grads, torch.autograd.grad(want, deq, do), strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)
    # Options are checked as for a bf16 call before the route, and the backward's mode is the argument or
    # PyTorch's switch.
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fa.attention(*leaves, causal=causal, fp8=True, deterministic="yes")
    assert not got.grad_fn.options.deterministic
    torch.use_deterministic_algorithms(True)
    try:
        assert fa.attention(*leaves, causal=causal, fp8=True).grad_fn.options.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
    # Only the LSE used: no gradient reaches the inputs, and none is an error.
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    _, lse2 = fa.attention(*leaves2, causal=causal, fp8=True, return_lse=True)
    assert not lse2.requires_grad


def _e4m3_call(seed, causal, per_tensor):
    """An e4m3 call's inputs (descales per (batch, kv head), or one per tensor) and its out and LSE."""
    e4m3, descales = [], []
    for t in _bf16_inputs(seed):
        if per_tensor:
            d = (t.float().abs().amax() / fp8.E4M3_MAX).reshape(1)
            e4m3.append((t.float() / d).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(E4M3))
            descales.append(d)
        else:
            t8, d = fp8.quantize(t, 2)
            e4m3.append(t8)
            descales.append(d)
    names = {"q_descale": descales[0], "k_descale": descales[1], "v_descale": descales[2]}
    out, lse = fa.attention(*e4m3, causal=causal, return_lse=True, **names)
    return e4m3, names, out, lse


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_fp8_backward_gives_the_dequantized_tensors_gradients(causal, per_tensor):
    e4m3, descales, out, lse = _e4m3_call(7 + causal, causal, per_tensor)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    got = fa.attention_fp8_backward(do, *e4m3, out, lse, causal=causal, **descales)
    assert [g.shape for g in got] == [t.shape for t in e4m3] and {g.dtype for g in got} == {torch.bfloat16}
    ds = (descales["q_descale"], descales["k_descale"], descales["v_descale"])
    # Against float64 autograd on the exactly dequantized tensors, within twice the error of PyTorch's own
    # practice (the dequantized bf16 tensors through SDPA's backward).
    exact = [(t.double() * (d.double().reshape(()) if d.numel() == 1 else
              d.double().repeat_interleave(t.shape[2] // 2, 1)[:, None, :, None])).requires_grad_()
             for t, d in zip(e4m3, ds, strict=True)]  # fmt: skip
    want = torch.autograd.grad(attention_reference(*exact, causal=causal)[0], exact, do.double())
    practice = practice_grads(
        *(fp8.dequantize(t, d, 2) for t, d in zip(e4m3, ds, strict=True)),
        do,
        causal,
        e4m3[0].shape[3] ** -0.5,
    )
    for name, g, w, p in zip("qkv", got, want, practice, strict=True):
        err = (g.double() - w).abs().max().item()
        err_torch = (p.double() - w).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, f"d{name}: {err:.3g} against PyTorch's practice {err_torch:.3g}"


def test_attention_fp8_backward_names_the_bad_argument():
    e4m3, descales, out, lse = _e4m3_call(3, False, False)
    do = torch.randn(out.shape).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"dout must be torch.bfloat16 of shape \(2, 37, 4, 64\)"):
        fa.attention_fp8_backward(do.float(), *e4m3, out, lse, **descales)
    with pytest.raises(ValueError, match="lse must be torch.float32 of shape"):
        fa.attention_fp8_backward(do, *e4m3, out, lse[:, :, :5], **descales)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        fa.attention_fp8_backward(do, *e4m3, None, lse, **descales)
    with pytest.raises(TypeError, match="q must be torch.float8_e4m3fn"):
        fa.attention_fp8_backward(do, out, *e4m3[1:], out, lse)
    with pytest.raises(ValueError, match="k_descale must hold one number or one per"):
        fa.attention_fp8_backward(do, *e4m3, out, lse, k_descale=torch.ones(3))


@pytest.mark.parametrize("causal", [False, True])
def test_the_gpu_tests_backward_bound_holds_a_model_of_the_kernel_and_not_a_fault(causal):
    # tests/test_gpu_fp8_backward.py's bound (fp8_bounds.assert_within_backward_bound), on this backward (the
    # PyTorch fallback here) fed a float64 model of the e4m3 forward: P rounded to e4m3 in the output, the
    # LSE of the exact products.
    q, k, v = _bf16_inputs(21 + causal)
    e4m3, descales = zip(*(fp8.quantize(t, 2) for t in (q, k, v)), strict=True)
    exact = [
        fp8.dequantize(t, None, 2).double()
        * d.double().repeat_interleave(t.shape[2] // 2, 1)[:, None, :, None]
        for t, d in zip(e4m3, descales, strict=True)
    ]
    kr, vr = (t.repeat_interleave(2, 2) for t in exact[1:])
    scale = q.shape[3] ** -0.5
    out = p_rounded_to(E4M3, exact[0], kr, vr, causal, scale).to(torch.bfloat16)
    s = torch.einsum("bqhd,bkhd->bhqk", exact[0], kr) * scale
    if causal:
        s = s.masked_fill(
            ~torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2]), -torch.inf
        )
    lse = torch.logsumexp(s, -1).float()
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    grads = _dequantized_backward(do, e4m3, descales, out, lse, OpOptions(causal, scale))
    assert_within_backward_bound(grads, e4m3, descales, do, out, lse, causal, scale)
    # A backward that disagrees with its forward (a softmax scale 1% off) falls outside it, and so does a
    # forward's LSE off by 0.05.
    wrong = _dequantized_backward(do, e4m3, descales, out, lse, OpOptions(causal, scale * 1.01))
    with pytest.raises(AssertionError, match="beyond its own terms"):
        assert_within_backward_bound(wrong, e4m3, descales, do, out, lse, causal, scale)
    with pytest.raises(AssertionError, match="LSE .* beyond its bound"):
        assert_within_backward_bound(grads, e4m3, descales, do, out, lse + 0.05, causal, scale)


def test_the_quantizers_descales_dequantize_exactly_in_bf16():
    # The backward dequantizes fp8=True's tensors in bf16 (spec.fp8.dequantize(powers_of_two=True)): with
    # quantize's power-of-two descales that is the float32 product, bit for bit, over e4m3's whole range;
    # with a descale that is not a power of two it would not be (so form 1 keeps the float32 product).
    gen = torch.Generator().manual_seed(12)
    for exponent in (-30, -8, 0, 8, 30):
        t = (torch.randn(2, 19, 4, 64, generator=gen) * 2.0**exponent).to(torch.bfloat16)
        t8, d = fp8.quantize(t, 2)
        want = fp8.dequantize(t8, d, 2)
        assert torch.equal(fp8.dequantize(t8, d, 2, powers_of_two=True), want)
    odd = d * 1.3
    assert not torch.equal(fp8.dequantize(t8, odd, 2, powers_of_two=True), fp8.dequantize(t8, odd, 2))
