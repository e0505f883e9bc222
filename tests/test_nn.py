"""flash_attention.nn on the CPU: the modules against PyTorch's own modules and float64 references.

On the CPU every route computes through PyTorch, so these tests check the semantics of each route (the
kernel route's attention() fallback has the kernel's semantics), the dispatch decisions, state_dict
compatibility, masks, errors and warnings. The key-range route (key padding with one run of valid keys per
batch row, run as one attention() call with ``key_range``) is only chosen on CUDA; tests force it by
replacing the seam ``kernel_expected`` (the ``force_key_range`` fixture of conftest.py), and the fallback
of attention() then computes the key ranges exactly as the kernel does.

Accuracy rule at module level: against the same module computed in float64, our max error is at most 2x the
error of PyTorch's module in the same precision, plus 1e-5.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import flash_attention
from flash_attention.nn import FlashAttention, MultiheadAttention, replace_attention
from flash_attention.nn import functional as fn


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(fn, "_warned", set())


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record every call of flash_attention.attention made by the modules (the kernel route)."""
    calls: list = []
    real = fn.attention

    def spy(q, k, v, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), kwargs.get("causal", False)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fn, "attention", spy)
    return calls


def _bound(ours: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    err = (ours.double() - exact).abs().max().item()
    return err, 2 * (stock.double() - exact).abs().max().item() + 1e-5


def _assert_close_rule(ours: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor, what: str = "") -> None:
    assert not ours.isnan().any(), what
    err, bound = _bound(ours, stock, exact)
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


# ======================================================================================================
# Reference for FlashAttention: the module's own weights in float64, a naive masked softmax


def _naive_attention(q, k, v, allowed):
    """q (B, L, H, D), k/v (B, S, Hkv, D), allowed (B|1, 1, L, S) bool; float64; rows without key -> 0."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2), p


def _fa_reference(module: FlashAttention, query, key, value, key_padding_mask=None):
    m = copy.deepcopy(module).double()
    q = m.q_proj(query.double()).unflatten(-1, (m.num_heads, m.head_dim))
    k = m.k_proj(key.double()).unflatten(-1, (m.num_kv_heads, m.head_dim))
    v = m.v_proj(value.double()).unflatten(-1, (m.num_kv_heads, m.head_dim))
    L, S = q.shape[1], k.shape[1]
    allowed = torch.ones(1, 1, L, S, dtype=torch.bool)
    if m.causal:
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        allowed = allowed & (j <= i + S - L)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    o, p = _naive_attention(q, k, v, allowed)
    return m.out_proj(o.reshape(q.shape[0], L, -1)), p


def _stock_fa(module: FlashAttention, query, key, value, key_padding_mask=None):
    """The same layer through PyTorch's SDPA in the module's precision: the 'PyTorch error' of the rule."""
    m = module
    q = m.q_proj(query).unflatten(-1, (m.num_heads, m.head_dim))
    k = m.k_proj(key).unflatten(-1, (m.num_kv_heads, m.head_dim))
    v = m.v_proj(value).unflatten(-1, (m.num_kv_heads, m.head_dim))
    L, S = q.shape[1], k.shape[1]
    allowed = torch.ones(1, 1, L, S, dtype=torch.bool)
    if m.causal:
        allowed = allowed & flash_attention.fallback.reference.causal_allowed(L, S)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    group = m.num_heads // m.num_kv_heads
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(group, 1),
        v.transpose(1, 2).repeat_interleave(group, 1),
        attn_mask=allowed,
    )
    o = torch.where(allowed.any(-1, keepdim=True), o, 0.0).transpose(1, 2)
    return m.out_proj(o.reshape(q.shape[0], L, -1))


def _padding(batch: int, seqlen: int, kind: str) -> torch.Tensor:
    """A (batch, seqlen) bool key padding mask, True = padded; lengths drawn at random per row."""
    mask = torch.zeros(batch, seqlen, dtype=torch.bool)
    for b in range(batch):
        n = int(torch.randint(1, seqlen + 1, ()))
        if kind == "right":
            mask[b, n:] = True
        elif kind == "left":
            mask[b, : seqlen - n] = True
        elif kind == "holes":
            mask[b] = torch.rand(seqlen) < 0.3
    if kind == "right" and batch > 1:
        mask[-1] = True  # a row with no key at all
        mask[0] = False  # and one with every key
    return mask


def _expected_key_range(key_padding_mask: torch.Tensor) -> torch.Tensor | None:
    """(batch, 2) [start, end) of each row's valid keys, read off the mask key by key; None when a row's
    valid keys are not one run. (0, 0) for a row without any."""
    rows = []
    rows2d = key_padding_mask if key_padding_mask.dim() == 2 else key_padding_mask[None]  # unbatched: (S,)
    for row in rows2d.tolist():
        valid = [j for j, padded in enumerate(row) if not padded]
        if not valid:
            rows.append((0, 0))
        elif valid != list(range(valid[0], valid[-1] + 1)):
            return None
        else:
            rows.append((valid[0], valid[-1] + 1))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def _assert_key_range_route(calls: dict, key_padding_mask: torch.Tensor, n_calls: int = 1) -> None:
    """The padded calls took the route the mask calls for: ``n_calls`` attention() calls with the mask's
    key ranges when its valid keys are one run per row (plain calls when nothing is padded), none else."""
    expected = _expected_key_range(key_padding_mask)
    if expected is None:
        assert calls["key_range"] == [], "a mask with holes must go to PyTorch"
    elif not key_padding_mask.any():
        assert calls["key_range"] == [] and calls["plain"] == n_calls
    else:
        assert len(calls["key_range"]) == n_calls, calls["key_range"]
        for _, _, _, kr in calls["key_range"]:
            assert kr.dtype == torch.int32 and torch.equal(kr, expected)


FA_CASES = [
    # (d_model, heads, kv_heads, causal, seqlen_q, seqlen_k, padding)
    (64, 4, 4, False, 13, 13, None),
    (64, 4, 4, True, 13, 13, None),
    (96, 4, 2, True, 17, 17, None),
    (64, 8, 1, True, 9, 23, None),
    (64, 8, 2, True, 23, 9, None),
    (64, 4, 2, False, 11, 19, "right"),
    (64, 4, 2, True, 19, 19, "right"),
    (64, 4, 4, True, 12, 20, "left"),
    (64, 4, 1, False, 15, 15, "holes"),
]


@pytest.mark.parametrize(
    "case, route",
    [(c, "default") for c in FA_CASES] + [(c, "key_range") for c in FA_CASES if c[-1] is not None],
    ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)),
)
def test_flash_attention_matches_reference(case, route, request):
    d_model, heads, kv_heads, causal, L, S, padding = case
    if route == "key_range":
        calls = request.getfixturevalue("force_key_range")
    m = FlashAttention(d_model, heads, num_kv_heads=kv_heads, causal=causal).eval()
    query = torch.randn(3, L, d_model)
    key = torch.randn(3, S, d_model) if S != L else query
    kpm = None if padding is None else _padding(3, S, padding)
    with torch.no_grad():
        out, weights = m(query, key, key, key_padding_mask=kpm)
        stock = _stock_fa(m, query, key, key, kpm)
    exact, _ = _fa_reference(m, query, key, key, kpm)
    assert weights is None
    assert out.shape == (3, L, d_model) and out.dtype == query.dtype
    _assert_close_rule(out, stock, exact, str(case))
    if route == "key_range":
        assert (_expected_key_range(kpm) is None) == (padding == "holes")
        _assert_key_range_route(calls, kpm)


def test_flash_attention_need_weights():
    m = FlashAttention(64, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 10, 64)
    kpm = _padding(2, 10, "right")
    with torch.no_grad():
        out, w = m(x, key_padding_mask=kpm, need_weights=True)
        out_fast, _ = m(x, key_padding_mask=kpm)
    exact, p = _fa_reference(m, x, x, x, kpm)
    assert w.shape == (2, 4, 10, 10)
    assert (w.double() - p).abs().max() < 1e-6
    # Rows with a key sum to 1, rows without are all 0 (the last batch row is fully padded).
    assert torch.allclose(w[0].sum(-1), torch.ones(4, 10))
    assert (w[1] == 0).all()
    assert (out.double() - exact).abs().max() < 1e-5
    assert (out - out_fast).abs().max() < 1e-5


def test_flash_attention_fully_padded_row_gives_bias():
    m = FlashAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True
    with torch.no_grad():
        out, _ = m(x, key_padding_mask=kpm)
    assert torch.allclose(out[1], m.out_proj.bias.expand(6, -1))
    assert not torch.allclose(out[0], m.out_proj.bias.expand(6, -1))


def test_flash_attention_inference_uses_kernel_route(kernel_calls):
    m = FlashAttention(64, 8, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        m(x)
    # GQA reaches attention() with its own kv heads: K/V are not repeated.
    assert kernel_calls == [((2, 16, 8, 8), (2, 16, 2, 8), True)]


def test_flash_attention_training_uses_the_kernel_route_and_matches_gradients(kernel_calls, monkeypatch):
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)  # warnings are for CUDA users
    m = FlashAttention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(2, 12, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs through PyTorch" warning: attention() has a backward
        out, _ = m(x)
    assert kernel_calls == [((2, 12, 4, 16), (2, 12, 2, 16), True)]
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    # The same gradients from the float64 reference (autograd through the naive computation).
    ref_m = copy.deepcopy(m).double()
    x64 = x.detach().double().requires_grad_(True)
    exact, _ = _fa_reference(ref_m, x64, x64, x64)
    exact.backward(grad_out.double())
    assert (x.grad.double() - x64.grad).abs().max() < 1e-4


def test_flash_attention_training_without_kernel_backward_goes_through_pytorch(kernel_calls, monkeypatch):
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", False)
    m = FlashAttention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(2, 12, 64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="backward pass is switched off"):
        out, _ = m(x)
    assert kernel_calls == []
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    x64 = x.detach().double().requires_grad_(True)
    exact, _ = _fa_reference(copy.deepcopy(m).double(), x64, x64, x64)
    exact.backward(grad_out.double())
    assert (x.grad.double() - x64.grad).abs().max() < 1e-4
    with warnings.catch_warnings():  # warned once only
        warnings.simplefilter("error")
        m(x)


def test_flash_attention_dropout_only_in_training(kernel_calls):
    m = FlashAttention(64, 4, dropout=0.5)
    x = torch.randn(2, 12, 64)
    with torch.no_grad():
        a, _ = m(x)
        b, _ = m(x)
        m.eval()
        c, _ = m(x)
        d, _ = m(x)
    assert not torch.allclose(a, b)  # random masks differ between calls
    assert torch.equal(c, d)
    exact, _ = _fa_reference(m, x, x, x)
    assert (c.double() - exact).abs().max() < 1e-5
    assert len(kernel_calls) == 4  # training calls too: the kernels have their own dropout


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(d_model=64, num_heads=5), ValueError, "multiple of num_heads"),
        (dict(d_model=2056, num_heads=8), ValueError, "head_dim"),
        (dict(d_model=64, num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads"),
        (dict(d_model=0, num_heads=4), ValueError, "d_model"),
        (dict(d_model=64, num_heads=4, dropout=1.5), ValueError, "dropout"),
        (dict(d_model=64, num_heads=4, causal=1), TypeError, "causal"),
    ],
)
def test_flash_attention_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FlashAttention(kwargs.pop("d_model"), kwargs.pop("num_heads"), **kwargs)


def test_flash_attention_forward_errors():
    m = FlashAttention(64, 4)
    x = torch.randn(2, 8, 64)
    with pytest.raises(
        ValueError, match=r"query must have shape \(batch, seqlen, d_model=64\); got \(8, 64\)"
    ):
        m(x[0])
    with pytest.raises(ValueError, match=r"query must have shape .* got \(2, 8, 32\)"):
        m(x[..., :32])
    with pytest.raises(ValueError, match=r"key must have shape \(2, seqlen"):
        m(x, torch.randn(3, 8, 64))
    with pytest.raises(ValueError, match="value must have the seqlen of key"):
        m(x, x, torch.randn(2, 9, 64))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        m(x, key_padding_mask=torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, seqlen_k\) = \(2, 8\)"):
        m(x, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        m([1, 2])


def test_flash_attention_state_dict_round_trip():
    a = FlashAttention(64, 8, num_kv_heads=2, bias=False)
    assert set(a.state_dict()) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}
    assert a.k_proj.weight.shape == (16, 64)
    b = FlashAttention(64, 8, num_kv_heads=2, bias=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])


# ======================================================================================================
# The dispatch core


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([[1, 1, 1, 0, 0]], ((0,), (3,))),
        ([[0, 0, 1, 1, 1]], ((2,), (5,))),
        ([[0, 1, 1, 0, 0]], ((1,), (3,))),
        ([[1, 1, 1, 1, 1]], ((0,), (5,))),
        ([[0, 0, 0, 0, 0]], ((0,), (0,))),
        ([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]], ((0, 3), (2, 5))),
        ([[1, 0, 1, 0, 0]], None),
        ([[1, 1, 0, 0, 1]], None),
    ],
)
def test_key_ranges(rows, expected):
    valid = torch.tensor(rows, dtype=torch.bool)
    got = fn.key_ranges(valid)
    assert got == (None if expected is None else fn.KeyRanges(*expected))
    if got is not None:
        # The tensor attention(key_range=) takes, built with the ranges on the mask's device.
        assert got.key_range.dtype == torch.int32 and got.key_range.device == valid.device
        starts, ends = expected
        assert got.key_range.tolist() == [[s, e] for s, e in zip(starts, ends, strict=True)]
        assert torch.equal(got.key_range, _expected_key_range(~valid))


def test_key_ranges_random_masks_against_a_scan():
    # Random masks of every kind against the key-by-key scan of _expected_key_range.
    for trial in range(200):
        batch, seqlen = int(torch.randint(1, 6, ())), int(torch.randint(0, 12, ()))
        starts = torch.randint(0, seqlen + 1, (batch,))
        ends = torch.minimum(starts + torch.randint(0, seqlen + 1, (batch,)), torch.tensor(seqlen))
        j = torch.arange(seqlen)
        valid = (j >= starts[:, None]) & (j < ends[:, None])
        if trial % 3 == 0 and seqlen:
            valid ^= torch.rand(batch, seqlen) < 0.2  # holes, usually
        expected = _expected_key_range(~valid)
        got = fn.key_ranges(valid)
        if expected is None:
            assert got is None, valid
        else:
            assert got is not None and torch.equal(got.key_range, expected), valid
            assert got == fn.KeyRanges(tuple(expected[:, 0].tolist()), tuple(expected[:, 1].tolist()))


def test_key_ranges_cache_follows_in_place_changes(monkeypatch):
    reads = []
    real = fn._key_ranges
    monkeypatch.setattr(fn, "_key_ranges", lambda m: reads.append(1) or real(m))
    valid = torch.ones(2, 6, dtype=torch.bool)
    first = fn.key_ranges(valid)
    assert first.is_full(6)
    again = fn.key_ranges(valid)  # served from the memo: no second read, the same device tensor
    assert again is first and again.key_range is first.key_range and len(reads) == 1
    valid[1, 4:] = False  # in place: bumps the version counter
    assert fn.key_ranges(valid) == fn.KeyRanges((0, 0), (6, 4))
    assert torch.equal(fn.key_ranges(valid).key_range, torch.tensor([[0, 6], [0, 4]], dtype=torch.int32))
    assert len(reads) == 2


def _ranges_case(S: int) -> fn.KeyRanges:
    # Full, right-padded, left-padded, both, empty, the middle, and one row repeated.
    starts = (0, 0, 2, 2, 0, S // 2, 0)
    ends = (S, S - 2, S, S - 1, 0, S - 1, S - 2)
    return fn.KeyRanges(starts, ends)


def _masked_reference(q, k, v, ranges: fn.KeyRanges, causal: bool):
    S = k.shape[1]
    j = torch.arange(S)
    valid = torch.stack([(j >= s) & (j < e) for s, e in zip(ranges.starts, ranges.ends, strict=True)])
    allowed = valid[:, None, None, :]
    if causal:
        i = torch.arange(q.shape[1])[:, None]
        allowed = allowed & (j[None, :] <= i + S - q.shape[1])
    return _naive_attention(q, k, v, allowed)[0], valid


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(7, 7), (5, 12), (12, 5), (1, 9)])
@pytest.mark.parametrize("made", ["by_hand", "from_mask"])
def test_key_range_attention_matches_masked_reference(causal, L, S, made, key_range_calls):
    B, H, Hkv, D = 7, 4, 2, 16
    q, k, v = torch.randn(B, L, H, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    ranges = _ranges_case(S)
    exact, valid = _masked_reference(q.double(), k.double(), v.double(), ranges, causal)
    if made == "from_mask":
        ranges = fn.key_ranges(valid)
        assert ranges is not None and ranges.key_range is not None
    out = fn.key_range_attention(q, k, v, ranges, causal=causal)
    assert (out.double() - exact).abs().max() < 1e-5
    # One call for the whole batch, with the ranges as a (batch, 2) int32 tensor.
    [(q_shape, k_shape, causal_arg, kr)] = key_range_calls["key_range"]
    assert q_shape == (B, L, H, D) and k_shape == (B, S, Hkv, D) and causal_arg == causal
    assert torch.equal(kr, _expected_key_range(~valid))
    via_sdpa = fn.sdpa_attention(q, k, v, causal=causal, key_valid=valid)
    assert (via_sdpa.double() - exact).abs().max() < 1e-5


def test_key_range_attention_without_padding_is_the_plain_call(key_range_calls):
    q, k, v = torch.randn(2, 5, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    ranges = fn.key_ranges(torch.ones(2, 6, dtype=torch.bool))
    out = fn.key_range_attention(q, k, v, ranges, causal=True)
    assert key_range_calls == {"key_range": [], "plain": 1}
    assert torch.equal(out, flash_attention.attention(q, k, v, causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_key_range_attention_is_differentiable(causal):
    # Ready for a differentiable attention() (the backward issue): the route is one attention() call, so it
    # is differentiable exactly when attention() is. On the CPU attention() is PyTorch: checked now.
    B, L, S, H, D = 5, 6, 9, 2, 8
    q, k, v = (torch.randn(B, n, H, D, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    ranges = fn.KeyRanges((0, 2, 0, 0, 2), (9, 9, 0, 5, 7))
    out = fn.key_range_attention(q, k, v, ranges, causal=causal)
    exact, _ = _masked_reference(q, k, v, ranges, causal)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    expected = torch.autograd.grad(exact, (q, k, v), g)
    assert (out - exact).abs().max() < 1e-12
    for got, want in zip(grads, expected, strict=True):
        assert (got - want).abs().max() < 1e-10


def test_plan_padded_reads_no_mask_off_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the mask was read")

    monkeypatch.setattr(fn, "_key_ranges", boom)
    assert fn.plan_padded(torch.ones(2, 8, dtype=torch.bool)) is None


def test_plan_padded_on_cuda_takes_every_one_run_mask(monkeypatch):
    # No cost model: any mask whose valid keys are one run per row goes to the kernel, however many
    # distinct lengths it has; only holes go to PyTorch.
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    lengths = torch.arange(64)
    valid = torch.arange(256)[None, :] < 100 + lengths[:, None]
    plan = fn.plan_padded(valid)
    assert plan is not None and plan.ends == tuple(range(100, 164)) and set(plan.starts) == {0}
    valid[3, 10] = False
    assert fn.plan_padded(valid) is None


@pytest.mark.parametrize("padding", ["right", "left"])
def test_flash_attention_key_range_route_under_autograd(padding, force_key_range, monkeypatch):
    # Training with padding takes the key-range route (attention() is differentiable); with
    # KERNEL_HAS_BACKWARD switched off it takes the PyTorch route. Gradients: the input's against the
    # float64 reference, the parameters' against the PyTorch route.
    m = FlashAttention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(3, 10, 64, requires_grad=True)
    kpm = _padding(3, 10, padding)
    kpm[1] = torch.arange(10) < 4 if padding == "left" else torch.arange(10) >= 6  # padded whatever the draw
    g = torch.randn(3, 10, 64)
    params = list(m.parameters())

    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", False)  # the switch off: PyTorch route, with a warning
    with pytest.warns(RuntimeWarning, match="backward pass is switched off"):
        out_pt, _ = m(x, key_padding_mask=kpm)
    assert force_key_range["key_range"] == []
    grads_pt = torch.autograd.grad(out_pt, [x, *params], g)

    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", True)  # the default: the kernel's backward
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs through PyTorch" warning
        out, _ = m(x, key_padding_mask=kpm)
    _assert_key_range_route(force_key_range, kpm)
    grads = torch.autograd.grad(out, [x, *params], g)

    x64 = x.detach().double().requires_grad_(True)
    exact, _ = _fa_reference(m, x64, x64, x64, kpm)
    (gx64,) = torch.autograd.grad(exact, x64, g.double())
    assert (out.double() - exact).abs().max() < 1e-5
    assert (grads[0].double() - gx64).abs().max() < 1e-4
    for got, want in zip(grads, grads_pt, strict=True):
        assert (got - want).abs().max() < 1e-4


# ======================================================================================================
# MultiheadAttention against torch.nn.MultiheadAttention


def _pair(*args, dtype=torch.float32, **kwargs):
    stock = nn.MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours = MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock.eval(), ours.eval()


def _run_all(stock, ours, args, kwargs):
    """(ours, stock, float64 stock) outputs of one call."""
    exact_m = copy.deepcopy(stock).double()
    exact_args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    # Keep identity between query/key/value (self-attention is detected by identity).
    for i in range(len(args)):
        for j in range(i):
            if args[i] is args[j]:
                exact_args[i] = exact_args[j]
    exact_kwargs = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in kwargs.items()
    }
    with torch.no_grad():
        o = ours(*args, **kwargs)
        s = stock(*args, **kwargs)
        e = exact_m(*exact_args, **exact_kwargs)
    return o, s, e


def test_state_dict_keys_match_stock():
    for kwargs in (
        {},
        {"bias": False},
        {"kdim": 24, "vdim": 40},
        {"add_bias_kv": True},
        {"add_zero_attn": True, "batch_first": True},
    ):
        stock = nn.MultiheadAttention(64, 4, **kwargs)
        ours = MultiheadAttention(64, 4, **kwargs)
        assert list(ours.state_dict()) == list(stock.state_dict()), kwargs
        for name, t in stock.state_dict().items():
            assert ours.state_dict()[name].shape == t.shape
        ours.load_state_dict(stock.state_dict())
        stock.load_state_dict(ours.state_dict())
        assert isinstance(ours, nn.MultiheadAttention)


MHA_CASES = [
    # (batch_first, attention kind, causal, key_padding_mask kind: bool/float, right-padded unless -left or
    # -holes)
    (True, "self", False, None),
    (False, "self", False, None),
    (True, "self", True, None),
    (False, "self", True, None),
    (True, "kv_shared", False, None),
    (False, "cross", False, None),
    (True, "self", False, "bool"),
    (False, "self", True, "bool"),
    (True, "self", True, "float"),
    (True, "cross", False, "bool"),
    (True, "unbatched", False, None),
    (True, "unbatched", True, "bool"),
    (True, "self", True, "bool-left"),
    (False, "self", False, "float-left"),
    (True, "cross", False, "bool-left"),
    (True, "unbatched", False, "bool-left"),
    (True, "self", False, "bool-holes"),
    (False, "self", True, "float-holes"),
]


def _mha_inputs(case, E=64):
    batch_first, kind, causal, kpm_kind = case
    kpm_dtype, _, side = (kpm_kind or "").partition("-")
    B, L, S = 3, 14, 14 if kind == "self" or kind == "unbatched" else 9

    def t(n):
        if kind == "unbatched":
            return torch.randn(n, E)
        return torch.randn(B, n, E) if batch_first else torch.randn(n, B, E)

    query = t(L)
    if kind in ("self", "unbatched"):
        key = value = query
    elif kind == "kv_shared":
        key = value = t(S)
    else:
        key, value = t(S), t(S)
    kwargs = {"need_weights": False}
    if causal:
        # The causal mask in the dtype of the padding mask (PyTorch deprecates mixing them).
        kwargs["attn_mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)
        if kpm_dtype != "bool":
            kwargs["attn_mask"] = torch.zeros(L, L).masked_fill(kwargs["attn_mask"], float("-inf"))
        kwargs["is_causal"] = True
    if kpm_kind:
        kpm = _padding(B, S, side or "right")
        if not side:
            kpm[0, -3:] = True  # the first row (otherwise unpadded) gets padding too
            kpm[-1, :2] = False  # and the last (otherwise all padding) two keys: fully padded rows apart
        elif side == "left":
            kpm[0, :3] = True  # at least one row padded whatever the random lengths
        if kind == "unbatched":
            kpm = kpm[1]
        if kpm_dtype == "float":
            kpm = torch.zeros(kpm.shape).masked_fill(kpm, float("-inf"))
        kwargs["key_padding_mask"] = kpm
    return (query, key, value), kwargs


@pytest.mark.parametrize(
    "case, route",
    [(c, "default") for c in MHA_CASES] + [(c, "key_range") for c in MHA_CASES if c[3] is not None],
    ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)),
)
def test_mha_matches_stock(case, route, kernel_calls, request):
    calls = request.getfixturevalue("force_key_range") if route == "key_range" else None
    stock, ours = _pair(64, 4, batch_first=case[0])
    args, kwargs = _mha_inputs(case)
    (o, ow), (s, sw), (e, _) = _run_all(stock, ours, args, kwargs)
    assert ow is None and sw is None
    assert o.shape == s.shape
    kpm = kwargs.get("key_padding_mask")
    # Query rows that see no key (left padding under causal: the padded positions) are NaN in PyTorch's
    # module; ours gives them an attention output of 0 on the kernel routes, so out_proj's bias.
    has_key = torch.ones(o.shape[:-1], dtype=torch.bool)
    if kpm is not None and case[2]:  # causal (square): query i sees the valid keys j <= i
        pad = kpm.isneginf() if kpm.is_floating_point() else kpm
        pad = pad[None] if pad.dim() == 1 else pad  # (batch, seqlen)
        has_key = (~pad).cumsum(1) > 0  # (batch, query)
        has_key = has_key[0] if case[1] == "unbatched" else has_key if case[0] else has_key.T
    if case[3] == "bool-left" and case[2]:
        assert not has_key.all(), "the case meant to have query rows without keys has none"
    _assert_close_rule(o[has_key], s[has_key], e[has_key], str(case))
    if route == "key_range" and not case[3].endswith("-holes"):
        assert torch.equal(o[~has_key], ours.out_proj.bias.expand_as(o[~has_key]))
    if kpm is None:
        assert len(kernel_calls) == 1, "the kernel route was not taken"
    elif route == "default":
        assert kernel_calls == [], "a padded call off CUDA goes to PyTorch's implementation"
    else:
        kpm = kpm.isneginf() if kpm.is_floating_point() else kpm
        holes = _expected_key_range(kpm) is None
        assert holes == case[3].endswith("-holes")
        # One kernel call with the mask's key ranges; a mask with holes goes to PyTorch's implementation.
        assert len(kernel_calls) == (0 if holes else 1)
        _assert_key_range_route(calls, kpm)
        if holes:
            assert torch.equal(o, s)


def test_mha_fully_padded_row(force_key_range):
    # PyTorch disagrees with itself on a batch row whose keys are all padding: its fused fast path gives NaN,
    # its SDPA path 0. Ours gives an attention output of 0, so the row's output is out_proj's bias.
    stock, ours = _pair(32, 4, batch_first=True)
    torch.nn.init.normal_(ours.out_proj.bias)
    stock.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, 32)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1] = True
    kpm[2, 4:] = True
    (o, _), (s, _), (e, _) = _run_all(
        stock, ours, (x, x, x), {"key_padding_mask": kpm, "need_weights": False}
    )
    _assert_key_range_route(force_key_range, kpm)
    assert force_key_range["key_range"][0][3].tolist() == [[0, 7], [0, 0], [0, 4]]
    keep = torch.tensor([True, False, True])
    _assert_close_rule(o[keep], s[keep], e[keep])
    assert torch.allclose(o[1], ours.out_proj.bias.expand(7, -1))


@pytest.mark.parametrize(
    "ctor, call",
    [
        ({}, {"need_weights": True}),
        ({}, {"need_weights": True, "average_attn_weights": False}),
        ({"kdim": 24, "vdim": 40}, {"need_weights": False}),
        ({"add_bias_kv": True}, {"need_weights": False}),
        ({"add_zero_attn": True}, {"need_weights": False}),
        ({"bias": False}, {"need_weights": False}),
        ({}, {"need_weights": False, "attn_mask": "bool"}),
        ({}, {"need_weights": False, "attn_mask": "float"}),
        ({}, {"need_weights": False, "attn_mask": "3d"}),
    ],
)
def test_mha_parent_path_cases_match_stock(ctor, call, kernel_calls):
    stock, ours = _pair(64, 4, batch_first=True, **ctor)
    query = torch.randn(2, 10, 64)
    key = torch.randn(2, 13, ctor.get("kdim", 64))
    value = torch.randn(2, 13, ctor.get("vdim", 64))
    call = dict(call)
    kind = call.get("attn_mask")
    if kind == "bool":
        call["attn_mask"] = torch.rand(10, 13) < 0.3
    elif kind == "float":
        call["attn_mask"] = torch.randn(10, 13)
    elif kind == "3d":
        call["attn_mask"] = torch.randn(2 * 4, 10, 13)
    if kind:
        with pytest.warns(RuntimeWarning, match="slow path"):
            (o, ow), (s, sw), (e, ew) = _run_all(stock, ours, (query, key, value), call)
    else:
        (o, ow), (s, sw), (e, ew) = _run_all(stock, ours, (query, key, value), call)
    supported = ctor == {"bias": False}
    assert (len(kernel_calls) == 1) == supported
    if not supported:
        # The parent's implementation itself: bit-identical to stock.
        assert torch.equal(o, s)
    _assert_close_rule(o, s, e)
    if call["need_weights"]:
        assert torch.equal(ow, sw)
        assert ow.shape == ((2, 10, 13) if call.get("average_attn_weights", True) else (2, 4, 10, 13))
    else:
        assert ow is None


def test_mha_float_attn_mask_warns_once():
    _, ours = _pair(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    bias = torch.randn(5, 5)
    with pytest.warns(RuntimeWarning, match="arbitrary float"):
        ours(x, x, x, attn_mask=bias, need_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, x, x, attn_mask=bias, need_weights=False)


def test_mha_float_padding_with_bias_values_goes_to_parent(force_key_range):
    stock, ours = _pair(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    kpm = torch.randn(2, 6)  # an additive key bias, not padding
    with pytest.warns(RuntimeWarning, match="additive bias"):
        (o, _), (s, _), (e, _) = _run_all(
            stock, ours, (x, x, x), {"key_padding_mask": kpm, "need_weights": False}
        )
    assert torch.equal(o, s)
    assert force_key_range == {"key_range": [], "plain": 0}


def test_mha_training_matches_stock_including_gradients_and_dropout(kernel_calls, monkeypatch):
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    stock, ours = _pair(64, 4, batch_first=True, dropout=0.3)
    stock.train(), ours.train()
    x = torch.randn(2, 9, 64, requires_grad=True)
    torch.manual_seed(1)
    s, _ = stock(x, x, x, need_weights=False)
    torch.manual_seed(1)
    with pytest.warns(RuntimeWarning):
        o, _ = ours(x, x, x, need_weights=False)
    assert torch.equal(o, s)  # same random dropout mask: the same computation
    g = torch.randn_like(o)
    (gs,) = torch.autograd.grad(s, x, g)
    (go,) = torch.autograd.grad(o, x, g)
    assert torch.equal(gs, go)
    assert kernel_calls == []


@pytest.mark.parametrize("side", ["right", "left"])
def test_mha_key_range_route_under_autograd_matches_stock_gradients(side, force_key_range, monkeypatch):
    # With a backward pass in the kernel (KERNEL_HAS_BACKWARD = True, the only change it will need), a
    # padded training call takes the key-range route; its gradients are those of PyTorch's module.
    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", True)
    stock, ours = _pair(64, 4, batch_first=True)
    stock.train(), ours.train()
    x = torch.randn(3, 9, 64, requires_grad=True)
    kpm = _padding(3, 9, side)
    kpm[0] = torch.arange(9) >= 5 if side == "right" else torch.arange(9) < 4
    o, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
    s, _ = stock(x, x, x, key_padding_mask=kpm, need_weights=False)
    _assert_key_range_route(force_key_range, kpm)
    assert (o - s).abs().max() < 1e-5
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, [x, *ours.parameters()], g)
    want = torch.autograd.grad(s, [x, *stock.parameters()], g)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() < 1e-4


def test_mha_eval_with_grad_enabled_parameters_uses_the_kernel_route(kernel_calls, monkeypatch):
    # Inference without torch.no_grad(): the parameters require grad, so autograd records the call, which
    # the kernel route (differentiable) takes; with KERNEL_HAS_BACKWARD off it goes to the parent.
    stock, ours = _pair(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    o, _ = ours(x, x, x, need_weights=False)
    assert o.requires_grad and len(kernel_calls) == 1
    s, _ = stock(x, x, x, need_weights=False)
    assert (o - s).abs().max() < 1e-5
    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", False)
    ours(x, x, x, need_weights=False)
    assert len(kernel_calls) == 1
    with torch.no_grad():
        ours(x, x, x, need_weights=False)
    assert len(kernel_calls) == 2


def _error_of(fn_call):
    try:
        fn_call()
    except Exception as exc:  # noqa: BLE001 - comparing whatever PyTorch raises
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize(
    "bad", ["query_4d", "key_embed", "batch_mismatch", "kv_len_mismatch", "is_causal_without_mask"]
)
def test_mha_bad_input_raises_pytorchs_error(bad):
    # Sequence-first: PyTorch's fused fast path (batch_first only) silently ignores is_causal without a mask.
    stock, ours = _pair(32, 4, batch_first=False)
    x = torch.randn(6, 2, 32)
    args, kwargs = [x, x, x], {"need_weights": False}
    if bad == "query_4d":
        args = [x[None], x[None], x[None]]
    elif bad == "key_embed":
        args = [x, torch.randn(6, 2, 16), torch.randn(6, 2, 16)]
    elif bad == "batch_mismatch":
        args = [x, torch.randn(6, 3, 32), torch.randn(6, 3, 32)]
    elif bad == "kv_len_mismatch":
        args = [x, torch.randn(6, 2, 32), torch.randn(7, 2, 32)]
    elif bad == "is_causal_without_mask":
        kwargs["is_causal"] = True
    with torch.no_grad():
        expected = _error_of(lambda: stock(*args, **kwargs))
        got = _error_of(lambda: ours(*args, **kwargs))
    assert expected is not None, "PyTorch accepts this input; the case is wrong"
    assert got == expected


@pytest.mark.parametrize(
    "name, mask, exc, match",
    [
        (
            "key_padding_mask",
            torch.zeros(2, 7, dtype=torch.bool),
            ValueError,
            r"shape \(batch, seqlen_k\) = \(2, 6\)",
        ),
        ("key_padding_mask", torch.zeros(2, 6, 1, dtype=torch.bool), ValueError, r"got \(2, 6, 1\)"),
        (
            "key_padding_mask",
            torch.zeros(2, 6, dtype=torch.int64),
            TypeError,
            "bool or floating-point tensor; got torch.int64",
        ),
        (
            "attn_mask",
            torch.zeros(5, 6, dtype=torch.bool),
            ValueError,
            r"\(6, 6\) or \(8, 6, 6\); got \(5, 6\)",
        ),
        ("attn_mask", torch.zeros(2, 6, 6), ValueError, r"got \(2, 6, 6\)"),
        (
            "attn_mask",
            torch.zeros(6, 6, dtype=torch.int32),
            TypeError,
            "bool or floating-point tensor; got torch.int32",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("causal", [False, True])
def test_mha_bad_mask_error_names_the_argument(name, mask, exc, match, causal):
    stock, ours = _pair(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    kwargs = {"need_weights": False, name: mask}
    if causal:
        kwargs.setdefault("attn_mask", nn.Transformer.generate_square_subsequent_mask(6))
        kwargs["is_causal"] = True
    with torch.no_grad():
        if _error_of(lambda: stock(x, x, x, **kwargs)) is None:
            # PyTorch discards attn_mask unread under is_causal: a drop-in must accept it too.
            assert causal and name == "attn_mask" and exc is ValueError
            assert torch.allclose(ours(x, x, x, **kwargs)[0], stock(x, x, x, **kwargs)[0], atol=1e-6)
            return
        with pytest.raises(exc, match=f"^{name} must .*{match}"):
            ours(x, x, x, **kwargs)


# ======================================================================================================
# replace_attention


def _encoder(num_layers=2, d=64, heads=4, **layer_kwargs):
    layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, **layer_kwargs)
    enc = nn.TransformerEncoder(layer, num_layers)
    for p in enc.parameters():  # every layer its own weights (the encoder deep-copies one layer)
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return enc.eval()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("mask", [None, "padding-right", "padding-left", "causal"])
def test_replace_attention_transformer_encoder(mask, kernel_calls, force_key_range, monkeypatch):
    reads = []
    real_read = fn._key_ranges
    monkeypatch.setattr(fn, "_key_ranges", lambda m: reads.append(1) or real_read(m))
    stock = _encoder(3)
    ours = replace_attention(copy.deepcopy(stock))
    assert all(isinstance(layer.self_attn, MultiheadAttention) for layer in ours.layers)
    assert ours.use_nested_tensor is False
    x = torch.randn(3, 11, 64)
    kwargs = {}
    if mask == "padding-right":
        kwargs["src_key_padding_mask"] = _padding(3, 11, "right")
        kwargs["src_key_padding_mask"][0, -2:] = True
        kwargs["src_key_padding_mask"][-1, :3] = False  # no fully padded row: the nested path would drop it
    elif mask == "padding-left":
        kwargs["src_key_padding_mask"] = _padding(3, 11, "left")
        kwargs["src_key_padding_mask"][0, :2] = True
    elif mask == "causal":
        kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(11)
        kwargs["is_causal"] = True
    exact_m = copy.deepcopy(stock).double()
    with torch.no_grad():
        s = stock(x, **kwargs)
        o = ours(x, **kwargs)
        e = exact_m(x.double(), **{k: v.double() if k == "mask" else v for k, v in kwargs.items()})
    kpm = kwargs.get("src_key_padding_mask")
    valid = slice(None) if kpm is None else ~kpm
    # Stock's nested-tensor path returns 0 at padded positions; ours computes them (as without nesting).
    _assert_close_rule(o[valid], s[valid], e[valid], str(mask))
    # Our forward ran in every layer (the fused fast paths were bypassed), on the kernel route.
    assert len(kernel_calls) == 3
    if kpm is not None:
        # Every layer: one call with the mask's key ranges. The mask was read on the host once for the
        # forward pass, not once per layer (the encoder hands every layer the same mask tensor).
        _assert_key_range_route(force_key_range, kpm, n_calls=3)
        assert len(reads) == 1
    else:
        assert force_key_range["key_range"] == [] and reads == []


def test_replace_attention_keeps_parameters_and_settings():
    model = nn.Transformer(
        d_model=32,
        nhead=4,
        num_encoder_layers=1,
        num_decoder_layers=2,
        dim_feedforward=64,
        dropout=0.0,
        batch_first=True,
        dtype=torch.float64,
    )
    old = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    params = {id(p) for p in model.parameters()}
    model.eval()
    src, tgt = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        before = model(
            src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
        )
    assert replace_attention(model) is model
    new = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(new) == len(old) == 5  # 1 encoder self-attn, 2 x (decoder self-attn + cross-attn)
    assert all(type(m) is MultiheadAttention for m in new)
    assert {id(p) for p in model.parameters()} == params  # the same Parameter objects
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(not m.training for m in new)
    with torch.no_grad():
        after = model(
            src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
        )
    assert (after - before).abs().max() < 1e-12


def test_replace_attention_bare_module_and_shared_module():
    stock = nn.MultiheadAttention(32, 4)
    converted = replace_attention(stock)
    assert type(converted) is MultiheadAttention and converted.in_proj_weight is stock.in_proj_weight
    shared = nn.MultiheadAttention(32, 4)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    replace_attention(model)
    assert model["a"] is model["b"][0] and type(model["a"]) is MultiheadAttention


# ======================================================================================================
# Demo (CPU path)


def test_demo_cpu_runs_and_renders(tmp_path, capsys, monkeypatch):
    from flash_attention.tools import demo, provenance

    out = tmp_path / "demo.json"
    assert (
        demo.main(
            ["--seqlens", "32,64", "--d-model", "64", "--heads", "4", "--layers", "1", "--out", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "No CUDA GPU found" in printed
    result = __import__("json").loads(out.read_text())
    assert {r["impl"] for r in result["rows"]} == {"stock", "flash_attention"}
    assert all(r["ms"] > 0 for r in result["rows"])
    ours = [r for r in result["rows"] if r["impl"] == "flash_attention"]
    assert all(r["max_abs_diff_vs_stock"] < 1e-4 for r in ours)
    assert result["source_digest"] == provenance.source_digest() and result["commit"]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- demo:begin -->\nold\n<!-- demo:end -->\n\n## after\n")
    # The README check of provenance has its own tests (test_bench.py); here the tables are the subject.
    monkeypatch.setattr(provenance, "check_result", lambda result, repo, what: None)
    demo.update_readme(readme, out)
    text = readme.read_text()
    assert (
        "old" not in text
        and "| flash_attention |" in text
        and text.endswith("<!-- demo:end -->\n\n## after\n")
    )


def _scored_reference(q, k, v, allowed, softcap, slopes):
    """float64 attention with an explicit (batch, 1, seqlen_q, seqlen_k) mask and a score function."""
    from flash_attention.fallback.reference import alibi_bias

    group = q.shape[2] // k.shape[2]
    kf, vf = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kf) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s + alibi_bias(slopes, q.shape[0], q.shape[1], k.shape[1], torch.float64)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf)


@pytest.mark.parametrize("score", ["alibi", "softcap"])
@pytest.mark.parametrize("padding", ["none", "right", "holes"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_flash_attention_layer_takes_alibi_and_softcap(score, padding, need_weights):
    # Every route of the layer (plain, key ranges, the materialised path for masks with holes and for
    # weights) against float64 with the same score function and mask.
    from flash_attention.nn import FlashAttention

    torch.manual_seed(5)
    heads, n = 4, 23
    slopes = torch.linspace(0.1, 0.8, heads) if score == "alibi" else None
    kw = {"alibi_slopes": slopes} if score == "alibi" else {"softcap": 1.5}
    layer = FlashAttention(64, heads, num_kv_heads=2, causal=True, **kw).eval()
    assert ("alibi" if score == "alibi" else "softcap=1.5") in repr(layer)
    x = torch.randn(2, n, 64) * 3
    pad = None
    if padding != "none":
        pad = torch.zeros(2, n, dtype=torch.bool)
        if padding == "right":
            pad[1, 17:] = True
        else:
            pad[1, 5:9] = True
    with torch.no_grad():
        out, weights = layer(x, key_padding_mask=pad, need_weights=need_weights)
        q = layer.q_proj(x).unflatten(-1, (heads, 16)).double()
        k = layer.k_proj(x).unflatten(-1, (2, 16)).double()
        v = layer.v_proj(x).unflatten(-1, (2, 16)).double()
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        if pad is not None:
            allowed = allowed & ~pad[:, None, None, :]
        ref = _scored_reference(q, k, v, allowed, 1.5 if score == "softcap" else 0.0,
                                None if slopes is None else slopes.double())  # fmt: skip
        want = layer.out_proj(ref.reshape(2, n, 64).float())
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert (weights is not None) == need_weights
    with pytest.raises(ValueError, match="alibi_slopes must be a tensor of shape"):
        FlashAttention(64, heads, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        FlashAttention(64, heads, softcap=-1.0)


def test_demo_on_a_gpu_writes_its_result_into_the_current_directory(tmp_path, monkeypatch):
    # A GPU run without --out used to write into the checkout's benchmarks/results/demo/ (a dirty tree for
    # whoever ran the README's command); it goes to ./flash_attention_results/demo/ like bench's results.
    from flash_attention.tools import demo

    result = {"gpu": "NVIDIA H200", "date": "2026-11-28", "rows": [{"impl": "stock", "ms": 1.0}]}
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: dict(result))
    monkeypatch.chdir(tmp_path)
    assert demo.main([]) == 0
    written = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [Path("flash_attention_results/demo/h200-2026-11-28.json")], written
    assert json.loads((tmp_path / written[0]).read_text())["gpu"] == "NVIDIA H200"
