"""``bench --ring``: context-parallel ring attention on every visible GPU against one GPU, one process each.

For each sequence length: one causal sequence (batch 1; heads from ``--width`` and ``--head-dims``, K/V heads
``--kv-heads``), forward+backward, timed on one GPU with :func:`flash_attention.attention` and on W GPUs with
:func:`flash_attention.api.ring.ring_attention` (zigzag shares, NCCL), with each run's peak memory. Rows:
``impl`` "flash_attention" (one GPU) and "ring_attention" (``world`` GPUs), ``ms`` (per step, the slowest
rank), ``tflops`` (the causal sequence's FLOPs), ``peak_gib`` (per GPU), and on the ring rows the
``speedup`` and ``memory_ratio`` against the one-GPU row. ``device="cpu"`` runs the same on gloo processes
(the tests' smoke run; the numbers mean nothing there).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RingSettings:
    seqlens: tuple[int, ...] = (16384, 32768, 65536, 131072)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    world: int = 2
    warmup: int = 1
    reps: int = 3
    device: str = "cuda"


def _flops(seqlen: int, s: RingSettings) -> float:
    return 4.0 * seqlen * seqlen * s.head_dim * s.heads * 0.5 * 3.5  # causal, forward + backward


def _timed(step, s: RingSettings, device: torch.device, barrier) -> tuple[float, float]:
    """(ms per step, peak GiB) of ``step``, after warm-up; ``barrier`` lines the ranks up."""
    for _ in range(s.warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(s.reps):
        step()
    sync()
    barrier()
    ms = (time.perf_counter() - t0) / s.reps * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return ms, peak


def _no_op() -> None:
    pass


def _train_step(attend, leaves: list[torch.Tensor]) -> None:
    """Forward and backward of one causal attention (``attend``: attention or ring_attention)."""
    o = attend(*leaves, causal=True)
    torch.autograd.grad(o, leaves, torch.ones_like(o))


def _worker(rank: int, s: RingSettings, init: str, results) -> None:
    import flash_attention
    from flash_attention.api.head_parallel import head_parallel_attention
    from flash_attention.api.ring import ring_attention, shard_sequence

    cuda = s.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=s.world)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[s.dtype]
    rows = []
    for n in s.seqlens:
        torch.manual_seed(0)
        q = torch.randn(1, n, s.heads, s.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, n, s.kv_heads, s.head_dim, device=device, dtype=dtype) for _ in range(2))
        one = None
        if rank == 0:  # one GPU, the whole sequence (the others wait at the barrier)
            # The full tensors themselves are the leaves and no share exists yet: the one-GPU peak holds one
            # copy of the inputs, as the ring's holds one copy of its shares.
            leaves = [t.requires_grad_() for t in (q, k, v)]
            one = _timed(functools.partial(_train_step, flash_attention.attention, leaves), s, device, _no_op)
            del leaves
        shares = [shard_sequence(t.detach()).requires_grad_() for t in (q, k, v)]
        del q, k, v
        dist.barrier()
        ms, peak = _timed(functools.partial(_train_step, ring_attention, shares), s, device, dist.barrier)
        # The same shares by all-to-all over heads (api/head_parallel.py), where the heads divide among the
        # ranks: its own rows, beside the ring's.
        heads_divide = s.heads % s.world == 0 and (s.kv_heads % s.world == 0 or s.world % s.kv_heads == 0)
        if heads_divide:
            step = functools.partial(_train_step, head_parallel_attention, shares)
            hp_ms, hp_peak = _timed(step, s, device, dist.barrier)
        else:
            hp_ms = hp_peak = float("nan")
        stats = torch.tensor([ms, peak, hp_ms, hp_peak], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(s.world)]
        dist.all_gather_object(gathered, stats)
        if rank == 0:
            ring_ms = max(float(g[0]) for g in gathered)
            ring_peak = max(float(g[1]) for g in gathered)
            base = dict(mode="fwd_bwd", dtype=s.dtype, head_dim=s.head_dim, causal=True, seqlen=n, batch=1,
                        heads=s.heads, kv_heads=s.kv_heads)  # fmt: skip
            flops = _flops(n, s)
            single = {**base, "impl": "flash_attention", "world": 1, "ms": round(one[0], 3)}
            single.update(tflops=round(flops / (one[0] * 1e-3) / 1e12, 2), peak_gib=round(one[1], 3))
            ringed = {**base, "impl": "ring_attention", "world": s.world, "ms": round(ring_ms, 3)}
            ringed.update(tflops=round(flops / (ring_ms * 1e-3) / 1e12, 2), peak_gib=round(ring_peak, 3))
            ringed.update(speedup=round(one[0] / ring_ms, 3))
            ringed.update(memory_ratio=round(ring_peak / one[1], 3) if one[1] else None)
            rows += [single, ringed]
            print(
                f"{n} tokens: one GPU {one[0]:.1f} ms ({one[1]:.2f} GiB), ring x{s.world} {ring_ms:.1f} ms "
                f"({ring_peak:.2f} GiB per GPU): {one[0] / ring_ms:.2f}x",
                flush=True,
            )
            if heads_divide:
                hp_ms, hp_peak = max(float(g[2]) for g in gathered), max(float(g[3]) for g in gathered)
                heads = {**base, "impl": "head_parallel_attention", "world": s.world, "ms": round(hp_ms, 3)}
                heads.update(tflops=round(flops / (hp_ms * 1e-3) / 1e12, 2), peak_gib=round(hp_peak, 3))
                heads.update(speedup=round(one[0] / hp_ms, 3))
                heads.update(memory_ratio=round(hp_peak / one[1], 3) if one[1] else None)
                rows.append(heads)
                print(f"  head-parallel x{s.world} {hp_ms:.1f} ms ({hp_peak:.2f} GiB): {one[0] / hp_ms:.2f}x")
        del shares
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run_ring(s: RingSettings, init_file: str) -> list[dict]:
    """Spawn ``s.world`` processes (one per GPU), run the comparison, return rank 0's rows."""
    if os.path.exists(init_file):
        os.remove(init_file)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, s, f"file://{init_file}", results)) for r in range(s.world)]
    for p in procs:
        p.start()
    rows = results.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a ring bench process failed: exit codes {[p.exitcode for p in procs]}")
    return rows


def ring_markdown(result: dict) -> str:
    """The README table of a ``--ring`` result: per sequence length, one GPU against the ring."""
    rows = result.get("rows", [])
    singles = {r["seqlen"]: r for r in rows if r.get("impl") == "flash_attention"}
    ringed = [r for r in rows if r.get("impl") == "ring_attention"]
    if not ringed:
        return ""
    first = ringed[0]
    world = first["world"]
    title = (
        f"### Context parallelism: one causal sequence, forward+backward ({first['dtype']}, "
        f"{first['heads']}/{first['kv_heads']} heads, head_dim {first['head_dim']}, {world} x "
        f"{result.get('gpu', '?')})"
    )
    head = [
        "seqlen", "one GPU ms", f"ring x{world} ms", "speedup", "one GPU TFLOP/s", "ring TFLOP/s",
        "one GPU peak GiB", "ring peak GiB per GPU", "memory ratio",
    ]  # fmt: skip
    out = [title, "", "| " + " | ".join(head) + " |", "| " + " | ".join("---:" for _ in head) + " |"]
    for r in sorted(ringed, key=lambda r: r["seqlen"]):
        one = singles.get(r["seqlen"], {})
        n = r["seqlen"]
        cells = [
            f"{n // 1024}k" if n % 1024 == 0 else str(n),
            f"{one.get('ms', float('nan')):.1f}",
            f"{r['ms']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{one.get('tflops', float('nan')):.0f}",
            f"{r['tflops']:.0f}",
            f"{one.get('peak_gib', float('nan')):.2f}",
            f"{r['peak_gib']:.2f}",
            f"{r['memory_ratio']:.2f}x" if r.get("memory_ratio") is not None else "n/a",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
