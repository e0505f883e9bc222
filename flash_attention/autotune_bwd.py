"""Autotuning of the backward kernel family: ``python -m flash_attention autotune --backward``.

The same loop as the forward's (flash_attention.autotune): a candidate space of :class:`BwdConfig`, compiled
in parallel, each checked against the float64 reference on a small odd-shaped problem (candidates that fail
to compile, spill more than the shipped bound, or compute wrong gradients are reported and skipped), then
timed on every benchmark shape. Winners go into the same cache file under ``bwd/<forward key>`` and
``ops.cuda_backward`` consults them before :func:`flash_attention.configs.default_bwd_config`.
"""

from __future__ import annotations

import itertools
import sys
import time
from functools import cache

from .autotune import (
    Progress,
    Result,
    entry_key,
    screen_candidates,
    seqlen_bucket,
    table_entry,
    time_candidates,
    write_cache,
)
from .configs import BwdConfig, default_bwd_config, padded_head_dim

#: Spill bytes a backward candidate may have and still be timed: the shipped defaults sit at the 255-register
#: limit with up to 24 bytes spilled outside the inner products (tests/test_bwd_configs.py bounds them at 32).
MAX_SPILL_BYTES = 32


def bwd_candidate_space(dtype: str, head_dim: int, arch: str = "sm_80") -> list[BwdConfig]:
    """Every valid backward config of the varied knobs, plus the defaults.

    Varied: the query step (64 or 128 rows), the key block (64 or 128), 4 or 8 warps, the column split and
    the Q/dO double buffer. Key blocks below 64 are left out: each block re-reads every query block, so
    halving it doubles the Q/dO traffic for no gain in parallelism at the benchmark shapes (thousands of
    blocks already). On sm_90 the wgmma kernel's config joins (its shape is fixed by the kernel).
    """
    d = padded_head_dim(head_dim)
    out: list[BwdConfig] = []
    for bq, bkv, warps, split, buf in itertools.product(
        (64, 128), (64, 128), (4, 8), (1, 2, 3, 4), (False, True)
    ):
        try:
            out.append(BwdConfig(dtype, d, bq, bkv, warps, split, buf))
        except ValueError:
            continue
    for cfg in (default_bwd_config(dtype, d), default_bwd_config(dtype, d, arch)):
        if cfg not in out:
            out.append(cfg)
    return out


def bwd_entry_key(dtype: str, head_dim: int, causal: bool, seqlen: int, group: int) -> str:
    return "bwd/" + entry_key(dtype, head_dim, causal, seqlen, group)


def lookup_bwd(
    gpu: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, group: int
) -> BwdConfig | None:
    """The tuned backward winner for this problem on this GPU, or None."""
    return _lookup_bwd(
        gpu, dtype, padded_head_dim(head_dim), causal, seqlen_bucket(max(seqlen_q, seqlen_k)), group > 1
    )


@cache
def _lookup_bwd(gpu: str, dtype: str, d: int, causal: bool, bucket: int, gqa: bool) -> BwdConfig | None:
    from .configs import parse_bwd_config

    # No dtype stand-in here: a backward config names its dtype and is compiled for it.
    found = table_entry(gpu, [bwd_entry_key(dtype, d, causal, bucket, g) for g in ((2, 1) if gqa else (1,))])
    try:
        return parse_bwd_config(found) if found else None
    except ValueError:
        return None


def check_bwd_candidate(cfg: BwdConfig, causal: bool) -> str | None:
    """None if ``cfg``'s gradients match the float64 reference on a small odd-shaped GQA problem."""
    import torch

    from . import ops
    from .reference import attention_backward_torch, attention_torch

    gen = torch.Generator(device="cuda").manual_seed(4321)
    dt = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    d = cfg.head_dim
    q = torch.randn(1, 333, 4, d, generator=gen, device="cuda").to(dt)
    k, v = (torch.randn(1, 301, 2, d, generator=gen, device="cuda").to(dt) for _ in range(2))
    dout = torch.randn(1, 333, 4, d, generator=gen, device="cuda").to(dt)
    scale = d**-0.5
    out, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)
    got = ops.cuda_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, config=cfg)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = attention_torch(q64, k64, v64, causal=causal, softmax_scale=scale, return_lse=True)
    ref = attention_backward_torch(do64, q64, k64, v64, ref_out, ref_lse, causal=causal, softmax_scale=scale)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        err = (g.double() - r).abs().nan_to_num(float("inf")).max().item() / max(r.abs().max().item(), 1e-6)
        # bf16 rounding of a correct kernel stays near 1e-2 of the largest gradient here; indexing errors
        # are of the order of the gradients themselves.
        if err > 0.05:
            return f"wrong {name}: max error {err:.3g} of the largest reference gradient"
    return None


def prepare_bwd_candidates(cands: list[BwdConfig], causal: bool, jobs: int = 16) -> tuple[list, dict]:
    """Compile in parallel; keep those that compile, spill at most MAX_SPILL_BYTES and compute right."""
    import torch

    from .jit.kernels import build, device_arch

    arch = device_arch(torch.cuda.current_device())

    def build_problem(cfg: BwdConfig) -> str | None:
        spill = max(r["spill_stores"] for r in build(cfg, arch).meta["resources"])
        return f"spills {spill} bytes" if spill > MAX_SPILL_BYTES else None

    return screen_candidates(cands, build_problem, lambda cfg: check_bwd_candidate(cfg, causal), jobs)


def tune_bwd_shape(
    cands: list[BwdConfig], dtype: str, head_dim: int, causal: bool, seqlen: int, group: int, budget_s: float
) -> list[Result]:
    """Time every candidate's backward (preprocessing, dK/dV with dQ, the dQ cast) on the benchmark shape of
    ``seqlen``; the best four again with 4x the budget."""
    import torch

    from . import ops
    from .bench import flops, time_cuda

    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    batch, heads = max(1, 16384 // seqlen), max(1, 2048 // head_dim)
    heads_kv = max(1, heads // group)
    heads = heads_kv * group
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dt)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=dt) for _ in range(2))
    dout = torch.randn_like(q)
    scale = head_dim**-0.5
    out, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)
    fl = flops(batch, heads, seqlen, seqlen, head_dim, causal, "bwd")

    def measure(cfg: BwdConfig, budget: float) -> float:
        def call(i: int) -> object:
            return ops.cuda_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, config=cfg)

        return time_cuda(call, 1, warmup=2, min_reps=5, min_time_s=budget).ms

    return time_candidates(cands, measure, budget_s, 4, fl)


def run(args, out_path, gpu: str, arch: str) -> tuple[dict[str, dict], list[dict]]:
    """The ``--backward`` loop of ``autotune``: winners (written after every class) and every timing."""
    dtypes = ["bf16", "fp16"] if args.dtype == "both" else args.dtype.split(",")
    head_dims = [int(x) for x in args.head_dim.split(",")]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    entries: dict[str, dict] = {}
    report: list[dict] = []
    t0 = time.perf_counter()
    for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
        cands = bwd_candidate_space(dtype, d, arch)
        ok, skipped = prepare_bwd_candidates(cands, causal)
        print(
            f"backward {dtype} d={d} {'causal' if causal else 'full'}: {len(ok)} of {len(cands)} candidates "
            f"ready ({time.perf_counter() - t0:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        for name, why in skipped.items():
            print(f"    skipped {name}: {why}", file=sys.stderr)
        if not ok:
            continue
        default = default_bwd_config(dtype, d, arch)
        for seqlen, group in itertools.product(seqlens, groups):
            prog = Progress(len(ok), f"  n={seqlen:5d} g={group}")
            results = tune_bwd_shape(ok, dtype, d, causal, seqlen, group, args.budget)
            for r in results:
                prog.step(r.tflops, r.cfg.name())
            best = results[0]
            if best.ms is None:
                continue
            dflt = next((r for r in results if r.cfg == default and r.ms), None)
            key = bwd_entry_key(dtype, d, causal, seqlen, group)
            entries[key] = {
                "config": best.cfg.name(),
                "ms": round(best.ms, 5),
                "tflops": round(best.tflops, 1),
                "heuristic": default.name(),
                "heuristic_tflops": round(dflt.tflops, 1) if dflt else None,
                "candidates": len(ok),
            }
            ratio = dflt.tflops / best.tflops if dflt else float("nan")
            print(
                f"    {key}: {best.tflops:6.1f} TFLOP/s {best.cfg.name()}  (default {ratio:.3f}x)",
                file=sys.stderr,
                flush=True,
            )
            report += [
                {"key": key, "config": r.cfg.name(), "ms": r.ms, "tflops": r.tflops, "error": r.error}
                for r in results
            ]
        write_cache(out_path, gpu, entries)
    return entries, report
