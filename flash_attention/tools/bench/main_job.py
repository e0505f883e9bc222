"""``python -m flash_attention`` without a command: our attention against PyTorch's on one default shape.

On a GPU: the time, TFLOP/s and the error against a float64 reference of the CUDA kernel and of SDPA. On a
machine without CUDA the call runs the PyTorch fallback, whose TFLOP/s say nothing about the kernels; what
is worth showing there is whether it computes the right thing (its error against float64 beside SDPA's own
in the same dtype, judged by the tests' accuracy rule), what it costs against SDPA on the same tensors, and
where to go next."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import flash_attention
from flash_attention import ops
from flash_attention.fallback.reference import attention_reference

from ..common import flops, input_sets_needed, l2_bytes, ready_host_library, time_cuda
from .fallback import run_fallback_bench
from .runners import Shape, make_inputs

__all__ = ["run_main_job"]


def run_main_job() -> int:
    """Our attention against PyTorch's on one default shape; on a machine without CUDA, the CPU path."""
    if not torch.cuda.is_available():
        return _main_job_cpu()
    ready_host_library("flash_attention")  # (before anything is timed)
    return _main_job_gpu()


def _print_table(headers: list[str], rows: list[list[str]], left: int = 2) -> None:
    """Columns aligned to their widest cell: the first ``left`` (labels) to the left, numbers to the right."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=False)]
    for cells in [headers, ["-" * w for w in widths], *rows]:
        print(
            "  ".join(
                c.rjust(w) if i >= left else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )


#: The CPU main job's shape: bench --device cpu's smallest, a call that takes well under a millisecond.
CPU_SHAPE = (1, 256, 4, 64)

#: What to run or read after the CPU main job, each with why.
CPU_NEXT_STEPS = (
    ("python -m flash_attention sanity", "what this machine lacks for the CUDA kernels, and what to do"),
    ('the README, section "Use"', "calling attention() from your code: the same call on CPU and GPU"),
    ("python -m flash_attention bench --device cpu", "the fallback against SDPA on more shapes, and bf16"),
)


def _ratio(mine: float, theirs: float) -> str:
    return f"{mine / theirs:.2f}" if theirs > 0 else "–"


def _main_job_cpu() -> int:
    b, n, h, d = CPU_SHAPE
    print("No CUDA GPU found: running the CPU (PyTorch) path of flash_attention.attention.")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"Shape: batch {b}, seqlen {n}, heads {h}, head_dim {d}, float32.")
    print("Max error against a float64 reference, and time (median ms), each beside torch SDPA's on the same")
    print("tensors; a ratio above 1 is ours worse.\n")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    # Timed as bench --device cpu times (ours and SDPA on the same tensors, warm-up, alternating rounds),
    # with fewer rounds: this job must take seconds.
    timed = run_fallback_bench(
        device="cpu",
        shapes=[CPU_SHAPE],
        dtypes=("fp32",),
        modes=("fwd",),
        rounds=2,
        min_time_s=0.05,
        log=lambda _: None,
    )
    ms = {row["causal"]: row["ms"] for row in timed}
    rows, failures = [], []
    for causal in (False, True):
        ref, _ = attention_reference(q, k, v, causal=causal)
        ours = flash_attention.attention(q, k, v, causal=causal)
        sdpa = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)
        err, sdpa_err = ((x.double() - ref).abs().max().item() for x in (ours, sdpa))
        # The tests' accuracy rule: ours within twice PyTorch's own error in the same dtype, plus 1e-5.
        if not err <= 2 * sdpa_err + 1e-5:
            failures.append(f"causal={causal}: max error {err:.3g}, over 2x SDPA's {sdpa_err:.3g} + 1e-5")
        mine, theirs = ms[causal]["flash_attention"], ms[causal]["sdpa"]
        rows.append(
            [
                "yes" if causal else "no",
                f"{err:.2e}",
                f"{sdpa_err:.2e}",
                _ratio(err, sdpa_err),
                f"{mine:.3f}",
                f"{theirs:.3f}",
                _ratio(mine, theirs),
            ]
        )
    headers = ["causal", "max err", "sdpa max err", "err / sdpa", "ms", "sdpa ms", "ms / sdpa"]
    _print_table(headers, rows, left=1)
    for failure in failures:
        print(f"FAIL: {failure}")
    if not failures:
        print("Both within the tests' accuracy rule: at most 2x SDPA's own error + 1e-5.")
    print("The CUDA kernels need an NVIDIA GPU; this machine ran the PyTorch fallback, same semantics.")
    print("\nNext steps:")
    width = max(len(what) for what, _ in CPU_NEXT_STEPS)
    for what, why in CPU_NEXT_STEPS:
        print(f"  {what:<{width}}  {why}")
    return 1 if failures else 0


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
