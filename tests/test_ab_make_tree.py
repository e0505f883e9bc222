"""tools/ab_make_tree.py: an A/B tree is the commit's package with exactly the edits asked for, and an edit
that does not match exactly once writes nothing."""

from __future__ import annotations

import subprocess

import pytest
from repo_tools import ROOT, load_tool

ab_make_tree = load_tool("ab_make_tree")


def _has_git() -> bool:
    try:
        subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_git(), reason="needs the repository's git history")

BACKWARD = "flash_attention/configs/backward.py"
OLD = "HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {}"
NEW = "HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {(128, False): 4}"


def test_a_tree_is_the_commit_with_its_edit(tmp_path):
    committed = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"HEAD:{BACKWARD}"], capture_output=True, text=True, check=True
    ).stdout
    assert ab_make_tree.main([str(tmp_path / "t"), "--edit", BACKWARD, OLD, NEW]) == 0
    tree = tmp_path / "t"
    assert (tree / BACKWARD).read_text() == committed.replace(OLD, NEW) != committed
    assert (tree / "flash_attention" / "__init__.py").is_file() and (tree / "pyproject.toml").is_file()
    assert (tree / "tests" / "conftest.py").is_file()
    # the base: the same commit without edits, every file as committed
    assert ab_make_tree.main([str(tmp_path / "base")]) == 0
    assert (tmp_path / "base" / BACKWARD).read_text() == committed


@pytest.mark.parametrize(
    "edit, message",
    [
        ((BACKWARD, "no such text anywhere", "x"), "occurs 0 times"),
        ((BACKWARD, "import", "x"), "times, not once"),
        (("flash_attention/missing.py", "a", "b"), "no such file"),
    ],
)
def test_an_edit_that_does_not_match_once_writes_nothing(tmp_path, capsys, edit, message):
    dest = tmp_path / "t"
    assert ab_make_tree.main([str(dest), "--edit", BACKWARD, OLD, NEW, "--edit", *edit]) == 2
    assert message in capsys.readouterr().err and not dest.exists()


def test_a_tree_is_never_made_twice(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    assert ab_make_tree.main([str(tmp_path / "t")]) == 2
    assert "exists" in capsys.readouterr().err


def _patch_of(tmp_path, old: str, new: str):
    """A unified diff of BACKWARD replacing ``old`` by ``new``, as `git diff` writes it (in a scratch
    repository holding that one file)."""
    committed = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"HEAD:{BACKWARD}"], capture_output=True, text=True, check=True
    ).stdout
    scratch = tmp_path / "scratch"
    (scratch / BACKWARD).parent.mkdir(parents=True)
    (scratch / BACKWARD).write_text(committed)
    git = ["git", "-C", str(scratch), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    (scratch / BACKWARD).write_text(committed.replace(old, new))
    patch = tmp_path / "step.diff"
    patch.write_text(subprocess.run([*git, "diff"], capture_output=True, text=True, check=True).stdout)
    return committed, patch


def test_a_patch_applies_before_the_edits_even_inside_a_repository(tmp_path):
    committed, patch = _patch_of(tmp_path, OLD, NEW)
    # the tree inside another repository's work tree, as .abt/ lies inside the checkout
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    dest = repo / ".abt" / "t"
    assert (
        ab_make_tree.main([str(dest), "--patch", str(patch), "--edit", BACKWARD, NEW, NEW + "  # edited"])
        == 0
    )
    assert (dest / BACKWARD).read_text() == committed.replace(OLD, NEW + "  # edited")


def test_a_patch_that_does_not_apply_writes_nothing(tmp_path, capsys):
    _, patch = _patch_of(tmp_path, OLD, NEW)
    patch.write_text(patch.read_text().replace(OLD, "a line the file does not have"))
    dest = tmp_path / "t"
    assert ab_make_tree.main([str(dest), "--patch", str(patch)]) == 2
    assert "does not apply" in capsys.readouterr().err and not dest.exists()
