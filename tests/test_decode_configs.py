"""The decode kernel family on the CPU: configuration names and rules, the defaults of every architecture,
the split arithmetic, and the dispatch between the decode kernels and the composed path."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import flash_attention
from flash_attention.configs import SMEM_OPTIN
from flash_attention.configs.decode import (
    DECODE_HEAD_DIMS,
    DecodeConfig,
    decode_validity_errors,
    default_decode_config,
    num_splits_heuristic,
    parse_decode_config,
    split_cost,
)
from flash_attention.ops import dispatch
from flash_attention.ops.decode import splits_for
from flash_attention.spec.validate_kvcache import CacheProblem


@pytest.mark.parametrize("arch", sorted(SMEM_OPTIN))
def test_defaults_are_valid_fit_the_gpu_and_round_trip(arch):
    for dtype in ("fp16", "bf16"):
        for head_dim in (8, 64, 72, 128, 200, 256):
            for rows in (1, 4, 16, 17, 64, 512):
                cfg = default_decode_config(dtype, head_dim, rows, arch)
                assert cfg.head_dim >= head_dim and cfg.head_dim in DECODE_HEAD_DIMS
                assert cfg.smem_bytes <= SMEM_OPTIN[arch], cfg
                assert parse_decode_config(cfg.name()) == cfg
                assert decode_validity_errors(cfg) == []


def test_the_wgmma_kernel_takes_more_than_16_rows_on_hopper():
    # More than 16 rows, head_dim <= 128, sm_90 (docs/kernel-log/decode.md steps 72 and 157): the wgmma kernel
    # with a 2-deep ring that refills first (step 159), small enough for two blocks per SM; otherwise the sm80
    # kernel.
    for rows, head_dim in ((17, 128), (64, 128), (512, 128), (64, 64), (64, 72)):
        cfg = default_decode_config("bf16", head_dim, rows, "sm_90")
        shape = (cfg.block_m, cfg.block_kv, cfg.warps_m, cfg.warps_n, cfg.stages)
        assert cfg.wgmma and shape == (64, 64, 4, 1, 2)
        assert 2 * cfg.smem_bytes <= SMEM_OPTIN["sm_90"], cfg
    name = default_decode_config("bf16", 128, 64, "sm_90").name()
    assert name == "decode_bf16_d128_m64_kv64_w4x1_s2_wgmma_rf"
    for args in (
        ("bf16", 128, 16, "sm_90"),  # one token: 16 rows
        ("bf16", 256, 64, "sm_90"),  # head_dim 256
        ("bf16", 128, 64, "sm_80"),  # no wgmma on Ampere
        ("bf16", 128, 64, "sm_89"),
    ):
        assert not default_decode_config(*args).wgmma, args
    for fields, words in (
        (("bf16", 128, 16, 64, 1, 4, 3), "one warpgroup of 64 rows"),
        (("bf16", 256, 64, 64, 4, 1, 2), "head_dim 64 or 128"),
        (("bf16", 128, 64, 32, 4, 1, 2), "block_kv 64 or 128"),
    ):
        with pytest.raises(ValueError, match=words):
            DecodeConfig(*fields, wgmma=True)


@pytest.mark.parametrize(
    "fields, words",
    [
        (("bf16", 96, 16, 64, 1, 4, 3), "head_dim"),
        (("fp32", 128, 16, 64, 1, 4, 3), "dtype"),
        (("bf16", 128, 32, 128, 2, 8, 3), "at most 8 warps"),
        (("bf16", 128, 24, 64, 1, 4, 3), "block_m"),
        (("bf16", 128, 16, 48, 1, 4, 3), "block_kv"),
        (("bf16", 128, 16, 64, 1, 4, 1), "stages"),
        # 32 threads, 16 chunks per row: 24 rows per thread, not a power of two (one page lookup per run
        # of rows needs runs that cannot straddle a page).
        (("bf16", 128, 16, 48, 1, 1, 2), "power of two"),
        (("bf16", 256, 32, 64, 1, 4, 3), "registers"),
    ],
)
def test_invalid_configs_say_why(fields, words):
    with pytest.raises(ValueError, match=words):
        DecodeConfig(*fields)


def test_names_and_symbols():
    cfg = DecodeConfig("bf16", 128, 16, 64, 1, 4, 3)
    assert cfg.name() == "decode_bf16_d128_m16_kv64_w1x4_s3"
    symbols = {cfg.symbol("decode", c, p) for c in (False, True) for p in (False, True)}
    symbols |= {cfg.symbol("append", paged=p) for p in (False, True)} | {cfg.symbol("combine")}
    assert len(symbols) == 7
    with pytest.raises(ValueError):
        parse_decode_config("decode_bf16_d128")


def _problem(batch, heads_kv, group, seqlen_q, capacity):
    return CacheProblem(batch, seqlen_q, heads_kv * group, heads_kv, 128, 1, 0, capacity, 0.1, True)


def test_splits_cover_the_capacity_exactly_once():
    rng = random.Random(0)
    cfg = DecodeConfig("bf16", 128, 16, 64, 1, 4, 3)
    for _ in range(2000):
        capacity = rng.randint(0, 200_000)
        problem = _problem(rng.randint(1, 64), rng.randint(1, 16), rng.choice([1, 4, 8]), 1, capacity)
        asked = rng.choice([0, 1, 2, 3, 7, 64, 1000])
        n, per = splits_for(cfg, problem, asked, sms=132)
        assert n >= 1 and per % cfg.block_kv == 0 and per > 0
        if capacity:
            assert (n - 1) * per < capacity <= n * per, (capacity, asked, n, per)
        if asked:
            assert n <= asked


def test_heuristic_examples_measured_on_an_h100():
    # Batch 8 x 8 K/V heads, 32k keys, two blocks per SM of 132: 4 splits make one full wave of 256 blocks
    # (5 made 1.2 waves and ran at 2.05 TB/s where 3 and 7 ran at 2.6-2.7).
    assert num_splits_heuristic(64, 32768, 64, 132, blocks_per_sm=2) == 4
    # One row, 8 K/V heads, 128k keys: 33 splits, one wave of 264 blocks.
    assert num_splits_heuristic(8, 131072, 64, 132, blocks_per_sm=2) == 33
    # 512 blocks already fill the GPU about twice over: no split.
    assert num_splits_heuristic(512, 8192, 64, 132, blocks_per_sm=2) == 1
    # Contiguous caches count one block per SM (ops.decode): one row of 8 K/V heads splits 16 ways at 8k to
    # 128k keys (measured 4-8% faster than the 33 of two blocks per SM), batch 8 two ways (1.5-2.6% faster
    # than 4). docs/kernel-log.md, step 65.
    assert [num_splits_heuristic(8, n, 64, 132) for n in (8192, 32768, 131072)] == [16, 16, 16]
    assert [num_splits_heuristic(64, n, 64, 132) for n in (8192, 32768, 131072)] == [2, 2, 2]
    # A short cache: no split shorter than four tiles, and a split must save more than the combine's launch
    # and pass (COMBINE_COST). One token, 1k keys (16 tiles), 32/8 heads, measured (the constant's comment):
    # batch 1 splits 4 ways, batch 4 too, batch 8 not at all (64 blocks already read at 16.0 us per call in a
    # CUDA graph, 17.6 with 2 splits and their combine).
    assert num_splits_heuristic(8, 512, 64, 132) == 1
    assert num_splits_heuristic(8, 100, 64, 132) == 1
    assert [num_splits_heuristic(8 * b, 1024, 64, 132) for b in (1, 4, 8)] == [4, 4, 1]


def test_heuristic_minimises_its_cost_model():
    # Against a brute-force search: the count is the cheapest under split_cost (the smallest on a tie),
    # within [1, tiles // 4] and max_splits.
    rng = random.Random(1)
    for _ in range(300):
        blocks, keys = rng.randint(1, 2000), rng.randint(1, 300_000)
        sms, per_sm, most = rng.choice([46, 108, 132]), rng.randint(1, 4), rng.choice([8, 128])
        n = num_splits_heuristic(blocks, keys, 64, sms, blocks_per_sm=per_sm, max_splits=most)
        tiles = -(-keys // 64)
        allowed = range(1, max(1, min(tiles // 4, most)) + 1)
        assert n in allowed
        costs = {s: split_cost(blocks, tiles, s, sms * per_sm) for s in allowed}
        assert costs[n] == min(costs.values()) and all(costs[s] > costs[n] for s in allowed if s < n)


class _FakeBackend:
    """The launch layer's decode seam: records the calls and answers like the kernels would."""

    def __init__(self, reason):
        self.reason, self.calls = reason, []

    def cuda_unavailable_reason(self, q):
        return "the test's fake backend has no forward kernel"

    def decode_plan(
        self, problem, q, k_cache, v_cache, k, v, lengths, table, num_splits, out, return_lse, key
    ):
        if self.reason is not None:
            return self.reason
        self.calls.append((problem, num_splits, key))
        return _FakePlan(problem, return_lse)


class _FakePlan:
    def __init__(self, problem, return_lse):
        self.problem, self.return_lse = problem, return_lse

    @staticmethod
    def runnable(k_cache, v_cache):
        return True

    def __call__(self, q, k_cache, v_cache, k, v, lengths, table, out, alibi_slopes=None):
        o = torch.full_like(q, 7.0)
        p = self.problem
        return o, (torch.zeros(p.batch, p.heads_q, p.seqlen_q) if self.return_lse else None)


def _call(num_splits=0):
    q = torch.randn(2, 1, 8, 64)
    k_cache, v_cache = torch.randn(2, 32, 2, 64), torch.randn(2, 32, 2, 64)
    return flash_attention.attention_with_kvcache(
        q, k_cache, v_cache, torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64),
        cache_seqlens=torch.tensor([3, 30], dtype=torch.int32), num_splits=num_splits,
    )  # fmt: skip


def test_kernel_path_gets_the_call_when_it_can(monkeypatch):
    fake = _FakeBackend(None)
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)
    monkeypatch.setattr(dispatch, "backend", lambda: fake)
    out = _call(num_splits=5)
    assert (out == 7).all()
    ((problem, splits, key),) = fake.calls
    assert splits == 5 and problem.seqlen_new == 1 and problem.capacity == 32 and problem.group == 4
    assert key is not None  # a tensor cache_seqlens: the call's signature keys the plan


def test_composed_path_with_a_warning_when_the_kernels_cannot(monkeypatch):
    fake = _FakeBackend("a reason the test gives")
    monkeypatch.setattr(dispatch, "wants_kernel", lambda q: True)
    monkeypatch.setattr(dispatch, "backend", lambda: fake)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _call()
    assert not fake.calls and not (out == 7).all()
    assert any("a reason the test gives" in str(w.message) for w in caught)


def test_broadcast_dimensions_are_not_written_in_place():
    # An expanded out or cache (stride 0 over more than one element) would have blocks race on its bytes.
    from flash_attention.ops.decode import layout_ok

    base = torch.randn(2, 8, 4, 16)
    assert layout_ok(base)
    assert not layout_ok(torch.randn(1, 8, 4, 16).expand(2, 8, 4, 16))
    assert not layout_ok(torch.randn(2, 1, 4, 16).expand(2, 8, 4, 16))
    assert layout_ok(torch.randn(1, 8, 4, 16).expand(1, 8, 4, 16))  # one element: nothing shared


def test_rows_per_copy_thread_and_the_page_sizes_looked_up_row_by_row():
    # fa::DecodeKVLoader: a tile's rows over the threads' 16-byte chunks (head_dim / 8 per row).
    one_token = default_decode_config("bf16", 128, 4, "sm_90a")  # 64-key tiles, 128 threads
    assert one_token.rows_per_copy_thread == 8
    assert default_decode_config("bf16", 64, 4, "sm_90a").rows_per_copy_thread == 4
    assert [p for p in (1, 2, 4, 8, 16, 24, 256) if one_token.looks_up_each_row(p)] == [1, 2, 4, 24]


@pytest.mark.parametrize("wgmma", [False, True])
def test_every_decode_entry_point_waits_for_the_kernel_before_it_first(wgmma):
    """Every kernel of a decode call may be queued programmatically on Hopper, the call's first too with
    FLASH_ATTENTION_DECODE_PDL_FIRST=1 (ops.decode, kernel log 158), so each entry point's first statement
    must be the grid-dependency wait: the append reads new tokens a previous kernel wrote, the decode kernel a
    cache the append wrote, the combine the partials; a kernel that passed it could also finish before its
    predecessor and free the next ordinary launch too early (fa/grid_dependency.cuh)."""
    from flash_attention.jit.sources import decode_kernel_source

    cfg = default_decode_config("bf16", 128, 64 if wgmma else 1, "sm_90")
    assert cfg.wgmma == wgmma
    source = decode_kernel_source(cfg)
    entries = source.split('extern "C" __global__')[1:]
    assert len(entries) == 7  # decode x (causal, paged), combine, append x (paged)
    for entry in entries:
        body = entry.split("{", 1)[1].lstrip()
        assert body.startswith("fa::grid_dependency_wait();"), entry


def test_a_ring_that_refills_first_is_named_and_holds_one_page_slot_more():
    # (fa/decode_block.cuh PageRing: its page entries are requested one tile further ahead)
    for base in (
        DecodeConfig("bf16", 128, 64, 64, 4, 1, 2, wgmma=True),
        DecodeConfig("fp16", 128, 16, 64, 1, 4, 3),
        DecodeConfig("bf16", 256, 16, 32, 1, 2, 2),
    ):
        rf = base.replace(refill_first=True)
        assert rf.name() == base.name() + "_rf"
        assert parse_decode_config(rf.name()) == rf and parse_decode_config(base.name()) == base
        assert rf.page_slot_bytes == base.page_slot_bytes + base.block_kv * 4
        assert "kRefillFirst = true" in rf.cpp_struct() and "kRefillFirst = false" in base.cpp_struct()
    # (the default: the wgmma kernel refills first, the others wait first; kernel log 159)
    assert all(
        cfg.refill_first == cfg.wgmma
        for cfg in (
            default_decode_config(dt, d, rows, arch)
            for dt in ("fp16", "bf16")
            for d in (64, 128, 256)
            for rows in (1, 64)
            for arch in ("sm_80", "sm_90")
        )
    )


@pytest.mark.parametrize("wgmma", [False, True])
def test_no_decode_entry_point_touches_memory_before_its_wait_in_sass(wgmma, tmp_path):
    """The compiled form of the test above: in every decode entry point's SASS the grid-dependency wait
    (ACQBULK, griddepcontrol.wait) comes before any load, store, atomic or copy of global or shared memory, so
    a programmatically queued launch reads nothing its predecessor may still write (ptxas may not hoist a load
    above it)."""
    from flash_attention.jit import compiler
    from flash_attention.jit.sources import decode_kernel_source
    from flash_attention.tools import report

    if compiler.find_nvcc() is None or report.find_cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump")
    cfg = default_decode_config("bf16", 128, 64 if wgmma else 1, "sm_90")
    built = compiler.compile_nvcc(decode_kernel_source(cfg), "sm_90a", "decode_sass_check")
    functions = report.sass_by_function(built.cubin)
    assert len(functions) == 7, list(functions)
    # (global, shared and local loads, stores, atomics and reductions, cp.async, bulk and tensor-map copies)
    memory = {"LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LD", "ST", "LDL", "STL", "ATOM", "ATOMS", "ATOMG"}
    memory |= {"RED", "REDG", "LDGSTS", "UBLKCP", "UBLKRED"}
    for name, sass in functions.items():
        ops = [op for _, op, _ in report.instructions(sass)]
        assert "ACQBULK" in ops, f"{name}: no grid-dependency wait"
        early = [op for op in ops[: ops.index("ACQBULK")] if op in memory or op.startswith("UTMA")]
        assert not early, f"{name}: memory accessed before the wait: {early}"
