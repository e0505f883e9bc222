"""v with a head_dim of its own (DeepSeek's multi-head latent attention: q/k 192, v 128), issue 51's first
step: attention() and attention_varlen() take it on every path, and the output has v's head_dim.

The warp-specialized forward kernel takes it (feature value_dim), and an inference call's repeats allocate
the output with it; no backward kernel reads two head dims yet, so the backward runs q's head_dim's kernels
on v, the output and dO zero-padded to it (exact: ops.cuda_backward), and training declines the repeat path
(the compiled node does not pad). These tests hold the fallback's forward, LSE and gradients against the
float64 reference with every variant, and the kernel path on the stand-in GPU (the real launch layer,
repeat calls and training node)."""

from __future__ import annotations

import warnings

import pytest
import torch
from stand_in_gpu import repeat_mode_gpu  # noqa: F401 (the gpu fixture: repeat calls in Python and native)

import flash_attention as fa
from flash_attention.fallback.reference import attention_reference


def _inputs(gen, dtype, d=48, dv=24, sq=37, sk=53, hq=4, hkv=2, batch=2):
    q = torch.randn(batch, sq, hq, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(batch, sk, hkv, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(batch, sk, hkv, dv, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def _reference(q, k, v, **kw):
    """float64 output, LSE and gradient closure of the reference on the same (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_kw = {name: (t.double() if name == "alibi_slopes" else t) for name, t in kw.items()}
    out, lse = attention_reference(*leaves, **ref_kw)
    return out, lse, lambda dout: torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"causal": True, "window": (9, 0)},
        {"softcap": 1.7},
        {"causal": True, "alibi_slopes": "heads"},
        {"key_range": True},
        {"sinks": True},
    ],
    ids=["plain", "causal", "window", "softcap", "alibi", "key_range", "sinks"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_attention_with_vs_own_head_dim_matches_the_reference(kw, dtype):
    gen = torch.Generator().manual_seed(51)
    q, k, v = _inputs(gen, dtype)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(4, generator=gen)
    if kw.pop("key_range", False):
        kw["key_range"] = torch.tensor([[3, 41], [0, 53]])
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if kw.pop("sinks", False) else None
    out, lse = fa.attention(q, k, v, return_lse=True, sinks=sinks, **kw)
    assert out.shape == (2, 37, 4, 24) and out.dtype == dtype and lse.shape == (2, 4, 37)
    ref, ref_lse, ref_grad = _reference(q, k, v, sinks=sinks, **kw)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = ref_grad(dout)
    if dtype == torch.float64:
        # (the sinks rescale O by the float32 LSE of the sink-free rows: float32's rounding there)
        tol = {"atol": 1e-6, "rtol": 1e-6} if sinks is not None else {}
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(lse.double(), ref_lse.float().double())
        for g, r in zip(grads, want, strict=True):
            torch.testing.assert_close(g, r, **tol)
    else:
        # The suite's rule: at most twice PyTorch's own low-precision error (its attention in bf16 on the
        # same inputs, the scores in float32), plus the output's rounding.
        own = _bf16_attention(q, k, v, **kw) if sinks is None else None
        bound = 2 * (own - ref).abs().max().item() if own is not None else 2e-2
        assert (out.double() - ref).abs().max().item() <= bound + 2**-8
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
        for g, r in zip(grads, want, strict=True):
            assert g.shape == r.shape
            assert (g.double() - r).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"causal": True, "window": (9, 0)},
        {"softcap": 1.7},
        {"alibi_slopes": "heads"},
        {"key_range": True},
        {"causal": True, "deterministic": True},
    ],
    ids=["causal", "window", "softcap", "alibi", "key_range", "deterministic"],
)
def test_the_backward_kernels_take_vs_own_head_dim_with_every_variant(monkeypatch, kw):
    # On the stand-in GPU: the backward's kernels on v, the output and dO padded to q's head_dim give the
    # reference's gradients (dV sliced back to v's head_dim) with each variant; no fallback runs. (Sinks: the
    # stand-in's backward kernels recompute without them, so their gradients are checked on the GPU,
    # test_gpu_value_head_dim.py, and the padding's exactness here with each variant.)
    import stand_in_gpu

    from flash_attention import ops

    gpu = stand_in_gpu.install(monkeypatch)
    try:
        gen = torch.Generator().manual_seed(53)
        q, k, v = _inputs(gen, torch.bfloat16, d=64, dv=40, sq=45, sk=45)
        kw = dict(kw)
        if kw.get("alibi_slopes") == "heads":
            kw["alibi_slopes"] = torch.rand(4, generator=gen)
        if kw.pop("key_range", False):
            kw["key_range"] = torch.tensor([[3, 41], [0, 45]], dtype=torch.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a fallback would warn)
            out = fa.attention(q, k, v, **kw)
            dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        dkdv = "dkdv_det" if kw.get("deterministic") else "dkdv"
        assert gpu.launches.count(dkdv) == 1 and not gpu.errors, (gpu.launches, gpu.errors)
        kw.pop("deterministic", None)
        _, _, ref_grad = _reference(q, k, v, **kw)
        for g, r in zip(grads, ref_grad(dout), strict=True):
            assert g.shape == r.shape
            assert (g.double() - r).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())
    finally:
        ops.clear_plans()


def test_the_padded_backward_is_the_kernels_on_an_explicitly_padded_v(monkeypatch):
    # What ops.cuda_backward does for v's own head_dim is what a caller padding v with zeros would get from
    # the equal-dims path, bit for bit (dV's padded columns dropped); sinks included, which the stand-in's
    # backward kernels do not model (so this, not a float64 bound, is their test on the CPU).
    import stand_in_gpu

    from flash_attention import ops

    stand_in_gpu.install(monkeypatch)
    try:
        gen = torch.Generator().manual_seed(61)
        q, k, v = _inputs(gen, torch.bfloat16, d=64, dv=40, sq=45, sk=45)
        for sinks in (None, torch.randn(4, generator=gen)):
            out = fa.attention(q, k, v, causal=True, sinks=sinks)
            dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            padded = torch.nn.functional.pad(v.detach(), (0, 24)).requires_grad_()
            out_p = fa.attention(q, k, padded, causal=True, sinks=sinks)
            want = torch.autograd.grad(out_p, (q, k, padded), torch.nn.functional.pad(dout, (0, 24)))
            assert torch.equal(out, out_p[..., :40])
            for got, ref in zip(grads, want, strict=True):
                assert torch.equal(got, ref[..., : got.shape[-1]])
    finally:
        ops.clear_plans()


@pytest.mark.parametrize("tma", [True, False])
def test_a_config_reading_vs_head_dim_runs_without_padded_copies(monkeypatch, tma):
    """A backward config with head_dim_v (the warp-specialized wide kernel at 192 reading v at 128;
    value-head-dim-study section 7) runs on v, the output and dO as they are: no padded copies, BwdParams'
    head_dim_v and dV's strides at v's width, dO's tensor map of dO itself (the stand-in GPU checks each
    against the tensors), and gradients of q's, k's and v's own shapes against float64."""
    import stand_in_gpu

    from flash_attention import ops
    from flash_attention.configs import backward as backward_configs
    from flash_attention.configs import hopper_bwd_config
    from flash_attention.ops import backward as ops_backward

    stand_in_gpu.install(monkeypatch)
    pads = []
    real_pad = ops_backward.pad_head_dim
    monkeypatch.setattr(ops_backward, "pad_head_dim", lambda t, d: pads.append(t.shape) or real_pad(t, d))
    try:
        gen = torch.Generator().manual_seed(67)
        q, k, v = (t.detach() for t in _inputs(gen, torch.bfloat16, d=192, dv=128, sq=70, sk=90))
        dout = torch.randn(2, 70, 4, 128, generator=gen).to(torch.bfloat16)
        kw = dict(causal=True, softmax_scale=192**-0.5)
        o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
        cfg = hopper_bwd_config("bf16", 192, tma_loads=tma).replace(head_dim_v=128)
        got = ops.cuda_backward(dout, q, k, v, o, lse, config=cfg, **kw)
        assert not pads  # (the padded path would copy v, the output and dO)
        # Without HOPPER_BWD_READS_VALUE_DIM the default is the padded path,
        monkeypatch.setattr(backward_configs, "HOPPER_BWD_READS_VALUE_DIM", False)
        ops.cuda_backward(dout, q, k, v, o, lse, **kw)
        assert len(pads) == 3
        # with it (the default) the kernel reading v's head_dim, without dropout or determinism.
        monkeypatch.setattr(backward_configs, "HOPPER_BWD_READS_VALUE_DIM", True)
        again = ops.cuda_backward(dout, q, k, v, o, lse, **kw)
        assert len(pads) == 3 and [g.shape for g in again] == [g.shape for g in got]
        ops.cuda_backward(dout, q, k, v, o, lse, deterministic=True, **kw)
        assert len(pads) == 6  # (the deterministic call takes the wide kernel: padded)
        # Named with such a config, a call the wide kernel would take is refused (it reads one head_dim).
        with pytest.raises(ValueError, match=f"config {cfg.name()} has no build for deterministic"):
            ops.cuda_backward(dout, q, k, v, o, lse, config=cfg, deterministic=True, **kw)
        _, _, ref_grad = _reference(q, k, v, causal=True)
        for g, r in zip(got, ref_grad(dout), strict=True):
            assert g.shape == r.shape
            assert (g.double() - r).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())
    finally:
        ops.clear_plans()


def test_a_packed_batch_trains_with_vs_own_head_dim_on_the_kernels(monkeypatch):
    # attention_varlen in training with v's own head_dim on the stand-in GPU: the segments builds of the
    # forward and the backward (on v padded to q's head_dim) run, and each sequence's gradients are the
    # reference's.
    import stand_in_gpu

    from flash_attention import ops

    gpu = stand_in_gpu.install(monkeypatch)
    try:
        gen = torch.Generator().manual_seed(67)
        lengths = [37, 1, 60]
        total = sum(lengths)
        q = torch.randn(total, 4, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        k = torch.randn(total, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        v = torch.randn(total, 2, 40, generator=gen).to(torch.bfloat16).requires_grad_()
        cu = torch.tensor([0, 37, 38, 98], dtype=torch.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no fallback)
            out = fa.attention_varlen(q, k, v, cu, cu, causal=True)
            dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        assert out.shape == (total, 4, 40) and "dkdv" in gpu.launches and not gpu.errors, gpu.errors
        for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            piece = [t[a:e].unsqueeze(0) for t in (q, k, v)]
            _, _, ref_grad = _reference(*piece, causal=True)
            for g, r in zip(grads, ref_grad(dout[a:e].unsqueeze(0)), strict=True):
                assert (g[a:e].double() - r[0]).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())
    finally:
        ops.clear_plans()


def _bf16_attention(q, k, v, causal=False, window=None, softcap=0.0, alibi_slopes=None, key_range=None):
    """PyTorch's attention of the bf16 inputs with float32 scores (the error the suite's bar doubles)."""
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    return attention_reference(
        qf, kf, vf, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        key_range=key_range, compute_dtype=torch.float32,
    )[0].to(torch.bfloat16).double()  # fmt: skip


def test_out_takes_vs_head_dim():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (t.detach() for t in _inputs(gen, torch.float64))
    out = torch.full((2, 37, 4, 24), float("nan"), dtype=torch.float64)
    got = fa.attention(q, k, v, causal=True, out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True)[0])
    with pytest.raises(
        ValueError, match=r"out must have the shape \(2, 37, 4, 24\) \(q's, with v's head_dim\)"
    ):
        fa.attention(q, k, v, out=torch.empty(2, 37, 4, 48, dtype=torch.float64))


def test_varlen_with_vs_own_head_dim():
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 1, 20, 12]
    total = sum(lengths)
    q = torch.randn(total, 4, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = fa.attention_varlen(q, k, v, cu, cu, causal=True)
    assert out.shape == (total, 4, 16)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        piece = [t[a:b].unsqueeze(0) for t in (q, k, v)]
        ref, _, ref_grad = _reference(*piece, causal=True)
        torch.testing.assert_close(out[a:b], ref[0])
        want = ref_grad(dout[a:b].unsqueeze(0))
        for g, r in zip(grads, want, strict=True):
            torch.testing.assert_close(g[a:b], r[0])


def test_shapes_v_may_not_change():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"v must have the batch, length and heads of k \(1, 8, 2\)"):
        fa.attention(q, q, torch.randn(1, 9, 2, 8))


@pytest.mark.parametrize("records", [False, True])
def test_the_kernels_take_vs_own_head_dim(monkeypatch, records):
    # On the stand-in GPU (the real launch layer): the warp-specialized forward takes v's own head_dim
    # (feature value_dim; the stand-in checks FwdParams.head_dim_v is v's) and its answer is the reference's;
    # the backward runs its kernels on v, out and dO padded to q's head_dim, with no fallback and no
    # warning, and its gradients are the reference's. Twice: the second call meets the repeat signature the
    # first one left.
    import stand_in_gpu

    from flash_attention import ops
    from flash_attention.ops import dispatch

    gpu = stand_in_gpu.install(monkeypatch)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    try:
        gen = torch.Generator().manual_seed(11)
        q, k, v = _inputs(gen, torch.bfloat16, d=128, dv=64, sq=40, sk=40)
        seen = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(records):
                warnings.simplefilter("always")
                out = fa.attention(q, k, v, causal=True)
                grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out)) if records else None
            assert out.shape == (2, 40, 4, 64)
            ref, _, ref_grad = _reference(q, k, v, causal=True)
            assert (out.double() - ref).abs().max() < 2e-2
            if records:
                for g, r in zip(grads, ref_grad(torch.ones_like(out)), strict=True):
                    assert (g.double() - r).abs().max() < 5e-2 * max(1.0, r.abs().max().item())
            seen.append([str(w.message) for w in caught if "differs from q's and k's" in str(w.message)])
        assert gpu.launches.count("forward") == 2, gpu.launches  # (the forward kernel, each call)
        assert gpu.launches.count("dkdv") == (2 if records else 0), gpu.launches
        assert not seen[0] and not seen[1] and not gpu.errors, (seen, gpu.errors)
    finally:
        ops.clear_plans()


def test_the_forward_pads_v_to_its_own_multiple_of_8(monkeypatch):
    # A head_dim that is not a multiple of 8 is zero-padded for the kernels: q and k to theirs, v to its own
    # (padding v to q's would run the kernel on the wrong shape), the output sliced back to v's; the
    # backward pads v, the output and dO to q's head_dim and then all of them to a multiple of 8, and slices
    # dV back to v's.
    import stand_in_gpu

    from flash_attention import ops

    stand_in_gpu.install(monkeypatch)
    try:
        gen = torch.Generator().manual_seed(4)
        q = torch.randn(1, 16, 2, 20, generator=gen).to(torch.bfloat16)
        v = torch.randn(1, 16, 2, 12, generator=gen).to(torch.bfloat16)
        out, lse = ops.cuda_forward(q, q, v, causal=False, softmax_scale=0.2, return_lse=True, out=None)
        assert out.shape == (1, 16, 2, 12)
        want, _ = attention_reference(q, q, v, softmax_scale=0.2)
        assert (out.double() - want).abs().max() < 2e-2
        dout = torch.randn(1, 16, 2, 12, generator=gen).to(torch.bfloat16)
        dq, dk, dv = ops.cuda_backward(dout, q, q, v, out, lse, causal=False, softmax_scale=0.2)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, q.shape, v.shape)
        leaves = [t.double().requires_grad_() for t in (q, q.clone(), v)]
        want_out, _ = attention_reference(*leaves, softmax_scale=0.2)
        want = torch.autograd.grad(want_out, leaves, dout.double())
        for got, ref in zip((dq, dk, dv), want, strict=True):
            assert (got.double() - ref).abs().max() <= 3e-2 * max(1.0, ref.abs().max().item())
    finally:
        ops.clear_plans()


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_with_v_caches_own_head_dim(paged):
    # A cache whose values have another head_dim than its keys: the new tokens appended to both, then every
    # row's queries against its keys, on the composed path, against the float64 truth (which appends too).
    from flash_attention.fallback.reference import attention_kvcache_reference

    gen = torch.Generator().manual_seed(17 + paged)
    batch, d, dv, heads_q, heads_kv = 3, 32, 16, 4, 2
    q = torch.randn(batch, 2, heads_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, 2, heads_kv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, 2, heads_kv, dv, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 0, 11], dtype=torch.int32)
    if paged:
        table = torch.tensor([[3, 0], [1, 5], [4, 2]], dtype=torch.int32)
        k_cache = torch.randn(6, 8, heads_kv, d, generator=gen, dtype=torch.float64)
        v_cache = torch.randn(6, 8, heads_kv, dv, generator=gen, dtype=torch.float64)
    else:
        table = None
        k_cache = torch.randn(batch, 16, heads_kv, d, generator=gen, dtype=torch.float64)
        v_cache = torch.randn(batch, 16, heads_kv, dv, generator=gen, dtype=torch.float64)
    want, want_lse, k_after, v_after = attention_kvcache_reference(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=True, window=(6, -1)
    )
    out, lse = fa.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, causal=True, window=(6, -1),
        return_lse=True,
    )  # fmt: skip
    assert out.shape == (batch, 2, heads_q, dv)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse.double(), want_lse.float().double())
    torch.testing.assert_close(k_cache, k_after)
    torch.testing.assert_close(v_cache, v_after)
    with pytest.raises(
        ValueError, match=r"v must have shape \(batch, seqlen_new, heads_kv, v_cache's head_dim\)"
    ):
        fa.attention_with_kvcache(q, k_cache, v_cache, k, k, cache_seqlens=lengths, block_table=table)


def test_kvcache_decode_kernels_refuse_vs_own_head_dim(monkeypatch):
    # On the stand-in GPU the decode plan declines with the reason (the composed path then runs, warned once),
    # and attention()'s few-query route declines silently (its usual path falls back with its own warning).
    import stand_in_gpu

    from flash_attention import ops
    from flash_attention.ops import dispatch

    gpu = stand_in_gpu.install(monkeypatch)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    try:
        gen = torch.Generator().manual_seed(23)
        q = torch.randn(2, 1, 8, 64, generator=gen).to(torch.bfloat16)
        k_cache = torch.randn(2, 300, 2, 64, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(2, 300, 2, 32, generator=gen).to(torch.bfloat16)
        lengths = torch.tensor([300, 170], dtype=torch.int32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
        assert any("no decode kernel takes yet" in str(w.message) for w in caught), [
            str(w.message) for w in caught
        ]
        # (no decode kernel ran: the composed path appends with PyTorch and attends on the forward kernel,
        # which takes v's own head_dim)
        assert not any(kind.startswith("decode_") for kind in gpu.launches), gpu.launches
        assert "forward" in gpu.launches
        for b, n in enumerate(lengths.tolist()):
            want, _ = attention_reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n])
            assert (out[b : b + 1].double() - want).abs().max() < 2e-2
        routed = fa.attention(q, k_cache, v_cache)  # (300 keys, one query: the route's shape)
        assert routed.shape == (2, 1, 8, 32)
    finally:
        ops.clear_plans()


def test_a_training_call_prefetches_the_backward_it_runs_for_vs_own_head_dim(monkeypatch):
    # The backward's kernels compile ahead of a training call's forward: with v's own head_dim they are q's
    # head_dim's (the backward pads v to it), so they are started as for any call.
    import stand_in_gpu

    from flash_attention import ops
    from flash_attention.ops import training

    gpu = stand_in_gpu.install(monkeypatch)
    try:
        q, k, v = _inputs(torch.Generator().manual_seed(2), torch.bfloat16, d=64, dv=32, sq=40, sk=40)
        fa.attention(q, k, v, causal=True)
        ((name, *_),) = gpu.prefetched
        assert name.startswith("bwd_bf16_d64_"), gpu.prefetched  # (q's head_dim's backward)
        # The backward of the same call with v as wide as q would prefetch the same kernels.
        training._prefetched.clear()
        gpu.prefetched.clear()
        fa.attention(q, k, torch.cat([v, v], dim=-1), causal=True)
        assert [p[0] for p in gpu.prefetched] == [name]
    finally:
        ops.clear_plans()


@pytest.mark.parametrize("dims", [(192, 128), (128, 64)], ids=["192-128", "128-64"])
def test_inference_repeats_take_vs_own_head_dim(gpu, validations, dims):
    # An inference call with v's own head_dim leaves a repeat call (Python's or the host library's, the
    # fixture's two modes) that allocates the output with v's head_dim: the later calls skip the whole path
    # and launch the forward kernel straight away, each on fresh inputs, the previous output poisoned (and
    # freed, so the next one may be allocated over it), and match the float64 reference.
    from flash_attention.ops import repeat

    d, dv = dims
    gen = torch.Generator().manual_seed(d + dv)
    out = None
    for _ in range(4):
        q, k, v = (t.detach() for t in _inputs(gen, torch.bfloat16, d=d, dv=dv, sq=37, sk=45))
        if out is not None:
            out.fill_(float("nan"))
            del out
        out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
        assert out.shape == (2, 37, 4, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
        ref, ref_lse, _ = _reference(q, k, v, causal=True)
        # (the stand-in kernel computes in float64 and rounds to bfloat16 once)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    key = repeat.signature(q, k, v, True, None, True, None, False, 0.0, None)
    made = repeat.NativeRepeatCall if repeat.MODE == "native" else repeat.RepeatCall
    assert isinstance(repeat.lookup(key), made)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward"] * 4 and not gpu.errors, gpu.errors


def test_packed_inference_repeats_take_vs_own_head_dim(gpu, validations):
    # attention_varlen's packed batch is attention()'s call with its runs bound: the same repeat call, each
    # batch's own runs, the output of v's head_dim.
    gen = torch.Generator().manual_seed(7)
    for lengths in ([30, 7, 50], [1, 60, 26], [40, 40, 7]):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(total, 4, 192, generator=gen).to(torch.bfloat16)
        k = torch.randn(total, 2, 192, generator=gen).to(torch.bfloat16)
        v = torch.randn(total, 2, 128, generator=gen).to(torch.bfloat16)
        out = fa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=64, max_seqlen_k=64, causal=True)
        assert out.shape == (total, 4, 128)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            ref, _, _ = _reference(*(t[a:b].unsqueeze(0) for t in (q, k, v)), causal=True)
            torch.testing.assert_close(out[a:b].double(), ref[0], rtol=2**-8, atol=1e-6)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward"] * 3 and not gpu.errors, gpu.errors


@pytest.mark.parametrize("dv", [128, 96])
def test_training_with_vs_own_head_dim_repeats_where_a_kernel_reads_it(gpu, validations, dv):
    # Training with v's own head_dim: at 192/128 the compiled node runs the backward kernel reading v's
    # head_dim (ops.backward.value_dim_config), so the signature repeats (validated once); 192/96, which no
    # kernel reads, the node does not take (the backward pads v in Python), so its signature is remembered
    # as the whole path's (every call validated). Either way the forward kernel, then the backward's, and
    # gradients of the tensors' own shapes, the reference's.
    from flash_attention.ops import repeat
    from flash_attention.spec import AttentionSpec

    reads = dv == 128
    gen = torch.Generator().manual_seed(29)
    for _ in range(3):
        q, k, v = _inputs(gen, torch.bfloat16, d=192, dv=dv, sq=37, sk=45)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no fallback, no warning)
            out = fa.attention(q, k, v, causal=True)
            dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        assert out.shape == (2, 37, 4, dv)
        ref, _, ref_grad = _reference(q, k, v, causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)
        for g, r in zip(grads, ref_grad(dout), strict=True):
            assert g.shape == r.shape
            assert (g.double() - r).abs().max().item() <= 4e-2 * max(1.0, r.abs().max().item())
    looked = repeat.lookup(repeat.signature(q, k, v, True, None, False, None, False, 0.0, None))
    assert (looked is repeat.WHOLE_PATH) != reads
    assert len(validations) == (1 if reads else 3)
    assert gpu.launches == ["forward", "pre", "dkdv", "convert"] * 3 and not gpu.errors, (
        gpu.launches,
        gpu.errors,
    )
    # (prepare declines a call no kernel reads itself, before it plans the node's backward, which would
    # refuse it)
    spec = AttentionSpec(True, 192**-0.5)
    assert (repeat.prepare(q, k, v, spec, key_range=None, records=True, return_lse=False) is None) != reads
    assert repeat.prepare(q, k, v, spec, key_range=None, records=False, return_lse=False) is not None
