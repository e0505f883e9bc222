"""GPU tests of the score functions (``softcap``, ``alibi_slopes`` and both; csrc/include/fa/variant.cuh
Softcap, Alibi, SoftcapAlibi) in every kernel family that takes them, forward and backward, at the launch
layer: outputs, LSE and gradients against float64 (flash_attention.fallback.reference) within a few times the
error of the same computation in float32 rounded to the inputs' precision, on shapes with GQA, seqlen_q above
and below seqlen_k, causal and not, key ranges, a sliding window, head dims 64/128/256 and one padded; the
deterministic backward bitwise between runs; and each with attention dropout, against float64 with the
kernels' keep mask (flash_attention.dropout.keep_mask)."""

from __future__ import annotations

import zlib

import pytest
import torch

from flash_attention import ops
from flash_attention.configs import default_bwd_config, hopper_bwd_config, padded_head_dim, portable_config
from flash_attention.configs.heuristics import classic_hopper_config
from flash_attention.dropout import draw_seed, keep_mask
from flash_attention.fallback.reference import attention_reference

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, key_range, window, score)
CASES = [
    (2, 333, 517, 4, 2, 128, True, False, None, "softcap"),
    (1, 517, 300, 4, 4, 64, False, False, None, "softcap"),
    (2, 300, 300, 4, 1, 256, True, True, None, "softcap"),
    (1, 400, 400, 2, 2, 72, True, False, (64, 0), "softcap"),
    (2, 333, 517, 4, 2, 128, True, False, None, "alibi"),
    (1, 517, 300, 4, 4, 64, False, True, None, "alibi"),
    (2, 300, 300, 4, 1, 256, True, False, (100, 0), "alibi"),
    # both, composed (SoftcapAlibi): the capped score plus the bias
    (2, 333, 517, 4, 2, 128, True, False, None, "softcap+alibi"),
    (1, 517, 300, 4, 4, 64, False, True, (90, 40), "softcap+alibi"),
    (2, 300, 300, 4, 1, 256, True, False, None, "softcap+alibi"),
    (1, 400, 333, 4, 2, 192, True, True, None, "softcap+alibi"),
]


def _ids(case):
    return "-".join(str(x).replace(" ", "") for x in case)


def _call(case):
    b, sq, sk, hq, hkv, d, causal, ranged, window, score = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    kr = None
    if ranged:
        kr = torch.tensor([[sk // 5, sk - 7], [0, sk]][:b], dtype=torch.int32, device="cuda")
    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=kr, window=window)
    mods = {}
    if "softcap" in score:
        mods["softcap"] = 1.5  # well inside the scores' range: the cap bites
    if "alibi" in score:
        mods["alibi_slopes"] = torch.linspace(0.05, 0.6, hq, device="cuda")
        if b > 1:
            mods["alibi_slopes"] = torch.stack([mods["alibi_slopes"] * (1 + 0.3 * i) for i in range(b)])
    return (q, k, v, do), kw, mods


def _reference(tensors, kw, mods, dtype, drop=None):
    q, k, v, do = tensors
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    ref_mods = dict(softcap=mods.get("softcap", 0.0))
    if drop is not None:
        ref_mods["dropout_keep"], ref_mods["dropout_p"] = drop
    if "alibi_slopes" in mods:
        ref_mods["alibi_slopes"] = mods["alibi_slopes"].to(dtype)
    o, lse = attention_reference(
        *leaves, causal=kw["causal"], softmax_scale=kw["softmax_scale"], key_range=kw["key_range"],
        window=kw["window"], compute_dtype=dtype, **ref_mods,
    )  # fmt: skip
    grads = torch.autograd.grad(o, leaves, do.to(dtype))
    return o.detach(), lse.detach(), grads


def _close(got, exact, f32, name):
    err = (got.double() - exact).abs().max().item()
    err32 = (f32.to(got.dtype).double() - exact).abs().max().item()
    assert err <= 4 * err32 + 2e-3, f"{name}: {err:.3g} against float64 (float32 rounded: {err32:.3g})"


def _families(case):
    d, causal, sq, sk = padded_head_dim(case[5]), case[6], case[1], case[2]
    fwd = {"default": None, "portable": portable_config("bf16", case[5], causal, sq, sk)}
    bwd = {"portable": default_bwd_config("bf16", d, "sm_80", portable=True)}
    if _hopper():
        fwd["sm90"] = classic_hopper_config("bf16", d, max(sq, sk), causal)
        bwd["hopper"] = hopper_bwd_config("bf16", d)
        if d <= 128:  # half of P's exponentials on the FMA pipe (BwdConfig.exp_poly, kernel log 138)
            bwd["hopper_poly"] = hopper_bwd_config("bf16", d).replace(exp_poly=4)
        if d == 192:  # the warp-specialized wide backward's other key block (the default 96: kernel log 140)
            bwd["hopper_kv64"] = hopper_bwd_config("bf16", d).replace(block_kv=64)
    return fwd, bwd


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_score_function_forward_and_backward_against_float64(case):
    tensors, kw, mods = _call(case)
    q, k, v, do = tensors
    exact_o, exact_lse, exact_g = _reference(tensors, kw, mods, torch.float64)
    f32_o, _, f32_g = _reference(tensors, kw, mods, torch.float32)
    fwd, bwd = _families(case)
    for name, cfg in fwd.items():
        out = torch.full_like(q, float("nan"))
        o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=out, config=cfg, **kw, **mods)
        assert torch.isfinite(o).all(), name
        _close(o, exact_o, f32_o, f"{name} out")
        rows = torch.isfinite(exact_lse)
        torch.testing.assert_close(lse[rows].double(), exact_lse[rows], rtol=0, atol=5e-3, msg=name)
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw, **mods)
    for name, cfg in bwd.items():
        for det in (False, True):
            got = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, deterministic=det, **kw, **mods)
            for gname, a, e, f in zip(("dq", "dk", "dv"), got, exact_g, f32_g, strict=True):
                assert torch.isfinite(a).all(), f"{name} det={det} {gname}"
                _close(a, e, f, f"{name} det={det} {gname}")
            if det:
                again = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, deterministic=True, **kw, **mods)
                assert all(torch.equal(x, y) for x, y in zip(got, again, strict=True)), name


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, key_range, window, score) with dropout
DROPOUT_CASES = [
    (2, 333, 517, 4, 2, 64, True, False, None, "softcap"),
    (2, 517, 300, 4, 4, 128, False, True, None, "alibi"),
    (1, 300, 300, 4, 1, 256, True, False, (100, 0), "softcap+alibi"),
    (2, 400, 333, 2, 2, 72, False, False, None, "softcap+alibi"),
]


@needs_cuda
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=_ids)
def test_score_function_with_dropout_against_float64(case):
    # Dropout multiplies the score function's probabilities by the keep mask / (1 - p) before P V, and its
    # backward takes the score function's derivative at the undropped probabilities: the two compose in
    # every family's softmax and dS step (fa/dropout.cuh, fa/variant.cuh).
    tensors, kw, mods = _call(case)
    q, k, v, do = tensors
    p, seed = 0.2, zlib.crc32(repr(case).encode()) % 10_000
    keep = keep_mask(seed, 0, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1], device="cuda")
    exact_o, exact_lse, exact_g = _reference(tensors, kw, mods, torch.float64, (keep, p))
    f32_o, _, f32_g = _reference(tensors, kw, mods, torch.float32, (keep, p))
    drop = dict(dropout_p=p, dropout_seed=draw_seed(seed))
    fwd, bwd = _families(case)
    for name, cfg in fwd.items():
        out = torch.full_like(q, float("nan"))
        o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=out, config=cfg, **kw, **mods, **drop)
        assert torch.isfinite(o).all(), name
        _close(o, exact_o, f32_o, f"{name} out")
        rows = torch.isfinite(exact_lse)
        torch.testing.assert_close(lse[rows].double(), exact_lse[rows], rtol=0, atol=5e-3, msg=name)
    # Without the mask the output is far off: the kernels apply it rather than ignore it.
    undropped = _reference(tensors, kw, mods, torch.float64)[0]
    assert (o.double() - undropped).abs().max() > 10 * (o.double() - exact_o).abs().max()
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw, **mods, **drop)
    for name, cfg in bwd.items():
        for det in (False, True):
            got = ops.cuda_backward(do, q, k, v, o, lse, config=cfg, deterministic=det, **kw, **mods, **drop)
            for gname, a, e, f in zip(("dq", "dk", "dv"), got, exact_g, f32_g, strict=True):
                assert torch.isfinite(a).all(), f"{name} det={det} {gname}"
                _close(a, e, f, f"{name} det={det} {gname}")


@needs_cuda
@pytest.mark.skipif(not _hopper(), reason="the soft-capped config is a Hopper (warp-specialized) one")
@pytest.mark.parametrize("cap", [1.5, 30.0])
def test_soft_capped_d128_config_against_float64(cap, monkeypatch):
    # From 3k keys, non-causal, bf16 at head_dim 128, soft-capping runs its own config (ops.select
    # score_function_config: 192-row blocks over 64-key tiles). Query rows not a multiple of 192 and keys not
    # of 64; grouped heads. The default call must launch it (and chosen_config, what bench and the tools
    # report, must name it); the named config runs on the causal entry point too.
    from flash_attention.ops import forward as launch
    from flash_attention.ops import repeat
    from flash_attention.spec.score_functions import SCORE_FUNCTIONS

    SOFTCAP_D128_CONFIG = SCORE_FUNCTIONS["softcap"].forward_config_d128

    launched: list[str] = []
    real = launch.launch_plan

    def spy(plan, *args, **kwargs):
        launched.append(plan.cfg.name())
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(launch, "launch_plan", spy)
    monkeypatch.setattr(repeat, "MODE", "python" if repeat.MODE == "native" else repeat.MODE)
    for causal, sq in ((False, 200), (True, 3100)):
        case = (1, sq, 3100, 4, 2, 128, causal, False, None, "softcap")
        tensors, kw, mods = _call(case)
        mods["softcap"] = cap
        q, k, v, do = tensors
        exact_o, exact_lse, _ = _reference(tensors, kw, mods, torch.float64)
        f32_o, _, _ = _reference(tensors, kw, mods, torch.float32)
        config = None if not causal else SOFTCAP_D128_CONFIG
        if config is None:
            chosen = ops.chosen_config(q, k, v, causal=False, softmax_scale=kw["softmax_scale"], softcap=True)
            assert chosen.name() == SOFTCAP_D128_CONFIG
        out = torch.full_like(q, float("nan"))
        launched.clear()
        o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=out, config=config, **kw, **mods)
        assert launched == [SOFTCAP_D128_CONFIG]
        assert torch.isfinite(o).all()
        _close(o, exact_o, f32_o, f"cap {cap} causal {causal} out")
        torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=5e-3)


# Rows that see exactly one key, soft-capped: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
# window, cap, dtype). One visible key makes the softmax exactly 1 whatever the score, so the row's output
# is that key's value and its dQ (and the dK of a key only such rows see) is exactly 0 in any precision.
ONE_KEY_CASES = [
    (2, 1, 1, 6, 1, 128, False, None, 15.0, "bf16"),  # one query, one key, multi-query heads
    (2, 1, 1, 6, 1, 128, False, None, 15.0, "fp16"),
    (3, 1, 1, 4, 2, 128, True, None, 15.0, "bf16"),
    (2, 1, 1, 4, 2, 64, True, (64, 0), 20.0, "bf16"),
    (2, 1, 1, 4, 2, 128, True, (64, 0), 20.0, "bf16"),
    (2, 300, 300, 4, 2, 128, False, (0, 0), 20.0, "bf16"),  # a window of one key: every row
    (1, 257, 257, 2, 1, 64, True, (0, 0), 30.0, "bf16"),
    (1, 300, 300, 2, 2, 256, False, (0, 0), 50.0, "bf16"),
    (1, 200, 200, 2, 1, 128, False, (0, 0), 20.0, "fp16"),
    (2, 300, 200, 4, 2, 128, True, None, 15.0, "bf16"),  # causal, seqlen_q > seqlen_k: row 100 sees key 0
]


def _visible_keys(sq, sk, causal, window):
    """(seqlen_q, seqlen_k) boolean of the keys each row sees (bottom-right aligned, as the kernels)."""
    from flash_attention.fallback.reference import window_allowed

    allowed = torch.ones(sq, sk, dtype=torch.bool, device="cuda")
    if causal:
        allowed &= window_allowed(sq, sk, (-1, 0), device="cuda")
    if window is not None:
        allowed &= window_allowed(sq, sk, window, device="cuda")
    return allowed


@needs_cuda
@pytest.mark.parametrize("case", ONE_KEY_CASES, ids=_ids)
def test_soft_capped_rows_with_one_key_have_exact_gradients(case):
    # The soft-capped forward without a running max (fa/softmax.cuh bounded_softmax_row) once summed the
    # fp32 probabilities while P V took them rounded to 16 bits: a one-key row's O was (bf16(P) / P) V, not
    # V, and the backward's D = rowsum(dO O) missed dP = dO V by that, giving dQ and dK of up to 0.09 where
    # both are exactly 0 (the accuracy rule allows 1e-5 there: PyTorch's own error is 0). Through the
    # public call with autograd, as a model trains.
    import flash_attention as fa

    b, sq, sk, hq, hkv, d, causal, window, cap, dt = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v, do = (
        torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype)
        for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = fa.attention(*leaves, causal=causal, window=window, softcap=cap)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)

    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=None, window=window)
    exact_o, _, exact_g = _reference((q, k, v, do), kw, {"softcap": cap}, torch.float64)
    low_o, _, low_g = _reference((q, k, v, do), kw, {"softcap": cap}, dtype)

    visible = _visible_keys(sq, sk, causal, window)
    one_key_rows = visible.sum(1) == 1
    assert one_key_rows.any()
    # Keys seen by one-key rows only (and by at least one row): their dK is exactly 0.
    only_one_key_rows = visible.any(0) & ~(visible & ~one_key_rows[:, None]).any(0)
    group = hq // hkv
    for name, got, exact, low, rows in (
        ("out", o, exact_o, low_o, one_key_rows),
        ("dq", dq, exact_g[0], low_g[0], one_key_rows),
        ("dk", dk, exact_g[1], low_g[1], only_one_key_rows),
        ("dv", dv, exact_g[2], low_g[2], visible.any(0)),
    ):
        assert torch.isfinite(got).all(), name
        if not rows.any():
            continue
        index = rows.nonzero().flatten()  # query rows (out, dq) or keys (dk, dv): dimension 1 of each
        err = (got.index_select(1, index).double() - exact.index_select(1, index)).abs().max().item()
        low_err = (low.index_select(1, index).double() - exact.index_select(1, index)).abs().max().item()
        assert err <= 2 * low_err + 1e-5, (
            f"{name}: {err:.3g} against float64 (PyTorch in {dt}: {low_err:.3g})"
        )
    # A one-key row's output is its key's value exactly (the weights P V applies add up to exactly 1).
    key_of_row = visible.float().argmax(1)
    rows = one_key_rows.nonzero().flatten()
    expected = v.repeat_interleave(group, dim=2).index_select(1, key_of_row[rows])
    assert torch.equal(o.detach().index_select(1, rows), expected)
