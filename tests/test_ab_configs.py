"""tools/ab_configs.py's parts that need no GPU: the grid's points, the configs a point times (the pick first,
the standing candidates valid), the per-round summary, and that the rows it writes are what the committed
runs hold (tests/test_autotune.py reads those)."""

from __future__ import annotations

import json

import pytest
from repo_tools import ROOT, load_tool

from flash_attention.configs import default_config, validity_errors

ab = load_tool("ab_configs")


def test_seqlens_and_grid_points():
    assert [ab.parse_seqlen(x) for x in ("512", "1k", " 16K ")] == [512, 1024, 16384]
    assert ab.grid_point(4096, 128) == (4, 16)
    assert ab.grid_point(1024, 64) == (16, 32)
    with pytest.raises(ValueError, match="no point"):
        ab.grid_point(3000, 128)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_point_times_the_pick_first_and_valid_candidates(d, causal):
    extra = "(BF16, 128, 128, 64, 12): wgmma+ws+overlap+stages_2" if d == 128 else None
    configs = ab.point_configs(d, 2048, causal, [extra] if extra else [])
    labels = list(configs)
    assert labels[0] == "pick" and configs["pick"] == default_config("bf16", d, causal, 2048, 2048, "sm_90")
    assert set(ab.CANDIDATES[d]) <= set(labels)
    for cfg in configs.values():
        assert cfg.head_dim == d and cfg.wgmma and not validity_errors(cfg)
    if extra:
        assert configs[extra].name() == extra


def test_summary_is_paired_per_round():
    # The candidate is slower in the first round and faster in the other two: its median ratio is the
    # median of its three per-round ratios, not the ratio of the medians.
    samples = [{"pick": 1.0, "a": 1.2}, {"pick": 2.0, "a": 1.8}, {"pick": 1.0, "a": 0.95}]
    s = ab.summarize(samples, ["pick", "a"])
    assert s["ratio"]["pick"] == 1.0 and s["faster"]["pick"] == 0
    assert s["ratio"]["a"] == pytest.approx(0.95) and s["faster"]["a"] == 2
    assert s["ms"]["a"] == pytest.approx(1.2)


def test_the_committed_runs_hold_the_rows_this_tool_writes():
    keys = {"d", "n", "causal", "pick", "ms", "ratio", "faster", "configs"}
    for d in (64, 128):
        path = ROOT / "benchmarks" / "results" / "ab" / f"h200-2026-11-30-fwd-picks-d{d}-9af4672.json"
        report = json.loads(path.read_text())
        for row in report["rows"]:
            assert set(row) == keys and row["d"] == d
            assert set(row["ms"]) == set(row["ratio"]) == set(row["faster"]) == set(row["configs"])
            assert row["configs"]["pick"] == row["pick"] and row["ratio"]["pick"] == 1.0
