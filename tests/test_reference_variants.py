"""The float64 reference's attention variants (sliding windows, softcapping, ALiBi, attention sinks) against
a second, independent computation: a loop over every (batch, head, query) row with Python's own math on
the scores it may see, for small random shapes (odd lengths, seqlen_q above and below seqlen_k, GQA)."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from flash_attention.fallback.reference import attention_reference, causal_allowed, window_allowed


def _rowwise(q, k, v, *, scale, causal=False, window=None, softcap=0.0, slopes=None, sinks=None):
    """Attention one row at a time: which keys a row sees and its scores written out as the definitions
    say them."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    shift = sk - sq
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                terms = []
                for j in range(sk):
                    if causal and j > i + shift:
                        continue
                    if window is not None:
                        left, right = window
                        if (left >= 0 and j < i + shift - left) or (right >= 0 and j > i + shift + right):
                            continue
                    s = scale * float(q[bi, i, h].double() @ k[bi, j, kh].double())
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = float(slopes[bi, h] if slopes.dim() == 2 else slopes[h])
                        s -= slope * abs(i + shift - j)
                    terms.append((s, j))
                logits = [s for s, _ in terms] + ([float(sinks[h])] if sinks is not None else [])
                if not logits:
                    continue
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                lse[bi, h, i] = m + math.log(z)
                for s, j in terms:
                    out[bi, i, h] += math.exp(s - lse[bi, h, i]) * v[bi, j, kh].double()
    return out, lse


_rng = random.Random(20261126)
_CASES = []
for n in range(10):
    sq, sk = _rng.randint(1, 13), _rng.randint(1, 13)
    hkv = _rng.choice([1, 2])
    _CASES.append(
        dict(
            shape=(_rng.randint(1, 2), sq, sk, hkv * _rng.choice([1, 2]), hkv, _rng.choice([4, 8])),
            causal=n % 3 == 0,
            window=_rng.choice([None, (2, 0), (3, 1), (-1, 2), (0, -1), (1, 1)]),
            softcap=_rng.choice([0.0, 0.0, 1.5, 5.0]),
            alibi=_rng.choice([None, "heads", "batch_heads"]),
            sinks=_rng.random() < 0.5,
        )
    )


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(str(x) for x in c.values()))
def test_reference_variants_against_rowwise_definition(case):
    b, sq, sk, hq, hkv, d = case["shape"]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen) for _ in range(2))
    slopes = None
    if case["alibi"] == "heads":
        slopes = torch.rand(hq, generator=gen)
    elif case["alibi"] == "batch_heads":
        slopes = torch.rand(b, hq, generator=gen)
    sinks = torch.randn(hq, generator=gen) if case["sinks"] else None
    kw = dict(causal=case["causal"], window=case["window"], softcap=case["softcap"])
    got, got_lse = attention_reference(q, k, v, softmax_scale=0.3, alibi_slopes=slopes, sinks=sinks, **kw)
    want, want_lse = _rowwise(q, k, v, scale=0.3, slopes=slopes, sinks=sinks, **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-10, atol=1e-12)


def test_window_special_cases_are_the_causal_mask_and_no_mask():
    for sq, sk in ((5, 9), (9, 5), (7, 7)):
        assert torch.equal(window_allowed(sq, sk, (-1, 0)), causal_allowed(sq, sk))
        assert window_allowed(sq, sk, (-1, -1)).all()
        # A window of w keys to the left and none to the right sees at most w + 1 keys per row.
        assert window_allowed(sq, sk, (3, 0)).sum(-1).max().item() <= 4


def test_sinks_scale_each_row_by_its_share_of_the_denominator():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 3, 8, generator=gen) for _ in range(3))
    sinks = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
    plain, lse = attention_reference(q, k, v)
    sunk, lse_sink = attention_reference(q, k, v, sinks=sinks)
    # out_sink = out * Z / (Z + e^sink), Z = e^lse; and the sink's LSE is logaddexp(lse, sink).
    share = torch.exp(lse - lse_sink).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(sunk, plain * share, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_sink, torch.logaddexp(lse, sinks[None, :, None]), rtol=1e-12, atol=0)
    # A sink of -inf changes nothing.
    same, _ = attention_reference(q, k, v, sinks=torch.full((3,), -math.inf))
    torch.testing.assert_close(same, plain, rtol=0, atol=0)


def test_softcap_bounds_the_scores_and_vanishes_when_large():
    gen = torch.Generator().manual_seed(4)
    sk = 9
    q, k = (torch.randn(1, sk, 2, 16, generator=gen) * 4 for _ in range(2))
    # V = the identity (head_dim = seqlen_k): the output rows are the probabilities themselves.
    v = torch.eye(sk).expand(1, 2, sk, sk).permute(0, 2, 1, 3).contiguous()
    plain, _ = attention_reference(q, k, v)
    loose, _ = attention_reference(q, k, v, softcap=1e6)
    torch.testing.assert_close(loose, plain, rtol=1e-6, atol=1e-9)
    capped, _ = attention_reference(q, k, v, softcap=0.5)
    # Scores within [-0.5, 0.5]: within a row, probabilities differ by at most a factor e^1.
    ratio = capped.amax(-1) / capped.amin(-1)
    assert (ratio <= math.e * (1 + 1e-12)).all() and (plain.amax(-1) / plain.amin(-1)).max() > math.e
