"""Attention dropout without a GPU: the counter-based keep mask, and the PyTorch paths against an independent
float64 computation that applies the same mask."""

from __future__ import annotations

import math

import pytest
import torch

from flash_attention.dropout import draw_seed, dropout_key, dropout_threshold, keep_mask
from flash_attention.fallback.reference import (
    attention_backward_torch,
    attention_reference,
    attention_torch,
    causal_allowed,
)


def _explicit(q, k, v, causal, keep, p):
    """softmax(q k^T scale) with the mask applied, times v, in float64 (autograd-able)."""
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~causal_allowed(q.shape[1], k.shape[1]), float("-inf"))
    a = torch.softmax(s, -1).nan_to_num(0.0) * keep / (1 - p)
    return torch.einsum("bhqk,bkhd->bqhd", a, v.repeat_interleave(group, 2))


def test_mask_is_reproducible_and_has_the_right_rate():
    m1 = keep_mask(123, 0, 0.3, 2, 4, 300, 500)
    m2 = keep_mask(123, 0, 0.3, 2, 4, 300, 500)
    m3 = keep_mask(124, 0, 0.3, 2, 4, 300, 500)
    m4 = keep_mask(123, 1, 0.3, 2, 4, 300, 500)
    assert torch.equal(m1, m2) and not torch.equal(m1, m3) and not torch.equal(m1, m4)
    n = m1.numel()
    rate = m1.double().mean().item()
    assert abs(rate - 0.7) < 4 * math.sqrt(0.21 / n)  # within 4 standard deviations of Bernoulli(0.7)
    # Rows, columns and heads are not correlated: each marginal is near 0.7 too.
    assert (m1.double().mean(-1) - 0.7).abs().max() < 0.12
    assert (m1.double().mean(-2) - 0.7).abs().max() < 0.12
    assert abs((m1[:, 0] == m1[:, 1]).double().mean().item() - (0.49 + 0.09)) < 0.01
    # Keys j and j + 8 share a finaliser (its two 16-bit halves): uncorrelated all the same.
    pairs = m1[..., :496].unflatten(-1, (31, 2, 8))
    assert abs((pairs[..., 0, :] == pairs[..., 1, :]).double().mean().item() - 0.58) < 0.01


def test_mask_is_the_documented_hash():
    # fa/dropout.cuh's definition written out with Python ints, element by element: v = mix(mix(mix(key ^
    # bh C0) ^ i C1) ^ (j & ~8) C2), its low 16 bits for j with bit 3 clear and its high 16 for j with it set,
    # kept iff >= round(p 2^16).
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seed, offset, p, heads = 99, 3, 0.37, 3
    mask = keep_mask(seed, offset, p, 2, heads, 20, 40)
    key, threshold = dropout_key(seed, offset), round(p * 2**16)  # (the 16-bit threshold)
    gen = torch.Generator().manual_seed(4)
    draws = (torch.randint(0, n, (300,), generator=gen).tolist() for n in (2, heads, 20, 40))
    for b, h, i, j in zip(*draws, strict=True):
        row = mix(mix(key ^ ((b * heads + h) * 0x9E3779B9 & 0xFFFFFFFF)) ^ (i * 0x85EBCA6B & 0xFFFFFFFF))
        v = mix(row ^ ((j & ~8) * 0xC2B2AE35 & 0xFFFFFFFF))
        assert bool(mask[b, h, i, j]) == (((v >> 16) if j & 8 else (v & 0xFFFF)) >= threshold)


def test_threshold_and_key():
    assert (
        dropout_threshold(0.0) == 0
        and dropout_threshold(0.5) == 2**31
        and dropout_threshold(0.99999) == 2**32 - 2**16
    )
    assert dropout_key(1, 2) != dropout_key(2, 1) and 0 <= dropout_key(2**63 - 1, 5) < 2**32
    seed = draw_seed(7)
    assert seed.tolist() == [7, 0]
    torch.manual_seed(0)
    a = draw_seed()
    torch.manual_seed(0)
    assert torch.equal(a, draw_seed())


@pytest.mark.parametrize("causal", [False, True])
def test_fallback_forward_and_backward_apply_the_mask(causal):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 11, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 11, 2, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    p, seed = 0.25, draw_seed(99)
    out, lse = attention_torch(q, k, v, causal=causal, return_lse=True, dropout_p=p, dropout_seed=seed)
    keep = keep_mask(99, 0, p, 2, 4, 9, 11)
    qe, ke, ve = (t.clone().requires_grad_(True) for t in (q, k, v))
    want = _explicit(qe, ke, ve, causal, keep, p)
    assert (out - want).abs().max() < 1e-12
    # The LSE is that of the undropped softmax.
    _, lse0 = attention_torch(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(lse, lse0)
    want.backward(dout)
    dq, dk, dv = attention_backward_torch(
        dout, q, k, v, out, lse, causal=causal, dropout_p=p, dropout_seed=seed
    )
    for got, ref in ((dq, qe.grad), (dk, ke.grad), (dv, ve.grad)):
        assert (got - ref).abs().max() < 1e-10


@pytest.mark.parametrize("score", ["softcap", "alibi", "softcap+alibi"])
def test_fallback_dropout_with_score_functions_matches_the_float64_reference(score):
    # The reference's dropout_keep is the GPU tests' truth for dropout with a score function
    # (tests/test_gpu_score_mods.py); here it checks the PyTorch path, and is itself checked against the
    # plain explicit computation where no score function applies.
    g = torch.Generator().manual_seed(len(score))
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 13, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 13, 2, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    mods = {}
    if "softcap" in score:
        mods["softcap"] = 0.7
    if "alibi" in score:
        mods["alibi_slopes"] = torch.tensor([[0.1, 0.3, 0.5, 0.9], [0.2, 0.4, 0.6, 1.1]], dtype=torch.float64)
    p, seed = 0.3, draw_seed(5)
    keep = keep_mask(5, 0, p, 2, 4, 9, 13)
    out, lse = attention_torch(q, k, v, causal=True, return_lse=True, dropout_p=p, dropout_seed=seed, **mods)
    qe, ke, ve = (t.clone().requires_grad_(True) for t in (q, k, v))
    want, want_lse = attention_reference(qe, ke, ve, causal=True, dropout_keep=keep, dropout_p=p, **mods)
    assert (out - want).abs().max() < 1e-12
    assert (lse.double() - want_lse).abs().max() < 1e-5  # (the LSE is float32, as the kernels return it)
    # Dropout changes the output: the mask is applied, not ignored.
    assert (want - attention_reference(q, k, v, causal=True, **mods)[0]).abs().max() > 0.1
    want.backward(dout)
    dq, dk, dv = attention_backward_torch(
        dout, q, k, v, out, lse, causal=True, dropout_p=p, dropout_seed=seed, **mods
    )
    for got, ref in ((dq, qe.grad), (dk, ke.grad), (dv, ve.grad)):
        assert (got - ref).abs().max() < 1e-10
    plain = attention_reference(q, k, v, causal=True, dropout_keep=keep, dropout_p=p)[0]
    assert (plain - _explicit(q, k, v, True, keep, p)).abs().max() < 1e-12


def test_dropout_without_seed_is_an_error():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="dropout_seed"):
        attention_torch(q, q, q, dropout_p=0.1)


def test_attention_with_dropout_on_the_fallback_matches_the_explicit_computation():
    import flash_attention

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 7, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    out = flash_attention.attention(q, k, v, causal=True, dropout_p=0.4, dropout_seed=11)
    keep = keep_mask(11, 0, 0.4, 2, 4, 7, 9)
    qe, ke, ve = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = _explicit(qe, ke, ve, True, keep, 0.4)
    assert (out - want).abs().max() < 1e-12
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    for got, ref in ((q.grad, qe.grad), (k.grad, ke.grad), (v.grad, ve.grad)):
        assert (got - ref).abs().max() < 1e-10
    # Reproducible with a seed; a drawn seed follows torch.manual_seed.
    with torch.no_grad():
        a = flash_attention.attention(q, k, v, dropout_p=0.4, dropout_seed=11)
        assert torch.equal(a, flash_attention.attention(q, k, v, dropout_p=0.4, dropout_seed=11))
        torch.manual_seed(5)
        b = flash_attention.attention(q, k, v, dropout_p=0.4)
        torch.manual_seed(5)
        assert torch.equal(b, flash_attention.attention(q, k, v, dropout_p=0.4))
        assert not torch.equal(b, flash_attention.attention(q, k, v, dropout_p=0.4))


def test_dropout_arguments_are_validated():
    import flash_attention

    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_attention.attention(q, q, q, dropout_p=1.0)
    for too_high in (1 - 2**-16, 1 - 2**-17):
        with pytest.raises(ValueError, match=r"dropout_p must be at most 1 - 2\*\*-15"):
            flash_attention.attention(q, q, q, dropout_p=too_high, dropout_seed=1)
    flash_attention.attention(q, q, q, dropout_p=1 - 2**-15, dropout_seed=1)  # (the largest: 2^-15 kept)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        flash_attention.attention(q, q, q, dropout_p="0.1")
    with pytest.raises(TypeError, match="dropout_seed must be an int"):
        flash_attention.attention(q, q, q, dropout_p=0.1, dropout_seed=1.5)
