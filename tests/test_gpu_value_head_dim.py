"""GPU tests of v with its own head_dim (issue 51): attention() and attention_varlen() on CUDA tensors whose v
has another head_dim than q and k (DeepSeek's 192/128, and 128/64) run our kernels both ways -- the
warp-specialized forward reads v's head_dim, the backward runs q's head_dim's kernels on v, the output and
dO zero-padded to it (ops.cuda_backward) -- with no fallback warning, and their output, LSE and gradients
agree with float64 within a multiple of the error of the same computation in float32 rounded to the inputs'
precision: twice for the output and the LSE (plus float32's rounding), four times for the gradients, whose
P and dS the backward rounds to 16 bits; variants included."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

import flash_attention
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal, dtype, variant)
CASES = [
    (2, 333, 517, 8, 8, 192, 128, True, torch.bfloat16, {}),
    (1, 300, 300, 8, 2, 128, 64, False, torch.float16, {}),
    (1, 400, 400, 4, 4, 192, 128, True, torch.bfloat16, {"window": (100, 0)}),
    (1, 257, 257, 4, 2, 128, 64, False, torch.bfloat16, {"softcap": 20.0}),
    (1, 257, 300, 4, 4, 192, 128, True, torch.bfloat16, {"sinks": True}),
]


def _bf16_inputs(gen, b, sq, sk, hq, hkv, d, dv):
    """Fresh bf16 q, k (head_dim d), v and dO (v's head_dim dv) on the GPU, drawn in that order from gen."""
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv))
    return [torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16) for shape in shapes]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:-1])) + "-" + "-".join(c[-1]))
def test_v_head_dim_on_cuda_runs_the_kernels_and_matches_float64(case, monkeypatch):
    b, sq, sk, hq, hkv, d, dv, causal, dtype, variant = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, dv, generator=gen, device="cuda").to(dtype).requires_grad_()
    do = torch.randn(b, sq, hq, dv, generator=gen, device="cuda").to(dtype)
    variant = dict(variant)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(hq, generator=gen, device="cuda")
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a fallback warns: none may run)
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, **variant)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype

    def run(compute):
        leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
        kw = {n: (t.double() if n == "sinks" else t) for n, t in variant.items()}
        o, row_lse = attention_reference(*leaves, causal=causal, compute_dtype=compute, **kw)
        return (o, row_lse, *torch.autograd.grad(o, leaves, do.to(compute)))

    # Against float64, within a multiple of the error of the same computation in float32 rounded to the
    # inputs' precision (`near`): twice it for the output (the forward's rule), twice float32's for the LSE
    # plus float32's own rounding at its magnitude, and four times it for the gradients: the backward's P
    # and dS are 16-bit operands of its products (the fallback's were float32), and the d192 kernels' dQ
    # measured up to 3.4 times it on an H200 (window 192/128: 0.0131 against 0.0039).
    exact = run(torch.float64)
    own = [t.to(dtype).double() if i != 1 else t.double() for i, t in enumerate(run(torch.float32))]
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, got, want, near in zip(names, [out, lse, *grads], exact, own, strict=True):
        err = (got.double() - want).abs().max().item()
        factor = 2 if name in ("out", "lse") else 4
        bound = factor * (near - want).abs().max().item() + 1e-6
        if name == "lse":
            bound += 2 * 2.0**-23 * want.abs().max().item()
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def test_varlen_v_head_dim_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(7)
    lengths = [100, 1, 257, 64]
    total = sum(lengths)
    q = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(total, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no fallback)
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    assert out.shape == (total, 8, 128)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want, _ = attention_reference(*(t[a:e].unsqueeze(0) for t in (q, k, v)), causal=True)
        assert (out[a:e].double() - want[0]).abs().max().item() < 2e-2


@pytest.mark.parametrize(
    "variant",
    [{"dropout_p": 0.2}, {"alibi": True}, {"sinks": True}, {"deterministic": True}, {"window": (64, 64)}],
    ids=["dropout", "alibi", "sinks-grad", "deterministic", "window"],
)
def test_v_head_dim_backward_is_the_kernels_on_an_explicitly_padded_v(variant):
    # The backward of a v narrower than q is q's head_dim's kernels on v, out and dO zero-padded: against the
    # same call made with v padded by the caller (the equal-dims kernels both ways; dropout's mask is the
    # same from the same seed, whatever the head_dim), every gradient agrees within the outputs' bf16
    # rounding (the two forwards are different builds: the value_dim one and q's head_dim's), and the
    # padded dV columns the caller's call returns are zero.
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(variant).encode()))
    b, s, hq, hkv, d, dv = 2, 300, 4, 2, 128, 64
    q, k, v, do = _bf16_inputs(gen, b, s, s, hq, hkv, d, dv)
    kw = dict(variant)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, generator=gen, device="cuda")
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=gen, device="cuda")
    if "dropout_p" in kw:
        kw["dropout_seed"] = 1234

    def grads(v_in, do_in):
        leaves = [t.clone().requires_grad_() for t in (q, k, v_in)]
        extra = [kw["sinks"].clone().requires_grad_()] if "sinks" in kw else []
        call = dict(kw, sinks=extra[0]) if extra else kw
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no fallback)
            out = flash_attention.attention(*leaves, causal=True, **call)
        return (out, *torch.autograd.grad(out, leaves + extra, do_in))

    got = grads(v, do)
    want = grads(torch.nn.functional.pad(v, (0, d - dv)), torch.nn.functional.pad(do, (0, d - dv)))
    assert not want[3][..., dv:].any()  # (the caller's zero columns get a zero gradient)
    want = (want[0][..., :dv], want[1], want[2], want[3][..., :dv], *want[4:])
    for name, a, e in zip(["out", "dq", "dk", "dv", "dsinks"], got, want, strict=False):
        scale = max(1.0, e.abs().max().item())
        assert (a.float() - e.float()).abs().max().item() <= 2e-2 * scale, name


def test_varlen_v_head_dim_trains_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(9)
    lengths = [100, 1, 257, 64]
    total = sum(lengths)
    q = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    k = torch.randn(total, 8, 192, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    v = torch.randn(total, 8, 128, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no fallback)
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
        dout = torch.randn(out.shape, generator=gen, device="cuda").to(torch.bfloat16)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        leaves = [t[a:e].detach().double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        want_out, _ = attention_reference(*leaves, causal=True)
        want = torch.autograd.grad(want_out, leaves, dout[a:e].double().unsqueeze(0))
        for g, r in zip(grads, want, strict=True):
            assert (g[a:e].double() - r[0]).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim_v, causal, variant): q and k at head_dim 192
NATIVE_CASES = [
    (2, 333, 517, 8, 2, 128, True, {}),
    (1, 300, 300, 4, 4, 64, False, {"window": (64, 0)}),
    (2, 129, 700, 4, 1, 128, False, {"softcap": 20.0, "alibi": True}),
    (1, 1, 300, 4, 2, 128, True, {}),
]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("form", ["tma", "copy", "kv96"])
@pytest.mark.parametrize(
    "case", NATIVE_CASES, ids=lambda c: "-".join(map(str, c[:-1])) + "-" + "-".join(c[-1])
)
def test_native_value_dim_backward_against_float64(case, form):
    """The warp-specialized wide backward reading v's own head_dim (BwdConfig.head_dim_v; no padded copies;
    docs/value-head-dim-study.md section 7), in its producer forms and on 96-key blocks: gradients against
    float64 autograd within four times the float32-rounded computation's error, and within 1.5x the padded
    path's (q's head_dim's kernels on v, out and dO zero-padded), with dQ, dK and dV of their own shapes."""
    from flash_attention import ops
    from flash_attention.configs import hopper_bwd_config

    b, sq, sk, hq, hkv, dv, causal, variant = case
    d = 192
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, form)).encode()))
    q, k, v, do = _bf16_inputs(gen, b, sq, sk, hq, hkv, d, dv)
    kw = dict(variant)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, generator=gen, device="cuda")
    cfg = hopper_bwd_config("bf16", d, tma_loads=form != "copy").replace(
        head_dim_v=dv, block_kv=96 if form == "kv96" else 64
    )
    scale = d**-0.5
    o, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None, **kw)
    got = ops.cuda_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=cfg, **kw)
    padded = ops.cuda_backward(  # (a config reading one head_dim: v, the output and dO padded to it)
        do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=hopper_bwd_config("bf16", d), **kw
    )
    ref_kw = {"softcap": kw.get("softcap", 0.0), "window": kw.get("window")}

    def grads(compute):
        leaves = [t.to(compute).requires_grad_() for t in (q, k, v)]
        slopes = kw.get("alibi_slopes")
        ref_o, _ = attention_reference(
            *leaves, causal=causal, softmax_scale=scale, compute_dtype=compute, **ref_kw,
            **({"alibi_slopes": slopes.to(compute)} if slopes is not None else {}),
        )  # fmt: skip
        return torch.autograd.grad(ref_o, leaves, do.to(compute))

    exact, f32 = grads(torch.float64), grads(torch.float32)
    for name, a, p, e, f in zip(("dq", "dk", "dv"), got, padded, exact, f32, strict=True):
        assert a.shape == e.shape and a.dtype == torch.bfloat16 and torch.isfinite(a).all(), name
        err = (a.double() - e).abs().max().item()
        near = (f.to(torch.bfloat16).double() - e).abs().max().item()
        err_padded = (p.double() - e).abs().max().item()
        assert err <= 4 * near + 1e-6, f"{name}: {err:.3g} > 4 x {near:.3g}"
        assert err <= 1.5 * err_padded + 1e-4, f"{name}: {err:.3g} against the padded path's {err_padded:.3g}"
