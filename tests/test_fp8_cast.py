"""The FP8 cast kernels (csrc/include/fa/fp8_cast.cuh, ops.fp8_cast) on the CPU: the translation unit
compiles for Hopper and sm_89 without spills, its params struct pinned to the ctypes twin (nvcc); the
layouts the kernels take; CPU tensors on spec.fp8's forms; and the host's launches through stand-in kernels
that read and write only what the params and the grid say, block by block. The kernels' bytes are checked
against spec.fp8 on a GPU (tests/test_gpu_fp8_cast.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from nvrtc_units import unit_resources

from flash_attention.configs.fp8_cast import FP8_CAST_ENTRY_POINTS, Fp8CastConfig
from flash_attention.jit import compiler, sources
from flash_attention.ops import fp8_cast
from flash_attention.ops.fp8_cast import dequantize, kernel_takes_layout, quantize
from flash_attention.spec import fp8 as spec

CFG = Fp8CastConfig()
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("arch", ["sm_90", "sm_89"])
def test_the_kernels_compile_without_spills(arch):
    """Every entry point builds for the GPUs with e4m3 conversions, with no spill or stack frame, the amax
    pass's 32 words of shared memory only, and registers that let 6 blocks of 256 threads share an SM."""
    by_name = unit_resources(CFG, arch)
    assert set(by_name) == {CFG.symbol(k) for k in FP8_CAST_ENTRY_POINTS}
    for key in FP8_CAST_ENTRY_POINTS:
        r = by_name[CFG.symbol(key)]
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, r
        assert r.static_smem == (128 if key.startswith("amax") else 0), r
        assert r.registers <= 40, r


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
def test_the_params_struct_matches_its_ctypes_twin_under_nvcc():
    source = sources.kernel_source(CFG)
    assert "__builtin_offsetof(fa::Fp8CastParams, descale_per_head)" in source
    compiler.compile_nvcc(source, "sm_90a", CFG.name())


def _bf16(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_the_layouts_the_kernels_take():
    q = _bf16(2, 33, 4, 128)
    assert kernel_takes_layout(q)
    assert kernel_takes_layout(q.float()) and kernel_takes_layout(q.half())
    assert kernel_takes_layout(q.to(E4M3))
    assert not kernel_takes_layout(q.double()) and not kernel_takes_layout(q.view(torch.int16))
    assert kernel_takes_layout(_bf16(2, 33, 3, 4, 128)[:, :, 1])  # k out of a packed qkv
    assert kernel_takes_layout(_bf16(2, 4, 33, 64).transpose(1, 2))  # (batch, heads, seqlen, d) storage
    assert kernel_takes_layout(_bf16(1, 33, 4, 128).expand(3, -1, -1, -1))  # a zero batch stride
    assert kernel_takes_layout(_bf16(2, 33, 4, 72))  # any multiple of 8
    assert not kernel_takes_layout(_bf16(2, 33, 4, 100))  # a thread's eight elements would straddle rows
    assert kernel_takes_layout(_bf16(2, 33, 4, 136)[..., :128])  # strides of 136 elements: 8-aligned
    assert not kernel_takes_layout(_bf16(2, 33, 4, 132)[..., :128])  # strides of 132 elements: not 8-aligned
    assert not kernel_takes_layout(_bf16(2, 33, 4, 256)[..., ::2])  # columns not contiguous
    assert not kernel_takes_layout(_bf16(2, 33, 4, 129)[..., 1:])  # an address off 16 bytes
    assert not kernel_takes_layout(_bf16(2, 0, 4, 128))  # empty
    assert not kernel_takes_layout(_bf16(33, 4, 128))  # 3-D (a packed batch: spec.fp8's forms)
    assert kernel_takes_layout(_bf16(1, 1, 1, 128).as_strided((1, 1, 1, 128), (7, 5, 3, 1)))


def test_cpu_tensors_take_spec_fp8s_forms():
    q = _bf16(2, 21, 4, 64, seed=3) * 30
    q8, descale = quantize(q, 2)
    want8, want = spec.quantize(q, 2)
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(descale, want)
    assert torch.equal(dequantize(q8, descale, 2), spec.dequantize(want8, want, 2))


def _tensor_at(address: int, shape, strides, dtype) -> torch.Tensor:
    size = dtype.itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    buf = (ctypes.c_char * (span * size)).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).as_strided(shape, strides)


class StandIn:
    """The three passes in PyTorch, one grid block at a time, seeing memory only through the params: a
    block (x, head, batch) takes rows rows_per_block x .. of its (batch, head); the amax pass raises its kv
    head's word, the converting pass writes its rows of the e4m3 tensor from that word (and the descale,
    once per kv head, from the first block of the kv head's first query head), the dequantizer its rows."""

    def __init__(self, dtype):
        self.dtype, self.launches = dtype, []

    def src(self, p, dtype):
        shape = (p.batch, p.seqlen, p.heads, p.head_dim)
        return _tensor_at(p.src, shape, (p.src_batch_stride, p.src_row_stride, p.src_head_stride, 1), dtype)

    def dst(self, p, dtype):
        shape = (p.batch, p.seqlen, p.heads, p.head_dim)
        return _tensor_at(
            p.dst, shape, (p.seqlen * p.heads * p.head_dim, p.heads * p.head_dim, p.head_dim, 1), dtype
        )

    def blocks(self, p, grid):
        group = p.heads // p.heads_kv
        for x in range(grid[0]):
            for head in range(grid[1]):
                for batch in range(grid[2]):
                    rows = slice(x * p.rows_per_block, min((x + 1) * p.rows_per_block, p.seqlen))
                    yield x, batch, head, head // group, rows

    def __call__(self, launches, index, p, stream):
        for kernel, grid, threads, smem, _ in launches:
            self.launches.append((kernel, grid, threads, smem))
            pairs = (p.batch, p.heads_kv)
            if kernel.startswith("amax"):
                src, amax = self.src(p, self.dtype), _tensor_at(p.amax, pairs, (p.heads_kv, 1), torch.int32)
                for _, batch, head, kv, rows in self.blocks(p, grid):
                    m = src[batch, rows, head].float().abs().amax().view(torch.int32)
                    amax[batch, kv] = max(int(amax[batch, kv]), int(m))
            elif kernel.startswith("quantize"):
                src, dst = self.src(p, self.dtype), self.dst(p, E4M3)
                amax = _tensor_at(p.amax, pairs, (p.heads_kv, 1), torch.int32).view(torch.float32)
                descale = _tensor_at(p.descale, pairs, (p.heads_kv, 1), torch.float32)
                for x, batch, head, kv, rows in self.blocks(p, grid):
                    # spec.fp8.quantize's own arithmetic on one kv head whose amax is the word's
                    block = src[batch, rows, head][None, :, None, None]
                    one = torch.cat([block.reshape(-1), amax[batch, kv].reshape(1).to(block.dtype)])
                    _, d = spec.quantize(one.view(1, -1, 1, 1), 1)
                    inverse = (1 / d).to(block.dtype if block.dtype is torch.bfloat16 else torch.float32)
                    y = (block.to(inverse.dtype) * inverse).clamp_(-448, 448).to(E4M3)
                    dst[batch, rows, head] = y.reshape(dst[batch, rows, head].shape)
                    if x == 0 and head % (p.heads // p.heads_kv) == 0:
                        descale[batch, kv] = d.reshape(())
            else:
                src, dst = self.src(p, E4M3), self.dst(p, torch.bfloat16)
                for _, batch, head, kv, rows in self.blocks(p, grid):
                    ds = 1.0
                    if p.descale:
                        shape = pairs if p.descale_per_head else (1, 1)
                        d = _tensor_at(p.descale, shape, (shape[1], 1), torch.float32)
                        ds = d[batch, kv] if p.descale_per_head else d[0, 0]
                    dst[batch, rows, head] = (src[batch, rows, head].float() * ds).to(torch.bfloat16)


def _stand_in(monkeypatch, dtype) -> StandIn:
    gpu = StandIn(dtype)
    monkeypatch.setattr(fp8_cast, "kernel_takes", kernel_takes_layout)
    monkeypatch.setattr(fp8_cast, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(fp8_cast, "current_stream", lambda index: 0)
    monkeypatch.setattr(
        fp8_cast, "get_fp8_cast_kernels", lambda cfg, arch: {k: k for k in FP8_CAST_ENTRY_POINTS}
    )
    monkeypatch.setattr(fp8_cast, "launch_all", gpu)
    # Four rows a block at head_dim 128, so the grid has several row blocks and a partial last one.
    monkeypatch.setattr(fp8_cast, "_CONFIG", Fp8CastConfig(elements_per_block=512))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0)
    return gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "heads_major"])
def test_the_host_launches_through_stand_in_kernels(monkeypatch, dtype, layout):
    """Quantize, then dequantize, on CPU tensors through the stand-ins: every byte and descale equals
    spec.fp8's, so every pointer, stride, size and grid the host filled in is right (the outputs are
    poisoned: torch.empty is made to fill them)."""
    b, n, h, hk, d = 2, 13, 6, 3, 128
    gen = torch.Generator().manual_seed(7)
    scales = torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(2)[None, None, :, None]
    if layout == "contiguous":
        t = torch.randn(b, n, h, d, generator=gen) * scales
    elif layout == "packed":
        t = (torch.randn(b, n, 3, h, d, generator=gen) * scales[:, :, None])[:, :, 1]
    else:
        t = (torch.randn(b, h, n, d, generator=gen) * scales.transpose(1, 2)).transpose(1, 2)
    t = t.to(dtype)
    gpu = _stand_in(monkeypatch, dtype)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poisoned(empty(*a, **k)))
    q8, descale = quantize(t, hk)
    want8, want = spec.quantize(t, hk)
    assert q8.is_contiguous() and torch.equal(q8.view(torch.uint8), want8.view(torch.uint8))
    assert torch.equal(descale, want)
    grid = (-(-n // 4), h, b)
    source = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    assert gpu.launches == [(f"amax_{source}", grid, 256, 0), (f"quantize_{source}", grid, 256, 0)]
    for ds in (descale, descale[:1, :1].clone(), None):
        out = dequantize(q8, ds, hk, powers_of_two=True)
        assert torch.equal(out, spec.dequantize(q8, ds, hk)), ds
    assert [x[0] for x in gpu.launches[2:]] == ["dequantize"] * 3


def test_what_the_kernels_leave_to_spec_fp8(monkeypatch):
    """A descale that takes a gradient, or one laid out other than (batch, heads_kv) contiguous, and layouts
    the kernels do not read go to spec.fp8's forms (no launch)."""
    gpu = _stand_in(monkeypatch, torch.bfloat16)
    q8 = (_bf16(2, 9, 4, 64) * 10).to(E4M3)
    grad = (torch.rand(2, 2) + 0.5).requires_grad_()
    for descale in (grad, torch.rand(2, 2).t(), torch.rand(2, 2).double()):
        out = dequantize(q8, descale, 2)
        assert torch.equal(out, spec.dequantize(q8, descale, 2))
    assert dequantize(q8, grad, 2).requires_grad  # (spec.fp8's form carries the descale's gradient)
    odd = _bf16(2, 9, 4, 100)
    q8_odd, d_odd = quantize(odd, 2)
    assert torch.equal(q8_odd.view(torch.uint8), spec.quantize(odd, 2)[0].view(torch.uint8))
    assert gpu.launches == []


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)  # (NaN in every float dtype here, e4m3 included)
    return t


def test_never_while_torch_compile_traces(monkeypatch):
    """Under torch.compile the casts are spec.fp8's PyTorch ops, which it traces (its fake tensors have no
    data pointer for the kernels): a tensor the kernels would take is refused while it traces."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(fp8_cast, "device_unavailable_reason", lambda index: None)
    monkeypatch.setattr(fp8_cast, "device_arch", lambda index: "sm_90")
    t = _bf16(2, 9, 4, 64)
    assert fp8_cast.kernel_takes(t)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fp8_cast.kernel_takes(t)
