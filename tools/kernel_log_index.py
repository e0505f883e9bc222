"""Writes the kernel log's index into docs/kernel-log.md from the family files in docs/kernel-log/: a table
of the families, then one row per numbered step with its kernel family, its title, a short extract of its
measured effect, the commits and result files it names, and a link to the entry.

    python tools/kernel_log_index.py          # rewrite the index in place
    python tools/kernel_log_index.py --check  # exit 1 if the index is not current (tests/test_kernel_log.py)
    python tools/kernel_log_index.py --next   # print the next step number

The entries live in one file per kernel family (``docs/kernel-log/<family>.md``, each opening with
``# Kernel log: <what it holds>``), in the order the work happened; step numbers are global, so "kernel log
116" names one entry whichever file holds it. The index is generated, never edited by hand.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "kernel-log.md"
FAMILY_DIR = ROOT / "docs" / "kernel-log"
BEGIN, END = "<!-- index:begin -->", "<!-- index:end -->"

_TITLE = re.compile(r"^# Kernel log: (.+)$")
_HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$")
_SECTION = re.compile(r"^## (.+)$")
# "### 39. Title" opens step 39; "### 39, measured. Title" continues it.
_STEP = re.compile(r"^### (\d+)(?:\. |, ([^.]+)\. )(.+)$")
# A commit: after "commit(s)", "merge", "at", "against" or "from" (and each of a list after "commits"), in
# backticks, or in parentheses; 7 to 40 hex digits (a full one is shown by its first 7).
_COMMIT = re.compile(
    r"\b(?i:commits?|merge|at|against|from)\s+`?([0-9a-f]{7,40})\b|`([0-9a-f]{7,40})`|\(([0-9a-f]{7,40})[;,)]"
)
_COMMIT_LIST = re.compile(r"\b(?i:commits)\s+((?:`?[0-9a-f]{7,40}`?(?:,\s*|\s+and\s+))+`?[0-9a-f]{7,40}`?)")
_RESULT = re.compile(r"benchmarks/results/[\w./{},*-]+?\.(?:json|txt)")

# What the measured-effect column looks for: a percentage, a ratio (1.06x, 0.93×), a rate, a time, or a
# change from one number to another (255 -> 252, 1.89 → 2.79).
_FIGURE = re.compile(
    r"\d%|\d[×x](?!\w)|\d\s*(?:TFLOP/s|TB/s|GB/s|µs|us|ms|cycles)(?!\w)|\d\s*(?:->|→)\s*[\d+-]"
)
# Sentences that say what was expected or what came before, not what was measured.
_PREDICTION = re.compile(r"^(?:Prediction|Predicted|Predicts|Expected|Why|Before)\b")
_CONTEXT = re.compile(r"^Steps? \d+")
_MEASURED = re.compile(r"^(?:Measured|Result|Cost|Verdict)\b|\bMeasured\b")
_VERDICT = re.compile(r"^(?:Met|Missed)\b")  # ends a prediction's paragraph
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9+`(])")
_SHAPE = re.compile(r"\((?:\d+, )+\d+\)")
EFFECT_CHARS = 100


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def heading_anchors(text: str) -> list[str]:
    """The anchors of every heading of a markdown page, in order, a repeated one suffixed -1, -2, ... as
    GitHub does (headings inside fenced code are not headings)."""
    out: list[str] = []
    counts: dict[str, int] = {}
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m is None:
            continue
        base = anchor(m[2])
        n = counts.get(base, 0)
        counts[base] = n + 1
        out.append(base if n == 0 else f"{base}-{n}")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def _paragraphs(lines: list[str]) -> list[str]:
    """The prose of an entry as paragraphs (a list item is one), without tables and code."""
    paras: list[list[str]] = [[]]
    fenced = False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
            paras.append([])
            continue
        stripped = line.strip()
        if fenced or not stripped or stripped.startswith("|"):
            paras.append([])
            continue
        if re.match(r"^(?:[-*] |\d+\. )", stripped):
            paras.append([])
            stripped = re.sub(r"^(?:[-*] |\d+\. )", "", stripped)
        paras[-1].append(stripped)
    return [" ".join(p) for p in paras if p]


def _plain(paragraph: str) -> str:
    """A paragraph without emphasis and without its parenthetical remarks (the method, the files), but for
    shapes such as (4, 1024, 32, 128)."""
    text = _SHAPE.sub(lambda m: m[0].replace("(", "\0").replace(")", "\1"), paragraph.replace("**", ""))
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", text)
        if shorter == text:
            break
        text = shorter
    return re.sub(r"\s+", " ", text.replace("\0", "(").replace("\1", ")")).strip()


def _short(sentence: str) -> str:
    """At most EFFECT_CHARS characters of ``sentence``; where its first figure lies beyond half of them,
    from the start of the clause that holds it. A code span cut in two loses its backticks."""
    if len(sentence) > EFFECT_CHARS:
        first = _FIGURE.search(sentence).start()
        clause = max(sentence.rfind(sep, 0, first) for sep in (": ", "; ", ", "))
        if first > EFFECT_CHARS // 2 and clause > 0:
            sentence = "…" + sentence[clause + 2 :]
    if len(sentence) > EFFECT_CHARS:
        cut = sentence[: EFFECT_CHARS - 1]
        cut = cut[: cut.rfind(" ")] if " " in cut else cut
        sentence = cut.rstrip(" ,;:") + "…"
    return sentence.replace("`", "") if sentence.count("`") % 2 else sentence


def measured_effect(lines: list[str]) -> str:
    """A short extract of what an entry measured: its first sentence with a figure (a percentage, a ratio,
    TFLOP/s, TB/s, a time, a before -> after) from the first sentence that reports a measurement
    ("Measured", "Result", "Cost", "Verdict") on, or else from the start. Left out: predictions (and the
    rest of a paragraph that opens with one, up to its "Measured", "Met" or "Missed"), sentences about
    earlier steps, sentences that open a table, parenthetical remarks. Empty when nothing is left."""
    sentences = []  # (sentence, whether it may be the extract)
    for paragraph in _paragraphs(lines):
        predicting = False
        for i, s in enumerate(_SENTENCE_END.split(_plain(paragraph))):
            predicting = predicting or (i == 0 and _PREDICTION.match(s))
            predicting = predicting and not (_MEASURED.search(s) or _VERDICT.match(s))
            if s and not predicting and not _PREDICTION.match(s) and not _CONTEXT.match(s):
                sentences.append((s, s[-1] != ":" and _FIGURE.search(s) is not None))  # ":" opens a table
    start = next((i for i, (s, _) in enumerate(sentences) if _MEASURED.search(s)), 0)
    for s, usable in sentences[start:] + sentences[:start]:
        if usable:
            return _short(s)
    return ""


def steps(text: str) -> list[dict]:
    """The numbered entries of a family file, in order, each with what the index shows: ``step`` (its
    number), ``label`` ("39" or "39, measured"), ``title``, ``section`` (its session heading), ``anchor``,
    ``commits``, ``results`` and ``lines`` (its text)."""
    rows: list[dict] = []
    section = ""
    current = None
    anchors = iter(heading_anchors(text))
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        is_heading = not fenced and _HEADING.match(line) is not None
        slug = next(anchors) if is_heading else None
        m = _SECTION.match(line) if is_heading else None
        if m:
            section = m[1].strip()
            current = None
            continue
        m = _STEP.match(line) if is_heading else None
        if m is None and is_heading:
            current = None  # an entry without a step number: what it names is its own, not the step's
            continue
        if m:
            label = m[1] if m[2] is None else f"{m[1]}, {m[2]}"
            current = {
                "step": int(m[1]),
                "label": label,
                "title": m[3].strip(),
                "section": section,
                "anchor": slug,
                "commits": [],
                "results": [],
                "lines": [],
            }
            rows.append(current)
            line = m[3]
        elif current is not None:
            current["lines"].append(line)
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


def families(folder: Path | None = None) -> list[dict]:
    """The family files, each as ``name`` (the file's stem), ``path``, ``title`` (from its "# Kernel log:"
    heading) and ``steps``, by name."""
    out = []
    for path in sorted((folder or FAMILY_DIR).glob("*.md")):
        text = path.read_text(encoding="utf-8")
        first = text.split("\n", 1)[0]
        m = _TITLE.match(first)
        if m is None:
            raise ValueError(f"{path}: the first line must be '# Kernel log: <what it holds>', not {first!r}")
        out.append({"name": path.stem, "path": path, "title": m[1].strip(), "steps": steps(text)})
    return out


def _link(family: dict) -> str:
    """The family file's path from docs/kernel-log.md's folder."""
    return Path(os.path.relpath(family["path"], LOG.parent)).as_posix()


def _results(found: list[str]) -> str:
    names = [f"`{r.removeprefix('benchmarks/results/')}`" for r in found]
    more = f" (+{len(names) - 2})" if len(names) > 2 else ""
    return ", ".join(names[:2]) + more


def render(fams: list[dict]) -> str:
    """The index block (between the markers) for the family files ``fams``."""
    lines = [
        BEGIN,
        "| family | what it holds | steps |",
        "| --- | --- | ---: |",
    ]
    for fam in fams:
        numbered = [s for s in fam["steps"] if s["label"] == str(s["step"])]
        lines.append(f"| [{fam['name']}]({_link(fam)}) | {_cell(fam['title'])} | {len(numbered)} |")
    lines += [
        "",
        "| step | kernel family | change | measured effect | commits | result files |",
        "| ---: | --- | --- | --- | --- | --- |",
    ]
    rows = [(s, fam) for fam in fams for s in fam["steps"]]
    rows.sort(key=lambda r: (r[0]["step"], r[0]["label"] != str(r[0]["step"])))
    for row, fam in rows:
        commits = ", ".join(f"`{c}`" for c in row["commits"][:3])
        lines.append(
            f"| [{row['label']}]({_link(fam)}#{row['anchor']}) | {fam['name']} | {_cell(row['title'])} | "
            f"{_cell(measured_effect(row['lines']))} | {commits} | {_results(row['results'])} |"
        )
    lines.append(END)
    return "\n".join(lines)


def rewrite(text: str, fams: list[dict]) -> str:
    """``text`` (docs/kernel-log.md) with its index replaced, or appended if it has none yet."""
    block = render(fams)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n## Index\n\n" + block + "\n"


def next_step(fams: list[dict]) -> int:
    return 1 + max((s["step"] for fam in fams for s in fam["steps"]), default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is not current")
    ap.add_argument("--next", action="store_true", help="print the next step number")
    args = ap.parse_args(argv)
    fams = families()
    if args.next:
        print(next_step(fams))
        return 0
    text = LOG.read_text(encoding="utf-8")
    new = rewrite(text, fams)
    if args.check:
        if new != text:
            print(
                "docs/kernel-log.md's index is not current: run python tools/kernel_log_index.py",
                file=sys.stderr,
            )
            return 1
        return 0
    LOG.write_text(new, encoding="utf-8")
    count = sum(s["label"] == str(s["step"]) for fam in fams for s in fam["steps"])
    print(f"wrote the index of {count} steps in {len(fams)} family files into {LOG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
