"""Where a step of the warp-specialized backward goes: its dK/dV kernel's timeline build on one call.

    python tools/bwd_timeline.py [--config NAME] [--head-dim 128] [--seqlen 4096] [--causal] [--batch B]
        [--heads H] [--csv OUT]

Compiles the dK/dV kernel of CONFIG (default: the one attention()'s backward picks for the shape) with
FA_TIMELINE=1 (csrc/include/fa/timeline.cuh: lane 0 of every warp of the first four blocks stamps its events
with the multiprocessor's cycle counter), runs one backward of the benchmark sweep's shape (16k tokens per
batch, heads = 2048 / head_dim, bf16) with it in place of the normal kernel, compares dK, dV and dQ with
the normal build's (a note on stderr if dK or dV are not bitwise equal: the stamps should move the schedule,
not the arithmetic), and prints, in cycles, per
consumer warpgroup, the median of each phase of a query step between its waits and barriers (the slot's
wait, S^T's, the exponentials, dP^T's wait, dS and its store, the meeting of the warpgroups, dQ's wait, dQ's
staging and reduction, dK's wait), the step's length, the share of each step during which both warpgroups
were in a phase with no product of theirs queued (after dP^T landed until dV's issue: the tensor cores'
idle time), the producer's time per slot and its wait for a free one, and the block's fixed part (its start
to its first step's data, its last step to dK's and dV's stores issued) as a share of the block. --batch
and --heads change the shape; --csv writes every event.

--spans instead compiles the kernel with FA_BLOCK_SPANS=1 (fa/timeline.cuh: four stamps a block, none in
the step loop, so the step is the normal build's) and reads where and when every block of the grid ran: the
kernel's span, the multiprocessors' idle share in it (before their first block, between blocks, after
their last: the grid's tail), and a least-squares fit of a block's cycles against its query steps, whose
intercept is the fixed part of a block (its start and end) and whose slope is a step, from the whole grid
rather than four blocks.

A development tool (it uses ops.backward's internals); needs a Hopper GPU. docs/kernel-log/backward.md (the
timeline note after step 132); docs/backward-study.md, stage 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from flash_attention.configs.backward import BwdConfig
from flash_attention.tools.timeline import (
    BLOCKS,
    RECORDS,
    WARPS,
    compile_timeline_build,
    median_text,
    write_csv,
)
from flash_attention.tools.timeline import events as timeline_events

# fa/timeline.cuh's kinds (the backward's; the forward's are tools/ws_timeline.py's).
EVENTS = {
    11: "full",
    12: "s_landed",
    13: "exp_done",
    14: "dp_landed",
    15: "ds_stored",
    16: "met",
    17: "dq_landed",
    18: "dq_out",
    19: "step_end",
    20: "slot_free",
    21: "slot_issued",
    22: "block_begin",
    23: "block_end",
}

#: fa/timeline.cuh's kSpanWords: a block's span record, [multiprocessor, query steps, then (cycle, ns) at its
#: start, past the grid dependency, at warpgroup 0's end and at warpgroup 1's].
SPAN_WORDS = 10

#: The Q/dO slots of the kernel's ring.
STAGES = BwdConfig.WS_STAGES

#: The consumer's phases in step order: (name, from event, to event).
PHASES = (
    ("slot wait (previous step's end to full)", "step_end", "full"),
    ("S^T wait", "full", "s_landed"),
    ("exponentials (P^T)", "s_landed", "exp_done"),
    ("dP^T wait", "exp_done", "dp_landed"),
    ("dS^T, its store, dV issued", "dp_landed", "ds_stored"),
    ("meeting (barrier 1)", "ds_stored", "met"),
    ("dV and dQ wait", "met", "dq_landed"),
    ("dQ staged and reduced", "dq_landed", "dq_out"),
    ("dK wait", "dq_out", "step_end"),
)


def build_kernel(cfg, name: str, arch: str, defines: tuple[str, ...] = ("FA_TIMELINE",)):
    """Entry point ``name`` of ``cfg``'s backward unit compiled with each of ``defines`` set to 1."""
    from flash_attention.jit import driver

    return driver.get_kernel(compile_timeline_build(cfg, arch, defines), name)


def run(
    cfg_name: str | None, d: int, n: int, causal: bool, *, batch=None, heads=None, device="cuda", spans=False
):
    """(cfg, raw records) of one backward at (batch, n, heads, d) with the timeline kernel: by default the
    sweep's (16k / n, n, 2048 / d, d). ``spans``: the FA_BLOCK_SPANS build instead, and its records as
    (blocks, SPAN_WORDS). (``device``: the CPU under the tests' stand-in GPU.)"""
    import torch

    from flash_attention.ops import backward, forward

    heads = heads or 2048 // d
    batch = batch or max(1, 16384 // n)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (
        torch.randn(batch, n, heads, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(4)
    )
    scale = d**-0.5
    out, lse = forward.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)[
        :2
    ]
    synchronize = torch.cuda.synchronize if q.is_cuda else (lambda: None)

    def grads():
        return backward.cuda_backward(
            do, q, k, v, out, lse, causal=causal, softmax_scale=scale, config=cfg_name
        )

    ref = grads()
    plan_for, plan_params = backward.plan_for, backward.plan_params
    defines = ("FA_BLOCK_SPANS",) if spans else ("FA_TIMELINE",)
    # (spans: one row per block of the dK/dV grid, sized when the plan says the grid)
    bufs = [] if spans else [torch.zeros(BLOCKS * WARPS * RECORDS * 2, dtype=torch.int64, device=device)]
    kernels = {}

    def timeline_plan(*args, **kwargs):
        plan = plan_for(*args, **kwargs)
        if not (plan.cfg.warp_specialized and not plan.cfg.wide_ws and plan.dkdv_kind == "dkdv"):
            raise SystemExit(
                f"{plan.cfg.name()} ({plan.dkdv_kind}) is not the warp-specialized atomic backward"
            )
        if spans and not bufs:
            blocks = plan.dkdv_grid[0] * plan.dkdv_grid[1] * plan.dkdv_grid[2]
            bufs.append(torch.zeros(blocks * SPAN_WORDS, dtype=torch.int64, device=device))
        if plan.dkdv.name not in kernels:
            kernel = build_kernel(plan.cfg, plan.dkdv.name, backward.device_arch(plan.index), defines)
            kernel.ensure_dynamic_smem(plan.cfg.smem_bytes, plan.index)
            kernels[plan.dkdv.name] = (plan.cfg, kernel)
        return dataclasses.replace(plan, dkdv=kernels[plan.dkdv.name][1], host_program=[])

    def traced_params(plan):
        args, p = plan_params(plan)
        p.trace = bufs[0].data_ptr()
        return args, p

    backward.plan_for, backward.plan_params = timeline_plan, traced_params
    try:
        for _ in range(3):  # the last of three runs is read (the first ones warm the caches and clocks)
            if bufs:  # (spans: made, zeroed, by the first run's plan)
                bufs[0].zero_()
            got = grads()
            synchronize()
    finally:
        backward.plan_for, backward.plan_params = plan_for, plan_params
    # dK and dV are each block's own sums, in a fixed order; dQ's reductions land in any order. A difference
    # is reported, not fatal: the timeline is still the kernel's (the stamps could in principle move a
    # contraction choice), and the numbers say how far.
    for name, a, b, exact in (
        ("dK", got[1], ref[1], True),
        ("dV", got[2], ref[2], True),
        ("dQ", got[0], ref[0], False),
    ):
        diff = (a.float() - b.float()).abs().max().item()
        if (exact and diff != 0) or diff > 1e-2:
            print(
                f"note: the timeline build's {name} differs from the normal build's by {diff:.3g}",
                file=sys.stderr,
            )
    ((cfg, _),) = kernels.values()
    if spans:
        return cfg, bufs[0].view(-1, SPAN_WORDS).cpu()
    return cfg, bufs[0].view(BLOCKS, WARPS, RECORDS, 2).cpu()


def events(raw) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """(block, warp) -> [(kind, argument, cycle)] in recorded order."""
    return timeline_events(raw, EVENTS)


def _steps(seq) -> dict[int, dict[str, int]]:
    """step -> {event: cycle} of one consumer warp."""
    steps: dict[int, dict[str, int]] = {}
    for kind, step, cycle in seq:
        steps.setdefault(step, {})[kind] = cycle
    return steps


def summarize(cfg, ev) -> str:
    lines = [f"{cfg.name()}: cycles, medians over the recorded blocks' steps (each block's first step apart)"]
    # The first warp of each consumer warpgroup: warps 4 and 8 (the producer is warps 0-3).
    consumers = [4, 8]
    phases: dict[int, dict[str, list[int]]] = {w: {name: [] for name, _, _ in PHASES} for w in consumers}
    lengths: dict[int, list[int]] = {w: [] for w in consumers}
    idle_shares = []
    for b in range(BLOCKS):
        per_wg = {w: _steps(ev.get((b, w), [])) for w in consumers}
        for w, steps in per_wg.items():
            for it, e in steps.items():
                if it == 0:
                    continue
                prev = steps.get(it - 1, {})
                for name, a, z in PHASES:
                    start = prev.get(a) if a == "step_end" else e.get(a)
                    if start is not None and z in e:
                        phases[w][name].append(e[z] - start)
                if "full" in e and "full" in steps.get(it + 1, {}):
                    lengths[w].append(steps[it + 1]["full"] - e["full"])
        # Both warpgroups between dP^T landed and dV issued at once: nothing of either on the tensor cores.
        a, c = per_wg[consumers[0]], per_wg[consumers[1]]
        for it in a:
            if it == 0 or it + 1 not in a or "full" not in a[it] or "full" not in a[it + 1]:
                continue
            if not all(k in a[it] and k in c.get(it, {}) for k in ("dp_landed", "ds_stored")):
                continue
            both = max(
                0, min(a[it]["ds_stored"], c[it]["ds_stored"]) - max(a[it]["dp_landed"], c[it]["dp_landed"])
            )
            idle_shares.append(both / (a[it + 1]["full"] - a[it]["full"]))
    lines.append(f"{'':44s}" + "".join(f"  warpgroup {i}" for i in range(len(consumers))))
    for name, _, _ in PHASES:
        lines.append(f"{name:44s}" + "".join(f"      {median_text(phases[w][name])}" for w in consumers))
    lines.append(
        f"{'step (full to next full)':44s}" + "".join(f"      {median_text(lengths[w])}" for w in consumers)
    )
    if idle_shares:
        share = statistics.median(idle_shares)
        lines.append(f"both warpgroups between dP^T landed and dV issued: {share:.0%} of a step")
    producer = [_steps(ev.get((b, 0), [])) for b in range(BLOCKS)]
    # From a slot's release to the producer's arrival on it: the issue, and the copies its own thread waits
    # for (the statistics; with cp.async, all of Q and dO).
    refill = [s[it]["slot_issued"] - s[it]["slot_free"] for s in producer for it in s if len(s[it]) == 2]
    # The wait for a slot's release, from the previous arrival; the first STAGES steps take empty slots.
    wait = [
        s[it]["slot_free"] - s[it - 1]["slot_issued"]
        for s in producer
        for it in s
        if it >= STAGES and "slot_free" in s[it] and "slot_issued" in s.get(it - 1, {})
    ]
    refilled, waited = median_text(refill).strip(), median_text(wait).strip()
    lines.append(
        f"producer: a slot released to refilled (issue + own copies) {refilled}, waited {waited} for it"
    )
    # A block's fixed part: from its start to its first step's data (K and V, the first Q and dO), and from
    # its last step's end to dK's and dV's stores issued (not completed: the stamp follows the st.global);
    # at short causal lengths a block has few steps to spread it over (kernel log: the 64-key form's note).
    before, after, share = [], [], []
    for b in range(BLOCKS):
        for w in consumers:
            s = _steps(ev.get((b, w), []))
            begin = s.get(0, {}).get("block_begin")
            first = s.get(0, {}).get("full")
            ends = [e["block_end"] for e in s.values() if "block_end" in e]
            last = [e["step_end"] for e in s.values() if "step_end" in e]
            if begin is None or first is None or not ends or not last:
                continue
            before.append(first - begin)
            after.append(ends[0] - max(last))
            share.append((first - begin + ends[0] - max(last)) / (ends[0] - begin))
    if share:
        lines.append(
            f"block: start to its first step's data {median_text(before).strip()}, last step to dK's and "
            f"dV's stores issued {median_text(after).strip()}: {statistics.median(share):.0%} of the block"
        )
    full = sorted({b for (b, w), seq in ev.items() if len(seq) >= RECORDS})
    if full:
        lines.append(f"note: blocks {full} filled a warp's {RECORDS} records: their later steps are not here")
    return "\n".join(lines)


def summarize_spans(spans) -> str:
    """The FA_BLOCK_SPANS records (rows of SPAN_WORDS; all-zero rows, blocks that did not record, left out)
    as text: the kernel's span, the multiprocessors' idle share in it, and a block's cycles from past the grid
    dependency to its end fitted against its query steps."""
    rows = [r for r in spans.tolist() if any(r)]
    if not rows:
        return "no block recorded a span"
    blocks = []
    for sm, steps, c0, t0, cr, tr, c1a, t1a, c1b, t1b in rows:
        # A block ends when its later consumer warpgroup does (the writer warps' last reduction may follow).
        blocks.append({"sm": sm, "steps": steps, "c0": c0, "t0": t0, "cr": cr, "tr": tr})
        blocks[-1].update(c1=max(c1a, c1b), t1=max(t1a, t1b))
    start, end = min(b["t0"] for b in blocks), max(b["t1"] for b in blocks)
    span = end - start
    by_sm: dict[int, list[dict]] = {}
    for b in blocks:
        by_sm.setdefault(b["sm"], []).append(b)
    before = waited = between = after = busy = 0
    gaps = []
    for run in by_sm.values():
        run.sort(key=lambda b: b["c0"])
        before += run[0]["t0"] - start
        after += end - run[-1]["t1"]
        waited += sum(b["tr"] - b["t0"] for b in run)
        busy += sum(b["t1"] - b["tr"] for b in run)
        for a, b in zip(run, run[1:], strict=False):
            gaps.append(b["c0"] - a["c1"])  # (cycles of this multiprocessor's own counter)
            between += b["t0"] - a["t1"]
    sms = len(by_sm)
    total = sms * span
    lines = [
        f"{len(blocks)} blocks on {sms} multiprocessors, {span / 1000:.1f} us from the first start to the "
        "last end",
        f"multiprocessors idle: {(total - busy) / total:.1%} of that: before their first block "
        f"{before / total:.1%}, at a block's start until past the grid dependency {waited / total:.1%}, "
        f"between blocks {between / total:.1%}, after their last {after / total:.1%}",
    ]
    if gaps:
        lines.append(
            f"a gap between two blocks on one multiprocessor: median {median_text(gaps).strip()} cycles"
        )
    # Least squares of a block's cycles on its steps: the intercept is what a block costs beside its steps.
    xs = [b["steps"] for b in blocks]
    ys = [b["c1"] - b["cr"] for b in blocks]
    if len(set(xs)) > 1:
        slope, fixed = statistics.linear_regression(xs, ys)
        r2 = statistics.correlation(xs, ys) ** 2 if len(set(ys)) > 1 else 1.0
        lines.append(
            f"a block's cycles = {fixed:.0f} + {slope:.0f} per query step (least squares over {len(xs)} "
            f"blocks, r^2 {r2:.3f}; steps {min(xs)}-{max(xs)})"
        )
    else:
        lines.append(
            f"every block ran {xs[0]} query steps: {median_text(ys).strip()} cycles a block (median)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a warp-specialized backward config (default: the call's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", type=int, default=None, help="default 16k tokens / seqlen")
    ap.add_argument("--heads", type=int, default=None, help="default 2048 / head_dim")
    ap.add_argument("--csv", default=None, help="write every event here")
    ap.add_argument(
        "--spans", action="store_true", help="every block's start and end (FA_BLOCK_SPANS) instead of steps"
    )
    args = ap.parse_args(argv)
    if args.spans:
        cfg, spans = run(
            args.config,
            args.head_dim,
            args.seqlen,
            args.causal,
            batch=args.batch,
            heads=args.heads,
            spans=True,
        )
        print(f"d{args.head_dim} seqlen {args.seqlen}{' causal' if args.causal else ''}: {cfg.name()}")
        print(summarize_spans(spans))
        return 0
    cfg, raw = run(args.config, args.head_dim, args.seqlen, args.causal, batch=args.batch, heads=args.heads)
    ev = events(raw)
    print(f"d{args.head_dim} seqlen {args.seqlen}{' causal' if args.causal else ''}")
    print(summarize(cfg, ev))
    if args.csv:
        write_csv(args.csv, ev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
