"""The float64 reference against a naive per-row loop written independently of it."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from flash_attention.fallback.reference import attention_reference, causal_allowed

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    # A different, reproducible seed per test: inputs are fresh random data, never shared between tests.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=torch.float64):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    return q, k, v


def naive_attention(q, k, v, causal, scale):
    """One query row at a time, in float64, with torch.softmax: shares no code with the reference."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    out = torch.zeros(batch, seqlen_q, heads_q, head_dim, dtype=torch.float64)
    lse = torch.full((batch, heads_q, seqlen_q), NEG_INF, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for b in range(batch):
        for h in range(heads_q):
            kv = h // group
            for i in range(seqlen_q):
                last = i + seqlen_k - seqlen_q if causal else seqlen_k - 1  # last key row i may see
                n = min(seqlen_k, last + 1)
                if n <= 0:
                    continue  # no key: out stays 0, lse stays -inf
                s = (k[b, :n, kv] @ q[b, i, h]) * scale
                out[b, i, h] = torch.softmax(s, dim=0) @ v[b, :n, kv]
                mx = s.max()
                lse[b, h, i] = mx + torch.log(torch.exp(s - mx).sum())
    return out, lse


def _assert_matches_naive(q, k, v, causal, scale=None):
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    exp_out, exp_lse = naive_attention(q, k, v, causal, s)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, exp_out, rtol=1e-10, atol=1e-12)
    # -inf compares equal to -inf in assert_close, so empty rows are checked too.
    torch.testing.assert_close(lse, exp_lse, rtol=1e-10, atol=1e-12)


LENGTHS = [(1, 1), (7, 7), (7, 63), (63, 7), (65, 63), (1, 65), (65, 1), (63, 65)]
HEADS = [(4, 4), (4, 2), (4, 1), (8, 2)]  # GQA ratios 1, 2, 4 and MQA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
def test_matches_naive(causal, seqlen_q, seqlen_k, heads_q, heads_kv):
    q, k, v = _inputs(2, seqlen_q, seqlen_k, heads_q, heads_kv, 16)
    _assert_matches_naive(q, k, v, causal)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0, -0.7])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale(scale, causal):
    q, k, v = _inputs(1, 9, 13, 2, 1, 8)
    _assert_matches_naive(q, k, v, causal, scale)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(2, 5, 6, 2, 2, 32)
    a = attention_reference(q, k, v)
    b = attention_reference(q, k, v, softmax_scale=1 / math.sqrt(32))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_causal_mask_is_bottom_right():
    # Written out by hand: with 2 queries and 4 keys the last query sees every key and the first all but one.
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_allowed(2, 4), expected)
    # 4 queries, 2 keys: the first two rows see nothing.
    expected = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(causal_allowed(4, 2), expected)
    assert torch.equal(causal_allowed(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_causal_last_row_sees_all_keys():
    # Bottom-right alignment: the last query attends every key, so it equals non-causal attention there.
    q, k, v = _inputs(2, 5, 40, 3, 3, 16)
    c_out, c_lse = attention_reference(q, k, v, causal=True)
    n_out, n_lse = attention_reference(q, k, v, causal=False)
    torch.testing.assert_close(c_out[:, -1], n_out[:, -1])
    torch.testing.assert_close(c_lse[..., -1], n_lse[..., -1])
    assert not torch.allclose(c_out[:, 0], n_out[:, 0])


def test_lse_is_logsumexp_of_masked_scaled_scores():
    q, k, v = _inputs(2, 11, 17, 4, 2, 16)
    scale = 0.3
    _, lse = attention_reference(q, k, v, causal=True, softmax_scale=scale)
    kr = k.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    scores = scores.masked_fill(~causal_allowed(11, 17), NEG_INF)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=1e-12)


def test_rows_without_keys_give_zero_and_neg_inf():
    q, k, v = _inputs(2, 10, 3, 4, 2, 16)
    out, lse = attention_reference(q, k, v, causal=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :7], torch.zeros_like(out[:, :7]))
    assert torch.isneginf(lse[..., :7]).all()
    assert torch.isfinite(lse[..., 7:]).all()
    assert (out[:, 7:].abs().sum(dim=-1) > 0).all()


def test_seqlen_k_zero():
    q, k, v = _inputs(2, 5, 0, 4, 2, 16)
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, causal=causal)
        assert torch.equal(out, torch.zeros_like(out))
        assert lse.shape == (2, 4, 5) and torch.isneginf(lse).all()


@pytest.mark.parametrize(
    "shape_q,shape_kv",
    [
        ((0, 5, 4, 16), (0, 6, 2, 16)),
        ((2, 0, 4, 16), (2, 6, 2, 16)),
        ((2, 0, 4, 16), (2, 0, 2, 16)),
        ((2, 5, 0, 16), (2, 6, 2, 16)),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_zero_size(shape_q, shape_kv, causal):
    q = torch.randn(shape_q, dtype=torch.float64)
    k = torch.randn(shape_kv, dtype=torch.float64)
    v = torch.randn(shape_kv, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=causal)
    assert out.shape == shape_q
    assert lse.shape == (shape_q[0], shape_q[2], shape_q[1])


def test_head_dim_zero():
    # Every score is 0, so the softmax is uniform over the keys and the LSE is log(#keys).
    q, k, v = _inputs(1, 3, 4, 2, 2, 0)
    out, lse = attention_reference(q, k, v)
    assert out.shape == (1, 3, 2, 0)
    torch.testing.assert_close(lse, torch.full((1, 2, 3), math.log(4), dtype=torch.float64))


def test_low_precision_inputs_are_upcast():
    q, k, v = _inputs(1, 7, 9, 2, 1, 16, dtype=torch.bfloat16)
    out, lse = attention_reference(q, k, v, causal=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    exp_out, exp_lse = naive_attention(q.double(), k.double(), v.double(), True, 0.25)
    torch.testing.assert_close(out, exp_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-10, atol=1e-12)


def test_compute_dtype():
    q, k, v = _inputs(1, 7, 9, 2, 1, 16, dtype=torch.float32)
    out, lse = attention_reference(q, k, v, compute_dtype=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse = attention_reference(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)
