"""Loaded entry points: each built cubin is loaded once per process and its kernels kept by key.

Torch-free like the rest of the JIT: callers name the GPU's architecture (``"sm_90"``), which the launch
layer reads off the device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..configs import BwdConfig, KernelConfig
from ..configs.decode import DecodeConfig
from ..configs.fp8_cast import FP8_CAST_ENTRY_POINTS, Fp8CastConfig
from ..configs.merge import MERGE_PART_DTYPES, MergeConfig
from ..configs.values_transpose import VALUES_TRANSPOSE_HEAD_DIMS, ValuesTransposeConfig
from . import driver
from .cache import build
from .sources import kernel_symbol, mask_causals, variant_name

__all__ = [
    "get_bwd_kernels",
    "get_decode_kernels",
    "get_fp8_cast_kernels",
    "get_kernel",
    "get_merge_kernels",
    "get_values_transpose_kernels",
]

_loaded: dict[tuple, object] = {}
_lock = threading.Lock()


def _once(key: tuple, load: Callable[[], None]):
    """``_loaded[key]``, running ``load`` (which fills it, and possibly its siblings) the first time: a
    lock-free read for the common case, and one compile per module even when threads race for it."""
    value = _loaded.get(key)
    if value is None:
        with _lock:
            value = _loaded.get(key)
            if value is None:
                load()
                value = _loaded[key]
    return value


def get_kernel(
    cfg: KernelConfig,
    causal: bool,
    arch: str,
    trace: bool = False,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> driver.Kernel:
    """The loaded entry point of ``cfg`` for a GPU of ``arch`` (compiling or reading the cache on first use).

    ``trace=True`` loads the debug build (flash_attention.tools.debug), ``ranged=True`` the key-padding
    build, ``dropout=True`` the dropout build, ``window=True`` the sliding window's (whose one entry point is
    named as not causal); each is cached apart from the normal one.
    """
    variant = variant_name(trace, ranged, dropout, window, score)

    def load() -> None:
        built = build(cfg, arch, trace=trace, ranged=ranged, dropout=dropout, window=window, score=score)
        library = driver.load_library(built.cubin)
        for c in mask_causals(window):
            symbol = kernel_symbol(cfg, c, trace, ranged=ranged, dropout=dropout, window=window, score=score)
            _loaded[(cfg, c, arch, variant)] = driver.get_kernel(library, symbol)

    return _once((cfg, causal, arch, variant), load)


def get_bwd_kernels(
    cfg: BwdConfig,
    arch: str,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> dict[str, driver.Kernel]:
    """The loaded entry points of a backward config, by symbol (compiling or reading the cache once)."""
    k = (cfg, arch, variant_name(False, ranged, dropout, window, score))

    def load() -> None:
        built = build(cfg, arch, ranged=ranged, dropout=dropout, window=window, score=score)
        library = driver.load_library(built.cubin)
        kerns = {kind: driver.get_kernel(library, cfg.symbol(kind)) for kind in cfg.MASK_FREE_KINDS}
        for causal in mask_causals(window):
            for kind in cfg.entry_kinds():
                sym = cfg.symbol(kind, causal, ranged, dropout, window, score)
                kerns[sym] = driver.get_kernel(library, sym)
        _loaded[k] = kerns

    return _once(k, load)


def get_decode_kernels(cfg: DecodeConfig, arch: str) -> dict[str, driver.Kernel]:
    """The loaded entry points of a decode config, by symbol (compiling or reading the cache once)."""
    k = (cfg, arch, "decode")

    def load() -> None:
        built = build(cfg, arch)
        library = driver.load_library(built.cubin)
        symbols = [cfg.symbol("combine")]
        for paged in (False, True):
            symbols.append(cfg.symbol("append", paged=paged))
            symbols += [cfg.symbol("decode", causal, paged) for causal in (False, True)]
        _loaded[k] = {sym: driver.get_kernel(library, sym) for sym in symbols}

    return _once(k, load)


def _entry_points_by(cfg, arch: str, kind: str, keys) -> dict:
    """``cfg``'s entry points ``cfg.symbol(key)`` by key, from one build, compiled or read once."""
    k = (cfg, arch, kind)

    def load() -> None:
        library = driver.load_library(build(cfg, arch).cubin)
        _loaded[k] = {key: driver.get_kernel(library, cfg.symbol(key)) for key in keys}

    return _once(k, load)


def get_merge_kernels(cfg: MergeConfig, arch: str) -> dict[str, driver.Kernel]:
    """The LSE merge's entry points by part dtype ("fp32", "fp16", "bf16"), compiled or read once."""
    return _entry_points_by(cfg, arch, "merge", MERGE_PART_DTYPES)


def get_values_transpose_kernels(cfg: ValuesTransposeConfig, arch: str) -> dict[int, driver.Kernel]:
    """The V^T layout kernel's entry points by head_dim, compiled or read once."""
    return _entry_points_by(cfg, arch, "values_transpose", VALUES_TRANSPOSE_HEAD_DIMS)


def get_fp8_cast_kernels(cfg: Fp8CastConfig, arch: str) -> dict[str, driver.Kernel]:
    """The FP8 casts' entry points by key (FP8_CAST_ENTRY_POINTS: ``amax_bf16``, ``quantize_bf16``, ...,
    ``dequantize``), compiled or read once."""
    return _entry_points_by(cfg, arch, "fp8_cast", FP8_CAST_ENTRY_POINTS)
