"""Do the host library's sources compile against another PyTorch's headers? A syntax check, no GPU needed.

The host library (flash_attention/csrc/host/*.cpp) is built on the user's machine against the running
PyTorch's headers, and ATen's overloads differ between versions: a call that one version's headers take
can be ambiguous in another's. Once it was: the GPU machine's torch 2.11 rejected what this machine's 2.13
compiled, the library did not build there, and every native path fell back to Python for a whole session
(docs/kernel-log/host.md). This tool fetches the given version's wheel from PyPI (kept in a cache folder),
unpacks its headers and runs ``c++ -fsyntax-only`` on each source against them.

    python tools/check_host_headers.py 2.11.0 [2.12.0 ...]   # exit status 1 when a source fails

Run it before a device session whose image carries another PyTorch than this machine.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "flash_attention" / "csrc" / "host").glob("*.cpp"))


def headers(version: str, cache: Path) -> Path:
    """The include folder of torch ``version``'s wheel for this Python, downloaded and unpacked once."""
    include = cache / version / "torch" / "include"
    if include.is_dir():
        return include
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = glob.glob(str(wheels / f"torch-{version}-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels)]
        subprocess.run([*pip, f"torch=={version}"], check=True)
        found = glob.glob(str(wheels / f"torch-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as wheel:
        members = [m for m in wheel.namelist() if m.startswith("torch/include/")]
        wheel.extractall(cache / version, members)
    return include


def check(version: str, cache: Path, cxx: str) -> list[str]:
    """The sources that fail against ``version``'s headers, each with its first error lines."""
    include = headers(version, cache)
    flags = ["-fsyntax-only", "-std=c++17", f"-I{include}", f"-I{include / 'torch/csrc/api/include'}"]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    failed = []
    for source in SOURCES:
        proc = subprocess.run([cxx, *flags, str(source)], capture_output=True, text=True)
        if proc.returncode:
            errors = [line for line in proc.stderr.splitlines() if "error" in line][:3]
            failed.append(f"{source.name}: " + " | ".join(errors))
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="+", help="PyTorch versions, e.g. 2.11.0")
    ap.add_argument(
        "--cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "flash_attention", "torch_headers"),
        help="where the wheels and their headers are kept",
    )
    args = ap.parse_args()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        print("no C++ compiler (set CXX)")
        return 2
    status = 0
    for version in args.versions:
        failed = check(version, Path(args.cache), cxx)
        print(f"torch {version}: {len(SOURCES) - len(failed)} of {len(SOURCES)} host sources compile")
        for line in failed:
            print(f"  {line}")
        status |= bool(failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
