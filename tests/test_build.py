"""The JIT build on a machine without a GPU: compile every kernel a model can need, read their resource
report, cache.

Needs NVRTC or nvcc (CI has both); skipped where no compiler exists. No GPU is used here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest
from kernel_families import catalog_families, family_sample, kernel_family

from flash_attention.configs import BwdConfig, KernelConfig, default_bwd_config, parse_config, smem_optin
from flash_attention.configs.decode import default_decode_config
from flash_attention.jit import cache as kernels
from flash_attention.jit import compiler, sources
from flash_attention.jit.params import BwdParams, FwdParams
from flash_attention.tools.build import jobs_for, spill_bound

needs_nvcc = pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    return tmp_path / "cache"


@pytest.mark.full_build
def test_build_command_compiles_every_kernel_a_model_can_need(catalog_builds):
    proc, metas = catalog_builds
    assert proc.returncode == 0, proc.stdout[-6000:]
    jobs = jobs_for(["sm_80", "sm_90"], None)
    # wgmma configs are built for sm_90a (their instructions have no portable target) and only there.
    expected = {
        (j.cfg.name(), "sm_90a" if getattr(j.cfg, "wgmma", False) else j.arch, j.ranged, j.dropout)
        for j in jobs
    }
    assert any(getattr(j.cfg, "wgmma", False) for j in jobs)
    assert any(isinstance(j.cfg, BwdConfig) for j in jobs) and any(j.ranged and j.dropout for j in jobs)
    assert {(m["config"], m["arch"], m["ranged"], m["dropout"]) for m in metas} == expected
    _assert_within_resource_bounds(metas, {j.cfg.name(): j.cfg for j in jobs})


def test_build_command_compiles_a_kernel_of_every_family(family_builds):
    proc, metas = family_builds
    assert proc.returncode == 0, proc.stdout[-6000:]
    sample = family_sample()
    assert {kernel_family(j.cfg) for j in sample} == catalog_families()
    expected = {(j.cfg.name(), "sm_90a" if getattr(j.cfg, "wgmma", False) else "sm_90") for j in sample}
    assert {(m["config"], m["arch"]) for m in metas} == expected
    _assert_within_resource_bounds(metas, {j.cfg.name(): j.cfg for j in sample})
    for m in metas:
        # ptxas says so when it has to serialise wgmma (e.g. an accumulator touched while in flight).
        assert "serializ" not in m["log"].lower(), m["config"]


def _assert_within_resource_bounds(metas: list[dict], cfgs: dict) -> None:
    """Every kernel of each built unit within the registers and spills the build allows; forward kernels
    without a stack frame."""
    for m in metas:
        backward = m["config"].startswith("bwd_")
        for r in m["resources"]:
            assert 0 < r["registers"] <= 255, r
            spill = max(r["spill_stores"], r["spill_loads"])
            assert spill <= spill_bound(cfgs[m["config"]], r["kernel"]), (
                f"{r['kernel']} on {m['arch']} spills {spill}"
            )
            if not backward:
                assert r["stack_frame"] == 0, f"{r['kernel']} on {m['arch']} uses a stack frame"


def test_build_command_prints_progress_and_the_report(family_builds):
    proc, _ = family_builds
    out = proc.stdout
    sample = family_sample()
    n = len(sample)
    assert f"building {n} kernels" in out
    assert f"[{n}/{n} " in out and f"{n}/{n} built" in out
    assert "regs" in out and "spill st/ld" in out
    for job in sample:
        if isinstance(job.cfg, KernelConfig):
            assert job.cfg.symbol(True) in out


def test_build_list_compiles_nothing(tmp_path):
    env = dict(os.environ, FLASH_ATTENTION_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "flash_attention", "build", "--list", "--arch", "sm_86"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = jobs_for(["sm_86"], None)
    lines = proc.stdout.splitlines()
    assert lines[:-1] == [j.describe() for j in jobs] and lines[-1] == (
        f"{len(jobs)} kernels, and the host library (training node, repeat call) of csrc/host/"
    )
    assert not list(tmp_path.iterdir())
    # The backward of head_dim 128 on sm_86 is the tile that fits its 99 KB of shared memory.
    assert default_bwd_config("bf16", 128, "sm_86").name() in proc.stdout
    assert all(max(j.cfg.smem_bytes, getattr(j.cfg, "dq_smem_bytes", 0)) <= smem_optin("sm_86") for j in jobs)


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


def test_parse_ptxas_log_keeps_a_called_device_function_apart():
    # A device function ptxas did not inline is listed after each entry that calls it (the decode kernels at
    # head_dim 256 call fa::combine_row_block_call): it belongs to neither entry.
    callee = "_ZN2fa22combine_row_block_callILb1ELi256ELi16ELi128EEEvRKNS_12DecodeParamsEiii"
    log = f"""ptxas info    : Compiling entry function 'flash_decode_a' for 'sm_90'
ptxas info    : Function properties for flash_decode_a
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers
ptxas info    : Function properties for {callee}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'flash_decode_b' for 'sm_90'
ptxas info    : Function properties for flash_decode_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 252 registers, used 1 barriers
ptxas info    : Function properties for {callee}
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
"""
    got = [(r.kernel, r.registers, r.stack_frame, r.spill_stores) for r in compiler.parse_ptxas_log(log)]
    assert got == [("flash_decode_a", 254, 8, 4), ("flash_decode_b", 252, 0, 0)]


def test_parse_ptxas_log_marks_serialized_wgmma():
    # ptxas's note comes before the resource lines and names its function last; the other entry is clean.
    note = (
        "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
        "to non wgmma instructions defining input registers of a wgmma between start and end of the pipeline "
        "stage in the function 'flash_fwd__b'"
    )
    log = f"""{note}
ptxas info    : Compiling entry function 'flash_fwd__a' for 'sm_90a'
ptxas info    : Function properties for flash_fwd__a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compiling entry function 'flash_fwd__b' for 'sm_90a'
ptxas info    : Function properties for flash_fwd__b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""
    got = {r.kernel: r.wgmma_serialized for r in compiler.parse_ptxas_log(log)}
    assert got["flash_fwd__a"] == ""
    assert got["flash_fwd__b"].startswith("C7513: non wgmma instructions defining input registers")
    # Too few registers (C7512) names its function "for the function" (NVRTC 13.0): missed before, which
    # left a serialized build reported clean.
    registers = (
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
        "to insufficient register resources for the function 'flash_fwd__a'"
    )
    got = {r.kernel: r.wgmma_serialized for r in compiler.parse_ptxas_log(registers + "\n" + log)}
    assert got["flash_fwd__a"] == "C7512: insufficient register resources"


def test_strict_build_refuses_serialized_wgmma():
    from flash_attention.tools import build as build_tool

    job = build_tool.jobs_for(["sm_90"], None, ["bf16"], [128])[0]
    clean = {"kernel": "k", "spill_stores": 0, "spill_loads": 0, "wgmma_serialized": ""}
    assert build_tool._problems(job, [clean]) == []
    (problem,) = build_tool._problems(job, [{**clean, "wgmma_serialized": "C7513: non wgmma instructions"}])
    assert "ptxas serialized its wgmma (C7513" in problem


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
    src = sources.kernel_source(cfg)
    for name, _ in FwdParams._fields_:
        assert f"fa::FwdParams, {name})" in src
    assert cfg.symbol(False) in src and cfg.symbol(True) in src
    bwd = default_bwd_config("bf16", 128, "sm_90")
    src = sources.kernel_source(bwd)
    for name, _ in BwdParams._fields_:
        assert f"fa::BwdParams, {name})" in src


@needs_nvcc
@pytest.mark.parametrize(
    "cfg",
    [
        parse_config("(BF16, 128, 64, 128, 4): wgmma"),
        default_bwd_config("fp16", 64, "sm_90"),
        default_bwd_config("bf16", 64, "sm_80"),
        default_decode_config("bf16", 128, 1, "sm_90"),
        default_decode_config("fp16", 128, 64, "sm_90"),  # the wgmma decode kernel
    ],
    ids=lambda c: c.name(),
)
def test_nvcc_checks_the_params_layout_of_each_family(cache, cfg):
    # NVRTC's front end rejects __builtin_offsetof, so only nvcc compiles the layout asserts: one translation
    # unit of each family with nvcc (the catalog test compiles them all with NVRTC).
    built = kernels.build(cfg, "sm_90", "nvcc")
    assert built.cubin[:4] == b"\x7fELF"


def _build_in_child(args):
    cache_dir, name = args
    os.environ["FLASH_ATTENTION_CACHE_DIR"] = cache_dir
    os.environ["FLASH_ATTENTION_QUIET"] = "1"
    built = kernels.build(parse_config(name), "sm_80", "nvcc")
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


@needs_nvcc
def test_an_unwritable_cache_warns_and_still_returns_the_kernel(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    monkeypatch.setattr(kernels, "_unwritable_warned", set())
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    with pytest.warns(RuntimeWarning, match="kernel cache .* is not writable.*FLASH_ATTENTION_CACHE_DIR"):
        built = kernels.build(cfg, "sm_80", "nvcc")
    assert built.cubin[:4] == b"\x7fELF" and not built.from_cache


def test_a_damaged_cache_entry_is_rebuilt_never_loaded(tmp_path, monkeypatch):
    # A build interrupted or a disk filled half way: an entry whose cubin does not match the digest its
    # metadata holds, or whose metadata is not JSON, is compiled again rather than handed to the driver.
    from flash_attention.jit import compiler as jit_compiler

    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    compiles = []

    def compile_source(source, arch, what, kind):
        compiles.append(what)
        return jit_compiler.CompileResult(b"\x7fELF" + bytes(range(256)) * 8, "ptxas info", kind, [])

    monkeypatch.setattr(jit_compiler, "compile_source", compile_source)
    monkeypatch.setattr(jit_compiler, "compiler_id", lambda kind: "stand-in compiler")
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    whole = kernels.build(cfg, "sm_80", "nvcc").cubin
    assert kernels.build(cfg, "sm_80", "nvcc").from_cache and len(compiles) == 1
    (cubin,) = tmp_path.glob("*.cubin")
    cubin.write_bytes(whole[: len(whole) // 2])  # cut short
    again = kernels.build(cfg, "sm_80", "nvcc")
    assert not again.from_cache and again.cubin == whole and len(compiles) == 2
    assert cubin.read_bytes() == whole  # and the entry is whole again
    (meta,) = tmp_path.glob("*.json")
    meta.write_text('{"config": "cut sh')
    assert not kernels.build(cfg, "sm_80", "nvcc").from_cache and len(compiles) == 3


def test_a_config_named_twice_is_built_once():
    name = "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+tma_store+stages_2"
    assert len(jobs_for(["sm_80", "sm_90"], [name, name])) == 1
