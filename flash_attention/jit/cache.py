"""Compile a translation unit once per (sources, config, arch, compiler), and keep the cubin on disk.

The cache lives in ``$FLASH_ATTENTION_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flash_attention`` or
``~/.cache/flash_attention``). An entry is keyed by a hash of the kernel sources, the generated translation
unit (which contains the config), the target architecture and the compiler's name and version, so editing a
kernel, upgrading the compiler or changing a config can never load a stale binary. Entries are written to a
temporary file and renamed into place: a concurrent reader sees either nothing or a whole file, and two
processes compiling the same kernel at once both succeed, the second rename replacing an identical file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..configs import BwdConfig, KernelConfig, is_wgmma
from ..configs.architectures import architecture
from . import compiler as _compiler
from .sources import kernel_source, variant_name

__all__ = [
    "BuiltKernel",
    "atomic_write",
    "build",
    "cache_dir",
    "cache_key",
    "prefetch",
    "sources_digest",
    "target_arch",
]


def cache_dir() -> Path:
    env = os.environ.get("FLASH_ATTENTION_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash_attention"


@cache
def sources_digest() -> str:
    """Hash of every shipped kernel source file (headers included)."""
    h = hashlib.sha256()
    for path in sorted(_compiler.CSRC.rglob("*")):
        if path.is_file() and path.suffix in (".cuh", ".h", ".cu"):
            h.update(str(path.relative_to(_compiler.CSRC)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(
    cfg: KernelConfig | BwdConfig,
    arch: str,
    compiler_id: str,
    trace: bool = False,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> str:
    h = hashlib.sha256()
    source = kernel_source(cfg, trace, ranged=ranged, dropout=dropout, window=window, score=score)
    for part in (sources_digest(), source, arch, compiler_id, " ".join(_compiler.COMMON_FLAGS)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass
class BuiltKernel:
    cfg: KernelConfig | BwdConfig
    arch: str
    compiler: str
    cubin: bytes
    meta: dict  # resources, compile time, log
    from_cache: bool


def _quiet() -> bool:
    return os.environ.get("FLASH_ATTENTION_QUIET", "") not in ("", "0")


class _Ticker:
    """Tells the person waiting about a compile that takes a while: nothing for one under ``quiet_under``
    seconds (most take 0.1-0.3 s on a GPU host: an H200's cold-start run), then one line when it is done
    with what it was and how long it took; a compile still running after ``first`` seconds also says so,
    then every ``every`` seconds, so that a long one is never a silent wait (issue 49)."""

    def __init__(self, what: str, quiet_under: float = 1.0, first: float = 5.0, every: float = 10.0):
        self.what, self.quiet_under, self.first, self.every = what, quiet_under, first, every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self.t0 = time.perf_counter()
        if not _quiet():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        wait = self.first
        while not self._stop.wait(wait):
            print(
                f"flash_attention: still compiling {self.what} ({time.perf_counter() - self.t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            wait = self.every

    def __exit__(self, *exc):
        self._stop.set()
        self.elapsed = time.perf_counter() - self.t0
        if not _quiet() and exc[0] is None and self.elapsed >= self.quiet_under:
            print(
                f"flash_attention: compiled {self.what} in {self.elapsed:.1f} s", file=sys.stderr, flush=True
            )


def target_arch(cfg: KernelConfig | BwdConfig, arch: str) -> str:
    """The architecture ``cfg`` compiles for on a GPU of ``arch``: wgmma configs need the sm_90a target
    (wgmma has no portable form), and run on sm_90 only."""
    if not is_wgmma(cfg):
        return arch
    target = architecture(arch).kernel_target
    if target is None:
        raise ValueError(f"config {cfg.name()} uses wgmma, which needs an sm_90 GPU (H100/H200); got {arch}")
    return target


def build(
    cfg: KernelConfig | BwdConfig,
    arch: str,
    compiler: str | None = None,
    *,
    force: bool = False,
    trace: bool = False,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> BuiltKernel:
    """Compile ``cfg`` for ``arch`` (e.g. 'sm_90'), or take it from the disk cache.

    ``trace=True`` builds the debug variant (csrc/include/fa/trace.cuh), ``ranged=True`` the key-padding
    variant, ``dropout=True`` the dropout variant, ``window=True`` the sliding window's; each is cached under
    its own key.
    """
    arch = target_arch(cfg, arch)
    kind = compiler or _compiler.choose_compiler()
    if kind is None:
        raise _compiler.CompileError(
            "no CUDA compiler found: install PyTorch's CUDA build (it ships NVRTC) or a CUDA toolkit (nvcc)"
        )
    cid = _compiler.compiler_id(kind)
    key = cache_key(cfg, arch, cid, trace, ranged=ranged, dropout=dropout, window=window, score=score)
    root = cache_dir()
    cubin_path, meta_path = root / f"{key}.cubin", root / f"{key}.json"
    if not force:
        cached = _cached(cfg, arch, cid, cubin_path, meta_path)
        if cached is not None:
            return cached
    # One compile per key in this process: a thread that asks for a key another is compiling (a prefetch,
    # below, or a racing caller) waits for that compile instead of starting its own.
    with _in_flight_lock:
        running = _in_flight.get(key)
        if running is None:
            _in_flight[key] = mine = Future()
    if running is not None:
        return running.result()
    # A compile that ended between the disk check above and the lock has written its entry and left
    # _in_flight: look again before compiling the same key a second time.
    cached = None if force else _cached(cfg, arch, cid, cubin_path, meta_path)
    if cached is not None:
        with _in_flight_lock:
            del _in_flight[key]
        mine.set_result(cached)
        return cached
    try:
        built = _compile_into_cache(cfg, arch, kind, cid, trace, ranged, dropout, window, score, root, key)
    except BaseException as exc:
        mine.set_exception(exc)
        raise
    finally:
        with _in_flight_lock:
            del _in_flight[key]
    mine.set_result(built)
    return built


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached(cfg, arch: str, cid: str, cubin_path: Path, meta_path: Path) -> BuiltKernel | None:
    """The disk cache's entry, or None where there is none whole. The metadata holds the cubin's digest: a
    cubin cut short or damaged on disk (a full disk, a copy interrupted half way) is never handed to the
    driver, but rebuilt."""
    if not (cubin_path.exists() and meta_path.exists()):
        return None
    try:
        cubin, meta = cubin_path.read_bytes(), json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None  # a damaged entry is rebuilt
    if meta.get("cubin_sha256", _digest(cubin)) != _digest(cubin):
        return None
    return BuiltKernel(cfg, arch, cid, cubin, meta, True)


_in_flight: dict[str, Future] = {}  # cache key -> the compile running for it in this process
_in_flight_lock = threading.Lock()
_prefetcher: ThreadPoolExecutor | None = None


def prefetch(cfg: KernelConfig | BwdConfig, arch: str, **variant) -> Future | None:
    """Compile ``cfg`` (with :func:`build`'s ``variant`` keywords) into the disk cache on a background
    thread, unless it is there already: for a kernel a call is about to need after another one (the
    backward of a training call, started beside its forward's compile). A later :func:`build` of it waits
    for this compile rather than repeating it. Best effort: returns None, and the later build reports the
    error, when the compile cannot be planned or fails."""
    global _prefetcher
    try:
        target = target_arch(cfg, arch)
        kind = _compiler.choose_compiler()
        if kind is None:
            return None
        key = cache_key(cfg, target, _compiler.compiler_id(kind), False, **variant)
        if (cache_dir() / f"{key}.cubin").exists():
            return None
    except Exception:  # noqa: BLE001 - the build that needs it says what is wrong
        return None
    with _in_flight_lock:
        if _prefetcher is None:
            _prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flash_attention compile")
    return _prefetcher.submit(build, cfg, arch, **variant)


def _compile_into_cache(
    cfg, arch, kind, cid, trace, ranged, dropout, window, score, root, key
) -> BuiltKernel:
    """build()'s compile of a cache miss: the source, the compiler, then the entry (metadata first)."""
    cubin_path, meta_path = root / f"{key}.cubin", root / f"{key}.json"
    variant = variant_name(trace, ranged, dropout, window, score)
    what = f"{cfg.name()}{f' ({variant} build)' if variant else ''}"
    with _Ticker(f"{what} for {arch} with {cid}") as tick:
        source = kernel_source(cfg, trace, ranged=ranged, dropout=dropout, window=window, score=score)
        result = _compiler.compile_source(source, arch, what, kind)
    meta = {
        "config": cfg.name(),
        "trace": trace,
        "ranged": ranged,
        "dropout": dropout,
        "window": window,
        "score": score,
        "arch": arch,
        "compiler": result.compiler,
        "compile_seconds": round(tick.elapsed, 2),
        "cubin_sha256": _digest(result.cubin),
        "resources": [r.to_dict() for r in result.resources],
        "log": result.log,
    }
    try:
        # Metadata first: a cubin on disk always has its metadata beside it.
        atomic_write(meta_path, json.dumps(meta, indent=1).encode())
        atomic_write(cubin_path, result.cubin)
    except OSError as exc:
        # A read-only or full cache costs a compile per process, never the call itself.
        _warn_unwritable(root, exc)
    return BuiltKernel(cfg, arch, cid, result.cubin, meta, False)


_unwritable_warned: set[str] = set()


def _warn_unwritable(root: Path, exc: OSError) -> None:
    if str(root) in _unwritable_warned:
        return
    _unwritable_warned.add(str(root))
    warnings.warn(
        f"flash_attention: the kernel cache {root} is not writable ({exc}); compiled kernels are kept in "
        "this process only and compiled again in the next. Set FLASH_ATTENTION_CACHE_DIR to a writable "
        "folder.",
        RuntimeWarning,
        stacklevel=3,
    )
