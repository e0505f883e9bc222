"""The compiled training node on the GPU (marked gpu): eager training calls record it, and its backward gives
what the Python autograd function gives with the same kernels, bit for bit in deterministic mode.

The gradients themselves are checked against float64 autograd of the reference in tests/test_gpu_autograd.py,
whose cases now run through this node; here it is compared with :class:`flash_attention.torch_ops.attention.
EagerAttention` (the Python path that remains for the calls the node does not take), over the options the
node carries to its backward: causal, GQA, key ranges, dropout, deterministic mode, transposed layouts, and
output gradients in layouts the kernels cannot read.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import flash_attention as fa
from flash_attention.api.varlen import _with_tiles, segments
from flash_attention.dropout import draw_seed
from flash_attention.jit import host
from flash_attention.spec import pack_options
from flash_attention.torch_ops import attention as custom_ops

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _library():
    reason = host.unavailable_reason()
    if reason is not None and (host._compiler() is None or os.environ.get(host.ENV) == "0"):
        pytest.skip(f"no host library here: {reason}")
    # A compiler that cannot build it is a defect to see, not a skip: a header of another PyTorch version
    # once failed the build on the GPU machine, and every native path went untested behind the skips.
    assert reason is None, f"the host library did not build: {reason}"


def _inputs(b, sq, sk, hq, hkv, d, layout, gen, dtype=torch.bfloat16):
    def make(s, h):
        if layout == "bhsd":
            return torch.randn(b, h, s, d, generator=gen, device="cuda").to(dtype).transpose(1, 2)
        return torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype)

    return make(sq, hq), make(sk, hkv), make(sk, hkv)


CASES = [
    # b, sq, sk, hq, hkv, d, causal, layout, key_range, dropout_p
    (2, 128, 128, 16, 16, 64, False, "bshd", False, 0.0),
    (1, 512, 512, 16, 16, 128, True, "bshd", False, 0.0),
    (2, 300, 517, 8, 2, 128, True, "bhsd", False, 0.0),
    (2, 200, 333, 6, 3, 64, False, "bshd", True, 0.0),
    (1, 257, 257, 4, 4, 256, True, "bshd", False, 0.2),
    (3, 65, 90, 4, 1, 96, True, "bhsd", True, 0.1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("deterministic", [True, False])
def test_the_node_matches_the_python_autograd_function(case, deterministic):
    b, sq, sk, hq, hkv, d, causal, layout, ranged, dropout_p = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q0, k0, v0 = _inputs(b, sq, sk, hq, hkv, d, layout, gen)
    dout = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    key_range = None
    if ranged:
        ends = torch.randint(1, sk + 1, (b,), generator=gen, device="cuda")
        key_range = torch.stack([torch.zeros_like(ends), ends], dim=1)
    seed = draw_seed(1234) if dropout_p else None
    scale = d**-0.5

    q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
    out = fa.attention(q, k, v, causal=causal, key_range=key_range, dropout_p=dropout_p, dropout_seed=1234,
                       deterministic=deterministic)  # fmt: skip
    assert out.grad_fn.name() == "FlashAttentionBackward"
    grads = torch.autograd.grad(out, (q, k, v), dout)

    q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
    ref_out, _ = custom_ops.EagerAttention.apply(
        q, k, v, *pack_options(causal, scale, deterministic, dropout_p), key_range, seed
    )
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)

    assert torch.equal(out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert g.isfinite().all(), name
        if deterministic:
            assert torch.equal(g, r), name
        else:  # dQ is accumulated with atomics in another order each run
            torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2, msg=name)


def _grad_fns(t, depth=4) -> set[str]:
    """The names of the autograd functions within ``depth`` steps of ``t`` (past views such as a packed
    batch's row taken out of its batch of one)."""
    names, frontier = set(), [t.grad_fn]
    for _ in range(depth):
        frontier = [f for f in frontier if f is not None]
        names |= {f.name() for f in frontier}
        frontier = [n for f in frontier for n, _ in f.next_functions]
    return names


VARIANTS = [
    # (softcap, ALiBi slopes' dims, window, packed)
    (0.0, 1, None, False),
    (0.0, 2, (60, 0), False),
    (2.0, 1, None, False),
    (0.0, 1, None, True),
    (1.5, 1, (50, 0), True),
]


def _runs(cu_q, cu_k, sq, sk, window):
    """A packed batch's causal runs of three sequences as attention_varlen notes them: the configs' lengths
    and the query tiles' offsets (the forward's tiles change its rounding)."""
    runs = segments(cu_q, cu_k, sq, sk, causal=True, window=window)
    runs[0]._typical_lengths = (-(-sq // 3), -(-sk // 3))
    return _with_tiles(runs, cu_q, cu_k)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_the_node_takes_alibi_and_packed_batches(variant):
    # ALiBi's slopes and a packed batch's runs are the program's bound tensors: each call binds its own, the
    # node writes them into the backward's params. Deterministic, so bit for bit against the Python function.
    softcap, alibi, window, packed = variant
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(variant).encode()))
    b, sq, sk, hq, hkv, d = (1, 700, 760, 4, 2, 128) if packed else (2, 300, 333, 4, 2, 128)
    q0, k0, v0 = _inputs(b, sq, sk, hq, hkv, d, "bshd", gen)
    dout = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    slopes = torch.rand((hq,) if alibi == 1 else (b, hq), generator=gen, device="cuda") * 0.5
    runs = None
    if packed:  # three causal sequences with more keys than queries each (ALiBi from each row's run)
        cu_q = torch.tensor([0, 200, 450, 700], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 220, 500, 760], dtype=torch.int32, device="cuda")
        runs = _runs(cu_q, cu_k, sq, sk, window)
    results = []
    for through_node in (True, False):
        q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
        if through_node:
            if packed:
                out = fa.attention_varlen(
                    q[0], k[0], v[0], cu_q, cu_k, causal=True, window=window, softcap=softcap,
                    alibi_slopes=slopes, deterministic=True,
                ).unsqueeze(0)  # fmt: skip
            else:
                out = fa.attention(q, k, v, causal=True, window=window, softcap=softcap, alibi_slopes=slopes,
                                   deterministic=True)  # fmt: skip
            assert "FlashAttentionBackward" in _grad_fns(out)
        else:
            # (the op's inputs: the options packed, key range and seed, slopes, the runs, sinks)
            shown = None if packed else window
            options, values = pack_options(True, d**-0.5, True, 0.0, shown, softcap=softcap)
            seg = (*runs, None)[:3] if packed else (None, None, None)
            out, _ = custom_ops.EagerAttention.apply(q, k, v, options, values, None, None, slopes, *seg, None)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for name, a, r in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert a.isfinite().all(), name
        assert torch.equal(a, r), name


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_the_node_gives_the_sinks_their_gradient(packed):
    # Attention sinks are an input of the node: their gradient comes from the preprocessing kernel's D rows
    # and the saved LSE, the Python function's formula with the same operations. Deterministic, so bit for
    # bit against that function, with a sliding window (gpt-oss's layers) and GQA. (The deterministic packed
    # plan lays its workspace out by packed row; the per-sequence layout the node reads back through
    # sink_rows is the atomic mode's key-tile plan, checked on the CPU stand-in, tests/test_repeat_calls.py.)
    gen = torch.Generator(device="cuda").manual_seed(17 + packed)
    b, sq, sk, hq, hkv, d = (1, 700, 700, 8, 2, 64) if packed else (2, 300, 300, 8, 2, 64)
    q0, k0, v0 = _inputs(b, sq, sk, hq, hkv, d, "bshd", gen)
    dout = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    sinks0 = torch.randn(hq, generator=gen, device="cuda") + 2.0
    window = (128, 0)
    runs = None
    if packed:
        cu = torch.tensor([0, 200, 450, 700], dtype=torch.int32, device="cuda")
        runs = _runs(cu, cu, sq, sk, window)
    results = []
    for through_node in (True, False):
        q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
        sinks = sinks0.detach().requires_grad_(True)
        if through_node:
            if packed:
                out = fa.attention_varlen(
                    q[0], k[0], v[0], cu, cu, causal=True, window=window, sinks=sinks, deterministic=True
                ).unsqueeze(0)
            else:
                out = fa.attention(q, k, v, causal=True, window=window, sinks=sinks, deterministic=True)
            assert "FlashAttentionBackward" in _grad_fns(out)
        else:
            options, values = pack_options(True, d**-0.5, True, 0.0, None if packed else window)
            seg = (*runs, None)[:3] if packed else (None, None, None)
            out, _ = custom_ops.EagerAttention.apply(q, k, v, options, values, None, None, None, *seg, sinks)
        results.append((out, *torch.autograd.grad(out, (q, k, v, sinks), dout)))
    for name, a, r in zip(("out", "dq", "dk", "dv", "dsinks"), *results, strict=True):
        assert a.isfinite().all(), name
        assert torch.equal(a, r), name


def test_output_gradients_the_kernels_cannot_read_are_copied():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q0, k0, v0 = _inputs(2, 150, 170, 4, 2, 64, "bshd", gen)
    dout = torch.randn(2, 150, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    # The same values at an address 2 bytes off 16-byte alignment, and as a transposed view.
    storage = torch.empty(dout.numel() + 1, dtype=dout.dtype, device="cuda")
    misaligned = storage[1:].view(dout.shape).copy_(dout)
    transposed = dout.transpose(1, 2).contiguous().transpose(1, 2)
    results = []
    for g in (dout, misaligned, transposed):
        q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
        out = fa.attention(q, k, v, causal=True, deterministic=True)
        results.append(torch.autograd.grad(out, (q, k, v), g))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["native", "python", "off"])
@pytest.mark.parametrize("dv", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_the_node_takes_vs_own_head_dim_where_a_kernel_reads_it(causal, dv, mode, monkeypatch):
    # q/k at 192 with v at 128 or 64 (ops.backward.value_dim_config's kernel reads v's head_dim), through
    # each form of repeat calls (ops.repeat.MODE; "off": every call takes ops.training.training_forward): two
    # calls record the node, whose gradients, of q's, k's and v's own shapes, are the Python function's (the
    # same kernels; dQ's atomics in another order); the deterministic mode, which no kernel reading v's
    # head_dim has, takes the Python function on the padded path.
    from flash_attention.ops import repeat

    monkeypatch.setattr(repeat, "MODE", mode)
    repeat.clear()
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((causal, dv)).encode()))
    q0 = torch.randn(2, 300, 8, 192, generator=gen, device="cuda").to(torch.bfloat16)
    k0 = torch.randn(2, 400, 2, 192, generator=gen, device="cuda").to(torch.bfloat16)
    v0 = torch.randn(2, 400, 2, dv, generator=gen, device="cuda").to(torch.bfloat16)
    dout = torch.randn(2, 300, 8, dv, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
    ref_out, _ = custom_ops.EagerAttention.apply(
        q, k, v, *pack_options(causal, 192**-0.5, False, 0.0), None, None
    )
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    for _ in range(2):  # the whole path's call, then the repeat call
        q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
        out = fa.attention(q, k, v, causal=causal)
        assert out.grad_fn.name() == "FlashAttentionBackward" and out.shape == dout.shape
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert torch.equal(out, ref_out)
        for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), strict=True):
            assert g.shape == t.shape and g.isfinite().all(), name
            torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2, msg=name)
    out = fa.attention(q, k, v, causal=causal, deterministic=True)
    assert out.grad_fn.name() != "FlashAttentionBackward"
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2, msg=name)
    repeat.clear()  # (nothing of this mode's kept for the next test)


def test_inputs_the_kernels_cannot_read_in_place_take_the_python_function():
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 64, 64, 2, 2, 64, "bshd", gen))
    out = fa.attention(q[:, :, :, 1:57], k[:, :, :, 1:57], v[:, :, :, 1:57])  # rows not 16-byte aligned
    assert out.grad_fn.name() != "FlashAttentionBackward"
    out.sum().backward()
    assert q.grad.isfinite().all() and q.grad[..., 0].eq(0).all()


def test_contiguous_views_two_bytes_off_are_copied_and_their_signature_repeats_later():
    # base[1:].view(shape) is contiguous with usable strides but 2 bytes off 16: neither the kernels' loads
    # nor a tensor map can read it in place, so the call copies it (clone, not .contiguous(): that returns
    # the view itself); an aligned call of the same signature then takes and repeats the planned launch.
    gen = torch.Generator(device="cuda").manual_seed(9)
    q0, k0, v0 = _inputs(2, 200, 200, 4, 4, 64, "bshd", gen)
    dout = torch.randn(2, 200, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    expected = None
    for shift in (1, 0, 0):
        views = []
        for t in (q0, k0, v0):
            base = torch.empty(t.numel() + 8, dtype=t.dtype, device="cuda").fill_(float("nan"))
            view = base[shift : shift + t.numel()].view(t.shape)
            view.copy_(t)
            assert view.is_contiguous() and (view.data_ptr() % 16 != 0) == bool(shift)
            views.append(view.requires_grad_(True))
        q, k, v = views
        out = fa.attention(q, k, v, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        if expected is None:
            expected = (out, *grads)
            ref = fa.attention(q0, k0, v0, causal=True, deterministic=True)
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for a, b in zip(expected, (out, *grads), strict=True):
            assert torch.equal(a, b)


def test_a_call_on_a_side_stream_gives_the_same_gradients():
    # The node launches on the current stream the engine sets for it (the forward's); a loss on a side
    # stream gives the same gradients as on the default one.
    gen = torch.Generator(device="cuda").manual_seed(8)
    q0, k0, v0 = _inputs(2, 333, 333, 8, 8, 128, "bshd", gen)
    dout = torch.randn(2, 333, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
    expected = torch.autograd.grad(fa.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v = (t.detach().requires_grad_(True) for t in (q0, k0, v0))
        got = torch.autograd.grad(fa.attention(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
