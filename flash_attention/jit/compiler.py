"""Compile a translation unit to a cubin with NVRTC (in process) or nvcc (subprocess).

NVRTC comes with PyTorch's CUDA wheels (the ``nvidia-cuda-nvrtc`` package), so most GPU users can compile
without a CUDA toolkit; nvcc is used where NVRTC is missing, or when ``FLASH_ATTENTION_COMPILER=nvcc``.
Both run ptxas verbosely so every build yields the resource report (registers, spills, stack frame).
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
INCLUDE_DIRS = [CSRC / "include", CSRC / "kernels"]

# -O3 device code, line info for profilers (no effect on the generated code), C++17 for `if constexpr`.
COMMON_FLAGS = ["-std=c++17", "-lineinfo"]


class CompileError(RuntimeError):
    """The compiler rejected a kernel; the message carries its own log."""


@dataclass
class ResourceUsage:
    kernel: str
    arch: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    static_smem: int = 0
    barriers: int = 0
    #: Why ptxas serialized the kernel's wgmma instructions ("" if it did not; its note "(C75xx) Potential
    #: Performance Loss: wgmma.mma_async instructions are serialized due to ..."): each product then waits
    #: for the one before it, and the overlap the kernel was written for is gone (+21-46% on the
    #: soft-capped forward, kernel log 116).
    wgmma_serialized: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompileResult:
    cubin: bytes
    log: str
    compiler: str
    resources: list[ResourceUsage]


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
# ptxas names the function at the end of its performance notes, which come before the resource lines: "in
# the function" for the pipeline-stage reasons (C7513-C7515), "for the function" for too few registers (C7512,
# "insufficient register resources").
_SERIALIZED_RE = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized due to (.*?) "
    r"(?:in|for) the function '([^']+)'"
)


def parse_ptxas_log(log: str) -> list[ResourceUsage]:
    """Resource usage per entry function from `ptxas -v` output (the same text from nvcc and NVRTC)."""
    out: dict[str, ResourceUsage] = {}
    current: ResourceUsage | None = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = out.setdefault(m[1], ResourceUsage(kernel=m[1], arch=m[2]))
            continue
        m = _PROPS_RE.search(line)
        if m:
            # An entry's own properties, or those of a device function ptxas did not inline (called from
            # several entries, listed after each): the latter get a record of their own, dropped below, so
            # their frame line neither overwrites an entry's nor lists that entry twice.
            arch = current.arch if current else "?"
            current = out.setdefault(m[1], ResourceUsage(kernel=m[1], arch=arch))
            continue
        if current is None:
            continue
        m = _FRAME_RE.search(line)
        if m:
            current.stack_frame, current.spill_stores, current.spill_loads = (int(x) for x in m.groups())
            continue
        m = _USED_RE.search(line)
        if m:
            current.registers = int(m[1])
            current.barriers = int(m[2] or 0)
            current.static_smem = int(m[3] or 0)
    for m in _SERIALIZED_RE.finditer(log):
        if m[3] in out:
            out[m[3]].wgmma_serialized = f"{m[1]}: {m[2]}"
    return [r for r in out.values() if not r.kernel.startswith("_Z") or "flash" in r.kernel]


# --------------------------------------------------------------------------------------------------
# nvcc


@cache
def find_nvcc() -> str | None:
    env = os.environ.get("FLASH_ATTENTION_NVCC")
    if env:
        return env
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@cache
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m[2] if m else out.strip().splitlines()[-1] if out.strip() else "unknown"


def compile_nvcc(source: str, arch: str, name: str) -> CompileResult:
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError("nvcc was not found (set CUDA_HOME or FLASH_ATTENTION_NVCC)")
    with tempfile.TemporaryDirectory(prefix="flash_attention_") as tmp:
        src = os.path.join(tmp, "kernel.cu")
        out = os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [
            nvcc,
            "-cubin",
            f"-arch={arch}",
            "-O3",
            *COMMON_FLAGS,
            "-Xptxas=-v",
            *[f"-I{d}" for d in INCLUDE_DIRS],
            "-o",
            out,
            src,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed to compile kernel {name} for {arch}:\n{log}")
        with open(out, "rb") as f:
            cubin = f.read()
    return CompileResult(cubin, log, f"nvcc {nvcc_version(nvcc)}", parse_ptxas_log(log))


# --------------------------------------------------------------------------------------------------
# NVRTC


def _nvrtc_candidates() -> list[str]:
    env = os.environ.get("FLASH_ATTENTION_NVRTC")
    if env:
        return [env]
    found: list[str] = []
    # pip's nvidia-* wheels: nvidia/cu13/lib (CUDA 13) or nvidia/cuda_nvrtc/lib (CUDA 12). The one of the
    # installed torch's CUDA major version comes first: its cubins are known to load on this driver.
    major = _torch_cuda_major()
    patterns = [f"nvidia/cu{major}/lib/libnvrtc.so*"] if major else []
    patterns += ["nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"]
    for pattern in patterns:
        for entry in sys.path:
            found += sorted(glob.glob(os.path.join(entry, pattern)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    found += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    return [f for f in found if "builtins" not in f and "alt" not in os.path.basename(f)]


def _torch_cuda_major() -> str | None:
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    return version.split(".")[0] if version else None


@cache
def load_nvrtc() -> ctypes.CDLL | None:
    for cand in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(cand)
        except OSError:
            continue
        if not hasattr(lib, "nvrtcGetCUBIN"):
            continue
        # NVRTC dlopens libnvrtc-builtins by soname at the first compile; a pip wheel's lib folder is not on
        # the loader's path, so load the one beside libnvrtc first (a loaded soname satisfies the dlopen).
        folder = os.path.dirname(cand)
        for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*")), reverse=True):
            try:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        return lib
    return None


def nvrtc_version(lib: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _nvrtc_check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(status).decode()}")


def compile_nvrtc(source: str, arch: str, name: str) -> CompileResult:
    lib = load_nvrtc()
    if lib is None:
        raise CompileError("NVRTC (libnvrtc.so) was not found")
    prog = ctypes.c_void_p()
    _nvrtc_check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [
            f"--gpu-architecture={arch}",
            *COMMON_FLAGS,
            "--ptxas-options=-v",
            *[f"-I{d}" for d in INCLUDE_DIRS],
        ]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise CompileError(f"NVRTC failed to compile kernel {name} for {arch}:\n{log}")
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return CompileResult(cubin.raw, log, f"nvrtc {nvrtc_version(lib)}", parse_ptxas_log(log))


# --------------------------------------------------------------------------------------------------


def choose_compiler() -> str | None:
    """'nvrtc', 'nvcc', or None when neither is usable. FLASH_ATTENTION_COMPILER forces one."""
    forced = os.environ.get("FLASH_ATTENTION_COMPILER", "").lower()
    if forced in ("nvrtc", "nvcc"):
        return forced
    if load_nvrtc() is not None:
        return "nvrtc"
    if find_nvcc() is not None:
        return "nvcc"
    return None


def compiler_id(kind: str) -> str:
    """Name and version of a compiler, part of every cache key."""
    if kind == "nvrtc":
        lib = load_nvrtc()
        return f"nvrtc {nvrtc_version(lib)}" if lib is not None else "nvrtc ?"
    nvcc = find_nvcc()
    return f"nvcc {nvcc_version(nvcc)}" if nvcc else "nvcc ?"


def compile_source(source: str, arch: str, name: str, kind: str) -> CompileResult:
    if kind == "nvrtc":
        return compile_nvrtc(source, arch, name)
    if kind == "nvcc":
        return compile_nvcc(source, arch, name)
    raise CompileError(f"unknown compiler {kind!r}; expected 'nvrtc' or 'nvcc'")
