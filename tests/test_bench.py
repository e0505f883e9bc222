"""CPU tests of the benchmark's pure parts: FLOP counts, result files, README tables, and the main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_attention
from flash_attention.configs import default_config
from flash_attention.ops.winners import gpu_slug
from flash_attention.tools import bench, provenance
from flash_attention.tools.bench.cli import _int_list
from flash_attention.tools.bench.readme import README_BEGIN, README_END, readme_markers, update_readme
from flash_attention.tools.bench.results import load_results, newest_results, write_results
from flash_attention.tools.bench.sweep import DEFAULT_SEQLENS, SweepSettings, sweep_shapes
from flash_attention.tools.bench.tables import ratio_summary, results_to_markdown, results_to_text
from flash_attention.tools.bench.tiny import TINY_SHAPES
from flash_attention.tools.common import flops, input_sets_needed, record_provenance

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_forward_known_value():
    # The DESIGN.md sweep point d=128, seqlen 4096: batch 4, heads 16 -> 4 * 4 * 16 * 4096^2 * 128.
    assert flops(4, 16, 4096, 4096, 128, False) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert flops(1, 1, 1, 1, 1, False) == 4


def test_flops_causal_halves_equal_lengths():
    for n in (512, 1000, 16384):
        assert flops(2, 8, n, n, 64, True) == flops(2, 8, n, n, 64, False) / 2


def test_flops_causal_unequal_lengths_bottom_right():
    # Queries are the last 1024 of 4096 keys: the full 1024 x 3072 rectangle plus half the 1024 square.
    assert flops(1, 1, 1024, 4096, 64, True) == 4 * 64 * (1024 * 3072 + 1024 * 1024 / 2)
    # More queries than keys: the first rows see nothing, the rest form a triangle of the keys.
    assert flops(1, 1, 4096, 1024, 64, True) == 4 * 64 * (1024 * 1024 / 2)


def test_flops_modes():
    f = flops(2, 4, 512, 512, 64, True)
    assert flops(2, 4, 512, 512, 64, True, "bwd") == 2.5 * f
    assert flops(2, 4, 512, 512, 64, True, "fwd_bwd") == 3.5 * f
    with pytest.raises(ValueError, match="mode"):
        flops(2, 4, 512, 512, 64, True, "backward")


def test_gpu_slug_and_input_sets():
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("") == "unknown-gpu"
    mb = 2**20
    assert input_sets_needed(256 * mb, 50 * mb) == 1  # the sweep's sets are far larger than L2
    assert input_sets_needed(25 * mb, 50 * mb) == 4
    assert input_sets_needed(1, 50 * mb) == 8  # capped


def test_sweep_shapes_follow_the_convention():
    s = SweepSettings(
        impls=("flash_attention", "sdpa_cudnn"),
        seqlens=DEFAULT_SEQLENS,
        head_dims=(64, 128, 256),
        causal=(False, True),
    )
    shapes = sweep_shapes(s)
    assert len(shapes) == 36
    for sh in shapes:
        assert sh.batch * sh.seqlen == 16384 and sh.heads * sh.head_dim == 2048 and sh.dtype == "bf16"
    assert {(sh.head_dim, sh.causal, sh.seqlen) for sh in shapes} == {
        (d, c, n) for d in (64, 128, 256) for c in (False, True) for n in DEFAULT_SEQLENS
    }


def test_grouped_query_sweep_gives_k_and_v_their_own_heads():
    from flash_attention.tools.bench.runners import make_inputs

    s = SweepSettings(
        impls=("flash_attention",), seqlens=(1024,), head_dims=(128,), causal=(True,), width=4096, kv_heads=8
    )
    (shape,) = sweep_shapes(s)
    assert (shape.heads, shape.kv, shape.batch) == (32, 8, 16)
    small = type(shape)("bf16", 2, 4, 16, 8, True, kv_heads=2)
    ((q, k, v),) = make_inputs(small, 1, "cpu")
    assert q.shape == (2, 16, 4, 8) and k.shape == v.shape == (2, 16, 2, 8)
    assert not torch.equal(k, v)  # fresh random data for each operand
    # Without kv_heads a shape has as many K/V heads as query heads.
    assert sweep_shapes(SweepSettings(impls=(), seqlens=(512,), head_dims=(64,), causal=(False,)))[0].kv == 32


# ------------------------------------------------------------------------------------------------
# A synthetic result


def _row(impl, d, causal, n, tflops, mode="fwd", **extra):
    return {
        "impl": impl,
        "mode": mode,
        "dtype": "bf16",
        "head_dim": d,
        "causal": causal,
        "seqlen": n,
        "batch": 16384 // n,
        "heads": 2048 // d,
        "ms": 1.0,
        "tflops": tflops,
        **extra,
    }


CFG = "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"


def _result():
    rows = [
        _row("flash_attention", 128, False, 512, 300.0, config=CFG),
        _row("flash_attention", 128, False, 1024, 360.0, config=CFG),
        _row("sdpa_flash", 128, False, 512, 250.0),
        _row("sdpa_flash", 128, False, 1024, 400.0),
        _row("sdpa_cudnn", 128, False, 512, 600.0),
        _row("sdpa_cudnn", 128, False, 1024, 720.0),
        _row("flex", 128, False, 1024, 470.4),
        _row("flash_attention", 128, True, 1024, 200.0, config=CFG),
        _row("sdpa_flash", 128, True, 1024, 100.0),
        _row("sdpa_flash", 64, True, 512, 7.25),
    ]
    return {
        "gpu": "NVIDIA H200",
        "driver": "580.00",
        "cuda": "13.0",
        "torch": "2.11.0+cu130",
        "commit": "abc1234",
        "matmul_tflops": 700.4,
        "date": "2026-11-22",
        "timestamp": "2026-11-22T10:00:00+00:00",
        "rows": rows,
    }


def _table_rows(md: str) -> dict[tuple[str, str, str], list[str]]:
    out = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| d |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[tuple(cells[:3])] = cells[3:]
    return out


def test_markdown_tables_hold_the_numbers_and_ratios():
    md = results_to_markdown(_result())
    assert md.count("### fwd (TFLOP/s, bf16)") == 1
    assert "| d | causal | impl | 512 | 1k |" in md
    rows = _table_rows(md)
    assert rows[("128", "no", "flash_attention")] == ["300", "360"]
    assert rows[("128", "no", "sdpa_cudnn")] == ["600", "720"]
    assert rows[("128", "no", "flex")] == ["–", "470"]
    assert rows[("64", "yes", "sdpa_flash")] == ["7.2", "–"]  # small values keep a decimal
    assert rows[("128", "no", "flash_attention / sdpa_flash")] == ["1.20×", "0.90×"]
    assert rows[("128", "no", "flash_attention / sdpa_cudnn")] == ["0.50×", "0.50×"]
    assert rows[("128", "yes", "flash_attention / sdpa_flash")] == ["–", "2.00×"]
    # No ratio rows where ours was not measured.
    assert ("64", "yes", "flash_attention / sdpa_flash") not in rows
    # Row order: head_dim, then non-causal before causal; ours first within a block.
    keys = list(rows)
    assert keys.index(("64", "yes", "sdpa_flash")) < keys.index(("128", "no", "flash_attention"))
    assert keys.index(("128", "no", "flash_attention")) < keys.index(("128", "no", "sdpa_flash"))
    assert keys.index(("128", "no", "flex")) < keys.index(("128", "yes", "flash_attention"))
    # The summary lines and the config list.
    assert (
        "flash_attention / sdpa_flash: min 0.90× (d=128, non-causal, seqlen 1k), median 1.20×, max 2.00×"
        in md
    )
    assert "over 3 points" in md
    assert CFG in md


def test_markdown_one_table_per_mode():
    r = _result()
    r["rows"] = r["rows"] + [_row("sdpa_flash", 128, False, 512, 200.0, mode="fwd_bwd")]
    md = results_to_markdown(r)
    assert md.index("### fwd (TFLOP/s") < md.index("### fwd_bwd (TFLOP/s")
    fwd_bwd = md[md.index("### fwd_bwd") :]
    assert "| 128 | no | sdpa_flash | 200 |" in fwd_bwd


def test_ratio_summary_and_text():
    s = ratio_summary(_result()["rows"], "sdpa_flash")
    assert s["points"] == 3 and s["min"] == pytest.approx(0.9) and s["max"] == pytest.approx(2.0)
    assert s["median"] == pytest.approx(1.2) and s["worst"] == (128, False, 1024)
    assert ratio_summary(_result()["rows"], "sdpa_efficient") is None
    assert ratio_summary(_result()["rows"], "sdpa_flash", mode="fwd_bwd") is None
    text = results_to_text(_result())
    assert "flash_attention / sdpa_cudnn" in text and "|" not in text


def test_later_row_of_the_same_point_wins():
    r = _result()
    r["rows"].append(_row("sdpa_flash", 128, False, 512, 150.0))
    rows = _table_rows(results_to_markdown(r))
    assert rows[("128", "no", "sdpa_flash")] == ["150", "400"]
    assert rows[("128", "no", "flash_attention / sdpa_flash")] == ["2.00×", "0.90×"]


# ------------------------------------------------------------------------------------------------
# Files


def test_write_load_round_trip(tmp_path):
    r = _result()
    r["rows"][0]["max_diff_vs_sdpa"] = float("nan")  # JSON has no NaN: written as null
    path = write_results(r, tmp_path / "sub" / "h200-2026-11-22.json")
    loaded = load_results(path)
    assert loaded["rows"][0]["max_diff_vs_sdpa"] is None
    del r["rows"][0]["max_diff_vs_sdpa"], loaded["rows"][0]["max_diff_vs_sdpa"]
    assert loaded == r
    json.loads(path.read_text())  # strict JSON
    assert len(path.read_text().splitlines()) < 20 + len(r["rows"])  # one row per line
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_write_and_load_reject_incomplete(tmp_path):
    r = _result()
    del r["matmul_tflops"]
    with pytest.raises(ValueError, match="matmul_tflops"):
        write_results(r, tmp_path / "x.json")
    r = _result()
    del r["rows"][3]["tflops"]
    (tmp_path / "y.json").write_text(json.dumps(r))
    with pytest.raises(ValueError, match="row 3.*tflops"):
        load_results(tmp_path / "y.json")


def test_newest_results_prefers_full_sweeps(tmp_path):
    old, new, quick = _result(), _result(), _result()
    old["timestamp"] = "2026-11-20T10:00:00+00:00"
    new["timestamp"] = "2026-11-21T10:00:00+00:00"
    quick["timestamp"] = "2026-11-23T10:00:00+00:00"
    quick["settings"] = {"quick": True}
    write_results(new, tmp_path / "b.json")
    write_results(old, tmp_path / "c.json")
    write_results(quick, tmp_path / "a-quick.json")
    (tmp_path / "notes.json").write_text("[1, 2]")
    assert newest_results(tmp_path).name == "b.json"
    with pytest.raises(FileNotFoundError):
        newest_results(tmp_path / "empty")


@pytest.fixture
def any_provenance(monkeypatch):
    """README tests of the tables themselves: the synthetic results name no real commit, so the provenance
    check (tested on its own below) is switched off."""
    monkeypatch.setattr(provenance, "check_result", lambda result, repo, what: None)


README = f"""# Title

Intro text.

{README_BEGIN}
old table
| stale | numbers |
{README_END}

## After
More text with {{braces}}.
"""


def test_update_readme_replaces_only_the_marked_region(tmp_path, any_provenance):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    results = write_results(_result(), tmp_path / "benchmarks" / "results" / "h200-2026-11-22.json")
    update_readme(readme, results)
    text = readme.read_text()
    before, rest = text.split(README_BEGIN)
    block, after = rest.split(README_END)
    assert before == README.split(README_BEGIN)[0]
    assert after == README.split(README_END)[1]
    assert "stale" not in block
    assert (
        "NVIDIA H200" in block and "2.11.0+cu130" in block and "abc1234" in block and "700 TFLOP/s" in block
    )
    assert "benchmarks/results/h200-2026-11-22.json" in block
    assert "| 128 | no | flash_attention | 300 | 360 |" in block
    # Idempotent: a second run gives the same file.
    update_readme(readme, results)
    assert readme.read_text() == text


def test_update_readme_needs_markers(tmp_path, any_provenance):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    results = write_results(_result(), tmp_path / "r.json")
    with pytest.raises(ValueError, match="bench:begin"):
        update_readme(readme, results)
    assert readme.read_text() == "# no markers\n"


def test_update_readme_cli(tmp_path, any_provenance):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    results = write_results(_result(), tmp_path / "r.json")
    assert bench.main(["--update-readme", str(results), "--readme", str(readme)]) == 0
    assert "| 128 | yes | flash_attention / sdpa_flash | – | 2.00× |" in readme.read_text()


# ------------------------------------------------------------------------------------------------
# CLI without a GPU


def test_config_is_refused_in_backward_modes(capsys):
    name = default_config("bf16", 128, False, 4096, 4096).name()
    assert bench.main(["--mode", "fwd_bwd", "--config", name]) == 2
    assert "--config applies to --mode fwd only" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    for argv in (["--impls", "sdpa_flash,nope"], ["--seqlens", "512,abc"], ["--seqlens", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
    assert _int_list("512,1k,16K") == (512, 1024, 16384)


def test_fallback_bench_on_cpu_times_both_sides_of_every_point(tmp_path, monkeypatch, capsys):
    from flash_attention.tools.bench import fallback

    monkeypatch.setitem(fallback.FALLBACK_SHAPES, "cpu", ((1, 48, 2, 16), (2, 33, 4, 32)))
    out = tmp_path / "cpu.json"
    argv = ["--device", "cpu", "--reps", "2", "--min-time", "0", "--out", str(out), "--allow-dirty"]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["threads"] >= 1 and result["torch"] == torch.__version__
    rows = result["rows"]
    points = {(r["mode"], tuple(r["shape"]), r["dtype"], r["causal"]) for r in rows}
    assert len(rows) == len(points) == 2 * 2 * 2 * 2  # modes x shapes x dtypes x causal, each once
    for r in rows:
        assert r["ms"]["flash_attention"] > 0 and r["ms"]["sdpa"] > 0, r
        assert r["ratio"] == pytest.approx(r["ms"]["flash_attention"] / r["ms"]["sdpa"])
        assert min(r["reps"].values()) >= 2 * 3, r  # three alternating rounds of at least --reps calls
        if r["mode"] == "fwd":
            # Both sides computed the same attention (the bf16 tolerance: two kernels' roundings).
            assert r["max_diff_vs_sdpa"] <= (1e-5 if r["dtype"] == "fp32" else 2e-2), r
        else:
            assert r["max_diff_vs_sdpa"] is None
    text = capsys.readouterr().out
    assert "ours/sdpa time: median" in text and f"wrote {out}" in text
    # --dtype keeps one dtype; fp16 is not a CPU dtype of this bench.
    assert bench.main([*argv[:-3], "--allow-dirty", "--dtype", "bf16", "--no-save"]) == 0
    assert bench.main(["--device", "cpu", "--dtype", "fp16", "--no-save"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_fp32_bench_needs_a_gpu(capsys):
    assert bench.main(["--dtype", "fp32", "--no-save"]) == 2
    assert "on a CUDA GPU, and none is available" in capsys.readouterr().err


def _repo_status() -> str:
    """The checkout's changed and untracked files (git status), to see that a command wrote nothing there."""
    try:
        proc = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    except OSError:
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.skip("needs the checkout's git metadata")
    return proc.stdout


def test_bench_without_output_writes_only_into_the_current_directory(tmp_path, monkeypatch):
    from flash_attention.tools.bench import fallback

    monkeypatch.setitem(fallback.FALLBACK_SHAPES, "cpu", ((1, 24, 2, 16),))
    before = _repo_status()
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--dtype", "fp32", "--reps", "1", "--min-time", "0", "--allow-dirty"]
    assert bench.main(argv) == 0
    written = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == 1 and written[0].parent == Path("flash_attention_results"), written
    result = json.loads((tmp_path / written[0]).read_text())
    assert result["device"] == "cpu" and len(result["rows"]) == 2 * 2  # modes x causal
    assert _repo_status() == before
    # --output names the folder.
    assert bench.main([*argv, "--output", str(tmp_path / "chosen")]) == 0
    assert [p.name for p in (tmp_path / "chosen").iterdir()] == [written[0].name]


def test_plots_of_a_result_file_go_to_the_output_folder_not_beside_the_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    committed = write_results(_result(), tmp_path / "committed" / "h200-2026-11-22.json")
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--plot", str(committed)]) == 0
    assert [p.name for p in committed.parent.iterdir()] == [committed.name]
    plots = sorted((tmp_path / "flash_attention_results").iterdir())
    assert [p.name for p in plots] == ["h200-2026-11-22-d128.png", "h200-2026-11-22-d64.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    # Beside the file only when asked.
    assert bench.main(["--plot", str(committed), "--output", str(committed.parent)]) == 0
    assert (committed.parent / "h200-2026-11-22-d128.png").exists()


def test_bench_without_a_gpu_names_device_cpu():
    p = _run_module("bench")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs a CUDA GPU" in p.stderr and "--device cpu" in p.stderr


def _run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "flash_attention", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the main job runs without a GPU")
def test_main_job_runs_cpu_path():
    p = _run_module()
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "No CUDA GPU found" in out and "CPU (PyTorch) path" in out
    # The fallback's throughput says nothing about the kernels: no TFLOP/s on a CPU.
    assert "TFLOP/s" not in out
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("causal"))
    assert "max err" in head and "sdpa max err" in head and "ms / sdpa" in head
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("no ", "yes "))}
    assert set(rows) == {"no", "yes"}
    for _, err, sdpa_err, err_ratio, ms, sdpa_ms, ms_ratio in rows.values():
        # float32 attention against float64: a real, small error, within twice SDPA's own (the tests' rule).
        assert 0 < float(err) < 1e-5 and 0 < float(sdpa_err) < 1e-5
        assert float(err) <= 2 * float(sdpa_err) + 1e-5 and float(err_ratio) <= 2
        assert float(ms) > 0 and float(sdpa_ms) > 0 and float(ms_ratio) > 0
    assert "within the tests' accuracy rule" in out
    steps = out.split("Next steps:")[1]
    for step in ("python -m flash_attention sanity", '"Use"', "python -m flash_attention bench --device cpu"):
        assert step in steps


def test_cpu_main_job_fails_a_result_beyond_the_accuracy_rule(monkeypatch, capsys):
    from flash_attention.tools.bench import main_job

    exact = flash_attention.attention
    # An error of 1e-3 in every element: far beyond float32 attention's (about 1e-6 against float64).
    monkeypatch.setattr(flash_attention, "attention", lambda q, k, v, **kw: exact(q, k, v, **kw) + 1e-3)
    assert main_job._main_job_cpu() == 1
    out = capsys.readouterr().out
    assert out.count("FAIL: causal=") == 2 and "within the tests' accuracy rule" not in out


def test_module_help_and_unknown_command():
    p = _run_module("--help")
    assert p.returncode == 0 and "bench" in p.stdout and "build" in p.stdout
    p = _run_module("no-such-command")
    assert p.returncode == 2 and "unknown command" in p.stderr


def test_training_results_go_to_their_own_readme_region(tmp_path, any_provenance):
    readme = tmp_path / "README.md"
    readme.write_text(README + "\n<!-- bench-fwd_bwd:begin -->\nold\n<!-- bench-fwd_bwd:end -->\ntail\n")
    fwd = write_results(_result(), tmp_path / "fwd.json")
    train = _result()
    train["rows"] = [dict(r, mode="fwd_bwd") for r in train["rows"]]
    train_path = write_results(train, tmp_path / "train.json")
    assert readme_markers(train) == ("<!-- bench-fwd_bwd:begin -->", "<!-- bench-fwd_bwd:end -->")
    update_readme(readme, fwd)
    update_readme(readme, train_path)
    text = readme.read_text()
    fwd_block = text.split(README_BEGIN)[1].split(README_END)[0]
    train_block = text.split("<!-- bench-fwd_bwd:begin -->")[1].split("<!-- bench-fwd_bwd:end -->")[0]
    assert "fwd (TFLOP/s" in fwd_block and "fwd_bwd" not in fwd_block
    assert "fwd_bwd (TFLOP/s" in train_block and "old" not in train_block
    assert text.endswith("tail\n")


def test_a_training_sweep_of_one_head_dim_off_the_grid_has_its_own_region(tmp_path, any_provenance):
    # head_dim 192 (and 192 with v at 128) beside the papers' grid: their regions, not the grid's
    readme = tmp_path / "README.md"
    regions = ("fwd_bwd", "fwd_bwd-d192", "fwd_bwd-d192-dv128")
    readme.write_text(
        "".join(f"<!-- bench-{n}:begin -->\nold {n}\n<!-- bench-{n}:end -->\n" for n in regions)
    )
    d192 = _result()
    d192["rows"] = [dict(r, mode="fwd_bwd", head_dim=192) for r in d192["rows"]]
    dv = dict(d192, settings=dict(d192.get("settings") or {}, head_dim_v=128))
    grid_only = dict(d192, rows=[dict(r, head_dim=256) for r in d192["rows"]])
    assert readme_markers(d192) == ("<!-- bench-fwd_bwd-d192:begin -->", "<!-- bench-fwd_bwd-d192:end -->")
    assert readme_markers(dv)[0] == "<!-- bench-fwd_bwd-d192-dv128:begin -->"
    assert readme_markers(grid_only)[0] == "<!-- bench-fwd_bwd:begin -->"  # (a grid head_dim: the grid's)
    update_readme(readme, write_results(d192, tmp_path / "d192.json"))
    update_readme(readme, write_results(dv, tmp_path / "dv.json"))
    text = readme.read_text()
    assert "old fwd_bwd\n" in text and "old fwd_bwd-d192" not in text
    begin, end = readme_markers(dv)
    block = text.split(begin)[1].split(end)[0]
    assert "dv.json" in block and "d192.json" not in block


# ------------------------------------------------------------------------------------------------
# Provenance: a README table only from a result whose code was exactly its commit's


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def tiny_repo(tmp_path):
    """A git checkout holding a package named like ours, with one commit."""
    repo = tmp_path / "repo"
    pkg = repo / provenance.PACKAGE_DIR.name
    (pkg / "csrc").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "csrc" / "k.cuh").write_text("// kernel\n")
    (pkg / "notes.txt").write_text("not a source\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    return repo, pkg, _git(repo, "rev-parse", "--short", "HEAD")


def test_digest_at_commit_equals_the_digest_of_the_committed_files(tiny_repo):
    repo, pkg, commit = tiny_repo
    assert provenance.digest_at_commit(commit, repo) == provenance.source_digest(pkg)
    (pkg / "a.py").write_text("x = 2\n")
    assert provenance.digest_at_commit(commit, repo) != provenance.source_digest(pkg)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "notes.txt").write_text("edited, but not a source\n")
    assert provenance.digest_at_commit(commit, repo) == provenance.source_digest(pkg)


def test_check_result_accepts_only_the_code_of_the_commit(tiny_repo):
    repo, pkg, commit = tiny_repo
    good = {"commit": commit, "source_digest": provenance.source_digest(pkg)}
    provenance.check_result(good, repo, "r.json")
    with pytest.raises(provenance.ProvenanceError, match="differs from that commit"):
        provenance.check_result(dict(good, source_digest="0" * 64), repo, "r.json")
    with pytest.raises(provenance.ProvenanceError, match="differed from its commit"):
        provenance.check_result(dict(good, dirty=True), repo, "r.json")
    with pytest.raises(provenance.ProvenanceError, match="no source_digest"):
        provenance.check_result({"commit": commit}, repo, "r.json")
    with pytest.raises(provenance.ProvenanceError, match="does not know commit"):
        provenance.check_result(dict(good, commit="deadbeef"), repo, "r.json")


def test_update_readme_refuses_a_result_without_provenance(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    results = write_results(_result(), tmp_path / "r.json")  # a commit git knows nothing of, no digest
    with pytest.raises(ValueError, match="source_digest"):
        update_readme(readme, results)
    assert readme.read_text() == README
    assert bench.main(["--update-readme", str(results), "--readme", str(readme)]) == 2


def test_uncommitted_sources_are_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(provenance, "git_commit", lambda: "abc1234")
    monkeypatch.setattr(provenance, "dirty_sources", lambda: ["flash_attention/ops/forward.py"])
    with pytest.raises(SystemExit, match="uncommitted code.*ops/forward.py"):
        record_provenance()
    block = record_provenance(allow_dirty=True)
    assert block["dirty"] and block["commit"] == "abc1234-dirty" and len(block["source_digest"]) == 64
    monkeypatch.setattr(provenance, "dirty_sources", lambda: [])
    assert record_provenance() == {"commit": "abc1234", "source_digest": provenance.source_digest()}
    # A copy without git metadata (the GPU machines): the caller names the commit.
    monkeypatch.setattr(provenance, "git_commit", lambda: None)
    monkeypatch.setattr(provenance, "dirty_sources", lambda: None)
    assert record_provenance("def5678")["commit"] == "def5678"
    # A copy whose git metadata is older than its files (a GPU machine's): the named commit is recorded, the
    # stale HEAD beside it, and the files are not compared with that HEAD; the digest ties the result to the
    # named commit's code when the result is checked.
    monkeypatch.setattr(provenance, "git_commit", lambda: "0ld0000")
    monkeypatch.setattr(provenance, "dirty_sources", lambda: ["flash_attention/ops/forward.py"])
    block = record_provenance("def5678")
    assert block == {
        "commit": "def5678",
        "source_digest": provenance.source_digest(),
        "git_commit": "0ld0000",
    }
    with pytest.raises(SystemExit, match="uncommitted"):
        record_provenance("0ld0000")  # the local HEAD named: its files are compared with it


def test_this_checkout_is_its_own_provenance():
    commit, dirty = provenance.git_commit(), provenance.dirty_sources()
    if commit is None or dirty:
        pytest.skip("needs a git checkout whose package sources are committed (CI's fresh clone is)")
    assert provenance.digest_at_commit(commit, REPO) == provenance.source_digest()


# ------------------------------------------------------------------------------------------------
# --tiny


def test_tiny_rows_get_their_own_table(any_provenance, tmp_path):
    r = _result()
    r["settings"] = {"tiny": True}
    r["rows"] = []
    for s in TINY_SHAPES:
        for impl, us in (("flash_attention", 180.0), ("sdpa_cudnn", 150.0)):
            row = _row(impl, s.head_dim, s.causal, s.seqlen, 1.0, mode="fwd_bwd", tiny=True)
            r["rows"].append(dict(row, batch=s.batch, heads=s.heads, ms=us / 1e3))
    md = results_to_markdown(r)
    assert "### fwd_bwd, tiny calls" in md and "TFLOP/s, bf16)" not in md
    assert "| (1, 128, 16, 64) | no | 180.0 | 150.0 | 1.20× |" in md
    assert readme_markers(r) == ("<!-- bench-tiny-fwd_bwd:begin -->", "<!-- bench-tiny-fwd_bwd:end -->")


def test_tiny_rounds_and_repeat_forms_are_medians_in_columns(any_provenance, tmp_path):
    # bench --tiny --rounds 3 --repeat-calls off,python: each (form, baseline) has its column, each cell the
    # median of the rounds, and every form of ours gets its ratio to each baseline.
    r = _result()
    r["settings"] = {"tiny": True, "rounds": 3}
    r["rows"] = []
    s = TINY_SHAPES[0]
    times = {("off", 0): 300.0, ("off", 1): 900.0, ("off", 2): 310.0, ("python", 0): 200.0,
             ("python", 1): 210.0, ("python", 2): 600.0}  # fmt: skip
    for round_ in range(3):
        for form in ("off", "python"):
            row = _row("flash_attention", s.head_dim, s.causal, s.seqlen, 1.0, mode="fwd_bwd", tiny=True)
            r["rows"].append(
                dict(row, batch=s.batch, heads=s.heads, ms=times[form, round_] / 1e3, round=round_,
                     repeat_calls=form)
            )  # fmt: skip
        row = _row("sdpa_cudnn", s.head_dim, s.causal, s.seqlen, 1.0, mode="fwd_bwd", tiny=True)
        r["rows"].append(dict(row, batch=s.batch, heads=s.heads, ms=(200.0 + round_) / 1e3, round=round_))
    md = results_to_markdown(r)
    assert "median of 3 rounds" in md
    assert (
        "| (batch, seqlen, heads, head_dim) | causal | flash_attention (off) µs "
        "| flash_attention (python) µs | sdpa_cudnn µs "
        "| flash_attention (off) / sdpa_cudnn | flash_attention (python) / sdpa_cudnn |"
    ) in md
    assert "| (1, 128, 16, 64) | no | 310.0 | 210.0 | 201.0 | 1.54× | 1.04× |" in md


def test_tiny_rounds_and_forms_need_tiny(capsys):
    from flash_attention.tools.bench.cli import main as bench_main

    assert bench_main(["--rounds", "2", "--no-save"]) == 2
    assert "--rounds goes with --tiny, --mode decode or --mode model" in capsys.readouterr().err
    assert bench_main(["--repeat-calls", "python", "--no-save"]) == 2
    assert "--repeat-calls goes with --tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--tiny", "--repeat-calls", "python,fast"])


def test_dirty_sources_names_whole_paths(tmp_path):
    """A modified file's porcelain line starts with a space; its path must come back whole."""
    import subprocess

    from flash_attention.tools import provenance

    pkg = tmp_path / "flash_attention"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("y = 1\n")
    who = ["-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(["git", *who, *cmd], cwd=tmp_path, check=True)
    (pkg / "b.py").write_text("y = 2\n")
    assert provenance.dirty_sources(pkg) == ["flash_attention/b.py"]


def test_deterministic_impl_is_known_and_only_times_backward_modes():
    from flash_attention.tools.bench.cli import _impl_list
    from flash_attention.tools.bench.results import OURS, OURS_DETERMINISTIC
    from flash_attention.tools.bench.runners import Skip, make_inputs, make_runner

    assert _impl_list(f"{OURS},{OURS_DETERMINISTIC}") == (OURS, OURS_DETERMINISTIC)
    shape = sweep_shapes(SweepSettings(impls=(), seqlens=(512,), head_dims=(64,), causal=(True,)))[0]
    inputs = make_inputs(shape, 1, "cpu")
    with pytest.raises(Skip, match="only the backward"):
        make_runner(OURS_DETERMINISTIC, shape, inputs, "fwd")
    with pytest.raises(Skip, match="cannot run"):  # CPU tensors: the fallback is not timed under our name
        make_runner(OURS_DETERMINISTIC, shape, inputs, "fwd_bwd")


def test_fp8_impl_is_known_runs_on_our_kernels_only_and_labels_its_rows():
    from flash_attention.tools.bench.cli import _impl_list
    from flash_attention.tools.bench.results import OURS, OURS_FP8
    from flash_attention.tools.bench.runners import Skip, make_inputs, make_runner
    from flash_attention.tools.bench.sweep import _row_base

    assert _impl_list(f"{OURS},{OURS_FP8}") == (OURS, OURS_FP8)
    s = SweepSettings(impls=(), seqlens=(512,), head_dims=(128,), causal=(True,))
    shape = sweep_shapes(s)[0]
    inputs = make_inputs(shape, 1, "cpu")
    for mode in ("fwd", "fwd_bwd"):  # (fwd_bwd: attention(..., fp8=True) with its autograd)
        with pytest.raises(Skip, match="cannot run"):  # CPU tensors: the fallback is not timed under our name
            make_runner(OURS_FP8, shape, inputs, mode)
    with pytest.raises(Skip, match="--dtype bf16"):
        make_runner(
            OURS_FP8,
            sweep_shapes(
                SweepSettings(impls=(), seqlens=(512,), head_dims=(128,), causal=(True,), dtype="fp16")
            )[0],
            inputs,
            "fwd_bwd",
        )
    assert _row_base(OURS_FP8, shape, s, 0, "off")["dtype"] == "fp8_e4m3"
    assert _row_base(OURS, shape, s, 0, "off")["dtype"] == "bf16"


def test_window_sweep_counts_the_band_and_masks_the_same_keys():
    """--window: causal shapes only; FLOPs of the band; SDPA's explicit mask is attention()'s window."""
    import torch

    from flash_attention.fallback.reference import window_allowed
    from flash_attention.tools.bench.runners import Shape, _variant_args, _window_mask
    from flash_attention.tools.bench.sweep import SweepSettings, sweep_shapes
    from flash_attention.tools.common import flops

    s = SweepSettings(
        impls=("flash_attention",), seqlens=(8192,), head_dims=(128,), causal=(False, True), window=1024
    )
    shapes = sweep_shapes(s)
    assert [(x.causal, x.window) for x in shapes] == [(False, 0), (True, 1024)]
    # The band: N W - W^2 / 2 of the N^2 / 2 triangle's convention.
    assert flops(1, 1, 8192, 8192, 128, True, "fwd", 1024) == 4 * 128 * (8192 * 1024 - 1024 * 1024 / 2)
    assert flops(1, 1, 8192, 8192, 128, True, "fwd", 0) == flops(1, 1, 8192, 8192, 128, True)
    shape = Shape("bf16", 1, 1, 300, 64, True, 0, 37)
    assert (
        _variant_args(shape) == {"window": (37, 0)}
        and _variant_args(Shape("bf16", 1, 1, 300, 64, True)) == {}
    )
    causal = torch.ones(300, 300, dtype=torch.bool).tril()
    assert torch.equal(_window_mask(shape, "cpu"), window_allowed(300, 300, (37, 0)) & causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("score", ["softcap", "alibi", "both"])
def test_score_function_baselines_compute_what_attention_computes(causal, score):
    """--softcap / --alibi: FlexAttention's score_mod and SDPA's additive ALiBi mask are the float64
    reference's score functions (so the rows time the same attention), both together too (Flex's score_mod
    applies the cap, then ALiBi), and attention() gets the same arguments; SDPA refuses soft-capping (no mask
    expresses it) instead of timing plain attention."""
    from torch.nn.attention.flex_attention import flex_attention

    from flash_attention.fallback.reference import alibi_bias, attention_reference
    from flash_attention.tools.bench.runners import (
        Shape,
        Skip,
        _alibi_bias,
        _flex_score_mod,
        _variant_args,
        alibi_slopes,
        make_runner,
    )

    torch.manual_seed(7)
    capped, with_alibi = score in ("softcap", "both"), score in ("alibi", "both")
    shape = Shape("bf16", 2, 4, 96, 32, causal, score=(("softcap", 5.0),) if capped else (), alibi=with_alibi)
    args = _variant_args(shape, "cpu")
    slopes = alibi_slopes(4, "cpu")
    assert args.get("softcap") == (5.0 if capped else None)
    assert torch.equal(args["alibi_slopes"], slopes) if with_alibi else "alibi_slopes" not in args
    assert torch.allclose(slopes, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]))
    q, k, v = (torch.randn(2, 4, 96, 32, dtype=torch.float64) * 2 for _ in range(3))  # (B, H, S, D)
    out = flex_attention(q, k, v, score_mod=_flex_score_mod(shape, "cpu")).transpose(1, 2)
    if causal:  # (the bench's causal rows add FlexAttention's block mask; here the reference's mask)
        mask = torch.ones(96, 96, dtype=torch.bool).tril()
        out = flex_attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, i, j: torch.where(
                mask[i, j], _flex_score_mod(shape, "cpu")(s, b, h, i, j), -torch.inf
            ),
        ).transpose(1, 2)
    ref, _ = attention_reference(
        *(t.transpose(1, 2) for t in (q, k, v)), causal=causal, **_variant_args(shape, "cpu")
    )
    assert torch.allclose(out, ref, atol=1e-9, rtol=1e-9)
    if score == "alibi":
        assert torch.equal(
            _alibi_bias(shape, "cpu", torch.float64), alibi_bias(slopes, 1, 96, 96, torch.float64)[0]
        )
    else:
        with pytest.raises(Skip, match="SDPA has no softcap"):
            make_runner("sdpa_cudnn", shape, [(q, k, v)], "fwd")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_alibi_rows_compute_each_documents_own_alibi_attention(causal):
    """bench --varlen --alibi: ours (with one slope table, and with the same slopes per document) and
    FlexAttention's packed outputs are each document's attention with ALiBi on its own positions (the
    float64 reference per document), so their rows time the same work; SDPA is skipped with its reason
    rather than timed without ALiBi."""
    from flash_attention.fallback.reference import attention_reference
    from flash_attention.tools.bench.runners import Skip, alibi_slopes
    from flash_attention.tools.bench.varlen import VarlenSettings, _runner

    torch.manual_seed(11)
    lengths = [5, 17, 1, 12]
    s = VarlenSettings(impls=("flash_attention", "flex"), head_dim=16, heads=4, alibi=True)
    q, k, v = (torch.randn(sum(lengths), 4, 16) * 2 for _ in range(3))  # float32: compiled Flex's widest
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    expected = torch.cat(
        [
            attention_reference(
                *(t[a : a + n].unsqueeze(0).double() for t in (q, k, v)),
                causal=causal,
                alibi_slopes=alibi_slopes(4, "cpu"),
            )[0][0]
            for a, n in zip(starts, lengths, strict=True)
        ]
    )
    for impl in ("flash_attention", "flash_attention_per_sequence_slopes", "flex"):
        out = _runner(impl, s, causal, lengths, q, k, v)[1]()
        assert torch.allclose(out.to(torch.float64), expected, atol=2e-5), impl
    with pytest.raises(Skip, match="additive mask"):
        _runner("sdpa_cudnn", s, causal, lengths, q, k, v)
