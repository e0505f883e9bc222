"""CPU tests of ``key_range`` (per-batch key padding): validation, the fallback against the reference, and
the reference against an explicit mask computed independently."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention.fallback.reference import attention_reference, key_range_allowed


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, hq, d, generator=g, dtype=dtype),
        torch.randn(b, sk, hkv, d, generator=g, dtype=dtype),
        torch.randn(b, sk, hkv, d, generator=g, dtype=dtype),
    )


def test_key_range_allowed_clamps_like_the_kernel():
    kr = torch.tensor([[2, 5], [-3, 100], [4, 1], [9, 9]])
    got = key_range_allowed(kr, 6)
    want = torch.tensor(
        [
            [0, 0, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],  # end < start: empty
            [0, 0, 0, 0, 0, 0],  # start past the end: empty
        ],
        dtype=torch.bool,
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_with_key_range_equals_slicing(causal):
    # Independent check: a right-padded row is exactly attention over the keys it keeps (non-causal), and
    # a left-padded causal row equals masking by hand.
    q, k, v = _qkv(2, 7, 9, 4, 2, 16, torch.float64, seed=1)
    kr = torch.tensor([[0, 5], [3, 9]])
    o, lse = attention_reference(q, k, v, causal=causal, key_range=kr)
    for b, (s, e) in enumerate(kr.tolist()):
        scores = torch.einsum("qhd,khd->hqk", q[b], k[b].repeat_interleave(2, 1)) / 4.0
        allowed = torch.zeros(7, 9, dtype=torch.bool)
        allowed[:, s:e] = True
        if causal:
            allowed &= torch.ones(7, 9, dtype=torch.bool).tril(9 - 7)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = scores.softmax(-1).nan_to_num(0.0)
        ref = torch.einsum("hqk,khd->qhd", p, v[b].repeat_interleave(2, 1))
        assert torch.allclose(o[b], ref, atol=1e-12)
        assert torch.allclose(lse[b], torch.logsumexp(scores, -1), atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_with_key_range_matches_reference(causal, dtype):
    q, k, v = _qkv(3, 11, 13, 6, 3, 32, dtype, seed=2)
    kr = torch.tensor([[0, 13], [4, 9], [7, 7]], dtype=torch.int32)
    o, lse = fa.attention(q, k, v, causal=causal, key_range=kr, return_lse=True)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, key_range=kr)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (o.double() - ref_o).abs().max() < tol
    has = torch.isfinite(ref_lse)
    assert (lse.double()[has] - ref_lse[has]).abs().max() < 1e-4
    assert torch.isneginf(lse[~has]).all() and (o[2] == 0).all()


def test_key_range_validation_names_the_argument():
    q, k, v = _qkv(2, 4, 5, 2, 2, 8)
    with pytest.raises(TypeError, match="key_range must be int32 or int64"):
        fa.attention(q, k, v, key_range=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"key_range must have shape \(batch, 2\) = \(2, 2\)"):
        fa.attention(q, k, v, key_range=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="key_range must be a torch.Tensor"):
        fa.attention(q, k, v, key_range=[[0, 5], [0, 5]])
