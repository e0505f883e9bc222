"""The FP8 forward's V layout (ops.fp8_values) against a model of the kernel's O += P V: S's accumulator
fragment packed into the 8-bit A fragment as pack4_e4m3 packs it, the k32 wgmma's operand layouts of the PTX
ISA, and V^T's tile read K-major. Exact in float64: a wrong key order, group size or fragment mapping
changes the sum."""

from __future__ import annotations

import pytest
import torch

from flash_attention.ops.fp8_values import KEY_ORDER_16, transposed_values


def test_the_key_order_is_a_permutation_within_each_group():
    assert sorted(KEY_ORDER_16) == list(range(16))
    assert KEY_ORDER_16 != tuple(range(16))  # (else the layout would need no permutation at all)


def _accumulator_value(p_rows: torch.Tensor, w: int, lane: int, n: int, e: int) -> float:
    # fa/frag.cuh: thread (g, t) of warp w holds S[16 w + g + 8 (e / 2)][8 n + 2 t + e % 2], register 4 n + e.
    g, t = divmod(lane, 4)
    return p_rows[16 * w + g + 8 * (e // 2), 8 * n + 2 * t + e % 2]


def _a_fragment(p_rows: torch.Tensor, step: int) -> dict:
    """What each thread packs for k32 step `step`: register r = pack4_e4m3 of its accumulator values of
    row g + 8 (r % 2) at n-tiles 4 step + 2 (r / 2) and + 1, in the order (n, col 2t), (n, 2t + 1),
    (n + 1, 2t), (n + 1, 2t + 1); returned as the A matrix the PTX ISA's fragment defines: register r, byte
    j of thread (g, t) of warp w is A[16 w + g + 8 (r % 2)][16 (r / 2) + 4 t + j]."""
    a = {}
    for w in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for r in range(4):
                n0 = 4 * step + 2 * (r // 2)
                half_e = 2 * (r % 2)  # the accumulator registers of row g + 8 (r % 2): e = 2 (r % 2) + {0, 1}
                values = [
                    _accumulator_value(p_rows, w, lane, n0, half_e),
                    _accumulator_value(p_rows, w, lane, n0, half_e + 1),
                    _accumulator_value(p_rows, w, lane, n0 + 1, half_e),
                    _accumulator_value(p_rows, w, lane, n0 + 1, half_e + 1),
                ]
                for j, value in enumerate(values):  # pack4_e4m3(x0, x1, x2, x3): x_j in byte j
                    a[(16 * w + g + 8 * (r % 2), 16 * (r // 2) + 4 * t + j)] = value
    return a


@pytest.mark.parametrize("seqlen_k", [32, 96, 77])
def test_p_times_the_transposed_values_is_p_v(seqlen_k):
    gen = torch.Generator().manual_seed(seqlen_k)
    head_dim = 16
    p = torch.rand(64, seqlen_k, generator=gen, dtype=torch.float64)
    v = torch.randn(1, seqlen_k, 1, head_dim, generator=gen, dtype=torch.float64)
    vt = transposed_values(v)[0, 0]  # (head_dim, keys rounded up to 16)
    keys = vt.shape[1]
    assert keys % 16 == 0 and keys >= seqlen_k
    steps = -(-keys // 32)
    p_pad = torch.zeros(64, 32 * steps, dtype=torch.float64)
    p_pad[:, :seqlen_k] = p
    vt_pad = torch.zeros(head_dim, 32 * steps, dtype=torch.float64)
    vt_pad[:, :keys] = vt
    o = torch.zeros(64, head_dim, dtype=torch.float64)
    for step in range(steps):
        a = _a_fragment(p_pad, step)
        assert len(a) == 64 * 32  # every element of the 64 x 32 A operand, once
        for (m, k), value in a.items():
            # B (32 x head_dim) K-major: column n of B is row n of V^T's tile, its k-th key position.
            o[m] += value * vt_pad[:, 32 * step + k]
    expected = p @ v[0, :, 0]
    assert torch.allclose(o, expected, rtol=1e-12, atol=1e-12)


def test_a_wrong_order_breaks_the_sum():
    """The check above can fail: V^T in the natural key order gives another product."""
    gen = torch.Generator().manual_seed(5)
    p = torch.rand(64, 32, generator=gen, dtype=torch.float64)
    v = torch.randn(32, 16, generator=gen, dtype=torch.float64)
    a = _a_fragment(p, 0)
    o = torch.zeros(64, 16, dtype=torch.float64)
    for (m, k), value in a.items():
        o[m] += value * v[k]  # natural order: position k holds key k
    assert not torch.allclose(o, p @ v)


def test_e4m3_values_move_byte_for_byte_and_padding_is_zero():
    gen = torch.Generator().manual_seed(3)
    v = (torch.randn(2, 21, 3, 32, generator=gen) * 4).to(torch.float8_e4m3fn)
    vt = transposed_values(v)
    assert vt.dtype is torch.float8_e4m3fn and vt.shape == (2, 3, 32, 32) and vt.is_contiguous()
    as_bytes = vt.view(torch.uint8)
    for key in range(32):
        group, position = divmod(key, 16)
        source = 16 * group + KEY_ORDER_16[position]
        if source < 21:
            assert torch.equal(as_bytes[:, :, :, key], v.view(torch.uint8)[:, source])
        else:
            assert not as_bytes[:, :, :, key].any()


def test_v_must_be_4_d():
    with pytest.raises(ValueError, match="v must be 4-D"):
        transposed_values(torch.zeros(3, 4, 5))
