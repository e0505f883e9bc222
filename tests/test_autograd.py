"""Gradients of flash_attention.attention on CPU (the PyTorch fallback backward), the custom ops
``flash_attention::fwd`` / ``flash_attention::bwd`` (schema, fake tensors, autograd registration) and
torch.compile.

The independent reference is float64 autograd through :func:`attention_reference`, which materialises the
whole score matrix and repeats K/V for GQA: nothing in it is shared with the chunked FlashAttention-2
backward under test.
"""

from __future__ import annotations

import copy
import random
import types
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attention
from flash_attention import fallback
from flash_attention.api import attention as interface
from flash_attention.fallback import reference
from flash_attention.fallback.reference import attention_backward_torch, attention_reference, attention_torch
from flash_attention.ops import NoKernel, dispatch
from flash_attention.spec import AttentionSpec, OpOptions, pack_options
from flash_attention.torch_ops import attention as custom_ops


def _spec(causal: bool, scale, q) -> AttentionSpec:
    """The spec a fallback call takes (scale None: 1 / sqrt(head_dim), as the public API resolves it)."""
    return AttentionSpec(causal, q.shape[-1] ** -0.5 if scale is None else scale)


FWD = torch.ops.flash_attention.fwd.default
BWD = torch.ops.flash_attention.bwd.default


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    # A different, reproducible seed per test: inputs are fresh random data, never shared between tests.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, layout="bshd", requires_grad=True):
    def make(s, h):
        if layout == "bhsd":
            # (batch, heads, seqlen, dim) storage seen as (batch, seqlen, heads, dim): no copy.
            t = torch.randn(b, h, s, d).to(dtype).transpose(1, 2)
        else:
            t = torch.randn(b, s, h, d).to(dtype)
        return t.requires_grad_(requires_grad) if t.is_leaf else t.detach().requires_grad_(requires_grad)

    return make(sq, hq), make(sk, hkv), make(sk, hkv)


def _random_key_range(b, sk, rng):
    """Per-batch [start, end): full, right-padded, left-padded, empty, or out of bounds (clamped)."""
    rows = []
    for _ in range(b):
        kind = rng.choice(["full", "right", "left", "both", "empty", "wild"])
        if kind == "full":
            rows.append((0, sk))
        elif kind == "right":
            rows.append((0, rng.randint(1, sk)))
        elif kind == "left":
            rows.append((rng.randint(0, sk - 1), sk))
        elif kind == "both":
            s = rng.randint(0, sk - 1)
            rows.append((s, rng.randint(s + 1, sk)))
        elif kind == "empty":
            s = rng.randint(0, sk)
            rows.append((s, rng.choice([s, max(0, s - 2)])))
        else:
            rows.append((rng.randint(-5, 0), sk + rng.randint(0, 5)))
    return torch.tensor(rows, dtype=rng.choice([torch.int32, torch.int64]))


def _reference_grads(q, k, v, dout, *, causal, scale=None, key_range=None):
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(q64, k64, v64, causal=causal, softmax_scale=scale, key_range=key_range)
    return out, torch.autograd.grad(out, (q64, k64, v64), dout.double())


def _grads(q, k, v, dout, **kwargs):
    out = flash_attention.attention(q, k, v, **kwargs)
    return out, torch.autograd.grad(out, (q, k, v), dout)


# ---------------------------------------------------------------------------------------------------------
# Gradients against float64 autograd


_rng = random.Random(20261123)
_LENS = [1, 2, 7, 16, 33, 64, 97]
_CASES = []
for _i in range(40):
    _sq = _rng.choice(_LENS)
    _sk = _sq if _rng.random() < 0.3 else _rng.choice(_LENS)
    _hkv = _rng.choice([1, 2, 3])
    _CASES.append(
        dict(
            b=_rng.choice([1, 2, 3]),
            sq=_sq,
            sk=_sk,
            hq=_hkv * _rng.choice([1, 2, 4]),
            hkv=_hkv,
            d=_rng.choice([8, 16, 40, 64]),
            causal=_rng.random() < 0.5,
            ranged=_rng.random() < 0.35,
            layout=_rng.choice(["bshd", "bshd", "bhsd"]),
            scale=_rng.choice([None, None, 0.37, -0.2]),
            seed=_i,
        )
    )


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_float32_gradients_match_float64_autograd(case):
    c = types.SimpleNamespace(**case)
    q, k, v = _qkv(c.b, c.sq, c.sk, c.hq, c.hkv, c.d, layout=c.layout)
    kr = _random_key_range(c.b, c.sk, random.Random(c.seed)) if c.ranged else None
    dout = torch.randn(q.shape)
    out, grads = _grads(q, k, v, dout, causal=c.causal, softmax_scale=c.scale, key_range=kr)
    ref_out, ref_grads = _reference_grads(q, k, v, dout, causal=c.causal, scale=c.scale, key_range=kr)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert g.isfinite().all(), f"d{name} is not finite"
        # float32 arithmetic over at most ~100 keys/queries and head_dim <= 64: errors up to about 3e-6
        # relative to the gradient's magnitude over these cases; 1e-5 keeps a margin and still catches any
        # wrong or missing term (those err by the gradient's own magnitude).
        tol = 1e-5 * (1.0 + r.abs().max().item())
        err = (g.double() - r).abs().max().item()
        assert err <= tol, f"d{name}: max error {err:.3g} > {tol:.3g}"


def test_float64_gradients_are_float64_accurate():
    # The saved LSE is float32; the float64 backward renormalises P so that this costs no precision.
    q, k, v = _qkv(2, 37, 53, 6, 2, 32, dtype=torch.float64)
    kr = torch.tensor([[3, 40], [0, 53]])
    dout = torch.randn(q.shape, dtype=torch.float64)
    _, grads = _grads(q, k, v, dout, causal=True, key_range=kr)
    _, ref_grads = _reference_grads(q, k, v, dout, causal=True, key_range=kr)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_within_twice_sdpa_error(dtype):
    # DESIGN.md's accuracy rule applied to the fallback's gradients: at most 2x the error of PyTorch's own
    # SDPA backward on the same low-precision inputs, plus 1e-5.
    b, sq, sk, hq, hkv, d = 2, 45, 71, 4, 2, 64
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype=dtype)
    dout = torch.randn(q.shape).to(dtype)
    mask = reference.causal_allowed(sq, sk)
    _, grads = _grads(q, k, v, dout, causal=True)
    _, ref = _reference_grads(q, k, v, dout, causal=True)

    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    group = hq // hkv
    o = F.scaled_dot_product_attention(
        qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1), attn_mask=mask
    )
    sdpa = [g.transpose(1, 2) for g in torch.autograd.grad(o, (qs, ks, vs), dout.transpose(1, 2))]
    for name, g, s, r in zip("qkv", grads, sdpa, ref, strict=True):
        assert g.dtype == dtype and g.isfinite().all()
        err = (g.double() - r).abs().max().item()
        bound = 2 * (s.double() - r).abs().max().item() + 1e-5
        assert err <= bound, f"d{name}: {err:.3g} > {bound:.3g}"


def test_rows_without_keys_get_zero_gradient_and_no_nan():
    # causal with seqlen_q > seqlen_k: the first 6 query rows see no key; batch row 1's key range is empty.
    q, k, v = _qkv(2, 11, 5, 4, 2, 16)
    kr = torch.tensor([[1, 5], [3, 3]])
    dout = torch.randn(q.shape)
    out, lse = flash_attention.attention(q, k, v, causal=True, key_range=kr, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for g in (dq, dk, dv):
        assert g.isfinite().all()
    assert (dq[:, :6] == 0).all() and (dq[1] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()  # batch row 1 attended nothing
    assert (dk[0, 0] == 0).all() and (dv[0, 0] == 0).all()  # key 0 is outside batch row 0's range
    _, ref = _reference_grads(q, k, v, dout, causal=True, key_range=kr)
    for g, r in zip((dq, dk, dv), ref, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 5, 0, 4, 2, 16), (2, 0, 5, 4, 2, 16), (0, 5, 5, 4, 2, 16)])
def test_empty_problems_are_differentiable_with_zero_gradients(shape):
    q, k, v = _qkv(*shape)
    out = flash_attention.attention(q, k, v, causal=True)
    assert out.requires_grad and (out == 0).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and (g == 0).all()


def test_backward_is_chunked_and_exact(monkeypatch):
    # A 64 KiB score budget forces the backward into many (batch, kv head, query row) chunks.
    q, k, v = _qkv(2, 300, 257, 4, 2, 32, requires_grad=False)
    kr = torch.tensor([[0, 200], [17, 257]])
    out, lse = attention_torch(q, k, v, causal=True, return_lse=True, key_range=kr)
    dout = torch.randn(q.shape)
    whole = attention_backward_torch(dout, q, k, v, out, lse, causal=True, key_range=kr)
    monkeypatch.setattr(reference, "_SCORE_BUDGET_BYTES", 64 * 1024)
    assert reference._chunk_sizes(2, 2, 2, 300, 257, 8)[2] < 300
    chunked = attention_backward_torch(dout, q, k, v, out, lse, causal=True, key_range=kr)
    _, ref = _reference_grads(q, k, v, dout, causal=True, key_range=kr)
    for a, b, r in zip(whole, chunked, ref, strict=True):
        assert a.is_contiguous() and b.is_contiguous()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.double(), r, rtol=1e-5, atol=1e-5)


def test_backward_accepts_expanded_and_strided_dout_and_lse():
    q, k, v = _qkv(1, 9, 12, 2, 1, 16, requires_grad=False)
    out, lse = attention_torch(q, k, v, return_lse=True)
    dout = torch.ones(()).expand(q.shape)  # what out.sum() hands to the backward: all strides 0
    lse_t = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    got = attention_backward_torch(dout, q, k, v, out, lse_t)
    want = attention_backward_torch(dout.contiguous(), q, k, v, out, lse)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_gradcheck_float64():
    q, k, v = _qkv(2, 3, 4, 2, 1, 8, dtype=torch.float64)
    kr = torch.tensor([[1, 4], [0, 3]])
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v, causal=causal: flash_attention.attention(q, k, v, causal=causal, key_range=kr),
            (q, k, v),
        )


# ---------------------------------------------------------------------------------------------------------
# The API around gradients


def test_lse_is_returned_but_not_differentiable():
    q, k, v = _qkv(1, 6, 6, 2, 2, 16)
    out, lse = flash_attention.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        ref_out, ref_lse = fallback.forward(q, k, v, _spec(False, None, q), return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_out_with_autograd_raises_and_names_out():
    q, k, v = _qkv(1, 6, 6, 2, 2, 16)
    buf = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match=r"out=.*requires grad"):
        flash_attention.attention(q, k, v, out=buf)
    with torch.no_grad():  # not recording: out= works as before
        assert flash_attention.attention(q, k, v, out=buf) is buf
    with torch.no_grad():
        torch.testing.assert_close(buf, fallback.forward(q, k, v, _spec(False, None, q))[0], rtol=0, atol=0)


def test_inference_calls_skip_the_custom_op(monkeypatch):
    calls = []
    real = interface._attention_op

    def spy(*args, **kwargs):
        calls.append(args[8])  # `records`
        return real(*args, **kwargs)

    monkeypatch.setattr(interface, "_attention_op", spy)
    q, k, v = _qkv(1, 6, 6, 2, 2, 16, requires_grad=False)
    flash_attention.attention(q, k, v)
    assert calls == []
    q.requires_grad_(True)
    with torch.no_grad():
        flash_attention.attention(q, k, v)
    assert calls == []
    out = flash_attention.attention(q, k, v)
    assert calls == [True] and out.grad_fn is not None


def test_deterministic_is_validated_and_reaches_the_backward():
    q, k, v = _qkv(1, 6, 6, 2, 2, 16)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention.attention(q, k, v, deterministic=1)

    # The op's autograd context carries the flag to flash_attention::bwd, among the packed options.
    def deterministic(out):
        return OpOptions.unpack(out.grad_fn.options, out.grad_fn.values).deterministic

    assert deterministic(flash_attention.attention(q, k, v, deterministic=True)) is True
    # (A plain call without the flag is PyTorch's own SDPA: test_plain_cpu_call_is_pytorchs_sdpa. Grouped
    # query heads keep this one on the op.)
    qg, kg, vg = _qkv(1, 6, 6, 4, 2, 16)
    assert deterministic(flash_attention.attention(qg, kg, vg)) is False
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert deterministic(flash_attention.attention(q, k, v)) is True
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("causal", [False, True])
def test_plain_cpu_call_is_pytorchs_sdpa(causal, monkeypatch):
    """A training call SDPA computes exactly as we define it runs SDPA whole (its autograd, its host path);
    one it cannot (grouped-query heads, causal with seqlen_q != seqlen_k, return_lse) runs our op."""
    q, k, v = _qkv(2, 40, 40, 4, 4, 32)
    monkeypatch.setattr(fallback, "forward", lambda *a, **kw: pytest.fail("our op ran"))
    out = flash_attention.attention(q, k, v, causal=causal)
    assert "ScaledDotProduct" in type(out.grad_fn.next_functions[0][0]).__name__
    dout = torch.randn(out.shape)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference.attention_reference(q64, k64, v64, causal=causal)
    (ref * dout.double()).sum().backward()
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert (got.double() - want).abs().max() < 1e-5
    monkeypatch.undo()
    for args, kwargs in (
        (_qkv(2, 40, 40, 4, 2, 32), dict(causal=causal)),  # grouped-query heads
        (_qkv(2, 30, 40, 4, 4, 32), dict(causal=True)),  # bottom-right causal on a rectangle
        ((q, k, v), dict(causal=causal, return_lse=True)),
        ((q, k, v), dict(causal=causal, deterministic=True)),
    ):
        o = flash_attention.attention(*args, **kwargs)
        o = o[0] if isinstance(o, tuple) else o
        assert type(o.grad_fn).__name__ in ("EagerAttentionBackward", "BackwardCFunction"), o.grad_fn


def test_deterministic_fallback_gradients_are_identical():
    q, k, v = _qkv(2, 33, 47, 4, 1, 32)
    dout = torch.randn(q.shape)
    _, first = _grads(q, k, v, dout, causal=True, deterministic=True)
    for kwargs in (dict(deterministic=True), dict(deterministic=False)):
        _, again = _grads(q, k, v, dout, causal=True, **kwargs)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# The CUDA implementations' dispatch, with a stand-in ops module (no GPU needed)


class _FakeOps:
    def __init__(self, reason=None, backward=True):
        self.reason = reason
        self.calls = []
        if backward:
            self.cuda_backward = self._cuda_backward

    def cuda_unavailable_reason(self, q):
        return self.reason

    def cuda_forward(self, q, k, v, **kwargs):
        self.calls.append(("forward", kwargs))
        return torch.full_like(q, 7.0), torch.full((q.shape[0], q.shape[2], q.shape[1]), 3.0)

    def _cuda_backward(self, dout, q, k, v, out, lse, **kwargs):
        self.calls.append(("backward", kwargs, dout.stride(-1)))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)


@pytest.fixture
def fake_ops(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)

    def install(ops):
        monkeypatch.setattr(dispatch, "backend", lambda: ops)
        return ops

    return install


def _saved(b=2, sq=5, sk=6, hq=4, hkv=2, d=16, dtype=torch.bfloat16):
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype=dtype, requires_grad=False)
    out, lse = attention_torch(q, k, v, return_lse=True)
    return q, k, v, out, lse


def test_cuda_forward_impl_calls_the_kernel_with_lse(fake_ops):
    ops = fake_ops(_FakeOps())
    q, k, v, _, _ = _saved()
    kr = torch.tensor([[0, 3], [1, 6]])
    out, lse = custom_ops.forward_impl(q, k, v, OpOptions(True, 0.25), kr)
    assert (out == 7).all() and (lse == 3).all()
    assert ops.calls == [
        (
            "forward",
            dict(
                causal=True,
                softmax_scale=0.25,
                return_lse=True,
                out=None,
                config=None,
                key_range=kr,
                dropout_p=0.0,
                dropout_seed=None,
            ),
        )
    ]


def test_cuda_backward_impl_calls_cuda_backward_by_its_signature(fake_ops):
    ops = fake_ops(_FakeOps())
    q, k, v, out, lse = _saved()
    dout = torch.randn(q.shape[:-1] + (2 * q.shape[-1],)).to(q.dtype)[..., ::2]  # stride(-1) == 2
    dq, dk, dv = custom_ops.backward_impl(dout, q, k, v, out, lse, OpOptions(True, 0.25, True))
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    kwargs = dict(
        causal=True, softmax_scale=0.25, deterministic=True, key_range=None, dropout_p=0.0, dropout_seed=None
    )
    assert ops.calls == [("backward", kwargs, 1)]  # dout handed over with a contiguous last dimension


def test_cuda_impls_fall_back_when_no_kernel_fits_this_gpu(fake_ops):
    ops = fake_ops(_FakeOps())

    def no_backward(*args, **kwargs):
        raise NoKernel("no backward kernel for head_dim 256 fits the 101376 bytes of shared memory (sm_86)")

    ops.cuda_backward = no_backward
    q, k, v, out, lse = _saved()
    dout = torch.randn(q.shape).to(q.dtype)
    with pytest.warns(RuntimeWarning, match="PyTorch fallback.*no backward kernel for head_dim 256"):
        got = custom_ops.backward_impl(dout, q, k, v, out, lse, OpOptions(False, 0.25))
    want = fallback.backward(dout, q, k, v, out, lse, _spec(False, 0.25, q))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        custom_ops.backward_impl(dout, q, k, v, out, lse, OpOptions(False, 0.25))


def test_cuda_impls_fall_back_with_one_warning_when_the_kernel_cannot_run(fake_ops):
    fake_ops(_FakeOps(reason="the kernels take float16 or bfloat16, not torch.float32", backward=False))
    q, k, v, out, lse = _saved(dtype=torch.float32)
    dout = torch.randn(q.shape)
    with pytest.warns(RuntimeWarning, match="PyTorch fallback.*float32"):
        got_out, got_lse = custom_ops.forward_impl(q, k, v, OpOptions(False, 0.25))
    assert torch.equal(got_out, fallback.forward(q, k, v, _spec(False, 0.25, q))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same reason: silent; and no NotImplementedError on the fallback
        got = custom_ops.backward_impl(dout, q, k, v, out, lse, OpOptions(False, None))
    want = fallback.backward(dout, q, k, v, out, lse, _spec(False, None, q))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_cuda_impls_launch_nothing_for_empty_problems(fake_ops):
    ops = fake_ops(_FakeOps())
    q, k, v, out, lse = _saved(sk=0)
    o, lse = custom_ops.forward_impl(q, k, v, OpOptions(False, 0.25))
    assert (o == 0).all() and torch.isneginf(lse).all()
    grads = custom_ops.backward_impl(torch.randn_like(q), q, k, v, o, lse, OpOptions(False, 0.25))
    assert all((g == 0).all() for g in grads) and ops.calls == []


# ---------------------------------------------------------------------------------------------------------
# The custom ops: opcheck, fake tensors


def _op_samples():
    samples = []
    for b, sq, sk, hq, hkv, d, causal, dtype, ranged in [
        (2, 5, 7, 4, 2, 16, True, torch.float32, True),
        (1, 9, 4, 3, 3, 8, True, torch.float32, False),  # rows without keys
        (2, 6, 6, 2, 1, 16, False, torch.float64, True),
        (1, 8, 11, 4, 4, 32, False, torch.bfloat16, False),
    ]:
        q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype=dtype)
        kr = torch.tensor([[1, sk]] * b) if ranged else None
        samples.append((q, k, v, causal, kr))
    return samples


@pytest.mark.parametrize("index", range(4))
def test_opcheck_fwd(index):
    q, k, v, causal, kr = _op_samples()[index]
    torch.library.opcheck(FWD, (q, k, v, *pack_options(causal, 0.3), kr))


@pytest.mark.parametrize("index", range(4))
def test_opcheck_bwd(index):
    q, k, v, causal, kr = _op_samples()[index]
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = FWD(q, k, v, *pack_options(causal, 0.3), kr)
    dout = torch.randn(q.shape).to(q.dtype)
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, *pack_options(causal, 0.3, True), kr))


def test_fake_tensor_shapes_dtypes_strides():
    with FakeTensorMode():
        q = torch.empty(3, 17, 8, 40, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
        k = torch.empty(3, 29, 2, 40, dtype=torch.bfloat16)
        v = torch.empty(3, 29, 2, 40, dtype=torch.bfloat16)
        kr = torch.zeros(3, 2, dtype=torch.int32)
        out, lse = FWD(q, k, v, *pack_options(True, 0.1), kr)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv = BWD(torch.empty_like(out), q, k, v, out, lse, *pack_options(True, 0.1), kr)
        for g, t in zip((dq, dk, dv), (q, k, v), strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous()
        # Through the public API, with autograd recording (the op path).
        qg = torch.empty(2, 5, 4, 16, requires_grad=True)
        kg = torch.empty(2, 7, 2, 16, requires_grad=True)
        o, lse2 = flash_attention.attention(qg, kg, kg, return_lse=True)
        assert o.shape == (2, 5, 4, 16) and lse2.shape == (2, 4, 5) and o.requires_grad


# ---------------------------------------------------------------------------------------------------------
# torch.compile


class _Block(torch.nn.Module):
    """A small pre-norm transformer block: GQA attention through flash_attention, then an MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
        )

    def forward(self, x, key_range=None):
        b, n, dim = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        a = flash_attention.attention(q, k, v, causal=True, key_range=key_range)
        x = x + self.o(a.reshape(b, n, dim))
        return x + self.mlp(self.norm2(x))


def _train(model, x, key_range, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x, key_range).float().square().mean()  # float32 loss for bf16 models too
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_compiled_training_matches_eager():
    torch._dynamo.reset()
    eager = _Block()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(2, 19, 64)
    kr = torch.tensor([[0, 19], [3, 15]])
    want = _train(eager, x, kr, 3)
    got = _train(compiled, x, kr, 3)
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, r in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


def test_traced_call_builds_no_spec(monkeypatch):
    # torch 2.11's dynamo cannot build the spec's frozen dataclasses inside a trace (a graph break, seen on
    # the GPU suite); this torch's dynamo can, so the test makes any build inside a trace an error instead.
    import flash_attention.api.attention as interface_module
    import flash_attention.spec.validate as validate_module

    def refusing(real):
        def build(*args, **kwargs):
            if torch.compiler.is_compiling():
                raise AssertionError(f"{real.__name__} built inside a trace")
            return real(*args, **kwargs)

        return build

    monkeypatch.setattr(interface_module, "AttentionSpec", refusing(interface_module.AttentionSpec))
    # (ScoreSpec.of is how validation builds a score spec: spec/validate.py's score_spec)
    monkeypatch.setattr(validate_module.ScoreSpec, "of", staticmethod(refusing(validate_module.ScoreSpec.of)))
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 33, 4, 16) for _ in range(3))
    slopes = torch.rand(4)
    call = lambda q, k, v: flash_attention.attention(  # noqa: E731
        q, k, v, causal=True, softcap=20.0, alibi_slopes=slopes, window=(8, 0)
    )
    got = torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(got, call(q, k, v), rtol=0, atol=0)
    torch._dynamo.reset()


def test_compiled_graphs_hold_one_fwd_and_one_bwd_node_and_no_break():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    targets = {"forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            targets[kind] += [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm)

        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    model = _Block()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 13, 64)
    compiled(x).sum().backward()
    assert targets["forward"].count(FWD) == 1 and BWD not in targets["forward"]
    assert targets["backward"].count(BWD) == 1 and FWD not in targets["backward"]

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_Block())(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_inference_with_out_and_lse():
    torch._dynamo.reset()

    def f(q, k, v, buf):
        return flash_attention.attention(q, k, v, causal=True, out=buf, return_lse=True)

    q, k, v = _qkv(2, 7, 9, 4, 2, 16, requires_grad=False)
    buf = torch.empty(q.shape)
    out, lse = torch.compile(f, fullgraph=True)(q, k, v, buf)
    want_out, want_lse = attention_torch(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(buf, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
