"""The FP8 calls' backward on a GPU (api.fp8_training; docs/fp8-study.md 4.2's first form): attention(q, k,
v, fp8=True) on Hopper runs the e4m3 forward kernel and the bf16 backward on the dequantized tensors, and
attention_fp8_backward does the same for e4m3 inputs. Each gradient element against float64 on the exactly
dequantized tensors, within twice PyTorch's own FP8-input practice's error (the dequantized bf16 tensors
through SDPA and its backward: the test suite's rule) plus the terms of the two roundings this backward adds
(tests/fp8_bounds.py e4m3_backward_terms: the e4m3 forward's output in delta, the bf16-rounded inputs'
P against the exact LSE)."""

from __future__ import annotations

import pytest
import torch
from fp8_bounds import assert_within_backward_bound

import flash_attention as fa
from flash_attention.ops.fp8_forward import E4M3_HEAD_DIMS, kernel_takes
from flash_attention.spec import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper GPU (sm_90): the e4m3 kernel",
    ),
]


def _inputs(seed, b, sq, sk, hq, hkv, d):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    return [
        (torch.randn(s, generator=gen) * c).to(torch.bfloat16).cuda()
        for s, c in zip(shapes, (2.0, 2.0, 1.0), strict=True)
    ]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_true_trains_on_the_e4m3_kernel(causal, head_dim):
    shape = (2, 300, 517, 8, 2, head_dim)
    q, k, v = _inputs(31 + causal, *shape)
    scale = head_dim**-0.5
    assert kernel_takes(q, k, v, scale=scale) == (head_dim in E4M3_HEAD_DIMS)  # (the route, asserted)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got, lse = fa.attention(*leaves, causal=causal, fp8=True, return_lse=True)
    e4m3, descales = zip(*(fp8.quantize(t, 2) for t in (q, k, v)), strict=True)
    want_out = fa.attention(
        *e4m3, causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2]
    )
    assert torch.equal(got, want_out)  # (the e4m3 call's output: the kernel ran)
    do = torch.randn(got.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    grads = torch.autograd.grad(got, leaves, do)
    assert_within_backward_bound(grads, e4m3, descales, do, got, lse, causal, scale)


def _per_tensor(t):
    """e4m3 t and its descale amax / 448 (one float32 number, not a power of two: the dequantized tensors
    the backward runs on are then rounded to bf16, the bound's row-factor term)."""
    d = (t.float().abs().amax() / fp8.E4M3_MAX).reshape(1)
    return (t.float() / d).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3), d


@pytest.mark.parametrize("descales", ["quantizer", "amax_448"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_fp8_backward_on_the_e4m3_kernels_output(causal, descales):
    q, k, v = _inputs(41 + causal, 1, 333, 333, 4, 4, 128)
    quantized = (
        (fp8.quantize(t, 4) for t in (q, k, v)) if descales == "quantizer" else map(_per_tensor, (q, k, v))
    )
    e4m3, descales = zip(*quantized, strict=True)
    names = dict(zip(("q_descale", "k_descale", "v_descale"), descales, strict=True))
    out, lse = fa.attention(*e4m3, causal=causal, return_lse=True, **names)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    grads = fa.attention_fp8_backward(do, *e4m3, out, lse, causal=causal, **names)
    assert_within_backward_bound(grads, e4m3, descales, do, out, lse, causal, 128**-0.5)
