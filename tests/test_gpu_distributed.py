"""Ring attention (and head-parallel attention, on a few of the cases) on 2 GPUs (NCCL, one process per
GPU; skipped with fewer): the kernels' ring result against
single-GPU flash_attention.attention on the same inputs, both measured against float64 attention on the
whole sequence with the accuracy rule (the ring's error at most twice the single GPU's, plus slack):
output, LSE and gradients; causal in the zigzag layout, non-causal, sliding windows on contiguous shares,
soft-capping and sinks, GQA, head_dim 64 to 256, bf16 and fp16."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import spawn_ranks

import flash_attention
from flash_attention.fallback.reference import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ring attention on GPUs needs 2 of them"),
]

# (causal, window, heads_q, heads_kv, head_dim, dtype, seqlen, softcap, sinks)
CASES = [
    (True, None, 16, 4, 128, "bf16", 2048, 0.0, False),
    (False, None, 8, 8, 256, "bf16", 1024, 0.0, False),
    (True, None, 8, 2, 64, "fp16", 1536, 0.0, False),
    (True, (300, 0), 8, 2, 128, "bf16", 2048, 0.0, False),  # one share back; rank 0's later share empty
    (False, (-1, 0), 8, 4, 128, "bf16", 4096, 0.0, False),  # causal as a window, on contiguous shares
    (False, (200, 150), 4, 4, 96, "bf16", 1024, 0.0, False),
    (True, None, 8, 2, 128, "bf16", 2048, 20.0, True),  # Gemma 2's cap, gpt-oss's sinks
    (True, (500, 0), 8, 2, 64, "bf16", 2048, 0.0, True),
]


def _worker(rank, world, init_file, case, scheme, failures):
    try:
        causal, window, hq, hkv, d, dtype_name, n, softcap, with_sinks = case
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev
        )
        from flash_attention.api.head_parallel import head_parallel_attention
        from flash_attention.api.ring import ring_attention, shard_sequence, unshard_sequence

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        torch.manual_seed(1000 + d + n)  # the same full tensors on every rank
        q = torch.randn(2, n, hq, d, device=dev, dtype=dtype)
        k, v = (torch.randn(2, n, hkv, d, device=dev, dtype=dtype) for _ in range(2))
        dout = torch.randn_like(q)
        sinks = torch.randn(hq, device=dev) if with_sinks else None
        variants = dict(window=window, softcap=softcap, sinks=sinks)
        zig = window is None and causal
        leaves = [shard_sequence(t, zigzag=zig).requires_grad_() for t in (q, k, v)]
        if scheme == "ring":
            out, lse = ring_attention(*leaves, causal=causal, return_lse=True, **variants)
        else:  # all-to-all over heads, on the same shares
            out, lse = head_parallel_attention(
                *leaves, causal=causal, zigzag=zig, return_lse=True, **variants
            )
        grads = torch.autograd.grad(out, leaves, shard_sequence(dout, zigzag=zig))
        ring = [unshard_sequence(t.detach(), zigzag=zig) for t in (out, *grads)]
        ring_lse = unshard_sequence(lse, dim=2, zigzag=zig)
        if rank == 0:
            one_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            one, one_lse = flash_attention.attention(*one_leaves, causal=causal, return_lse=True, **variants)
            one_grads = torch.autograd.grad(one, one_leaves, dout)
            ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
            ref_sinks = None if sinks is None else sinks.double()
            ref, ref_lse = attention_reference(
                *ref_leaves, causal=causal, window=window, softcap=softcap, sinks=ref_sinks
            )
            ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
            named = zip(("out", "dq", "dk", "dv"), ring, (one, *one_grads), (ref, *ref_grads), strict=True)
            for name, got, single, want in named:
                err = (got.double() - want).abs().max().item()
                err_one = (single.double() - want).abs().max().item()
                assert err <= 2 * err_one + 1e-3, f"{name}: ring {err:.3g}, one GPU {err_one:.3g}"
            err = (ring_lse.double() - ref_lse).abs().max().item()
            err_one = (one_lse.double() - ref_lse).abs().max().item()
            assert err <= 2 * err_one + 1e-4, f"lse: ring {err:.3g}, one GPU {err_one:.3g}"
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"causal{int(c[0])}-w{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-{c[5]}"
)
def test_ring_attention_on_two_gpus_equals_one_gpu(case, tmp_path):
    spawn_ranks(_worker, 2, tmp_path, case, "ring", timeout=300)


@pytest.mark.parametrize(
    "case", [CASES[i] for i in (0, 1, 3, 6)], ids=lambda c: f"causal{int(c[0])}-w{c[1]}-d{c[4]}"
)
def test_head_parallel_attention_on_two_gpus_equals_one_gpu(case, tmp_path):
    # (the same accuracy rule as the ring's: at most twice one GPU's error against float64, plus slack)
    spawn_ranks(_worker, 2, tmp_path, case, "heads", timeout=300)
