"""A communication/compute model of context parallelism: the step time of one causal sequence's forward and
backward on W GPUs, ring (:func:`flash_attention.ring_attention`) against all-to-all over heads
(:func:`flash_attention.head_parallel_attention`), from what one GPU measures and the links carry.

Inputs are measured numbers, not fitted ones: the attention kernels' throughput on one GPU (``tflops``,
forward+backward, from ``bench --ring``'s one-GPU rows or the fwd_bwd grid), the link bandwidth per GPU
and direction (``link_gbs``: about 450 GB/s for an H100/H200's NVLink, 50 for InfiniBand) and a latency per
transfer (``latency_us``). What it leaves out: the kernels' lower throughput on a step's smaller calls,
the merge of the ring's partial results, launches and the host; so it bounds the speedup from above, and
how far a measurement falls below it is what those costs take.

Ring, zigzag layout, per rank: the attention's FLOPs divide into W equal steps each way (the forward's,
then the backward's at 2.5 x); each step but the last receives the next K/V share while it computes (the
backward's also the dK/dV accumulators in float32: three times the bytes), so a step takes the longer of
its compute and its transfer, plus the latency. Head-parallel: the same FLOPs per rank (the whole sequence
of 1/W of the heads) and no overlap: four all-to-alls each way (q, k, v, out; dout, dq, dk, dv), each
sending (W - 1)/W of the rank's share of that tensor, K/V heads repeated up to W where there are fewer.

    python -m flash_attention.tools.cp_model --tflops 550 --link-gbs 450 --worlds 2,4,8 --seqlens 128k,1M
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["Model", "head_parallel_ms", "one_gpu_ms", "ring_ms", "main"]


@dataclass(frozen=True)
class Model:
    """One causal sequence's attention (``heads``/``kv_heads``, ``head_dim``, 2-byte elements) on GPUs that
    run its kernels at ``tflops`` (forward+backward) with links of ``link_gbs`` per direction."""

    tflops: float
    link_gbs: float
    latency_us: float = 20.0
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    def flops(self, seqlen: int) -> float:
        """Forward+backward FLOPs of the causal sequence (the backward 2.5 x the forward's)."""
        return 4.0 * seqlen * seqlen * self.head_dim * self.heads * 0.5 * 3.5

    def transfer_ms(self, nbytes: float) -> float:
        return nbytes / (self.link_gbs * 1e9) * 1e3 + self.latency_us * 1e-3


def one_gpu_ms(m: Model, seqlen: int) -> float:
    return m.flops(seqlen) / (m.tflops * 1e12) * 1e3


def ring_ms(m: Model, seqlen: int, world: int) -> float:
    """Step time of the ring on ``world`` GPUs (module docstring)."""
    if world == 1:
        return one_gpu_ms(m, seqlen)
    compute = one_gpu_ms(m, seqlen) / world  # per rank
    forward_step, backward_step = compute / 3.5 / world, compute * 2.5 / 3.5 / world
    share = 2 * (seqlen / world) * m.kv_heads * m.head_dim * 2  # K and V, bf16
    sends_forward = m.transfer_ms(share)
    sends_backward = m.transfer_ms(3 * share)  # with the float32 dK/dV accumulators
    steps = world - 1  # steps with a transfer under them; the last computes alone
    return (
        steps * max(forward_step, sends_forward)
        + forward_step
        + steps * max(backward_step, sends_backward)
        + backward_step
    )


def head_parallel_ms(m: Model, seqlen: int, world: int) -> float:
    """Step time of all-to-all over heads on ``world`` GPUs (module docstring)."""
    if world == 1:
        return one_gpu_ms(m, seqlen)
    compute = one_gpu_ms(m, seqlen) / world
    kv = max(m.kv_heads, world)  # (fewer K/V heads than ranks: repeated up to one per rank)
    per_token = m.head_dim * 2 * (world - 1) / world / world  # bytes of one head of one token sent, per rank
    forward = seqlen * per_token * (2 * m.heads + 2 * kv)  # q and out, k and v
    backward = seqlen * per_token * (2 * m.heads + 2 * kv)  # dout and dq, dk and dv
    # (four all-to-alls each way: their bytes at the link's rate, and a latency each)
    return compute + sum(m.transfer_ms(b) + 3 * m.latency_us * 1e-3 for b in (forward, backward))


def _tokens(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tflops", type=float, required=True, help="one GPU's forward+backward TFLOP/s")
    ap.add_argument("--link-gbs", type=float, default=450.0, help="GB/s per GPU and direction (NVLink: 450)")
    ap.add_argument("--latency-us", type=float, default=20.0)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--seqlens", default="128k,256k,512k,1M")
    args = ap.parse_args(argv)
    m = Model(args.tflops, args.link_gbs, args.latency_us, args.heads, args.kv_heads, args.head_dim)
    worlds = [int(w) for w in args.worlds.split(",")]
    widths = (8, 3, 11, 9, 7, 9, 8)
    head = ("seqlen", "W", "one GPU ms", "ring ms", "ring x", "heads ms", "heads x")
    print(" ".join(f"{h:>{width}}" for h, width in zip(head, widths, strict=True)))
    for n in (_tokens(s) for s in args.seqlens.split(",")):
        one = one_gpu_ms(m, n)
        for world in worlds:
            ring, heads = ring_ms(m, n, world), head_parallel_ms(m, n, world)
            ratios = (f"{ring:.1f}", f"{one / ring:.2f}", f"{heads:.1f}", f"{one / heads:.2f}")
            cells = (n, world, f"{one:.1f}", *ratios)
            print(" ".join(f"{c:>{width}}" for c, width in zip(cells, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
