"""GPU tests of attention_with_kvcache against the float64 reference: every page size serving engines use,
ragged cache lengths (0 and full included), appends inside a page, at a page's end and across pages, GQA
groups 1/4/8, head_dim 64/128/256, fp16/bf16. The check (tests/kvcache_cases.py) poisons the output, holds
the accuracy rule row by row and compares the caches after the append with the reference's exactly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from kvcache_cases import Case, check_case, make_inputs, random_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [0, 1, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pages_dtypes_head_dims(page_size, dtype, head_dim):
    rng = random.Random(f"{page_size}-{dtype}-{head_dim}")
    for group, seqlen_q, seqlen_new in ((1, 1, 1), (4, 4, 4), (8, 16, 0), (8, 1, 17)):
        case = random_case(
            rng,
            page_size=page_size,
            head_dim=head_dim,
            group=group,
            seqlen_q=seqlen_q,
            seqlen_new=seqlen_new,
            causal=rng.random() < 0.8,
            batch=4,
            max_pages=max(2, 1024 // max(page_size, 1)) if page_size else 6,
        )
        check_case(case, dtype, "cuda")


def test_long_cache_one_token():
    # 1 query token against 32k cached keys, 32/8 heads: the decode shape of the issue, on a paged cache.
    case = Case(
        batch=2,
        seqlen_q=1,
        heads_q=32,
        heads_kv=8,
        head_dim=128,
        seqlen_new=1,
        page_size=256,
        capacity=32768,
        causal=True,
        lengths=[32767, 20000],
    )
    check_case(case, torch.bfloat16, "cuda")


@pytest.mark.parametrize("fused_combine", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 1000])
def test_explicit_split_counts(num_splits, fused_combine, monkeypatch):
    # Every split count gives the same answer within the accuracy rule; 1000 is more splits than tiles. The
    # splits are merged by the standalone combine kernel, or by the decode kernel's last split block
    # (FLASH_ATTENTION_DECODE_FUSED_COMBINE=1, read when a plan is built: the plans are dropped around).
    from flash_attention.ops import decode

    if fused_combine:
        monkeypatch.setenv("FLASH_ATTENTION_DECODE_FUSED_COMBINE", "1")
    decode._plans.clear()
    case = Case(
        batch=3,
        seqlen_q=2,
        heads_q=16,
        heads_kv=4,
        head_dim=128,
        seqlen_new=2,
        page_size=16,
        capacity=4096,
        causal=True,
        lengths=[0, 4094, 1500],
    )
    try:
        for _ in range(2):  # the second call reuses the split counters the first left at zero
            check_case(case, torch.bfloat16, "cuda", num_splits=num_splits)
    finally:
        decode._plans.clear()


@pytest.mark.parametrize("page_size", [0, 1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits, fused_combine", [(0, False), (3, False), (3, True)])
def test_many_rows_on_a_full_grid(page_size, head_dim, num_splits, fused_combine, monkeypatch):
    # 64 packed rows (16 tokens x a group of 4) on a grid of 40 x 8 row blocks, more than twice the SMs: on
    # Hopper the wgmma decode kernel (configs.decode.default_decode_config), its answers written directly or
    # as split partials (two columns per thread), merged by the combine kernel or the fused merge.
    from flash_attention.ops import decode

    if fused_combine:
        monkeypatch.setenv("FLASH_ATTENTION_DECODE_FUSED_COMBINE", "1")
    decode._plans.clear()
    rng = random.Random(f"full-grid-{page_size}-{head_dim}-{num_splits}")
    capacity = 320
    case = Case(
        batch=40, seqlen_q=16, heads_q=32, heads_kv=8, head_dim=head_dim, seqlen_new=3, page_size=page_size,
        capacity=capacity, causal=True, lengths=[rng.randint(0, capacity - 3) for _ in range(40)],
    )  # fmt: skip
    try:
        check_case(case, torch.float16 if head_dim == 64 else torch.bfloat16, "cuda", num_splits=num_splits)
        names = [kernel.name for plan in decode._plans._plans.values() for kernel, *_ in plan.launches]
        assert any("__decode" in n for n in names), names
        if torch.cuda.get_device_capability() == (9, 0):
            assert all("_wgmma" in n.split("__")[0] for n in names if "__decode" in n), names
    finally:
        decode._plans.clear()


def test_cuda_graph_replay_with_changing_lengths():
    # One captured decode step replayed with new lengths, tokens and queries written into its static
    # inputs: each replay must equal the reference of its own inputs (nothing read on the host).
    import flash_attention as fa
    from flash_attention.fallback.reference import attention_kvcache_reference

    case = Case(
        batch=4,
        seqlen_q=1,
        heads_q=32,
        heads_kv=8,
        head_dim=128,
        seqlen_new=1,
        page_size=64,
        capacity=8192,
        causal=True,
        lengths=[5, 100, 4000, 8191],
    )
    q, k_cache, v_cache, k, v, lengths, table = make_inputs(case, torch.bfloat16, "cuda")
    fa.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)
    for step in range(4):
        new_lengths = torch.tensor([step * 7, 100 + step, 8000 - step, 0], dtype=torch.int32)
        lengths.copy_(new_lengths)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        before_k, before_v = k_cache.double().cpu(), v_cache.double().cpu()
        graph.replay()
        torch.cuda.synchronize()
        ref, _, ref_k, ref_v = attention_kvcache_reference(
            q.double().cpu(),
            before_k,
            before_v,
            k.double().cpu(),
            v.double().cpu(),
            cache_seqlens=new_lengths,
            block_table=table.cpu(),
            causal=True,
        )
        assert torch.equal(k_cache.double().cpu(), ref_k) and torch.equal(v_cache.double().cpu(), ref_v)
        assert (out.double().cpu() - ref).abs().max() < 2e-2


def test_bad_lengths_and_pages_poison_their_row_and_write_nothing_outside():
    # Row 1's length leaves no room for its new token, row 2 uses a page index past the cache: both rows'
    # outputs are NaN, the other rows are right, and no page the valid rows do not append to changes.
    import flash_attention as fa
    from flash_attention.fallback.reference import attention_kvcache_reference

    case = Case(
        batch=4,
        seqlen_q=1,
        heads_q=8,
        heads_kv=2,
        head_dim=64,
        seqlen_new=1,
        page_size=16,
        capacity=256,
        causal=True,
        lengths=[10, 256, 40, 100],
    )
    case.lengths[1] = 255  # valid for make_inputs; made invalid below
    q, k_cache, v_cache, k, v, lengths, table = make_inputs(case, torch.float16, "cuda")
    lengths[1] = 256
    table[2, 1] = k_cache.shape[0] + 5
    before = k_cache.clone()
    out, lse = fa.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, return_lse=True
    )
    torch.cuda.synchronize()
    assert out[1].isnan().all() and out[2].isnan().all() and lse[1].isnan().all() and lse[2].isnan().all()
    good = [0, 3]
    ref, _, _, _ = attention_kvcache_reference(
        q[good].double().cpu(),
        before.double().cpu(),
        v_cache.double().cpu(),
        k[good].double().cpu(),
        v[good].double().cpu(),
        cache_seqlens=lengths[good].cpu(),
        block_table=table[good].cpu(),
        causal=True,
    )
    assert (out[good].double().cpu() - ref).abs().max() < 1e-2
    changed = (k_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    expected = {int(table[0, 10 // 16]), int(table[3, 100 // 16]), int(table[2, 40 // 16])}
    assert set(changed) <= expected  # row 2's position 40 is on a valid page: its token may be written


# (causal, window, softcap, alibi): windows about the diagonal on both sides and one, soft-capping alone and
# with a window (Gemma 2's sliding layers decode with both), ALiBi per head and per row and head, and
# soft-capping with ALiBi (the capped score plus the bias).
VARIANTS = [
    (True, (64, -1), 0.0, 0),
    (False, (100, 20), 0.0, 0),
    (True, None, 30.0, 0),
    (True, (200, 0), 20.0, 0),
    (True, None, 0.0, 1),
    (False, (300, 10), 0.0, 2),
    (True, None, 5.0, 2),
]


@pytest.mark.parametrize("page_size", [0, 1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_variants_on_the_decode_kernels(page_size, head_dim, variant):
    # One token, a speculative chunk of 16 with a group of 4 (64 packed rows: on Hopper the wgmma kernel)
    # and an append of 5 over one token; caches long enough that each window starts inside them.
    causal, window, softcap, alibi = variant
    rng = random.Random(f"variants-{page_size}-{head_dim}-{variant}")
    for group, seqlen_q, seqlen_new in ((1, 1, 1), (4, 16, 0), (8, 1, 5)):
        case = random_case(
            rng, page_size=page_size, head_dim=head_dim, group=group, seqlen_q=seqlen_q,
            seqlen_new=seqlen_new, causal=causal, batch=4,
            max_pages=max(2, 1024 // max(page_size, 1)) if page_size else 6,
        )  # fmt: skip
        if not page_size:
            case = dataclasses.replace(case, capacity=1000, lengths=[0, 995 - seqlen_new, 300, 640])
        case = dataclasses.replace(case, window=window, softcap=softcap, alibi=alibi)
        check_case(case, torch.bfloat16, "cuda")


@pytest.mark.parametrize("num_splits", [0, 1, 3, 1000])
@pytest.mark.parametrize("page_size", [0, 256])
def test_a_window_reads_only_its_keys(num_splits, page_size):
    # A 4k window over a 32k cache, 32/8 heads (Mistral's decoding): within the accuracy rule, and the same
    # bits when every key more than a tile before the earliest window is NaN (a kernel that read one would
    # carry 0 * NaN into the output): the splits cover the window, not the cache.
    from flash_attention import attention_with_kvcache

    case = Case(
        batch=2, seqlen_q=2, heads_q=32, heads_kv=8, head_dim=128, seqlen_new=0, page_size=page_size,
        capacity=32768, causal=True, lengths=[32768, 20000], window=(4095, -1),
    )  # fmt: skip
    check_case(case, torch.bfloat16, "cuda", num_splits=num_splits)
    q, k_cache, v_cache, _, _, lengths, table = make_inputs(case, torch.bfloat16, "cuda")
    call = dict(cache_seqlens=lengths, block_table=table, window=case.window, num_splits=num_splits)
    before = attention_with_kvcache(q, k_cache, v_cache, **call)
    for b, n in enumerate(case.lengths):
        far = torch.arange(max(0, n - case.seqlen_q - 4095 - 128), device="cuda")
        if table is None:
            k_cache[b, far], v_cache[b, far] = float("nan"), float("nan")
        else:
            pages, slots = table[b].long()[far // page_size], far % page_size
            k_cache[pages, slots], v_cache[pages, slots] = float("nan"), float("nan")
    after = attention_with_kvcache(q, k_cache, v_cache, **call)
    assert torch.equal(before, after)
