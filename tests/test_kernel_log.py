"""The kernel log: its entries in docs/kernel-log/<family>.md, its index in docs/kernel-log.md
(tools/kernel_log_index.py). The index is current, every step is in exactly one family file and in the
index once, the links into the log land on headings, and the result files the entries name exist."""

from __future__ import annotations

import glob
import re

import pytest
from repo_tools import ROOT, load_tool

DOCS = ROOT / "docs"
INDEX = DOCS / "kernel-log.md"
FAMILY_DIR = DOCS / "kernel-log"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PRIMARY = re.compile(r"^### (\d+)\. ", re.M)
_CONTINUED = re.compile(r"^### (\d+), [^.]+\. ", re.M)


def github_headings(text: str) -> list[tuple[str, str]]:
    """A page's headings and the anchors GitHub gives them, written apart from the tool's: lower case, only
    letters, digits, "_", "-" and spaces kept, spaces as hyphens, the n-th repeat of an anchor suffixed -n."""
    seen: dict[str, int] = {}
    out = []
    fenced = False
    for line in text.split("\n"):
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = "".join(c for c in m[1].strip().lower() if c.isalnum() or c in "_- ").replace(" ", "-")
            out.append((line, f"{slug}-{seen[slug]}" if slug in seen else slug))
            seen[slug] = seen.get(slug, 0) + 1
    return out


def github_anchors(text: str) -> list[str]:
    return [slug for _, slug in github_headings(text)]


def family_texts() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(FAMILY_DIR.glob("*.md"))}


def index_block() -> str:
    text = INDEX.read_text(encoding="utf-8")
    return text.split("<!-- index:begin -->", 1)[1].split("<!-- index:end -->", 1)[0]


def test_github_anchors_as_github_writes_them():
    page = "# T\n## 2026-11-22 — Hopper kernels (wgmma), H100\n"
    page += "### 117. bwd_ws: dV (e462e30 -> 6446c25; H200)\n"
    page += "### Where decode stands (`x`)\n```\n# not a heading\n```\n### Where decode stands (x)\n"
    assert github_anchors(page) == [
        "t",
        "2026-11-22--hopper-kernels-wgmma-h100",
        "117-bwd_ws-dv-e462e30---6446c25-h200",
        "where-decode-stands-x",
        "where-decode-stands-x-1",
    ]
    assert load_tool("kernel_log_index").heading_anchors(page) == github_anchors(page)


def test_the_committed_index_is_current():
    assert load_tool("kernel_log_index").main(["--check"]) == 0, "rerun: python tools/kernel_log_index.py"


def test_every_step_is_in_exactly_one_family_file():
    where: dict[int, list[str]] = {}
    for name, text in family_texts().items():
        assert text.startswith("# Kernel log: "), f"{name}: opens with '# Kernel log: <what it holds>'"
        for n in _PRIMARY.findall(text):
            where.setdefault(int(n), []).append(name)
        for m in _CONTINUED.finditer(text):  # "### 39, measured." continues step 39, after it, in its file
            primary = re.search(rf"^### {m[1]}\. ", text, re.M)
            assert primary and primary.start() < m.start(), f"{name}: {m[0]!r} before its step"
    assert {n: files for n, files in where.items() if len(files) > 1} == {}
    assert sorted(where) == list(range(1, max(where) + 1)), "steps are numbered 1, 2, ... without a gap"
    assert max(where) >= 121  # what the log held when it was split; numbers are never reused


def test_each_family_file_keeps_its_steps_in_order():
    for name, text in family_texts().items():
        numbers = [int(n) for n in _PRIMARY.findall(text)]
        assert numbers == sorted(numbers), f"{name}: steps out of order"


def test_the_index_has_one_row_per_step_heading_linked_to_it():
    row = re.compile(r"^\| \[([^\]]+)\]\(kernel-log/([\w-]+)\.md#([^)]+)\) \| ([\w-]+) \|", re.M)
    rows = row.findall(index_block())
    headings = []
    for name, text in family_texts().items():
        for line, slug in github_headings(text):
            m = re.match(r"^### (\d+)(?:\. |, ([^.]+)\. )", line)
            if m:
                label = m[1] if m[2] is None else f"{m[1]}, {m[2]}"
                family = name.removesuffix(".md")
                headings.append((label, family, slug, family))  # the link's file and the family column agree
    assert sorted(rows) == sorted(headings)
    steps = [int(label.split(",")[0]) for label, *_ in rows]
    assert steps == sorted(steps), "the index is in step order"


def test_every_family_file_is_linked_from_the_index():
    block = index_block()
    for name in family_texts():
        assert f"](kernel-log/{name})" in block, f"docs/kernel-log.md's index does not link {name}"


def test_links_into_the_kernel_log_land_on_headings():
    # README, docs/ and the family files: a link to the log (or a file of it) with an anchor names a heading.
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    log_pages = [INDEX, *FAMILY_DIR.glob("*.md")]
    anchors = {p: set(github_anchors(p.read_text(encoding="utf-8"))) for p in log_pages}
    checked = 0
    for page in pages:
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if dest in anchors and anchor:
                assert anchor in anchors[dest], f"{page.relative_to(ROOT)}: no heading for {target}"
                checked += 1
    assert checked > 121  # the index's rows at least


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [e for alt in m[1].split(",") for e in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def test_every_result_file_an_entry_names_exists():
    tool = load_tool("kernel_log_index")
    named = [(s["label"], r) for fam in tool.families() for s in fam["steps"] for r in s["results"]]
    assert len(named) > 50  # not vacuous
    missing = [(step, e) for step, r in named for e in _expand(r) if not glob.glob(str(ROOT / e))]
    assert missing == []


FAMILY = """# Kernel log: a family

Scope.

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

### 3. Again (fedcba9)

### 3. Again (fedcba9)
"""


def test_the_tool_reads_each_steps_commits_results_and_anchor():
    tool = load_tool("kernel_log_index")
    rows = tool.steps(FAMILY)
    assert [r["label"] for r in rows] == ["1", "2", "2, measured", "3", "3"]
    assert rows[0]["commits"] == ["0281a6f", "e5d5fcc"]
    assert rows[0]["results"] == ["benchmarks/results/h200-2026-11-22.json"]  # once
    assert rows[1]["commits"] == [] and rows[1]["anchor"] == "2-fragment-addresses-fragaddr--kept"
    assert rows[2]["commits"] == ["5fcb070", "abcdef1", "1234abc", "5678def", "9abcdef0"]
    assert rows[2]["section"] == "2026-11-23 — backward, H100"
    assert rows[2]["title"] == "The first run (H100, commit 5fcb070)"
    # A repeated heading's anchor is numbered, as GitHub numbers it.
    assert [r["anchor"] for r in rows[3:]] == ["3-again-fedcba9", "3-again-fedcba9-1"]


@pytest.mark.parametrize(
    ("entry", "effect"),
    [
        # A prediction is not a measurement; the method in parentheses is left out.
        ("Prediction: +5% at 1k.\n\nMeasured (`ab.py`, H100): 0.97x at 1k.", "Measured: 0.97x at 1k."),
        # A sentence that opens a table says nothing; the first figure after it does.
        ("Measured on an H100:\n\n| a |\n| --- |\n| 1.1x |\n\n+16-26% over it.", "+16-26% over it."),
        # A paragraph that opens with a prediction predicts until it reports.
        ("- **Prediction**: within 10%. Short ones take 8-15 us.\n- Resources: 168 registers.", ""),
        ("Predicted: -3%. Met: 2.5 -> 2.4 ms.", "Met: 2.5 -> 2.4 ms."),
        ("Step 30 lost 3-35%. Now: 1.10x.", "Now: 1.10x."),
        ("Nothing was timed.", ""),
    ],
)
def test_the_measured_effect_is_the_first_measured_figure(entry, effect):
    assert load_tool("kernel_log_index").measured_effect(entry.split("\n")) == effect


def test_the_measured_effect_is_short():
    tool = load_tool("kernel_log_index")
    long = "Measured: " + ", ".join(f"point {i} 0.9{i}x" for i in range(40)) + "."
    effect = tool.measured_effect([long])
    assert len(effect) <= tool.EFFECT_CHARS and effect.endswith("…")
    late = "The sweep on the machine that ran it, with every knob, took long; then " + "a" * 50 + " 1.5x."
    effect = tool.measured_effect([late])  # from the clause that holds the figure
    assert effect.startswith("…") and effect.endswith(" 1.5x.") and len(effect) <= tool.EFFECT_CHARS


def test_the_tool_writes_and_checks_the_index(tmp_path, monkeypatch, capsys):
    tool = load_tool("kernel_log_index")
    folder = tmp_path / "kernel-log"
    folder.mkdir()
    (folder / "fwd.md").write_text(FAMILY.split("### 3.")[0], encoding="utf-8")
    (folder / "bwd.md").write_text("# Kernel log: backward\n\n## 2026-11-24 — x\n\n### 3. Later (1.2x)\n")
    log = tmp_path / "kernel-log.md"
    log.write_text("# Kernel log\n\nIntro.\n", encoding="utf-8")
    monkeypatch.setattr(tool, "LOG", log)
    monkeypatch.setattr(tool, "FAMILY_DIR", folder)
    assert tool.main(["--check"]) == 1  # no index yet
    assert tool.main([]) == 0
    text = log.read_text(encoding="utf-8")
    families_row = "| [bwd](kernel-log/bwd.md) | backward | 1 |"
    assert text.index("Intro.") < text.index("## Index") < text.index(families_row)
    assert "| [3](kernel-log/bwd.md#3-later-12x) | bwd | Later (1.2x) |  |  |  |" in text
    assert "| [2, measured](kernel-log/fwd.md#2-measured-the-first-run-h100-commit-5fcb070) | fwd |" in text
    first = text.split("\n| [1](kernel-log/fwd.md#1-first-version-commit-0281a6f) | fwd |")[1].split("\n")[0]
    assert first.endswith("| `0281a6f`, `e5d5fcc` | `h200-2026-11-22.json` |")
    assert tool.main(["--check"]) == 0 and tool.rewrite(text, tool.families(folder)) == text
    assert tool.main(["--next"]) == 0 and capsys.readouterr().out.strip().endswith("4")
    with (folder / "bwd.md").open("a", encoding="utf-8") as f:
        f.write("\n### 4. An entry added without rerunning the tool\n")
    assert tool.main(["--check"]) == 1
