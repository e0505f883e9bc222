"""GPU tests of v with its own head_dim (issue 51): attention() and attention_varlen() on CUDA tensors whose v
has another head_dim than q and k (DeepSeek's 192/128, and 128/64) run our kernels both ways -- the
warp-specialized forward reads v's head_dim, the backward runs q's head_dim's kernels on v, the output and
dO zero-padded to it (ops.cuda_backward) -- with no fallback warning, and their output, LSE and gradients
agree with float64 within twice the error of the same computation in float32 rounded to the inputs'
precision (the suite's rule), variants included."""

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

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal, dtype, variant)
CASES = [
    (2, 333, 517, 8, 8, 192, 128, True, torch.bfloat16, {}),
    (1, 300, 300, 8, 2, 128, 64, False, torch.float16, {}),
    (1, 400, 400, 4, 4, 192, 128, True, torch.bfloat16, {"window": (100, 0)}),
    (1, 257, 257, 4, 2, 128, 64, False, torch.bfloat16, {"softcap": 20.0}),
    (1, 257, 300, 4, 4, 192, 128, True, torch.bfloat16, {"sinks": True}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:-1])) + "-" + "-".join(c[-1]))
def test_v_head_dim_on_cuda_runs_the_kernels_and_matches_float64(case, monkeypatch):
    b, sq, sk, hq, hkv, d, dv, causal, dtype, variant = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, dv, generator=gen, device="cuda").to(dtype).requires_grad_()
    do = torch.randn(b, sq, hq, dv, generator=gen, device="cuda").to(dtype)
    variant = dict(variant)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(hq, generator=gen, device="cuda")
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a fallback warns: none may run)
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, **variant)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype

    def run(compute):
        leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
        kw = {n: (t.double() if n == "sinks" else t) for n, t in variant.items()}
        o, row_lse = attention_reference(*leaves, causal=causal, compute_dtype=compute, **kw)
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
        warnings.simplefilter("error")  # (no fallback)
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    assert out.shape == (total, 8, 128)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want, _ = attention_reference(*(t[a:e].unsqueeze(0) for t in (q, k, v)), causal=True)
        assert (out[a:e].double() - want[0]).abs().max().item() < 2e-2
