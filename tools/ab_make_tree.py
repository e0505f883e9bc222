"""Make an A/B tree for tools/ab_trees.py: the package of a commit with a few exact text edits.

    python tools/ab_make_tree.py DEST [--rev HEAD] [--edit PATH OLD NEW ...]

    # e.g. the backward with half of P's exponentials on the FMA pipe at head_dim 128 (kernel log 138):
    python tools/ab_make_tree.py .abt/ep4 --edit flash_attention/configs/backward.py \\
        'HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {}' \\
        'HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {(128, False): 4, (128, True): 4}'

DEST receives `git archive REV` of flash_attention/, tests/ and pyproject.toml (what ab_trees.py imports and
what `python -m pytest` run inside DEST tests), then each edit: OLD must occur exactly once in PATH (a macro
line, a default's table), else nothing is written and the command fails, naming the edit, so a tree never
silently measures the base. A tree of the base itself is DEST without edits. DEST must not exist: trees are
made fresh, never patched twice. The trees of one A/B share the JIT cache where their csrc/ is the same (the
cache keys on the sources), so a tree that edits only Python compiles nothing new.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

#: What a tree holds: the package, its tests and the project file pytest reads its markers from.
TREE_PATHS = ("flash_attention", "tests", "pyproject.toml")


def make_tree(dest: Path, rev: str, edits: list[tuple[str, str, str]], repo: Path) -> list[str]:
    """Write the tree; return one line per edit applied. Raises ValueError (nothing written) when an edit's
    file is outside the tree or its text does not occur exactly once."""
    if dest.exists():
        raise ValueError(f"{dest} exists: make each tree fresh")
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev, *TREE_PATHS], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        edited: dict[str, str] = {}
        for path, old, new in edits:
            if path not in members or not members[path].isfile():
                raise ValueError(f"--edit {path}: no such file in {rev}'s {', '.join(TREE_PATHS)}")
            text = edited.get(path)
            if text is None:
                text = tar.extractfile(members[path]).read().decode()
            count = text.count(old)
            if count != 1:
                raise ValueError(f"--edit {path}: the old text occurs {count} times, not once: {old!r}")
            edited[path] = text.replace(old, new)
        dest.mkdir(parents=True)
        tar.extractall(dest, filter="data")
    for path, text in edited.items():
        (dest / path).write_text(text)
    return [f"{path}: {old!r} -> {new!r}" for path, old, new in edits]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the tree's root (created; ab_trees.py takes it as a TREE)")
    ap.add_argument("--rev", default="HEAD", help="the commit to archive (default HEAD)")
    ap.add_argument(
        "--edit",
        nargs=3,
        action="append",
        default=[],
        metavar=("PATH", "OLD", "NEW"),
        help="replace OLD, which must occur exactly once in PATH (relative to the repository root), by NEW",
    )
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    try:
        applied = make_tree(args.dest, args.rev, [tuple(e) for e in args.edit], repo)
    except (ValueError, subprocess.CalledProcessError) as err:
        print(f"ab_make_tree: {err}", file=sys.stderr)
        return 2
    print(f"{args.dest}: {args.rev}" + ("".join(f"\n  {line}" for line in applied) or " (no edits)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
