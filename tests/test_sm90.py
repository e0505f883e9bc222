"""The Hopper (wgmma) kernel on the CPU: its generated instruction wrappers, its compile, and what the
compiler made of it (tensor-core instructions present, no spills, no serialised wgmma)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flash_attention.configs import default_config, parse_config, wgmma_config
from flash_attention.jit import cache, sources

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "tools" / "gen_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_wrappers_are_current():
    gen = _generator()
    assert gen.HEADER.read_text() == gen.render(), "rerun: python tools/gen_wgmma.py"


def test_wrappers_cover_every_n_the_kernel_uses():
    ns = set(_generator().NS)
    for d in (64, 128, 192, 256):
        for causal in (False, True):
            for n in (512, 16384):
                cfg = default_config("bf16", d, causal, n, n, "sm_90")
                assert {cfg.block_kv, cfg.head_dim} <= ns


def test_wgmma_config_refuses_other_architectures():
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        cache.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_80")
    assert cache.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_90") == "sm_90a"
    assert cache.target_arch(default_config("bf16", 128, False, 1, 1), "sm_80") == "sm_80"


def test_trace_build_is_sm80_only():
    with pytest.raises(ValueError, match="debug \\(trace\\) build"):
        sources.kernel_source(wgmma_config("bf16", 64, 64, 64), trace=True)


def test_hopper_forward_units_compile_to_wgmma_without_spills(catalog_builds):
    _, metas = catalog_builds
    hopper = [m for m in metas if m["arch"] == "sm_90a" and not m["config"].startswith("bwd_")]
    assert {parse_config(m["config"]).head_dim for m in hopper} == {64, 128, 192, 256}
    assert any(m["ranged"] for m in hopper) and any(m["dropout"] for m in hopper)
    for m in hopper:
        assert parse_config(m["config"]).wgmma
        for r in m["resources"]:
            assert r["spill_stores"] == 0 and r["stack_frame"] == 0, r
        # ptxas says so when it has to serialise wgmma (e.g. an accumulator touched while in flight).
        assert "serializ" not in m["log"].lower(), m["log"]
