"""The score functions' host side and PyTorch path (no GPU): attention(softcap=, alibi_slopes=) off the
kernels against the float64 reference (outputs, LSE, gradients), the arguments' checks, and the builds'
translation units (the policy named, its own entry points and cache key)."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention.configs import hopper_bwd_config, portable_config
from flash_attention.fallback.reference import attention_reference
from flash_attention.jit import cache, sources
from flash_attention.spec import ALIBI_ORIGINS, ScoreSpec
from flash_attention.spec.validate import score_spec


@pytest.mark.parametrize(
    "causal,window,ranged,mods",
    [
        (False, None, False, {"softcap": 1.3}),
        (True, (6, 0), False, {"softcap": 0.7}),
        (True, None, True, {"alibi": 1}),
        (False, None, False, {"alibi": 2}),
        # both, composed: the capped score plus the bias
        (True, None, False, {"softcap": 0.9, "alibi": 1}),
        (False, (5, 3), True, {"softcap": 1.1, "alibi": 2}),
    ],
)
def test_attention_score_functions_on_the_fallback_match_the_reference(causal, window, ranged, mods):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 37, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 45, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 45, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    kr = torch.tensor([[3, 40], [0, 45]]) if ranged else None
    kw = dict(causal=causal, window=window, key_range=kr)
    if "softcap" in mods:
        kw["softcap"] = mods["softcap"]
    if "alibi" in mods:
        slopes = torch.rand(4, generator=gen) if mods["alibi"] == 1 else torch.rand(2, 4, generator=gen)
        kw["alibi_slopes"] = slopes
    out, lse = fa.attention(q, k, v, return_lse=True, **kw)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_kw = dict(kw)
    if "alibi_slopes" in ref_kw:
        ref_kw["alibi_slopes"] = ref_kw["alibi_slopes"].double()
    ref, ref_lse = attention_reference(q, k, v, **ref_kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse.float().double())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    with torch.no_grad():
        torch.testing.assert_close(fa.attention(q, k, v, **kw), ref)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        ({"softcap": -1.0}, ValueError, "softcap must be a finite number >= 0"),
        ({"softcap": "1"}, TypeError, "softcap must be a float"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes must have shape"),
        ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError, "alibi_slopes must be a float32"),
    ],
)
def test_attention_names_a_bad_score_function(kw, err, match):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(err, match=match):
        fa.attention(q, q, q, **kw)


@pytest.mark.parametrize(
    "cfg",
    [
        portable_config("bf16", 128, True, 4096, 4096),
        hopper_bwd_config("bf16", 128),
        hopper_bwd_config("bf16", 256),
    ],
    ids=lambda c: c.name(),
)
@pytest.mark.parametrize("score,policy", [("softcap", "fa::Softcap"), ("alibi", "fa::Alibi")])
def test_score_function_builds_name_their_policy(cfg, score, policy):
    src = sources.kernel_source(cfg, score=score)
    assert f"fa::Variant<fa::CausalRangeMask<true, false>, {policy}>" in src and f"__{score}" in src
    windowed = sources.kernel_source(cfg, score=score, window=True, ranged=True)
    assert f"fa::Variant<fa::WindowMask<true>, {policy}>" in windowed
    keys = {cache.cache_key(cfg, "sm_90", "x", score=s) for s in (None, "softcap", "alibi")}
    assert len(keys) == 3
    with pytest.raises(ValueError, match="score must be one of"):
        sources.variant_type(True, False, score="tanh")


def test_score_specs_name_every_build_once():
    # spec.ScoreSpec.build is the one place a build's score function is named: every form of a call's score
    # function is a build the kernels have, and no two forms share one.
    specs = [ScoreSpec()] + [
        ScoreSpec(softcap, alibi=True, alibi_origin=origin, alibi_rows=rows)
        for softcap in (0.0, 30.0)
        for origin in ALIBI_ORIGINS
        for rows in (False, True)
    ]
    specs.append(ScoreSpec(30.0))
    builds = [s.build for s in specs]
    assert builds[0] is None and len(set(builds)) == len(specs)
    assert set(builds[1:]) == set(sources.SCORE_MODS)
    for s in specs:
        assert s.features == {"softcap": s.softcap > 0, "alibi": s.alibi}
    with pytest.raises(ValueError, match="need alibi=True"):
        ScoreSpec(alibi_rows=True)


@pytest.mark.parametrize("causal", [False, True])
def test_score_spec_of_a_packed_batch_measures_alibi_from_its_runs_or_table(causal):
    q = torch.randn(1, 12, 2, 8)
    runs = (torch.zeros(12, 2, dtype=torch.int32), torch.zeros(12, 2, dtype=torch.int32))
    table = (*runs, torch.zeros(12, dtype=torch.int32))
    heads, rows = torch.ones(2), torch.ones(12, 2)
    assert score_spec(0.5, None, q, runs, causal) == ScoreSpec(0.5)
    assert score_spec(0.0, heads, q).build == "alibi"
    assert score_spec(0.0, heads, q, runs, causal).build == ("alibi_runs" if causal else "alibi")
    assert score_spec(0.5, heads, q, table, causal).build == "softcap_alibi_table"
    assert score_spec(0.0, rows, q, runs, causal).build == ("alibi_runs_rows" if causal else "alibi_rows")
