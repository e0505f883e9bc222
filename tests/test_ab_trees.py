"""tools/ab_trees.py's parts that need no GPU: the cases it takes, its table, the trees it refuses, and its
child script run on the CPU."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ab_trees  # noqa: E402


def _run_child(monkeypatch, args: list[str], elapsed_ms: float) -> None:
    """The child script on the CPU with ``args`` after its tree (mode, shape, reps, cases, packed): its
    tensors moved there, and CUDA events stubbed to report ``elapsed_ms`` per timing."""

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return elapsed_ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    root = str(Path(ab_trees.__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "argv", ["child", root, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the child puts its tree first)
    exec(compile(ab_trees._CHILD.replace('device="cuda"', 'device="cpu"'), "child", "exec"), {})


def test_cases_are_checked():
    assert ab_trees.parse_case("30:1:128") == "30:1:128"
    assert ab_trees.parse_case("50:0:256:1024") == "50:0:256:1024"  # a sliding window of 1024
    assert ab_trees.parse_case("0:0:128:seqalibi:cross") == "0:0:128:seqalibi:cross"  # packed ALiBi options
    assert ab_trees.parse_case("0:1:64:512:alibi") == "0:1:64:512:alibi"
    assert ab_trees.parse_case("0:1:192:v128") == "0:1:192:v128"  # v's own head_dim
    assert ab_trees.parse_case("0:0:128:drop10") == "0:0:128:drop10"  # dropout 0.1
    for bad in (
        "30:2:128",
        "30:1",
        "x:0:64",
        "0:0:d64",
        "0:0:64:w",
        "0:0:64:8:8",
        "0:0:64:alibi2",
        "0:0:192:v",
        "0:0:192:v64:v32",
        "0:0:128:drop0",
        "0:0:128:drop100",
        "0:0:128:drop10:drop20",
    ):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            ab_trees.parse_case(bad)


def test_the_table_gives_each_trees_median_spread_and_ratio_to_the_first():
    rounds = [
        {"a": {"c": 2.0}, "b": {"c": 1.0}},
        {"a": {"c": 4.0}, "b": {"c": 3.0}},
        {"a": {"c": 3.0}, "b": {"c": 1.5}},
    ]
    head, row = ab_trees.summarize(["a", "b"], ["c"], rounds)
    assert head.split() == ["case", "a", "b"]
    cells = row.split()
    # a: median 3 (2-4), 1x; b: median 1.5 (1-3), 0.5x
    assert cells == ["c", "3.000", "(2.000-4.000)", "1.000x", "1.500", "(1.000-3.000)", "0.500x"]


def test_a_tree_without_the_package_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_trees.main([str(tmp_path)])
    assert "holds no flash_attention package" in capsys.readouterr().err


def test_zero_rounds_is_the_warm_up_alone(monkeypatch, capsys):
    """--rounds 0 (compiling trees ahead of a timed run, several at once): each tree's warm-up process runs
    once and nothing is timed or tabled (it used to fail taking the median of no rounds)."""
    root = str(Path(ab_trees.__file__).resolve().parents[1])
    calls = []

    def run_tree(tree, mode, shape, reps, cases, packed=0):
        calls.append((tree, reps))
        return {"0:0:64": 1.0}

    monkeypatch.setattr(ab_trees, "run_tree", run_tree)
    assert ab_trees.main([root, root, "--rounds", "0", "--cases", "0:0:64"]) == 0
    assert calls == [(root, 3), (root, 3)]  # the warm-up's reps, once per tree
    out = capsys.readouterr().out
    assert "nothing timed" in out and "ratio to" not in out
    with pytest.raises(SystemExit):
        ab_trees.main([root, "--rounds", "-1"])
    with pytest.raises(SystemExit):  # (nothing timed: no file to write)
        ab_trees.main([root, "--rounds", "0", "--json", "x.json"])


def test_a_run_cut_short_keeps_the_rounds_it_timed(monkeypatch, tmp_path):
    """--json is written after every timed round: a run that its time limit kills in round 3 of 5 leaves
    rounds 1 and 2 (with rounds_planned 5), where the file used to be written only at the end."""
    root = str(Path(ab_trees.__file__).resolve().parents[1])
    out = tmp_path / "ab.json"
    timed = []

    def run_tree(tree, mode, shape, reps, cases, packed=0):
        if reps != 3:  # (a timed call, not the warm-up's)
            timed.append(tree)
            if len(timed) == 5:  # round 3's first tree: the time limit
                raise KeyboardInterrupt
        return {"0:0:64": float(len(timed))}

    monkeypatch.setattr(ab_trees, "run_tree", run_tree)
    with pytest.raises(KeyboardInterrupt):
        ab_trees.main([root, root, "--rounds", "5", "--cases", "0:0:64", "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["rounds_planned"] == 5
    assert got["rounds"] == [{root: {"0:0:64": 2.0}}, {root: {"0:0:64": 4.0}}]  # (same tree twice: one key)


@pytest.mark.parametrize("mode,packed", [("fwd_bwd", "0"), ("fwd", "9000")])
def test_the_child_times_every_case_dense_and_packed(mode, packed, monkeypatch, capsys):
    """The child script itself, on the CPU (its tensors moved there, CUDA events stubbed; the package's
    PyTorch fallback computes): one JSON line per case, a window and soft-capping included, dense and
    packed (attention_varlen over its drawn documents; the forward only, to keep the CPU time short)."""

    cases = "30:1:64,0:0:64:100,0:1:64:v32,0:1:64:drop10"
    _run_child(monkeypatch, [mode, "1,256,2", "1", cases, packed], elapsed_ms=1.0)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["case"] for x in lines] == cases.split(",")


def test_decode_cases_are_checked_and_the_child_times_them(monkeypatch, capsys):
    # --mode decode: batch:keys:seqlen_q, each attention_with_kvcache against a full cache; on the CPU
    # (the fallback computes, CUDA events stubbed), one JSON line per case with the time per call.
    assert ab_trees.parse_decode_case("8:32768:1") == "8:32768:1"
    for bad in ("8:32768", "8:0:1", "a:1:1", "1:2:3:4"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab_trees.parse_decode_case(bad)

    _run_child(monkeypatch, ["decode", "1,1,1", "4", "1:64:1,2:64:4", "0"], elapsed_ms=50.0)  # 50 calls
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines == [{"case": "1:64:1", "ms": 1.0}, {"case": "2:64:4", "ms": 1.0}]


def test_each_tree_takes_every_place_in_a_round_in_turn():
    trees = ["a", "b", "c"]
    orders = [ab_trees.round_order(trees, i) for i in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    for place in range(3):  # over any three rounds, each tree once in each place
        assert sorted(order[place] for order in orders[:3]) == trees
    assert [ab_trees.round_order(["x", "y"], i) for i in range(3)] == [["x", "y"], ["y", "x"], ["x", "y"]]
