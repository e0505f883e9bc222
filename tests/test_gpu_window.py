"""GPU tests of the sliding window (``window=(left, right)``, csrc/include/fa WindowMask) in every kernel
family that has it, forward and backward: outputs and gradients against float64
(flash_attention.fallback.reference)
within twice the error of PyTorch's own low-precision attention under the same mask, on random shapes
(seqlen_q above and below seqlen_k, one query, GQA, head dims 64/128/192/256 and one padded up to 128,
windows with either side unbounded, one key per row, combined with causal and key ranges); the
deterministic backward bitwise between runs; dropout under a window the same on the Hopper kernels as on
the portable ones; rows whose window holds no key give zeros, never NaN."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from flash_attention import ops
from flash_attention.configs import default_bwd_config, hopper_bwd_config, padded_head_dim, portable_config
from flash_attention.configs.heuristics import classic_hopper_config
from flash_attention.fallback.reference import (
    attention_reference,
    causal_allowed,
    key_range_allowed,
    window_allowed,
)

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_hopper = pytest.mark.skipif(not _hopper(), reason="the wgmma kernels need an sm_90 GPU")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, key_range)
CASES = [
    (2, 333, 517, 4, 2, 64, False, (100, 50), False),
    # Causal with a left bound; more queries than keys (the first rows see nothing)
    (2, 517, 333, 4, 4, 128, True, (64, -1), False),
    (1, 700, 700, 8, 2, 128, False, (128, 0), False),
    (2, 400, 600, 4, 1, 256, False, (200, 17), True),
    (1, 300, 300, 2, 2, 72, True, (31, 5), False),
    # One key per row (the diagonal)
    (1, 1000, 1000, 4, 4, 192, False, (0, 0), False),
    (2, 1, 700, 4, 4, 128, False, (256, -1), False),
    # Only a right bound
    (1, 450, 450, 4, 2, 64, False, (-1, 40), True),
]


def _ids(case):
    return "-".join(str(x).replace(" ", "") for x in case)


def _inputs(case, dtype=torch.bfloat16):
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    kr = None
    if ranged:
        starts = torch.randint(0, sk // 3, (b,), generator=gen, device="cuda")
        ends = torch.randint(sk // 2, sk + 1, (b,), generator=gen, device="cuda")
        kr = torch.stack([starts, ends], 1).to(torch.int32)
    return q, k, v, do, kr


def _allowed(case, kr):
    """(batch, 1, seqlen_q, seqlen_k) boolean mask of the case (the reference's own helpers)."""
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    allowed = window_allowed(sq, sk, window, device="cuda")
    if causal:
        allowed = allowed & causal_allowed(sq, sk, device="cuda")
    allowed = allowed[None, None].expand(b, 1, sq, sk)
    if kr is not None:
        allowed = allowed & key_range_allowed(kr, sk)[:, None, None, :]
    return allowed


def _torch_lowp(q, k, v, do, allowed):
    """PyTorch's math attention in the inputs' precision under the same mask (rows with no key: zeros),
    output and gradients: the error scale the accuracy rule allows."""
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=allowed)
        out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)
        grads = torch.autograd.grad(out, leaves, do.transpose(1, 2))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
    return out.transpose(1, 2), [g.nan_to_num().transpose(1, 2) for g in grads]


def _reference(case, q, k, v, do, kr):
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_o, ref_lse = attention_reference(*leaves, causal=causal, window=window, key_range=kr)
    ref_grads = torch.autograd.grad(ref_o, leaves, do.double())
    return ref_o.detach(), ref_lse, ref_grads


def _forward_configs(case):
    """The default (on Hopper the warp-specialized kernel), the portable kernel and the sm90 wgmma one."""
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    cfgs = {"default": None, "portable": portable_config("bf16", d, causal, sq, sk)}
    if _hopper():
        cfgs["sm90"] = classic_hopper_config("bf16", padded_head_dim(d), max(sq, sk), causal)
    return cfgs


def _close(got, ref, lowp, name, slack=1e-3):
    err = (got.double() - ref).abs().max().item()
    err_t = (lowp.double() - ref).abs().max().item()
    assert err <= 2 * err_t + slack, f"{name}: {err:.3g} vs PyTorch's low precision {err_t:.3g}"


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_window_forward_every_family_against_float64(case):
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    q, k, v, do, kr = _inputs(case)
    ref_o, ref_lse, _ = _reference(case, q, k, v, do, kr)
    allowed = _allowed(case, kr)
    lowp_o, _ = _torch_lowp(q, k, v, do, allowed)
    seen = allowed.any(-1)[:, 0]  # (batch, seqlen_q): rows with some key
    for name, cfg in _forward_configs(case).items():
        out = torch.full_like(q, float("nan"))
        o, lse = ops.cuda_forward(
            q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=out, config=cfg,
            key_range=kr, window=window,
        )  # fmt: skip
        assert torch.isfinite(o).all(), name
        _close(o, ref_o, lowp_o, f"{name} out")
        # The LSE of rows with keys; -inf for rows without (their output is 0).
        lse_ok = seen[:, None, :].expand_as(lse)
        torch.testing.assert_close(lse[lse_ok].double(), ref_lse[lse_ok], rtol=0, atol=2e-3, msg=name)
        assert (lse[~lse_ok] == float("-inf")).all(), name
        assert (o.transpose(1, 2)[~lse_ok] == 0).all(), name


def _backward_configs(case):
    d = padded_head_dim(case[5])
    cfgs = {"portable": default_bwd_config("bf16", d, "sm_80", portable=True)}
    if _hopper():
        cfgs["hopper"] = hopper_bwd_config("bf16", d)  # warp-specialized (bwd_ws, or the wide form above 128)
        if d == 192:  # and its other key block (the default's 96, kernel log 140)
            cfgs["hopper_kv64"] = hopper_bwd_config("bf16", d).replace(block_kv=64)
    return cfgs


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_window_backward_every_family_against_float64(case):
    b, sq, sk, hq, hkv, d, causal, window, ranged = case
    q, k, v, do, kr = _inputs(case)
    _, _, ref = _reference(case, q, k, v, do, kr)
    _, lowp = _torch_lowp(q, k, v, do, _allowed(case, kr))
    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=kr, window=window)
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
    for name, cfg in _backward_configs(case).items():
        for det in (False, True):
            got = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, deterministic=det, **kw)
            for gname, a, r, t in zip(("dq", "dk", "dv"), got, ref, lowp, strict=True):
                assert torch.isfinite(a).all(), f"{name} det={det} {gname}"
                _close(a, r, t, f"{name} det={det} {gname}")
            if det:
                again = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, deterministic=True, **kw)
                for gname, a, a2 in zip(("dq", "dk", "dv"), got, again, strict=True):
                    assert torch.equal(a, a2), f"{name}: deterministic {gname} differs between runs"


@needs_hopper
@pytest.mark.parametrize("d", [128, 256])
def test_window_dropout_matches_the_portable_kernels(d):
    """Dropout under a window: the Hopper kernels drop the same elements as the portable ones (the same
    hash of (seed, batch, head, query, key)), so their outputs and gradients agree within rounding."""
    from flash_attention.dropout import draw_seed

    case = (2, 300, 400, 4, 2, d, True, (90, 0), False)
    q, k, v, do, _ = _inputs(case)
    kw = dict(causal=True, softmax_scale=d**-0.5, window=(90, 0), dropout_p=0.2, dropout_seed=draw_seed(5))
    o_h, lse_h = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
    o_p, lse_p = ops.cuda_forward(
        q, k, v, return_lse=True, out=None, config=portable_config("bf16", d, True, 300, 400), **kw
    )
    torch.testing.assert_close(o_h, o_p, rtol=0, atol=2e-2)
    g_h = ops.cuda_backward(do, q, k, v, o_h, lse_h, config=hopper_bwd_config("bf16", d), **kw)
    g_p = ops.cuda_backward(
        do, q, k, v, o_h, lse_h, config=default_bwd_config("bf16", d, "sm_80", portable=True), **kw
    )
    for name, a, b_ in zip(("dq", "dk", "dv"), g_h, g_p, strict=True):
        torch.testing.assert_close(a.float(), b_.float(), rtol=0, atol=3e-2, msg=name)


@needs_cuda
def test_window_that_bounds_nothing_runs_the_plain_build():
    """(-1, -1), and (-1, 0) with causal, are the plain and causal masks: the same bits as without a
    window (plans.window_bounds routes them to those builds)."""
    q, k, v, do, _ = _inputs((1, 200, 300, 2, 2, 64, False, (-1, -1), False))
    for causal, window in ((False, (-1, -1)), (True, (-1, 0)), (True, (-1, 5))):
        kw = dict(causal=causal, softmax_scale=0.125, return_lse=True, out=None)
        a = ops.cuda_forward(q, k, v, window=window, **kw)
        b_ = ops.cuda_forward(q, k, v, **kw)
        assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])


@needs_cuda
def test_attention_window_trains_on_the_kernels_eager_and_compiled():
    """attention(window=) in training: the eager autograd node and torch.compile's graph (the custom ops,
    whose schemas carry the window) run the window kernels: the same bits as the launch layer's
    deterministic forward and backward."""
    import flash_attention as fa

    case = (2, 300, 400, 4, 2, 128, True, (90, 0), False)
    q, k, v, do, _ = _inputs(case)
    sc = 128**-0.5
    o_ref, lse = ops.cuda_forward(
        q, k, v, causal=True, softmax_scale=sc, return_lse=True, out=None, window=(90, 0)
    )
    g_ref = ops.cuda_backward(
        do, q, k, v, o_ref, lse, causal=True, softmax_scale=sc, window=(90, 0), deterministic=True
    )

    def step(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, do)

    def call(a, b, c):
        return fa.attention(a, b, c, causal=True, window=(90, 0), deterministic=True)

    for name, fn in (("eager", call), ("compiled", torch.compile(call, fullgraph=True))):
        out, grads = step(fn)
        assert torch.equal(out, o_ref), name
        for gname, a, r in zip(("dq", "dk", "dv"), grads, g_ref, strict=True):
            assert torch.equal(a, r), f"{name} {gname}"


@needs_cuda
def test_flash_attention_layer_window_on_the_kernels():
    """nn.FlashAttention(window=) in bf16 on CUDA (plain and padded: attention(window=) with key ranges)
    against its own weights route in float64."""
    from flash_attention.nn import FlashAttention

    torch.manual_seed(1)
    layer = FlashAttention(256, 4, num_kv_heads=2, causal=True, window=(40, 0), device="cuda")
    x = torch.randn(2, 300, 256, device="cuda")
    pad = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    pad[0, :17] = True
    for mask in (None, pad):
        ref, _ = layer.double()(x.double(), x.double(), x.double(), key_padding_mask=mask, need_weights=True)
        out, _ = layer.to(torch.bfloat16)(*(x.to(torch.bfloat16),) * 3, key_padding_mask=mask)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
        layer.float()
