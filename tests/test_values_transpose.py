"""The values-transpose kernel (csrc/include/fa/values_transpose.cuh: V^T in P's key order for the FP8
forward, ops.fp8_values) on the CPU: its translation unit compiles for Hopper and sm_80 without spills, with
the kernel's key order pinned to KEY_ORDER_16 (a different order fails the compile) and its params struct to
the ctypes twin (nvcc); the layouts the host sends to it; and the host's launch, through a stand-in kernel
that reads and writes only what the params and the grid say. The kernel's bytes are checked against the
PyTorch form on a GPU (tests/test_gpu_values_transpose.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from nvrtc_units import require_nvrtc, unit_resources

from flash_attention.configs.values_transpose import (
    KEY_ORDER_16,
    VALUES_TRANSPOSE_HEAD_DIMS,
    ValuesTransposeConfig,
)
from flash_attention.jit import compiler, sources
from flash_attention.ops import fp8_values
from flash_attention.ops.fp8_values import kernel_takes_layout, transposed_values, transposed_values_reference

CFG = ValuesTransposeConfig()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_kernel_compiles_for_hopper_and_sm80_without_spills(arch):
    """Every head_dim's entry point builds (the kernel uses sm_80 instructions only: cp.async, prmt), with no
    spill or stack frame, the static tile of 128 keys x head_dim bytes and the occupancy its launch assumes
    (at least 4 blocks of 256 threads a multiprocessor by registers; 32 at head_dim 128 under NVRTC 13.0)."""
    by_name = unit_resources(CFG, arch)
    assert set(by_name) == {CFG.symbol(d) for d in VALUES_TRANSPOSE_HEAD_DIMS}
    for d in VALUES_TRANSPOSE_HEAD_DIMS:
        r = by_name[CFG.symbol(d)]
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, r
        assert r.static_smem == CFG.keys_per_block * d, r
        assert r.registers <= 64, r


def test_a_key_order_other_than_key_order_16_fails_the_compile(monkeypatch):
    """The unit static_asserts fa::values_key_at against the Python order, so the kernel cannot drift from
    the layout tests/test_fp8_values.py checks against P V."""
    require_nvrtc()
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


def _e4m3(*shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_the_layouts_the_kernel_takes():
    v = _e4m3(2, 33, 3, 128)
    assert kernel_takes_layout(v)
    assert kernel_takes_layout(_e4m3(1, 5, 2, 256))
    assert kernel_takes_layout(_e4m3(2, 33, 3, 2, 128)[:, :, :, 1])  # k's or v's slice of a packed kv
    assert kernel_takes_layout(_e4m3(2, 4, 33, 128).transpose(1, 2))  # (batch, heads, seqlen, d) storage
    assert kernel_takes_layout(_e4m3(1, 33, 3, 128).expand(4, -1, -1, -1))  # a zero batch stride
    assert kernel_takes_layout(v.view(torch.uint8))  # any 1-byte dtype: the bytes are moved
    assert not kernel_takes_layout(v.view(torch.uint8).to(torch.bfloat16))  # 2-byte elements
    assert kernel_takes_layout(_e4m3(2, 33, 3, 64))  # half a bank line: its rows swap in pairs
    assert not kernel_takes_layout(_e4m3(2, 33, 3, 96))  # no entry point
    assert not kernel_takes_layout(_e4m3(2, 33, 3, 136)[..., :128])  # head stride 136: not 16-byte chunks
    assert not kernel_takes_layout(_e4m3(2, 33, 3, 129)[..., 1:])  # an address off 16 bytes, odd strides
    assert not kernel_takes_layout(_e4m3(2, 33, 3, 256)[..., ::2])  # columns not contiguous
    flat = _e4m3(2 * 33 * 3 * 128 + 16)
    assert not kernel_takes_layout(flat[8 : 8 + v.numel()].view(v.shape))  # base 8 bytes off alignment
    assert kernel_takes_layout(flat[16 : 16 + v.numel()].view(v.shape))
    # A dimension of one element has no stride that matters.
    assert kernel_takes_layout(_e4m3(1, 1, 1, 128).as_strided((1, 1, 1, 128), (7, 5, 3, 1)))


def test_cpu_tensors_take_the_pytorch_form_into_out():
    v = _e4m3(2, 21, 3, 128)
    want = transposed_values_reference(v).view(torch.uint8)
    out = torch.full((2, 3, 128, 32), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert transposed_values(v, out=out) is out
    assert torch.equal(out.view(torch.uint8), want)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        transposed_values(v, out=out[..., :16])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        transposed_values(v, out=out.view(torch.uint8))


def _tensor_at(address: int, shape, strides) -> torch.Tensor:
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    buf = (ctypes.c_char * span).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8).as_strided(shape, strides)


@pytest.mark.parametrize("seqlen_k", [1, 15, 16, 77, 300])
@pytest.mark.parametrize("layout", ["contiguous", "packed_kv", "heads_major"])
def test_the_host_launch_through_a_stand_in_kernel(monkeypatch, seqlen_k, layout):
    """The host's params and grid, on CPU tensors: a stand-in kernel sees V only through the params' pointer
    and strides and writes, block by block of the grid, its 128 keys of every V^T row at the params' output
    pointer (the PyTorch form of those keys, from what it read). Any wrong pointer, stride, size or grid
    leaves the poisoned output wrong somewhere."""
    b, h, d = 2, 3, 128
    if layout == "contiguous":
        v = _e4m3(b, seqlen_k, h, d)
    elif layout == "packed_kv":
        v = _e4m3(b, seqlen_k, 2, h, d)[:, :, 1]
    else:
        v = _e4m3(b, h, seqlen_k, d).transpose(1, 2)
    launches = []

    def stand_in(kernel, grid, threads, smem, index, p):
        launches.append((kernel, grid, threads, smem))
        keys = p.keys
        seen = _tensor_at(
            p.v, (p.batch, p.seqlen_k, p.heads_kv, d), (p.v_batch_stride, p.v_row_stride, p.v_head_stride, 1)
        )
        whole = transposed_values_reference(seen.clone())
        vt = _tensor_at(p.vt, (p.batch, p.heads_kv, d, keys), (p.heads_kv * d * keys, d * keys, keys, 1))
        for x in range(grid[0]):
            for head in range(grid[1]):
                for batch in range(grid[2]):
                    lo, hi = 128 * x, min(128 * x + 128, keys)
                    vt[batch, head, :, lo:hi] = whole[batch, head, :, lo:hi]

    monkeypatch.setattr(fp8_values, "_kernel_can_transpose", lambda t: kernel_takes_layout(t))
    monkeypatch.setattr(fp8_values, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(
        fp8_values, "get_values_transpose_kernels", lambda cfg, arch: {128: "d128", 256: "d256"}
    )
    monkeypatch.setattr(fp8_values, "launch", stand_in)
    keys = -(-seqlen_k // 16) * 16
    out = torch.full((b, h, d, keys), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    transposed_values(v, out=out)
    assert launches == [("d128", (-(-keys // 128), h, b), 256, 0)]
    assert torch.equal(out.view(torch.uint8), transposed_values_reference(v).view(torch.uint8))
