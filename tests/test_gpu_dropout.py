"""GPU tests of attention dropout in the kernels (marked gpu; need sm_80+).

The kernels' keep mask is a pure function of (seed, batch, head, query, key) that
:func:`flash_attention.dropout.keep_mask` computes in PyTorch; the tests read the mask back out of the kernel
(with V the identity, O = P Z / (1 - p) element by element) and require it to be exactly that function, then
check outputs and gradients against a float64 computation with that mask. Bound: the accuracy rule's
2x SDPA error (SDPA without dropout, same inputs) scaled by 1 / (1 - p), plus one rounding of the result in
the input dtype (SDPA has no dropout with our mask to compare with), plus 1e-5.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import flash_attention as fa
from flash_attention.dropout import keep_mask
from flash_attention.fallback.reference import attention_reference, causal_allowed

pytestmark = pytest.mark.gpu


def _explicit(q, k, v, causal, keep, p, key_range=None):
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~causal_allowed(q.shape[1], k.shape[1], device=q.device), float("-inf"))
    a = torch.softmax(s, -1).nan_to_num(0.0) * keep / (1 - p)
    return torch.einsum("bhqk,bkhd->bqhd", a, v.repeat_interleave(group, 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_mask_is_the_reference_mask(causal, d):
    # V = identity (keys = head_dim), so O[b, i, h, j] = P[b, h, i, j] Z[b, h, i, j] / (1 - p).
    p, seed = 0.3, 1234
    b, h, n = 2, 3, d
    q = torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16)
    k = (0.3 * torch.randn(b, n, h, d, device="cuda")).to(torch.bfloat16)
    v = torch.eye(d, device="cuda", dtype=torch.bfloat16).expand(b, h, d, d).permute(0, 2, 1, 3).contiguous()
    o = fa.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed)
    probs, _ = attention_reference(q, k, v, causal=causal)  # V = identity: the probabilities themselves
    probs = probs.permute(0, 2, 1, 3)  # (b, h, i, j)
    oz = o.permute(0, 2, 1, 3).double()
    visible = probs > 1e-3  # where bf16 keeps enough bits to tell kept from dropped
    kept = oz[visible] / (probs[visible] / (1 - p))
    want = keep_mask(seed, 0, p, b, h, n, n, device="cuda")[visible]
    assert ((kept > 0.5) == want).all()
    assert ((kept - 1).abs() < 0.02)[want].all() and (kept.abs() < 1e-6)[~want].all()


def test_mask_rate_is_near_one_minus_p():
    m = keep_mask(99, 0, 0.1, 4, 16, 1024, 1024, device="cuda")
    assert abs(m.float().mean().item() - 0.9) < 1e-3


_rng = random.Random(77)
_CASES = [
    (
        _rng.randint(1, 3),
        _rng.randint(1, 400),
        # At least two keys: with one, the exact dQ is 0 and SDPA (no dropout) computes it exactly, while
        # delta = rowsum(dO O) from the rounded O (as in FlashAttention-2) leaves a rounding residue that
        # the rule's SDPA yardstick cannot measure (test_one_key_gradient_is_rounding_only covers it).
        _rng.randint(2, 400),
        *_rng.choice([(4, 2), (2, 2), (3, 1)]),
        _rng.choice([64, 128, 96, 256, 192]),
        _rng.choice([torch.bfloat16, torch.float16]),
        _rng.random() < 0.5,
        _rng.choice([0.1, 0.3, 0.5]),
        _rng.random() < 0.3,
        i,
    )
    for i in range(16)
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_dropout_output_and_gradients(case):
    b, sq, sk, hq, hkv, d, dtype, causal, p, det, seed = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    dout = torch.randn(b, sq, hq, d, device="cuda", generator=gen).to(dtype)
    out = fa.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed, deterministic=det)
    out.backward(dout)
    keep = keep_mask(seed, 0, p, b, hq, sq, sk, device="cuda")
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = _explicit(q64, k64, v64, causal, keep, p)
    ref.backward(dout.double())
    # SDPA's own error without dropout on the same inputs, output and gradients, as the yardstick.
    group = hq // hkv
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mask = causal_allowed(sq, sk, device="cuda") if causal else None
    so = F.scaled_dot_product_attention(
        qs.transpose(1, 2),
        ks.transpose(1, 2).repeat_interleave(group, 1),
        vs.transpose(1, 2).repeat_interleave(group, 1),
        attn_mask=mask,
    ).transpose(1, 2)
    so = so.nan_to_num(0.0)
    so.backward(dout)
    q0, k0, v0 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    r0 = _explicit(q0, k0, v0, causal, torch.ones_like(keep), 0.0)
    r0.backward(dout.double())
    for name, got, want, s_got, s_want in (
        ("out", out, ref, so, r0),
        ("dq", q.grad, q64.grad, qs.grad, q0.grad),
        ("dk", k.grad, k64.grad, ks.grad, k0.grad),
        ("dv", v.grad, v64.grad, vs.grad, v0.grad),
    ):
        assert torch.isfinite(got).all(), name
        err = (got.double() - want).abs().max().item()
        # Plus one rounding of the result: where SDPA is exact (one key: out = v), ours is v / (1 - p),
        # which the output dtype cannot hold exactly.
        rounding = torch.finfo(dtype).eps * want.abs().max().item()
        bound = 2 * (s_got.double() - s_want).abs().max().item() / (1 - p) + rounding + 1e-5
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} for {case}"


def test_dropout_zero_runs_the_plain_kernels_and_seeded_calls_repeat():
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a = fa.attention(q, k, v, dropout_p=0.0)
    assert torch.equal(a, fa.attention(q, k, v))
    x = fa.attention(q, k, v, dropout_p=0.2, dropout_seed=3)
    assert torch.equal(x, fa.attention(q, k, v, dropout_p=0.2, dropout_seed=3))
    assert not torch.equal(x, fa.attention(q, k, v, dropout_p=0.2, dropout_seed=4))


def test_one_key_gradient_is_rounding_only():
    # One key: P = 1, so the exact dQ is 0; ours is the residue of delta computed from the rounded output,
    # bounded by the output's rounding (eps |O|) times |dO| |K| scale summed over head_dim.
    q, k, v = (torch.randn(2, 50, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    q.requires_grad_(True)
    dout = torch.randn(2, 50, 2, 64, device="cuda", dtype=torch.bfloat16)
    out = fa.attention(q, k, v, dropout_p=0.1, dropout_seed=2)
    out.backward(dout)
    eps = torch.finfo(torch.bfloat16).eps
    allowance = eps * (dout.double().abs() * out.double().abs()).sum(-1).max() * k.double().abs().max() / 8
    assert q.grad.double().abs().max() <= 4 * allowance
