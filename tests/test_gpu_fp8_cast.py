"""The FP8 cast kernels (csrc/include/fa/fp8_cast.cuh, ops.fp8_cast) against spec.fp8's PyTorch forms on a
GPU, byte for byte: quantizing bf16, fp16 and float32 tensors (GQA groups, odd lengths, head_dims 8-256,
strided layouts, kv heads of very different scales, an all-zero kv head, values under bf16's normal range
after scaling, inf and NaN heads) and dequantizing e4m3 tensors of every byte pattern with no descale, one
or one per (batch, kv head). The outputs are poisoned (torch.empty made to fill 0x5A bytes, a finite value
in every dtype here) and spec.fp8's forms made to fail inside ops.fp8_cast, so what is compared is the
kernels' own writes. NaN's bit pattern is not specified by either side: positions that are NaN must be NaN
in both, every other byte equal."""

from __future__ import annotations

import pytest
import torch

from flash_attention.ops import fp8_cast
from flash_attention.ops.device import device_unavailable_reason
from flash_attention.spec import fp8 as spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a GPU with e4m3 conversions (sm_89 or later)",
    ),
]

E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch):
    reason = device_unavailable_reason(torch.cuda.current_device())
    if reason:
        pytest.skip(reason)

    class Refuse:
        def __getattr__(self, name):
            if name in ("quantize", "dequantize"):
                raise AssertionError(f"spec.fp8.{name} ran instead of the kernel")
            return getattr(spec, name)

    monkeypatch.setattr(fp8_cast, "_fp8", Refuse())
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(0x5A)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def _assert_same(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def _scaled(b, n, h, d, hk, dtype, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # kv heads of very different scales: e4m3's subnormals, its middle, bf16's top
    scales = torch.logspace(-30, 30, hk, device="cuda").repeat_interleave(h // hk)
    if layout == "packed":  # (scaled before the slice: the tensor stays a strided view)
        full = torch.randn(b, n, 3, h, d, generator=gen, device="cuda") * scales[None, None, None, :, None]
        return full.to(dtype)[:, :, 1]
    if layout == "heads_major":
        full = torch.randn(b, h, n, d, generator=gen, device="cuda") * scales[None, :, None, None]
        return full.to(dtype).transpose(1, 2)
    return (torch.randn(b, n, h, d, generator=gen, device="cuda") * scales[None, None, :, None]).to(dtype)


SHAPES = [
    # (batch, seqlen, heads, heads_kv, head_dim)
    (1, 1, 1, 1, 8),
    (2, 77, 4, 2, 64),
    (3, 300, 8, 2, 128),
    (1, 4097, 4, 4, 128),
    (2, 33, 6, 3, 256),
    (2, 129, 2, 1, 72),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_is_spec_fp8s_bytes(shape, dtype):
    b, n, h, hk, d = shape
    if dtype is torch.float16:  # (fp16's range: kv heads of 1e-4 to 1e4)
        scales = torch.logspace(-4, 4, hk, device="cuda").repeat_interleave(h // hk)
        t = (torch.randn(b, n, h, d, device="cuda") * scales[None, None, :, None]).half()
    else:
        t = _scaled(b, n, h, d, hk, dtype, "contiguous", seed=sum(shape))
    q8, descale = fp8_cast.quantize(t, hk)
    want8, want = spec.quantize(t, hk)
    _assert_same(q8, want8)
    _assert_same(descale, want)


@pytest.mark.parametrize("layout", ["packed", "heads_major"])
def test_quantize_reads_strided_layouts(layout):
    t = _scaled(2, 129, 8, 128, 4, torch.bfloat16, layout, seed=5)
    assert not t.is_contiguous()
    q8, descale = fp8_cast.quantize(t, 4)
    want8, want = spec.quantize(t, 4)
    _assert_same(q8, want8)
    _assert_same(descale, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_edge_heads(dtype):
    """Per kv head: all zeros (descale 1, zeros), one inf and one NaN (NaN descale and NaN elements), an
    amax of exactly 448 times a power of two (frexp's mantissa of 0.5), one huge element beside small ones
    (most of the head rounds to e4m3's subnormals and zero), and, where the dtype holds it, an amax under
    float32's normal range times 448 (amax / 448 subnormal: frexp there, and the exponent's floor of -126)."""
    b, n, h, hk, d = 2, 65, 8, 8, 64
    t = torch.randn(b, n, h, d, device="cuda").to(dtype)
    t[:, :, 0] = 0
    t[0, 3, 1, 5] = float("inf")
    t[1, 7, 2, 9] = float("nan")
    t[:, :, 3] = t[:, :, 3].clamp(-1, 1)
    t[:, 0, 3, 0] = 448 * 2.0**-4
    t[:, 0, 4, 0] = 6e4 if dtype is torch.float16 else 2.0**100
    if dtype is not torch.float16:
        t[:, :, 5] = (torch.randn(b, n, d, device="cuda") * 1e-38).to(dtype)
        t[:, :, 6] = (torch.randn(b, n, d, device="cuda") * 2.0**-128).to(dtype)
    q8, descale = fp8_cast.quantize(t, hk)
    want8, want = spec.quantize(t, hk)
    _assert_same(q8, want8)
    _assert_same(descale, want)
    assert torch.equal(descale[:, 0].cpu(), torch.ones(b))
    assert descale[0, 1].isnan() and descale[1, 2].isnan()
    if dtype is not torch.float16:
        assert (descale[:, 6] == 2.0**-126).all()  # (the floor)


@pytest.mark.parametrize("per", ["none", "one", "per_head"])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_is_spec_fp8s_values(shape, per):
    b, n, h, hk, d = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    t = torch.randint(0, 256, (b, n, h, d), generator=gen, dtype=torch.uint8, device="cuda").view(E4M3)
    descale = {
        "none": None,
        "one": torch.rand(1, generator=gen, device="cuda") * 3,
        "per_head": torch.rand(b, hk, generator=gen, device="cuda") * 3,
    }[per]
    _assert_same(fp8_cast.dequantize(t, descale, hk), spec.dequantize(t, descale, hk))
    # powers_of_two is the caller's word that the descales are powers of two (spec.fp8 then multiplies in
    # bf16); the kernel's float32 product is the same value for those.
    if descale is not None:
        descale = torch.ldexp(
            torch.ones_like(descale), torch.randint_like(descale, -20, 20, dtype=torch.int32)
        )
    _assert_same(
        fp8_cast.dequantize(t, descale, hk, powers_of_two=True),
        spec.dequantize(t, descale, hk, powers_of_two=True),
    )


def test_dequantize_reads_strided_layouts_and_round_trips():
    t = _scaled(2, 77, 8, 128, 2, torch.bfloat16, "contiguous", seed=9)
    q8, descale = fp8_cast.quantize(t, 2)
    packed = torch.stack([q8, q8, q8], 2)[:, :, 1]  # (not contiguous)
    _assert_same(
        fp8_cast.dequantize(packed, descale, 2, powers_of_two=True),
        spec.dequantize(q8, descale, 2, powers_of_two=True),
    )
