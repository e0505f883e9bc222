"""GPU tests of the PyTorch fallback on CUDA tensors (marked gpu): float32, and half precision as a GPU below
sm_80 or without a compiler would run it, through PyTorch's memory-efficient CUDA kernel under our semantics
(bottom-right causal, GQA without copies, key ranges, rows with no key), against the float64 reference.

The fused cases are the CPU tests' (tests/test_fallback.py), so both devices are held to the same
properties: the chunked path is never taken, a poisoned output buffer is fully written, rows with no key
give out 0 and LSE -inf, and out, LSE and gradients match float64 autograd of the reference.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_fallback import _FUSED_CASES, check_fused_path

import flash_attention
from flash_attention import fallback
from flash_attention.fallback.reference import attention_reference

pytestmark = pytest.mark.gpu

# Max error of out against the reference, and of each gradient relative to its largest element. float32 on
# the memory-efficient kernel runs its products as three TF32 products (about float32's accuracy).
OUT_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _inputs(b, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(b, sq, hq, d, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
    return q, k, v


def _no_chunked_path(monkeypatch):
    monkeypatch.setattr(fallback, "attention_torch", lambda *a, **kw: pytest.fail("chunked forward"))
    monkeypatch.setattr(
        fallback, "attention_backward_torch", lambda *a, **kw: pytest.fail("chunked backward")
    )


def _check_grads(grads, leaves64, dtype, rows):
    for got, want, name in zip(grads, (t.grad for t in leaves64), ("dq", "dk", "dv"), strict=True):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        rel = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        assert rel <= GRAD_TOL[dtype], (name, rel)
    dq = grads[0]
    assert torch.equal(dq[~rows], torch.zeros_like(dq[~rows]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", _FUSED_CASES, ids=str)
def test_fused_cuda_path_matches_the_reference(case, causal, dtype, monkeypatch):
    b, sq, sk, hq, hkv, d, kr = case
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, dtype)
    kr = None if kr is None else torch.tensor(kr, device="cuda")
    check_fused_path(q, k, v, kr, causal, OUT_TOL[dtype], GRAD_TOL[dtype], monkeypatch)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 300, 8, 2, 64), (1, 1000, 4, 4, 128), (3, 77, 6, 3, 40)], ids=str)
def test_float32_attention_on_cuda_runs_the_fused_kernel(shape, causal, return_lse, monkeypatch):
    """attention() with float32 CUDA tensors, through autograd: the fused path (our op, or SDPA itself for a
    plain call: equal heads, no LSE), forward and backward."""
    b, s, hq, hkv, d = shape
    _no_chunked_path(monkeypatch)
    q, k, v = (t.requires_grad_(True) for t in _inputs(b, s, s, hq, hkv, d, torch.float32))
    if return_lse:
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
    else:
        out, lse = flash_attention.attention(q, k, v, causal=causal), None
        plain = "ScaledDotProduct" in type(out.grad_fn.next_functions[0][0]).__name__
        assert plain == (hq == hkv), out.grad_fn
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_lse = attention_reference(q64, k64, v64, causal=causal)
    assert (out.double() - ref_out.detach()).abs().max().item() <= OUT_TOL[torch.float32]
    if lse is not None:
        assert (lse.double() - ref_lse.detach()).abs().max().item() <= 1e-5
    (ref_out * dout.double()).sum().backward()
    rows = torch.ones(b, s, dtype=torch.bool, device="cuda")
    _check_grads((q.grad, k.grad, v.grad), (q64, k64, v64), torch.float32, rows)


@pytest.mark.parametrize("head_dim", [6, 20, 250])
def test_float32_any_head_dim_is_right_on_either_path(head_dim):
    """Head dims PyTorch's memory-efficient kernel may refuse (its alignment rules) take the chunked path:
    the answer is the same either way."""
    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 90, 70, 4, 2, head_dim, torch.float32))
    out = flash_attention.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref_out, _ = attention_reference(q64, k64, v64, causal=True)
    # causal with 90 queries and 70 keys: the first 20 rows see no key.
    rows = torch.zeros(2, 90, dtype=torch.bool, device="cuda")
    rows[:, 20:] = True
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    assert (out.double() - ref_out.detach())[rows].abs().max().item() <= OUT_TOL[torch.float32]
    (ref_out * dout.double()).sum().backward()
    _check_grads((q.grad, k.grad, v.grad), (q64, k64, v64), torch.float32, rows)
