"""The wheel a user would install: its name, version, license and files."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flash_attention

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.skip(f"pip wheel failed here (build tools missing?): {proc.stderr[-500:]}")
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_wheel_metadata(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    fields = dict(
        line.split(": ", 1) for line in text.splitlines() if ": " in line and not line.startswith(" ")
    )
    assert fields["Name"] == "fa-scratch"
    assert fields["Version"] == flash_attention.__version__
    assert fields["License-Expression"] == "BSD-3-Clause"
    assert "Programming Language :: Python :: 3.12" in text and "Requires-Python: >=3.10" in text


def test_wheel_ships_the_license_and_the_kernel_sources(wheel):
    names = wheel.namelist()
    licenses = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
    assert licenses and b"BSD 3-Clause" in wheel.read(licenses[0])
    headers = {Path(n).name for n in names if n.startswith("flash_attention/csrc/")}
    for path in (REPO / "flash_attention" / "csrc").rglob("*"):
        if path.suffix in (".cuh", ".h", ".cu", ".cpp"):  # the host library's source too (jit/host.py)
            assert path.name in headers, f"{path} is not in the wheel"
    assert any(n.startswith("flash_attention/tools/") for n in names)
    assert not any("/tuned/" in n for n in names)
