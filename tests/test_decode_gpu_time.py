"""tools/decode_gpu_time.py's parts that need no GPU: the points it takes, the calls each cache gets, and the
bytes its bandwidth counts."""

from __future__ import annotations

from repo_tools import load_tool

tool = load_tool("decode_gpu_time")


def test_points_and_calls():
    assert tool.parse_keys("1k,8K,100") == [1024, 8192, 100]
    assert tool.impls_at(0) == ("kvcache", "attention", "cudnn")
    assert tool.impls_at(16) == ("kvcache",)  # plain attention() and SDPA have no paged form


def test_bytes_are_k_and_v_of_every_kv_head():
    # batch 1, 32k keys, 8 K/V heads of 128 bf16 values, K and V: 128 MiB
    assert tool.cache_bytes(32768, 1) == 2 * 32768 * 8 * 128 * 2 == 128 * 2**20
    assert tool.cache_bytes(1024, 8) == 8 * tool.cache_bytes(1024, 1)


def test_calls_are_the_decode_benchs_own():
    from flash_attention.tools.bench import decode as bench

    assert set(tool.BENCH_IMPLS) == set(tool.IMPLS)
    assert tool.BENCH_IMPLS["kvcache"] == bench.OURS and tool.BENCH_IMPLS["attention"] == bench.PLAIN_CALL
    assert tool.BENCH_IMPLS["cudnn"] in bench.DECODE_IMPLS
