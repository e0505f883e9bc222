"""Decode calls' GPU time beside their eager time: what a host-bound decode point costs on the GPU itself.

    python tools/decode_gpu_time.py [--batch 1] [--keys 1k,8k,32k] [--seqlens-q 1,4,16] [--pages 0,16]
        [--json OUT]

Per point (32 / 8 heads, head_dim 128, bf16; more than one query causal at the cache's end, as `bench --mode
decode` runs them) and per call (ours on the cache, plain attention() and cuDNN's SDPA on a contiguous one,
each made by the decode bench's own `_call`): the bench's eager timing
(flash_attention.tools.common.time_cuda, input sets rotated past the L2, three repeats), the GPU time of 20
calls captured in one CUDA graph (the launches' host cost gone), our split count and config (ops.decode's),
and the kernels a call runs with their CUDA times (torch.profiler; with programmatic launches a kernel's time
includes its wait for the one before). Where the eager time is far above the graph's, the point is host-bound
and a single run's comparison is the host's (kernel log, decode.md, eighteenth session). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
IMPLS = ("kvcache", "attention", "cudnn")
#: Each call's implementation in `bench --mode decode` (flash_attention.tools.bench.decode), which makes it.
BENCH_IMPLS = {"kvcache": "flash_attention", "attention": "flash_attention.attention", "cudnn": "sdpa_cudnn"}


def parse_keys(text: str) -> list[int]:
    """``"1k,8k,32k"`` -> [1024, 8192, 32768]."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",")]


def impls_at(page_size: int) -> tuple[str, ...]:
    """The calls timed on a cache of ``page_size`` (0: contiguous): ours on every cache, plain attention()
    and cuDNN on a contiguous one only (they have no paged form)."""
    return IMPLS if page_size == 0 else ("kvcache",)


def cache_bytes(keys: int, batch: int) -> int:
    """Bytes of K and V read per call (bf16)."""
    return 2 * batch * keys * HEADS_KV * HEAD_DIM * 2


def _graph_us(fn, n_sets: int) -> float:
    """GPU time per call (µs) of 20 calls replayed from one CUDA graph, the median of ten replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20 * 1e3)
    return statistics.median(times)


def _kernels(fn, n_sets: int) -> dict[str, list]:
    """Kernel name -> [launches per call, median CUDA time in µs] over 20 calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(20):
            fn(i % n_sets)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times.setdefault(e.name[:90], []).append(e.device_time)
    return {k: [len(v) / 20, round(statistics.median(v), 2)] for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keys", default="1k,8k,32k", help="cache lengths, comma-separated (1k = 1024)")
    ap.add_argument("--seqlens-q", default="1,4,16", help="query tokens per row, comma-separated")
    ap.add_argument("--pages", default="0,16", help="page sizes, 0 = contiguous")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    import torch

    from flash_attention.ops import decode
    from flash_attention.tools.bench.decode import DecodeSettings, _cache, _call
    from flash_attention.tools.common import input_sets_needed, l2_bytes, time_cuda

    # The plan's split count and config, as ops.decode makes them (read back from its splits_for).
    seen: dict = {}
    splits_for = decode.splits_for

    def spy(cfg, problem, num_splits, sms, blocks_per_sm=1):
        result = splits_for(cfg, problem, num_splits, sms, blocks_per_sm)
        seen.update(config=str(cfg)[:200], splits=result[0], keys_per_split=result[1], per_sm=blocks_per_sm)
        return result

    decode.splits_for = spy
    settings = DecodeSettings(heads=HEADS, heads_kv=HEADS_KV, head_dim=HEAD_DIM)
    gen = random.Random(0)
    rows = []
    for seqlen_q in (int(x) for x in args.seqlens_q.split(",")):
        for keys in parse_keys(args.keys):
            for page in (int(x) for x in args.pages.split(",")):
                nbytes = cache_bytes(keys, args.batch)
                n_sets = input_sets_needed(nbytes, l2_bytes())
                sets = [_cache(args.batch, keys, page, settings, torch.bfloat16, gen) for _ in range(n_sets)]
                qs = [
                    torch.randn(args.batch, seqlen_q, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    for _ in range(n_sets)
                ]
                lengths = torch.full((args.batch,), keys, dtype=torch.int32, device="cuda")
                for impl in impls_at(page):
                    fn, context = _call(BENCH_IMPLS[impl], qs, sets, lengths)
                    seen.clear()
                    with context:
                        eager = [time_cuda(fn, n_sets, min_time_s=0.1).ms * 1e3 for _ in range(3)]
                        plan = dict(seen)
                        graph = _graph_us(fn, n_sets)
                        kernels = _kernels(fn, n_sets)
                    row = dict(seqlen_q=seqlen_q, batch=args.batch, keys=keys, page=page, impl=impl)
                    row.update(eager_us=[round(x, 2) for x in eager], graph_us=round(graph, 2))
                    row.update(graph_tb_s=round(nbytes / (graph * 1e-6) / 1e12, 3), **plan, kernels=kernels)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                del sets
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
