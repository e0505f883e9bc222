"""The score functions' host side and PyTorch path (no GPU): attention(softcap=, alibi_slopes=) off the
kernels against the float64 reference (outputs, LSE, gradients), the arguments' checks, and the builds'
translation units (the policy named, its own entry points and cache key)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flash_attention as fa
from flash_attention.configs import hopper_bwd_config, portable_config
from flash_attention.fallback.reference import attention_reference
from flash_attention.jit import cache, sources
from flash_attention.spec import ALIBI_ORIGINS, ScoreSpec, score_builds, score_functions
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
        ScoreSpec.of(softcap=softcap, alibi=True, alibi_origin=origin, alibi_rows=rows)
        for softcap in (0.0, 30.0)
        for origin in ALIBI_ORIGINS
        for rows in (False, True)
    ]
    specs.append(ScoreSpec.of(softcap=30.0))
    builds = [s.build for s in specs]
    assert builds[0] is None and len(set(builds)) == len(specs)
    assert set(builds[1:]) == set(sources.SCORE_MODS)
    for s in specs:
        assert s.features == {"softcap": s.value("softcap") > 0, "alibi": s.alibi}
    with pytest.raises(ValueError, match="need alibi=True"):
        ScoreSpec(alibi_rows=True)


@pytest.mark.parametrize("causal", [False, True])
def test_score_spec_of_a_packed_batch_measures_alibi_from_its_runs_or_table(causal):
    q = torch.randn(1, 12, 2, 8)
    runs = (torch.zeros(12, 2, dtype=torch.int32), torch.zeros(12, 2, dtype=torch.int32))
    table = (*runs, torch.zeros(12, dtype=torch.int32))
    heads, rows = torch.ones(2), torch.ones(12, 2)
    assert score_spec(None, q, runs, causal, softcap=0.5) == ScoreSpec.of(softcap=0.5)
    assert score_spec(heads, q).build == "alibi"
    assert score_spec(heads, q, runs, causal).build == ("alibi_runs" if causal else "alibi")
    assert score_spec(heads, q, table, causal, softcap=0.5).build == "softcap_alibi_table"
    assert score_spec(rows, q, runs, causal).build == ("alibi_runs_rows" if causal else "alibi_rows")


def _toy(monkeypatch):
    """A test-only scalar score function, "tilt" (s -> s + value * s^2 / 8: smooth, its own slope), in the
    table after soft-capping: what registering a new one through spec.score_functions looks like."""
    tilt = score_functions.ScoreFunction(
        "tilt", "Tilt", lambda s, b: s + b * s * s / 8, lambda out, b: None, "a test's toy"
    )
    monkeypatch.setitem(score_functions.SCORE_FUNCTIONS, "tilt", tilt)
    return tilt


def test_a_registered_score_function_names_its_builds_policies_and_features(monkeypatch):
    _toy(monkeypatch)
    spec = ScoreSpec.of(tilt=0.5, softcap=30.0, alibi=True, alibi_origin="runs")
    assert spec.values == (("softcap", 30.0), ("tilt", 0.5))  # the table's order, not the call's
    assert (spec.build, spec.policy) == ("softcap_tilt_alibi_runs", "fa::SoftcapTiltAlibiRuns")
    assert spec.features == {"softcap": True, "tilt": True, "alibi": True}
    assert ScoreSpec.of(tilt=0.0) == ScoreSpec()  # 0: off, the plain build
    builds = score_builds()
    assert builds["tilt"] == "fa::Tilt" and builds["tilt_alibi_table_rows"] == "fa::TiltAlibiTableRows"
    # every subset of the scalar functions with every form of ALiBi, once: (2^2 subsets) x (1 + 6) - 1
    assert len(builds) == 4 * 7 - 1 and set(sources.SCORE_MODS) < set(builds)


def test_score_values_are_checked_by_name():
    with pytest.raises(TypeError, match="no score function named \\['cap'\\]"):
        ScoreSpec.of(cap=1.0)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        score_functions.values_of(softcap=-1.0)
    with pytest.raises(ValueError, match="once each, in that order"):
        ScoreSpec((("softcap", 0.0),))  # (a zero is "off": not a function the build applies)
    with pytest.raises(TypeError, match="softcap must be a float"):
        score_functions.check_value("softcap", True)
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        score_functions.check_value("softcap", float("inf"))


def test_the_chains_slope_is_its_derivative(monkeypatch):
    # The chunked backward's chain rule (fallback.reference) multiplies dP's gradient by this slope: against
    # autograd's derivative of the same chain, with soft-capping alone and with the toy after it.
    tilt = _toy(monkeypatch)
    monkeypatch.setitem(
        score_functions.SCORE_FUNCTIONS,
        "tilt",
        score_functions.ScoreFunction(
            "tilt", "Tilt", tilt.apply, lambda out, b: (1 + b * out / 2).clamp(min=0).sqrt(), tilt.doc
        ),
    )  # (s + b s^2 / 8 has slope 1 + b s / 4 = sqrt(1 + b out / 2) where s > -4 / b: the scores below are)
    s = (torch.rand(64, dtype=torch.float64) * 6 - 3).requires_grad_()
    for values in ((("softcap", 2.5),), (("softcap", 2.5), ("tilt", 0.3))):
        out, slope = score_functions.apply_scores_with_slope(s, values)
        (exact,) = torch.autograd.grad(out.sum(), s)
        torch.testing.assert_close(slope, exact, rtol=1e-12, atol=1e-12)
        assert torch.equal(out, score_functions.apply_scores(s, values))


def test_a_score_functions_name_cannot_be_a_launch_keyword():
    # The layers below the public functions take the values as keywords beside their own arguments.
    for name in ("window", "sinks", "causal", "not an identifier"):
        with pytest.raises(ValueError, match="must be an identifier outside"):
            score_functions.ScoreFunction(name, "X", lambda s, b: s, lambda o, b: None, "")


def test_a_score_functions_decode_fields_read_zero_as_off():
    # The decode kernels read 0 as off and every function's fields are filled on every call: an entry whose
    # decode_values(0) is not one zero per field is refused when it is made.
    entry = score_functions.SCORE_FUNCTIONS["softcap"]
    assert score_functions.decode_fields() == [(name, 0.0) for name in entry.decode_fields]
    with pytest.raises(ValueError, match="decode_values"):
        dataclasses.replace(entry, decode_values=lambda cap: (cap, 1.0))
    with pytest.raises(ValueError, match="decode_values"):
        dataclasses.replace(entry, decode_values=lambda cap: (cap,))
