"""One attention call, ours or a peer's, for a profiler: warm-up calls first, then the profiled call alone
between cudaProfilerStart and cudaProfilerStop, so that `ncu --profile-from-start off` sees one call's
kernels and no compile, warm-up or reference. (`--clock-control none`: ncu otherwise locks the clocks to
base while it profiles; the device notes say to leave the card's clocks alone.)

    python tools/profile_call.py IMPL [--mode fwd|fwd_bwd] [--causal] [--head-dim 128] [--shape 4,4096,16]

    # the kernels' counters, ours and FlashAttention-4's on one shape (kernel log, backward, 21st session):
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python tools/profile_call.py fa4 --mode fwd_bwd --head-dim 128 --shape 4,4096,16
    # the SASS of the dK/dV kernels with executed counts and stall samples (ncu's source page):
    ncu --profile-from-start off --clock-control none -k regex:"bwd_sm90|dkdv" --section SourceCounters \\
        --page source --print-source sass --csv \\
        python tools/profile_call.py flash_attention --mode fwd_bwd --causal

IMPL is a bench implementation (flash_attention, sdpa_cudnn, fa4, ...), called as `bench` times it
(flash_attention.tools.bench.runners.make_runner: our rows through the config attention() picks, fwd_bwd
with the gradients of q, k and v), on one set of fresh random bf16 inputs of (batch, seqlen, heads,
head_dim). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"4,4096,16"`` -> (batch, seqlen, heads)."""
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 1:
        raise ValueError(f"--shape takes batch,seqlen,heads, each at least 1, not {text!r}")
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("impl", help="a bench implementation: flash_attention, sdpa_cudnn, fa4, ...")
    ap.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--shape", default="4,4096,16", help="batch,seqlen,heads")
    ap.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
    args = ap.parse_args(argv)
    batch, seqlen, heads = parse_shape(args.shape)

    import torch

    from flash_attention.tools.bench.runners import Shape, Skip, make_inputs, make_runner

    if not torch.cuda.is_available():
        print("profile_call: needs a CUDA GPU", file=sys.stderr)
        return 2
    shape = Shape("bf16", batch, heads, seqlen, args.head_dim, args.causal)
    try:
        runner = make_runner(args.impl, shape, make_inputs(shape, 1, "cuda"), args.mode)
    except Skip as exc:
        print(f"profile_call: {args.impl} cannot run this call: {exc}", file=sys.stderr)
        return 2
    with runner.context():
        for _ in range(args.warmup):
            runner.call(0)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        runner.call(0)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
