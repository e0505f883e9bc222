"""What the warp-specialized forward's warps wait for, step by step: its timeline build on one call.

    python tools/ws_timeline.py [--config NAME] [--head-dim 128] [--seqlen 1024] [--causal] [--csv OUT]

Compiles the kernel of CONFIG (default: the one attention() picks for the shape) with FA_TIMELINE=1
(csrc/include/fa/timeline.cuh: lane 0 of every warp of the first four blocks stamps its events with the
multiprocessor's cycle counter), runs one call of the benchmark sweep's shape (16k tokens per batch, heads =
2048 / head_dim, bf16) and prints, in cycles, per consumer warpgroup: the wait for each S_j, the softmax
step, the wait for P_j V_j, a tile's first step and its epilogue; how much of one warpgroup's softmax ran
while the other was in its own (the time the tensor cores can only be fed by the products already queued);
and the producer's gaps between loads. --csv writes every event (block, warp, kind, argument, cycle).

A development tool (it uses ops.forward's internals); needs a Hopper GPU. docs/kernel-log.md, step 58.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from flash_attention.tools.timeline import (
    BLOCKS,
    RECORDS,
    WARPS,
    compile_timeline_build,
    median_text,
    write_csv,
)
from flash_attention.tools.timeline import events as timeline_events

EVENTS = {
    1: "tile_begin",
    2: "s_issued",
    3: "s_done",
    4: "softmax_done",
    5: "pv_done",
    6: "epilogue_begin",
    7: "epilogue_end",
    8: "q_issued",
    9: "k_issued",
    10: "v_issued",
}


def build_kernel(cfg, causal: bool, arch: str, defines: tuple[str, ...] = ("FA_TIMELINE",)):
    """``cfg``'s forward compiled with ``defines`` set to 1 ahead of its source (the timeline build by
    default; FA_NO_SOFTMAX_ORDER gives the schedule before kernel-log step 58, for an A/B)."""
    from flash_attention.jit import driver
    from flash_attention.jit.sources import kernel_symbol

    return driver.get_kernel(compile_timeline_build(cfg, arch, defines), kernel_symbol(cfg, causal))


def run(cfg_name: str | None, d: int, n: int, causal: bool, defines: tuple[str, ...] = ("FA_TIMELINE",)):
    import torch

    from flash_attention.configs import parse_config
    from flash_attention.ops import forward
    from flash_attention.ops.device import device_arch
    from flash_attention.ops.plans import launch
    from flash_attention.spec import AttentionSpec

    heads, batch = 2048 // d, 16384 // n
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, n, heads, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)
    )
    o = torch.empty_like(q)
    plan = forward.plan_for(q, k, v, o, AttentionSpec(causal, d**-0.5), cfg_name and parse_config(cfg_name))
    cfg = plan.cfg
    if not cfg.warp_specialized:
        raise SystemExit(f"{cfg.name()} is not a warp-specialized config")
    index = q.device.index or 0
    kernel = build_kernel(cfg, causal, device_arch(index), defines)
    kernel.ensure_dynamic_smem(plan.smem, index)
    buf = torch.zeros(BLOCKS * WARPS * RECORDS * 2, dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last of three launches is read (the first ones warm the caches and clocks)
        buf.zero_()
        args, p, counter = forward._call_args(plan, q, k, v, o, None)
        p.trace = buf.data_ptr()
        launch(kernel, plan.grid, plan.threads, plan.smem, index, args)
        torch.cuda.synchronize()
    ref = forward.cuda_forward(q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=False, out=None,
                               config=cfg)[0]  # fmt: skip
    if not torch.equal(o, ref):
        raise SystemExit("the timeline build's output differs from the normal build's")
    return cfg, buf.view(BLOCKS, WARPS, RECORDS, 2).cpu()


def events(raw) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """(block, warp) -> [(kind, argument, cycle)] in recorded order."""
    return timeline_events(raw, EVENTS)


def summarize(cfg, ev) -> str:
    lines = [f"{cfg.name()}: cycles, medians over the recorded blocks' tiles and steps"]
    consumers = sorted({w for (_, w) in ev if w >= 4 and w % 4 == 0})  # the first warp of each warpgroup
    phases: dict[int, dict[str, list[float]]] = {}
    softmax_spans: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for (b, w), seq in ev.items():
        if w not in consumers:
            continue
        ph = phases.setdefault(w, defaultdict(list))
        last: dict[str, int] = {}
        tile_begin = None
        for kind, arg, cycle in seq:
            if kind == "tile_begin":
                tile_begin = cycle
            elif kind == "s_issued":
                last["s_issued"] = cycle
                if arg == 0 and tile_begin is not None:
                    ph["tile start to first S issued"].append(cycle - tile_begin)
            elif kind == "s_done":
                ph["S_j wait (issue to landed)"].append(cycle - last.get("s_issued", cycle))
                last["s_done"] = cycle
            elif kind == "softmax_done":
                ph["softmax step"].append(cycle - last.get("s_done", cycle))
                softmax_spans[(b, w)].append((last.get("s_done", cycle), cycle))
                last["softmax_done"] = cycle
            elif kind == "pv_done":
                ph["P V wait after the softmax"].append(cycle - last.get("softmax_done", cycle))
                last["pv_done"] = cycle
            elif kind == "epilogue_begin":
                last["epilogue_begin"] = cycle
                if tile_begin is not None:
                    ph["tile (begin to last product)"].append(cycle - tile_begin)
            elif kind == "epilogue_end":
                ph["epilogue"].append(cycle - last.get("epilogue_begin", cycle))
    names = sorted({k for ph in phases.values() for k in ph})
    lines.append(f"{'':34s}" + "".join(f"  warpgroup {(w - 4) // 4}" for w in consumers))
    for name in names:
        lines.append(f"{name:34s}" + "".join(f"      {median_text(phases[w][name])}" for w in consumers))
    # Softmax beside softmax: of warpgroup 0's softmax time, the share during which warpgroup 1 was in its
    # own softmax (both then wait on the tensor cores' queue alone).
    if len(consumers) >= 2:
        both = total = 0
        for b in range(BLOCKS):
            a, c = softmax_spans.get((b, consumers[0]), []), softmax_spans.get((b, consumers[1]), [])
            for s0, e0 in a:
                total += e0 - s0
                both += sum(max(0, min(e0, e1) - max(s0, s1)) for s1, e1 in c)
        if total:
            lines.append(f"warpgroup 0's softmax time with warpgroup 1 in its own: {both / total:.0%}")
    producer = [seq for (b, w), seq in ev.items() if w == 0]
    gaps = [
        c2 - c1
        for seq in producer
        for (k1, _, c1), (k2, _, c2) in zip(seq, seq[1:], strict=False)
        if k1 == "v_issued" and k2 == "k_issued"
    ]
    lines.append(
        f"producer: V_j issued to K_(j+1) issued (a slot's wait), median {median_text(gaps).strip()}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a warp-specialized config name (default: attention()'s)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--csv", default=None, help="write every event here")
    ap.add_argument(
        "--old-order", action="store_true", help="the schedule before step 58 (FA_NO_SOFTMAX_ORDER)"
    )
    args = ap.parse_args(argv)
    defines = ("FA_TIMELINE", "FA_NO_SOFTMAX_ORDER") if args.old_order else ("FA_TIMELINE",)
    cfg, raw = run(args.config, args.head_dim, args.seqlen, args.causal, defines)
    ev = events(raw)
    print(f"d{args.head_dim} seqlen {args.seqlen}{' causal' if args.causal else ''}")
    print(summarize(cfg, ev))
    if args.csv:
        write_csv(args.csv, ev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
