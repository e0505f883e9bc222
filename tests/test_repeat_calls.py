"""Repeat calls (flash_attention/ops/repeat.py) on the CPU, through the stand-in GPU of tests/stand_in_gpu.py.

A call whose signature ran before skips validation and planning and goes straight to its launch; these tests
check that such calls compute what the whole path computes (fresh inputs at new addresses each time, against
float64 references, forward and gradients), that every difference in what the checks and plans depend on
makes a new signature, and that anything a signature cannot fix (an address's alignment, the debug build's
variable) or the checks must see (arguments of other types, bad input) still takes the whole path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import zlib

import pytest
import torch
from stand_in_gpu import install

import flash_attention as fa
from flash_attention import ops
from flash_attention.api.varlen import segments
from flash_attention.configs import heuristics
from flash_attention.fallback.reference import attention_reference
from flash_attention.jit import host
from flash_attention.ops import forward, repeat, select


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["sm_90-python", "sm_80-python", "sm_90-native", "sm_80-native"])
def gpu(request, monkeypatch):
    """The stand-in GPU of an H100 (the TMA kernels: q, k and v read through tensor maps) or an A100, with
    repeat calls in Python or in the host library (skipped where it cannot be built)."""
    arch, mode = request.param.split("-")
    monkeypatch.setattr(repeat, "MODE", mode)
    stand_in = install(monkeypatch, arch)
    if mode == "native" and host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    yield stand_in
    ops.clear_plans()


def _repeat_type():
    return repeat.NativeRepeatCall if repeat.MODE == "native" else repeat.RepeatCall


def _inputs(b=2, sq=37, sk=45, hq=4, hkv=2, d=64, grad=False, dtype=torch.bfloat16):
    return tuple(
        torch.randn(b, s, h, d, dtype=dtype).requires_grad_(grad) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )


def _check_forward(out, q, k, v, lse=None, **kwargs):
    ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    assert (out.double() - ref).abs().max().item() < 2e-2
    if lse is not None:
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def _check_grads(grads, q, k, v, dout, **kwargs):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, **kwargs)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for name, got, w in zip("qkv", grads, want, strict=True):
        assert got.dtype == q.dtype and got.shape == w.shape, name
        assert (got.double() - w).abs().max().item() < 3e-2 * (1 + w.abs().max().item()), f"d{name}"


@pytest.mark.parametrize("causal", [False, True])
def test_inference_repeats_compute_what_the_first_call_did(gpu, validations, causal):
    for _ in range(4):
        q, k, v = _inputs()  # fresh tensors at new addresses every time
        out, lse = fa.attention(q, k, v, causal=causal, return_lse=True)
        _check_forward(out, q, k, v, lse, causal=causal)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward"] * 4 and not gpu.errors, gpu.errors
    if repeat.MODE == "native" and gpu.arch == "sm_90":
        assert gpu.encodes >= 3  # the host library encoded the maps of the repeats' own addresses


def test_tma_store_configs_write_the_output_through_its_map(gpu, validations, monkeypatch, request):
    # The stand-in kernel writes O through the output's tensor map when the params carry one, and checks
    # its address against the params': each call's fresh output must get a map of its own.
    if gpu.arch != "sm_90":
        pytest.skip("the TMA kernels are Hopper's")
    real = heuristics._hopper_default
    monkeypatch.setattr(heuristics, "_hopper_default", lambda *args: real(*args).replace(tma_store=True))
    # The heuristic's picks are cached: earlier tests' must not serve this one, nor this one's outlive it.
    heuristics.default_config.cache_clear()
    request.addfinalizer(heuristics.default_config.cache_clear)
    ops.clear_plans()
    outs = []
    for _ in range(4):
        q, k, v = _inputs()
        out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
        _check_forward(out, q, k, v, lse, causal=True)
        outs.append(out)  # kept alive: the next output lands at another address
    assert len({o.data_ptr() for o in outs}) == 4
    assert len(validations) == 1 and gpu.launches == ["forward"] * 4 and not gpu.errors, gpu.errors
    assert gpu.output_maps == 4
    if repeat.MODE == "native":
        assert gpu.encodes >= 3 + 3 + 3  # q, k and v at new addresses, and o, on every repeat


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_training_repeats_record_the_node_and_give_exact_gradients(gpu, validations, causal, deterministic):
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    for _ in range(3):
        q, k, v = _inputs(grad=True)
        out = fa.attention(q, k, v, causal=causal, deterministic=deterministic)
        assert out.grad_fn.name() == "FlashAttentionBackward"
        _check_forward(out, q, k, v, causal=causal)
        dout = torch.randn_like(out)
        _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, causal=causal)
    assert len(validations) == 1
    assert not gpu.errors, gpu.errors
    # Deterministic on Hopper: the warp-specialized kernel adds dQ in a fixed order itself, then the cast.
    det = ["pre", "dkdv_det", "convert" if gpu.arch == "sm_90" else "dq"]
    last = det if deterministic else ["pre", "dkdv", "convert"]
    assert gpu.launches == (["forward"] + last) * 3


@pytest.mark.parametrize("switch", ["1", "0", None])
def test_a_backwards_later_launches_are_programmatic_on_hopper(gpu, validations, switch, monkeypatch):
    # On sm_90 the dK/dV launch and the cast after it may start before the kernel ahead of them has finished
    # (their entry points wait for it: fa/grid_dependency.cuh): by default since kernel log 122 measured it,
    # and not with FLASH_ATTENTION_PDL=0. The preprocessing kernel and the forward are ordinary launches,
    # and on sm_80 every launch is (griddepcontrol is sm_90's).
    if switch is None:
        monkeypatch.delenv("FLASH_ATTENTION_PDL", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_PDL", switch)
    q, k, v = _inputs(grad=True)
    out = fa.attention(q, k, v, causal=True)
    gpu.programmatic.clear()
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not gpu.errors, gpu.errors
    later = gpu.arch == "sm_90" and switch != "0"
    assert gpu.programmatic == [("pre", False), ("dkdv", later), ("convert", later)]


# A sliding window and soft-capping are values of the plans: their calls repeat, through the window and
# soft-capping builds (the stand-in kernels compute them from the bounds and the cap in the params).
_VARIANTS = [
    dict(window=(7, 0), causal=True),
    dict(window=[5, 9]),
    dict(softcap=5.0),
    dict(softcap=3, window=(6, 2)),
]


@pytest.mark.parametrize("variant", _VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in sorted(v)))
def test_windows_and_softcapping_repeat(gpu, validations, variant):
    ref = {**variant, "window": tuple(variant["window"])} if "window" in variant else variant
    for _ in range(3):
        q, k, v = _inputs()
        out, lse = fa.attention(q, k, v, return_lse=True, **variant)
        _check_forward(out, q, k, v, lse, **ref)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward"] * 3 and not gpu.errors, gpu.errors


def test_each_window_and_cap_makes_a_new_signature(gpu, validations):
    q, k, v = _inputs()
    calls = [dict(window=(7, 0)), dict(window=(8, 0)), dict(window=(7, 1))]
    calls += [dict(softcap=5.0), dict(softcap=6.0)]
    for kwargs in calls * 2:
        _check_forward(fa.attention(q, k, v, **kwargs), q, k, v, **kwargs)
    assert len(validations) == len(calls)
    assert not gpu.errors, gpu.errors


# ALiBi's slopes and the sinks are bound per launch: each call's own tensors (fresh ones at new addresses
# here, so a repeat that kept the first call's would read the wrong values).
_BOUND = [
    dict(alibi=(4,), causal=True),
    dict(alibi=(2, 4)),
    dict(alibi=(4,), softcap=4.0, window=(9, 3)),
    dict(sinks=True, causal=True),
    dict(sinks=True, alibi=(4,)),
]


def _bound_args(variant: dict) -> dict:
    kwargs = {n: variant[n] for n in ("causal", "softcap", "window") if n in variant}
    if "alibi" in variant:
        kwargs["alibi_slopes"] = torch.rand(variant["alibi"]) * 0.5
    if variant.get("sinks"):
        kwargs["sinks"] = torch.randn(4)
    return kwargs


def _repeat_with_fresh_tensors(variant: dict, validations: list, calls: int = 3) -> None:
    """``calls`` inference calls of one signature, each with fresh inputs, slopes and sinks, against float64;
    only the first may run the whole path."""
    for _ in range(calls):
        q, k, v = _inputs()
        kwargs = _bound_args(variant)
        out, lse = fa.attention(q, k, v, return_lse=True, **kwargs)
        _check_forward(out, q, k, v, lse, **kwargs)
    assert len(validations) == 1, "the repeats should not run the whole path"


@pytest.mark.parametrize("variant", _BOUND, ids=lambda v: "-".join(f"{k}{v[k]}" for k in sorted(v)))
def test_alibi_and_sinks_repeat_with_each_calls_tensors(gpu, validations, variant):
    _repeat_with_fresh_tensors(variant, validations)
    assert gpu.launches == ["forward"] * 3 and not gpu.errors, gpu.errors


@pytest.mark.parametrize(
    "variant",
    [_VARIANTS[0], _VARIANTS[3], *_BOUND[:3]],
    ids=["window", "softcap-window", "alibi", "alibi-batch", "alibi-softcap-window"],
)
def test_training_with_variants_repeats_and_binds_the_slopes_for_the_backward(gpu, validations, variant):
    # (the window's bounds and the cap travel in the backward plan; the node binds each call's slopes)
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    for _ in range(3):
        q, k, v = _inputs(grad=True)
        kwargs = _bound_args(variant)
        out = fa.attention(q, k, v, **kwargs)
        assert out.grad_fn.name() == "FlashAttentionBackward"
        _check_forward(out, q, k, v, **kwargs)
        dout = torch.randn_like(out)
        _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, **kwargs)
    assert len(validations) == 1
    assert gpu.launches == ["forward", "pre", "dkdv", "convert"] * 3 and not gpu.errors, gpu.errors


def test_sinks_the_kernels_cannot_read_as_given_take_the_whole_path(gpu, validations):
    q, k, v = _inputs()
    for sinks in (torch.randn(4, dtype=torch.float64), torch.randn(8)[::2]):
        for _ in range(2):
            out, lse = fa.attention(q, k, v, sinks=sinks, return_lse=True)
            _check_forward(out, q, k, v, lse, sinks=sinks.float())
    assert len(validations) == 4


@pytest.mark.parametrize("grads", ["qkv_sinks", "sinks_only"])
def test_training_with_sinks_repeats_and_the_node_gives_the_sinks_their_gradient(
    gpu, validations, monkeypatch, grads
):
    # The sinks are an input of the compiled node (ops.training): their gradient comes from the
    # preprocessing kernel's D rows and the saved LSE after the backward's launches, and repeats hand each
    # call's sinks to the node. (The stand-in backward kernels compute dq, dk and dv of the sink-free
    # attention: those are checked against the Python function's, which runs the same stand-ins, bit for
    # bit; the sinks' gradient, which needs only D and the LSE, against float64.)
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    kw = dict(causal=True, window=(20, 0))
    calls = []
    for _ in range(3):
        q, k, v = _inputs(grad=grads == "qkv_sinks")
        calls.append((q, k, v, torch.randn(4, requires_grad=True), torch.randn(2, 37, 4, 64)))

    def run(q, k, v, sinks, dout):
        out = fa.attention(q, k, v, sinks=sinks, **kw)
        leaves = (q, k, v, sinks) if q.requires_grad else (sinks,)
        return out, torch.autograd.grad(out, leaves, dout.to(out.dtype))

    through_node = [run(*c) for c in calls]
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward", "pre", "dkdv", "convert"] * 3 and not gpu.errors, gpu.errors
    for (q, k, v, sinks, dout), (out, got) in zip(calls, through_node, strict=True):
        assert out.grad_fn.name() == "FlashAttentionBackward"
        _check_forward(out, q, k, v, sinks=sinks.detach(), **kw)
        # d sink = -sum over batch and rows of exp(sink - lse'_i) D_i, D_i = dO_i . O'_i with the call's own
        # (bf16) O' as the kernels read it, the LSE in float64 (flash_attention/sinks.py derives it).
        _, lse = attention_reference(q.detach(), k.detach(), v.detach(), sinks=sinks.detach(), **kw)
        d = (dout.to(q.dtype).double() * out.detach().double()).sum(-1).transpose(1, 2)
        want = -(torch.exp(sinks.detach().double()[None, :, None] - lse) * d).sum((0, 2))
        assert got[-1].dtype == sinks.dtype and got[-1].shape == sinks.shape
        torch.testing.assert_close(got[-1].double(), want, rtol=1e-5, atol=1e-5)

    ops.clear_plans()
    monkeypatch.setattr(host, "ops_or_none", lambda: None)  # the Python autograd function's path
    for call, (_, got) in zip(calls, through_node, strict=True):
        out, python = run(*call)
        assert out.grad_fn.name() != "FlashAttentionBackward"
        for a, b in zip(got, python, strict=True):
            assert torch.equal(a, b)


def test_pytorchs_deterministic_switch_makes_another_signature(gpu, validations):
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    q, k, v = _inputs(grad=True)
    fa.attention(q, k, v).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        fa.attention(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(validations) == 2
    assert gpu.launches[4:] == ["forward", "pre", "dkdv_det", "convert" if gpu.arch == "sm_90" else "dq"]


def test_without_the_host_library_training_takes_the_python_function(gpu, validations, monkeypatch):
    monkeypatch.setattr(host, "ops_or_none", lambda: None)
    for _ in range(2):
        q, k, v = _inputs(grad=True)
        out = fa.attention(q, k, v, causal=True)
        assert out.grad_fn.name() != "FlashAttentionBackward"
        dout = torch.randn_like(out)
        _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, causal=True)
    assert len(validations) == 2  # its signature is remembered as one of the whole path


def test_key_ranges_repeat_when_int32(gpu, validations):
    for dtype, whole_path_calls in ((torch.int32, 1), (torch.int64, 3)):
        validations.clear()
        for _ in range(3):
            q, k, v = _inputs()
            kr = torch.tensor([[3, 40], [0, 17]], dtype=dtype)
            out = fa.attention(q, k, v, causal=True, key_range=kr)
            _check_forward(out, q, k, v, causal=True, key_range=kr)
        assert len(validations) == whole_path_calls, dtype


def test_training_with_key_ranges_repeats(gpu, validations):
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    for _ in range(3):
        q, k, v = _inputs(grad=True)
        kr = torch.tensor([[3, 40], [0, 17]], dtype=torch.int32)
        out = fa.attention(q, k, v, causal=True, key_range=kr)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        _check_grads(grads, q, k, v, dout, causal=True, key_range=kr)
    assert len(validations) == 1 and not gpu.errors


def test_each_difference_makes_a_new_signature(gpu, validations):
    q, k, v = _inputs()
    calls = [
        dict(),
        dict(causal=True),
        dict(softmax_scale=0.3),
        dict(return_lse=True),
        dict(key_range=torch.tensor([[0, 45], [1, 45]], dtype=torch.int32)),
    ]
    for kwargs in calls * 2:
        result = fa.attention(q, k, v, **kwargs)
        out, lse = result if kwargs.get("return_lse") else (result, None)
        check = {n: kwargs[n] for n in ("causal", "softmax_scale", "key_range") if n in kwargs}
        _check_forward(out, q, k, v, lse, **check)
    # Other layouts, head counts and lengths of the same data.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    _check_forward(fa.attention(qt, kt, vt), q, k, v)
    _check_forward(fa.attention(q, k[:, :, :1], v[:, :, :1]), q, k[:, :, :1], v[:, :, :1])
    _check_forward(fa.attention(q[:, :20], k, v), q[:, :20], k, v)
    assert len(validations) == len(calls) + 3


def test_a_misaligned_repeat_takes_the_whole_path(gpu, validations):
    q, k, v = _inputs()
    fa.attention(q, k, v)
    base = torch.randn(q.numel() + 1, dtype=q.dtype)
    shifted = base[1:].view(q.shape)  # q's strides, at an address 2 bytes off 16
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    _check_forward(fa.attention(shifted, k, v), shifted, k, v)
    assert len(validations) == 2
    _check_forward(fa.attention(q, k, v), q, k, v)
    assert len(validations) == 2  # the signature still repeats for aligned calls


def test_a_misaligned_first_call_leaves_its_signature_to_repeat_later(gpu, validations):
    # The plan encodes its tensor maps on the first call's addresses, which the driver refuses unless 16-byte
    # aligned (the stand-in too): that call takes the whole path and the next aligned one makes the repeat.
    q, k, v = _inputs()
    base = torch.randn(q.numel() + 1, dtype=q.dtype)
    shifted = base[1:].view(q.shape)
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    _check_forward(fa.attention(shifted, k, v), shifted, k, v)
    _check_forward(fa.attention(q, k, v), q, k, v)
    assert len(validations) == 2  # both calls validated: the first made no repeat call
    _check_forward(fa.attention(q, k, v), q, k, v)
    assert len(validations) == 2  # the second made it, and the third repeated


def test_bad_input_is_still_refused_after_a_signature_repeats(gpu):
    q, k, v = _inputs()
    fa.attention(q, k, v)
    fa.attention(q, k, v, causal=True, softmax_scale=1.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fa.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        fa.attention(q, k, v, causal=True, softmax_scale=True)  # equal to 1.0 as a key, not as an argument
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        fa.attention(q, k, v, dropout_p=False)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fa.attention(q, k, v, deterministic=0)
    with pytest.raises(TypeError, match="dropout_seed must be an int"):
        fa.attention(q, k, v, dropout_seed="7")
    with pytest.raises(ValueError, match="key_range must have shape"):
        fa.attention(q, k, v, key_range=torch.zeros(3, 2, dtype=torch.int32))


def test_tensor_subclasses_and_out_take_the_whole_path(gpu, validations):
    q, k, v = _inputs()
    fa.attention(q, k, v)
    p = torch.nn.Parameter(q.clone(), requires_grad=False)
    _check_forward(fa.attention(p, k, v), q, k, v)
    out = torch.full_like(q, float("nan"))
    assert fa.attention(q, k, v, out=out) is out
    _check_forward(out, q, k, v)
    assert len(validations) == 3


def test_the_debug_build_variable_stops_a_repeat(gpu, monkeypatch):
    q, k, v = _inputs()
    fa.attention(q, k, v)
    call = repeat.lookup(repeat.signature(q, k, v, False, None, False, None, False, 0.0, None))
    assert isinstance(call, _repeat_type())
    monkeypatch.setenv("FLASH_ATTENTION_TRACE", "0,0,0,0")
    assert call(q, k, v, None) is None


def test_clearing_the_plans_forgets_the_repeat_calls(gpu):
    q, k, v = _inputs()
    key = repeat.signature(q, k, v, False, None, False, None, False, 0.0, None)
    fa.attention(q, k, v)
    assert isinstance(repeat.lookup(key), _repeat_type())
    ops.clear_plans()
    assert repeat.lookup(key) is None


def test_a_fallback_signature_is_remembered_as_the_whole_path():
    q, k, v = _inputs(dtype=torch.float32)  # CPU float32: PyTorch's path, no stand-in GPU
    for _ in range(2):
        _check_forward(fa.attention(q, k, v), q, k, v)
    key = repeat.signature(q, k, v, False, None, False, None, False, 0.0, None)
    assert repeat.lookup(key) is repeat.WHOLE_PATH


def test_the_signature_covers_what_the_checks_read():
    q, k, v = _inputs()

    def sig(q=q, k=k, v=v, causal=False, scale=None, lse=False, kr=None, det=False, p=0.0, seed=None, **kw):
        scores = (("softcap", kw.pop("softcap")),) if "softcap" in kw else ()
        return repeat.signature(q, k, v, causal, scale, lse, kr, det, p, seed, score_values=scores, **kw)

    assert sig() == sig() and hash(sig()) == hash(sig())
    variants = [
        sig(causal=True), sig(scale=0.5), sig(lse=True), sig(q=q.half(), k=k.half(), v=v.half()),
        sig(k=k[:, :40], v=v[:, :40]), sig(q=q.transpose(1, 2).contiguous().transpose(1, 2)),
        sig(kr=torch.zeros(2, 2, dtype=torch.int32)), sig(kr=torch.zeros(2, 2, dtype=torch.int64)),
        sig(window=(3, 0)), sig(window=(3, 1)), sig(softcap=2.0), sig(softcap=2.0, window=(3, 0)),
    ]  # fmt: skip
    assert all(s is not None and s != sig() for s in variants)
    assert len(set(variants)) == len(variants)
    qg, kg, vg = _inputs(grad=True)
    assert sig(qg, kg, vg) != sig(qg, kg, vg, det=True)  # the backward's mode, when autograd records
    with torch.no_grad():
        assert sig(qg, kg, vg) == sig(qg, kg, vg, det=True)
    for none in (
        sig(p=0.1), sig(p=False), sig(seed=3), sig(causal=1), sig(scale=True), sig(scale=1), sig(det=None),
        sig(q=q.float().numpy()), sig(q=torch.nn.Parameter(q)), sig(kr=[[0, 1], [0, 1]]),
        sig(q=torch.zeros(2, 37, 4, 64).to_sparse()),
        sig(window=(3, 0.0)), sig(window=(3, True)), sig(window=(3,)), sig(window="3, 0"),
        sig(softcap=True), sig(softcap=torch.tensor(2.0)), sig(softcap=10**400),
    ):  # fmt: skip
        assert none is None
    # What the checks read the same is the same signature: a list and a tuple window, an int and a float cap.
    assert sig(window=[3, 0]) == sig(window=(3, 0)) and sig(softcap=2) == sig(softcap=2.0)
    assert sig(softcap=0.0) == sig() == sig(window=None)


def test_the_switch_sends_every_call_down_the_whole_path(gpu, validations, monkeypatch):
    monkeypatch.setattr(repeat, "MODE", "off")
    for _ in range(3):
        q, k, v = _inputs()
        _check_forward(fa.attention(q, k, v, causal=True), q, k, v, causal=True)
    assert len(validations) == 3
    assert repeat.signature(q, k, v, True, None, False, None, False, 0.0, None) is None


def test_a_forward_program_checks_what_it_is_given():
    from flash_attention.jit import host
    from flash_attention.jit.params import FwdParams

    try:
        host.load(connect_driver=False)
    except host.HostLibraryUnavailable as exc:
        pytest.skip(f"no host library here: {exc}")
    program = torch.classes.flash_attention_host.ForwardProgram
    size = ctypes.sizeof(FwdParams)
    params = torch.zeros(size, dtype=torch.uint8)
    good = dict(
        offsets=[0, 8, 16, 24, 32, 40], launch=[0x1234, 1, 1, 1, 128, 0, 0], maps=[], flags=[1, 0, 3, 3, 0],
        bound=[48],
    )  # fmt: skip

    def make(**changes):
        a = {**good, **changes}
        return program(params, a["offsets"], a["launch"], "k", 1, [], a["maps"], a["flags"], 0, a["bound"])

    make()  # the good one is accepted
    for changes, words in (
        (dict(offsets=[0, 8, 16]), "offsets"),
        (dict(offsets=[0, 8, 16, 24, 32, size - 4]), "outside the params"),
        (dict(launch=[0x1234, 1, 1]), "seven integers"),
        (dict(launch=[0x1234, 1, 1, 1, 128, 0, 0] * 2), "one launch"),
        (dict(maps=[0] * 12), "12 integers each, three"),
        (dict(maps=[size - 64] + [1] * 11 + [0] * 24), "tensor map outside the params"),
        (dict(flags=[1, 0, 3]), "five encode flags"),
        (dict(bound=[size - 4]), "outside the params"),
    ):
        with pytest.raises(RuntimeError, match=words):
            make(**changes)
    with pytest.raises(RuntimeError, match="uint8"):
        program(params.float(), good["offsets"], good["launch"], "k", 1, [], [], good["flags"], 0, [])


def _packed(lens, hq=4, hkv=2, d=64, grad=False):
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, dtype=torch.bfloat16).requires_grad_(grad) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _check_packed(out, lse, q, k, v, cu, causal):
    """Each sequence against its own float64 attention."""
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if b == a:
            continue
        ref, ref_lse = attention_reference(
            *(t[a:b].unsqueeze(0) for t in (q.detach(), k.detach(), v.detach())), causal=causal
        )
        assert (out[a:b].double() - ref[0]).abs().max().item() < 2e-2
        torch.testing.assert_close(lse[:, a:b].double(), ref_lse[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_inference_repeats_bind_each_calls_runs_and_tiles(gpu, validations, causal):
    # Four packed batches of the same token count and sequence-count bucket (4) but other boundaries, so one
    # signature: each repeat must bind its own runs (and, on Hopper, its own query-tile table, which the
    # stand-in checks covers every row once) or some sequence sees another's keys.
    batches = ([100, 7, 50, 43], [1, 199, 0, 0], [60, 60, 0, 80], [33, 67, 99, 1])
    for lens in batches:
        q, k, v, cu = _packed(lens)
        out, lse = fa.attention_varlen(
            q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128, causal=causal, return_lse=True
        )
        _check_packed(out, lse, q, k, v, cu, causal)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert gpu.launches == ["forward"] * len(batches) and not gpu.errors, gpu.errors


def test_packed_batches_repeat_per_plan_in_inference_and_training(gpu, validations):
    q, k, v, cu = _packed([100, 100])
    for hint in (128, 128, 2048):  # the hint chooses the plan's config: a new signature
        fa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=hint, max_seqlen_k=hint, causal=True)
    assert len(validations) == 2
    q, k, v, cu = _packed([30] * 9)  # nine sequences: another count bucket (16), another plan
    fa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128, causal=True)
    assert len(validations) == 3
    # Training repeats too, as its own signature (the node's backward plan and tables).
    q, k, v, cu = _packed([100, 100], grad=True)
    runs = segments(cu, cu, 200, 200, causal=True)
    args = (
        True,
        None,
        False,
        None,
        False,
        0.0,
        None,
    )  # causal, scale, lse, key_range, deterministic, dropout
    training = repeat.signature(q, k, v, *args, segments=runs)
    with torch.no_grad():
        inference = repeat.signature(q, k, v, *args, segments=runs)
    assert None not in (training, inference) and training != inference
    assert repeat.signature(
        q.detach(), k.detach(), v.detach(), *args, segments=(runs[0], runs[1].long())
    ) != (
        repeat.signature(q.detach(), k.detach(), v.detach(), *args, segments=runs)
    )  # the runs' layouts are the signature's


@pytest.mark.parametrize("causal", [False, True])
def test_packed_training_repeats_bind_each_calls_runs_and_tables(gpu, validations, causal):
    # Training steps on four packed batches of one signature (same token count and sequence-count bucket,
    # other boundaries): the forward binds each call's runs and query tiles, and the node each call's runs,
    # key tiles and workspace units (the stand-in's backward walks them as the kernels do: a table of
    # another batch reads delta and adds dQ at other rows). Gradients per sequence against float64.
    batches = ([100, 7, 50, 43], [1, 199, 0, 0], [60, 60, 0, 80], [33, 67, 99, 1])
    for lens in batches:
        q, k, v, cu = _packed(lens, grad=True)
        out = fa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128, causal=causal)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            if b == a:
                continue
            leaves = [t[a:b].detach().double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
            ref, _ = attention_reference(*leaves, causal=causal)
            assert (out[a:b].double() - ref[0]).abs().max().item() < 2e-2
            exact = torch.autograd.grad(ref, leaves, dout[a:b].double().unsqueeze(0))
            for name, got, want in zip("qkv", grads, exact, strict=True):
                err = (got[a:b].double() - want[0]).abs().max().item()
                assert err < 5e-2, f"{lens} sequence [{a}, {b}) d{name}: {err:.3g}"
    assert len(validations) == 1, "the repeats should not run the whole path"
    steps = ["forward", "pre", "dkdv", "convert"] if gpu.arch == "sm_90" else None
    if steps is not None:  # (the warp-specialized backward's packed plan: a key-tile table)
        assert gpu.launches == steps * len(batches), gpu.launches
        assert gpu.key_tile_walks == len(batches)
    assert not gpu.errors, gpu.errors


def test_packed_training_with_sinks_reads_each_rows_d_where_the_workspace_holds_it(gpu, validations):
    # A packed batch's backward lays its workspace out by sequence (the key-tile plans): the node reads the
    # D rows for the sinks' gradient back by each row's place (ops.training.sink_rows), on repeats too.
    # Against the gradient's formula in float64 over the call's own output (flash_attention/sinks.py).
    if host.ops_or_none() is None:
        pytest.skip("no host library here (no C++ compiler)")
    for lens in ([100, 7, 50, 43], [60, 60, 0, 80], [33, 67, 99, 1]):
        q, k, v, cu = _packed(lens, grad=True)
        sinks = torch.randn(4, requires_grad=True)
        out = fa.attention_varlen(q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128, causal=True,
                                  sinks=sinks)  # fmt: skip
        assert out.grad_fn.next_functions[0][0].name() == "FlashAttentionBackward"  # (under the squeeze)
        dout = torch.randn_like(out)
        (dsinks,) = torch.autograd.grad(out, sinks, dout)
        want = torch.zeros(4, dtype=torch.float64)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            if b == a:
                continue
            seq = [t[a:b].detach().unsqueeze(0) for t in (q, k, v)]
            _, lse = attention_reference(*seq, causal=True, sinks=sinks.detach())
            d = (dout[a:b].double() * out[a:b].detach().double()).sum(-1).T.unsqueeze(0)
            want -= (torch.exp(sinks.detach().double()[None, :, None] - lse) * d).sum((0, 2))
        torch.testing.assert_close(dsinks.double(), want, rtol=1e-5, atol=1e-5)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert not gpu.errors, gpu.errors
    if gpu.arch == "sm_90":
        assert gpu.key_tile_walks == 3  # (the plan lays its workspace out by sequence: sink_rows is used)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_packed_alibi_without_causal_repeats_bind_each_calls_diagonals(gpu, validations, grad):
    # ALiBi without causal over other query and key counts: the segments carry each row's diagonal (the
    # "alibi_table" build), which every repeat must bind with the runs, in the forward and in the node.
    # Four batches of one signature (same totals and sequence-count bucket), other boundaries each.
    batches = (([100, 7, 50, 43], [120, 3, 60, 17]), ([1, 199, 0, 0], [50, 100, 0, 50]),
               ([60, 60, 0, 80], [10, 100, 0, 90]), ([33, 67, 99, 1], [40, 40, 100, 20]))  # fmt: skip
    slopes = torch.linspace(0.05, 0.6, 4)
    for lens_q, lens_k in batches:
        q = torch.randn(200, 4, 64, dtype=torch.bfloat16).requires_grad_(grad)
        k, v = (torch.randn(200, 2, 64, dtype=torch.bfloat16).requires_grad_(grad) for _ in "kv")
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                      for n in (lens_q, lens_k))  # fmt: skip
        out = fa.attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=128, max_seqlen_k=128, causal=False, alibi_slopes=slopes
        )
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout) if grad else None
        _check_each_sequence_alibi(out, grads, dout, (q, k, v), (cu_q, cu_k), (lens_q, lens_k), False, slopes)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert not gpu.errors, gpu.errors


def _check_each_sequence_alibi(out, grads, dout, qkv, offsets, lengths, causal, slopes):
    """A packed ALiBi call's output (and gradients, unless None) against each sequence alone in float64,
    with ``slopes`` (heads,) or each sequence's own (batch, heads)."""
    (q, k, v), (cu_q, cu_k), (lens_q, lens_k) = qkv, offsets, lengths
    for i, (m, n) in enumerate(zip(lens_q, lens_k, strict=True)):
        if m == 0 or n == 0:
            continue
        qs, ks = slice(int(cu_q[i]), int(cu_q[i]) + m), slice(int(cu_k[i]), int(cu_k[i]) + n)
        pieces = ((q, qs), (k, ks), (v, ks))
        leaves = [t[s].detach().double().unsqueeze(0).requires_grad_() for t, s in pieces]
        own = (slopes if slopes.dim() == 1 else slopes[i]).double()
        ref, _ = attention_reference(*leaves, causal=causal, alibi_slopes=own)
        assert (out[qs].double() - ref[0]).abs().max().item() < 2e-2, (lens_q, lens_k, i)
        if grads is not None:
            exact = torch.autograd.grad(ref, leaves, dout[qs].double().unsqueeze(0))
            for name, got, want, s in zip("qkv", grads, exact, (qs, ks, ks), strict=True):
                err = (got[s].double() - want[0]).abs().max().item()
                bound = 2**-7 * want.abs().max().item() + 1e-2  # (bf16 rounding of the sums)
                assert err < bound, f"{lens_q} sequence {i} d{name}: {err:.3g}"


@pytest.mark.parametrize("form", ["table", "runs", "self"])
def test_per_sequence_alibi_repeats_bind_each_calls_slopes(gpu, validations, form):
    # Slopes of each sequence's own reach the kernels as a table of each row's (the "..._rows" builds),
    # made at every call: every repeat must bind the call's table (new slopes each call here) and its
    # diagonals (table: without causal; runs: causal; self: packed self-attention without causal).
    causal = form == "runs"
    batches = (([100, 7, 50, 43], [120, 3, 60, 17]), ([1, 199, 0, 0], [50, 100, 0, 50]),
               ([60, 60, 0, 80], [10, 100, 0, 90]))  # fmt: skip
    if form == "self":
        batches = tuple((lens_q, lens_q) for lens_q, _ in batches)
    for lens_q, lens_k in batches:
        slopes = torch.rand(4, 4) * 0.6 + 0.02
        q = torch.randn(200, 4, 64, dtype=torch.bfloat16).requires_grad_()
        k, v = (torch.randn(200, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in "kv")
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                      for n in (lens_q, lens_k))  # fmt: skip
        if form == "self":
            cu_k = cu_q  # (one offsets tensor)
        out = fa.attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=128, max_seqlen_k=128, causal=causal, alibi_slopes=slopes
        )
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        lengths = (lens_q, lens_k)
        _check_each_sequence_alibi(out, grads, dout, (q, k, v), (cu_q, cu_k), lengths, causal, slopes)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert not gpu.errors, gpu.errors


def test_a_persistent_grid_repeats_with_the_current_streams_tile_counter(gpu, validations, monkeypatch):
    # A packed batch at head_dim 128 whose sequences are about 512 tokens runs the persistent grid on an
    # H100: each launch must take the tile counter the whole path's launch would (the current stream's).
    if gpu.arch != "sm_90":
        pytest.skip("the persistent grid is the warp-specialized kernel's")
    given = []

    def counter(device):
        given.append(torch.zeros(2, dtype=torch.int32))
        return given[-1]

    monkeypatch.setattr(forward, "stream_tile_counter", counter)
    for lens in ([300, 512, 212], [512, 512, 0], [100, 400, 524]):
        q, k, v, cu = _packed(lens, hq=16, hkv=8, d=128)  # (16 heads: more tiles than SMs)
        out, lse = fa.attention_varlen(
            q, k, v, cu, cu, max_seqlen_q=512, max_seqlen_k=512, causal=True, return_lse=True
        )
        _check_packed(out, lse, q, k, v, cu, True)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert len(given) == 3 and gpu.counters == [t.data_ptr() for t in given], "a stale or missing counter"


@pytest.fixture
def forced_persistent(gpu, monkeypatch, request):
    """The persistent grid forced on small problems (the heuristic gives it to large ones), with fewer SMs
    than tiles, so that the tile counter hands the tiles out."""
    if gpu.arch != "sm_90":
        pytest.skip("the persistent grid is the warp-specialized kernel's")
    real = heuristics._hopper_default
    monkeypatch.setattr(heuristics, "_hopper_default", lambda *args: real(*args).replace(persistent=True))
    # (a narrow window's own small config is not persistent: ops.select.narrow_window_config kept out)
    monkeypatch.setattr(select, "NARROW_WINDOW_MAX_KEYS", 0)
    monkeypatch.setattr(forward, "sm_count", lambda index: 2)
    heuristics.default_config.cache_clear()
    request.addfinalizer(heuristics.default_config.cache_clear)
    ops.clear_plans()
    return gpu


def test_persistent_grids_repeat_in_training_with_each_calls_counter(
    forced_persistent, validations, monkeypatch
):
    # Eager training: the node records with its own bound tensors (none here) while the forward binds the
    # counter.
    gpu = forced_persistent
    given = []

    def counter(device):
        given.append(torch.zeros(2, dtype=torch.int32))
        return given[-1]

    monkeypatch.setattr(forward, "stream_tile_counter", counter)
    for _ in range(3):
        q, k, v = _inputs(grad=True)
        out = fa.attention(q, k, v, causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        _check_grads(grads, q, k, v, dout, causal=True)
    assert len(validations) == 1, "the repeats should not run the whole path"
    assert len(given) == 3 and gpu.counters == [t.data_ptr() for t in given], "a stale or missing counter"


@pytest.mark.parametrize("variant", _BOUND, ids=lambda v: "-".join(f"{k}{v[k]}" for k in sorted(v)))
def test_persistent_grids_bind_the_counter_after_the_variants_tensors(
    forced_persistent, validations, variant
):
    # Slopes and sinks bound per call beside the counter: each in its own field (the order of _native's
    # offsets).
    gpu = forced_persistent
    _repeat_with_fresh_tensors(variant, validations)
    assert len(gpu.counters) == 3 and all(gpu.counters), gpu.counters


@pytest.mark.parametrize(
    ("variant", "deterministic"),
    [
        ({}, False),
        ({}, True),
        ({"window": (20, 0)}, False),
        ({"window": (20, 0)}, True),
        ({"packed": True}, False),
        ({"no_node": True}, False),
        ({"d": 256}, False),
    ],
    ids=["plain", "plain-det", "window", "window-det", "packed", "python-function", "d256"],
)
def test_tma_loads_backward_reads_q_and_dout_through_their_maps(gpu, validations, monkeypatch, variant,
                                                                deterministic):  # fmt: skip
    # BwdConfig.tma_loads: the dK/dV kernel takes BwdTmaParams, whose q and dO maps each call encodes on its
    # own addresses: in Python (ops.backward.bind_maps) or in the node (BackwardProgram.put_maps). The
    # stand-in dK/dV kernel reads q and dO through the maps (checking them against the params), so a map of
    # a stale address or layout gives wrong gradients. Fresh tensors every step, against float64.
    if gpu.arch != "sm_90":
        pytest.skip("the warp-specialized backward is Hopper's")
    from flash_attention.ops import backward as ops_backward

    real = ops_backward.backward_config

    def with_tma(*args, **kwargs):
        cfg = real(*args, **kwargs)
        # (TMA without dQ's writer warps: the default has both, so this covers the other TMA form)
        return dataclasses.replace(cfg, tma_loads=True, dq_writer=False) if cfg.warp_specialized else cfg

    monkeypatch.setattr(ops_backward, "backward_config", with_tma)
    if variant.get("no_node"):  # (the Python autograd function's backward: ops.backward.bind_maps)
        monkeypatch.setattr(host, "ops_or_none", lambda: None)
    ops.clear_plans()
    steps = 3
    for _ in range(steps):
        if variant.get("packed"):
            lens = [50, 37, 61]
            q, k, v, cu = _packed(lens, grad=True)
            out = fa.attention_varlen(q, k, v, cu, cu, causal=True, deterministic=deterministic)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
                leaves = [t[a:b].detach().double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
                ref, _ = attention_reference(*leaves, causal=True)
                exact = torch.autograd.grad(ref, leaves, dout[a:b].double().unsqueeze(0))
                for name, got, want in zip("qkv", grads, exact, strict=True):
                    assert (got[a:b].double() - want[0]).abs().max().item() < 5e-2, f"d{name}"
        else:
            q, k, v = _inputs(grad=True, d=variant.get("d", 64))
            kw = dict(causal=True, window=variant.get("window"))
            out = fa.attention(q, k, v, deterministic=deterministic, **kw)
            dout = torch.randn_like(out)
            _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, **kw)
    assert not gpu.errors, gpu.errors
    assert any(name.endswith("_tma") for name, *_ in gpu.backward_builds), gpu.backward_builds
    assert gpu.backward_maps == steps, gpu.backward_maps


def test_tma_loads_fall_back_to_the_copying_producer(gpu, validations, monkeypatch):
    # A broadcast output gradient (stride 0: out.sum()'s, expanded) has no tensor map; the call runs the same
    # config with the cp.async producer (BwdParams, no maps) instead of raising.
    if gpu.arch != "sm_90":
        pytest.skip("the warp-specialized backward is Hopper's")
    from flash_attention.ops import backward as ops_backward

    real = ops_backward.backward_config
    monkeypatch.setattr(
        ops_backward,
        "backward_config",
        lambda *a, **kw: dataclasses.replace(real(*a, **kw), tma_loads=True),
    )
    monkeypatch.setattr(host, "ops_or_none", lambda: None)  # (the node copies such a gradient itself)
    ops.clear_plans()
    q, k, v = _inputs(grad=True)
    out = fa.attention(q, k, v, causal=True)
    dout = torch.randn(out.shape[2], out.shape[3], dtype=out.dtype).expand(out.shape)
    _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, causal=True)
    assert gpu.backward_maps == 0 and not gpu.errors, gpu.errors
    assert not any("_tma" in name for name, *_ in gpu.backward_builds[-1:]), gpu.backward_builds
