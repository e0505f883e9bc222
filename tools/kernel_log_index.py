"""Writes the index table at the top of docs/kernel-log.md: one row per numbered step, with its session and
topic, its title, the commits and result files it names, and a link to the entry.

    python tools/kernel_log_index.py          # rewrite the index in place
    python tools/kernel_log_index.py --check  # exit 1 if the index is not current (tests/test_kernel_log.py)

The log itself stays one file in the order the work happened; the index is how a reader finds a step by
kernel or by result without reading 4,000 lines.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "docs" / "kernel-log.md"
BEGIN, END = "<!-- index:begin -->", "<!-- index:end -->"

_SECTION = re.compile(r"^## (.+)$")
_STEP = re.compile(r"^### (\d+)[.,] (.+)$")  # ("39, measured." continues step 39)
# A commit: after "commit(s)", "merge", "at", "against" or "from" (and each of a list after "commits"), in
# backticks, or in parentheses; 7 to 40 hex digits (a full one is shown by its first 7).
_COMMIT = re.compile(
    r"\b(?i:commits?|merge|at|against|from)\s+`?([0-9a-f]{7,40})\b|`([0-9a-f]{7,40})`|\(([0-9a-f]{7,40})[;,)]"
)
_COMMIT_LIST = re.compile(r"\b(?i:commits)\s+((?:`?[0-9a-f]{7,40}`?(?:,\s*|\s+and\s+))+`?[0-9a-f]{7,40}`?)")
_RESULT = re.compile(r"benchmarks/results/[\w./{},*-]+?\.json")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def steps(text: str) -> list[dict]:
    """The numbered steps of the log body, in order, each with what the index shows."""
    rows: list[dict] = []
    section = ""
    current = None
    for line in text.split("\n"):
        if line.startswith(BEGIN):
            continue
        m = _SECTION.match(line)
        if m:
            section = m[1].strip()
            current = None
            continue
        m = _STEP.match(line)
        if m is None and line.startswith("### "):
            current = None  # an entry without a step number: what it names is its own, not the step's
            continue
        if m:
            current = {
                "step": int(m[1]),
                "title": m[2].strip(),
                "section": section,
                "commits": [],
                "results": [],
            }
            current["anchor"] = _anchor(line[4:])
            rows.append(current)
            line = m[2]
        if current is None:
            continue
        shas = [next(g for g in found.groups() if g) for found in _COMMIT.finditer(line)]
        for listed in _COMMIT_LIST.finditer(line):
            shas += re.findall(r"[0-9a-f]{7,40}", listed[1])
        for sha in shas:
            sha = sha[:7] if len(sha) == 40 else sha
            if not sha.isdigit() and sha not in current["commits"]:
                current["commits"].append(sha)
        for found in _RESULT.findall(line):
            if found not in current["results"]:
                current["results"].append(found)
    return rows


def render(text: str) -> str:
    """The index block (between the markers) for the log ``text``."""
    body = text.split(END, 1)[1] if END in text else text
    lines = [
        BEGIN,
        "| step | session | change | commits | result files |",
        "| ---: | --- | --- | --- | --- |",
    ]
    for row in steps(body):
        session = row["section"].split(" — ", 1)
        date, topic = (session[0], session[1]) if len(session) == 2 else ("", row["section"])
        commits = ", ".join(f"`{c}`" for c in row["commits"][:3])
        results = len(row["results"])
        lines.append(
            f"| [{row['step']}](#{row['anchor']}) | {_cell(date)}: {_cell(topic)} | {_cell(row['title'])} | "
            f"{commits} | {results or ''} |"
        )
    lines.append(END)
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """``text`` with its index replaced (or inserted after the introduction, before the first session)."""
    block = render(text)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    first = text.index("\n## ")
    return text[:first] + "\n\n## Index\n\n" + block + "\n" + text[first:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is not current")
    args = ap.parse_args(argv)
    text = LOG.read_text(encoding="utf-8")
    new = rewrite(text)
    if args.check:
        if new != text:
            print(
                "docs/kernel-log.md's index is not current: run python tools/kernel_log_index.py",
                file=sys.stderr,
            )
            return 1
        return 0
    LOG.write_text(new, encoding="utf-8")
    print(f"wrote the index of {len(steps(new.split(END, 1)[1]))} steps into {LOG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
