"""docs/kernel-log.md's index (tools/kernel_log_index.py) is current, and finds what an entry names."""

from __future__ import annotations

from repo_tools import load_tool

LOG = """# Kernel log

Intro.

## 2026-11-22 — forward kernel v1, H200

### 1. First version (commit 0281a6f)

Measured at `e5d5fcc`: benchmarks/results/h200-2026-11-22.json and benchmarks/results/h200-2026-11-22.json.

### 2. Fragment addresses (`FragAddr`) — kept

Nothing named.

## 2026-11-23 — backward, H100

### 2, measured. The first run (H100, commit 5fcb070)

Against abcdef1 in one call; step 12345678 is a number, not a commit; a flat deadbee1 is prose.
Kept as commits 1234abc, 5678def and 9abcdef0.

### Where the backward stands (no step number)

Commit fedcba9 belongs to this entry, not to step 2.
"""


def test_the_committed_index_is_current():
    assert load_tool("kernel_log_index").main(["--check"]) == 0, "rerun: python tools/kernel_log_index.py"


def test_the_index_names_each_steps_commits_results_and_anchor():
    tool = load_tool("kernel_log_index")
    text = tool.rewrite(LOG)
    assert text.index("## Index") < text.index("## 2026-11-22")  # after the introduction
    assert tool.rewrite(text) == text  # rewriting an indexed log changes nothing
    rows = tool.steps(text.split(tool.END, 1)[1])
    assert [r["step"] for r in rows] == [1, 2, 2]
    assert rows[0]["commits"] == ["0281a6f", "e5d5fcc"]
    assert rows[0]["results"] == ["benchmarks/results/h200-2026-11-22.json"]  # once
    assert rows[1]["commits"] == [] and rows[1]["anchor"] == "2-fragment-addresses-fragaddr--kept"
    assert rows[2]["commits"] == ["5fcb070", "abcdef1", "1234abc", "5678def", "9abcdef0"]
    assert rows[2]["section"] == "2026-11-23 — backward, H100"
    assert "| [1](#1-first-version-commit-0281a6f) | 2026-11-22: forward kernel v1, H200 |" in text
