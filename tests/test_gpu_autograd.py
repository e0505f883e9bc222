"""GPU tests of the backward pass: gradients of flash_attention.attention on CUDA (marked gpu; need sm_80+).

Accuracy rule of DESIGN.md applied to each gradient: against float64 autograd of the reference, the max
error of dq, dk and dv must each be at most 2x the error PyTorch's own SDPA backward makes on the same
low-precision inputs, plus 1e-5; every gradient finite; rows that attend no key get dq exactly 0. Inputs
(and the upstream gradient) are fresh random draws for every case.

fp16/bf16 cases run ``flash_attention.ops.cuda_backward``; with an ``ops`` that lacks it they fail with the
kernel path's NotImplementedError, whose message ``test_missing_backward_kernel_is_a_clear_error`` checks
(skipped once the function exists).
"""

from __future__ import annotations

import copy
import math
import random
import threading

import pytest
import torch
import torch.nn.functional as F
from test_autograd import _Block, _train

import flash_attention as fa
from flash_attention import ops
from flash_attention.api import few_queries as _few_queries
from flash_attention.fallback.reference import attention_reference, causal_allowed, key_range_allowed
from flash_attention.ops import dispatch

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FWD = torch.ops.flash_attention.fwd.default
BWD = torch.ops.flash_attention.bwd.default
HAS_BACKWARD_KERNEL = getattr(ops, "cuda_backward", None) is not None


def _make(b, s, h, d, dtype, layout, gen):
    """A (b, s, h, d) tensor requiring grad, in one of three storages (the grads are taken w.r.t. it)."""
    if layout == "bhsd":
        # (batch, heads, seqlen, dim) storage seen as (batch, seqlen, heads, dim): no copy.
        base = torch.randn(b, h, s, d, generator=gen, device="cuda").to(dtype).requires_grad_(True)
        return base.transpose(1, 2)
    if layout == "padded":
        # Rows further apart than heads * dim, as a slice of a fused QKV projection would be.
        base = torch.randn(b, s, h, d + 8, generator=gen, device="cuda").to(dtype).requires_grad_(True)
        return base[..., :d]
    return torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype).requires_grad_(True)


def _key_range(b, sk, rng):
    rows = []
    for _ in range(b):
        kind = rng.choice(["right", "left", "both", "empty", "wild"])
        if kind == "right":
            rows.append((0, rng.randint(1, sk)))
        elif kind == "left":
            rows.append((rng.randint(0, sk - 1), sk))
        elif kind == "both":
            a, z = sorted(rng.randint(0, sk) for _ in range(2))
            rows.append((a, z))
        elif kind == "empty":
            s = rng.randint(0, sk)
            rows.append((s, s))
        else:  # out of bounds: clamped by the kernel and the reference alike
            rows.append((rng.randint(-50, sk + 50), rng.randint(-50, sk + 50)))
    return torch.tensor(rows, dtype=rng.choice([torch.int32, torch.int64]), device="cuda")


def _allowed(b, sq, sk, causal, key_range):
    """(b, 1, sq, sk) boolean: where query i of batch row b may attend key j."""
    allowed = torch.ones(b, 1, sq, sk, dtype=torch.bool, device="cuda")
    if causal:
        allowed = allowed & causal_allowed(sq, sk, device="cuda")
    if key_range is not None:
        allowed = allowed & key_range_allowed(key_range, sk)[:, None, None, :]
    return allowed


def _reference_grads(q, k, v, dout, causal, scale, key_range):
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(q64, k64, v64, causal=causal, softmax_scale=scale, key_range=key_range)
    return torch.autograd.grad(out, (q64, k64, v64), dout.double())


def _delta_term(q, k, v, out, dout, causal, scale, key_range):
    """What the FlashAttention backward's D = rowsum(dO * O) adds to dq and dk when O is the rounded
    forward output rather than the exact one: dS gains -P * dD with dD = rowsum(dO * (O - O_exact)), so dq
    gains -scale * dD * (P K) and dk gains -scale * P^T (dD * Q), in float64. Every FlashAttention backward
    (ours, the FlashAttention library's, cuDNN's dot_do_o) computes D this way; with head_dim of 8 or more
    the term averages out below the output's own rounding, but at head_dim 1-7 it is a few units in the last
    place of dq, where PyTorch's math path (the only one of its backends that takes such head dims) derives D
    from its own P and dP instead."""
    group = q.shape[2] // k.shape[2]
    q64, k64, v64, o, do = (t.detach().double().transpose(1, 2) for t in (q, k, v, out, dout))
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = q64 @ k64.transpose(-1, -2) * scale
    allowed = _allowed(q.shape[0], q.shape[1], k.shape[1], causal, key_range)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    d_delta = (do * (o - p @ v64)).sum(-1, keepdim=True)  # (b, h, sq, 1)
    dq = -scale * d_delta * (p @ k64)
    dk = -scale * (p.transpose(-1, -2) @ (d_delta * q64))
    b, hkv = k.shape[0], k.shape[2]
    dk = dk.reshape(b, hkv, group, *dk.shape[2:]).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2)


def _flash_algorithm_grads(q, k, v, out, dout, allowed, scale):
    """(dq, dk, dv) of the FlashAttention backward written out in PyTorch, in float32 with the roundings the
    algorithm itself makes: P and dS rounded to the input dtype before the products that take them (dV =
    P^T dO, dK = dS^T Q, dQ = dS K) and D = rowsum(dO * O) from the rounded output.

    The error bound at head_dim 1-7 is taken from this: there SDPA runs only its math path, which works in
    float32 throughout and never rounds dS, so twice *its* error asks more than any FlashAttention backward
    gives (the float32 emulation of our own rounding is measured at 1-3x it for dk at head_dim 1).
    An implementation independent of our kernels; it shares their algorithm, not their code."""
    group = q.shape[2] // k.shape[2]
    dt = q.dtype
    q32, k32, v32, o, do = (t.detach().float().transpose(1, 2) for t in (q, k, v, out, dout))
    k32, v32 = k32.repeat_interleave(group, 1), v32.repeat_interleave(group, 1)
    s = (q32 @ k32.transpose(-1, -2)).masked_fill(~allowed, float("-inf")) * scale
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    dv = p.to(dt).float().transpose(-1, -2) @ do
    dp = do @ v32.transpose(-1, -2)
    d_row = (do * o).sum(-1, keepdim=True)
    ds = (p * (dp - d_row)).to(dt).float()
    dq = (ds @ k32) * scale
    dk = (ds.transpose(-1, -2) @ q32) * scale
    b, hkv = k.shape[0], k.shape[2]
    dk, dv = (g.reshape(b, hkv, group, *g.shape[2:]).sum(2) for g in (dk, dv))
    return [g.to(dt).transpose(1, 2) for g in (dq, dk, dv)]


def _sdpa_grads(q, k, v, dout, allowed, has_key, scale):
    """SDPA's (dq, dk, dv) on the same low-precision tensors, in our layout.

    A row that attends no key has no well-defined SDPA gradient (its softmax is 0/0); such rows are given
    every key and a zero upstream gradient, so they add nothing to dk/dv, and their dq is left out of the
    comparison (ours must be exactly 0 there, checked separately).
    """
    group = q.shape[2] // k.shape[2]
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    kr, vr = (t.repeat_interleave(group, 1) if group > 1 else t for t in (ks, vs))
    if allowed.all():
        o = F.scaled_dot_product_attention(qs, kr, vr, scale=scale)
    else:
        mask = allowed | ~has_key[..., None]
        o = F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask, scale=scale)
    do = dout.transpose(1, 2) * has_key[..., None].to(dout.dtype)
    return [g.transpose(1, 2) for g in torch.autograd.grad(o, (qs, ks, vs), do)]


def _inputs(b, sq, sk, hq, hkv, d, dtype, layout, ranged, seed):
    """(q, k, v, key_range, dout) of one case; the same case always draws the same tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = DTYPES[dtype]
    q = _make(b, sq, hq, d, dt, layout, gen)
    k = _make(b, sk, hkv, d, dt, layout, gen)
    v = _make(b, sk, hkv, d, dt, layout, gen)
    kr = _key_range(b, sk, random.Random(seed)) if ranged else None
    if layout == "bhsd":  # the upstream gradient in a transposed layout too, as a transpose after us gives
        dout = torch.randn(b, hq, sq, d, generator=gen, device="cuda").to(dt).transpose(1, 2)
    else:
        dout = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)
    return q, k, v, kr, dout


def check_grads(b, sq, sk, hq, hkv, d, dtype, causal, layout, ranged, seed, deterministic=False):
    q, k, v, kr, dout = _inputs(b, sq, sk, hq, hkv, d, dtype, layout, ranged, seed)
    scale = 1.0 / math.sqrt(d)
    case = (
        f"b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} {dtype} causal={causal} {layout} "
        f"ranged={ranged} seed={seed} deterministic={deterministic}"
    )

    out = fa.attention(q, k, v, causal=causal, key_range=kr, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    with torch.no_grad():
        inference = fa.attention(q, k, v, causal=causal, key_range=kr)
    if kr is None and _few_queries.takes_shape(b, sq, hq, sk, hkv):
        # An inference call of a few queries runs on the split-KV decode kernels (_few_queries), a training
        # call on the forward kernel: the same within two roundings of the output, not bitwise.
        eps = torch.finfo(out.dtype).eps
        scale_of_out = out.abs().max().item()
        torch.testing.assert_close(
            out, inference, rtol=2 * eps, atol=2 * eps * scale_of_out, msg=lambda m: f"{case}: {m}"
        )
    else:  # the op path runs the very kernel of the inference path
        assert torch.equal(out, inference), case

    allowed = _allowed(b, sq, sk, causal, kr)
    has_key = allowed.any(-1)  # (b, 1, sq)
    ref = _reference_grads(q, k, v, dout, causal, scale, kr)
    if d < 8:
        # The algorithm's own term (see _delta_term): the reference becomes the FlashAttention backward
        # evaluated in float64 on our rounded forward output.
        dq_t, dk_t = _delta_term(q, k, v, out, dout, causal, scale, kr)
        ref = (ref[0] + dq_t, ref[1] + dk_t, ref[2])
    sdpa = _sdpa_grads(q, k, v, dout, allowed, has_key, scale)
    peers = [sdpa]
    if d < 8:
        peers.append(_flash_algorithm_grads(q, k, v, out, dout, allowed, scale))
    rows = has_key[:, 0, :, None, None]  # (b, sq, 1, 1), broadcast over heads and dims of dq
    for i, (name, g, r, t) in enumerate(zip("qkv", grads, ref, (q, k, v), strict=True)):
        assert g.shape == t.shape and g.dtype == t.dtype, f"d{name}: {g.shape} {g.dtype}: {case}"
        assert g.isfinite().all(), f"d{name} has NaN/inf: {case}"
        err = (g.double() - r).abs().max().item()
        peer_err = 0.0
        for peer in peers:
            diff = (peer[i].double() - r).abs()
            if name == "q":
                diff = diff * rows
            peer_err = max(peer_err, diff.max().item())
        bound = 2 * peer_err + 1e-5
        assert err <= bound, f"d{name}: max error {err:.3g} > bound {bound:.3g} (2x peer + 1e-5): {case}"
    if not has_key.all():
        assert (grads[0] * ~rows == 0).all(), f"dq of rows without keys must be 0: {case}"
    return grads


# About forty random cases over the axes, drawn once with a fixed seed so failures reproduce.
_rng = random.Random(4321)
_LENS = [1, 7, 63, 65, 127, 200, 513, 1000]
_CASES = []
for _i in range(40):
    _sq = _rng.choice(_LENS)
    _sk = _sq if _rng.random() < 0.35 else _rng.choice(_LENS)
    _hkv = _rng.choice([1, 2, 3])
    _CASES.append(
        (
            _rng.choice([1, 2]),  # batch
            _sq,
            _sk,
            _hkv * _rng.choice([1, 2, 4]),  # heads_q
            _hkv,
            # every head_dim class: the four compiled sizes and sizes that run on the next one up
            [32, 40, 64, 96, 128, 160, 192, 256][_i % 8],
            _rng.choice(["bf16", "fp16"]),
            _rng.random() < 0.5,  # causal
            _rng.choice(["bshd", "bshd", "bhsd", "padded"]),
            _rng.random() < 0.3,  # key_range
            _i,  # seed
        )
    )
# Head dims that are not a multiple of 8 (zero-padded to the next one inside the op), every family of
# kernels below them, with GQA, causal, key ranges and a transposed layout.
_CASES += [
    (2, 77, 91, 4, 2, 1, "bf16", True, "bshd", False, 200),
    (1, 130, 130, 2, 1, 3, "fp16", False, "bhsd", True, 201),
    (2, 65, 200, 6, 3, 36, "bf16", True, "bshd", False, 202),
    (1, 300, 257, 4, 4, 100, "fp16", True, "padded", True, 203),
    (1, 129, 129, 2, 2, 129, "bf16", False, "bshd", False, 204),
    (2, 200, 150, 4, 1, 250, "bf16", True, "bhsd", False, 205),
]
# Longer ones, where many K/V blocks accumulate into one dQ row and many query blocks into one dK/dV row.
_CASES += [
    (1, 4097, 4097, 4, 2, 128, "bf16", True, "bshd", False, 100),
    (1, 2048, 3000, 2, 1, 64, "fp16", False, "bhsd", True, 101),
    (2, 1500, 1024, 4, 4, 256, "bf16", True, "padded", False, 102),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c)))
def test_gradients_within_twice_sdpa_error(case):
    check_grads(*case)


def test_threads_that_made_no_cuda_call_get_the_same_answer():
    # The autograd engine runs a backward on a thread of its own, and a user's worker thread may call us
    # before it has made any CUDA call: neither has a current CUDA context until someone makes one. Both
    # must launch (not fail with "invalid device context") and give bit for bit what the main thread gives.
    gen = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = (_make(2, n, h, 64, torch.bfloat16, "bshd", gen) for n, h in ((150, 4), (170, 2), (170, 2)))
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16)

    def run():
        o = fa.attention(q, k, v, causal=True, deterministic=True)
        return (o, *torch.autograd.grad(o, (q, k, v), dout))

    expected = run()
    got: dict[str, object] = {}

    def worker():
        try:
            got["result"] = run()
            torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread's assert
            got["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in got, got.get("error")
    for name, a, b in zip(("out", "dq", "dk", "dv"), expected, got["result"], strict=True):
        assert torch.equal(a, b), name


def test_fp32_cuda_gradients_use_the_fallback(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_reasons", set())  # the warning is once per process
    # float32 on CUDA: the op's CUDA implementation takes the PyTorch fallback, forward and backward.
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (_make(2, n, h, 64, torch.float32, "bshd", gen) for n, h in ((77, 4), (91, 2), (91, 2)))
    dout = torch.randn(q.shape, generator=gen, device="cuda")
    with pytest.warns(RuntimeWarning, match="float16 or bfloat16"):
        out = fa.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _reference_grads(q, k, v, dout, True, 1 / 8, None)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(HAS_BACKWARD_KERNEL, reason="ops.cuda_backward exists")
def test_missing_backward_kernel_is_a_clear_error():
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (_make(1, 64, 2, 64, torch.bfloat16, "bshd", gen) for _ in range(3))
    out = fa.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="cuda_backward"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------------------
# deterministic=True


@pytest.mark.parametrize(
    "case",
    [
        (2, 1000, 1000, 8, 2, 128, "bf16", False, "bshd", False, 200),
        (1, 777, 2049, 4, 1, 64, "fp16", True, "bhsd", True, 201),
        (1, 1024, 1024, 2, 2, 256, "bf16", True, "bshd", False, 202),
    ],
    ids=lambda c: "-".join(map(str, c)),
)
def test_deterministic_gradients_are_bitwise_identical(case):
    b, sq, sk, hq, hkv, d, dtype, causal, layout, ranged, seed = case
    # Within the accuracy rule first, then identical over ten more runs on the same inputs.
    first = check_grads(*case, deterministic=True)
    q, k, v, kr, dout = _inputs(b, sq, sk, hq, hkv, d, dtype, layout, ranged, seed)
    runs = []
    for _ in range(10):
        out = fa.attention(q, k, v, causal=causal, key_range=kr, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for run in runs:
        for name, a, b_ in zip("qkv", first, run, strict=True):
            assert torch.equal(a, b_), f"d{name} differs between deterministic runs"


# ---------------------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs


def test_compiled_training_matches_eager_bf16():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Block(dim=256, heads=4, kv_heads=2).cuda().to(torch.bfloat16)  # head_dim 64
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(2, 257, 256, device="cuda", dtype=torch.bfloat16)
    kr = torch.tensor([[0, 257], [5, 200]], device="cuda")
    want = _train(eager, x, kr, 5)
    got = _train(compiled, x, kr, 5)
    assert want[-1] < want[0], f"the eager model does not train: {want}"
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-2 * abs(w), f"step {step}: compiled loss {g} vs eager {w}"


def test_compile_sees_one_op_per_direction_and_no_graph_break():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    targets = {"forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            targets[kind] += [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm)

        return compiler

    model = _Block(dim=128, heads=2, kv_heads=1).cuda().to(torch.bfloat16)
    x = torch.randn(2, 100, 128, device="cuda", dtype=torch.bfloat16)
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch.compile(model, backend=backend, fullgraph=True)(x).float().sum().backward()
    assert targets["forward"].count(FWD) == 1 and targets["backward"].count(BWD) == 1
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_inference_runs_the_kernel():
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(2, 300, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        return fa.attention(q, k, v, causal=True, return_lse=True)

    with torch.no_grad():
        out, lse = torch.compile(f, fullgraph=True)(q, k, v)
        want_out, want_lse = f(q, k, v)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_cuda_graph_replays_forward_and_backward():
    b, sq, sk, hq, hkv, d = 2, 333, 517, 8, 2, 128
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(10)
    static = [
        torch.randn(b, n, h, d, generator=gen, device="cuda").to(dt)
        for n, h in ((sq, hq), (sk, hkv), (sk, hkv))
    ]
    static_dout = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dt)

    def step():
        q, k, v = (t.detach().requires_grad_(True) for t in static)
        out = fa.attention(q, k, v, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), static_dout))

    # Warm up on a side stream (kernels compiled and loaded, allocator pools filled) before capturing.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for trial in range(3):
        # New data in the static buffers: the replay must compute on it, not on what was captured.
        for t in (*static, static_dout):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(dt))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, c, e in zip(("out", "dq", "dk", "dv"), captured, eager, strict=True):
            assert c.isfinite().all(), f"replay {trial}: {name} not finite"
            # Same kernels, deterministic mode: the replay equals an eager run bit for bit.
            assert torch.equal(c, e), f"replay {trial}: {name} differs from eager"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_autotune_check_accepts_defaults_and_rejects_a_broken_kernel(d, monkeypatch):
    """The tuner's gradient check passes the shipped configs and catches wrong gradients."""
    from flash_attention.configs import default_bwd_config
    from flash_attention.ops import device_arch
    from flash_attention.tools.autotune import backward as autotune_bwd

    arch = device_arch(torch.cuda.current_device())
    for cfg in {default_bwd_config("bf16", d), default_bwd_config("bf16", d, arch)}:
        assert autotune_bwd.check_bwd_candidate(cfg, causal=True) is None, cfg.name()
    real = ops.cuda_backward

    def broken(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, dk.flip(1), dv

    monkeypatch.setattr(ops, "cuda_backward", broken)
    assert "wrong dk" in autotune_bwd.check_bwd_candidate(default_bwd_config("bf16", d), causal=False)
