"""FP8 (e4m3) inputs with descales through attention() (flash_attention.spec.fp8; docs/fp8-study.md, the
contract): against the float64 reference on the exactly dequantized tensors, within twice the error of
PyTorch's own FP8-input attention (dequantize to bf16, bf16 SDPA); descales per tensor and per (batch, kv
head) with grouped queries; the checks that name the bad argument. On a GPU the same call runs our kernels
(marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flash_attention as fa
from flash_attention.fallback.reference import attention_reference
from flash_attention.spec import fp8

E4M3 = torch.float8_e4m3fn


def _quantized(seed, b, sq, sk, hq, hkv, d, device="cpu"):
    """e4m3 q, k, v (with values spread over e4m3's range, so the descales matter) and their descales:
    q's per (batch, kv head), k's per tensor, v's None."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen) * 40
    k = torch.randn(b, sk, hkv, d, generator=gen) * 100
    v = torch.randn(b, sk, hkv, d, generator=gen)
    q_descale = (torch.rand(b, hkv, generator=gen) * 0.02 + 0.01).to(device)
    k_descale = torch.tensor([0.013]).to(device)
    # (Clamped to e4m3's largest finite value, as a quantizer saturates: the cast makes NaN of what's beyond.)
    big = fp8.E4M3_MAX
    return [t.clamp(-big, big).to(E4M3).to(device) for t in (q, k, v)], (q_descale, k_descale, None)


def _dequantized(tensors, descales, dtype):
    """float(t) * descale in ``dtype`` (a query head takes its kv head's descale)."""
    hkv = tensors[1].shape[2]
    out = []
    for t, ds in zip(tensors, descales, strict=True):
        x = t.to(dtype)
        if ds is not None:
            ds = ds.to(dtype)
            x = x * (
                ds.reshape(())
                if ds.numel() == 1
                else ds.repeat_interleave(t.shape[2] // hkv, 1)[:, None, :, None]
            )
        out.append(x)
    return out


def _torch_fp8_practice(q, k, v, causal):
    """PyTorch's own FP8-input attention: the dequantized bf16 tensors through SDPA (GQA expanded)."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (
        x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2))
    )
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 70, 90, 4, 2, 64), (1, 33, 33, 6, 1, 128)])
def test_fp8_attention_against_float64_on_the_dequantized_inputs(shape, causal):
    tensors, descales = _quantized(sum(shape) + causal, *shape)
    exact = attention_reference(*_dequantized(tensors, descales, torch.float64), causal=causal)
    out = torch.full((*shape[:2], shape[3], shape[5]), float("nan"), dtype=torch.bfloat16)
    got, lse = fa.attention(
        *tensors, causal=causal, return_lse=True, out=out, q_descale=descales[0], k_descale=descales[1]
    )
    assert got is out and got.dtype == torch.bfloat16 and lse.dtype == torch.float32
    practice = _torch_fp8_practice(*_dequantized(tensors, descales, torch.bfloat16), causal)
    err = (got.double() - exact[0]).abs().max().item()
    err_torch = (practice.double() - exact[0]).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, f"{err:.3g} against PyTorch's FP8 practice {err_torch:.3g}"
    torch.testing.assert_close(lse.double(), exact[1], rtol=0, atol=2e-2)
    # The descales are applied: without them the result is another attention altogether.
    plain = fa.attention(*tensors, causal=causal)
    assert (plain.double() - exact[0]).abs().max().item() > 20 * max(err, 1e-3)


def test_fp8_descales_default_to_one_and_every_option_applies():
    tensors, _ = _quantized(7, 1, 40, 50, 2, 2, 64)
    window, softcap = (8, 0), 2.0
    got = fa.attention(*tensors, causal=True, window=window, softcap=softcap)
    ref = fa.attention(*(t.to(torch.bfloat16) for t in tensors), causal=True, window=window, softcap=softcap)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)  # the same bf16 call, bit for bit


def test_fp8_checks_name_the_argument():
    (q, k, v), (qd, kd, _) = _quantized(3, 2, 16, 16, 4, 2, 64)
    with pytest.raises(TypeError, match="v must be torch.float8_e4m3fn"):
        fa.attention(q, k, v.to(torch.bfloat16))
    with pytest.raises(TypeError, match="q_descale given, so q must be torch.float8_e4m3fn"):
        fa.attention(*(t.to(torch.bfloat16) for t in (q, k, v)), q_descale=qd)
    with pytest.raises(
        ValueError, match=r"k_descale must hold one number or one per \(batch, kv head\), shape \(2, 2\)"
    ):
        fa.attention(q, k, v, k_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="v_descale must be float32"):
        fa.attention(q, k, v, v_descale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="q_descale must be a float32 tensor or None"):
        fa.attention(q, k, v, q_descale=0.5)
    with pytest.raises(ValueError, match="q is an e4m3 tensor that requires grad"):
        fa.attention(q.clone().requires_grad_(), k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_attention_on_the_gpu(causal, head_dim):
    """On CUDA: at head_dim 64, 128 and 256 on Hopper the e4m3 kernel (ops.fp8_forward), within the bound
    derived from where it rounds (tests/fp8_bounds.py: P in e4m3, above PyTorch's practice); elsewhere the
    dequantized tensors on our bf16 kernels, within twice PyTorch's practice."""
    from fp8_bounds import e4m3_output_bound

    from flash_attention.ops.fp8_forward import E4M3_HEAD_DIMS, kernel_takes

    shape = (2, 300, 517, 8, 2, head_dim)
    tensors, descales = _quantized(11 + causal, *shape, device="cuda")
    exact_inputs = _dequantized(
        [t.cpu() for t in tensors], [None if d is None else d.cpu() for d in descales], torch.float64
    )
    exact = attention_reference(*exact_inputs, causal=causal)
    got = fa.attention(*tensors, causal=causal, q_descale=descales[0], k_descale=descales[1])
    routed = kernel_takes(*tensors, scale=head_dim**-0.5)
    # (the route itself is asserted: a predicate that never routes would pass the bound below unseen)
    assert routed == (head_dim in E4M3_HEAD_DIMS and torch.cuda.get_device_capability() == (9, 0))
    if routed:
        qx, kx, vx = exact_inputs
        group = qx.shape[2] // kx.shape[2]
        bound, _ = e4m3_output_bound(
            qx, kx.repeat_interleave(group, 2), vx.repeat_interleave(group, 2), causal, head_dim**-0.5
        )
        worst = ((got.cpu().double() - exact[0]).abs() / bound).max().item()
        assert worst <= 1.0, f"an element at {worst:.3g}x its bound"
        return
    practice = _torch_fp8_practice(
        *_dequantized(
            [t.cpu() for t in tensors], [None if d is None else d.cpu() for d in descales], torch.bfloat16
        ),
        causal,
    )
    err = (got.cpu().double() - exact[0]).abs().max().item()
    err_torch = (practice.double() - exact[0]).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, f"{err:.3g} against PyTorch's FP8 practice {err_torch:.3g}"


def test_fp8_varlen_takes_each_sequences_descales():
    """attention_varlen with e4m3 tensors: a per-(sequence, kv head) descale scales each packed row by its
    own sequence's (the offsets made into a row index on the device), against float64 per sequence."""
    lens_q, lens_k, hq, hkv, d = [5, 0, 17, 9], [7, 3, 17, 12], 4, 2, 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), hq, d, generator=gen) * 30
    k = (
        torch.randn(sum(lens_k), hkv, d, generator=gen) * 2
    )  # (scores of a few units: the softmax feels q's scale)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen)
    q8, k8, v8 = (t.to(E4M3) for t in (q, k, v))
    qd = torch.rand(len(lens_q), hkv, generator=gen) * 0.03 + 0.01
    vd = torch.rand(len(lens_q), hkv, generator=gen) + 0.5
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lens_q, lens_k)
    )
    got = fa.attention_varlen(q8, k8, v8, cu_q, cu_k, causal=True, q_descale=qd, v_descale=vd)
    assert got.dtype == torch.bfloat16 and got.shape == (sum(lens_q), hq, d)
    for b in range(len(lens_q)):
        if lens_q[b] == 0:
            continue
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [
            x[s].double()[None]
            * (ds[b].repeat_interleave(x.shape[1] // hkv)[None, None, :, None] if ds is not None else 1)
            for x, s, ds in ((q8, qs, qd), (k8, ks, None), (v8, ks, vd))
        ]
        exact = attention_reference(*seq, causal=True)[0][0]
        lowp = _torch_fp8_practice(*(x.to(torch.bfloat16) for x in seq), True)[0]
        err = (got[qs].double() - exact).abs().max().item()
        err_torch = (lowp.double() - exact).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, (
            f"sequence {b}: {err:.3g} against PyTorch's FP8 practice {err_torch:.3g}"
        )
    with pytest.raises(
        ValueError, match=r"q_descale must hold one number or one per \(batch, kv head\), shape \(4, 2\)"
    ):
        fa.attention_varlen(q8, k8, v8, cu_q, cu_k, q_descale=torch.ones(2, 2))


def test_fp8_true_quantizes_bf16_inputs_and_passes_the_gradient_through():
    """attention(q, k, v, fp8=True) on bf16 tensors: e4m3 per (batch, kv head) with descale amax / 448 rounded
    up to a power of two (q's amax over its GQA group; an all-zero head keeps 1), the same output as the e4m3
    call with those descales, and the gradients of the bf16 tensors those of attention at the dequantized
    tensors (the quantization's derivative taken as 1)."""
    gen = torch.Generator().manual_seed(9)
    b, n, hq, hkv, d = 2, 40, 4, 2, 64
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))
    k[1, :, 0] = 0  # an all-zero kv head: descale 1, not 0 / 0
    q8, qd = fp8.quantize(q, hkv)
    k8, kd = fp8.quantize(k, hkv)
    v8, vd = fp8.quantize(v, hkv)
    assert qd.shape == (b, hkv) and kd[1, 0] == 1
    ratio = q.float().reshape(b, n, hkv, hq // hkv, d).abs().amax(dim=(1, 3, 4)) / 448
    assert torch.equal(torch.log2(qd), torch.log2(qd).round())  # (powers of two)
    assert bool((qd >= ratio).all() and (qd < 2 * ratio).all())  # (the least one at or above amax / 448)
    # The largest element of each kv head's group lands in e4m3's top binade.
    top = q8.float().reshape(b, n, hkv, hq // hkv, d).abs().amax(dim=(1, 3, 4))
    assert bool(((top >= 224) & (top <= 448)).all())
    e4m3_call = fa.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fa.attention(*leaves, causal=True, fp8=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, e4m3_call)
    do = torch.randn(got.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(got, leaves, do)
    deq = [fp8.dequantize(t, s, hkv).requires_grad_() for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    want = torch.autograd.grad(fa.attention(*deq, causal=True), deq, do)
    for g, w in zip(grads, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(TypeError, match="fp8=True takes 4-D bfloat16 q, k and v; v is torch.float32"):
        fa.attention(q, k, v.float(), fp8=True)
    with pytest.raises(ValueError, match="k_descale is for e4m3 inputs"):
        fa.attention(q, k, v, fp8=True, k_descale=kd)
