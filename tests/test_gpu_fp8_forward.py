"""The e4m3 forward kernel (ops.fp8_forward, docs/fp8-study.md step 2) against the float64 reference on the
exactly dequantized inputs, element by element within the bound derived from where the kernel rounds
(tests/fp8_bounds.py: P to e4m3 above all, 3 significand bits), and beside PyTorch's own FP8-input practice
(dequantize to bf16, bf16 SDPA), whose error is printed for the record: the first GPU run (H200) put the
kernel's at 4.5-7x the practice's, as a float64 model of P's rounding predicts (kernel log, fp8-study)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fp8_bounds import e4m3_output_bound

from flash_attention.fallback.reference import attention_reference
from flash_attention.ops.fp8_forward import cuda_forward_e4m3, e4m3_config

E4M3 = torch.float8_e4m3fn


def test_the_e4m3_forward_names_what_it_does_not_take():
    with pytest.raises(ValueError, match="head_dim"):
        e4m3_config(192)
    x = torch.zeros(1, 8, 1, 128)
    with pytest.raises(TypeError, match="q must be a 4-D float8_e4m3fn CUDA tensor"):
        cuda_forward_e4m3(x, x, x)


def _case(seed, b, sq, sk, hq, hkv, device, form="floats", head_dim=128):
    """e4m3 q, k, v spread over e4m3's range, their descales in `form` (Python numbers, one-element tensors,
    or one per (batch, kv head)), and the exactly dequantized float64 tensors."""
    gen = torch.Generator().manual_seed(seed)
    scales = (30.0, 60.0, 2.0)  # (spread over e4m3's range, so the descales matter)
    raw = [
        torch.randn(b, s, h, head_dim, generator=gen) * c
        for (s, h), c in zip(((sq, hq), (sk, hkv), (sk, hkv)), scales, strict=True)
    ]
    e4m3 = [t.clamp(-448, 448).to(E4M3) for t in raw]
    base = (0.02, 0.011, 0.7)
    # (the float32 values the kernel reads, as the float64 reference's factors)
    per_head = [torch.full((b, hkv), d, dtype=torch.float32) for d in base]
    if form == "per_head":
        per_head = [t * (0.5 + torch.rand(b, hkv, generator=gen)) for t in per_head]
    descales = {
        "floats": base,
        "tensors": [torch.tensor([d], dtype=torch.float32, device=device) for d in base],
        "per_head": [t.to(device) for t in per_head],
    }[form]
    exact = [
        t.double() * d.double().repeat_interleave(t.shape[2] // hkv, 1).view(b, 1, t.shape[2], 1)
        for t, d in zip(e4m3, per_head, strict=True)
    ]
    return [t.to(device) for t in e4m3], descales, exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "shape", [(2, 300, 517, 8, 2), (1, 1024, 1024, 4, 4), (1, 77, 77, 2, 2), (2, 256, 640, 4, 1)]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["floats", "tensors", "per_head"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_e4m3_forward_against_float64_on_the_dequantized_inputs(shape, causal, form, head_dim):
    # (head_dim 64: Q's and K's 64-byte rows through the 64-byte swizzle, V^T by its head_dim-64 entry point)
    (q, k, v), (qd, kd, vd), exact = _case(
        sum(shape) + causal, *shape, device="cuda", form=form, head_dim=head_dim
    )
    o, lse = cuda_forward_e4m3(
        q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True
    )
    ref, ref_lse = attention_reference(*exact, causal=causal)
    group = shape[3] // shape[4]
    qt, kt, vt = (
        x.to(torch.bfloat16).transpose(1, 2)
        for x in (exact[0], exact[1].repeat_interleave(group, 2), exact[2].repeat_interleave(group, 2))
    )
    sq, sk = shape[1], shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    practice = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    # (every query row sees a key: seqlen_q <= seqlen_k in every shape)
    bound, _ = e4m3_output_bound(
        exact[0],
        exact[1].repeat_interleave(group, 2),
        exact[2].repeat_interleave(group, 2),
        causal,
        1 / math.sqrt(head_dim),
    )
    diff = (o.cpu().double() - ref).abs()
    err, err_practice = diff.max().item(), (practice.double() - ref).abs().max().item()
    worst = (diff / bound).max().item()
    print(
        f"e4m3 forward {shape} causal={causal}: max error {err:.3g} ({worst:.2f} of the bound), "
        f"PyTorch's practice {err_practice:.3g}"
    )
    assert worst <= 1.0, f"an element at {worst:.3g}x its bound (max error {err:.3g})"
    assert torch.allclose(lse.cpu().double(), ref_lse, atol=2e-3, rtol=0)
