"""In-process A/B of Hopper forward configs at the grid's points: each candidate's time against the
heuristic's pick, the configs taking turns sample by sample in one process. The evidence behind a change of
a pick (configs.heuristics; kernel log 171, whose runs are benchmarks/results/ab/h200-2026-11-30-fwd-picks-*).

    python tools/ab_configs.py --head-dims 128 --seqlens 1k,2k,4k,8k,16k [--pairs 24] [--calls 3] [--json OUT]
    python tools/ab_configs.py --head-dims 64 --seqlens 2k \\
        --extra "(BF16, 64, 192, 128, 16): wgmma+ws+overlap+tma_store+stages_2"

A point is the FlashAttention papers' grid: 16k tokens per batch (batch 16384 / seqlen), 2048 / head_dim
heads, bf16, causal and not. Its configs are the pick of this checkout's heuristic ("pick"), the head_dim's
standing candidates (:data:`CANDIDATES`: the tiles and schedules the picks choose among) and any --extra
config by name. Each is called through ops.cuda_forward with its config, so every one runs the same launch
path; a config the kernels refuse at a point (shared memory, a rule) is reported and left out. Every round
times each config once (--calls calls between two CUDA events) in rotated order, and a config's ratio is
the median over the rounds of its time over the pick's in the same round (below 1: faster), with the
number of rounds it was faster in. Why in one process: between processes the same kernel reads 3-6%
apart (kernel log 153, 165-167), more than most picks differ by. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_kernels import pair_orders, paired_summary  # noqa: E402  (a sibling script: rounds and ratios)

#: Per head_dim, the standing candidates by label: ws_config's arguments after the dtype and head_dim
#: (block_q, block_kv, stages, then its flags). The tiles and schedules the Hopper picks choose among
#: (configs.heuristics._hopper_default): one block per tile or the persistent grid, with or without the
#: tile overlap, 128- or 176-key tiles, the 192-row three-warpgroup tile at 64, ping-pong at 128.
CANDIDATES: dict[int, dict[str, tuple]] = {
    128: {
        "np128": (128, 128, 2, {"overlap": True}),
        "np176": (128, 176, 2, {"overlap": True}),
        "p128": (128, 128, 2, {"overlap": True, "persistent": True}),
        "pto128": (128, 128, 2, {"overlap": True, "persistent": True, "tile_overlap": True}),
        "pp128": (128, 128, 2, {"overlap": True, "pingpong": True}),
    },
    64: {
        "np192": (192, 128, 2, {"overlap": True}),
        "p192": (192, 128, 2, {"overlap": True, "persistent": True}),
        "pto192": (192, 128, 2, {"overlap": True, "persistent": True, "tile_overlap": True}),
        "pto176": (128, 176, 3, {"overlap": True, "persistent": True, "tile_overlap": True}),
        "p128": (128, 128, 2, {"overlap": True, "persistent": True}),
        "np128_176": (128, 176, 3, {"overlap": True}),
    },
}


def parse_seqlen(text: str) -> int:
    """``"2k"`` -> 2048, ``"512"`` -> 512."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def grid_point(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads) of the grid's point: 16k tokens per batch, 2048 / head_dim heads."""
    if 16384 % seqlen or 2048 % head_dim:
        raise ValueError(f"the grid has no point at seqlen {seqlen}, head_dim {head_dim}")
    return 16384 // seqlen, 2048 // head_dim


def point_configs(head_dim: int, seqlen: int, causal: bool, extra: list[str]) -> dict[str, object]:
    """The configs timed at a point by label: "pick" first (the heuristic's), then the candidates and the
    extras (labelled by their names). A candidate the config rules refuse is left out with a line."""
    from flash_attention.configs import default_config, parse_config
    from flash_attention.configs.forward import ws_config

    configs = {"pick": default_config("bf16", head_dim, causal, seqlen, seqlen, "sm_90")}
    for label, (bq, bk, stages, flags) in CANDIDATES.get(head_dim, {}).items():
        try:
            configs[label] = ws_config("bf16", head_dim, bq, bk, stages, tma_store=True, **flags)
        except ValueError as exc:
            print(f"  {label}: {exc}")
    for name in extra:
        configs[name] = parse_config(name)
    return configs


def summarize(samples: list[dict[str, float]], labels: list[str]) -> dict:
    """Per label: the median time (ms), and against "pick" (``labels[0]``) the median of the per-round
    ratios and the rounds it was faster in (ab_kernels.paired_summary, by label)."""
    assert labels[0] == "pick", labels
    rows = paired_summary([{i: s[x] for i, x in enumerate(labels)} for s in samples], len(labels))
    return {
        key: {x: row[key] for x, row in zip(labels, rows, strict=True)} for key in ("ms", "ratio", "faster")
    }


def time_point(head_dim: int, seqlen: int, causal: bool, configs: dict, pairs: int, calls: int) -> dict:
    """One point's row: the configs' names, and their times and ratios (:func:`summarize`)."""
    import torch

    from flash_attention import ops

    batch, heads = grid_point(seqlen, head_dim)
    q, k, v = (
        torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    calls_of = {}
    for label, cfg in configs.items():

        def call(cfg=cfg):
            return ops.cuda_forward(
                q, k, v, causal=causal, softmax_scale=head_dim**-0.5, return_lse=False, out=None, config=cfg
            )

        try:
            call()  # (compiles)
            torch.cuda.synchronize()
            calls_of[label] = call
        except Exception as exc:  # a config the kernels refuse here: reported, not fatal
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}")
    if "pick" not in calls_of:
        raise RuntimeError(f"the pick {configs['pick'].name()} did not run at seqlen {seqlen}")
    labels = list(calls_of)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for order in pair_orders(len(labels), pairs):
        sample = {}
        for i in order:
            start.record()
            for _ in range(calls):
                calls_of[labels[i]]()
            end.record()
            end.synchronize()
            sample[labels[i]] = start.elapsed_time(end) / calls
        samples.append(sample)
    row = {"d": head_dim, "n": seqlen, "causal": causal, "pick": configs["pick"].name()}
    row.update(summarize(samples, labels))
    row["configs"] = {x: configs[x].name() for x in labels}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="128", help="comma-separated (64, 128: the standing candidates)")
    ap.add_argument("--seqlens", default="1k,2k,4k,8k,16k", help="comma-separated, 1k = 1024")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--extra", action="append", default=[], help="another config by name (repeatable)")
    ap.add_argument("--pairs", type=int, default=24, help="rounds (each times every config once)")
    ap.add_argument("--calls", type=int, default=3, help="calls per sample, between two events")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    import torch

    masks = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (parse_seqlen(x) for x in args.seqlens.split(",")):
            for causal in masks:
                row = time_point(
                    d, n, causal, point_configs(d, n, causal, args.extra), args.pairs, args.calls
                )
                others = "  ".join(
                    f"{x} {row['ratio'][x]:.3f} ({row['faster'][x]})" for x in row["configs"] if x != "pick"
                )
                print(f"d{d} n{n} causal={int(causal)} pick {row['ms']['pick']:.3f} ms: {others}", flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
    if args.json:
        out = {
            "tool": "tools/ab_configs.py",
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "pairs": args.pairs,
            "calls_per_sample": args.calls,
            "ratio": "median of per-round time ratios to the pick (below 1: faster)",
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
