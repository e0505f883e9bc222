"""``bench --mode model`` without a GPU: its options, and a run of a small model on the CPU with a wall-clock
timer in place of CUDA events (every implementation trains the same weights on the same tokens, so their
losses agree; the rows carry what the table and the result file need)."""

from __future__ import annotations

import time

import pytest

from flash_attention.tools.bench.cli import build_parser
from flash_attention.tools.bench.model import ModelSettings, model_text, run_model
from flash_attention.tools.bench.results import OURS
from flash_attention.tools.common import Timing

pytest.importorskip("transformers")


def test_options_parse():
    args = build_parser().parse_args(
        ["--mode", "model", "--layers", "2", "--seqlens", "2k", "--batches", "2"]
    )
    assert args.mode == "model" and args.layers == 2 and args.seqlens == (2048,) and args.batches == (2,)
    assert build_parser().parse_args(["--mode", "model"]).layers == 8


def _cpu_timer(fn, n_sets=1, **_):
    times = []
    for i in range(3):
        start = time.perf_counter()
        fn(i % n_sets)
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(sorted(times)[1], min(times), len(times))


def test_small_model_steps_on_the_cpu():
    settings = ModelSettings(
        impls=(OURS, "sdpa"),
        layers=2,
        width=128,
        head_dim=32,
        heads_kv=2,
        vocab=256,
        batch=2,
        seqlen=48,
        dtype="fp32",
        rounds=2,
    )
    rows = run_model(settings, "cpu", _cpu_timer)
    assert [r["impl"] for r in rows] == [OURS, "sdpa"]
    for r in rows:
        assert r["mode"] == "model" and (r["heads"], r["kv_heads"]) == (4, 2)
        assert len(r["ms_rounds"]) == 2 and r["ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 48 / (r["ms"] * 1e-3))
    # Random weights and tokens over a vocabulary of 256: a loss near log(256) = 5.55, the same for both.
    assert 4.5 < rows[0]["loss"] < 6.5
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-4)
    text = model_text(rows)
    assert OURS in text and "sdpa" in text and "1.00x" in text
