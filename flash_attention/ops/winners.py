"""The tuned-winners cache: which kernel configuration won a shape class on this GPU.

``python -m flash_attention autotune`` (:mod:`flash_attention.tools.autotune`) measures candidates and writes
the winners here with :func:`write_cache`; the launch layer (:mod:`flash_attention.ops.select`) reads them
with :func:`lookup` / :func:`lookup_bwd` before falling back to the heuristics of
:mod:`flash_attention.configs`. This module is the only place that knows the file format and the keys, so the
library never imports the tuner.

A table is only used when it was made on a GPU of the same name, with the same compiler and the same kernel
sources (a hash of every file under ``csrc/``): a winner measured on an older kernel is never applied to a
newer one. Two tables are read: the user's (``<kernel cache dir>/autotune.json``, written by the tuner) and
one shipped with the package for a GPU model (``flash_attention/tuned/<gpu>.json``; none ships today, see
docs/kernel-log.md step 11), the user's entries winning.

Keys: ``<dtype>/d<head_dim>/<causal|full>/<seqlen bucket>/<mha|gqa>``, and ``bwd/<the same>`` for the
backward family.
"""

from __future__ import annotations

import json
import math
import re
import threading
from functools import cache
from pathlib import Path

from ..configs import BwdConfig, KernelConfig, padded_head_dim, parse_bwd_config, parse_config
from ..jit import compiler as _compiler
from ..jit.cache import atomic_write, cache_dir, sources_digest

__all__ = [
    "CACHE_FILE",
    "FORMAT_VERSION",
    "SEQLEN_BUCKETS",
    "TUNED_DIR",
    "bwd_entry_key",
    "clear_memo",
    "entry_key",
    "environment_key",
    "gpu_slug",
    "group_bucket",
    "lookup",
    "lookup_bwd",
    "seqlen_bucket",
    "shipped_cache_path",
    "user_cache_path",
    "write_cache",
]

SEQLEN_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)
TUNED_DIR = Path(__file__).resolve().parents[1] / "tuned"  # flash_attention/tuned/ (this module is in ops/)
CACHE_FILE = "autotune.json"
FORMAT_VERSION = 1


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``.

    The vendor prefix is dropped because every GPU we measure is NVIDIA's; it would only lengthen names.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug or "unknown-gpu"


# --------------------------------------------------------------------------------------------------
# Keys


def seqlen_bucket(seqlen: int) -> int:
    """The benchmark length nearest to ``seqlen`` on a log scale (512 below, 16k above)."""
    return min(SEQLEN_BUCKETS, key=lambda b: abs(math.log2(max(seqlen, 1)) - math.log2(b)))


def group_bucket(group: int) -> str:
    # GQA changes which K/V tiles neighbouring blocks share in L2, not the kernel's inner loop: one class
    # for plain multi-head attention and one for every grouped layout.
    return "mha" if group == 1 else "gqa"


def entry_key(dtype: str, head_dim: int, causal: bool, seqlen: int, group: int) -> str:
    mask = "causal" if causal else "full"
    return f"{dtype}/d{padded_head_dim(head_dim)}/{mask}/{seqlen_bucket(seqlen)}/{group_bucket(group)}"


def bwd_entry_key(dtype: str, head_dim: int, causal: bool, seqlen: int, group: int) -> str:
    return "bwd/" + entry_key(dtype, head_dim, causal, seqlen, group)


# --------------------------------------------------------------------------------------------------
# Files


def environment_key(gpu: str | None = None) -> dict:
    """What a table must have been made with to apply here: compiler, kernel sources (and GPU)."""
    kind = _compiler.choose_compiler()
    env = {"compiler": _compiler.compiler_id(kind) if kind else "none", "sources": sources_digest()}
    if gpu is not None:
        env["gpu"] = gpu
    return env


def user_cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def shipped_cache_path(gpu: str) -> Path:
    return TUNED_DIR / f"{gpu_slug(gpu)}.json"


def _load(path: Path, want: dict) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("format") != FORMAT_VERSION:
        return {}
    for k, v in want.items():
        if data.get(k) != v:
            return {}  # another GPU, compiler or kernel: its winners say nothing about this one
    return data.get("entries", {})


_tables: dict[str, dict[str, dict]] = {}
_tables_lock = threading.Lock()


def _table(gpu: str) -> dict[str, dict]:
    table = _tables.get(gpu)
    if table is None:
        with _tables_lock:
            want = environment_key(gpu)
            table = dict(_load(shipped_cache_path(gpu), want))
            table.update(_load(user_cache_path(), want))  # the user's own tuning wins
            _tables[gpu] = table
    return table


def write_cache(path: Path, gpu: str, entries: dict[str, dict]) -> None:
    """Merge ``entries`` into the table at ``path`` (entries of another GPU/compiler/source are dropped)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    env = environment_key(gpu)
    merged = old.get("entries", {}) if all(old.get(k) == v for k, v in env.items()) else {}
    merged.update(entries)
    data = {"format": FORMAT_VERSION, **env, "entries": dict(sorted(merged.items()))}
    atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    clear_memo()


def clear_memo() -> None:
    """Forget the tables read so far (after the tuner wrote one, or in tests)."""
    _tables.clear()
    _lookup.cache_clear()
    _lookup_bwd.cache_clear()


def table_entry(gpu: str, keys: list[str]) -> str | None:
    """The config name of the first of ``keys`` this GPU's tables have a winner for (GQA classes fall back
    to the multi-head entry, one dtype to the other, by the order of ``keys``), or None."""
    table = _table(gpu)
    for key in keys:
        entry = table.get(key)
        if entry:
            return entry["config"]
    return None


# --------------------------------------------------------------------------------------------------
# Lookups (memoised: attention() asks on every call)


def lookup(
    gpu: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, group: int
) -> KernelConfig | None:
    """The tuned forward winner for this problem on this GPU, or None."""
    return _lookup(
        gpu, dtype, padded_head_dim(head_dim), causal, seqlen_bucket(max(seqlen_q, seqlen_k)), group > 1
    )


@cache
def _lookup(gpu: str, dtype: str, d: int, causal: bool, bucket: int, gqa: bool) -> KernelConfig | None:
    # fp16 and bf16 kernels differ only in the mma and convert instructions' type suffix, so a winner
    # tuned for one dtype stands in for the other when that one was not tuned.
    other = "fp16" if dtype == "bf16" else "bf16"
    keys = [entry_key(dt, d, causal, bucket, g) for dt in (dtype, other) for g in ((2, 1) if gqa else (1,))]
    found = table_entry(gpu, keys)
    try:
        return parse_config(found).replace(dtype=dtype) if found else None
    except ValueError:
        return None


def lookup_bwd(
    gpu: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, group: int
) -> BwdConfig | None:
    """The tuned backward winner for this problem on this GPU, or None."""
    return _lookup_bwd(
        gpu, dtype, padded_head_dim(head_dim), causal, seqlen_bucket(max(seqlen_q, seqlen_k)), group > 1
    )


@cache
def _lookup_bwd(gpu: str, dtype: str, d: int, causal: bool, bucket: int, gqa: bool) -> BwdConfig | None:
    # No dtype stand-in here: a backward config names its dtype and is compiled for it.
    found = table_entry(gpu, [bwd_entry_key(dtype, d, causal, bucket, g) for g in ((2, 1) if gqa else (1,))])
    try:
        return parse_bwd_config(found) if found else None
    except ValueError:
        return None
