"""On a GPU: ``attention()`` calls with a few queries per row against many keys run on the decode kernels
(flash_attention.api.few_queries) and agree with the float64 reference with every variant the route takes
(causal, windows, soft-capping, ALiBi per head and per row, sinks, the LSE), on poisoned outputs, with
repeated signatures; the forward kernel's answer (the route switched off) agrees too."""

from __future__ import annotations

import zlib

import pytest
import torch

import flash_attention as fa
from flash_attention.api import few_queries as _few_queries
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import repeat

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap, alibi, sinks)
CASES = [
    (1, 1, 1000, 32, 8, 128, True, None, 0.0, None, False),
    (8, 1, 8191, 32, 8, 128, True, None, 0.0, None, False),
    (2, 4, 3000, 32, 8, 128, True, None, 0.0, None, False),
    (3, 16, 2049, 32, 8, 128, True, None, 0.0, None, False),
    (2, 16, 777, 16, 4, 64, False, None, 0.0, None, False),
    (2, 1, 4096, 8, 4, 256, True, (1023, 0), 50.0, None, False),  # Gemma 2's sliding layers
    (2, 2, 5000, 32, 8, 128, True, (127, 0), 0.0, None, True),  # gpt-oss's sliding layers
    (4, 1, 600, 16, 16, 128, True, None, 0.0, "heads", False),
    (2, 3, 900, 8, 2, 64, False, (200, 50), 20.0, "rows", False),
]


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[str(c[:7]) for c in CASES])
def test_routed_calls_match_the_reference(case, monkeypatch):
    b, sq, sk, hq, hkv, d, causal, window, softcap, alibi, sinks = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v = (
        torch.randn(b, n, h, d, device="cuda", generator=gen).to(torch.bfloat16)
        for n, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )
    kw = dict(causal=causal, window=window, softcap=softcap)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(hq, device="cuda", generator=gen) * 0.1
    elif alibi == "rows":
        kw["alibi_slopes"] = torch.rand(b, hq, device="cuda", generator=gen) * 0.1
    if sinks:
        kw["sinks"] = torch.randn(hq, device="cuda", generator=gen)
    routes, runs = [], []
    real = _few_queries.route
    monkeypatch.setattr(_few_queries, "route", lambda *a, **k: routes.append(real(*a, **k)) or routes[-1])
    real_run = _few_queries.RoutedCall.run
    monkeypatch.setattr(_few_queries.RoutedCall, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    ref_kw = {n: (x.double() if n == "alibi_slopes" else x) for n, x in kw.items()}
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), **ref_kw)
    for call in range(4):  # a poisoned out= buffer first (the whole path), then a plan and its repeats
        poisoned = torch.full_like(q, float("nan")) if call == 0 else None
        out, lse = fa.attention(q, k, v, return_lse=True, out=poisoned, **kw)
        torch.cuda.synchronize()
        assert call > 0 or out is poisoned
        assert (out.double() - ref).abs().max().item() < 1e-2
        assert (lse.double() - ref_lse).abs().max().item() < 1e-3
    assert routes and isinstance(routes[0], _few_queries.RoutedCall), "the call was not routed"
    assert len(runs) == 4  # every call on the decode kernels: the whole path's, then the repeat table's
    # The forward kernel's answer, the route switched off (and the signature's repeat call forgotten).
    monkeypatch.setattr(_few_queries, "MAX_ROWS", 0)
    repeat.clear()
    plain = fa.attention(q.clone(), k.clone(), v.clone(), **kw)
    assert (plain.double() - ref).abs().max().item() < 1e-2


# attention_varlen decoding steps (about one query per sequence) on the decode kernels: each packed query row
# a cache row at its sequence's key offset (cache_starts). (lens_q, lens_k, heads_q, heads_kv, head_dim,
# causal, window, softcap, alibi, sinks, seqused_k)
VARLEN_CASES = [
    ([1] * 8, [1000, 8191, 300, 4096, 2000, 257, 1, 3000], 32, 8, 128, True, None, 0.0, None, False, None),
    ([1, 1, 1], [5000, 700, 2048], 64, 8, 128, True, (127, 0), 0.0, None, True, None),  # gpt-oss sliding
    ([1, 1], [4096, 3000], 8, 4, 256, True, (1023, 0), 50.0, "heads", False, None),
    (
        [2, 0, 1, 1],
        [600, 900, 1500, 800],
        16,
        4,
        64,
        True,
        None,
        0.0,
        "sequences",
        False,
        [600, 0, 1000, 799],
    ),  # fmt: skip
    ([1, 1, 1, 1], [1000, 2000, 300, 4000], 16, 16, 128, False, None, 20.0, None, True, None),
]


@needs_cuda
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[str(c[2:7]) for c in VARLEN_CASES])
def test_varlen_decoding_steps_match_the_reference(case, monkeypatch):
    lens_q, lens_k, hq, hkv, d, causal, window, softcap, alibi, sinks, used = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    total_q, total_k = sum(lens_q) + 1, sum(lens_k)  # (one row past the last sequence: output 0)
    q = torch.randn(total_q, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(total_k, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        for n in (lens_q, lens_k)
    )
    kw = dict(causal=causal, window=window, softcap=softcap)
    slopes = None
    if alibi == "heads":
        slopes = kw["alibi_slopes"] = torch.rand(hq, device="cuda", generator=gen) * 0.1
    elif alibi == "sequences":
        slopes = kw["alibi_slopes"] = torch.rand(len(lens_q), hq, device="cuda", generator=gen) * 0.1
    if sinks:
        kw["sinks"] = torch.randn(hq, device="cuda", generator=gen)
    if used is not None:
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    taken = []
    real = _few_queries.route_varlen
    monkeypatch.setattr(
        "flash_attention.api.varlen.route_varlen", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    )
    # The hints a serving loop passes (the route gates on max_seqlen_q: without it, the extra row past the
    # last sequence makes more rows than sequences, and the call keeps its usual path).
    kw.update(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    for _ in range(2):  # the second call finds its plan and row tables
        out, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
        assert taken[-1] is not None, "the call should have taken the decode kernels"
        assert out.shape == q.shape and lse.shape == (hq, total_q)
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
            if nq == 0:
                continue
            a, ka = cu_q[b].item(), cu_k[b].item()
            ke = ka + (used[b] if used is not None else nk)
            ref_kw = dict(causal=causal, window=window, softcap=softcap)
            if slopes is not None:
                ref_kw["alibi_slopes"] = (slopes if slopes.dim() == 1 else slopes[b]).double()
            if sinks:
                ref_kw["sinks"] = kw["sinks"]
            ref, ref_lse = attention_reference(
                *(t[None].double() for t in (q[a : a + nq], k[ka:ke], v[ka:ke])), **ref_kw
            )
            err = (out[a : a + nq].double() - ref[0]).abs().max().item()
            assert err < 2e-2, f"sequence {b}: {err:.3g}"
            finite = ref_lse[0].isfinite()
            assert (lse[:, a : a + nq][finite].double() - ref_lse[0][finite]).abs().max().item() < 1e-3
        assert (out[cu_q[-1].item() :] == 0).all()
