"""What a machine that cannot compile, load or keep kernels gets: a reason in words and the PyTorch path,
never a crash, a hang or a broken cache entry. No compiler, a driver older than the compiler, a full disk,
and a build interrupted half way (tests/test_build.py has the read-only cache folder, two processes
compiling one kernel at once, and damaged entries; tests/test_host_library.py the host library's own
failures)."""

from __future__ import annotations

import errno

import pytest
import torch

import flash_attention as fa
from flash_attention.configs import parse_config
from flash_attention.jit import cache as jit_cache
from flash_attention.jit import compiler as jit_compiler
from flash_attention.jit import driver
from flash_attention.ops import device, dispatch

CONFIG = "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax"


@pytest.fixture()
def facts(monkeypatch):
    """device_unavailable_reason on a GPU this machine does not have: an sm_90 whose driver and compiler
    the test sets (the cached answers are forgotten before and after)."""
    monkeypatch.setattr(device, "_device_problem", lambda index: None)
    for fn in (device._compiler_problem, device._driver_problem):
        fn.cache_clear()
    yield monkeypatch
    for fn in (device._compiler_problem, device._driver_problem):
        fn.cache_clear()


def _compiler(monkeypatch, kind, cid="nvrtc 13.0"):
    monkeypatch.setattr(jit_compiler, "choose_compiler", lambda: kind)
    monkeypatch.setattr(jit_compiler, "compiler_id", lambda k: cid)


def test_without_a_compiler_the_kernels_step_aside_with_the_reason(facts):
    _compiler(facts, None)
    facts.setattr(driver, "driver_version", lambda: 13000)
    reason = device.device_unavailable_reason(0)
    assert "no CUDA compiler" in reason and "NVRTC" in reason
    # and a build asked for anyway says what to install
    with pytest.raises(jit_compiler.CompileError, match="no CUDA compiler found: install"):
        jit_cache.build(parse_config(CONFIG), "sm_80")


@pytest.mark.parametrize(
    ("version", "cid", "needed_by"),
    [
        (12040, "nvrtc 13.0", "the kernels' compiler (nvrtc 13.0) needs 13.0"),
        (12080, "nvcc 13.0.88", "the kernels' compiler (nvcc 13.0.88) needs 13.0"),
        (11080, "nvrtc 12.4", "the launch layer (cuLibraryLoadData) needs 12.0"),
    ],
)
def test_a_driver_older_than_the_compiler_or_the_launch_layer_is_named(facts, version, cid, needed_by):
    _compiler(facts, cid.split()[0], cid)
    facts.setattr(driver, "driver_version", lambda: version)
    reason = device.device_unavailable_reason(0)
    have = f"{version // 1000}.{version % 1000 // 10}"
    assert reason is not None and f"supports CUDA {have}" in reason and needed_by in reason, reason
    assert "update the NVIDIA driver" in reason
    # a PyTorch of the driver's CUDA version helps only where the compiler is what is too new
    assert ("built for CUDA 12" in reason) == (version >= 12000)


def test_a_driver_of_the_compilers_major_version_or_later_is_fine(facts):
    _compiler(facts, "nvrtc", "nvrtc 13.0")
    for version in (13000, 13020, 14000):
        device._driver_problem.cache_clear()
        facts.setattr(driver, "driver_version", lambda v=version: v)
        assert device.device_unavailable_reason(0) is None


def test_a_driver_that_cannot_answer_is_a_reason_too(facts):
    _compiler(facts, "nvrtc")

    def fails():
        raise driver.DriverError("cuDriverGetVersion failed: unknown error (999)")

    facts.setattr(driver, "driver_version", fails)
    assert "driver API is unusable" in device.device_unavailable_reason(0)


def test_an_unusable_gpu_gives_the_pytorch_path_and_one_warning(monkeypatch):
    # The dispatch seam: a call the kernels are meant for whose device has a problem runs the fallback,
    # warned once with the reason (here on CPU tensors standing in for that GPU's).
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)
    monkeypatch.setattr(
        dispatch.ops, "cuda_unavailable_reason", lambda q: "the CUDA driver supports CUDA 12.4, and ..."
    )
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="fallback .* because the CUDA driver supports CUDA 12.4"):
        out = fa.attention(q, k, v, causal=True)
    ref = fa.attention(q.float(), k.float(), v.float(), causal=True)
    assert (out.float() - ref).abs().max().item() < 2e-2


def _stand_in_compiler(monkeypatch, fail_at=None):
    """A compiler that returns a fixed cubin at once (and raises ``fail_at`` when asked to)."""
    compiles = []

    def compile_source(source, arch, what, kind):
        compiles.append(what)
        if fail_at is not None:
            raise fail_at
        return jit_compiler.CompileResult(b"\x7fELF" + bytes(range(256)) * 4, "ptxas info", kind, [])

    monkeypatch.setattr(jit_compiler, "compile_source", compile_source)
    monkeypatch.setattr(jit_compiler, "compiler_id", lambda kind: "stand-in compiler")
    return compiles


def test_a_full_disk_costs_a_compile_per_process_never_the_call(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    monkeypatch.setattr(jit_cache, "_unwritable_warned", set())
    compiles = _stand_in_compiler(monkeypatch)
    real_write = jit_cache.atomic_write
    writes = []

    def full(path, data):
        writes.append(path)
        if len(writes) == 2:  # the metadata fitted, the cubin did not
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(jit_cache, "atomic_write", full)
    cfg = parse_config(CONFIG)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        built = jit_cache.build(cfg, "sm_80", "nvrtc")
    assert built.cubin[:4] == b"\x7fELF" and not built.from_cache
    assert not list(tmp_path.glob("*.cubin")) and not list(tmp_path.glob("*.tmp"))
    # Space again: metadata without its cubin is no entry; the next build compiles and keeps a whole one.
    monkeypatch.setattr(jit_cache, "atomic_write", real_write)
    again = jit_cache.build(cfg, "sm_80", "nvrtc")
    assert not again.from_cache and len(compiles) == 2
    assert jit_cache.build(cfg, "sm_80", "nvrtc").from_cache


@pytest.mark.parametrize("where", ["compile", "metadata", "cubin"])
def test_a_build_interrupted_half_way_leaves_no_entry_and_no_waiter(tmp_path, monkeypatch, where):
    # Ctrl-C during the compile, or while a file is being written (its temporary file written, the rename
    # not yet done): atomic_write's own cleanup runs, and the in-flight table lets go of the key.
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    compiles = _stand_in_compiler(monkeypatch, KeyboardInterrupt() if where == "compile" else None)
    real_replace = jit_cache.os.replace
    renames = []

    def interrupted(src, dst):
        renames.append(dst)
        if len(renames) == {"metadata": 1, "cubin": 2}.get(where):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(jit_cache.os, "replace", interrupted)
    cfg = parse_config(CONFIG)
    with pytest.raises(KeyboardInterrupt):
        jit_cache.build(cfg, "sm_80", "nvrtc")
    assert not list(tmp_path.glob("*.cubin")) and not list(tmp_path.glob("*.tmp"))
    assert not jit_cache._in_flight  # nobody is left waiting on the interrupted compile
    # The next build compiles afresh and keeps a whole entry.
    monkeypatch.setattr(jit_cache.os, "replace", real_replace)
    _stand_in_compiler(monkeypatch)
    built = jit_cache.build(cfg, "sm_80", "nvrtc")
    assert not built.from_cache and built.cubin[:4] == b"\x7fELF"
    assert jit_cache.build(cfg, "sm_80", "nvrtc").from_cache
    assert len(compiles) == 1
