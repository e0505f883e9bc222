"""Make an A/B tree for tools/ab_trees.py: the package of a commit with prepared patches and exact text edits.

    python tools/ab_make_tree.py DEST [--rev HEAD] [--patch FILE ...] [--edit PATH OLD NEW ...]

    # e.g. the backward with half of P's exponentials on the FMA pipe at head_dim 128 (kernel log 138):
    python tools/ab_make_tree.py .abt/ep4 --edit flash_attention/configs/backward.py \\
        'HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {}' \\
        'HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {(128, False): 4, (128, True): 4}'

DEST receives `git archive REV` of flash_attention/, tests/ and pyproject.toml (what ab_trees.py imports and
what `python -m pytest` run inside DEST tests), then each patch (a unified diff against REV, as `git diff`
writes it, applied by `git apply`: a kernel step prepared in one session and measured in another keeps its
change in the repository as docs/kernel-log/patches/*.diff, where no branch of a lost machine takes it along),
then each edit: OLD must occur exactly once in PATH (a macro line, a default's table). A patch that does not
apply or an edit that does not match leaves nothing written and fails the command, naming it, so a tree never
silently measures the base. A tree of the base itself is DEST without edits. DEST must not exist: trees are
made fresh, never patched twice. The trees of one A/B share the JIT cache where their csrc/ is the same (the
cache keys on the sources), so a tree that edits only Python compiles nothing new.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

#: What a tree holds: the package, its tests and the project file pytest reads its markers from.
TREE_PATHS = ("flash_attention", "tests", "pyproject.toml")


def make_tree(
    dest: Path, rev: str, edits: list[tuple[str, str, str]], repo: Path, patches: list[Path] = ()
) -> list[str]:
    """Write the tree; return one line per patch and edit applied. Raises ValueError (nothing written) when a
    patch does not apply, or an edit's file is outside the tree or its text does not occur exactly once."""
    if dest.exists():
        raise ValueError(f"{dest} exists: make each tree fresh")
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev, *TREE_PATHS], capture_output=True, check=True
    ).stdout
    dest.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        # `git apply` outside a repository patches the files under its working directory; inside one (the
        # trees live in .abt/ of the checkout) it would take the paths as the repository's and skip them,
        # so git is kept from looking above the tree for one.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
        for patch in patches:
            applied = subprocess.run(
                ["git", "apply", "--whitespace=nowarn", str(Path(patch).resolve())],
                cwd=dest,
                env=env,
                capture_output=True,
                text=True,
            )
            if applied.returncode != 0:
                raise ValueError(f"--patch {patch} does not apply to {rev}: {applied.stderr.strip()}")
        edited: dict[str, str] = {}
        for path, old, new in edits:
            if not (dest / path).is_file() or path.split("/")[0] not in TREE_PATHS:
                raise ValueError(f"--edit {path}: no such file in {rev}'s {', '.join(TREE_PATHS)}")
            text = edited[path] if path in edited else (dest / path).read_text()
            count = text.count(old)
            if count != 1:
                raise ValueError(f"--edit {path}: the old text occurs {count} times, not once: {old!r}")
            edited[path] = text.replace(old, new)
        for path, text in edited.items():
            (dest / path).write_text(text)
    except BaseException:
        shutil.rmtree(dest)
        raise
    return [f"patch {patch}" for patch in patches] + [
        f"{path}: {old!r} -> {new!r}" for path, old, new in edits
    ]


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
    ap.add_argument(
        "--patch",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a unified diff against REV (git diff's form), applied before the edits",
    )
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    try:
        applied = make_tree(args.dest, args.rev, [tuple(e) for e in args.edit], repo, args.patch)
    except (ValueError, subprocess.CalledProcessError) as err:
        print(f"ab_make_tree: {err}", file=sys.stderr)
        return 2
    print(f"{args.dest}: {args.rev}" + ("".join(f"\n  {line}" for line in applied) or " (no edits)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
