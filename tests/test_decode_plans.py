"""The decode launch layer (:class:`flash_attention.ops.decode.DecodePlan`) on the CPU, through the stand-in
GPU of tests/stand_in_gpu.py: ``attention_with_kvcache`` builds its real plan (config, split count, params,
the partials' workspace, the append/decode/combine launches) and the stand-in kernels compute from the
addresses and strides in the params. The check is the GPU tests' (tests/kvcache_cases.py: the float64
reference, poisoned output, the caches after the append); the kernels themselves are the GPU tests' job.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from kvcache_cases import Case, check_case, make_inputs, random_case
from stand_in_gpu import repeat_mode_gpu  # noqa: F401 (the gpu fixture)

from flash_attention import attention_with_kvcache, ops
from flash_attention.configs.decode import num_splits_heuristic
from flash_attention.fallback.reference import attention_kvcache_reference
from flash_attention.ops import decode, dispatch, repeat
from flash_attention.spec import score_functions


def _natively_launched() -> bool:
    """Whether every decode plan made so far ran its calls through the host library."""
    made = list(decode._plans._plans.values())
    return bool(made) and all(plan._native for plan in made)


@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
def test_plans_append_and_attend_as_the_reference(gpu, page_size):
    rng = random.Random(f"decode-plan-{page_size}")
    for group, seqlen_q, seqlen_new in ((1, 1, 1), (4, 4, 4), (8, 3, 0)):
        case = random_case(
            rng,
            page_size=page_size,
            head_dim=64,
            group=group,
            seqlen_q=seqlen_q,
            seqlen_new=seqlen_new,
            causal=rng.random() < 0.7,
            batch=3,
            max_pages=4 if page_size else 6,
        )
        gpu.launches.clear()
        check_case(case, torch.bfloat16, "cpu")
        assert "decode_decode" in gpu.launches, gpu.launches  # the decode plan ran, not the composed path
        assert ("decode_append" in gpu.launches) == bool(seqlen_new)
        assert not gpu.errors, gpu.errors
    # (check_case passes a caller's out, which stays in Python; the host library's calls are below.)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_partials_merge_to_the_reference(gpu, num_splits, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_PDL", "1")  # (the launches' form is checked below)
    case = Case(
        batch=2, seqlen_q=2, heads_q=8, heads_kv=2, head_dim=64, seqlen_new=2, page_size=16, capacity=320,
        causal=True, lengths=[0, 250],
    )  # fmt: skip
    gpu.launches.clear()
    gpu.programmatic.clear()
    check_case(case, torch.bfloat16, "cpu", num_splits=num_splits)
    assert ("decode_combine" in gpu.launches) == (num_splits > 1)
    # On the (sm_90) stand-in every launch of the call is queued programmatically, the first one too (each
    # waits for the kernel before it: fa/grid_dependency.cuh); FLASH_ATTENTION_DECODE_PDL_FIRST=0 (kernel
    # log 158) makes the first an ordinary launch.
    queued = [("decode_append", True), ("decode_decode", True)]
    queued += [("decode_combine", True)] * (num_splits > 1)
    assert gpu.programmatic == queued, gpu.programmatic
    monkeypatch.setenv("FLASH_ATTENTION_DECODE_PDL_FIRST", "0")
    ops.clear_plans()
    gpu.programmatic.clear()
    check_case(case, torch.bfloat16, "cpu", num_splits=num_splits)
    assert gpu.programmatic == [("decode_append", False)] + queued[1:], gpu.programmatic


def test_an_int_length_and_a_repeated_signature(gpu):
    case = Case(
        batch=3, seqlen_q=1, heads_q=4, heads_kv=4, head_dim=64, seqlen_new=1, page_size=0, capacity=90,
        causal=True, lengths=[40, 40, 40],
    )  # fmt: skip
    for _ in range(3):  # the second and third calls reuse the plan made by the first
        check_case(case, torch.bfloat16, "cpu", use_int_seqlens=True)
    assert gpu.launches.count("decode_decode") == 3


def test_a_misaligned_output_of_a_planned_layout_gets_a_buffer_of_its_own(gpu):
    # The plan was made for a caller's buffer in (batch, heads, seqlen, head_dim) order; a later call of the
    # same signature brings that layout at an address the kernels cannot write (2 bytes off): the output goes
    # to a contiguous buffer with its own strides, then into the caller's.
    torch.manual_seed(5)
    b, s, hq, hkv, d, cap = 2, 3, 4, 2, 64, 40
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, cap, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([7, 30], dtype=torch.int32)
    ref = attention_kvcache_reference(
        q.double(), k_cache.double(), v_cache.double(), cache_seqlens=lengths, causal=True
    )[0]
    aligned = torch.empty(b, hq, s, d, dtype=torch.bfloat16).transpose(1, 2)
    shifted = torch.empty(b * hq * s * d + 1, dtype=torch.bfloat16)[1:].view(b, hq, s, d).transpose(1, 2)
    assert shifted.stride() == aligned.stride() and shifted.data_ptr() % 16
    for out in (aligned, shifted):
        out.fill_(float("nan"))
        got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert (got.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_calls_without_a_callers_output_launch_from_the_host_library_in_native_mode(
    gpu, page_size, num_splits
):
    rng = random.Random(f"native-{page_size}-{num_splits}")
    case = random_case(
        rng, page_size=page_size, head_dim=64, group=4, seqlen_q=2, seqlen_new=2, causal=True, batch=3,
        max_pages=5,
    )  # fmt: skip
    q, k_cache, v_cache, k, v, lengths, table = make_inputs(case, torch.bfloat16, "cpu")
    ref_out, ref_lse, ref_kc, ref_vc = attention_kvcache_reference(
        q.double(), k_cache.double(), v_cache.double(), k.double(), v.double(), cache_seqlens=lengths,
        block_table=table, causal=True,
    )  # fmt: skip
    out, lse = attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, num_splits=num_splits,
        return_lse=True,
    )  # fmt: skip
    assert not gpu.errors, gpu.errors
    assert _natively_launched() == (repeat.MODE == "native")
    assert torch.equal(k_cache.double(), ref_kc) and torch.equal(v_cache.double(), ref_vc)
    assert (out.double() - ref_out).abs().max().item() < 2e-2
    seen = ~torch.isneginf(ref_lse)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], atol=2e-2, rtol=0)


@pytest.mark.parametrize("lengths_as", ["int", "tensor"])
def test_a_growing_cache_keeps_a_plan_per_bucket_and_attends_its_whole_length(gpu, lengths_as):
    # transformers' DynamicCache: a new (batch, heads, seqlen, head_dim) tensor one position longer each step,
    # read as (batch, seqlen, heads, head_dim). One plan per capacity bucket (configs.decode.
    # cache_length_bucket: 45-48 and 49-52 here), each call with its own capacity and strides, and an int
    # length passed to the kernels by value (no lengths buffer).
    torch.manual_seed(11)
    b, hq, hkv, d = 2, 8, 2, 64
    made = []
    for capacity in range(45, 53):
        q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
        k_cache, v_cache = (
            torch.randn(b, hkv, capacity, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2)
        )
        lengths = capacity if lengths_as == "int" else torch.full((b,), capacity, dtype=torch.int32)
        ref = attention_kvcache_reference(
            q.double(), k_cache.double(), v_cache.double(), cache_seqlens=torch.full((b,), capacity),
            causal=True,
        )[0]  # fmt: skip
        got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=3)
        assert not gpu.errors, gpu.errors
        assert (got.double() - ref).abs().max().item() < 2e-2, capacity
        made.append(len(decode._plans._plans))
    assert made == [1] * 4 + [2] * 4
    assert _natively_launched() == (repeat.MODE == "native")
    # The plan's splits cover its bucket's top, not its first cache: made for 2049 positions (3 splits of 11
    # tiles would end at 2112), it must still attend all 2300 of a later cache of the bucket (2049-2304).
    for capacity in (2049, 2300):
        q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
        k_cache, v_cache = (torch.randn(b, capacity, hkv, d, dtype=torch.bfloat16) for _ in range(2))
        ref = attention_kvcache_reference(
            q.double(), k_cache.double(), v_cache.double(), cache_seqlens=torch.full((b,), capacity),
            causal=True,
        )[0]  # fmt: skip
        lengths = capacity if lengths_as == "int" else torch.full((b,), capacity, dtype=torch.int32)
        got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=3)
        assert (got.double() - ref).abs().max().item() < 2e-2, capacity
    assert len(decode._plans._plans) == 3


def _one_row_cache(keys: int, hkv: int, d: int, page_size: int):
    """K and V caches of one row holding ``keys`` positions: contiguous (page_size 0; table None) or in pages
    of ``page_size`` in a random order (the table)."""
    if not page_size:
        k_cache, v_cache = (torch.randn(1, keys, hkv, d, dtype=torch.bfloat16) for _ in range(2))
        return k_cache, v_cache, None
    pages = keys // page_size
    k_cache, v_cache = (torch.randn(pages, page_size, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    return k_cache, v_cache, torch.randperm(pages, dtype=torch.int32).reshape(1, pages)


@pytest.mark.parametrize("page_size", [0, 16, 2])
def test_the_split_waves_take_a_second_block_per_sm_only_for_pages_looked_up_row_by_row(gpu, page_size):
    """Contiguous caches and pages that hold a copy thread's rows split for waves of one block per SM;
    pages smaller than a thread's rows (looked up row by row) for the occupancy's blocks per SM (the
    stand-in's 2)."""
    b, hq, hkv, d, keys = 1, 8, 8, 64, 32768
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
    k_cache, v_cache, table = _one_row_cache(keys, hkv, d, page_size)
    attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=keys, block_table=table)
    assert not gpu.errors, gpu.errors
    (plan,) = decode._plans._plans.values()
    row_by_row = page_size == 2
    assert num_splits_heuristic(hkv, keys, 64, 132, blocks_per_sm=2 if row_by_row else 1) == (
        plan.template.num_splits
    )
    assert plan.template.num_splits == (32 if row_by_row else 16)


@pytest.mark.parametrize("page_size", [0, 16])
def test_the_wgmma_kernels_splits_take_two_blocks_per_sm(gpu, page_size):
    """More than 16 rows on Hopper run the wgmma kernel, whose blocks are bound by their own math: the split
    waves count two blocks per SM (the stand-in's occupancy, 2), contiguous and paged alike; the answer is
    the reference's."""
    b, sq, hq, hkv, d, keys = 1, 16, 32, 8, 128, 8192
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
    k_cache, v_cache, table = _one_row_cache(keys, hkv, d, page_size)
    got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=keys, block_table=table, causal=True)
    assert not gpu.errors, gpu.errors
    (plan,) = decode._plans._plans.values()
    assert plan.launches[0].kernel.cfg.wgmma
    assert plan.template.num_splits == num_splits_heuristic(hkv, keys, 64, 132, blocks_per_sm=2) == 32
    assert num_splits_heuristic(hkv, keys, 64, 132, blocks_per_sm=1) == 16  # (the test tells them apart)
    if table is not None:
        k_cache, v_cache = (c[table[0].long()].reshape(1, keys, hkv, d) for c in (k_cache, v_cache))
    want = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=keys, causal=True)[0]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


def test_clear_plans_forgets_the_decode_plans(gpu):
    q = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 40, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=30)
    assert decode._plans._plans
    ops.clear_plans()
    assert not decode._plans._plans


def test_repeat_calls_skip_the_plans_call_but_not_the_per_call_checks(gpu, monkeypatch):
    # A signature's later calls go from attention_with_kvcache straight to the plan's host library form
    # (native mode; Python mode has none and runs the plan's whole call); the checks a signature cannot fix
    # still run: an int length out of range, an input requiring grad.
    torch.manual_seed(3)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 70, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    whole = []
    real = decode.DecodePlan.__call__
    monkeypatch.setattr(
        decode.DecodePlan, "__call__", lambda self, *a, **kw: whole.append(1) or real(self, *a, **kw)
    )
    ref = attention_kvcache_reference(
        q.double(), k_cache.double(), v_cache.double(), cache_seqlens=torch.full((2,), 61), causal=True
    )[0]
    for _ in range(3):
        gpu.launches.clear()
        got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=61)
        assert "decode_decode" in gpu.launches
        assert (got.double() - ref).abs().max().item() < 2e-2
    assert len(whole) == (1 if repeat.MODE == "native" else 3)
    with pytest.raises(ValueError, match=r"cache_seqlens \(71\)"):
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=71)
    with pytest.raises(RuntimeError, match="no backward"):
        attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, cache_seqlens=61)


def test_a_score_function_reaches_the_decode_kernels_through_its_run_time_fields(gpu, monkeypatch):
    # Soft-capping is the registry's one function with run-time fields in the decode kernels' params: the plan
    # sets them from spec.score_functions (the stand-in kernel caps from them as the kernels do), and the
    # call matches the float64 reference with the cap.
    case = Case(
        batch=2, seqlen_q=2, heads_q=4, heads_kv=2, head_dim=64, seqlen_new=1, page_size=0, capacity=60,
        causal=True, lengths=[21, 34], softcap=1.75,
    )  # fmt: skip
    check_case(case, torch.bfloat16, "cpu")
    assert gpu.launches.count("decode_decode") == 1
    (plan,) = decode._plans._plans.values()
    fields = score_functions.decode_fields((("softcap", 1.75),))
    assert fields and all(getattr(plan.template, name) == pytest.approx(value) for name, value in fields)
    # A function without run-time fields would be dropped by the decode kernels: such a call says so and
    # takes the PyTorch path, still the reference's answer.
    entry = score_functions.SCORE_FUNCTIONS["softcap"]
    bare = dataclasses.replace(entry, decode_fields=(), decode_values=lambda value: ())
    monkeypatch.setitem(score_functions.SCORE_FUNCTIONS, "softcap", bare)
    decode.clear_plans()
    monkeypatch.setattr(dispatch, "_warned_reasons", set())  # (the warning comes once per reason)
    with pytest.warns(RuntimeWarning, match="the decode kernels have no score function 'softcap'"):
        check_case(dataclasses.replace(case, softcap=2.25), torch.bfloat16, "cpu")
    assert gpu.launches.count("decode_decode") == 1


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_the_refill_first_switch_picks_the_ring_of_the_plans_kernels(gpu, switch, monkeypatch):
    # FLASH_ATTENTION_DECODE_REFILL_FIRST=1 / =0 (a trial switch; kernel log 159) gives both kernels' plans
    # the main loop that refills before it waits / waits first; unset, the wgmma kernel's refills first and
    # the one-token kernel's waits first. The answer stays the reference's.
    if switch is None:
        monkeypatch.delenv("FLASH_ATTENTION_DECODE_REFILL_FIRST", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_DECODE_REFILL_FIRST", switch)
    ops.clear_plans()
    for seqlen_q in (1, 16):
        q = torch.randn(2, seqlen_q, 8, 128, dtype=torch.bfloat16)
        k_cache, v_cache = (torch.randn(2, 700, 2, 128, dtype=torch.bfloat16) for _ in range(2))
        got = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=650, num_splits=3)
        want = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=650)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    assert not gpu.errors, gpu.errors
    configs = [plan.launches[-2].kernel.cfg for plan in decode._plans._plans.values()]
    assert len(configs) == 2 and {c.wgmma for c in configs} == {False, True}
    assert all(c.refill_first == (c.wgmma if switch is None else switch == "1") for c in configs), configs
    ops.clear_plans()
