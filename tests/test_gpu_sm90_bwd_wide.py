"""GPU tests of the Hopper backward at head_dim 192 and 256 (csrc/kernels/sm90/bwd_wide: the two warpgroups on
one 64-key block, one keeping dV and the other dK; and csrc/kernels/sm90/bwd_wide_ws, the default at both):
gradients against float64 autograd on random shapes (odd lengths, seqlen_q above and below seqlen_k, one
query, GQA groups up to 8, head dims 192 and 256 and sizes zero-padded to them, fp16 and bf16, causal and not)
within twice the error of PyTorch's own low-precision attention and 1.5x the error of the portable (sm80)
backward it replaces there; dK and dV bitwise equal between runs; strided inputs; the key-range and dropout
builds."""

from __future__ import annotations

import zlib

import pytest
import torch
from test_gpu_sm90_bwd_ws import (
    DTYPES,
    _torch_lowp_grads,
    check_deterministic_backward,
    check_key_range_backward,
)

from flash_attention import ops
from flash_attention.configs import BwdConfig, default_bwd_config, hopper_bwd_config
from flash_attention.fallback.reference import attention_reference

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the wide wgmma backward needs an sm_90 GPU")


#: The forms under test: the wide kernel, the warp-specialized wide one (bwd_wide_ws; the default at 192 and
#: 256, kernel log 136) on 64-key blocks, and that one on 96-key blocks (head_dim 192 only, its default there
#: since kernel log 140).
FORMS = ["wide", "wide_ws", "wide_ws_kv96"]


def wide_config(dtype: str, d: int = 256, ws: bool | str = False) -> BwdConfig:
    """The wide kernel, or (``ws`` True or "wide_ws") the warp-specialized wide one on 64-key blocks, or
    ("wide_ws_kv96") that one on 96-key blocks, which only head_dim 192 (and the sizes padded to it) has: a
    test of a wider head_dim skips it."""
    form = {False: "wide", True: "wide_ws"}.get(ws, ws)
    padded = 192 if d <= 192 else 256
    cfg = hopper_bwd_config(dtype, padded, warp_specialized=form != "wide")
    if form == "wide_ws_kv96":
        if padded != 192:
            pytest.skip("96-key blocks are head_dim 192's")
        cfg = cfg.replace(block_kv=96)
    elif form == "wide_ws":
        cfg = cfg.replace(block_kv=64)
    return cfg


def portable_config(dtype: str, d: int = 256) -> BwdConfig:
    return default_bwd_config(dtype, 192 if d <= 192 else 256, "sm_90a", portable=True)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = [
    (2, 333, 517, 4, 2, 256),
    (1, 517, 129, 8, 1, 256),
    (2, 1, 300, 4, 4, 256),
    (1, 200, 200, 3, 3, 200),
    (1, 700, 650, 2, 2, 256),
    (3, 64, 65, 2, 1, 256),
    (2, 333, 517, 4, 2, 192),
    (1, 300, 300, 4, 1, 160),
    (2, 1, 129, 4, 4, 192),
]


@needs_hopper
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ws", FORMS)
def test_wide_backward_against_float64(shape, causal, dtype, ws):
    b, sq, sk, hq, hkv, d = shape
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(
        zlib.crc32(repr(("wide", shape, causal, dtype)).encode())
    )
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dt) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)
    scale = d**-0.5
    o, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)
    got = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=wide_config(dtype, d, ws)
    )
    old = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=portable_config(dtype, d)
    )
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_o, _ = attention_reference(*leaves, causal=causal)
    ref = torch.autograd.grad(ref_o, leaves, do.double())
    lowp = _torch_lowp_grads(q, k, v, do, causal)
    for name, a, b_, r, t in zip(("dq", "dk", "dv"), got, old, ref, lowp, strict=True):
        assert a.shape == r.shape and a.dtype == dt, name
        assert torch.isfinite(a).all(), name
        err = (a.double() - r).abs().max().item()
        err_old = (b_.double() - r).abs().max().item()
        err_torch = (t.double() - r).abs().max().item()
        assert err <= 2 * err_torch + 1e-3, (
            f"{name}: {err:.3g} vs PyTorch's {err_torch:.3g} (portable kernel {err_old:.3g})"
        )
        assert err <= 1.5 * err_old + 1e-4, f"{name}: {err:.3g} vs the portable kernel's {err_old:.3g}"


@needs_hopper
@pytest.mark.parametrize("ws", FORMS)
def test_wide_backward_dk_dv_repeat_bitwise(ws):
    """dK and dV are summed in registers in a fixed order (no atomics): identical over runs."""
    d = 192 if ws == "wide_ws_kv96" else 256
    q = torch.randn(2, 777, 8, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 555, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = ops.cuda_forward(q, k, v, causal=True, softmax_scale=0.07, return_lse=True, out=None)
    runs = [
        ops.cuda_backward(
            do, q, k, v, o, lse, causal=True, softmax_scale=0.07, config=wide_config("bf16", d, ws=ws)
        )
        for _ in range(3)
    ]
    for r in runs[1:]:
        assert torch.equal(r[1], runs[0][1]) and torch.equal(r[2], runs[0][2])
        torch.testing.assert_close(r[0], runs[0][0], rtol=0, atol=2e-2)  # dQ: atomic order varies


@needs_hopper
@pytest.mark.parametrize("ws", [False, True], ids=["wide", "wide_ws"])
def test_wide_backward_strided_inputs(ws):
    """Inputs that are views with a row stride wider than heads * head_dim (a fused QKV projection)."""
    qkv = torch.randn(2, 300, 3, 4, 256, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    do = torch.randn(2, 300, 4, 256, device="cuda", dtype=torch.bfloat16)
    o, lse = ops.cuda_forward(q, k, v, causal=False, softmax_scale=0.06, return_lse=True, out=None)
    got = ops.cuda_backward(
        do, q, k, v, o, lse, causal=False, softmax_scale=0.06, config=wide_config("bf16", ws=ws)
    )
    want = ops.cuda_backward(
        do, q, k, v, o, lse, causal=False, softmax_scale=0.06, config=portable_config("bf16")
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)


@needs_hopper
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ws", FORMS)
def test_wide_backward_key_range(d, causal, ws):
    check_key_range_backward(d, causal, wide_config("bf16", d, ws))


@needs_hopper
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_wide_backward_dropout(d, causal):
    """The dropout build (warpgroup 0 draws the keep mask and hands it to warpgroup 1 as P^T's sign): against
    float64 autograd through the same mask (flash_attention.dropout.keep_mask) and the portable kernel's
    error, which draws the mask itself."""
    from test_gpu_dropout import _explicit

    from flash_attention.dropout import draw_seed, keep_mask

    gen = torch.Generator(device="cuda").manual_seed(7 * d + causal)
    b, sq, sk, hq, hkv, p, seed = 2, 333, 517, 4, 2, 0.3, 9876 + d
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    drop = {"dropout_p": p, "dropout_seed": draw_seed(seed)}
    o, lse = ops.cuda_forward(
        q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=None, **drop
    )
    got, old = (
        ops.cuda_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5, config=cfg, **drop)
        for cfg in (wide_config("bf16", d), portable_config("bf16", d))
    )
    keep = keep_mask(seed, 0, p, b, hq, sq, sk, device="cuda")
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(_explicit(*leaves, causal, keep, p), leaves, do.double())
    for name, a, b_, r in zip(("dq", "dk", "dv"), got, old, ref, strict=True):
        assert torch.isfinite(a).all(), name
        err, err_old = (a.double() - r).abs().max().item(), (b_.double() - r).abs().max().item()
        assert err <= 1.5 * err_old + 1e-4, f"{name}: {err:.3g} vs the portable kernel's {err_old:.3g}"


_DET_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, key_range, dropout_p)
    (2, 333, 517, 4, 2, 256, True, False, 0.0),
    # Non-causal: wrapped walks (lane 1)
    (1, 700, 650, 2, 2, 256, False, False, 0.0),
    # More query blocks than key blocks, key ranges, a group of 2
    (2, 1500, 200, 4, 2, 192, False, True, 0.0),
    # One query block, 32 key blocks: every block's turn in the same step (a chain of 32)
    (1, 64, 2000, 8, 1, 256, False, False, 0.0),
    (2, 400, 380, 4, 1, 192, True, True, 0.1),
    (1, 1, 700, 4, 4, 256, True, False, 0.0),
    # A head_dim zero-padded to 192
    (1, 300, 300, 4, 1, 160, False, False, 0.0),
]


@needs_hopper
@pytest.mark.parametrize("case", _DET_CASES, ids=lambda c: "-".join(map(str, c)))
def test_wide_deterministic_bitwise_and_accurate(case):
    """deterministic=True on the wide kernel: its third warpgroup adds dQ in the order of fa/dq_turns.cuh,
    so ten runs give the same bits, as accurate as the atomic mode."""
    check_deterministic_backward(case, wide_config("bf16", case[5]))
