"""fp16 against bf16, interleaved in one process on the same GPU: our forward and cuDNN's, per shape.

Each shape is timed bf16, fp16, bf16, fp16 (ours and sdpa_cudnn, fresh inputs each time); a dtype's time is
the faster of its two medians, and the printed ratio is fp16's throughput over bf16's. Interleaving keeps a
clock or power change between two separate sweeps from passing for a dtype difference.

Usage: python tools/dtype_compare.py (needs a CUDA GPU). Used for docs/kernel-log.md step 36.
"""

from __future__ import annotations

import statistics

import torch

import flash_attention as fa
from flash_attention.tools.common import flops, time_cuda

DTYPES = (torch.bfloat16, torch.float16)


def _inputs(b: int, n: int, h: int, d: int, dtype: torch.dtype, sets: int = 2) -> list[tuple]:
    return [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3)) for _ in range(sets)]


def _times(b: int, n: int, h: int, d: int, causal: bool) -> dict:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    times: dict = {}
    for _ in range(2):
        for dtype in DTYPES:
            xs = _inputs(b, n, h, d, dtype)
            ts = [tuple(x.transpose(1, 2).contiguous() for x in s) for s in xs]
            ours = time_cuda(lambda i, xs=xs: fa.attention(*xs[i % 2], causal=causal), 2, min_time_s=0.3).ms
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                cudnn = time_cuda(lambda i, ts=ts: sdpa(*ts[i % 2], is_causal=causal), 2, min_time_s=0.3).ms
            times.setdefault((dtype, "ours"), []).append(ours)
            times.setdefault((dtype, "cudnn"), []).append(cudnn)
    return {key: min(v) for key, v in times.items()}


def main() -> None:
    ratios = []
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                t = _times(b, n, h, d, causal)
                ours = t[(torch.bfloat16, "ours")] / t[(torch.float16, "ours")]
                cudnn = t[(torch.bfloat16, "cudnn")] / t[(torch.float16, "cudnn")]
                tflops = flops(b, h, n, n, d, causal, "fwd") / t[(torch.bfloat16, "ours")] / 1e9
                print(
                    f"d{d} {'causal' if causal else 'full  '} {n:6d}  ours fp16/bf16 {ours:.3f}  "
                    f"cudnn fp16/bf16 {cudnn:.3f}  bf16 {tflops:.0f} TFLOP/s",
                    flush=True,
                )
                ratios.append((ours, cudnn))
    ours, cudnn = [r[0] for r in ratios], [r[1] for r in ratios]
    print(
        f"median ours {statistics.median(ours):.3f} min {min(ours):.3f}; "
        f"cudnn median {statistics.median(cudnn):.3f} min {min(cudnn):.3f}"
    )


if __name__ == "__main__":
    main()
