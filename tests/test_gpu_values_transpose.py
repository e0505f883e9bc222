"""The values-transpose kernel (csrc/include/fa/values_transpose.cuh) against the PyTorch form
(ops.fp8_values.transposed_values_reference), byte for byte: key counts that are and are not multiples of 16
or of the kernel's 128-key tile, batch 1-3, heads 1-8, head_dim 64, 128 and 256, V contiguous, sliced out of a
packed qkv tensor, stored heads-major and expanded over the batch; the output poisoned before the call and
guarded on both sides (a missed byte or a byte written out of bounds fails). Random bytes, NaN patterns
included: the kernel moves bytes and must never look at them."""

from __future__ import annotations

import pytest
import torch

from flash_attention.ops import fp8_values
from flash_attention.ops.device import device_unavailable_reason
from flash_attention.ops.fp8_values import kernel_takes_layout, transposed_values, transposed_values_reference

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
POISON, GUARD = 0xA5, 0x5A


@pytest.fixture(autouse=True)
def _kernels_available():
    reason = device_unavailable_reason(torch.cuda.current_device())
    if reason:
        pytest.skip(reason)


def _random_bytes(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device="cuda")


def _values(layout: str, b: int, s: int, h: int, d: int, seed: int) -> torch.Tensor:
    if layout == "contiguous":
        return _random_bytes(b, s, h, d, seed=seed).view(E4M3)
    if layout == "qkv":  # v of a packed (batch, seqlen, 3, heads, head_dim) projection
        return _random_bytes(b, s, 3, h, d, seed=seed).view(E4M3)[:, :, 2]
    if layout == "heads_major":  # (batch, heads, seqlen, head_dim) storage
        return _random_bytes(b, h, s, d, seed=seed).view(E4M3).transpose(1, 2)
    if layout == "expanded":  # one sequence's values for every batch row (a zero batch stride)
        return _random_bytes(1, s, h, d, seed=seed).view(E4M3).expand(b, -1, -1, -1)
    raise AssertionError(layout)


def _guarded_out(shape, guard: int = 256):
    """A poisoned output inside a buffer with guard bytes on both sides (guard a multiple of 16, so the
    output stays 16-byte aligned)."""
    n = shape[0] * shape[1] * shape[2] * shape[3]
    buf = torch.full((guard + n + guard,), GUARD, dtype=torch.uint8, device="cuda")
    buf[guard : guard + n] = POISON
    return buf, buf[guard : guard + n].view(shape).view(E4M3), guard


def _kernel_only(monkeypatch):
    """Make a call that would take the PyTorch form fail: the result checked is the kernel's."""

    def refuse(v):
        raise AssertionError(f"the PyTorch form ran for v {tuple(v.shape)} strides {v.stride()}")

    monkeypatch.setattr(fp8_values, "transposed_values_reference", refuse)


SHAPES = [
    # (batch, seqlen_k, heads_kv, head_dim)
    (1, 1, 1, 128),
    (2, 15, 3, 128),
    (1, 16, 8, 128),
    (3, 77, 2, 128),
    (2, 300, 5, 128),
    (1, 1024, 8, 128),
    (2, 4097, 4, 128),
    (3, 129, 1, 128),
    (1, 300, 2, 256),
    (2, 77, 3, 64),
    (1, 4097, 8, 64),
    (2, 4097, 3, 256),
]


@pytest.mark.parametrize("layout", ["contiguous", "qkv", "heads_major", "expanded"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_the_pytorch_form_byte_for_byte(monkeypatch, shape, layout):
    b, s, h, d = shape
    v = _values(layout, b, s, h, d, seed=s * 31 + h * 7 + b)
    assert kernel_takes_layout(v)
    want = transposed_values_reference(v.view(torch.uint8))  # (before the form is refused below)
    keys = -(-s // 16) * 16
    buf, out, guard = _guarded_out((b, h, d, keys))
    _kernel_only(monkeypatch)
    assert transposed_values(v, out=out) is out
    got = out.view(torch.uint8)
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    assert (buf[:guard] == GUARD).all() and (buf[-guard:] == GUARD).all(), "a byte written out of bounds"
    # The keys past seqlen_k are zeros: in V^T's positions of the last group that hold them.
    if s % 16:
        tail = [p for p, key in enumerate(fp8_values.KEY_ORDER_16) if keys - 16 + key >= s]
        assert not got[..., [keys - 16 + p for p in tail]].any()


def test_the_kernel_runs_on_the_current_stream(monkeypatch):
    v = _values("qkv", 2, 333, 4, 128, seed=5)
    want = transposed_values_reference(v.view(torch.uint8))
    _kernel_only(monkeypatch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # (v was written on the default stream)
    with torch.cuda.stream(stream):
        got = transposed_values(v)
    stream.synchronize()
    assert got.dtype is E4M3 and got.is_contiguous() and got.shape == (2, 4, 128, 336)
    assert torch.equal(got.view(torch.uint8), want)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _random_bytes(2, 77, 3, 96, seed=1).view(E4M3),  # head_dim 96: no entry point
        lambda: _random_bytes(2, 77, 3, 136, seed=2).view(E4M3)[..., :128],  # head stride 136
        lambda: _random_bytes(2 * 77 * 3 * 128 + 8, seed=3)[8:].view(2, 77, 3, 128).view(E4M3),  # address
    ],
    ids=["d96", "head_stride_136", "address_8"],
)
def test_layouts_the_kernel_leaves_out_take_the_pytorch_form(make):
    v = make()
    assert not kernel_takes_layout(v)
    got = transposed_values(v)
    assert torch.equal(got.view(torch.uint8), transposed_values_reference(v.view(torch.uint8)))
