"""The Hopper (wgmma) kernel on the CPU: its generated instruction wrappers, its compile, and what the
compiler made of it (tensor-core instructions present, no spills, no serialised wgmma)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flash_attention.configs import default_config, wgmma_config
from flash_attention.jit import compiler, kernels

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
        kernels.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_80")
    assert kernels.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_90") == "sm_90a"
    assert kernels.target_arch(default_config("bf16", 128, False, 1, 1), "sm_80") == "sm_80"


def test_trace_build_is_sm80_only():
    with pytest.raises(ValueError, match="debug \\(trace\\) build"):
        kernels.kernel_source(wgmma_config("bf16", 64, 64, 64), trace=True)


@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("ranged, dropout", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_hopper_defaults_compile_to_wgmma_without_spills(tmp_path, monkeypatch, d, ranged, dropout):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    cfgs = {default_config("bf16", d, c, n, n, "sm_90") for c in (False, True) for n in (512, 16384)}
    for cfg in cfgs:
        built = kernels.build(cfg, "sm_90", ranged=ranged, dropout=dropout)
        assert built.arch == "sm_90a"
        for r in built.meta["resources"]:
            assert r["spill_stores"] == 0 and r["stack_frame"] == 0, r
        # ptxas says so when it has to serialise wgmma (e.g. an accumulator touched while in flight).
        assert "serializ" not in built.meta["log"].lower(), built.meta["log"]
