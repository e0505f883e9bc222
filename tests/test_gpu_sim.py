"""The kernels against the tile simulator, and the debug build's traces (marked gpu; need sm_80+, and sm_90
for the warp-specialized Hopper kernel's).

Bound: the simulator rounds at the kernel's rounding points, so the two can differ only by what the
tensor cores' summation order and the hardware's ex2/logf change in fp32 -- a few ulps of fp32 -- and by
where that moves a value across a rounding boundary of the output dtype. ``simulate(error_bound=True)``
propagates that fp32 uncertainty through the same steps and returns, per element, 0 where no rounding
boundary is within reach (the kernel must be bit-identical there) and one, rarely two, units in the last
place of the output where one is: per element, far tighter than the reference rule of test_gpu_forward.py
(2x PyTorch's error, one number for the whole tensor); each case prints both. On top of the bound, at least
90% of the output must be bit-identical (an H200 gave 96.9-99.98%).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_gpu_forward import _VARIANTS
from test_gpu_sm90 import needs_hopper

import flash_attention as fa
from flash_attention import ops
from flash_attention.configs import HEAD_DIMS, default_config, parse_config, portable_config
from flash_attention.fallback.reference import attention_reference, causal_allowed
from flash_attention.ops.plans import device_facts
from flash_attention.ops.winners import SEQLEN_BUCKETS
from flash_attention.tools import debug, sanity
from flash_attention.tools.sim import TraceSpec, lazy_reference, simulate

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Every portable default, and the variants.
CONFIGS = [
    c.name()
    for c in dict.fromkeys(
        portable_config(dt, d, causal, n, n)
        for dt in DTYPES
        for d in HEAD_DIMS
        for causal in (False, True)
        for n in SEQLEN_BUCKETS
    )
] + list(_VARIANTS)
# The warp-specialized Hopper defaults (sm_90 only): three consumer warpgroups (head_dim 64), the persistent
# grid (128, 64 with a 3-deep ring of 176-key tiles) and one block per tile (128 with 176 keys, 192, 256 with
# 80 keys), and the schedule without intra-warpgroup overlap (256, short).
WS_TRACE_CONFIGS = [
    default_config("bf16", 64, False, 8192, 8192, "sm_90").name(),
    default_config("bf16", 128, True, 512, 512, "sm_90").name(),
    default_config("fp16", 64, False, 512, 512, "sm_90").name(),
    default_config("fp16", 128, False, 4096, 4096, "sm_90").name(),
    default_config("bf16", 192, True, 4096, 4096, "sm_90").name(),
    default_config("bf16", 256, True, 4096, 4096, "sm_90").name(),
    default_config("fp16", 256, False, 512, 512, "sm_90").name(),
]


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(
        torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype)
        for s, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )


def _reference_tolerance(q, k, v, causal):
    """The accuracy rule's bound (2x PyTorch's own error + 1e-5), for comparison with ours."""
    ref, _ = attention_reference(q, k, v, causal=causal)
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    mask = causal_allowed(q.shape[1], k.shape[1], device=q.device) if causal else None
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    return 2 * (o.double() - ref).abs().nan_to_num(0.0).max().item() + 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", CONFIGS + [pytest.param(n, marks=needs_hopper) for n in WS_TRACE_CONFIGS])
def test_kernel_equals_simulator(name, causal):
    cfg = parse_config(name)
    seed = (CONFIGS + WS_TRACE_CONFIGS).index(name) * 2 + causal
    d = cfg.head_dim if seed % 4 < 2 else cfg.head_dim - 24
    sq, sk = (459, 300) if causal else (300, 459)  # causal: 159 rows see no key
    q, k, v = _inputs(2, sq, sk, 4, 2, d, DTYPES[cfg.dtype], seed)
    out = torch.full_like(q, float("nan"))
    o, lse = fa.forward(cfg, q, k, v, causal=causal, return_lse=True, out=out)
    torch.cuda.synchronize()
    s_out, s_lse, bound, lse_bound = simulate(q, k, v, cfg, causal=causal, error_bound=True)
    o, lse = o.cpu(), lse.cpu()

    diff = (o.double() - s_out.double()).abs()
    outside = diff > bound
    same = (o == s_out).double().mean().item()
    reachable = (bound > 0).double().mean().item()
    # In units in the last place of each row's largest value (an element's own ulp means nothing near 0).
    row_max = s_out.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    row_ulp = torch.finfo(o.dtype).eps * torch.exp2(torch.floor(torch.log2(row_max)))
    worst_ulps = (diff / row_ulp).max().item()
    fin = torch.isfinite(s_lse)
    lse_diff = (lse.double() - s_lse.double()).abs()
    ref_tol = _reference_tolerance(q, k, v, causal)
    print(
        f"\nSIMSTAT {name} causal={causal} d={d}: {same * 100:.3f}% bit-identical, bound > 0 on "
        f"{reachable * 100:.1f}%, max diff {diff.max().item():.3g} ({worst_ulps:.2f} row ulp), max bound "
        f"{bound.max().item():.3g} vs reference tolerance {ref_tol:.3g}; lse max diff "
        f"{lse_diff[fin].max().item():.3g} (bound max {lse_bound[fin].max().item():.3g})"
    )
    assert not torch.isnan(o).any()
    if outside.any():
        i = tuple(torch.nonzero(outside)[0].tolist())
        pytest.fail(
            f"{int(outside.sum())} elements outside the bound; first {i}: kernel {o[i].item()} simulator "
            f"{s_out[i].item()} bound {bound[i].item():.3g}"
        )
    assert torch.equal(torch.isfinite(lse), fin) and torch.equal(lse[~fin], s_lse[~fin])
    assert (lse_diff[fin] <= lse_bound[fin]).all(), (lse_diff - lse_bound)[fin].max().item()
    # Measured on an H200 at these seeds: 96.9% (fp16, non-causal) to 99.98% bit-identical.
    assert same > 0.9, "the simulator should reproduce almost every element bit for bit"


def _ratios(tr_s, tr_k) -> str:
    """How much of each bound the kernel used (max over steps and elements): the bound's margin."""
    out = []
    for name in ("S", "M", "alpha", "P", "L", "O"):
        worst = 0.0
        for ss, ks, bs in zip(tr_s.steps, tr_k.steps, tr_s.bounds, strict=True):
            diff = (ks[name].double() - ss[name].double()).abs().nan_to_num(0.0, posinf=0.0)
            used = torch.where(diff > 0, diff / bs[name].clamp_min(1e-300), torch.zeros_like(diff))
            worst = max(worst, used.max().item())
        out.append(f"{name} {worst:.2g}")
    return ", ".join(out)


TRACE_CONFIGS = [
    default_config("bf16", 64, False, 1, 1).name(),
    default_config("bf16", 128, False, 1, 1).name(),
    default_config("fp16", 256, False, 1, 1).name(),
    "(BF16, 128, 64, 64, 4): sync+load_0_0_0_tiles",
    "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse",
    "(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer",
    "(BF16, 256, 128, 64, 8): async+eager+swizzled+load_2_2_1_tiles+buffer+opt_softmax",
    "(BF16, 64, 16, 256, 1): async+eager+swizzled+load_0_1_2_tiles+buffer+opt_softmax",
] + [pytest.param(n, marks=needs_hopper) for n in WS_TRACE_CONFIGS]


@pytest.mark.parametrize("name", TRACE_CONFIGS)
def test_kernel_trace_matches_the_simulator(name):
    cfg = parse_config(name)
    d = cfg.head_dim - 8
    q, k, v = _inputs(1, 300, 333, 4, 2, d, DTYPES[cfg.dtype], 17)
    for causal in (False, True):
        # The last warp of the last row block: rows past seqlen_q, the tail of K/V, and (causal) the diagonal.
        spec = TraceSpec(0, 3, -1, cfg.compute_warps - 1)
        out_t, lse_t, tr_k = debug.run_kernel(q, k, v, cfg, causal=causal, trace=spec)
        out_n, lse_n = fa.forward(cfg, q, k, v, causal=causal, return_lse=True)
        # The debug build computes bit for bit what the normal build computes.
        assert torch.equal(out_t, out_n) and torch.equal(lse_t, lse_n)
        *_, tr_s = simulate(q, k, v, cfg, causal=causal, trace=spec)
        assert tr_k.kv_blocks == tr_s.kv_blocks and len(tr_k.steps) > 1
        print(f"\nTRACESTAT {name} causal={causal}: max |kernel - simulator| / bound: {_ratios(tr_s, tr_k)}")
        mismatch = debug.compare(tr_s, tr_k)
        assert mismatch is None, f"{name} causal={causal}: {mismatch.describe()}"


@pytest.mark.parametrize(
    "name",
    [
        default_config("bf16", 128, False, 1, 1).name(),
        "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse",
        "(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer",
        # The warp-specialized kernel with and without the overlapped schedule (step j's O is recorded
        # inside step j + 1 with it), and persistent.
        pytest.param(default_config("bf16", 128, False, 4096, 4096, "sm_90").name(), marks=needs_hopper),
        pytest.param(default_config("fp16", 256, False, 512, 512, "sm_90").name(), marks=needs_hopper),
        pytest.param(default_config("bf16", 64, True, 512, 512, "sm_90").name(), marks=needs_hopper),
    ],
)
def test_planted_faults_are_located(name, tmp_path, capsys):
    cfg = parse_config(name)
    q, k, v = _inputs(1, 300, 300, 2, 2, cfg.head_dim, DTYPES[cfg.dtype], 23)
    spec = TraceSpec(0, 1, 1, cfg.compute_warps - 1)
    # The ws kernel's lazy reference (sim.lazy_reference) moves only when a block's max passes it by 2^8:
    # scores on a scale of 1 (not 1/sqrt(head_dim)) spread far enough for some row's to move after the first
    # step.
    scale = 1.0 if lazy_reference(cfg) else None
    *_, tr_s = simulate(q, k, v, cfg, softmax_scale=scale, trace=spec)

    # Skipped rescale: O goes wrong at the first step where some row's max grew (alpha < 1), not before.
    _, _, tr_k = debug.run_kernel(q, k, v, cfg, softmax_scale=scale, trace=spec, fault="skip_rescale")
    m = debug.compare(tr_s, tr_k)
    first = next(i for i, st in enumerate(tr_s.steps) if i > 0 and (st["alpha"] < 1).any())
    assert m is not None and (m.step, m.name) == (first, "O"), m.describe() if m else None
    assert tr_s.steps[m.step]["alpha"][m.index[0]] < 1

    # Wrong swizzle of K's fragments (warp-specialized: K's descriptor one row off, fa/trace.cuh): Q and K
    # in shared memory are right, S of the first step is not.
    _, _, tr_k = debug.run_kernel(q, k, v, cfg, softmax_scale=scale, trace=spec, fault="wrong_swizzle")
    m = debug.compare(tr_s, tr_k)
    assert m is not None and (m.step, m.name) == (0, "S"), m.describe() if m else None

    # The command names the same place and writes both traces.
    args = ["--config", name, "--seqlen", "300", "--trace", f"0,1,1,{cfg.compute_warps - 1}"]
    args += ["--seed", "5", "--out", str(tmp_path)] + ([] if scale is None else ["--scale", str(scale)])
    assert debug.main(args) == 0
    out = capsys.readouterr().out
    assert "\nmatch: every traced intermediate" in out and "; 0 of " in out and " and 0 of " in out, out
    assert debug.main(args + ["--fault", "skip_rescale"]) == 1
    out = capsys.readouterr().out
    assert "first difference: step " in out and ", O[row " in out, out
    kernel_txt = (tmp_path / "kernel.txt").read_text()
    assert kernel_txt.startswith("# flash_attention trace (kernel)")
    assert kernel_txt.count("\n## step ") == (tmp_path / "sim.txt").read_text().count("\n## step ")


@needs_hopper
@pytest.mark.parametrize(
    "name",
    [
        default_config("bf16", 128, True, 512, 512, "sm_90").name(),
        default_config("fp16", 64, True, 512, 512, "sm_90").name(),
        default_config("bf16", 64, False, 8192, 8192, "sm_90").name(),
    ],
)
def test_ws_trace_of_a_late_tile_and_of_rows_without_keys(name):
    """More query tiles than multiprocessors (a persistent block reaches the traced tile through the tile
    counter, after other tiles), GQA 4:1, and causal with seqlen_q > seqlen_k: a row block that sees no key
    (at block_q 128) and rows without keys inside a visited block (at 192)."""
    cfg = parse_config(name)
    b, sq, sk, hq, hkv = 2, 459, 300, 24, 6
    tiles = b * hq * math.ceil(sq / cfg.block_q)
    assert tiles > torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = _inputs(b, sq, sk, hq, hkv, cfg.head_dim, DTYPES[cfg.dtype], 31)
    cases = [
        (False, TraceSpec(1, hq - 1, -1, cfg.compute_warps - 1)),  # the last tile of the schedule
        (True, TraceSpec(1, 17, -1, 5)),
        (True, TraceSpec(0, 5, 0, 3)),  # rows 48..63: no key is visible to them (159 rows see none)
    ]
    for causal, spec in cases:
        out_t, lse_t, tr_k = debug.run_kernel(q, k, v, cfg, causal=causal, trace=spec)
        out_n, lse_n = fa.forward(cfg, q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out_t, out_n) and torch.equal(lse_t, lse_n)
        *_, tr_s = simulate(q, k, v, cfg, causal=causal, trace=spec)
        assert tr_k.kv_blocks == tr_s.kv_blocks
        mismatch = debug.compare(tr_s, tr_k)
        assert mismatch is None, f"{name} causal={causal} {spec}: {mismatch.describe()}"
        if spec.row_block == 0 and causal:
            assert torch.isneginf(tr_k.final["LSE"]).all() and (tr_k.final["O"] == 0).all()
            assert (tr_k.n_blocks == 0) == (cfg.block_q <= 159)


def test_trace_from_the_environment_variable(monkeypatch):
    q, k, v = _inputs(1, 200, 200, 4, 4, 64, torch.bfloat16, 29)
    monkeypatch.setenv("FLASH_ATTENTION_TRACE", "0,2,1,0")
    out = fa.attention(q, k, v, causal=True)
    tr_k = debug.last_kernel_trace()
    assert tr_k is not None and tr_k.spec == TraceSpec(0, 2, 1, 0)
    # The config a traced call picks (on Hopper the warp-specialized default, which has a debug build).
    facts = device_facts(torch.cuda.current_device())
    assert tr_k.config == ops.forward_config("bf16", 64, True, 200, 200, 1, **facts, features=["trace"])
    *_, tr_s = simulate(q, k, v, tr_k.config, causal=True, trace=tr_k.spec)
    assert debug.compare(tr_s, tr_k) is None
    monkeypatch.delenv("FLASH_ATTENTION_TRACE")
    assert torch.equal(out, fa.attention(q, k, v, causal=True))
    assert ops.last_trace()["config"] == tr_k.config


def test_sanity_runs_what_attention_runs_on_this_gpu(capsys):
    assert sanity.main([]) == 0
    out = capsys.readouterr().out
    assert "\nPASS" in out and "compute capability" in out and "run:       PASS" in out, out
    assert math.isfinite(float(out.split("max error ")[-1].split()[0]))
    # The forward and backward configurations named are the ones a default call picks here.
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert ops.chosen_config(q, q, causal=True, softmax_scale=128**-0.5).name() in out
    if torch.cuda.get_device_capability() == (9, 0):
        assert "wgmma" in out.split("forward:")[1].splitlines()[0]
        assert "_wgmma" in out.split("backward:")[1].splitlines()[0]


@pytest.mark.parametrize("variant", ["window", "segments", "alibi", "sinks"])
@pytest.mark.parametrize("opt", [True, False])
def test_kernel_variants_equal_the_simulator(variant, opt):
    """The portable kernel's window, segments, ALiBi and sinks builds within the simulator's bounds."""
    from flash_attention.api.varlen import segments as make_segments

    cfg = portable_config("bf16", 64, True, 512, 512).replace(opt_softmax=opt)
    sq = sk = 333
    q, k, v = _inputs(1, sq, sk, 4, 2, 64, torch.bfloat16, 77 + opt)
    kw: dict = {}
    sim_kw: dict = {}
    causal = True
    if variant == "window":
        kw["window"] = sim_kw["window"] = (70, 9)
    elif variant == "alibi":
        kw["alibi_slopes"] = sim_kw["alibi_slopes"] = torch.linspace(0.05, 0.5, 4, device="cuda")
    elif variant == "sinks":
        kw["sinks"] = sim_kw["sinks"] = torch.linspace(-1.0, 4.0, 4, device="cuda")
    else:
        cu = torch.tensor([0, 100, 101, 260, 333], dtype=torch.int32, device="cuda")
        runs = make_segments(cu, cu, sq, sk, causal=True)
        kw["segments"], sim_kw["segments"], causal = runs, runs[0], False
    o, lse = ops.cuda_forward(
        q, k, v, causal=causal, softmax_scale=64**-0.5, return_lse=True, out=None, config=cfg, **kw
    )
    torch.cuda.synchronize()
    s_out, s_lse, bound, lse_bound = simulate(q, k, v, cfg, causal=causal, error_bound=True, **sim_kw)
    o, lse = o.cpu(), lse.cpu()
    outside = (o.double() - s_out.double()).abs() > bound
    assert not outside.any(), f"{int(outside.sum())} elements outside the simulator's bound"
    fin = torch.isfinite(s_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert ((lse.double() - s_lse.double()).abs()[fin] <= lse_bound[fin]).all()
    assert (o == s_out).double().mean().item() > 0.9
