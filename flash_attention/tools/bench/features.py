"""``bench --features``: every feature of the backward beside the plain call at one shape, forward+backward.

What a user pays for a feature: the deterministic mode, dropout, key ranges, a sliding window, soft-capping,
ALiBi, sinks with their gradient, grouped-query attention and a packed batch (attention_varlen), each timed in
the same process right after the plain call on the same tensors. Rows record the time, the useful work (a
window keeps only its band; every other feature does the plain call's work) and both ratios to the plain
call: ``speed`` (plain time / this time, for equal work) and ``rate`` (this TFLOP/s / plain TFLOP/s). The
project's bar for them (issue 48): every feature within 10% of the plain backward at 4k tokens, head_dim 128
(``rate`` >= 0.9), the deterministic mode >= 0.85.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import flash_attention

from ...spec.score_functions import SCORE_FUNCTIONS
from ..common import flops, time_cuda
from .runners import alibi_slopes

#: The rows, in order; "plain" first (the others' reference).
FEATURES = (
    "plain",
    "deterministic",
    "dropout",
    "key_range",
    "window",
    *SCORE_FUNCTIONS,  # (each scalar score function's row, by its name)
    "alibi",
    "sinks",
    "gqa",
    "varlen",
)


@dataclass(frozen=True)
class FeaturesSettings:
    head_dim: int = 128
    seqlen: int = 4096
    tokens: int = 16384  # batch = tokens // seqlen
    width: int = 2048  # heads = width // head_dim
    causal: tuple[bool, ...] = (False, True)
    dtype: str = "bf16"
    window: int = 1024  # keys before each query (causal shapes; non-causal rows skip it)
    dropout_p: float = 0.1
    #: The score functions' rows' values, (name, value) pairs; a function not named takes its typical value.
    score_values: tuple[tuple[str, float], ...] = ()
    gqa_group: int = 4  # query heads per K/V head of the "gqa" row
    warmup: int = 3
    min_reps: int = 25
    min_time_s: float = 0.2


def _feature_call(
    feature: str, s: FeaturesSettings, causal: bool, q: Any, k: Any, v: Any, do: Any
) -> tuple[Callable[[int], Any], float] | str:
    """``(call, useful FLOPs)`` of one row (call(i) runs forward and backward once), or why it is skipped."""
    batch, n, heads, d = q.shape
    work = flops(batch, heads, n, n, d, causal, "fwd_bwd")
    kw: dict[str, Any] = {"causal": causal}
    tensors = [q, k, v]
    fn: Callable[..., Any] = flash_attention.attention
    if feature == "deterministic":
        kw["deterministic"] = True
    elif feature == "dropout":
        kw.update(dropout_p=s.dropout_p, dropout_seed=1234)
    elif feature == "key_range":
        # Every row sees all its keys: the ranged kernels at the plain call's work.
        kw["key_range"] = torch.tensor([[0, n]] * batch, dtype=torch.int32, device=q.device)
    elif feature == "window":
        if not causal:
            return "a sliding window is timed on causal shapes (the band before each query)"
        kw["window"] = (s.window, 0)
        work = flops(batch, heads, n, n, d, causal, "fwd_bwd", window=s.window)
    elif feature in SCORE_FUNCTIONS:
        kw[feature] = dict(s.score_values).get(feature, SCORE_FUNCTIONS[feature].typical)
    elif feature == "alibi":
        kw["alibi_slopes"] = alibi_slopes(heads, q.device)
    elif feature == "sinks":
        tensors.append(torch.randn(heads, device=q.device))  # (a leaf: its gradient is computed)
    elif feature == "gqa":
        if heads % s.gqa_group:
            return f"{heads} heads do not divide into groups of {s.gqa_group}"
        kv = heads // s.gqa_group
        tensors[1], tensors[2] = (t[:, :, :kv].contiguous() for t in (k, v))
    elif feature == "varlen":
        # The same batch as documents of n tokens each: the plain call's work through the packed path.
        cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=q.device)
        tensors = [t.reshape(batch * n, heads, d) for t in tensors]

        def fn(q_, k_, v_, **kw_):
            return flash_attention.attention_varlen(q_, k_, v_, cu, cu, max_seqlen_q=n, max_seqlen_k=n, **kw_)

        do = do.reshape(batch * n, heads, d)
    elif feature != "plain":
        raise ValueError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
    leaves = [t.detach().requires_grad_(True) for t in tensors]

    def call(i: int) -> Any:
        extra = {"sinks": leaves[3]} if feature == "sinks" else {}
        out = fn(*leaves[:3], **kw, **extra)
        return torch.autograd.grad(out, leaves, do)

    return call, work


def run_features(s: FeaturesSettings) -> list[dict]:
    """One row per (causal, feature), each with the plain row of its mask as reference."""
    dt = torch.bfloat16 if s.dtype == "bf16" else torch.float16
    batch, heads, n, d = max(1, s.tokens // s.seqlen), max(1, s.width // s.head_dim), s.seqlen, s.head_dim
    rows: list[dict] = []
    for causal in s.causal:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(batch, n, heads, d, generator=gen, device="cuda").to(dt) for _ in range(4))
        mask = "causal" if causal else "non-causal"
        print(f"\nfeatures: {s.dtype} ({batch}, {n}, {heads}, {d}) {mask}, forward+backward")
        print(f"  {'feature':14} {'ms':>8} {'TFLOP/s':>8} {'speed':>6} {'rate':>6}")
        plain_ms = plain_rate = None
        for feature in FEATURES:
            made = _feature_call(feature, s, causal, q, k, v, do)
            row = {
                "feature": feature, "mode": "fwd_bwd", "dtype": s.dtype, "head_dim": d, "causal": causal,
                "seqlen": n, "batch": batch, "heads": heads,
            }  # fmt: skip
            if isinstance(made, str):
                print(f"  {feature:14} skipped: {made}")
                rows.append({**row, "skipped": made})
                continue
            call, work = made
            timing = time_cuda(call, warmup=s.warmup, min_reps=s.min_reps, min_time_s=s.min_time_s)
            rate = work / (timing.ms * 1e-3) / 1e12
            if feature == "plain":
                plain_ms, plain_rate = timing.ms, rate
            speed, rel = plain_ms / timing.ms, rate / plain_rate
            print(f"  {feature:14} {timing.ms:8.3f} {rate:8.1f} {speed:5.2f}x {rel:5.2f}x")
            rows.append({
                **row, "ms": round(timing.ms, 5), "ms_min": round(timing.ms_min, 5), "reps": timing.reps,
                "tflops": round(rate, 2), "speed_vs_plain": round(speed, 4), "rate_vs_plain": round(rel, 4),
            })  # fmt: skip
            del call
        torch.cuda.empty_cache()
    return rows
