"""The e4m3 forward's error bound (tests/fp8_bounds.py) against a float64 model of the kernel's rounding: P
rounded to e4m3 stays inside it, on inputs spread over e4m3's range as the GPU test's are. And it is not so
wide that the fault it is there to catch passes: V's keys out of order within a 16-key group (the layout
ops.fp8_values builds) leave it. (It is a worst case, not an estimate: P truncated to e4m3's 3 bits instead
of rounded, a biased fault of twice the rounding's size, stays inside it on these inputs.)"""

from __future__ import annotations

import math

import pytest
import torch
from fp8_bounds import e4m3_output_bound, p_rounded_to

E4M3 = torch.float8_e4m3fn


def _inputs(seed, b, sq, sk, h):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        (torch.randn(b, s, h, 128, generator=gen) * c).clamp(-448, 448).to(E4M3).double() * d
        for s, c, d in ((sq, 30.0, 0.02), (sk, 60.0, 0.011), (sk, 2.0, 0.7))
    )
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 64, 200, 2), (1, 300, 300, 2), (1, 1, 77, 3)])
def test_p_rounded_to_e4m3_stays_inside_the_bound(shape, causal):
    q, k, v = _inputs(sum(shape) + causal, *shape)
    bound, ref = e4m3_output_bound(q, k, v, causal, 1 / math.sqrt(128))
    model = p_rounded_to(E4M3, q, k, v, causal, 1 / math.sqrt(128))
    assert ((model - ref).abs() <= bound).all()
    assert ((model - ref).abs() > 0).any()  # (the model rounds something)


def test_keys_out_of_order_leave_the_bound():
    q, k, v = _inputs(8, 2, 300, 300, 2)
    scale = 1 / math.sqrt(128)
    bound, ref = e4m3_output_bound(q, k, v, True, scale)
    swapped = v.clone()  # keys 0 and 1 of every 16-key group exchanged
    swapped[:, 0::16], swapped[:, 1::16] = v[:, 1::16], v[:, 0::16]
    assert ((p_rounded_to(E4M3, q, k, swapped, True, scale) - ref).abs() > bound).any()
