"""In-process A/B of kernel sources: the same attention calls, timed with the kernels compiled from each
source tree's csrc/, alternated sample by sample in one process.

    python tools/ab_kernels.py CSRC_A CSRC_B [CSRC ...] [--mode fwd|fwd_bwd] [--cases 0:0:128,0:1:64]
        [--shape 4,4096,16] [--pairs 40] [--calls 3] [--json OUT]

    # e.g. a kernel step on a branch against main, its tree made by tools/ab_make_tree.py:
    python tools/ab_kernels.py flash_attention/csrc .abt/trees/step/flash_attention/csrc --mode fwd_bwd

Why beside tools/ab_trees.py. That script runs one process per tree and round, which is what a change of
the Python layer needs; for a change of csrc/ alone its spread is the machine's drift between processes
(trees running the very same kernel read 0.968-1.029 of each other in one run of kernel log 165-167), wider
than the 1-3% a kernel step often buys. Here the package is this checkout's, imported once, and only the
kernels differ: each tree's kernels are compiled from its csrc/ (jit.compiler's include directories and
jit.cache's sources digest pointed at it, so they live side by side in the disk cache) and kept in a
loader table of their own, which the calls see while that tree is selected (:func:`kernel_sources`). A
sample is ``--calls`` calls back to back between two CUDA events; the trees take turns sample by sample
(A B, then B A, ...), so neighbouring samples share the GPU's clock and temperature, and each tree's ratio
to the first is the median of per-pair ratios. Use it for changes that leave the launch layer as it is
(the params structs, configs and host code the same); a change of either needs tools/ab_trees.py.

So that every call reaches the loader, the process turns off what keeps kernels elsewhere: repeat calls
and the host library (FLASH_ATTENTION_REPEAT_CALLS=0, FLASH_ATTENTION_HOST_LIBRARY=0, set before the
import; the Python launch path then adds its host time, so a timed call should be long enough to hide it,
a millisecond or more), and the backward's background prefetch (compiles run where the tree is selected).
A case is ``softcap:causal:head_dim[:option...]`` with bf16 inputs of --shape (batch, seqlen, heads); options
``det``, the deterministic backward, ``dropNN``, dropout_p NN / 100 with a fixed seed (as
tools/ab_trees.py writes it), and ``winW``, a sliding window of W keys before each query (window=(W, 0);
causal cases only), e.g. ``0:0:128:det:drop10``, ``30:1:128:win1024``. Needs a CUDA GPU.

``--prewarm N`` compiles first, in up to N child processes at once: one per tree and case, each this tool
on that tree alone for one round (its warm-up calls compile the tree's kernels into the disk cache, which
the timed process then finds). The timed process would otherwise compile every tree's kernels one after
another inside its warm-ups; the GPU machine's cores compile them side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

#: What the tool's process turns off before it imports the package (repeat calls are chosen when ops.repeat
#: loads; the host library's switch is read per call).
ENV = {"FLASH_ATTENTION_REPEAT_CALLS": "0", "FLASH_ATTENTION_HOST_LIBRARY": "0"}


class KernelTables:
    """One tree's kernels as the process keeps them: the loader's table of loaded entry points and the
    launch plans of the forward and the backward (which hold the kernels they launch), each filled as its
    tree's calls first need them."""

    def __init__(self) -> None:
        self.loaded: dict = {}
        self.plans: dict[int, object] = {}


def _plan_caches() -> list:
    from flash_attention.ops import backward, forward

    return [forward._plans, backward._plans]


@contextlib.contextmanager
def kernel_sources(csrc: Path, tables: KernelTables) -> Iterator[None]:
    """Within: kernels are compiled from ``csrc`` (its include/ and kernels/ directories, the cache keyed
    on its sources) and looked up, with the plans that launch them, in ``tables`` (kept by the caller
    across selections). The previous sources and tables after."""
    from collections import OrderedDict

    from flash_attention.jit import cache, compiler, loader
    from flash_attention.ops import winners

    csrc = Path(csrc).resolve()
    if not (csrc / "include" / "fa").is_dir():
        raise ValueError(f"{csrc} is not a csrc/ directory (no include/fa)")
    caches = _plan_caches()
    saved = (compiler.CSRC, list(compiler.INCLUDE_DIRS), loader._loaded, [c._plans for c in caches])
    compiler.CSRC = csrc
    compiler.INCLUDE_DIRS[:] = [csrc / "include", csrc / "kernels"]
    cache.sources_digest.cache_clear()
    # Tuned-winner tables apply where their sources digest is this tree's: forget the memo of the other's.
    winners.clear_memo()
    loader._loaded = tables.loaded
    for i, c in enumerate(caches):
        c._plans = tables.plans.setdefault(i, OrderedDict())
    try:
        yield
    finally:
        compiler.CSRC, loader._loaded = saved[0], saved[2]
        compiler.INCLUDE_DIRS[:] = saved[1]
        for c, plans in zip(caches, saved[3], strict=True):
            c._plans = plans
        cache.sources_digest.cache_clear()
        winners.clear_memo()


def parse_case(text: str) -> tuple[float, bool, int, dict]:
    """softcap:causal(0|1):head_dim[:det][:dropNN][:winW] -> (softcap, causal, head_dim, the options' call
    arguments)."""
    parts = text.split(":")
    options = parts[3:]
    drops = [o for o in options if o[:4] == "drop" and o[4:].isdigit() and 0 < int(o[4:]) < 100]
    wins = [o for o in options if o[:3] == "win" and o[3:].isdigit() and int(o[3:]) > 0]
    known = (
        options.count("det") <= 1
        and len(drops) <= 1
        and len(wins) <= 1
        and all(o == "det" or o in drops or o in wins for o in options)
    )
    if len(parts) < 3 or parts[1] not in ("0", "1") or not parts[2].isdigit() or not known:
        raise argparse.ArgumentTypeError(
            f"a case is softcap:causal(0|1):head_dim[:det][:dropNN][:winW]; got {text!r}"
        )
    if wins and parts[1] != "1":
        raise argparse.ArgumentTypeError(f"a window case (winW) is causal: {text!r}")
    extra = {"deterministic": True} if "det" in options else {}
    if drops:
        extra.update(dropout_p=int(drops[0][4:]) / 100, dropout_seed=1234)
    if wins:
        extra.update(window=(int(wins[0][3:]), 0))
    return float(parts[0]), parts[1] == "1", int(parts[2]), extra


def pair_orders(n_trees: int, pairs: int) -> list[list[int]]:
    """The trees' order in each round of samples: rotated by one each round, so that no tree is always
    first (two trees: A B, B A, A B, ...)."""
    base = list(range(n_trees))
    return [base[i % n_trees :] + base[: i % n_trees] for i in range(pairs)]


def paired_summary(samples: list[dict[int, float]], n_trees: int) -> list[dict]:
    """Per tree: the median sample (ms), and against tree 0 the median of the per-round ratios, their
    quartiles and how many rounds it was faster in."""
    rows = []
    for t in range(n_trees):
        times = [s[t] for s in samples]
        ratios = sorted(s[t] / s[0] for s in samples)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append(
            {
                "tree": t,
                "ms": statistics.median(times),
                "ratio": statistics.median(ratios),
                "ratio_q1": q[0],
                "ratio_q3": q[2],
                "faster": sum(r < 1 for r in ratios),
                "rounds": len(ratios),
            }
        )
    return rows


def time_case(case, trees, tables, mode: str, shape, pairs: int, calls: int) -> list[dict[int, float]]:
    """Every round's sample per tree (ms per call) for one case, after a warm-up of each tree (which
    compiles its kernels where it is selected)."""
    import flash_attention as fa

    cap, causal, d, extra = case
    b, s, h = shape
    grad = mode == "fwd_bwd"
    q, k, v = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)
    )
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def call():
        o = fa.attention(q, k, v, causal=causal, softcap=cap, **extra)
        if grad:
            torch.autograd.grad(o, (q, k, v), do)

    for tree, table in zip(trees, tables, strict=True):
        with kernel_sources(tree, table):  # (the warm-up compiles this tree's kernels)
            for _ in range(3):
                call()
    torch.cuda.synchronize()
    samples = []
    for order in pair_orders(len(trees), pairs):
        sample = {}
        for t in order:
            with kernel_sources(trees[t], tables[t]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    call()
                end.record()
                end.synchronize()
                sample[t] = start.elapsed_time(end) / calls
        samples.append(sample)
    return samples


def prewarm_commands(trees: list[Path], cases: list[str], mode: str, shape: str) -> list[list[str]]:
    """One child command per tree and case: this tool on that tree alone, one round, nothing written."""
    tool = str(Path(__file__).resolve())
    common = ["--mode", mode, "--shape", shape, "--pairs", "1"]
    return [
        [sys.executable, tool, str(tree), str(tree), "--cases", case, *common]
        for tree in trees
        for case in cases
    ]


def run_prewarm(commands: list[list[str]], jobs: int) -> list[str]:
    """Run the commands, at most ``jobs`` at once; return one line per command that failed (the command's
    tree and case, its exit status and the last line of its stderr), so that the caller can say so before
    it times anything. Each child's stderr goes to a file of its own (a pipe left unread while others run
    could fill and stall it)."""
    failures: list[str] = []
    pending, running = list(commands), []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = pending.pop(0)
            err = tempfile.TemporaryFile(mode="w+")
            running.append(
                (cmd, err, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True))
            )
        cmd, err, proc = running.pop(0)
        proc.wait()
        err.seek(0)
        last = err.read().strip().splitlines()[-1:] or ["(no stderr)"]
        err.close()
        if proc.returncode != 0:
            failures.append(f"prewarm of {cmd[2]} --cases {cmd[5]}: exit {proc.returncode}: {last[0]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", type=Path, help="csrc/ directories, the first the baseline")
    ap.add_argument("--mode", choices=["fwd", "fwd_bwd"], default="fwd_bwd")
    ap.add_argument(
        "--cases", default="0:0:128,0:1:128", help="softcap:causal:head_dim[:det][:dropNN][:winW],..."
    )
    ap.add_argument("--shape", default="4,4096,16", help="batch,seqlen,heads (default 4,4096,16)")
    ap.add_argument("--pairs", type=int, default=40, help="rounds of samples (one per tree each)")
    ap.add_argument("--calls", type=int, default=3, help="calls per sample, between two events")
    ap.add_argument("--json", default=None, help="write every sample here")
    ap.add_argument(
        "--prewarm",
        type=int,
        default=0,
        metavar="N",
        help="compile first in up to N child processes (one per tree and case)",
    )
    args = ap.parse_args(argv)
    if len(args.trees) < 2:
        ap.error("give two csrc/ directories or more: the first is the baseline")
    cases = [parse_case(c) for c in args.cases.split(",")]
    shape = [int(x) for x in args.shape.split(",")]
    if "flash_attention" in sys.modules:
        ap.error("run as a script: the package must be imported after the environment is set")
    if args.prewarm > 0:
        commands = prewarm_commands(args.trees, args.cases.split(","), args.mode, args.shape)
        for line in run_prewarm(commands, args.prewarm):
            print(line, file=sys.stderr)
    os.environ.update(ENV)
    from flash_attention.jit import cache

    # The backward's background prefetch would compile under whichever tree is selected when it runs.
    cache.prefetch = lambda *a, **k: None
    tables = [KernelTables() for _ in args.trees]
    results = {}
    for case, text in zip(cases, args.cases.split(","), strict=True):
        samples = time_case(case, args.trees, tables, args.mode, shape, args.pairs, args.calls)
        results[text] = samples
        rows = paired_summary(samples, len(args.trees))
        print(f"{text} ({args.mode}, shape {args.shape}, {args.pairs} rounds of {args.calls} calls)")
        for row, tree in zip(rows, args.trees, strict=True):
            print(
                f"  {str(tree)[-48:]:>48}  {row['ms']:8.3f} ms  {row['ratio']:.4f}x (quartiles "
                f"{row['ratio_q1']:.4f}-{row['ratio_q3']:.4f}; faster in {row['faster']}/{row['rounds']})"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "tool": "ab_kernels",
                        "mode": args.mode,
                        "shape": args.shape,
                        "calls": args.calls,
                        "trees": [str(t) for t in args.trees],
                        "samples": results,
                    },
                    f,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
