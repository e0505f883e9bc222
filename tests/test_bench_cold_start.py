"""``bench --mode cold-start`` without a GPU: each measurement gets a fresh process whose caches are new empty
folders (and, without a compiler, a CXX that points nowhere), its row says which, a failed child is a row
with its error, and the table shows every row. The child script itself runs on a GPU (`bench --mode
cold-start`)."""

from __future__ import annotations

import json
import os
import subprocess

from flash_attention.tools.bench import cold_start


def _fake_run(seen):
    def run(argv, capture_output, text, env, timeout):
        impl, what = json.loads(argv[-1])
        seen.append((impl, what, env))
        assert os.path.isdir(env["XDG_CACHE_HOME"]) and not os.listdir(env["XDG_CACHE_HOME"])
        assert env["FLASH_ATTENTION_CACHE_DIR"].startswith(env["XDG_CACHE_HOME"])
        row = {"impl": impl, "what": what, "seconds": 3.5, "warm_seconds": 0.001, "import_seconds": 2.0}
        if what.startswith("generate"):
            row |= {"per_token_pass1": 0.004, "per_token_pass2": 0.003}
        stderr = "flash_attention: compiling X ...\nflash_attention: compiled X in 2.0 s\nother line"
        return subprocess.CompletedProcess(argv, 0, stdout="noise\n" + json.dumps(row) + "\n", stderr=stderr)

    return run


def test_every_first_call_runs_in_a_fresh_process_with_empty_caches(monkeypatch):
    seen = []
    monkeypatch.setattr(cold_start.subprocess, "run", _fake_run(seen))
    monkeypatch.setattr(cold_start, "_fa4_installed", lambda: True)
    rows = cold_start.run_cold_start()
    ours = [r for r in rows if r["impl"] == "flash_attention"]
    assert {(r["what"], r["compiler"]) for r in ours} == {
        (w, c) for w in cold_start.OURS_WHAT for c in (True, False)
    }
    assert {(r["impl"], r["what"]) for r in rows if r["impl"] != "flash_attention"} == {
        (i, w) for i in ("sdpa_cudnn", "fa4") for w in cold_start.PEER_WHAT
    }
    homes = [env["XDG_CACHE_HOME"] for *_, env in seen]
    assert len(set(homes)) == len(homes)  # a new folder each time
    for (_impl, _what, env), row in zip(seen, rows, strict=True):
        no_cxx = "CXX" in env and not os.path.exists(env["CXX"])
        assert no_cxx == (not row["compiler"])
        assert row["stderr_lines"] == [
            "flash_attention: compiling X ...",
            "flash_attention: compiled X in 2.0 s",
        ]
    table = cold_start.cold_start_text(rows)
    assert table.count("\n") == len(rows)  # a header and a line per row
    assert "per token: pass 1 4.00 ms, pass 2 3.00 ms" in table


def test_a_failed_child_is_a_row_with_its_error(monkeypatch):
    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="Traceback ...\nRuntimeError: no GPU")

    monkeypatch.setattr(cold_start.subprocess, "run", run)
    row = cold_start._child("flash_attention", "forward", False, 10.0)
    assert row["compiler"] is False and "RuntimeError: no GPU" in row["error"]
    assert "failed: RuntimeError: no GPU" in cold_start.cold_start_text([row])
