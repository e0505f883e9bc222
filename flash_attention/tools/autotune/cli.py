"""``python -m flash_attention autotune``: time every surviving kernel configuration per shape class and cache
the winners (forward by default, ``--backward`` for the backward family)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from flash_attention.ops import clear_plans, device_arch
from flash_attention.ops.winners import CACHE_FILE, SEQLEN_BUCKETS, environment_key, user_cache_path

from .backward import BACKWARD
from .forward import FORWARD
from .loop import run
from .space import bwd_candidate_space, candidate_space, prune

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention autotune",
        description="Time every surviving kernel configuration per shape class and cache the winners.",
    )
    ap.add_argument("--dtype", default="bf16", help="bf16, fp16 or both (comma-separated)")
    ap.add_argument("--head-dim", default="64,128,256", help="comma-separated head dims")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLEN_BUCKETS)))
    ap.add_argument("--groups", default="1", help="GQA group sizes to tune (1 = multi-head)")
    ap.add_argument("--budget", type=float, default=0.05, help="seconds of timing per candidate and shape")
    ap.add_argument("--out", default=None, help=f"cache file (default: <cache dir>/{CACHE_FILE})")
    ap.add_argument("--report", default=None, help="also write every timing to this JSON file")
    ap.add_argument("--space", action="store_true", help="print the search space and pruning, time nothing")
    ap.add_argument(
        "--backward",
        action="store_true",
        help="tune the backward kernels (BwdConfig) instead of the forward",
    )
    ap.add_argument(
        "--arch", default="sm_90", help="the architecture whose space --space prints (default sm_90)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dtypes = ["bf16", "fp16"] if args.dtype == "both" else args.dtype.split(",")
    head_dims = [int(x) for x in args.head_dim.split(",")]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]

    if args.space and args.backward:
        for dtype, d in itertools.product(dtypes, head_dims):
            cands = bwd_candidate_space(dtype, d, args.arch)
            print(f"backward {dtype} d={d}: {len(cands)} candidates")
            for c in cands:
                print(f"    {c.name()}")
        return 0
    if args.space:
        for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
            all_c = candidate_space(dtype, d, causal, args.arch)
            kept, rejected = prune(all_c)
            print(
                f"{dtype} d={d} {'causal' if causal else 'full'}: {len(all_c)} candidates, {len(kept)} kept"
            )
            for why, n in sorted(rejected.items(), key=lambda x: -x[1]):
                print(f"    pruned {n:4d}: {why}")
        return 0

    if not torch.cuda.is_available():
        print(
            "autotune times kernels on a CUDA GPU; none was found (try --space to see the search space)",
            file=sys.stderr,
        )
        return 2
    gpu = torch.cuda.get_device_name()
    arch = device_arch(torch.cuda.current_device())
    out_path = Path(args.out) if args.out else user_cache_path()
    t0 = time.perf_counter()
    entries, report = run(
        BACKWARD if args.backward else FORWARD,
        dtypes=dtypes,
        head_dims=head_dims,
        causals=causals,
        seqlens=seqlens,
        groups=groups,
        budget=args.budget,
        out_path=out_path,
        gpu=gpu,
        arch=arch,
    )
    clear_plans()  # plans made before the table changed keep their old choice
    if args.report:
        Path(args.report).write_text(json.dumps({"gpu": gpu, **environment_key(), "rows": report}, indent=1))
    print(f"wrote {len(entries)} winners to {out_path} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0
