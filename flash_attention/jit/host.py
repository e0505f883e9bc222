"""The compiled host library of ``csrc/host/``: the training node (``training_node.cpp``), the repeat call
(``repeat_call.cpp``) and the decode call (``decode_call.cpp``), built on first use.

Our kernels need no host compiler (NVRTC builds them), and neither does this library: it is an
acceleration. Where a C++ compiler is found (``$CXX``, else ``c++``/``g++``/``clang++`` on the PATH) the
source is compiled once against the running PyTorch's headers and kept in the kernel cache folder, keyed by
a hash of the source, the PyTorch version and its C++ ABI, the Python version and the compiler's identity;
where none is found, or the build fails, training runs the same kernels through the Python autograd
function instead, after one warning that says why. ``FLASH_ATTENTION_HOST_LIBRARY=0`` turns it off.

The build takes about half a minute (g++ on PyTorch's headers), which a first call must not wait for: the
callers' question, :func:`ops_or_none`, starts it in a background thread (one line on stderr says so, and
another when it is done) and answers None, the Python path, until the library is on disk; the call after
that loads it, and the listeners of :func:`when_ready` (the launch layer's caches of repeat and decode
calls, which chose the Python path meanwhile) are told. :func:`load` builds in the caller's thread, for the
tools and tests that want the library now; so does ``FLASH_ATTENTION_HOST_LIBRARY=wait``.

The library registers ``torch.ops.flash_attention_host`` (``set_driver``, ``record_training``,
``repeat_call``, ``decode_call``) and the classes ``torch.classes.flash_attention_host.BackwardProgram``,
``ForwardProgram`` and ``DecodeProgram``; :mod:`flash_attention.ops.training`, :mod:`flash_attention.ops.
repeat` and :mod:`flash_attention.ops.decode` use them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from functools import cache
from pathlib import Path

import torch

from . import driver
from .cache import cache_dir

__all__ = [
    "DRIVER_FUNCTION_TYPES",
    "ENV",
    "HostLibraryUnavailable",
    "load",
    "ops_or_none",
    "set_stand_in_driver",
    "source_path",
    "unavailable_reason",
    "wait_for_background_build",
    "when_ready",
]

ENV = "FLASH_ATTENTION_HOST_LIBRARY"
SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "host"
#: The library's translation units; every file of SOURCE_DIR (headers too) goes into its cache key.
SOURCES = (SOURCE_DIR / "training_node.cpp", SOURCE_DIR / "repeat_call.cpp", SOURCE_DIR / "decode_call.cpp")

_lock = threading.Lock()
# "ops" once loaded, or "reason" once it could not be; "builder": the background build's thread, if one ran.
_state: dict[str, object] = {}
#: Called (in the calling thread) once a library built in the background has been loaded.
_ready_listeners: list = []


class HostLibraryUnavailable(RuntimeError):
    """The host library could not be built or loaded here; the message says why."""


def source_path() -> Path:
    """The folder of the library's sources."""
    return SOURCE_DIR


def _compiler() -> str | None:
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env) or (env if os.path.exists(env) else None)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


@cache
def _compiler_identity(cxx: str) -> str:
    run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return run.stdout.splitlines()[0] if run.stdout else cxx


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = [
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
    ]
    flags += [f"-I{d}" for d in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    flags += [f"-L{d}" for d in libs] + [f"-Wl,-rpath,{d}" for d in libs]
    return flags + ["-lc10", "-ltorch_cpu", "-ltorch"]


def _library_path(cxx: str) -> Path:
    return cache_dir() / "host" / f"host_library-{_library_digest(cxx)}.so"


@cache  # (asked by the first call that wants the library, and again by its load: it reads the sources)
def _library_digest(cxx: str) -> str:
    h = hashlib.sha256()
    sources = sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    for part in (
        *(p.name.encode() + b"\0" + p.read_bytes() for p in sources),
        torch.__version__.encode(),
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")).encode(),
        sys.version.encode(),
        _compiler_identity(cxx).encode(),
        " ".join(_flags()).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _build(cxx: str, target: Path) -> None:
    """Compile into ``target`` through a temporary file and a rename (two processes may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        run = subprocess.run(
            [cxx, *map(str, SOURCES), "-o", tmp, *_flags()], capture_output=True, text=True, timeout=900
        )
        if run.returncode != 0:
            names = ", ".join(p.name for p in SOURCES)
            raise HostLibraryUnavailable(
                f"{cxx} could not compile {names} (exit {run.returncode}):\n{run.stderr[-4000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


#: The C types of the driver entry points ``set_driver`` takes (cuLaunchKernel, cuCtxGetCurrent,
#: cuCtxSetCurrent, cuGetErrorString, cuTensorMapEncodeTiled, cuLaunchKernelEx), for whoever hands the
#: library stand-ins (the CPU tests and tools). cuLaunchKernelEx takes (config, kernel, params, extra), the
#: config laid out as jit.driver.LaunchConfig.
DRIVER_FUNCTION_TYPES = (
    ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
    ),
    ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)),
    ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p),
    ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ),
    ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(driver.LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ),
)  # fmt: skip


def set_stand_in_driver(
    host_ops, launch, ctx_get, ctx_set, error_string, encode_tiled=None, launch_ex=None
) -> tuple:
    """Hand the library Python stand-ins for the driver's entry points (signatures as the driver's, see
    DRIVER_FUNCTION_TYPES; ``encode_tiled`` and ``launch_ex`` may be None: without ``launch_ex`` programmatic
    launches go through ``launch``); returns the C function objects, which must outlive every launch through
    them. The next :func:`load` that connects the driver hands the real one back."""
    given = (launch, ctx_get, ctx_set, error_string, encode_tiled, launch_ex)
    functions = [
        None if fn is None else kind(fn) for kind, fn in zip(DRIVER_FUNCTION_TYPES, given, strict=True)
    ]
    host_ops.set_driver(*(0 if f is None else _address(f) for f in functions))
    _state.pop("driver", None)
    return tuple(functions)


def _load():
    if os.environ.get(ENV, "1") == "0":
        raise HostLibraryUnavailable(f"{ENV}=0")
    cxx = _compiler()
    if cxx is None:
        raise HostLibraryUnavailable("no C++ compiler was found (set CXX, or install g++)")
    target = _library_path(cxx)
    if not target.exists():
        _build(cxx, target)
    torch.ops.load_library(str(target))
    return torch.ops.flash_attention_host


def _connect_driver(host_ops) -> None:
    """Hand libcuda's entry points to the library (it links against no CUDA library of its own)."""
    lib = driver.libcuda()
    # cuTensorMapEncodeTiled and cuLaunchKernelEx came with CUDA 12.0; without the first no program has
    # tensor maps (no TMA kernel runs), without the second programmatic launches are ordinary ones.
    encode = getattr(lib, "cuTensorMapEncodeTiled", None)
    launch_ex = getattr(lib, "cuLaunchKernelEx", None)
    host_ops.set_driver(
        _address(lib.cuLaunchKernel),
        _address(lib.cuCtxGetCurrent),
        _address(lib.cuCtxSetCurrent),
        _address(lib.cuGetErrorString),
        0 if encode is None else _address(encode),
        0 if launch_ex is None else _address(launch_ex),
    )


def load(connect_driver: bool = True):
    """``torch.ops.flash_attention_host`` (building the library on first use), or HostLibraryUnavailable.
    ``connect_driver=False`` is for the CPU tests, which hand it stand-in launch functions instead."""
    if connect_driver and _state.get("driver"):  # every training call asks: no lock once it is ready
        return _state["ops"]
    with _lock:
        if "ops" not in _state and "reason" not in _state:
            try:
                _state["ops"] = _load()
            except Exception as exc:  # noqa: BLE001 - an optional speed-up: any failure means "use Python"
                _state["reason"] = str(exc) or type(exc).__name__
        if "reason" in _state:
            raise HostLibraryUnavailable(_state["reason"])
        host_ops = _state["ops"]
        if connect_driver and not _state.get("driver"):
            try:
                _connect_driver(host_ops)
            except Exception as exc:  # noqa: BLE001 - as above
                _state["reason"] = f"handing the CUDA driver to the library failed: {exc}"
                raise HostLibraryUnavailable(_state["reason"]) from exc
            _state["driver"] = True
        return host_ops


def unavailable_reason() -> str | None:
    """None when :func:`load` succeeds (building the library if needed), else why it cannot."""
    try:
        load(connect_driver=False)
    except HostLibraryUnavailable as exc:
        return str(exc)
    return None


def when_ready(listener) -> None:
    """Call ``listener()`` once a library built in the background has been loaded (see the module
    docstring): for caches that hold a decision made while it was not."""
    _ready_listeners.append(listener)


def _say(message: str) -> None:
    if os.environ.get("FLASH_ATTENTION_QUIET", "") in ("", "0"):
        print(f"flash_attention: {message}", file=sys.stderr, flush=True)


def _build_in_background(cxx: str, target: Path) -> None:
    t0 = time.perf_counter()
    try:
        _build(cxx, target)
    except Exception as exc:  # noqa: BLE001 - any failure means "use Python", said by ops_or_none's warning
        with _lock:
            _state["reason"] = str(exc) or type(exc).__name__
        _say(f"the host library could not be built ({time.perf_counter() - t0:.1f} s); the Python path stays")
        return
    _say(f"host library built in {time.perf_counter() - t0:.1f} s; the next calls use it")


def _loadable_now() -> bool:
    """Whether :func:`load` would answer without compiling: the library is loaded, known unavailable, or on
    disk (or the caller asked to wait for it). Otherwise starts the background build, once, and answers
    False while it runs."""
    with _lock:
        if "ops" in _state or "reason" in _state:
            return True
        builder = _state.get("builder")
        if builder is not None:
            return not builder.is_alive()
        mode = os.environ.get(ENV, "1")
        cxx = _compiler()
        if mode in ("0", "wait") or cxx is None:
            return True  # (load says why it cannot, or builds in this thread)
        try:
            target = _library_path(cxx)
        except Exception:  # noqa: BLE001 - load gives the reason
            return True
        if target.exists():
            return True
        builder = threading.Thread(
            target=_build_in_background, args=(cxx, target), name="flash_attention host library", daemon=True
        )
        _state["builder"] = builder
        _say(
            f"building the host library (C++ training node, repeat calls) with {Path(cxx).name} in the "
            "background, about 30 s; calls take the Python path until it is ready"
        )
        builder.start()
        return False


def wait_for_background_build(timeout: float | None = None) -> bool:
    """Wait for a background build of the library, if one runs; True when none runs any more."""
    builder = _state.get("builder")
    if builder is not None:
        builder.join(timeout)
        return not builder.is_alive()
    return True


def ops_or_none():
    """The library's ops (:func:`load`), or None where it is unavailable or still being built in the
    background (the module docstring), with one warning per process where it is unavailable, unless it was
    turned off on purpose (FLASH_ATTENTION_HOST_LIBRARY=0): what the launch layer's callers (the training
    node, repeat calls, decode calls) ask before taking their native form."""
    if _state.get("driver"):  # every training call asks: nothing more once it is ready
        return _state["ops"]
    if not _loadable_now():
        return None
    try:
        ops = load()
    except HostLibraryUnavailable as exc:
        if not _state.get("warned") and os.environ.get(ENV) != "0":
            _state["warned"] = True
            warn_unavailable(str(exc))
        return None
    if _state.pop("builder", None) is not None:
        for listener in _ready_listeners:
            listener()
    return ops


def warn_unavailable(reason: str) -> None:
    warnings.warn(
        f"flash_attention: training steps run through a Python autograd function (more host time per call) "
        f"because the compiled host library is unavailable: {reason}",
        RuntimeWarning,
        stacklevel=4,
    )
