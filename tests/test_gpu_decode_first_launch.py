"""GPU tests of a decode call whose first launch is queued programmatically
(FLASH_ATTENTION_DECODE_PDL_FIRST=1, kernel log 158: off by default until these pass), after each kind of
work a caller's stream may hold just before the call: a kernel that writes the cache and the page table, a
device-to-device copy (a misaligned q's aligned copy, made by the call itself), a host-to-device copy of the
lengths, a memset (the fused combine's counters under capture), and an event join from a second stream,
eagerly and replayed from a CUDA graph. The answer must be the float64 reference of what that work wrote: a
first kernel that ran ahead of it would read the old cache, table, q or lengths. The work before the call is
large (a whole cache rewritten) so that a kernel starting early would overlap it."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention.fallback.reference import attention_kvcache_reference

pytestmark = pytest.mark.gpu

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, CAPACITY, PAGE = 2, 8, 2, 128, 8192, 16


@pytest.fixture(autouse=True)
def _first_launch_programmatic(monkeypatch):
    from flash_attention import ops

    monkeypatch.setenv("FLASH_ATTENTION_DECODE_PDL_FIRST", "1")
    ops.clear_plans()
    yield
    ops.clear_plans()


def _caches(paged: bool):
    shape = (BATCH * CAPACITY // PAGE, PAGE) if paged else (BATCH, CAPACITY)
    k_cache, v_cache = (
        torch.randn(*shape, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    table = None
    if paged:
        table = torch.randperm(BATCH * CAPACITY // PAGE, device="cuda").to(torch.int32).reshape(BATCH, -1)
    return k_cache, v_cache, table


def _check(out, q, k_cache, v_cache, lengths, table):
    want = attention_kvcache_reference(
        q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(),
        cache_seqlens=lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths,
        block_table=None if table is None else table.cpu(), causal=True,
    )[0]  # fmt: skip
    err = (out.double().cpu() - want).abs().max().item()
    assert err < 2e-2, err


def _replayed(step, before_replay, check, times: int = 3) -> None:
    """``step()`` (the work before the call, then the call, returning its output) captured in a CUDA graph
    and replayed ``times`` times, each after ``before_replay(i)`` (new inputs written in place) and followed
    by ``check(out)``."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(times):
        before_replay(i)
        graph.replay()
        torch.cuda.synchronize()
        check(out)


def _rewrite(k_cache, v_cache, table, step: int):
    """Kernels on the current stream that change every cache value and, paged, the whole table."""
    k_cache.mul_(-1.0).add_(0.25 * step)
    v_cache.mul_(-1.0).add_(-0.25 * step)
    if table is not None:
        table.copy_(torch.roll(table, shifts=step + 1, dims=1))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_after_kernels_that_rewrite_the_cache_and_the_table(paged, seqlen_q):
    k_cache, v_cache, table = _caches(paged)
    lengths = torch.tensor([CAPACITY - 3, CAPACITY // 3], dtype=torch.int32, device="cuda")
    q = torch.randn(BATCH, seqlen_q, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for step in range(3):
        _rewrite(k_cache, v_cache, table, step)
        out = fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
        _check(out, q, k_cache, v_cache, lengths, table)

    # The same in a graph: the rewrite's kernels and the call captured together, replayed.
    def step():
        _rewrite(k_cache, v_cache, table, 5)
        return fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

    _replayed(
        step,
        lambda i: q.copy_(torch.randn_like(q)),
        lambda out: _check(out, q, k_cache, v_cache, lengths, table),
    )


def test_after_the_calls_own_copy_of_a_misaligned_q():
    # q two bytes off a 16-byte boundary: the call copies it (a device-to-device copy) before its first
    # launch; a kernel writes q's values just before the call.
    k_cache, v_cache, _ = _caches(False)
    lengths = torch.tensor([CAPACITY, CAPACITY // 2], dtype=torch.int32, device="cuda")
    numel = BATCH * HEADS_Q * HEAD_DIM
    base = torch.empty(numel + 1, device="cuda", dtype=torch.bfloat16)
    q = base[1:].view(BATCH, 1, HEADS_Q, HEAD_DIM)
    assert q.data_ptr() % 16
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out = fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
        _check(out, q, k_cache, v_cache, lengths, None)
    fresh = torch.randn(BATCH, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def step():
        q.copy_(fresh)
        return fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)

    _replayed(
        step,
        lambda i: fresh.copy_(torch.randn_like(fresh)),
        lambda out: _check(out, fresh, k_cache, v_cache, lengths, None),
    )


def test_after_a_host_to_device_copy_of_the_lengths():
    k_cache, v_cache, table = _caches(True)
    q = torch.randn(BATCH, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lengths = torch.zeros(BATCH, dtype=torch.int32, device="cuda")
    for step in range(4):
        host = torch.tensor([CAPACITY - 100 * step, 17 + 900 * step], dtype=torch.int32).pin_memory()
        lengths.copy_(host, non_blocking=True)
        out = fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
        _check(out, q, k_cache, v_cache, host, table)


def test_the_fused_combine_under_capture(monkeypatch):
    # The fused merge's counters come from a memset node right before the decode kernel in the graph.
    monkeypatch.setenv("FLASH_ATTENTION_DECODE_FUSED_COMBINE", "1")
    k_cache, v_cache, table = _caches(True)
    lengths = torch.tensor([CAPACITY - 1, 4000], dtype=torch.int32, device="cuda")
    q = torch.randn(BATCH, 4, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def call():
        return fa.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, num_splits=3
        )

    _check(call(), q, k_cache, v_cache, lengths, table)

    def new_inputs(step):
        q.copy_(torch.randn_like(q))
        _rewrite(k_cache, v_cache, None, step)

    _replayed(call, new_inputs, lambda out: _check(out, q, k_cache, v_cache, lengths, table))


def test_after_an_event_join_from_a_second_stream():
    # A second stream rewrites the cache; the call's stream waits for it (an event) and then calls.
    k_cache, v_cache, table = _caches(True)
    lengths = torch.tensor([CAPACITY, CAPACITY - 777], dtype=torch.int32, device="cuda")
    q = torch.randn(BATCH, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def step(n):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _rewrite(k_cache, v_cache, table, n)
        torch.cuda.current_stream().wait_stream(side)
        return fa.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

    for n in range(3):
        _check(step(n), q, k_cache, v_cache, lengths, table)
    _replayed(
        lambda: step(7),
        lambda i: q.copy_(torch.randn_like(q)),
        lambda out: _check(out, q, k_cache, v_cache, lengths, table),
    )
