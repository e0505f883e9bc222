"""GPU tests of attention sinks (``sinks=``, flash_attention.sinks): attention() forward and gradients (the
sinks' own included) on the kernels, alone and with causal, GQA, key ranges, a sliding window,
soft-capping, deterministic mode and dropout, in fp16 and bf16 at head dims 64/128/256 and 72; the
KV-cache call on the decode kernels (contiguous and paged); ``torch.compile(fullgraph=True)``. Against
float64 (flash_attention.fallback.reference, whose sinks are an extra softmax column) within a few times
the error of the same computation in float32 rounded to the inputs' precision."""

from __future__ import annotations

import zlib

import pytest
import torch

import flash_attention
from flash_attention.fallback.reference import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, variant, dtype)
CASES = [
    (2, 333, 517, 8, 2, 128, True, None, "bf16"),
    (2, 517, 300, 4, 4, 64, False, None, "fp16"),
    (1, 300, 300, 4, 1, 256, True, "key_range", "bf16"),
    (2, 400, 400, 4, 2, 72, True, "window", "fp16"),
    (1, 384, 384, 8, 8, 128, True, "softcap", "bf16"),
    (2, 256, 700, 4, 2, 64, True, "deterministic", "bf16"),
]


def _dtype(name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _make(case):
    b, sq, sk, hq, hkv, d, causal, variant, dt = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    dtype = _dtype(dt)
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    # Logits on the scale of the scores' LSE, so that the sink takes a real share of each row.
    sinks = (torch.randn(hq, generator=gen, device="cuda") + 4.0).to(dtype)
    kw: dict = {"causal": causal}
    if variant == "key_range":
        kw["key_range"] = torch.tensor([[sk // 5, sk - 7]], dtype=torch.int32, device="cuda")
    elif variant == "window":
        kw["window"] = (64, 0)
    elif variant == "softcap":
        kw["softcap"] = 1.5
    elif variant == "deterministic":
        kw["deterministic"] = True
    return (q, k, v, do, sinks), kw


def _reference(tensors, kw, dtype):
    q, k, v, do, sinks = tensors
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, sinks)]
    ref_kw = {n: kw[n] for n in ("causal", "key_range", "window", "softcap") if n in kw}
    o, lse = attention_reference(*leaves[:3], sinks=leaves[3], compute_dtype=dtype, **ref_kw)
    grads = torch.autograd.grad(o, leaves, do.to(dtype))
    return o.detach(), lse.detach(), grads


def _close(got, exact, f32, name):
    err = (got.double() - exact).abs().max().item()
    err32 = (f32.to(got.dtype).double() - exact).abs().max().item()
    bound = 4 * err32 + 2e-3
    if name == "dsinks":  # (as in test_gpu_varlen: a sum over every row of D, formed from the rounded O')
        bound += 1e-2 * exact.abs().max().item()
    assert err <= bound, f"{name}: {err:.3g} against float64 (float32 rounded: {err32:.3g})"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sinks_forward_and_gradients_against_float64(case):
    tensors, kw = _make(case)
    q, k, v, do, sinks = tensors
    exact = _reference(tensors, kw, torch.float64)
    f32 = _reference(tensors, kw, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = torch.full_like(q, float("nan"))  # poisoned: the call must write every element
    with torch.no_grad():
        o_inf, lse_inf = flash_attention.attention(q, k, v, sinks=sinks, return_lse=True, out=out, **kw)
    assert o_inf.data_ptr() == out.data_ptr()
    _close(o_inf, exact[0], f32[0], "out (inference)")
    _close(lse_inf, exact[1], f32[1], "lse (inference)")
    o, lse = flash_attention.attention(*leaves[:3], sinks=leaves[3], return_lse=True, **kw)
    _close(o, exact[0], f32[0], "out")
    _close(lse, exact[1], f32[1], "lse")
    grads = torch.autograd.grad(o, leaves, do)
    for name, g, e, f in zip("dq dk dv dsinks".split(), grads, exact[2], f32[2], strict=True):
        _close(g, e, f, name)
    if kw.get("deterministic"):
        again = torch.autograd.grad(flash_attention.attention(*leaves[:3], sinks=leaves[3], **kw), leaves, do)
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


def test_sinks_with_dropout_have_the_dropout_free_sink_share():
    # Dropout drops probabilities, not the sink: with the same seed, out(sinks) = out(no sinks) * the
    # sink-free share exp(lse - lse'), and the LSE is the full softmax's either way.
    torch.manual_seed(11)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.randn(4, device="cuda") + 3.0
    o, lse = flash_attention.attention(q, k, v, causal=True, dropout_p=0.2, dropout_seed=5, return_lse=True)
    os, lses = flash_attention.attention(
        q, k, v, causal=True, dropout_p=0.2, dropout_seed=5, return_lse=True, sinks=sinks
    )
    share = torch.exp(lse - lses).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(os.float(), (o.float() * share), atol=1e-2, rtol=1e-2)
    assert (os.float() - o.float()).abs().max() > 1e-2


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode_with_sinks_against_float64(paged):
    torch.manual_seed(13)
    b, cap, hq, hkv, d = 3, 512, 8, 2, 128
    dt = torch.bfloat16
    k_cache = torch.randn(b, cap, hkv, d, device="cuda", dtype=dt)
    v_cache = torch.randn(b, cap, hkv, d, device="cuda", dtype=dt)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt)
    lengths = torch.tensor([1, 300, 512], dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, device="cuda") + 4.0
    extra: dict = {}
    kc, vc = k_cache, v_cache
    if paged:
        page = 64
        order = torch.randperm(b * cap // page, device="cuda")
        kc = k_cache.reshape(b * cap // page, page, hkv, d)[order.argsort()]
        vc = v_cache.reshape(b * cap // page, page, hkv, d)[order.argsort()]
        extra["block_table"] = order.reshape(b, cap // page).to(torch.int32)
    with torch.no_grad():
        out, lse = flash_attention.attention_with_kvcache(
            q, kc, vc, cache_seqlens=lengths, sinks=sinks, return_lse=True, **extra
        )
    for row in range(b):
        n = int(lengths[row])
        args = (q[row : row + 1], k_cache[row : row + 1, :n], v_cache[row : row + 1, :n])
        exact = attention_reference(*args, causal=True, sinks=sinks.double())
        f32 = attention_reference(*args, causal=True, sinks=sinks.float(), compute_dtype=torch.float32)
        _close(out[row : row + 1], exact[0], f32[0], f"out row {row}")
        _close(lse[row : row + 1], exact[1], f32[1], f"lse row {row}")


def test_compiled_training_with_sinks_is_one_graph():
    torch.manual_seed(17)
    q, k, v = (
        torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    sinks = torch.randn(4, device="cuda", requires_grad=True)

    def f(q, k, v, sinks):
        return flash_attention.attention(q, k, v, causal=True, sinks=sinks)

    compiled = torch.compile(f, fullgraph=True)
    do = torch.randn_like(q)
    want = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks), do)
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks), do)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["default", "portable", "sm90"])
def test_a_block_without_keys_has_the_sink_as_its_lse(family):
    # A batch row whose key range is empty: every one of its query blocks sees no key and takes the kernels'
    # empty-block path, whose rows must still count the sink (LSE = the sink, output 0), as the rows without
    # keys of a block that has some do.
    from flash_attention import ops
    from flash_attention.configs import portable_config
    from flash_attention.configs.heuristics import classic_hopper_config

    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 300, 4, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 200, 2, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(4, generator=gen, device="cuda") + 2.0
    key_range = torch.tensor([[0, 200], [50, 50]], dtype=torch.int32, device="cuda")
    cfg = {
        "default": None,
        "portable": portable_config("bf16", 128, False, 300, 200),
        "sm90": classic_hopper_config("bf16", 128, 300, False),
    }[family]
    out = torch.full_like(q, float("nan"))
    o, lse = ops.cuda_forward(
        q, k, v, causal=False, softmax_scale=128**-0.5, return_lse=True, out=out, config=cfg,
        key_range=key_range, sinks=sinks,
    )  # fmt: skip
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(lse[1], sinks[:, None].expand(4, 300))
    exact, exact_lse = attention_reference(q[:1], k[:1], v[:1], sinks=sinks, softmax_scale=128**-0.5)
    assert (o[0].double() - exact[0]).abs().max().item() < 2e-2
    assert (lse[0].double() - exact_lse[0]).abs().max().item() < 1e-2
