"""Each implementation's time per call when it runs back to back for seconds, with the GPU's SM clock and
power read meanwhile: does one kernel run at a lower clock than another under sustained load?

    python tools/sustained_clocks.py [--impls flash_attention,fa4] [--mode fwd_bwd] [--head-dim 128]
                                     [--shapes 4,4096,16] [--causal both] [--seconds 3] [--rounds 2]
                                     [--json FILE]

Why: an interleaved A/B (tools/ab_kernels.py, ab_trees.py) alternates its trees every few milliseconds, so
the card's power and clock state is the mix of both and a change that draws less power cannot show there;
`bench` runs each implementation alone for a fifth of a second or more, long enough for the clock to follow
its power. On an H200, tools/kernel_times.py (kernel log, backward, 2026-12-01) read ours 1-13% slower per
call back to back than one call at a time, FA4 -4 to +5%. This tool puts numbers on it: each point runs
every implementation in turn (the order rotated each round), each for --seconds of calls queued back to back
(synchronized every 50 ms or so, so the queue stays short); the first half settles the clock, the second is
timed with CUDA events while `nvidia-smi` samples the SM clock and the power draw every 50 ms. A point's
line gives the time per call, the median clock (MHz) and power (W) over the timed half, and how many
samples they came from. It reads the card's state and changes nothing (METHOD.md: leave the clocks alone).
Needs a CUDA GPU and nvidia-smi (without it the clock and power columns read '-').
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_times import add_point_arguments, points_of  # noqa: E402  (a sibling script: the same points)

#: nvidia-smi's query: the SM clock (MHz) and the board's power draw (W), one line every 50 ms.
SMI_QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]


def parse_smi_line(line: str) -> tuple[float, float] | None:
    """``"1980, 512.34"`` -> (1980.0, 512.34); a missing field ('[N/A]') or not two numbers -> None."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:
        return None


def window_medians(
    samples: list[tuple[float, float, float]], t0: float, t1: float
) -> tuple[float | None, float | None, int]:
    """(median clock, median power, count) of the (host time, clock, power) samples taken in [t0, t1]."""
    inside = [(mhz, w) for t, mhz, w in samples if t0 <= t <= t1]
    if not inside:
        return None, None, 0
    return statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside), len(inside)


class ClockSampler:
    """nvidia-smi's samples, each stamped with the host's monotonic clock as its line arrives (a line lags
    its reading by a few ms at most: far under a timed half of a second or more)."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self._proc = None
        self._thread = None

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(SMI_QUERY, stdout=subprocess.PIPE, text=True)
        except OSError:
            return self  # no nvidia-smi: no samples
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            got = parse_smi_line(line)
            if got is not None:
                self.samples.append((time.monotonic(), *got))

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        return False


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_point_arguments(ap)
    ap.add_argument("--seconds", type=float, default=3.0, help="per implementation and point: half settles")
    ap.add_argument("--rounds", type=int, default=2, help="every point's implementations in turn, rotated")
    ap.add_argument("--json", help="write every window here")
    args = ap.parse_args(argv)
    points = points_of(args)
    if args.seconds <= 0 or args.rounds < 1:
        raise ValueError("--seconds must be positive and --rounds at least 1")

    import torch

    from flash_attention.tools.bench.runners import Shape, Skip, make_inputs, make_runner

    if not torch.cuda.is_available():
        print("sustained_clocks: needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = args.impls.split(",")
    rows = []
    with ClockSampler() as sampler:
        for batch, seqlen, heads, causal in points:
            shape = Shape("bf16", batch, heads, seqlen, args.head_dim, causal)
            inputs = make_inputs(shape, 1, "cuda")
            runners = {}
            for impl in impls:
                try:
                    runners[impl] = make_runner(impl, shape, inputs, args.mode)
                except Skip as exc:
                    print(f"{impl}: skipped ({exc})")
            names = list(runners)
            for r in range(args.rounds):
                k = r % max(1, len(names))
                for impl in names[k:] + names[:k]:
                    row = _sustain(torch, runners[impl], args.seconds, sampler)
                    row.update(impl=impl, round=r, head_dim=args.head_dim, batch=batch, seqlen=seqlen)
                    row.update(heads=heads, causal=causal, mode=args.mode)
                    rows.append(row)
                    kind = "causal" if causal else "non-causal"
                    print(
                        f"{impl:16s} d{args.head_dim} {batch}x{seqlen}x{heads} {kind:10s} round {r}: "
                        f"{row['us_per_call']:9.1f} us/call, {_fmt(row['mhz'], '.0f')} MHz, "
                        f"{_fmt(row['watts'], '.0f')} W ({row['samples']} samples)",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


def _sustain(torch, runner, seconds: float, sampler: ClockSampler) -> dict:
    """One implementation back to back for ``seconds``; the second half timed and its samples read."""
    with runner.context():
        runner.call(0)  # (compiles on a first call: outside the window)
        torch.cuda.synchronize()
        t = time.monotonic()
        runner.call(0)
        torch.cuda.synchronize()
        per_call = max(time.monotonic() - t, 1e-6)
        chunk = max(1, int(0.05 / per_call))  # calls between synchronizations: about 50 ms

        def run_until(deadline: float) -> int:
            n = 0
            while time.monotonic() < deadline:
                for _ in range(chunk):
                    runner.call(0)
                n += chunk
                torch.cuda.synchronize()
            return n

        run_until(time.monotonic() + seconds / 2)  # the clock settles at this load
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.monotonic()
        start.record()
        calls = run_until(t0 + seconds / 2)
        end.record()
        torch.cuda.synchronize()
        t1 = time.monotonic()
    mhz, watts, n = window_medians(sampler.samples, t0, t1)
    us = start.elapsed_time(end) * 1000 / calls
    return {"us_per_call": us, "calls": calls, "mhz": mhz, "watts": watts, "samples": n}


if __name__ == "__main__":
    sys.exit(main())
