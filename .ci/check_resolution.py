"""CI: the test extra must resolve together with PyPI's current CUDA build of PyTorch without downgrading it.

Resolves (pip --dry-run, no install) `torch` alone and `torch` plus `.[test]` against PyPI in a clean
environment, and fails if the second fails or picks another torch than the first. This is what broke when
the extra pinned an NVRTC version that torch's CUDA wheels pin differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def resolve(*requirements: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--index-url", "https://pypi.org/simple", "--report", str(report), *requirements,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            sys.exit(f"resolution of {' '.join(requirements)} failed:\n{proc.stderr[-3000:]}")
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}


def main() -> int:
    alone = resolve("torch")["torch"]
    together = resolve("torch", f"{REPO}[test]")
    nvrtc = together.get("nvidia-cuda-nvrtc")
    print(f"torch alone: {alone}; torch with .[test]: {together['torch']}; nvidia-cuda-nvrtc: {nvrtc}")
    if together["torch"] != alone:
        sys.exit(f"installing .[test] changes torch from {alone} to {together['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
