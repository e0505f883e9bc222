"""tools/sustained_clocks.py on the CPU: nvidia-smi's lines are read or refused, the samples of a timed window
give its medians, and without a GPU it says so and exits 2."""

from __future__ import annotations

import random

import pytest
import torch
from repo_tools import load_tool

sustained = load_tool("sustained_clocks")


def test_smi_lines():
    assert sustained.parse_smi_line("1980, 512.34\n") == (1980.0, 512.34)
    assert sustained.parse_smi_line(" 1755 , 690.1") == (1755.0, 690.1)
    for bad in ("[N/A], 512.3", "1980", "1980, 512, 3", "", "clocks.sm, power.draw"):
        assert sustained.parse_smi_line(bad) is None, bad


def test_window_medians_take_only_the_window():
    rng = random.Random(5)
    inside = [(10.0 + 0.05 * i, rng.uniform(1700, 1800), rng.uniform(600, 700)) for i in range(21)]
    outside = [(9.0, 345.0, 80.0), (20.0, 1980.0, 100.0), (9.99, 1.0, 1.0)]
    samples = sorted(inside + outside)
    mhz, watts, n = sustained.window_medians(samples, 10.0, 11.0)
    assert n == 21
    assert mhz == sorted(m for _, m, _ in inside)[10]
    assert watts == sorted(w for _, _, w in inside)[10]
    assert sustained.window_medians(samples, 30.0, 31.0) == (None, None, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_a_gpu_it_says_so(capsys):
    assert sustained.main(["--impls", "flash_attention", "--shapes", "1,128,2", "--head-dim", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_window_must_have_time_and_a_round():
    for bad in (["--seconds", "0"], ["--rounds", "0"]):
        with pytest.raises(ValueError, match="--seconds"):
            sustained.main(bad)
