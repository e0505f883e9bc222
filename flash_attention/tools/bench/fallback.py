"""``bench --device cpu`` and ``bench --dtype fp32``: the PyTorch fallback against SDPA on the same tensors.

The fallback is what CPU users (laptops, CPU CI) run, and what float32 runs on a GPU; the bar is PyTorch's
own attention on the same tensors (on CUDA, SDPA's own choice for float32: its memory-efficient kernel).
Per shape, dtype and causal flag, the forward and the forward + backward of :func:`flash_attention.attention`
(our layout) and of SDPA (transposed views of the same tensors: (batch, heads, seqlen, head_dim)) are timed
alternately in one process, median of several calls each (on CUDA each call synchronized, so a time is
the call's latency, its host work included). All shapes have seqlen_q == seqlen_k, where SDPA's top-left
causal mask is our bottom-right one.
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import flash_attention

from ..common import environment, record_provenance

__all__ = ["FALLBACK_SHAPES", "fallback_environment", "fallback_results_to_text", "run_fallback_bench"]

#: (batch, seqlen, heads, head_dim) per device: on CPU the shapes issue 18 names, from a small test call to a
#: long sequence; on CUDA shapes a GPU is used for (16k-32k tokens per batch), and one short call.
FALLBACK_SHAPES = {
    "cpu": ((1, 256, 4, 64), (2, 1024, 8, 64), (1, 4096, 8, 128)),
    "cuda": ((2, 1024, 8, 64), (16, 1024, 16, 64), (4, 4096, 16, 128), (2, 8192, 16, 128)),
}
#: The dtypes timed per device by default: on CUDA only float32 (half precision runs on our kernels).
FALLBACK_DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("fp32",)}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cpu_model() -> str:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def fallback_environment(device: str, commit: str | None, allow_dirty: bool) -> dict:
    """The metadata block of a result file: the CPU's, or the sweep's block of the current GPU."""
    if device == "cuda":
        env = environment(torch.cuda.current_device(), commit, allow_dirty)
        env["device"] = "cuda"
        return env
    now = _dt.datetime.now().astimezone()
    return {
        "device": "cpu",
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **record_provenance(commit, allow_dirty),
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }


def _time_ms(
    fn: Callable[[], object], min_reps: int, min_time_s: float, sync: Callable[[], None]
) -> list[float]:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time_s:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _calls(shape, dtype, causal, mode, device):
    """(ours, sdpa) zero-argument callables on the same fresh random tensors."""
    b, n, h, d = shape
    gen = torch.Generator().manual_seed(n * 131 + h * 7 + d)
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    dout = torch.randn(b, n, h, d, generator=gen).to(device=device, dtype=dtype)
    if mode == "fwd":

        def ours():
            with torch.no_grad():
                return flash_attention.attention(q, k, v, causal=causal)

        def sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
                )

        return ours, sdpa
    for t in (q, k, v):
        t.requires_grad_(True)

    def ours():
        flash_attention.attention(q, k, v, causal=causal).backward(dout)

    def sdpa():
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        o.backward(dout.transpose(1, 2))

    return ours, sdpa


def run_fallback_bench(
    device: str = "cpu",
    shapes=None,
    dtypes=None,
    modes=("fwd", "fwd_bwd"),
    causal=(False, True),
    rounds: int = 3,
    min_reps: int = 3,
    min_time_s: float = 0.3,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per point: median ms of ours and SDPA's, and ours / SDPA's time (lower is better).
    ``shapes`` and ``dtypes`` default to the device's (:data:`FALLBACK_SHAPES`, :data:`FALLBACK_DTYPES`)."""
    shapes = FALLBACK_SHAPES[device] if shapes is None else shapes
    dtypes = FALLBACK_DTYPES[device] if dtypes is None else dtypes
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for mode in modes:
        for shape in shapes:
            for dt in dtypes:
                for c in causal:
                    ours, sdpa = _calls(shape, _DTYPES[dt], c, mode, device)
                    # Warm-up (first-call allocations and dispatch caches), and the two answers compared: a
                    # timing of something that computes another function would be no comparison.
                    mine, theirs = ours(), sdpa()
                    diff = None
                    if mode == "fwd":
                        diff = (mine.float() - theirs.transpose(1, 2).float()).abs().max().item()
                    got: dict[str, list[float]] = {"flash_attention": [], "sdpa": []}
                    for _ in range(rounds):  # alternate, so drifting clocks or load hit both alike
                        got["sdpa"] += _time_ms(sdpa, min_reps, min_time_s, sync)
                        got["flash_attention"] += _time_ms(ours, min_reps, min_time_s, sync)
                    ms = {name: statistics.median(t) for name, t in got.items()}
                    row = {
                        "mode": mode,
                        "shape": list(shape),
                        "dtype": dt,
                        "causal": c,
                        "ms": ms,
                        "ratio": ms["flash_attention"] / ms["sdpa"],
                        "reps": {name: len(t) for name, t in got.items()},
                        "max_diff_vs_sdpa": diff,
                    }
                    rows.append(row)
                    log(_row_text(row))
    return rows


def _row_text(row: dict) -> str:
    b, n, h, d = row["shape"]
    return (
        f"{row['mode']:8} ({b}, {n}, {h}, {d}) {row['dtype']:4} {'causal' if row['causal'] else 'full':6}"
        f"  ours {row['ms']['flash_attention']:9.2f} ms  sdpa {row['ms']['sdpa']:9.2f} ms"
        f"  ours/sdpa {row['ratio']:.2f}x"
        + (f"  max diff {row['max_diff_vs_sdpa']:.1e}" if row.get("max_diff_vs_sdpa") is not None else "")
    )


def fallback_results_to_text(result: dict) -> str:
    if result.get("device") == "cuda":
        head = f"{result['gpu']}, torch {result['torch']}, commit {result['commit']}"
    else:
        head = f"{result['cpu']}, {result['threads']} threads"
        head += f", torch {result['torch']}, commit {result['commit']}"
    ratios = [r["ratio"] for r in result["rows"]]
    tail = (
        f"ours/sdpa time: median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x" if ratios else ""
    )
    return "\n".join([head, *(_row_text(r) for r in result["rows"]), tail])
