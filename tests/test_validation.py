"""Every bad argument gets a TypeError/ValueError naming it, before anything runs; empty inputs work."""

from __future__ import annotations

import math
import re
import zlib
from unittest import mock

import pytest
import torch

import flash_attention
from flash_attention import fallback
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import dispatch
from flash_attention.spec.validate import Problem, validate


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _qkv(q_shape=(2, 16, 4, 64), kv_shape=(2, 24, 2, 64), dtype=torch.float16):
    return (
        torch.randn(q_shape).to(dtype),
        torch.randn(kv_shape).to(dtype),
        torch.randn(kv_shape).to(dtype),
    )


def _raises(exc, match, **overrides):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    kwargs = {}
    for name, value in overrides.items():
        (args if name in ("q", "k", "v") else kwargs)[name] = value
    # Validation must fire before any attention is computed: make the fallback fail loudly if reached.
    with mock.patch.object(fallback, "forward", side_effect=AssertionError("computed")):
        with pytest.raises(exc, match=match):
            flash_attention.attention(args["q"], args["k"], args["v"], **kwargs)
    # validate() itself raises the same error (forward/forward_timed call it first too).
    with pytest.raises(exc, match=match):
        validate(
            args["q"],
            args["k"],
            args["v"],
            causal=kwargs.get("causal", False),
            softmax_scale=kwargs.get("softmax_scale"),
            out=kwargs.get("out"),
        )


def test_valid_problem():
    q, k, v = _qkv()
    p = validate(q, k, v, causal=True, softmax_scale=None, out=None)
    assert p == Problem(2, 16, 24, 4, 2, 64, 0.125, True)
    assert p.group == 2 and not p.is_empty
    assert validate(q, k, v, causal=False, softmax_scale=2, out=torch.empty_like(q)).scale == 2.0
    with pytest.raises(AttributeError):
        p.batch = 3  # frozen


# ---- TypeError ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(name):
    q, k, v = _qkv()
    bad = {"q": q, "k": k, "v": v}
    bad[name] = bad[name].tolist()
    _raises(TypeError, rf"^{name} must be a torch.Tensor.*got list", **bad)


def test_out_not_a_tensor():
    _raises(TypeError, r"^out must be a torch.Tensor.*got ndarray", out=torch.randn(2, 16, 4, 64).numpy())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.complex64])
def test_dtype_not_floating(dtype):
    q, k, v = _qkv()
    q, k, v = (torch.ones(t.shape, dtype=dtype) for t in (q, k, v))
    _raises(TypeError, r"^q must be float16, bfloat16, float32 or float64; got torch\.", q=q, k=k, v=v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_accepted_dtypes(dtype):
    q, k, v = _qkv(dtype=dtype)
    assert validate(q, k, v, causal=False, softmax_scale=None, out=None).head_dim == 64


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    q, k, v = _qkv()
    bad = {name: (k if name == "k" else v).to(torch.bfloat16)}
    _raises(TypeError, rf"^{name} must have the dtype of q \(torch.float16\); got torch.bfloat16", **bad)


def test_out_dtype():
    _raises(
        TypeError,
        r"^out must have the dtype of q \(torch.float16\); got torch.float32",
        out=torch.empty(2, 16, 4, 64),
    )


@pytest.mark.parametrize("causal", [1, 0, None, "yes", torch.tensor(True)])
def test_causal_not_bool(causal):
    _raises(TypeError, r"^causal must be a bool", causal=causal)


@pytest.mark.parametrize("scale", ["0.1", True, [0.1], torch.tensor(0.1)])
def test_softmax_scale_not_a_number(scale):
    _raises(TypeError, r"^softmax_scale must be a float or None", softmax_scale=scale)


# ---- ValueError -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(2, 16, 64), (2, 16, 4, 64, 1), (64,)])
def test_rank(name, shape):
    q, k, v = _qkv()
    bad = {name: torch.randn(shape).half()}
    expected = {
        "q": "(batch, seqlen_q, heads_q, head_dim)",
        "k": "(batch, seqlen_k, heads_kv, head_dim)",
        "v": "(batch, seqlen_k, heads_kv, head_dim_v)",
    }[name]
    _raises(ValueError, "^" + re.escape(f"{name} must have shape {expected}; got {shape}"), **bad)


def test_out_rank():
    _raises(
        ValueError,
        r"^out must have shape \(batch, seqlen_q, heads_q, head_dim_v\)",
        out=torch.randn(2, 16, 256).half(),
    )


def test_batch_mismatch():
    q, k, v = _qkv(kv_shape=(3, 24, 2, 64))
    _raises(ValueError, r"^k must have the batch size of q \(2\)", q=q, k=k, v=v)


def test_head_dim_mismatch_k():
    q, k, v = _qkv(kv_shape=(2, 24, 2, 32))
    _raises(ValueError, r"^k must have the head_dim of q \(64\)", q=q, k=k, v=v)


@pytest.mark.parametrize("v_shape", [(2, 25, 2, 64), (2, 24, 1, 64), (1, 24, 2, 64)])
def test_v_shape_differs_from_k(v_shape):
    q, k, _ = _qkv()
    _raises(
        ValueError,
        r"^v must have the batch, length and heads of k \(2, 24, 2\) \(its head_dim may differ\)",
        q=q,
        k=k,
        v=torch.randn(v_shape).half(),
    )


@pytest.mark.parametrize("head_dim_v", [0, 257])
def test_v_head_dim_out_of_range(head_dim_v):
    q, k, _ = _qkv()
    _raises(
        ValueError,
        rf"^v's head_dim \(v.shape\[3\]\) must be between 1 and 256; got {head_dim_v}",
        q=q,
        k=k,
        v=torch.randn(2, 24, 2, head_dim_v).half(),
    )


@pytest.mark.parametrize("heads_q,heads_kv", [(6, 4), (4, 3), (1, 2)])
def test_heads_not_multiple(heads_q, heads_kv):
    q, k, v = _qkv((2, 16, heads_q, 64), (2, 24, heads_kv, 64))
    _raises(
        ValueError,
        rf"^q's heads \({heads_q}\) must be a multiple of k's and v's heads \({heads_kv}\)",
        q=q,
        k=k,
        v=v,
    )


def test_zero_kv_heads():
    q, k, v = _qkv((2, 16, 4, 64), (2, 24, 0, 64))
    _raises(ValueError, r"^k must have at least one head", q=q, k=k, v=v)


@pytest.mark.parametrize("head_dim", [0, 257, 264, 512])
def test_bad_head_dim(head_dim):
    q, k, v = _qkv((2, 16, 4, head_dim), (2, 24, 2, head_dim))
    msg = rf"^head_dim \(q.shape\[3\]\) must be between 1 and 256; got {head_dim}"
    _raises(ValueError, msg, q=q, k=k, v=v)


@pytest.mark.parametrize("head_dim", [1, 3, 8, 12, 24, 40, 100, 136, 250, 256])
def test_every_head_dim_up_to_256_is_accepted(head_dim):
    q, k, v = _qkv((1, 3, 2, head_dim), (1, 5, 1, head_dim), dtype=torch.float32)
    out = flash_attention.attention(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert out.shape == q.shape
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_devices_differ():
    # Only CPU exists here, so use the meta device as the "other" device: the check must fire first.
    q, k, v = _qkv()
    for name in ("k", "v"):
        bad = {name: torch.empty(k.shape, dtype=k.dtype, device="meta")}
        _raises(ValueError, rf"^{name} must be on the device of q \(cpu\); got meta", **bad)
    _raises(
        ValueError,
        r"^out must be on the device of q \(cpu\); got meta",
        out=torch.empty(q.shape, dtype=q.dtype, device="meta"),
    )


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_last_dim_not_contiguous(name):
    q, k, v = _qkv()
    shapes = {"q": q.shape, "k": k.shape, "v": k.shape, "out": q.shape}
    b, s, h, d = shapes[name]
    strided = torch.randn(b, s, h, d, 2).half()[..., 0]  # stride(-1) == 2
    assert strided.stride(-1) == 2
    _raises(
        ValueError,
        rf"^{name} must have a contiguous last dimension \({name}.stride\(-1\) == 1\)",
        **{name: strided},
    )


def test_out_wrong_shape():
    _raises(
        ValueError,
        r"^out must have the shape \(2, 16, 4, 64\) \(q's, with v's head_dim\); got \(2, 16, 2, 64\)",
        out=torch.empty(2, 16, 2, 64).half(),
    )


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 0.0, 0])
def test_bad_softmax_scale(scale):
    _raises(ValueError, r"^softmax_scale must be a finite nonzero number", softmax_scale=scale)


def test_negative_and_integer_scales_accepted():
    q, k, v = _qkv()
    assert validate(q, k, v, causal=False, softmax_scale=-0.5, out=None).scale == -0.5
    assert validate(q, k, v, causal=False, softmax_scale=3, out=None).scale == 3.0


def test_validation_runs_before_kernel_dispatch(monkeypatch):
    # Even on the kernel path, a bad argument is rejected before ops is consulted.
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)

    def boom():
        raise AssertionError("ops consulted before validation")

    monkeypatch.setattr(dispatch, "backend", boom)
    q, k, v = _qkv(kv_shape=(2, 24, 3, 64))
    with pytest.raises(ValueError, match="multiple"):
        flash_attention.attention(q, k, v)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention.forward(
            "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer", q, k, v
        )


# ---- empty inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_shape,kv_shape",
    [
        ((0, 16, 4, 64), (0, 24, 2, 64)),  # batch 0
        ((2, 0, 4, 64), (2, 24, 2, 64)),  # seqlen_q 0
        ((2, 0, 4, 64), (2, 0, 2, 64)),  # both lengths 0
        ((2, 16, 0, 64), (2, 24, 2, 64)),  # no query heads
    ],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_empty_outputs(q_shape, kv_shape, causal, dtype):
    q, k, v = _qkv(q_shape, kv_shape, dtype)
    out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q_shape and out.dtype == dtype
    assert lse.shape == (q_shape[0], q_shape[2], q_shape[1]) and lse.dtype == torch.float32
    assert flash_attention.attention(q, k, v, causal=causal).shape == q_shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_no_keys(causal, dtype):
    # seqlen_k == 0: every row attends nothing, so out is 0 and lse is -inf (not NaN), also into `out`.
    q, k, v = _qkv((2, 5, 4, 64), (2, 0, 2, 64), dtype)
    out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q))
    assert lse.shape == (2, 4, 5) and torch.isneginf(lse).all()
    buf = torch.full_like(q, float("nan"))
    res = flash_attention.attention(q, k, v, causal=causal, out=buf)
    assert res is buf and torch.equal(buf, torch.zeros_like(q))


def test_empty_scale_default_resolved():
    q, k, v = _qkv((0, 5, 4, 72), (0, 6, 2, 72))
    assert validate(q, k, v, causal=False, softmax_scale=None, out=None).scale == pytest.approx(
        1 / math.sqrt(72)
    )


# ---- rough edges --------------------------------------------------------------------------------------


def test_meta_tensors_propagate_shapes():
    # Shape propagation (model tracing, init on the meta device) must not read any value.
    q = torch.empty(2, 8, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 9, 2, 64, device="meta", dtype=torch.bfloat16)
    out, lse = flash_attention.attention(q, k, k, causal=True, return_lse=True)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 4, 8)
    kr = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    assert flash_attention.attention(q, k, k, key_range=kr, dropout_p=0.1).shape == q.shape
    qg = q.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(flash_attention.attention(qg, k, k).sum(), qg)
    assert g.shape == q.shape and g.device.type == "meta"


def test_dropout_seed_out_of_range_names_the_argument():
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^dropout_seed must be in \[-2\*\*63, 2\*\*63\)"):
        flash_attention.attention(q, k, v, dropout_p=0.1, dropout_seed=2**70)
    assert flash_attention.attention(q, k, v, dropout_p=0.1, dropout_seed=-(2**63)).shape == q.shape


def test_nested_tensors_get_our_error():
    nt = torch.nested.nested_tensor([torch.randn(3, 4, 64), torch.randn(5, 4, 64)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"^q must be a dense \(strided\) tensor .* got a nested tensor"):
        flash_attention.attention(nt, nt, nt)
