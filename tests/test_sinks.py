"""Attention sinks (``sinks=``, flash_attention.sinks) on the CPU paths: attention(), its autograd (the sinks'
own gradient included), the KV-cache call and validation, against the float64 reference, which computes
the sinks as an extra column of the softmax (not through the rescale the library uses)."""

from __future__ import annotations

import zlib

import pytest
import torch

import flash_attention
from flash_attention.fallback.reference import attention_reference
from flash_attention.sinks import apply_sinks, sinks_gradient

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, variant)
CASES = [
    (2, 37, 45, 4, 2, 16, False, None),
    (2, 45, 37, 4, 4, 24, True, None),  # causal with seqlen_q > seqlen_k: rows that see no key
    (1, 50, 50, 6, 2, 16, True, "window"),
    (2, 40, 40, 4, 1, 32, False, "key_range"),
    (1, 33, 41, 4, 2, 16, True, "softcap"),
]


def _inputs(case, dtype=torch.float32):
    b, sq, sk, hq, hkv, d, causal, variant = case
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k, v = torch.randn(b, sk, hkv, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype)
    sinks = torch.randn(hq, dtype=dtype) * 2
    kw: dict = {"causal": causal}
    if variant == "window":
        kw["window"] = (7, 0)
    elif variant == "key_range":
        kw["key_range"] = torch.tensor([[3, 31], [0, 0]][:b], dtype=torch.int32)  # an empty row too
    elif variant == "softcap":
        kw["softcap"] = 1.5
    return (q, k, v, sinks), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sinks_forward_and_gradients_match_float64(case, dtype):
    # float64 runs the chunked backward, which renormalises each row of P in float64 against the float32
    # LSE's rounding: a row's sum then counts its sink (it forced the rows to sum to one before, and the
    # gradients were 2-5% off, with or without the sinks' own gradient).
    torch.manual_seed(zlib.crc32(repr(case).encode()))
    (q, k, v, sinks), kw = _inputs(case, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = flash_attention.attention(*leaves[:3], sinks=leaves[3], return_lse=True, **kw)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = attention_reference(*ref_leaves[:3], sinks=ref_leaves[3], **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=2e-6)
    # A row with no key keeps lse = its sink (logaddexp(-inf, sink)), never -inf or NaN.
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, leaf, g, r in zip("q k v sinks".split(), leaves, grads, ref_grads, strict=True):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        torch.testing.assert_close(g.double(), r, atol=5e-6, rtol=5e-6, msg=name)
    # Without autograd (the direct path) the same numbers.
    with torch.no_grad():
        again = flash_attention.attention(q, k, v, sinks=sinks, **kw)
    torch.testing.assert_close(again, out.detach(), atol=1e-6, rtol=1e-6)


def test_sinks_change_the_result_and_a_very_negative_sink_is_no_sink():
    torch.manual_seed(3)
    (q, k, v, sinks), kw = _inputs(CASES[0])
    plain = flash_attention.attention(q, k, v, **kw)
    with_sinks = flash_attention.attention(q, k, v, sinks=sinks, **kw)
    assert (with_sinks - plain).abs().max() > 1e-2  # a check that could not fail would prove nothing
    gone = flash_attention.attention(q, k, v, sinks=torch.full_like(sinks, -1e4), **kw)
    torch.testing.assert_close(gone, plain, atol=1e-6, rtol=1e-6)


def test_apply_sinks_and_its_gradient_formula_against_autograd():
    # The rescale and the closed-form gradient (flash_attention.sinks) against autograd through the
    # sink-free reference plus an explicit softmax column, in float64.
    torch.manual_seed(5)
    b, s, h, d = 2, 9, 3, 8
    o = torch.randn(b, s, h, d, dtype=torch.float64)
    lse = torch.randn(b, h, s, dtype=torch.float64)
    lse[0, 1, 2] = float("-inf")  # a row with no key
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    factor = torch.exp(lse - torch.logaddexp(lse, sinks[None, :, None]))
    want = o * factor.transpose(1, 2).unsqueeze(-1)
    got, new_lse = apply_sinks(o.clone(), lse.float(), sinks)
    torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
    assert new_lse[0, 1, 2].item() == pytest.approx(sinks[1].item(), rel=1e-6)
    dout = torch.randn_like(o)
    (want_grad,) = torch.autograd.grad(want, sinks, dout)
    got_grad = sinks_gradient(dout, got, torch.logaddexp(lse, sinks.detach()[None, :, None]), sinks)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-6)  # (computed in float32)


def test_kvcache_call_takes_sinks():
    torch.manual_seed(7)
    b, cap, hq, hkv, d = 2, 40, 4, 2, 16
    k_cache, v_cache = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    q = torch.randn(b, 1, hq, d)
    lengths = torch.tensor([17, 40], dtype=torch.int32)
    sinks = torch.randn(hq)
    out, lse = flash_attention.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, sinks=sinks, return_lse=True
    )
    for row in range(b):
        n = int(lengths[row])
        ref, ref_lse = attention_reference(
            q[row : row + 1], k_cache[row : row + 1, :n], v_cache[row : row + 1, :n], causal=True, sinks=sinks
        )
        torch.testing.assert_close(out[row : row + 1].double(), ref, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(lse[row : row + 1].double(), ref_lse, atol=2e-6, rtol=2e-6)


def test_bad_sinks_are_refused_naming_the_argument():
    q = torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads_q,\) = \(4,\)"):
        flash_attention.attention(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        flash_attention.attention(q, q, q, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        flash_attention.attention(q, q, q, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="sinks must have shape"):
        flash_attention.attention_with_kvcache(q[:, :1], q, q, cache_seqlens=8, sinks=torch.zeros(4, 1))
