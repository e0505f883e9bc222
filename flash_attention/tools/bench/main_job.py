"""``python -m flash_attention`` without a command: our attention against PyTorch's on one default shape,
with the time, TFLOP/s and the error against a float64 reference; on a machine without CUDA, the CPU path."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

import flash_attention
from flash_attention import ops
from flash_attention.reference import attention_reference

from ..common import flops, input_sets_needed, l2_bytes, time_cuda
from .runners import Shape, make_inputs

__all__ = ["run_main_job"]


def run_main_job() -> int:
    """Our attention against PyTorch's on one default shape; on a machine without CUDA, the CPU path."""
    if not torch.cuda.is_available():
        return _main_job_cpu()
    return _main_job_gpu()


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=False)]
    for cells in [headers, ["-" * w for w in widths], *rows]:
        print(
            "  ".join(
                c.rjust(w) if i >= 2 else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )


def _main_job_cpu() -> int:
    b, n, h, d = 1, 256, 4, 64
    print("No CUDA GPU found: running the CPU (PyTorch) path of flash_attention.attention.")
    print(f"Shape: batch {b}, seqlen {n}, heads {h}, head_dim {d}, float32.")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    rows = []
    for causal in (False, True):
        ref, _ = attention_reference(q, k, v, causal=causal)
        for name, f in (
            ("flash_attention", lambda c=causal: flash_attention.attention(q, k, v, causal=c)),
            (
                "torch sdpa",
                lambda c=causal: torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c
                ).transpose(1, 2),
            ),
        ):
            out = f()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            tf = flops(b, h, n, n, d, causal) / (ms * 1e-3) / 1e12
            err = (out.double() - ref).abs().max().item()
            rows.append([name, "yes" if causal else "no", f"{ms:.3f}", f"{tf:.3f}", f"{err:.2e}"])
    _print_table(["impl", "causal", "ms", "TFLOP/s", "max err vs fp64"], rows)
    print("The CUDA kernels need an NVIDIA GPU; this machine ran the PyTorch fallback, same semantics.")
    return 0


def _main_job_gpu() -> int:
    b, n, h, d = 4, 2048, 16, 128
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"Shape: batch {b}, seqlen {n}, heads {h}, head_dim {d}, bf16")
    shape = Shape("bf16", b, h, n, d, False)
    n_sets = input_sets_needed(4 * b * n * h * d * 2, l2_bytes())
    inputs = make_inputs(shape, n_sets, device)
    reason = ops.cuda_unavailable_reason(inputs[0][0])
    print(
        f"flash_attention path: {'CUDA kernel' if reason is None else 'PyTorch fallback: ' + reason}",
        flush=True,
    )
    native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]
    rows, errors, status = [], [], 0
    for causal in (False, True):
        q, k, v = inputs[0]
        ref, _ = attention_reference(q, k, v, causal=causal, compute_dtype=torch.float64)
        impls = (
            ("flash_attention", lambda i, c=causal: flash_attention.attention(*inputs[i], causal=c), False),
            ("torch sdpa", lambda i, c=causal: F.scaled_dot_product_attention(*native[i], is_causal=c), True),
        )
        for name, f, transposed in impls:
            try:
                out = f(0)
                if transposed:
                    out = out.transpose(1, 2)
                err = (out.double() - ref).abs().max().item()
                t = time_cuda(f, n_sets)
                tf = flops(b, h, n, n, d, causal) / (t.ms * 1e-3) / 1e12
                rows.append([name, "yes" if causal else "no", f"{t.ms:.3f}", f"{tf:.1f}", f"{err:.2e}"])
                if not math.isfinite(err):
                    status = 1
            except Exception as exc:
                rows.append([name, "yes" if causal else "no", "failed", "–", "–"])
                errors.append(f"{name}, causal={causal}: {type(exc).__name__}: {exc}")
                status = 1
        del ref
    _print_table(["impl", "causal", "ms", "TFLOP/s", "max err vs fp64"], rows)
    for e in errors:  # after the table: compiler messages span many lines
        print(e)
    print("Full sweep against every PyTorch backend: python -m flash_attention bench")
    return status
