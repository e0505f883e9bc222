"""The tile simulator on the CPU: accuracy against the float64 reference, tiling, traces, error bounds.

Accuracy rule (DESIGN.md): max error against float64 at most 2x the error of PyTorch's own attention on the
same low-precision inputs (here its CPU implementation) + 1e-5. Every case draws fresh random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_gpu_forward import _VARIANTS  # the variant list the GPU tests run: one list for both tiers

import flash_attention.tools.sim as sim
from flash_attention.configs import HEAD_DIMS, default_config, parse_config, portable_config
from flash_attention.fallback.reference import attention_reference, causal_allowed
from flash_attention.ops.winners import SEQLEN_BUCKETS
from flash_attention.tools.sim import STEP_NAMES, TraceSpec, n_blocks_per_row_block, simulate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Every portable default (the simulator models the sm80 kernel), and the variants.
CONFIGS = [
    c.name()
    for c in dict.fromkeys(
        portable_config(dt, d, causal, n, n)
        for dt in ("fp16", "bf16")
        for d in HEAD_DIMS
        for causal in (False, True)
        for n in SEQLEN_BUCKETS
    )
] + list(_VARIANTS)


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    return q, k, v


def _sdpa_cpu_error(q, k, v, causal, ref):
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    mask = causal_allowed(q.shape[1], k.shape[1]) if causal else None
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    return (o.double() - ref).abs().nan_to_num(0.0).max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_simulator_meets_the_accuracy_rule(name, causal):
    cfg = parse_config(name)
    # Odd lengths, seqlen_q != seqlen_k (both ways), GQA, and a head_dim below the compiled one.
    seed = CONFIGS.index(name) * 2 + causal
    sq, sk = (131, 197) if seed % 2 else (203, 77)
    d = cfg.head_dim if seed % 3 else cfg.head_dim - 24
    q, k, v = _inputs(1, sq, sk, 4, 2, d, DTYPES[cfg.dtype], seed)
    out, lse = simulate(q, k, v, cfg, causal=causal)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (1, 4, sq)
    has_key = torch.arange(sq) + (sk - sq) >= 0 if causal else torch.ones(sq, dtype=torch.bool)
    err = (out.double() - ref)[:, has_key].abs().max().item()
    # PyTorch gives NaN for rows that see no key; _sdpa_cpu_error leaves them out.
    bound = 2 * _sdpa_cpu_error(q, k, v, causal, ref)
    assert err <= bound + 1e-5, f"{name} causal={causal}: error {err:.3g} > {bound + 1e-5:.3g}"
    assert torch.isfinite(out).all()
    lse_err = (lse[:, :, has_key].double() - ref_lse[:, :, has_key]).abs().max().item()
    assert lse_err < 1e-4, lse_err
    if not has_key.all():  # causal with seqlen_q > seqlen_k: rows that see no key
        assert (out[:, ~has_key] == 0).all() and torch.isneginf(lse[:, :, ~has_key]).all()


def test_rows_without_keys_and_empty_row_blocks():
    cfg = default_config("bf16", 64, True, 1, 1)
    # seqlen_q - seqlen_k = 150 > block_q: whole row blocks see no key (n_blocks = 0 there).
    q, k, v = _inputs(1, 170, 20, 2, 1, 64, torch.bfloat16, 1)
    assert n_blocks_per_row_block(cfg, 170, 20, True)[:2] == [0, 0]
    out, lse = simulate(q, k, v, cfg, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out[:, :150] == 0).all() and torch.isneginf(lse[:, :, :150]).all()
    assert (out[:, 150:].double() - ref[:, 150:]).abs().max() < 0.02


def _expected_blocks(cfg, row_block, sq, sk, causal):
    """K/V blocks a row block must visit: those holding a key any of its rows may attend (independent of
    the simulator: from the reference's causal mask), in the config's order."""
    rows = range(row_block * cfg.block_q, min(sq, (row_block + 1) * cfg.block_q))
    allowed = causal_allowed(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    keys = torch.nonzero(allowed[list(rows)].any(0)).flatten().tolist()
    blocks = sorted({key // cfg.block_kv for key in keys})
    # The kernel walks every block up to the last needed one (blocks before the diagonal are all needed).
    assert blocks == list(range(len(blocks)))
    return blocks[::-1] if cfg.reverse_kv else blocks


# Hopper defaults of the warp-specialized kernel (its consumer warps own 16 rows each): three consumer
# warpgroups, the persistent grid with 176-key tiles, and 80-key tiles at head_dim 256.
WS_CONFIGS = [
    default_config("bf16", 64, False, 8192, 8192, "sm_90").name(),
    default_config("fp16", 64, False, 512, 512, "sm_90").name(),
    default_config("bf16", 256, True, 4096, 4096, "sm_90").name(),
]


@pytest.mark.parametrize(
    "name",
    [
        "(BF16, 64, 64, 128, 4): async+eager+swizzled+load_0_0_1_tiles+buffer+opt_softmax",
        "(BF16, 64, 64, 128, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax+reverse",
        "(BF16, 64, 16, 256, 1): async+eager+swizzled+load_0_1_2_tiles+buffer+opt_softmax",
        *WS_CONFIGS,
    ],
)
@pytest.mark.parametrize("sq,sk", [(150, 150), (100, 230), (230, 100)])
def test_trace_visits_the_kernels_blocks_in_order(name, sq, sk):
    cfg = parse_config(name)
    q, k, v = _inputs(1, sq, sk, 1, 1, 64, DTYPES[cfg.dtype], sq + sk)
    for causal in (False, True):
        for rb in range(math.ceil(sq / cfg.block_q)):
            *_, tr = simulate(q, k, v, cfg, causal=causal, trace=TraceSpec(0, 0, rb, 0))
            assert tr.kv_blocks == _expected_blocks(cfg, rb, sq, sk, causal), (causal, rb)
            assert tr.n_blocks == len(tr.steps) == len(tr.kv_blocks)


@pytest.mark.parametrize(
    "name",
    [
        "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_4_4_1_tiles+buffer+opt_softmax",
        "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse",
        "(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer",
        *WS_CONFIGS,
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_trace_is_consistent(name, causal):
    cfg = parse_config(name)
    sq, sk, d = 230, 300, cfg.head_dim - 8
    q, k, v = _inputs(1, sq, sk, 4, 2, d, DTYPES[cfg.dtype], 5)
    scale = 0.7 / math.sqrt(d)
    # GQA: query head 3 reads K/V head 1. A warp-specialized block's last consumer warp: rows past seqlen_q.
    spec = TraceSpec(0, 3, -1, cfg.compute_warps - 1 if cfg.warp_specialized else 1)
    out, lse, tr = simulate(q, k, v, cfg, causal=causal, softmax_scale=scale, trace=spec)
    spec = tr.spec
    wm, bc = cfg.rows_per_warp, cfg.block_kv
    rows = torch.arange(tr.first_row, tr.first_row + wm)
    inside = rows < sq
    allowed = causal_allowed(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    kf, vf = k[0, :, 1].double(), v[0, :, 1].double()
    qrows = torch.zeros(wm, cfg.head_dim, dtype=torch.float64)
    qrows[inside, :d] = q[0, rows[inside], 3].double()

    # The ws kernel's lazy reference max (fa/softmax.cuh kLazy): M is then the reference.
    lazy = sim.lazy_reference(cfg)
    running_m = torch.full((wm,), float("-inf"), dtype=torch.float64)
    l_expect = torch.zeros(wm, dtype=torch.float64)
    o_expect = torch.zeros(wm, cfg.head_dim, dtype=torch.float64)
    for step, j in zip(tr.steps, tr.kv_blocks, strict=True):
        keys = torch.arange(j * bc, j * bc + bc)
        kin = keys < sk
        # Q, K, V: exactly the rows the tile holds (zero past the sequence and past head_dim).
        kt = torch.zeros(bc, cfg.head_dim, dtype=torch.float64)
        vt = torch.zeros(bc, cfg.head_dim, dtype=torch.float64)
        kt[kin, :d], vt[kin, :d] = kf[keys[kin]], vf[keys[kin]]
        assert torch.equal(step["Q"].double(), qrows)
        assert torch.equal(step["K"].double(), kt) and torch.equal(step["V"].double(), vt)
        # S = Q K^T in fp32: within a few fp32 ulps of the exact product.
        s_exact = qrows @ kt.T
        assert ((step["S"].double() - s_exact).abs() <= 1e-6 * (qrows.abs() @ kt.abs().T) + 1e-30).all()
        # M: the running max of the visible scores (raw with opt_softmax, scaled otherwise); never falls.
        vis = torch.zeros(wm, bc, dtype=torch.bool)
        vis[inside.nonzero().flatten().unsqueeze(1), kin.nonzero().flatten()] = allowed[rows[inside]][
            :, keys[kin]
        ]
        if not causal:
            vis[~inside] = kin  # rows past seqlen_q run on zero Q against every key in range
        else:
            for i in (~inside).nonzero().flatten().tolist():
                vis[i] = kin & (keys <= rows[i] + sk - sq)
        sx = step["S"].double() * (1.0 if cfg.opt_softmax else scale)
        block_max = sx.masked_fill(~vis, float("-inf")).amax(1)
        new_m = torch.maximum(running_m, block_max)
        if lazy:  # the reference moves only past the margin (base 2): P <= 2^margin
            kept = (new_m - running_m) * (scale if cfg.opt_softmax else 1.0) / math.log(2) <= sim.LAZY_MARGIN
            new_m = torch.where(kept, running_m, new_m)
            assert (step["alpha"][kept] == 1).all()
        assert torch.allclose(
            step["M"].double(), new_m.float().double(), rtol=1e-6, atol=0, equal_nan=False
        ) or (
            torch.equal(torch.isneginf(step["M"]), torch.isneginf(new_m))
            and torch.allclose(
                step["M"].double()[~torch.isneginf(new_m)], new_m[~torch.isneginf(new_m)], rtol=1e-6
            )
        )
        assert (step["M"].double() >= running_m.float().double()).all(), "M fell"
        # P = exp(scale * (S - M)) on visible keys, 0 elsewhere; alpha = exp(scale * (M_old - M_new)).
        unit = scale if cfg.opt_softmax else 1.0
        m_fin = torch.where(torch.isneginf(new_m), torch.zeros_like(new_m), new_m)
        p_exact = torch.where(vis, torch.exp(unit * (sx - m_fin.unsqueeze(1))), torch.zeros_like(sx))
        assert ((step["P"].double() - p_exact).abs() <= 1e-5 * p_exact + 1e-30).all()
        a_exact = torch.exp(unit * (running_m - m_fin))
        assert ((step["alpha"].double() - a_exact).abs() <= 1e-5 * a_exact + 1e-30).all()
        # L and O follow the online-softmax recurrence over the trace's own P (O with P rounded to the dtype).
        alpha = step["alpha"].double()
        l_expect = alpha * l_expect + step["P"].double().sum(1)
        p_round = step["P"].to(q.dtype).double()
        o_expect = alpha.unsqueeze(1) * o_expect + p_round @ step["V"].double()
        assert ((step["L"].double() - l_expect).abs() <= 1e-5 * l_expect + 1e-30).all()
        assert ((step["O"].double() - o_expect).abs() <= 1e-5 * (p_round @ vt.abs()).sum() + 1e-30).all()
        running_m = new_m
    # Final rows: the returned output and LSE, and O / L of the last step.
    assert torch.equal(tr.final["O"][inside, :d], out[0, rows[inside], 3].float())
    assert torch.equal(tr.final["LSE"][inside], lse[0, 3, rows[inside]])
    pos = l_expect > 0
    o_norm = (o_expect[pos] / l_expect[pos].unsqueeze(1)).to(q.dtype).double()
    assert ((tr.final["O"][pos].double() - o_norm).abs() <= 2 * 2.0**-7 * o_norm.abs() + 1e-6).all()


def test_trace_l_is_the_rescaled_sum_of_p_and_m_never_falls():
    """The two properties the issue names, on a reverse-order causal config (the order changes both)."""
    cfg = parse_config(
        "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse"
    )
    q, k, v = _inputs(1, 300, 300, 1, 1, 128, torch.bfloat16, 9)
    *_, tr = simulate(q, k, v, cfg, causal=True, trace=TraceSpec(0, 0, -1, 2))
    n = len(tr.steps)
    assert n == 5
    total = torch.zeros(cfg.rows_per_warp, dtype=torch.float64)
    for s in range(n):
        later = torch.ones(cfg.rows_per_warp, dtype=torch.float64)
        for t in range(s + 1, n):
            later = later * tr.steps[t]["alpha"].double()
        total += later * tr.steps[s]["P"].double().sum(1)
    final_l = tr.steps[-1]["L"].double()
    assert torch.allclose(final_l, total, rtol=1e-5, atol=0)
    ms = torch.stack([st["M"] for st in tr.steps])
    assert (ms[1:] >= ms[:-1]).all()
    assert (ms[1:] > ms[:-1]).any(), "with reverse order some row's max must grow"


def _truncating_mma(acc, a, b):
    """A tensor core that truncates each mma step toward zero instead of rounding to nearest."""
    exact = acc.double() + a @ b
    r = exact.float()
    toward_zero = torch.nextafter(r, torch.zeros_like(r))
    return torch.where(r.double().abs() > exact.abs(), toward_zero, r)


def _sloppy_ex2(x):
    """An ex2 with the relative error of the hardware's ex2.approx (about 2^-22), signed by the input."""
    r = torch.exp2(x)
    return r * (1 + 2.0**-22 * torch.sign(torch.sin(1000 * x.nan_to_num(0.0))))


@pytest.mark.parametrize(
    "name",
    [
        "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_4_4_1_tiles+buffer+opt_softmax",
        "(FP16, 64, 64, 128, 4): async+eager+swizzled+load_0_0_1_tiles+buffer+opt_softmax",
        "(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer",
    ],
)
def test_error_bound_covers_other_rounding_of_the_same_steps(name, monkeypatch):
    """What the bound promises for the kernel, checked against a simulated 'other hardware': mma steps that
    truncate and an ex2 that is off by 2^-22 must stay within it, in the output and in every traced entry."""
    from flash_attention.tools.debug import compare

    cfg = parse_config(name)
    q, k, v = _inputs(1, 197, 150, 2, 2, cfg.head_dim, DTYPES[cfg.dtype], 3)
    spec = TraceSpec(0, 1, -1, 0)
    out, lse, ob, lb, tr = simulate(q, k, v, cfg, causal=True, trace=spec, error_bound=True)
    monkeypatch.setattr(sim, "_mma", _truncating_mma)
    monkeypatch.setattr(sim, "_ex2", _sloppy_ex2)
    out2, lse2, *_, tr2 = simulate(q, k, v, cfg, causal=True, trace=spec, error_bound=True)
    assert not torch.equal(out, out2), "the perturbation changed nothing: the test would prove nothing"
    assert ((out2.double() - out.double()).abs() <= ob).all()
    fin = torch.isfinite(lse)
    assert torch.equal(fin, torch.isfinite(lse2))
    assert ((lse2[fin].double() - lse[fin].double()).abs() <= lb[fin]).all()
    tr2.source = "perturbed"
    assert compare(tr, tr2) is None
    # The bound is tight: many elements must be bit-identical, and none may be off by more than two units
    # in the last place of its row's largest value (eps is 2 ulps at 1.0).
    assert (ob == 0).float().mean() > 0.3
    row_max = out.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    row_ulp = torch.finfo(out.dtype).eps * torch.exp2(torch.floor(torch.log2(row_max)))
    assert (ob <= 2 * row_ulp).all()


def test_error_bound_catches_a_wrong_rounding_point(monkeypatch):
    """Skipping the rounding of P to bf16 (a kernel bug of the kind the simulator exists to expose) moves the
    output far outside the bound."""
    cfg = default_config("bf16", 64, False, 1, 1)
    q, k, v = _inputs(1, 100, 300, 2, 2, 64, torch.bfloat16, 4)
    out, lse, ob, lb = simulate(q, k, v, cfg, error_bound=True)

    real_to = torch.Tensor.to

    def no_rounding(self, *args, **kwargs):
        if args and args[0] is torch.bfloat16 and self.dtype == torch.float32 and self.dim() == 5:
            return self  # P stays fp32 in P V
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_rounding)
    out2, _ = simulate(q, k, v, cfg)
    monkeypatch.undo()
    outside = ((out2.double() - out.double()).abs() > ob).float().mean().item()
    assert outside > 0.05, outside


def test_simulate_validates_its_arguments():
    cfg = default_config("bf16", 64, False, 1, 1)
    q, k, v = _inputs(1, 10, 10, 4, 2, 64, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="head_dim <= 64"):
        simulate(*_inputs(1, 10, 10, 1, 1, 72, torch.bfloat16, 0), cfg)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        simulate(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1), cfg)
    with pytest.raises(ValueError, match="positive"):
        simulate(q, k, v, cfg, softmax_scale=-0.1)
    with pytest.raises(ValueError, match="warp must be in"):
        simulate(q, k, v, cfg, trace=TraceSpec(0, 0, 0, 4))
    with pytest.raises(ValueError, match="batch,head,row_block,warp"):
        TraceSpec.parse("0,0,1")


def test_non_opt_softmax_takes_negative_scales():
    cfg = parse_config("(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer")
    q, k, v = _inputs(1, 70, 90, 2, 1, 200, torch.float16, 6)
    out, lse = simulate(q, k, v, cfg, causal=True, softmax_scale=-0.05)
    ref, ref_lse = attention_reference(q, k, v, causal=True, softmax_scale=-0.05)
    assert (out.double() - ref).abs().max() < 2e-3
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def test_trace_dump_names_every_step_and_tensor():
    cfg = parse_config("(FP16, 64, 64, 128, 4): async+eager+swizzled+load_0_0_1_tiles+buffer+opt_softmax")
    q, k, v = _inputs(1, 200, 200, 1, 1, 64, torch.float16, 2)
    *_, tr = simulate(q, k, v, cfg, causal=True, trace=TraceSpec(0, 0, 2, 3))
    text = tr.dump()
    assert f"K/V steps, blocks in visit order: {tr.kv_blocks}" in text
    for i, j in enumerate(tr.kv_blocks):
        assert f"## step {i}: K/V block {j} (keys {j * 128}..{j * 128 + 127})" in text
    wm = cfg.rows_per_warp
    shapes = {"Q": f"{wm} x 64", "K": "128 x 64", "S": f"{wm} x 128", "M": f"{wm}", "P": f"{wm} x 128"}
    for name, shape in shapes.items():
        assert text.count(f"\n{name} [{shape}]\n") == len(tr.steps)
    assert "\n## final\n" in text and f"\nLSE [{wm}]\n" in text
    # Every value of the last P appears in order on its rows.
    last_p = text.split("\nP [")[-1].split("\nL [")[0]
    assert f"{tr.steps[-1]['P'][0, 0].item():12.7g}" in last_p.splitlines()[1]
    assert set(STEP_NAMES) == {"Q", "K", "S", "M", "alpha", "P", "L", "V", "O"}


@pytest.mark.parametrize("variant", ["window", "segments", "alibi", "softcap", "softcap_alibi", "sinks"])
@pytest.mark.parametrize("opt", [True, False])
def test_simulator_variants_against_float64(variant, opt):
    # Each variant the kernels compute, simulated, against the float64 reference with the same variant,
    # within the tolerance of the plain simulation (float32 softmax, inputs in bf16).
    from flash_attention.api.varlen import segments as make_segments

    cfg = portable_config("bf16", 64, True, 256, 256).replace(opt_softmax=opt)
    sq = sk = 203
    q, k, v = _inputs(1, sq, sk, 4, 2, 64, torch.bfloat16, 41 + opt)
    kw: dict = {}
    ref_kw: dict = {}
    causal = True
    if variant == "window":
        kw["window"] = ref_kw["window"] = (37, 5)
    elif variant == "alibi":
        kw["alibi_slopes"] = torch.linspace(0.05, 0.5, 4)
        ref_kw["alibi_slopes"] = kw["alibi_slopes"].double()
    elif variant == "softcap":
        kw["softcap"] = ref_kw["softcap"] = 1.5
    elif variant == "softcap_alibi":  # (composed: the cap first, then the bias, as fa::SoftcapAlibi)
        kw["softcap"] = ref_kw["softcap"] = 1.5
        kw["alibi_slopes"] = torch.linspace(0.05, 0.5, 4)
        ref_kw["alibi_slopes"] = kw["alibi_slopes"].double()
    elif variant == "sinks":
        kw["sinks"] = torch.linspace(-1.0, 4.0, 4)
        ref_kw["sinks"] = kw["sinks"].double()
    out_plain, _ = simulate(q, k, v, cfg, causal=causal)
    if variant == "segments":
        cu = torch.tensor([0, 50, 51, 160, 203], dtype=torch.int32)
        row_keys, _ = make_segments(cu, cu, sq, sk, causal=True)
        out, lse = simulate(q, k, v, cfg, causal=False, segments=row_keys)
        ref = torch.zeros(q.shape, dtype=torch.float64)
        ref_lse = torch.zeros(1, 4, sq, dtype=torch.float64)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            ref[:, a:b], ref_lse[:, :, a:b] = attention_reference(
                q[:, a:b], k[:, a:b], v[:, a:b], causal=True
            )
    else:
        out, lse = simulate(q, k, v, cfg, causal=causal, **kw)
        ref, ref_lse = attention_reference(q, k, v, causal=causal, **ref_kw)
    plain_ref, _ = attention_reference(q, k, v, causal=causal)
    tol = 2 * (out_plain.double() - plain_ref).abs().max().item() + 1e-5
    assert (out.double() - ref).abs().max().item() <= tol
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4
    assert (out.double() - out_plain.double()).abs().max() > 10 * tol  # the variant changed the result
    if variant.startswith("softcap"):
        with pytest.raises(ValueError, match="softcap: the hardware's approximations are not modelled"):
            simulate(q, k, v, cfg, causal=causal, error_bound=True, **kw)
    else:
        *_, bound, lse_bound = simulate(
            q, k, v, cfg, causal=variant != "segments", error_bound=True,
            **(kw if variant != "segments" else {"segments": row_keys}),
        )  # fmt: skip
        assert bound.shape == q.shape and torch.isfinite(lse_bound).all()


def _check_each_sequence(out, lse, qkv, offsets, lengths, causal, slopes):
    """A simulated packed ALiBi call (bf16) against each sequence alone in float64, with ``slopes`` (heads,)
    or each sequence's own (batch, heads): the output within twice its own rounding, the LSE to 1e-4."""
    (q, k, v), (cu_q, cu_k), (lens_q, lens_k) = qkv, offsets, lengths
    for i, (m, n) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i]) + m), slice(int(cu_k[i]), int(cu_k[i]) + n)
        own = (slopes if slopes.dim() == 1 else slopes[i]).double()
        ref, ref_lse = attention_reference(q[:, qs], k[:, ks], v[:, ks], causal=causal, alibi_slopes=own)
        rounding = (ref.to(torch.bfloat16).double() - ref).abs().max().item()  # (the output's own)
        assert (out[:, qs].double() - ref).abs().max().item() <= 2 * rounding + 1e-3, i
        seen = torch.isfinite(ref_lse)  # (causal rows past their keys see none: -inf in both)
        assert torch.equal(seen, torch.isfinite(lse[:, :, qs]))
        assert (lse[:, :, qs].double() - ref_lse)[seen].abs().max().item() < 1e-4, i


@pytest.mark.parametrize("per_sequence", [False, True], ids=["one_slope_table", "per_sequence_slopes"])
@pytest.mark.parametrize("causal", [False, True])
def test_simulator_packed_alibi_measures_from_each_rows_diagonal(causal, per_sequence):
    # A packed batch of other query and key counts: the kernels' packed ALiBi builds measure from each row's
    # diagonal (the table of varlen.alibi_diagonals without causal, the runs' ends with it), which the
    # simulator takes as alibi_diagonal; slopes of each sequence's own reach the per-row builds as a
    # (seqlen_q, heads) table of each row's (varlen.row_slopes). Each sequence against float64 with ALiBi
    # bottom-right aligned and its own slopes.
    from flash_attention.api.varlen import alibi_diagonals, row_slopes
    from flash_attention.api.varlen import segments as make_segments
    from flash_attention.fallback.reference import runs_alibi_diagonal

    cfg = portable_config("bf16", 64, causal, 256, 256)
    lens_q, lens_k = [50, 1, 109, 43], [70, 20, 100, 13]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))  # fmt: skip
    q, k, v = _inputs(1, sum(lens_q), sum(lens_k), 4, 2, 64, torch.bfloat16, 7 + causal + 2 * per_sequence)
    slopes = torch.linspace(0.05, 0.5, 4)
    if per_sequence:
        slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(3)) * 0.5 + 0.05
    row_keys, _ = make_segments(cu_q, cu_k, q.shape[1], k.shape[1], causal=causal)
    diagonal = (
        runs_alibi_diagonal(row_keys, True, slopes) if causal else alibi_diagonals(cu_q, cu_k, q.shape[1])
    )
    given = row_slopes(slopes, cu_q, q.shape[1]) if per_sequence else slopes
    kw = dict(segments=row_keys, alibi_slopes=given, alibi_diagonal=diagonal)
    out, lse = simulate(q, k, v, cfg, **kw)
    _check_each_sequence(out, lse, (q, k, v), (cu_q, cu_k), (lens_q, lens_k), causal, slopes)
    if per_sequence:
        # The first sequence's slopes for every row are another answer; a table of other rows is refused.
        first, _ = simulate(q, k, v, cfg, **{**kw, "alibi_slopes": slopes[0]})
        assert (first.double() - out.double()).abs().max() > 0.05
        with pytest.raises(ValueError, match="alibi_slopes"):
            simulate(q, k, v, cfg, **{**kw, "alibi_slopes": given[:-1]})
    else:
        # Measured from the packed row instead, the distances are other sequences' where offsets differ.
        measured_in_the_row, _ = simulate(q, k, v, cfg, segments=row_keys, alibi_slopes=slopes)
        assert (measured_in_the_row.double() - out.double()).abs().max() > 0.1
    *_, bound, _ = simulate(q, k, v, cfg, error_bound=True, **kw)
    assert bound.shape == q.shape


def test_lazy_reference_moves_only_past_the_margin_and_stays_accurate():
    """The ws kernel's lazy reference max at head_dim 256 (fa/softmax.cuh kLazy), on scores that grow along
    the keys by about 3 (base 2) per 80-key block: the reference must be kept in some steps after the first
    (alpha exactly 1 while the block's max passed it) and moved in others, and the output must still meet
    the accuracy rule against float64."""
    cfg = parse_config(default_config("bf16", 256, False, 4096, 4096, "sm_90").name())
    assert cfg.warp_specialized and cfg.head_dim == 256 and cfg.block_kv == 80
    gen = torch.Generator().manual_seed(31)
    sq, sk, d = 40, 800, 256
    q = (torch.randn(1, sq, 1, d, generator=gen) * 0.1 + 1.0).to(torch.bfloat16)
    # Key j's scaled scores (q.k / 16, about 1 + 0.026 j) grow by about 2.1 per block, 3 in base 2.
    growth = (1.0 + torch.arange(sk, dtype=torch.float32) * 0.026).view(1, sk, 1, 1)
    k = ((torch.randn(1, sk, 1, d, generator=gen) * 0.1 + 1.0) * growth / 16).to(torch.bfloat16)
    v = torch.randn(1, sk, 1, d, generator=gen).to(torch.bfloat16)
    out, lse, tr = simulate(q, k, v, cfg, causal=False, trace=TraceSpec(0, 0, 0, 0))
    kept = moved = 0
    for it, step in enumerate(tr.steps):
        block_max = step["S"].float().amax(1)
        alpha = step["alpha"]
        if it > 0:
            kept += int(((alpha == 1) & (block_max > step["M"])).any())
            moved += int((alpha < 1).any())
        # P never exceeds 2^margin: the reference trails the max by at most the margin.
        assert step["P"].max().item() <= 2.0**sim.LAZY_MARGIN
    assert kept > 0 and moved > 0, (kept, moved)
    ref, ref_lse = attention_reference(q, k, v)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * _sdpa_cpu_error(q, k, v, False, ref) + 1e-5, err
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4


def test_error_bound_widens_for_polynomial_exponentials():
    """A config computing part of P by fa/ptx.cuh exp2_poly (exp_poly; kernel log 139), whose relative error
    is 1e-4 for bf16 against the SFU's 2^-22.5, gets a bound that allows it: same values, wider P and L
    terms, so a traced kernel's P is not reported as a mismatch."""
    from flash_attention.configs import ws_config

    base = ws_config("bf16", 64, 192, 128, 2, overlap=True)
    q, k, v = _inputs(1, 150, 300, 2, 1, 64, torch.bfloat16, 7)
    out, lse, ob, lb = simulate(q, k, v, base, error_bound=True)
    out2, lse2, ob2, lb2 = simulate(q, k, v, base.replace(exp_poly=4), error_bound=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert (ob2 >= ob).all() and (lb2 >= lb).all() and (lb2 > lb).any()
