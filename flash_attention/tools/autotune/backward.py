"""The backward kernel family in the autotuner (``autotune --backward``): candidates of :class:`BwdConfig`
compiled in parallel, each checked against the float64 reference gradients on a small odd-shaped GQA
problem (candidates that fail to compile, spill more than the shipped bound or compute wrong gradients are
reported and skipped), then timed on every benchmark shape. Winners go into the same cache under
``bwd/<forward key>``, which the launch layer consults before the defaults."""

from __future__ import annotations

import torch

from flash_attention import ops
from flash_attention.configs import BwdConfig, default_bwd_config
from flash_attention.fallback.reference import attention_backward_torch, attention_torch
from flash_attention.jit.cache import build
from flash_attention.ops.winners import bwd_entry_key

from ..common import flops, time_cuda
from .loop import Family, Result, screen_candidates, time_candidates
from .space import bwd_candidate_space

__all__ = ["BACKWARD", "check_bwd_candidate", "prepare_bwd_candidates", "tune_bwd_shape"]

#: Spill bytes a backward candidate may have and still be timed: the plain instantiations of the shipped
#: defaults spill up to 24 bytes of stores outside the inner products; a candidate that spills more moves
#: registers through local memory where it hurts.
MAX_CANDIDATE_SPILL_BYTES = 32


def check_bwd_candidate(cfg: BwdConfig, causal: bool) -> str | None:
    """None if ``cfg``'s gradients match the float64 reference on a small odd-shaped GQA problem."""
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
    """Compile in parallel; keep those that compile, spill at most MAX_CANDIDATE_SPILL_BYTES and compute
    right."""
    arch = ops.device_arch(torch.cuda.current_device())

    def build_problem(cfg: BwdConfig) -> str | None:
        spill = max(r["spill_stores"] for r in build(cfg, arch).meta["resources"])
        return f"spills {spill} bytes" if spill > MAX_CANDIDATE_SPILL_BYTES else None

    return screen_candidates(cands, build_problem, lambda cfg: check_bwd_candidate(cfg, causal), jobs)


def tune_bwd_shape(
    cands: list[BwdConfig], dtype: str, head_dim: int, causal: bool, seqlen: int, group: int, budget_s: float
) -> list[Result]:
    """Time every candidate's backward (preprocessing, dK/dV with dQ, the dQ cast) on the benchmark shape of
    ``seqlen``; the best four again with 4x the budget."""
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


BACKWARD = Family(
    name="backward",
    candidates=lambda dtype, d, causal, arch: bwd_candidate_space(dtype, d, arch),
    prepare=prepare_bwd_candidates,
    tune=tune_bwd_shape,
    default=lambda dtype, d, causal, seqlen, arch: default_bwd_config(dtype, d, arch, causal=causal),
    key=bwd_entry_key,
)
