"""tools/kernel_times.py on the CPU: shape triples are parsed or refused naming the argument, kernel records
are summed per name and divided by the calls, and without a GPU it says so and exits 2."""

from __future__ import annotations

import random

import pytest
import torch
from repo_tools import load_tool

kernel_times = load_tool("kernel_times")


def test_shapes_are_triples():
    assert kernel_times.parse_shapes("4,4096,16,1,16384,16") == [(4, 4096, 16), (1, 16384, 16)]
    for bad in ("4,4096", "4,0,16", "a,b,c", "4,4096,16,2", ""):
        with pytest.raises(ValueError, match="--shapes"):
            kernel_times.parse_shapes(bad)


def test_records_grouped_per_call_longest_first():
    rng = random.Random(7)
    names = ["dkdv", "convert", "prep"]
    calls = rng.randint(3, 9)
    records, want = [], dict.fromkeys(names, 0.0)
    for _ in range(calls):
        for name in names:
            us = rng.uniform(1.0, 500.0)
            records.append((name, us))
            want[name] += us
    rng.shuffle(records)
    got = kernel_times.group_kernel_times(records, calls)
    assert [n for n, _ in got] == sorted(names, key=lambda n: -want[n])
    for name, us in got:
        assert us == pytest.approx(want[name] / calls)
    with pytest.raises(ValueError, match="calls"):
        kernel_times.group_kernel_times(records, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_a_gpu_it_says_so(capsys):
    assert kernel_times.main(["--impls", "flash_attention", "--shapes", "1,128,2", "--head-dim", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_timeline_medians_per_position():
    rng = random.Random(11)
    calls = 5
    layout = [("pre", 0.0, 70.0), ("dkdv", 40.0, 1240.0), ("convert", 1100.0, 1290.0)]
    events = []
    for c in range(calls):
        base = 10_000.0 * c + rng.uniform(0, 50)
        jitter = [rng.uniform(-3, 3) for _ in layout]
        events += [(n, base + a + j, base + b + j) for (n, a, b), j in zip(layout, jitter, strict=True)]
        events[-3] = ("pre", base, base + 70.0)  # the call's first kernel starts the call
    rng.shuffle(events)
    got = kernel_times.call_timeline(events, calls)
    assert [n for n, _, _ in got] == ["pre", "dkdv", "convert"]
    for (name, a, b), (_, ga, gb) in zip(layout, got, strict=True):
        assert abs(ga - a) <= 3 and abs(gb - b) <= 3, name
    with pytest.raises(ValueError, match="divide"):
        kernel_times.call_timeline(events[:-1], calls)
    swapped = [("other" if (n == "dkdv" and a < 10_000) else n, a, b) for n, a, b in events]
    with pytest.raises(ValueError, match="different kernels"):
        kernel_times.call_timeline(swapped, calls)


def test_points_are_every_shape_at_each_causal_setting():
    import argparse

    ap = argparse.ArgumentParser()
    kernel_times.add_point_arguments(ap)
    args = ap.parse_args(["--shapes", "4,4096,16,1,16384,16"])
    assert kernel_times.points_of(args) == [
        (4, 4096, 16, False),
        (4, 4096, 16, True),
        (1, 16384, 16, False),
        (1, 16384, 16, True),
    ]
    args = ap.parse_args(["--shapes", "2,512,8", "--causal", "yes"])
    assert kernel_times.points_of(args) == [(2, 512, 8, True)]
