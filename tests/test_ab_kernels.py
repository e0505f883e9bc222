"""tools/ab_kernels.py's parts that need no GPU: a tree's selection points the compiles, the sources digest,
the loader's table and the launch plans at that tree and puts them back after; the round orders and the
paired summary; the cases it takes and what it refuses."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import OrderedDict

import pytest
from repo_tools import ROOT, load_tool

from flash_attention.configs.fp8_cast import Fp8CastConfig
from flash_attention.jit import cache, compiler, loader
from flash_attention.ops import backward, forward

ab = load_tool("ab_kernels")
CSRC = ROOT / "flash_attention" / "csrc"


@pytest.fixture
def tree_b(tmp_path, monkeypatch):
    """A copy of csrc/ whose FP8 cast header fails to compile with a message of its own, and a disk cache
    of the test's own."""
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    header = copy / "include" / "fa" / "fp8_cast.cuh"
    header.write_text('#error "this is tree B"\n' + header.read_text())
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path / "cache"))
    return copy


def test_a_selected_tree_compiles_from_its_own_sources(tree_b):
    if compiler.load_nvrtc() is None:
        pytest.skip("NVRTC is not installed")
    cfg = Fp8CastConfig()
    digest = cache.sources_digest()
    with ab.kernel_sources(tree_b, ab.KernelTables()):
        assert cache.sources_digest() != digest
        with pytest.raises(compiler.CompileError, match="this is tree B"):
            cache.build(cfg, "sm_90", "nvrtc")
    assert cache.sources_digest() == digest and compiler.CSRC == CSRC.resolve()
    assert cache.build(cfg, "sm_90", "nvrtc").cubin  # (this checkout's sources again)


def test_the_tables_are_the_trees_and_come_back_after_an_error(tree_b):
    tables = ab.KernelTables()
    before = (loader._loaded, forward._plans._plans, backward._plans._plans, list(compiler.INCLUDE_DIRS))
    with pytest.raises(RuntimeError, match="inside"):
        with ab.kernel_sources(tree_b, tables):
            assert loader._loaded is tables.loaded
            assert forward._plans._plans is tables.plans[0] and backward._plans._plans is tables.plans[1]
            assert isinstance(tables.plans[0], OrderedDict)
            assert compiler.INCLUDE_DIRS == [tree_b / "include", tree_b / "kernels"]
            raise RuntimeError("inside")
    after = (loader._loaded, forward._plans._plans, backward._plans._plans, list(compiler.INCLUDE_DIRS))
    assert all(a is b for a, b in zip(before[:3], after[:3], strict=True)) and before[3] == after[3]
    # The same tables again: what the tree filled is what it finds.
    tables.loaded["k"] = "a kernel of tree B"
    with ab.kernel_sources(tree_b, tables):
        assert loader._loaded["k"] == "a kernel of tree B"
    assert "k" not in loader._loaded


def test_tuned_winners_are_read_again_for_each_tree(tree_b, monkeypatch):
    """Winner tables apply where their sources digest is the tree's: the memo of which tables apply is
    forgotten when a tree is selected and when it is left."""
    from flash_attention.ops import winners

    cleared = []
    monkeypatch.setattr(winners, "clear_memo", lambda: cleared.append(cache.sources_digest()))
    digest = cache.sources_digest()
    with ab.kernel_sources(tree_b, ab.KernelTables()):
        assert cleared == [cache.sources_digest()] and cleared[0] != digest
    assert cleared[1] == digest and len(cleared) == 2


def test_a_directory_that_is_not_csrc_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a csrc/ directory"):
        with ab.kernel_sources(tmp_path, ab.KernelTables()):
            pass


def test_round_orders_rotate_and_the_summary_pairs_rounds():
    assert ab.pair_orders(2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert ab.pair_orders(3, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    # Tree 1 is 2% faster in every round while the machine drifts by 10% between rounds: the paired ratio
    # sees the 2%, the medians of the times alone would see the drift.
    samples = [{0: 1.0 * f, 1: 0.98 * f} for f in (1.0, 1.1, 0.95, 1.05, 1.0)]
    base, other = ab.paired_summary(samples, 2)
    assert base["ratio"] == 1.0 and base["faster"] == 0
    assert other["ratio"] == pytest.approx(0.98) and other["faster"] == 5 and other["rounds"] == 5
    assert other["ratio_q1"] == pytest.approx(0.98) and other["ratio_q3"] == pytest.approx(0.98)
    assert other["ms"] == pytest.approx(0.98)


def test_cases_and_the_refusals():
    assert ab.parse_case("30:1:128") == (30.0, True, 128, {})
    assert ab.parse_case("0:0:64:det:drop10") == (
        0.0,
        False,
        64,
        {"deterministic": True, "dropout_p": 0.1, "dropout_seed": 1234},
    )
    assert ab.parse_case("30:1:128:win1024") == (30.0, True, 128, {"window": (1024, 0)})
    for bad in (
        "0:2:128",
        "0:1",
        "x:0:64",
        "0:0:d",
        "0:0:64:fast",
        "0:0:64:drop",
        "0:0:64:det:det",
        "0:1:64:win0",
        "0:1:64:win",
        "0:0:64:win512",  # (a window case is causal)
        "0:1:64:win512:win64",
    ):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            ab.parse_case(bad)
    with pytest.raises(SystemExit):
        ab.main([str(CSRC)])  # one tree: nothing to compare


def test_prewarm_runs_one_child_per_tree_and_case(tmp_path):
    trees = [tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"]
    cmds = ab.prewarm_commands(trees, ["0:0:128", "0:1:64:det"], "fwd_bwd", "4,4096,16")
    assert len(cmds) == 4
    for cmd, (tree, case) in zip(
        cmds, [(t, c) for t in trees for c in ["0:0:128", "0:1:64:det"]], strict=True
    ):
        # this tool on the tree alone (as both A and B), one round of the case, nothing written
        assert cmd[1].endswith("ab_kernels.py") and cmd[2] == cmd[3] == str(tree)
        assert cmd[cmd.index("--cases") + 1] == case and cmd[cmd.index("--pairs") + 1] == "1"
        assert cmd[cmd.index("--mode") + 1] == "fwd_bwd" and cmd[cmd.index("--shape") + 1] == "4,4096,16"
        assert "--json" not in cmd and "--prewarm" not in cmd
    # Every child runs (two at a time here), and those that fail are named with their last stderr line.
    log = tmp_path / "ran.txt"
    fake = tmp_path / "fake_tool.py"
    fake.write_text(
        "import sys\n"
        f"open({str(log)!r}, 'a').write(sys.argv[4] + '\\n')\n"
        "if 'bad' in sys.argv[4]:\n"
        "    sys.stderr.write('compiling...\\nerror: this case does not build\\n')\n"
        "    sys.exit(3)\n"
    )
    cases = ["0:0:128", "bad:1:64", "0:1:128", "0:0:64", "bad:0:64"]
    fakes = [[sys.executable, str(fake), "T", "T", "--cases", c] for c in cases]
    failures = ab.run_prewarm(fakes, jobs=2)
    assert sorted(log.read_text().split()) == sorted(cases)  # every child ran, once
    assert failures == [
        "prewarm of T --cases bad:1:64: exit 3: error: this case does not build",
        "prewarm of T --cases bad:0:64: exit 3: error: this case does not build",
    ]
