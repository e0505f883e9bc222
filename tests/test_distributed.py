"""Ring attention (flash_attention.api.ring) on the CPU: 2 and 3 gloo processes, the PyTorch fallback
path, against single-process float64 attention on the whole sequence (output, LSE and gradients), causal in
the zigzag layout and not, with GQA; and the shard helpers' round trip."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import leave_group, spawn_ranks

import flash_attention
from flash_attention.fallback.reference import attention_reference


def _leave(dist) -> None:
    """Leave the group once every rank is done (spawn_ranks.leave_group)."""
    leave_group(dist)


def _assert_as_close_as_one_process(named) -> None:
    """Each (name, sharded result, one process's float32 result, float64 reference): the sharded result's
    error against float64 at most twice one process's, plus float32 rounding of the reference's scale. The
    head-parallel ranks run the very attention one process runs (on their heads), whose own error on the
    CPU fallback (SDPA's float32 kernel, with an ALiBi bias) reached 7e-5 in one suite run: the bar is
    relative to it, not absolute."""
    for name, got, single, want in named:
        err = (got.double() - want).abs().max().item()
        err_one = (single.double() - want).abs().max().item()
        scale = max(1.0, want.abs().max().item())
        assert err <= 2 * err_one + 1e-5 * scale, f"{name}: {err:.3g}, one process {err_one:.3g}"


def _assert_matches_float64(named) -> None:
    """Each (name, ring result, float64 reference) within float32 rounding of the reference's scale."""
    for name, got, want in named:
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), f"{name}: {err:.3g} against float64"


def _worker(rank, world, init_file, causal, softcap, head_dim_v, failures):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from flash_attention.api.ring import ring_attention, shard_sequence, unshard_sequence

        torch.manual_seed(1234)  # the same full tensors on every rank
        seqlen = 2 * world * 7
        q = torch.randn(2, seqlen, 4, 16)
        k = torch.randn(2, seqlen, 2, 16)
        v = torch.randn(2, seqlen, 2, head_dim_v)
        dout = torch.randn(2, seqlen, 4, head_dim_v)
        zig = causal
        assert torch.equal(unshard_sequence(shard_sequence(q, zigzag=zig), zigzag=zig), q)
        leaves = [shard_sequence(t, zigzag=zig).requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(*leaves, causal=causal, softcap=softcap, return_lse=True)
        grads = torch.autograd.grad(out, leaves, shard_sequence(dout, zigzag=zig))
        full = [unshard_sequence(t.detach(), zigzag=zig) for t in (out, *grads)]
        full_lse = unshard_sequence(lse, dim=2, zigzag=zig)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = attention_reference(*ref_leaves, causal=causal, softcap=softcap)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
        _assert_matches_float64(zip(("out", "dq", "dk", "dv"), full, (ref, *ref_grads), strict=True))
        torch.testing.assert_close(full_lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_ring_attention_equals_single_process_attention(world, causal, softcap, tmp_path):
    # Soft-capping (a small cap, which bends most scores) through the ring's steps, whole and halved ones.
    spawn_ranks(_worker, world, tmp_path, causal, softcap, 16)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_with_vs_own_head_dim(causal, tmp_path):
    # v's head_dim apart from q's and k's (8 against 16): the shares travel side by side in one buffer, the
    # dK/dV accumulators too, and the output has v's head_dim.
    spawn_ranks(_worker, 3, tmp_path, causal, 0.0, 8)


def test_ring_attention_needs_a_process_group_and_refuses_float64():
    from flash_attention.api.ring import ring_attention

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(q, q, q)
    with pytest.raises(TypeError, match="float64"):
        ring_attention(q.double(), q.double(), q.double())


def _training_worker(rank, world, init_file, failures):
    try:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from ring_llama import ring_step, tiny_llama

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        torch.manual_seed(3)
        ids = torch.randint(3, 256, (1, 4 * world * 6))
        model = tiny_llama()
        loss = ring_step(model, ids)
        # The same step on one process, the whole sequence, transformers' eager attention.
        ref = tiny_llama()
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        logits = ref(input_ids=ids, use_cache=False).logits
        ref_loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ) / (ids.shape[1] - 1)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            scale = q.grad.abs().max().item()
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_ring_training_example_equals_one_process(tmp_path):
    # examples/ring_llama.py's step on 2 gloo ranks: the loss and every parameter's gradient of one training
    # step equal the whole sequence's on one process.
    pytest.importorskip("transformers")
    spawn_ranks(_training_worker, 2, tmp_path, timeout=180)


def _window_worker(rank, world, init_file, causal, window, softcap, failures):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from flash_attention.api import ring as fd

        torch.manual_seed(99)
        seqlen = world * 12
        q = torch.randn(2, seqlen, 4, 16)
        k, v = torch.randn(2, seqlen, 2, 16), torch.randn(2, seqlen, 2, 16)
        dout = torch.randn_like(q)
        steps = fd._steps(rank, world, causal, window, 2, 12, "cpu")
        if causal and window[0] == 5:  # a 5-key window reaches one share back: two of the steps
            assert len(steps) == 2
        leaves = [fd.shard_sequence(t, zigzag=False).requires_grad_() for t in (q, k, v)]
        out = fd.ring_attention(*leaves, causal=causal, window=window, softcap=softcap)
        grads = torch.autograd.grad(out, leaves, fd.shard_sequence(dout, zigzag=False))
        full = [fd.unshard_sequence(t.detach(), zigzag=False) for t in (out, *grads)]
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_reference(*ref_leaves, causal=causal, window=window, softcap=softcap)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
        _assert_matches_float64(zip(("out", "dq", "dk", "dv"), full, (ref, *ref_grads), strict=True))
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize(
    ("causal", "window", "softcap"),
    [
        (True, (5, 0), 0.0),
        (True, (20, 0), 0.0),
        (False, (4, 3), 0.0),
        (True, (20, 0), 2.0),
        (False, (4, 3), 1.5),
    ],
)
def test_ring_attention_with_a_sliding_window(causal, window, softcap, tmp_path):
    # Contiguous shares over 3 ranks: a causal window runs only the steps that reach it (the rest of the
    # ring skipped), a two-sided one every step, each through per-row key runs, with soft-capping too (small
    # caps, which bend most scores); against float64.
    spawn_ranks(_window_worker, 3, tmp_path, causal, window, softcap)


def test_ring_bench_runs_on_gloo(tmp_path):
    # bench --ring's worker logic on 2 CPU processes (gloo, the fallback): rows for one GPU, the ring and
    # head-parallel attention, with the keys the README's plot reads; the numbers mean nothing here.
    from flash_attention.tools.bench.ring import RingSettings, run_ring

    s = RingSettings(
        seqlens=(64,), heads=4, kv_heads=2, head_dim=16, dtype="fp32", warmup=0, reps=1, device="cpu"
    )
    rows = run_ring(s, os.fspath(tmp_path / "init"))
    assert [r["impl"] for r in rows] == ["flash_attention", "ring_attention", "head_parallel_attention"]
    for row in rows[1:]:  # the ring and, on the same shares, all-to-all over heads
        assert row["world"] == 2 and row["ms"] > 0 and "speedup" in row and "memory_ratio" in row


def _score_worker(rank, world, init_file, causal, window, failures):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from flash_attention.api import ring as fd

        torch.manual_seed(7)
        seqlen = 2 * world * 6
        q = torch.randn(2, seqlen, 4, 16) * 3  # scores large enough for the cap to bend them
        k, v = torch.randn(2, seqlen, 2, 16), torch.randn(2, seqlen, 2, 16)
        sinks = torch.randn(4)
        dout = torch.randn_like(q)
        zig = causal and window is None
        leaves = [fd.shard_sequence(t, zigzag=zig).requires_grad_() for t in (q, k, v)]
        sink_leaf = sinks.clone().requires_grad_()
        out, lse = fd.ring_attention(
            *leaves, causal=causal, window=window, softcap=5.0, sinks=sink_leaf, return_lse=True
        )
        grads = torch.autograd.grad(out, [*leaves, sink_leaf], fd.shard_sequence(dout, zigzag=zig))
        dsinks = grads[3].clone()
        dist.all_reduce(dsinks)  # each rank's rows' share of the replicated sinks' gradient
        full = [fd.unshard_sequence(t.detach(), zigzag=zig) for t in (out, *grads[:3])]
        full_lse = fd.unshard_sequence(lse, dim=2, zigzag=zig)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
        ref, ref_lse = attention_reference(
            *ref_leaves[:3], causal=causal, window=window, softcap=5.0, sinks=ref_leaves[3]
        )
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
        _assert_matches_float64(
            zip(("out", "dq", "dk", "dv", "dsinks"), (*full, dsinks), (ref, *ref_grads), strict=True)
        )
        torch.testing.assert_close(full_lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, (7, 0))])
def test_ring_attention_with_softcap_and_sinks(causal, window, tmp_path):
    # Soft-capping in every step's kernels and the sinks joined once after the last merge, on 2 ranks
    # (zigzag causal, non-causal, a window on contiguous shares); the sinks' gradient summed over the ranks;
    # against float64 attention with both.
    spawn_ranks(_score_worker, 2, tmp_path, causal, window)


def test_ring_attention_names_bad_variant_arguments():
    from flash_attention.api.ring import ring_attention

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="softcap"):
        ring_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        ring_attention(q, q, q, sinks=torch.zeros(3))


def _head_parallel_worker(rank, world, init_file, case, failures):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from flash_attention.api.head_parallel import head_parallel_attention
        from flash_attention.api.ring import shard_sequence, unshard_sequence

        heads_q, heads_kv, causal, zigzag, extra = case
        torch.manual_seed(1234)  # the same full tensors on every rank
        seqlen = 2 * world * 5
        q = torch.randn(2, seqlen, heads_q, 16)
        k, v = torch.randn(2, seqlen, heads_kv, 16), torch.randn(2, seqlen, heads_kv, 16)
        dout = torch.randn_like(q)
        kw = {}
        if "window" in extra:
            kw["window"] = (7, 0 if causal else 3)
        if "softcap" in extra:
            kw["softcap"] = 2.0
        if "alibi" in extra:
            kw["alibi_slopes"] = torch.rand(heads_q) * 0.3
        sinks = torch.randn(heads_q, requires_grad=True) if "sinks" in extra else None
        leaves = [shard_sequence(t, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
        out, lse = head_parallel_attention(
            *leaves, causal=causal, zigzag=zigzag, sinks=sinks, return_lse=True, **kw
        )
        wrt = leaves + ([sinks] if sinks is not None else [])
        grads = torch.autograd.grad(out, wrt, shard_sequence(dout, zigzag=zigzag))
        full = [unshard_sequence(t.detach(), zigzag=zigzag) for t in (out, *grads[:3])]
        full_lse = unshard_sequence(lse.detach(), dim=2, zigzag=zigzag)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = None if sinks is None else sinks.detach().double().requires_grad_()
        ref_kw = dict(kw)
        if "alibi_slopes" in ref_kw:
            ref_kw["alibi_slopes"] = ref_kw["alibi_slopes"].double()
        ref, ref_lse = attention_reference(*ref_leaves, causal=causal, sinks=ref_sinks, **ref_kw)
        ref_wrt = ref_leaves + ([ref_sinks] if ref_sinks is not None else [])
        ref_grads = torch.autograd.grad(ref, ref_wrt, dout.double())
        # One process's float32 attention of the whole sequence, the same options (the accuracy's yardstick)
        one_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        one_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
        one, one_lse = flash_attention.attention(
            *one_leaves, causal=causal, sinks=one_sinks, return_lse=True, **kw
        )
        one_wrt = one_leaves + ([one_sinks] if one_sinks is not None else [])
        one_grads = torch.autograd.grad(one, one_wrt, dout)
        names = ("out", "dq", "dk", "dv")
        _assert_as_close_as_one_process(
            zip(names, full, (one, *one_grads[:3]), (ref, *ref_grads[:3]), strict=True)
        )
        if sinks is None:  # (with sinks the reference's LSE is the sink-free one's: not compared)
            _assert_as_close_as_one_process([("lse", full_lse, one_lse, ref_lse)])
        else:  # each rank's sinks gradient is its heads' part: summed over the ranks, the whole of it
            dsinks = grads[3].clone()
            dist.all_reduce(dsinks, group=None)
            _assert_as_close_as_one_process([("dsinks", dsinks, one_grads[3], ref_grads[3])])
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize(
    "world,case",
    [
        (2, (4, 2, True, True, ())),  # zigzag shares, causal, GQA with heads_kv a multiple of W
        (2, (4, 4, False, False, ("softcap", "alibi"))),
        (4, (8, 2, True, False, ("window", "sinks"))),  # heads_kv a divisor of W: K/V heads repeated
        (3, (6, 3, True, True, ("alibi",))),
    ],
    ids=["zigzag-causal", "softcap-alibi", "w4-window-sinks-gqa", "w3-zigzag-alibi"],
)
def test_head_parallel_attention_equals_single_process_attention(world, case, tmp_path):
    # All-to-all over heads: each rank attends whole rows of its heads, so every option of attention()
    # applies; outputs, LSE and gradients of q, k, v (and the sinks, summed over the ranks) against float64
    # attention of the whole sequence on one process.
    spawn_ranks(_head_parallel_worker, world, tmp_path, case)


def test_head_parallel_attention_checks_its_heads_and_group():
    from flash_attention.api.head_parallel import head_parallel_attention

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="process group"):
        head_parallel_attention(q, q, q)


def _hybrid_worker(rank, world, init_file, causal, window, failures):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from flash_attention.api.head_parallel import head_parallel_attention
        from flash_attention.api.ring import shard_sequence, unshard_sequence

        # Four ranks: heads exchanged within {0, 1} and {2, 3} (a node's GPUs), the ring over {0, 2} and
        # {1, 3}. Every rank makes every group, in the same order.
        head_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ring_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        heads, ring = head_groups[rank // 2], ring_groups[rank % 2]
        zig = causal and window is None
        torch.manual_seed(4321)
        seqlen = 2 * 2 * 2 * 5
        q = torch.randn(2, seqlen, 8, 16)
        k, v = torch.randn(2, seqlen, 2, 16), torch.randn(2, seqlen, 2, 16)
        dout = torch.randn_like(q)
        sinks = torch.randn(8, requires_grad=True)

        def shard(t):  # a ring share, cut contiguously among the head group
            return shard_sequence(shard_sequence(t, ring, zigzag=zig), heads, zigzag=False)

        def unshard(t):
            return unshard_sequence(unshard_sequence(t, heads, zigzag=False), ring, zigzag=zig)

        leaves = [shard(t).requires_grad_() for t in (q, k, v)]
        out = head_parallel_attention(
            *leaves, group=heads, ring_group=ring, causal=causal, window=window, softcap=2.0, sinks=sinks
        )
        grads = torch.autograd.grad(out, [*leaves, sinks], shard(dout))
        full = [unshard(t.detach()) for t in (out, *grads[:3])]
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().double().requires_grad_()
        ref, _ = attention_reference(*ref_leaves, causal=causal, window=window, softcap=2.0, sinks=ref_sinks)
        ref_grads = torch.autograd.grad(ref, [*ref_leaves, ref_sinks], dout.double())
        _assert_matches_float64(zip(("out", "dq", "dk", "dv"), full, (ref, *ref_grads[:3]), strict=True))
        dsinks = grads[3].clone()
        dist.all_reduce(dsinks)
        _assert_matches_float64([("dsinks", dsinks, ref_grads[3])])
        _leave(dist)
    except Exception:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.parametrize("causal,window", [(True, None), (False, (9, 4))], ids=["causal-zigzag", "window"])
def test_hybrid_of_heads_and_ring_equals_single_process_attention(causal, window, tmp_path):
    # head_parallel_attention(group=, ring_group=): 2 x 2 ranks, GQA 8/2 (one K/V head per head-group rank),
    # soft-capping and sinks, against float64 attention of the whole sequence.
    spawn_ranks(_hybrid_worker, 4, tmp_path, causal, window)
