"""A/B timing of source trees: the same attention calls timed with each tree's package, alternated.

    python tools/ab_trees.py TREE [TREE ...] [--mode fwd|fwd_bwd] [--cases 0:0:128,30:1:128] [--rounds 3]
        [--shape 4,4096,16] [--reps 20] [--json OUT]
    python tools/ab_trees.py TREE [TREE ...] --mode decode --cases 1:32768:1,8:8192:16  (batch:keys:seqlen_q)

A kernel change is measured against the tree before it (a `git worktree` of the previous commit, or a copy of
a commit with one macro or default changed: tools/ab_make_tree.py makes one) on the same machine in the same
call: one process per tree per round, in turn (the order rotated each round: round_order), so that the
machine's drift between rounds reaches every tree alike (shared GPUs drift by several percent). Each process
imports flash_attention from its own tree (its JIT cache keys on the sources, so the trees' kernels live side
by side) and times every case with CUDA events, after a warm-up round whose numbers are dropped (it compiles).
A case is `softcap:causal:head_dim[:option...]` (softcap 0: none; options: a number w, a sliding window of w
keys on each side, (w, 0) when causal; `alibi`, ALiBi with the geometric slopes; `seqalibi`, the same slopes
given per sequence (--packed); `cross`, the keys' offsets another tensor than the queries' (--packed: ALiBi
without causal then measures from the table of diagonals); `dropNN`, dropout_p NN / 100): bf16 q, k, v of
--shape (batch, seqlen, heads) and that head_dim, fresh per case; with --packed, a packed batch of documents
through attention_varlen instead.

Prints the median of the rounds per case and tree, and each tree's ratio to the first. The spread is
the rounds' own (min-max per tree), printed beside: a difference inside it is noise. docs/kernel-log.md
steps 100-102 were measured with the script this grew from (the same child). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# The child: one tree's package, every case timed once (a process per tree and round).
_CHILD = r"""
import itertools, json, os, sys
tree, mode, shape, reps = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
packed = int(sys.argv[6])
sys.path.insert(0, tree)
import torch
import flash_attention as fa
assert os.path.abspath(fa.__file__).startswith(os.path.abspath(tree)), fa.__file__
from flash_attention.jit import host
host.unavailable_reason()  # the host library built now, not in the background while rounds are timed
if packed:  # documents of 128 to 8191 tokens (the same in every tree and round) up to `packed` tokens
    gen, lens = torch.Generator().manual_seed(0), []
    while sum(lens) + (n := int(torch.randint(128, 8192, (1,), generator=gen))) <= packed:
        lens.append(n)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
def decode_case(case):
    # batch:keys:seqlen_q: attention_with_kvcache of seqlen_q new queries (32 query heads, 8 K/V heads,
    # head_dim 128, bf16) against a full contiguous cache of `keys`, causal; 50 calls queued back to back
    # per timed pair of events, so that the host's time between calls does not hide the GPU's.
    b, keys, sq = (int(x) for x in case.split(":"))
    sets = max(1, (256 << 20) // (4 * b * keys * 8 * 128) + 1)  # inputs cycled past the L2
    caches = [[torch.randn(b, keys, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for _ in range(sets)]
    qs = [torch.randn(b, sq, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    calls = 50
    def run():
        for i in range(calls):
            k, v = caches[i % sets]
            fa.attention_with_kvcache(qs[i % sets], k, v, cache_seqlens=keys)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, reps // 4)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); run(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    print(json.dumps({"case": case, "ms": sorted(times)[len(times) // 2]}), flush=True)
for case in sys.argv[5].split(","):
    if mode == "decode":
        decode_case(case)
        continue
    cap, causal, d, *options = case.split(":")
    win = [o for o in options if o.isdigit()]
    window = None if not win else (int(win[0]), 0 if causal == "1" else int(win[0]))
    dv = next((int(o[1:]) for o in options if o[:1] == "v"), int(d))  # v's own head_dim (option vNN)
    b, s, h = shape
    dims = (sum(lens), h) if packed else (b, s, h)
    grad = mode == "fwd_bwd"
    q, k, v = (torch.randn(*dims, n, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for n in (int(d), int(d), dv))
    do = torch.randn(*dims, dv, device="cuda", dtype=torch.bfloat16)
    opts = dict(causal=causal == "1", softcap=float(cap), window=window)
    drop = [o for o in options if o[:4] == "drop"]
    if drop:  # (option dropNN: dropout_p NN / 100, a fixed seed)
        opts.update(dropout_p=int(drop[0][4:]) / 100, dropout_seed=1234)
    if "alibi" in options or "seqalibi" in options:
        opts["alibi_slopes"] = torch.pow(2.0, -8.0 * torch.arange(1, h + 1, device="cuda") / h)
        if "seqalibi" in options:
            opts["alibi_slopes"] = opts["alibi_slopes"].expand(len(lens), h).contiguous()
    cu_k = cu.clone() if packed and "cross" in options else (cu if packed else None)
    def call():
        if packed:
            o = fa.attention_varlen(q, k, v, cu, cu_k, max_seqlen_q=max(lens), max_seqlen_k=max(lens), **opts)
        else:
            o = fa.attention(q, k, v, **opts)
        if mode == "fwd_bwd":
            torch.autograd.grad(o, (q, k, v), do)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); call(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    print(json.dumps({"case": case, "ms": sorted(times)[len(times) // 2]}), flush=True)
"""


_OPTIONS = ("alibi", "seqalibi", "cross")


def parse_decode_case(text: str) -> str:
    """A --mode decode case `batch:keys:seqlen_q`, checked."""
    parts = text.split(":")
    if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"a decode case is batch:keys:seqlen_q, positive ints; got {text!r}")
    return text


def parse_case(text: str) -> str:
    """A case `softcap:causal:head_dim[:option...]` (options: a window, alibi, seqalibi, cross, vNN: v's own
    head_dim NN, dropNN: dropout_p NN / 100), checked."""
    parts = text.split(":")
    options = parts[3:]
    value_dims = [o for o in options if o[:1] == "v"]
    drops = [o for o in options if o[:4] == "drop"]
    if (
        len(parts) < 3
        or parts[1] not in ("0", "1")
        or not parts[2].isdigit()
        or sum(o.isdigit() for o in options) > 1
        or len(value_dims) > 1
        or not all(o[1:].isdigit() for o in value_dims)
        or len(drops) > 1
        or not all(o[4:].isdigit() and 0 < int(o[4:]) < 100 for o in drops)
        or not all(o.isdigit() or o in _OPTIONS or o in value_dims or o in drops for o in options)
    ):
        raise argparse.ArgumentTypeError(
            "a case is softcap:causal(0|1):head_dim[:window][:alibi|seqalibi][:cross][:vNN][:dropNN], got "
            f"{text!r}"
        )
    float(parts[0])
    return text


def run_tree(
    tree: str, mode: str, shape: str, reps: int, cases: list[str], packed: int = 0
) -> dict[str, float]:
    """One process of ``tree``: each case's median time (ms)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, tree, mode, shape, str(reps), ",".join(cases), str(packed)],
        capture_output=True,
        text=True,
        env={**os.environ, "FLASH_ATTENTION_QUIET": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r["ms"] for r in rows}


def round_order(trees: list[str], i: int) -> list[str]:
    """The order round ``i`` runs the trees in: rotated by one each round (two trees: A B, B A, A B, ...), so
    that no tree always runs first or last in a round. Two copies of one tree, timed in a fixed order at 4 x
    4096 x 16, d128 forward+backward, five rounds (H200), differed by 2.3-2.8% at the median; the same
    change measured in both orders read 1.058x one way and 0.945x the other (kernel log 153)."""
    k = i % len(trees)
    return trees[k:] + trees[:k]


def summarize(trees: list[str], cases: list[str], rounds: list[dict[str, dict[str, float]]]) -> list[str]:
    """The table: per case, each tree's median over the rounds, its min-max, and its ratio to the first."""
    lines = [f"{'case':12}" + "".join(f" {t[-28:]:>28}" for t in trees)]
    for case in cases:
        cells = []
        first = None
        for tree in trees:
            times = [r[tree][case] for r in rounds]
            median = statistics.median(times)
            first = median if first is None else first
            cells.append(f"{median:7.3f} ({min(times):.3f}-{max(times):.3f}) {median / first:5.3f}x")
        lines.append(f"{case:12}" + "".join(f" {c:>28}" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="source trees (their roots: each holds flash_attention/)")
    ap.add_argument(
        "--mode",
        choices=["fwd", "fwd_bwd", "decode"],
        default="fwd_bwd",
        help="decode: attention_with_kvcache, cases batch:keys:seqlen_q (32/8 heads, d128, bf16), 50 calls "
        "back to back per timing",
    )
    ap.add_argument(
        "--cases",
        default="0:0:128,30:0:128,0:1:128,30:1:128",
        help="softcap:causal:head_dim[:window][:alibi|seqalibi][:cross][:vNN][:dropNN],...",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed rounds after the warm-up (default 3); 0: the warm-up alone, which compiles each tree's "
        "kernels (several trees' in parallel, one process each, before the timed run)",
    )
    ap.add_argument("--shape", default="4,4096,16", help="batch,seqlen,heads (default 4,4096,16)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per case (the median is kept)")
    ap.add_argument(
        "--packed",
        type=int,
        default=0,
        metavar="TOKENS",
        help="time attention_varlen on documents of 128-8191 tokens (seed 0) filling up to TOKENS, with "
        "--shape's heads (its batch and seqlen unused)",
    )
    ap.add_argument("--json", default=None, help="write every round's times here")
    args = ap.parse_args(argv)
    parse = parse_decode_case if args.mode == "decode" else parse_case
    cases = [parse(c) for c in args.cases.split(",")]
    if args.mode == "decode" and args.packed:
        ap.error("--packed is for the fwd and fwd_bwd modes")
    if not args.packed and any(o in c.split(":")[3:] for c in cases for o in ("seqalibi", "cross")):
        ap.error("the seqalibi and cross options are a packed batch's: give --packed")
    for tree in args.trees:
        if not os.path.isfile(os.path.join(tree, "flash_attention", "__init__.py")):
            ap.error(f"{tree} holds no flash_attention package")
    if args.rounds < 0:
        ap.error("--rounds is 0 or more")
    if args.rounds == 0 and args.json:
        ap.error("--rounds 0 times nothing: no --json to write")
    for tree in args.trees:  # the warm-up round: compiles each tree's kernels, its numbers dropped
        run_tree(tree, args.mode, args.shape, 3, cases, args.packed)
    if args.rounds == 0:
        print(f"warm-up only: {len(args.trees)} tree(s) compiled and run once, nothing timed")
        return 0
    rounds = []

    def write_json() -> None:
        # After every round, not once at the end: a run its time limit cuts short keeps the rounds it timed
        # (rounds_planned says how many were asked for).
        with open(args.json, "w") as f:
            json.dump(
                {
                    "mode": args.mode,
                    "shape": args.shape,
                    "packed": args.packed,
                    "trees": args.trees,
                    "rounds_planned": args.rounds,
                    "rounds": rounds,
                },
                f,
            )

    for i in range(args.rounds):
        timed = {
            tree: run_tree(tree, args.mode, args.shape, args.reps, cases, args.packed)
            for tree in round_order(args.trees, i)
        }
        rounds.append({tree: timed[tree] for tree in args.trees})
        # (each round as it ends: a run cut short by its time limit still leaves what it measured)
        print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        if args.json:
            write_json()
    what = f"packed {args.packed} tokens, " if args.packed else ""
    rounds_text = f"median of {args.rounds} rounds (min-max), ratio to {args.trees[0]}"
    print(f"{args.mode}, {what}shape {args.shape}, {rounds_text}")
    print("\n".join(summarize(args.trees, cases, rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
