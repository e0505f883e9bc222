"""The values-transpose kernel (csrc/include/fa/values_transpose.cuh: V^T in P's key order for the FP8
forward, ops.fp8_values) on the CPU: its translation unit compiles for Hopper and sm_80 without spills, with
the kernel's key order pinned to KEY_ORDER_16 (a different order fails the compile) and its params struct to
the ctypes twin (nvcc)."""

from __future__ import annotations

import pytest

from flash_attention.configs.values_transpose import (
    KEY_ORDER_16,
    VALUES_TRANSPOSE_HEAD_DIMS,
    ValuesTransposeConfig,
)
from flash_attention.jit import compiler, sources

CFG = ValuesTransposeConfig()


def _nvrtc():
    if compiler.load_nvrtc() is None:
        pytest.skip("NVRTC is not installed")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_kernel_compiles_for_hopper_and_sm80_without_spills(arch):
    """Every head_dim's entry point builds (the kernel uses sm_80 instructions only: cp.async, prmt), with no
    spill or stack frame, the static tile of 128 keys x head_dim bytes and the occupancy its launch assumes
    (at least 4 blocks of 256 threads a multiprocessor by registers; 32 at head_dim 128 under NVRTC 13.0)."""
    _nvrtc()
    result = compiler.compile_nvrtc(sources.kernel_source(CFG), arch, CFG.name())
    by_name = {r.kernel: r for r in result.resources}
    assert set(by_name) == {CFG.symbol(d) for d in VALUES_TRANSPOSE_HEAD_DIMS}
    for d in VALUES_TRANSPOSE_HEAD_DIMS:
        r = by_name[CFG.symbol(d)]
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, r
        assert r.static_smem == CFG.keys_per_block * d, r
        assert r.registers <= 64, r


def test_a_key_order_other_than_key_order_16_fails_the_compile(monkeypatch):
    """The unit static_asserts fa::values_key_at against the Python order, so the kernel cannot drift from
    the layout tests/test_fp8_values.py checks against P V."""
    _nvrtc()
    swapped = list(KEY_ORDER_16)
    swapped[2], swapped[3] = swapped[3], swapped[2]
    monkeypatch.setattr(sources, "KEY_ORDER_16", tuple(swapped))
    with pytest.raises(compiler.CompileError, match="key order differs from KEY_ORDER_16"):
        compiler.compile_nvrtc(sources.kernel_source(CFG), "sm_90a", CFG.name())


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
def test_the_params_struct_matches_its_ctypes_twin_under_nvcc():
    """The offset asserts compile under nvcc only (NVRTC rejects __builtin_offsetof)."""
    source = sources.kernel_source(CFG)
    assert "__builtin_offsetof(fa::ValuesTransposeParams, keys)" in source
    compiler.compile_nvcc(source, "sm_90a", CFG.name())
