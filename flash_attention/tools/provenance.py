"""Which code a measurement ran: the commit and a digest of the package's sources, recorded in every result
file, and checked before a README region is generated from one.

A result file says ``commit`` (what git said, or what the caller passed with ``--commit`` where the copy has
no git metadata, as on the GPU machines) and ``source_digest``, a SHA-256 of every source file of the package
as it ran. The README generator recomputes the digest from the files git holds at that commit and refuses a
file whose code was not exactly that commit's: a number in the README always belongs to a commit.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

__all__ = [
    "PACKAGE_DIR",
    "ProvenanceError",
    "check_result",
    "digest_at_commit",
    "dirty_sources",
    "git_commit",
    "source_digest",
]

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: Files whose content decides what a measurement measures: the Python package, the kernels, and any
#: tuned-winners table shipped with it.
_SOURCE_SUFFIXES = (".py", ".cuh", ".h", ".cu", ".cpp", ".json")


class ProvenanceError(ValueError):
    """A result file cannot be tied to a commit."""


def _is_source(rel: str) -> bool:
    return rel.endswith(_SOURCE_SUFFIXES) and "__pycache__" not in rel


def _digest(items: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(items):
        h.update(rel.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the package's source files (path and content), as they are on disk now."""
    items = []
    for path in package_dir.rglob("*"):
        rel = path.relative_to(package_dir).as_posix()
        if path.is_file() and _is_source(rel):
            items.append((rel, path.read_bytes()))
    return _digest(items)


def _git(args: list[str], cwd: Path) -> str | None:
    """git's stdout without trailing whitespace (leading spaces are kept: porcelain status lines start with
    their column of status letters), or None when git is missing or fails."""
    try:
        p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.decode(errors="replace").rstrip() if p.returncode == 0 else None


def git_commit(cwd: Path = PACKAGE_DIR) -> str | None:
    """Short hash of the checkout's HEAD, or None where there is no git metadata."""
    return _git(["rev-parse", "--short", "HEAD"], cwd)


def dirty_sources(cwd: Path = PACKAGE_DIR) -> list[str] | None:
    """The package's source files that differ from HEAD (modified, added or untracked); None without git."""
    out = _git(["status", "--porcelain", "--untracked-files=all", "--", "."], cwd)
    if out is None:
        return None
    files = [line[3:] for line in out.splitlines() if line.strip()]
    return [f for f in files if _is_source(f)]


def digest_at_commit(commit: str, repo: Path) -> str:
    """:func:`source_digest` of the package as committed at ``commit`` in the git checkout ``repo``."""
    prefix = PACKAGE_DIR.name + "/"
    listing = _git(["ls-tree", "-r", "--name-only", commit, "--", PACKAGE_DIR.name], repo)
    if listing is None:
        raise ProvenanceError(f"git does not know commit {commit!r} in {repo}")
    items = []
    for name in listing.splitlines():
        rel = name[len(prefix) :]
        if not _is_source(rel):
            continue
        blob = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=repo, capture_output=True, check=True)
        items.append((rel, blob.stdout))
    return _digest(items)


def check_result(result: dict, repo: Path, what: str) -> None:
    """Raise :class:`ProvenanceError` unless ``result`` was measured on exactly the code of its commit."""
    commit, digest = result.get("commit"), result.get("source_digest")
    if result.get("dirty") or (isinstance(commit, str) and commit.endswith("-dirty")):
        raise ProvenanceError(
            f"{what} was measured on a working tree that differed from its commit ({commit})"
        )
    if not digest:
        raise ProvenanceError(f"{what} records no source_digest: it cannot be tied to the code that ran")
    if not commit or commit == "unknown":
        raise ProvenanceError(f"{what} records no commit")
    expected = digest_at_commit(commit, repo)
    if expected != digest:
        raise ProvenanceError(
            f"{what} says commit {commit}, but the code that ran differs from that commit's "
            f"(source digest {digest[:12]} != {expected[:12]}): measure again from a committed tree"
        )
