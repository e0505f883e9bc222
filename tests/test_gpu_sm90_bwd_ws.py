"""GPU tests of the warp-specialized Hopper backward (csrc/kernels/sm90/bwd_ws): gradients against float64
autograd on random shapes (odd lengths, seqlen_q above and below seqlen_k, GQA groups up to 8, a head_dim
below the compiled one, fp16 and bf16, causal and not), within twice the error of PyTorch's own
low-precision attention and 1.5x the error of the wgmma kernel it replaces, and bitwise agreement of the
atomic-free parts (dK, dV) between runs."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from flash_attention import ops
from flash_attention.configs import BwdConfig, hopper_bwd_config
from flash_attention.fallback.reference import attention_reference, causal_allowed

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the warp-specialized backward needs an sm_90 GPU")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ws_config(dtype: str, d: int, producer: str = "default") -> BwdConfig:
    """The warp-specialized kernel: its default (TMA with dQ's writer warps at 64 and 128), or a producer
    form that stays selectable: "tma" (TMA without the writer warps) or "copy" (the cp.async rows, which
    ops.backward falls back to for a layout no tensor map describes); "poly": the default with half of P's
    exponentials as a polynomial on the FMA pipe (exp_poly 4, kernel log 138)."""
    if producer == "poly":
        return hopper_bwd_config(dtype, d).replace(exp_poly=4)
    if producer == "tma":
        return hopper_bwd_config(dtype, d, tma_loads=True, dq_writer=False)
    if producer == "copy":
        return hopper_bwd_config(dtype, d, tma_loads=False)
    return hopper_bwd_config(dtype, d)


def wgmma_config(dtype: str, d: int) -> BwdConfig:
    return hopper_bwd_config(dtype, d, warp_specialized=False)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = [
    (2, 333, 517, 6, 2, 128),
    (1, 517, 129, 8, 1, 64),
    (2, 1, 300, 4, 4, 128),
    (1, 200, 200, 3, 3, 100),
    (1, 1100, 700, 8, 8, 64),
    (3, 64, 65, 2, 1, 128),
]


def _torch_lowp_grads(q, k, v, do, causal):
    """PyTorch's math attention in the inputs' precision: the error scale the accuracy rule allows."""
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    mask = causal_allowed(q.shape[1], k.shape[1], device=q.device) if causal else None
    # The math backend upcasts 16-bit inputs to fp32 unless told to compute in their precision, as every
    # fused kernel does (P and dS rounded to 16 bits before their matrix products).
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=mask)
        grads = torch.autograd.grad(out, leaves, do.transpose(1, 2))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
    return [g.transpose(1, 2) for g in grads]


@needs_hopper
@pytest.mark.parametrize("producer", ["default", "tma", "copy", "poly"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ws_backward_against_float64(shape, causal, dtype, producer):
    b, sq, sk, hq, hkv, d = shape
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, causal, dtype)).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dt) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)
    scale = d**-0.5
    o, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)
    dpad = 64 if d <= 64 else 128
    got = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=ws_config(dtype, dpad, producer)
    )
    old = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=wgmma_config(dtype, dpad)
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
            f"{name}: {err:.3g} vs PyTorch's {err_torch:.3g} (wgmma kernel {err_old:.3g})"
        )
        assert err <= 1.5 * err_old + 1e-4, f"{name}: {err:.3g} vs the wgmma kernel's {err_old:.3g}"


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_causal_blocks_in_heaviest_first_groups_compute_the_same(d, monkeypatch):
    # Causal dK/dV blocks start heaviest first within groups of (K/V head, batch row) pairs
    # (fa/kv_block_order.cuh): with groups of two out of 3 x 3 pairs (the last group holding one), every
    # block is computed once, so dK and dV are bitwise those of one group over all pairs (no atomics in
    # them), dQ within the atomics' reordering, and all three against float64.
    from flash_attention.ops import backward

    monkeypatch.setenv("FLASH_ATTENTION_CAUSAL_ORDER", "1")  # (off by default: kernel log 123)
    b, sq, sk, hq, hkv = 3, 700, 650, 6, 3
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(("kv-order", d)).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").bfloat16() for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").bfloat16()
    scale = d**-0.5
    o, lse = ops.cuda_forward(q, k, v, causal=True, softmax_scale=scale, return_lse=True, out=None)
    assert backward.kv_block_group(b * hkv, sq, d, hq // hkv) == b * hkv  # one group: every pair at once
    whole = ops.cuda_backward(do, q, k, v, o, lse, causal=True, softmax_scale=scale)
    per_pair = 4 * sq * d * (hq // hkv)
    monkeypatch.setattr(backward, "KV_BLOCK_GROUP_L2_BYTES", 2 * per_pair)
    assert backward.kv_block_group(b * hkv, sq, d, hq // hkv) == 2
    ops.clear_plans()  # (the plan holds the group)
    try:
        grouped = ops.cuda_backward(do, q, k, v, o, lse, causal=True, softmax_scale=scale)
    finally:
        ops.clear_plans()
    assert torch.equal(grouped[1], whole[1]) and torch.equal(grouped[2], whole[2])
    torch.testing.assert_close(grouped[0], whole[0], rtol=1e-2, atol=1e-2)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_o, _ = attention_reference(*leaves, causal=True)
    ref = torch.autograd.grad(ref_o, leaves, do.double())
    for name, got, r in zip(("dq", "dk", "dv"), grouped, ref, strict=True):
        err = (got.double() - r).abs().max().item()
        assert err < 0.05 * (1 + r.abs().max().item()), f"{name}: {err:.3g}"


@needs_hopper
def test_ws_backward_dk_dv_repeat_bitwise():
    """dK and dV are summed in registers in a fixed order (no atomics): identical over runs."""
    q = torch.randn(2, 777, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 555, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = ops.cuda_forward(q, k, v, causal=True, softmax_scale=0.1, return_lse=True, out=None)
    runs = [
        ops.cuda_backward(do, q, k, v, o, lse, causal=True, softmax_scale=0.1, config=ws_config("bf16", 128))
        for _ in range(3)
    ]
    for r in runs[1:]:
        assert torch.equal(r[1], runs[0][1]) and torch.equal(r[2], runs[0][2])
        torch.testing.assert_close(r[0], runs[0][0], rtol=0, atol=2e-2)  # dQ: atomic order varies


@needs_hopper
def test_ws_backward_strided_inputs():
    """Inputs that are views with a row stride wider than heads * head_dim (a fused QKV projection)."""
    qkv = torch.randn(2, 300, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    do = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    o, lse = ops.cuda_forward(q, k, v, causal=False, softmax_scale=0.09, return_lse=True, out=None)
    got = ops.cuda_backward(
        do, q, k, v, o, lse, causal=False, softmax_scale=0.09, config=ws_config("bf16", 128)
    )
    want = ops.cuda_backward(
        do, q, k, v, o, lse, causal=False, softmax_scale=0.09, config=wgmma_config("bf16", 128)
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_backward_key_range(d, causal):
    check_key_range_backward(d, causal, ws_config("bf16", d))


def check_key_range_backward(d, causal, config):
    """The key-range build of ``config``: batch rows with a range on both sides, one with no key at all (zero
    gradients, never NaN), one with the whole row; against float64 autograd and the portable kernel's
    error."""
    from flash_attention.configs import default_bwd_config

    gen = torch.Generator(device="cuda").manual_seed(31 * d + causal)
    b, sq, sk, hq, hkv = 4, 300, 517, 4, 2
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    kr = torch.tensor([[40, 333], [0, 0], [0, sk], [200, 517]], dtype=torch.int32, device="cuda")
    o, lse = ops.cuda_forward(
        q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=None, key_range=kr
    )
    got = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5, key_range=kr, config=config
    )
    portable = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5, key_range=kr,
        config=default_bwd_config("bf16", d),
    )  # fmt: skip
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_o, _ = attention_reference(*leaves, causal=causal, key_range=kr)
    ref = torch.autograd.grad(ref_o, leaves, do.double())
    for name, a, p_, r in zip(("dq", "dk", "dv"), got, portable, ref, strict=True):
        assert torch.isfinite(a).all(), name
        err, err_p = (a.double() - r).abs().max().item(), (p_.double() - r).abs().max().item()
        assert err <= 1.5 * err_p + 1e-4, f"{name}: {err:.3g} vs the portable kernel's {err_p:.3g}"
    assert (got[0][1] == 0).all()  # batch row 1 sees no key: no gradient reaches its queries
    assert (got[1][1] == 0).all() and (got[2][1] == 0).all()
    assert (got[1][0, :40] == 0).all() and (got[1][0, 333:] == 0).all()  # keys outside the range


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_backward_dropout(d, causal):
    """The dropout build regenerates the forward's keep mask: gradients against float64 autograd through
    the explicit masked attention (the mask from flash_attention.dropout.keep_mask), within 1.5x the portable
    kernel's error on the same call; and a dropped run differs from an undropped one."""
    from test_gpu_dropout import _explicit

    from flash_attention.configs import default_bwd_config
    from flash_attention.dropout import draw_seed, keep_mask

    p_drop, seed = 0.3, 4321 + d + causal
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, sq, sk, hq, hkv = 2, 333, 301, 4, 2
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    dseed = draw_seed(seed)
    kw = dict(causal=causal, softmax_scale=d**-0.5, dropout_p=p_drop, dropout_seed=dseed)
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
    got = ops.cuda_backward(do, q, k, v, o, lse, config=ws_config("bf16", d), **kw)
    portable = ops.cuda_backward(do, q, k, v, o, lse, config=default_bwd_config("bf16", d), **kw)
    keep = keep_mask(seed, 0, p_drop, b, hq, sq, sk, device="cuda")
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(_explicit(*leaves, causal, keep, p_drop), leaves, do.double())
    for name, a, p_, r in zip(("dq", "dk", "dv"), got, portable, ref, strict=True):
        assert torch.isfinite(a).all(), name
        err, err_p = (a.double() - r).abs().max().item(), (p_.double() - r).abs().max().item()
        assert err <= 1.5 * err_p + 1e-4, f"{name}: {err:.3g} vs the portable kernel's {err_p:.3g}"


_DET_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, key_range, dropout_p)
    (2, 777, 555, 8, 2, 128, True, False, 0.0),
    (1, 1100, 1100, 4, 4, 128, False, False, 0.0),
    (3, 300, 517, 6, 3, 64, True, True, 0.0),
    (2, 640, 640, 4, 1, 64, False, False, 0.2),
    (1, 1000, 900, 8, 8, 128, True, True, 0.1),
    # One query block, 16 key blocks: every block's turn in the same step (a chain of 16)
    (1, 64, 2000, 8, 1, 128, False, False, 0.0),
    # More query blocks than key blocks, wrapped walks (lane 1), key ranges and a group of 2
    (2, 1500, 200, 4, 2, 64, False, True, 0.0),
    (1, 1, 700, 4, 4, 128, True, False, 0.0),
    (2, 900, 1300, 16, 2, 128, False, False, 0.0),
]


@needs_hopper
@pytest.mark.parametrize("case", _DET_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_deterministic_bitwise_and_accurate(case):
    """deterministic=True on the ws kernel: dQ's reductions take turns in a fixed order, so ten runs give
    the same bits (dq included); and the gradients are as accurate as the atomic mode's."""
    check_deterministic_backward(case, ws_config("bf16", case[5]))


def check_deterministic_backward(case, cfg):
    """Ten deterministic backward calls of ``case`` on ``cfg`` give the same bits, within a few roundings
    of the atomic mode's gradients and (without dropout) as close to float64 autograd as they are."""
    from flash_attention.dropout import draw_seed

    b, sq, sk, hq, hkv, d, causal, ranged, p_drop = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    kr = None
    if ranged:
        starts = torch.randint(0, sk // 3, (b,), generator=gen, device="cuda")
        ends = torch.randint(sk // 2, sk + 1, (b,), generator=gen, device="cuda")
        kr = torch.stack([starts, ends], 1).to(torch.int32)
    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=kr, dropout_p=p_drop)
    if p_drop:
        kw["dropout_seed"] = draw_seed(99)
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
    runs = [ops.cuda_backward(do, q, k, v, o, lse, deterministic=True, config=cfg, **kw) for _ in range(10)]
    for r in runs[1:]:
        for name, a, b_ in zip(("dq", "dk", "dv"), runs[0], r, strict=True):
            assert torch.equal(a, b_), f"{name} differs between deterministic runs"
    atomic = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, **kw)
    for name, a, b_ in zip(("dq", "dk", "dv"), runs[0], atomic, strict=True):
        assert torch.isfinite(a).all(), name
        # The same products summed in another order: within a few roundings of each other.
        torch.testing.assert_close(a.float(), b_.float(), rtol=0, atol=2e-2, msg=name)
    if not p_drop:
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref_o, _ = attention_reference(*leaves, causal=causal, key_range=kr)
        ref = torch.autograd.grad(ref_o, leaves, do.double())
        for name, a, b_, r in zip(("dq", "dk", "dv"), runs[0], atomic, ref, strict=True):
            err, err_a = (a.double() - r).abs().max().item(), (b_.double() - r).abs().max().item()
            assert err <= 1.5 * err_a + 1e-4, f"{name}: {err:.3g} vs the atomic mode's {err_a:.3g}"
