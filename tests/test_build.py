"""The JIT build on a machine without a GPU: compile the shipped kernels, read their resource report, cache.

Needs nvcc (CI has the CUDA toolkit); skipped where no compiler exists. No GPU is used here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from flash_attention.configs import KernelConfig, parse_config
from flash_attention.jit import compiler, kernels
from flash_attention.jit.build import SMEM_LIMITS, shipped_configs
from flash_attention.jit.params import FwdParams

COMPILERS = [
    pytest.param(
        "nvrtc",
        marks=pytest.mark.skipif(
            compiler.load_nvrtc() is None, reason="needs NVRTC (pip: nvidia-cuda-nvrtc)"
        ),
    ),
    pytest.param(
        "nvcc", marks=pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
    ),
]
needs_nvcc = pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=COMPILERS)
def shipped_builds(request, tmp_path_factory):
    """Every shipped config compiled for sm_80 and sm_90 by one compiler (the build command, run once)."""
    root = tmp_path_factory.mktemp(f"shipped-{request.param}")
    env = dict(os.environ, FLASH_ATTENTION_CACHE_DIR=str(root), FLASH_ATTENTION_QUIET="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flash_attention",
            "build",
            "--arch",
            "sm_80,sm_90",
            "--compiler",
            request.param,
            "--strict",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    metas = [json.loads(p.read_text()) for p in root.glob("*.json")]
    return proc, metas


def test_build_command_compiles_every_shipped_kernel_without_spills(shipped_builds):
    proc, metas = shipped_builds
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # wgmma configs are built for sm_90a (their instructions have no portable target) and only there.
    expected = {
        (c.name(), "sm_90a" if c.wgmma else a) for a in ("sm_80", "sm_90") for c in shipped_configs(a)
    }
    assert any(c.wgmma for c in shipped_configs("sm_90"))
    assert {(m["config"], m["arch"]) for m in metas} == expected
    for m in metas:
        cfg = parse_config(m["config"])
        kernels_seen = {r["kernel"] for r in m["resources"]}
        assert kernels_seen == {cfg.symbol(False), cfg.symbol(True)}, m["config"]
        for r in m["resources"]:
            assert 0 < r["registers"] <= 255, r
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{r['kernel']} on {m['arch']} spills"
            assert r["stack_frame"] == 0, f"{r['kernel']} on {m['arch']} uses a stack frame"
        assert cfg.smem_bytes <= SMEM_LIMITS[m["arch"]]


def test_build_command_prints_the_report(shipped_builds):
    proc, _ = shipped_builds
    out = proc.stdout
    assert "regs" in out and "spill st/ld" in out
    for cfg in shipped_configs("sm_90"):
        assert cfg.symbol(True) in out
    n = len(shipped_configs("sm_80")) + len(shipped_configs("sm_90"))
    assert f"{n}/{n} built" in out


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_fwd__x' for 'sm_90'
ptxas info    : Function properties for flash_fwd__x
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers, 16 bytes smem, 592 bytes cmem[0]
"""
    (r,) = compiler.parse_ptxas_log(log)
    assert (r.kernel, r.arch, r.registers, r.spill_stores, r.spill_loads, r.static_smem, r.barriers) == (
        "flash_fwd__x",
        "sm_90",
        254,
        8,
        12,
        16,
        1,
    )


@needs_nvcc
def test_cache_hit_and_key(cache):
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    first = kernels.build(cfg, "sm_90", "nvcc")
    assert not first.from_cache and first.cubin[:4] == b"\x7fELF"
    again = kernels.build(cfg, "sm_90", "nvcc")
    assert again.from_cache and again.cubin == first.cubin
    # Another arch, config or compiler version is another entry.
    cid = compiler.compiler_id("nvcc")
    keys = {
        kernels.cache_key(cfg, "sm_90", cid),
        kernels.cache_key(cfg, "sm_80", cid),
        kernels.cache_key(cfg.replace(block_kv=128), "sm_90", cid),
        kernels.cache_key(cfg, "sm_90", cid + "-other"),
    }
    assert len(keys) == 4
    assert not list(cache.glob("*.tmp"))


def test_cache_key_follows_kernel_sources(monkeypatch):
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    before = kernels.cache_key(cfg, "sm_90", "nvcc x")
    monkeypatch.setattr(kernels, "sources_digest", lambda: "edited")
    assert kernels.cache_key(cfg, "sm_90", "nvcc x") != before


@needs_nvcc
def test_compile_error_names_config_and_shows_compiler_message(cache):
    bad = KernelConfig.unchecked("bf16", 128, 48, 64, 4)
    with pytest.raises(compiler.CompileError) as exc:
        kernels.build(bad, "sm_90", "nvcc")
    msg = str(exc.value)
    assert bad.name() in msg
    assert "block_q must be a multiple of 16 * num_warps" in msg  # the static_assert's text


def test_translation_unit_pins_params_layout():
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    src = kernels.kernel_source(cfg)
    for name, _ in FwdParams._fields_:
        assert f"fa::FwdParams, {name})" in src
    assert cfg.symbol(False) in src and cfg.symbol(True) in src


def _build_in_child(args):
    cache_dir, name = args
    os.environ["FLASH_ATTENTION_CACHE_DIR"] = cache_dir
    os.environ["FLASH_ATTENTION_QUIET"] = "1"
    from flash_attention.configs import parse_config as parse
    from flash_attention.jit import kernels as k

    built = k.build(parse(name), "sm_80", "nvcc")
    return len(built.cubin)


@needs_nvcc
def test_two_processes_compiling_the_same_kernel(cache):
    name = "(FP16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax"
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        sizes = pool.map(_build_in_child, [(str(cache), name)] * 2)
    assert sizes[0] == sizes[1] > 0
    cubins = list(cache.glob("*.cubin"))
    assert len(cubins) == 1 and len(list(cache.glob("*.json"))) == 1
    assert not list(cache.glob("*.tmp"))
    assert cubins[0].read_bytes()[:4] == b"\x7fELF"
