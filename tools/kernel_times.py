"""Where one attention call's GPU time goes, kernel by kernel: ours and the peers' on the same shapes.

    python tools/kernel_times.py [--impls flash_attention,fa4] [--mode fwd_bwd] [--head-dim 128]
                                 [--shapes 4,4096,16] [--causal both] [--calls 20] [--json FILE]

    # the backward's fixed passes (preprocessing, dQ conversion) beside the dK/dV kernel, ours and FA4's:
    python tools/kernel_times.py --impls flash_attention,fa4 --shapes 4,4096,16,1,16384,16

Each call runs as `bench` times it (flash_attention.tools.bench.runners.make_runner, fresh random bf16
inputs) after warm-up calls; `--calls` more calls run under torch.profiler (CUPTI's kernel records), and each
kernel's device time is summed and divided by the calls. Kernels are grouped by name. The table gives each
kernel's time per call and its share of the call's summed kernel time; the wall time per call (CUDA events
around the same calls, outside the profiler) shows what launch gaps and overlap add or hide. Programmatic
launches overlap a kernel's start with its predecessor's end, so the kernels' sum can exceed the wall time.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"4,4096,16,1,16384,16"`` -> [(4, 4096, 16), (1, 16384, 16)]: (batch, seqlen, heads) triples."""
    try:
        nums = [int(x) for x in text.split(",")]
    except ValueError:
        nums = []
    if not nums or len(nums) % 3 or min(nums) < 1:
        raise ValueError(f"--shapes takes batch,seqlen,heads triples, each at least 1, not {text!r}")
    return [tuple(nums[i : i + 3]) for i in range(0, len(nums), 3)]


def add_point_arguments(ap: argparse.ArgumentParser) -> None:
    """The implementations and the points they run at (this tool's and tools/sustained_clocks.py's)."""
    ap.add_argument("--impls", default="flash_attention,fa4", help="bench implementations, comma-separated")
    ap.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shapes", default="4,4096,16", help="batch,seqlen,heads triples, comma-separated")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")


def points_of(args: argparse.Namespace) -> list[tuple[int, int, int, bool]]:
    """(batch, seqlen, heads, causal) of every point, shape by shape, non-causal first."""
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [(b, s, h, c) for b, s, h in parse_shapes(args.shapes) for c in causals]


def group_kernel_times(events: list[tuple[str, float]], calls: int) -> list[tuple[str, float]]:
    """(kernel name, device µs) records -> [(name, µs per call)], longest first."""
    if calls < 1:
        raise ValueError("calls must be at least 1")
    total: dict[str, float] = {}
    for name, us in events:
        total[name] = total.get(name, 0.0) + us
    return sorted(((name, us / calls) for name, us in total.items()), key=lambda kv: -kv[1])


def call_timeline(events: list[tuple[str, float, float]], calls: int) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, end µs) records of ``calls`` identical calls run one after another ->
    [(name, start, end)] of one call, in launch order, each the median over the calls of its offsets from
    the call's first kernel start. Every call launches the same kernels, so the records sorted by start
    fall into ``calls`` runs of equal length."""
    if calls < 1 or len(events) % calls:
        raise ValueError(f"{len(events)} kernel records do not divide into {calls} calls")
    per = len(events) // calls
    ordered = sorted(events, key=lambda e: e[1])
    runs = [ordered[i * per : (i + 1) * per] for i in range(calls)]
    out = []
    for k in range(per):
        names = {run[k][0] for run in runs}
        if len(names) != 1:
            raise ValueError(f"the calls launch different kernels at position {k}: {sorted(names)}")
        starts = sorted(run[k][1] - run[0][1] for run in runs)
        ends = sorted(run[k][2] - run[0][1] for run in runs)
        out.append((names.pop(), starts[calls // 2], ends[calls // 2]))
    return out


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_point_arguments(ap)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per point")
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also time the calls one at a time (synchronized) and print one call's kernels in launch order "
        "with their start and end from the call's first kernel start (medians): where kernels overlap "
        "(programmatic launches) and where the GPU idles between them",
    )
    ap.add_argument("--json", help="write every point's kernels here")
    args = ap.parse_args(argv)
    points = points_of(args)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from flash_attention.tools.bench.runners import Shape, Skip, make_inputs, make_runner

    if not torch.cuda.is_available():
        print("kernel_times: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for batch, seqlen, heads, causal in points:
        shape = Shape("bf16", batch, heads, seqlen, args.head_dim, causal)
        inputs = make_inputs(shape, 1, "cuda")
        for impl in args.impls.split(","):
            try:
                runner = make_runner(impl, shape, inputs, args.mode)
            except Skip as exc:
                print(f"{impl}: skipped ({exc})")
                continue
            with runner.context():
                for _ in range(args.warmup):
                    runner.call(0)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.calls):
                    runner.call(0)
                end.record()
                torch.cuda.synchronize()
                wall_us = start.elapsed_time(end) * 1000 / args.calls
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        runner.call(0)
                    torch.cuda.synchronize()
            records = [
                (e.name, e.device_time_total)
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
            ]
            timeline = None
            if args.timeline:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        runner.call(0)
                        torch.cuda.synchronize()
                spans = [
                    (e.name, e.time_range.start, e.time_range.end)
                    for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
                ]
                timeline = call_timeline(spans, args.calls)
            kernels = group_kernel_times(records, args.calls)
            summed = sum(us for _, us in kernels)
            label = f"{impl} d{args.head_dim} {batch}x{seqlen}x{heads} {'causal' if causal else 'non-causal'}"
            print(f"\n{label}: wall {wall_us:.1f} µs per call, kernels summed {summed:.1f} µs")
            for name, us in kernels:
                print(f"  {us:9.1f} µs  {100 * us / summed:5.1f}%  {_short(name)}")
            if timeline:
                print(f"  one call alone, from its first kernel's start (span {timeline[-1][2]:.1f} µs):")
                for name, t0, t1 in timeline:
                    print(f"  {t0:9.1f} -> {t1:9.1f} µs ({t1 - t0:8.1f})  {_short(name, 70)}")
            results.append(
                {
                    "impl": impl,
                    "mode": args.mode,
                    "head_dim": args.head_dim,
                    "batch": batch,
                    "seqlen": seqlen,
                    "heads": heads,
                    "causal": causal,
                    "wall_us": wall_us,
                    "kernels": [{"name": n, "us": us} for n, us in kernels],
                    "timeline": [{"name": n, "start_us": a, "end_us": b} for n, a, b in timeline or []],
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "points": points},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
