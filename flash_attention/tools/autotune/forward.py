"""The forward kernel family in the autotuner: each candidate compiled (spilling ones and ones that cost a
second block per SM dropped), checked against the float64 reference on an odd-shaped problem, and timed
through :func:`flash_attention.forward` on the benchmark shapes."""

from __future__ import annotations

import torch

from flash_attention import ops
from flash_attention.api import attention as interface
from flash_attention.configs import KernelConfig, default_config
from flash_attention.fallback.reference import attention_reference
from flash_attention.jit.cache import build
from flash_attention.ops.winners import entry_key

from ..common import flops, time_cuda
from .loop import Family, Result, screen_candidates, time_candidates
from .space import occupancy_problem, search_space

__all__ = ["FORWARD", "check_candidate", "prepare_candidates", "tune_shape"]


def check_candidate(cfg: KernelConfig, causal: bool, device) -> str | None:
    """None if ``cfg`` computes attention correctly on a small odd-shaped problem; else what went wrong."""
    gen = torch.Generator(device=device).manual_seed(1234)
    dt = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    d = cfg.head_dim
    q = torch.randn(1, 333, 4, d, generator=gen, device=device).to(dt)
    k = torch.randn(1, 301, 2, d, generator=gen, device=device).to(dt)
    v = torch.randn(1, 301, 2, d, generator=gen, device=device).to(dt)
    out = torch.full_like(q, float("nan"))
    o = interface.forward(cfg, q, k, v, causal=causal, out=out)
    ref, _ = attention_reference(q, k, v, causal=causal)
    err = (o.double() - ref).abs().nan_to_num(float("inf")).max().item()
    # Far above bf16 rounding of a correct kernel (~1e-2 worst case here), far below any indexing error.
    return None if err < 0.05 else f"wrong result: max error {err:.3g} against the float64 reference"


def tune_shape(
    cands: list[KernelConfig],
    dtype: str,
    head_dim: int,
    causal: bool,
    seqlen: int,
    group: int,
    *,
    tokens: int = 16384,
    width: int = 2048,
    budget_s: float = 0.05,
    finalists: int = 4,
) -> list[Result]:
    """Time every candidate on the benchmark shape of ``seqlen``; the best few again, longer.

    Successive halving in two rounds: a short timing of everyone, then ``finalists`` re-timed with 4x the
    budget, so the winner is not a lucky sample and the sweep stays affordable.
    """
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    batch, heads = max(1, tokens // seqlen), max(1, width // head_dim)
    heads_kv = max(1, heads // group)
    heads = heads_kv * group
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dt)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    fl = flops(batch, heads, seqlen, seqlen, head_dim, causal, "fwd")

    def measure(cfg: KernelConfig, budget: float) -> float:
        t = time_cuda(
            lambda i: interface.forward(cfg, q, k, v, causal=causal),
            1,
            warmup=2,
            min_reps=5,
            min_time_s=budget,
        )
        return t.ms

    return time_candidates(cands, measure, budget_s, finalists, fl)


def prepare_candidates(cands: list[KernelConfig], causal: bool, jobs: int = 16) -> tuple[list, dict]:
    """Compile all candidates in parallel; drop those that fail, spill, or compute a wrong result."""
    arch = ops.device_arch(torch.cuda.current_device())

    def build_problem(cfg: KernelConfig) -> str | None:
        built = build(cfg, arch)
        spills = sum(r["spill_stores"] + r["spill_loads"] for r in built.meta["resources"])
        regs = max(r["registers"] for r in built.meta["resources"])
        # A spilling kernel moves registers through local memory inside its main loop: never a winner.
        if spills:
            return f"spills {spills} bytes"
        if occupancy_problem(cfg, regs):
            return f"{regs} registers: {occupancy_problem(cfg, regs)}"
        return None

    return screen_candidates(
        cands, build_problem, lambda cfg: check_candidate(cfg, causal, torch.device("cuda")), jobs
    )


FORWARD = Family(
    name="forward",
    candidates=search_space,
    prepare=prepare_candidates,
    tune=lambda ok, dtype, d, causal, seqlen, group, budget: tune_shape(
        ok, dtype, d, causal, seqlen, group, budget_s=budget
    ),
    default=lambda dtype, d, causal, seqlen, arch: default_config(dtype, d, causal, seqlen, seqlen, arch),
    key=entry_key,
)
