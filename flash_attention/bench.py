"""``python -m flash_attention bench``: the benchmark sweep of DESIGN.md, its result files and README table.

The sweep follows the FlashAttention papers: 16k tokens per batch (batch = 16384 / seqlen), model width 2048
(heads = 2048 / head_dim), seqlen 512 ... 16k, bf16, forward. Every implementation runs in the same process on
the same GPU: ours (``flash_attention``), ``scaled_dot_product_attention`` pinned to each of its backends
(``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``) and ``torch.compile(flex_attention)`` (``flex``), plus an
8192^3 bf16 matmul as the ceiling of the day (the same GPU model measures 680-800 TFLOP/s on different days,
so a ratio is only meaningful against a ceiling taken in the same run).

Results go to ``benchmarks/results/<gpu>-<yyyy-mm-dd>[-<tag>].json`` in the one shape DESIGN.md fixes; the
README table is generated from such a file by :func:`update_readme`, which needs no GPU.

The functions without a GPU in their signature (:func:`flops`, :func:`results_to_markdown`,
:func:`results_to_text`, :func:`ratio_summary`, :func:`write_results`, :func:`load_results`,
:func:`update_readme`, :func:`gpu_slug`) are pure and tested on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_IMPLS",
    "DEFAULT_SEQLENS",
    "DEFAULT_HEAD_DIMS",
    "flops",
    "gpu_slug",
    "ratio_summary",
    "results_to_markdown",
    "results_to_text",
    "results_header",
    "write_results",
    "load_results",
    "newest_results",
    "update_readme",
    "run_main_job",
    "main",
]

DEFAULT_IMPLS = ("flash_attention", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128, 256)
MODES = ("fwd", "bwd", "fwd_bwd")
OURS = "flash_attention"
#: Baselines of our ratio rows and summaries: FlashAttention-2 inside PyTorch (the bar of the
#: first kernel issue) and cuDNN (the best peer on Hopper, the bar of the project).
RATIO_BASELINES = ("sdpa_flash", "sdpa_cudnn")

#: Backward FLOPs are 2.5x the forward's (five matmuls of the same size instead of two), so fwd+bwd is 3.5x.
_MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}

#: Keys every result file and every row has (DESIGN.md "Benchmarks"); tools read these and nothing else.
RESULT_KEYS = ("gpu", "driver", "cuda", "torch", "commit", "matmul_tflops", "rows")
ROW_KEYS = ("impl", "mode", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "ms", "tflops")

README_BEGIN = "<!-- bench:begin -->"
README_END = "<!-- bench:end -->"

_PACKAGE_DIR = Path(__file__).resolve().parent


# ================================================================================================
# Pure helpers (no GPU, no torch)


def flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool, mode: str = "fwd"
) -> float:
    """Floating-point operations of one attention call, by the FlashAttention papers' convention.

    Forward: two matmuls (Q K^T and P V) of 2·N_q·N_k·d each per head, so 4·B·H·N_q·N_k·d. Causal keeps the
    area under the bottom-right-aligned diagonal as a continuous triangle: exactly half when N_q == N_k (the
    papers' "halved for causal", not the exact (N+1)/2N of a discrete mask), N_q·N_k - N_q²/2 when the
    queries are the last N_q positions of a longer key sequence, and N_k²/2 when N_q > N_k (the first
    N_q - N_k query rows see no key). Backward is 2.5x the forward, forward+backward 3.5x.
    """
    if mode not in _MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if causal:
        if seqlen_k >= seqlen_q:
            area = seqlen_q * seqlen_k - seqlen_q * seqlen_q / 2
        else:
            area = seqlen_k * seqlen_k / 2
    else:
        area = float(seqlen_q * seqlen_k)
    return 4.0 * batch * heads * area * head_dim * _MODE_FLOP_FACTOR[mode]


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``.

    The vendor prefix is dropped because every GPU we measure is NVIDIA's; it would only lengthen names.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug)
    return slug or "unknown-gpu"


def _seqlen_label(n: int) -> str:
    # The papers' column labels: 1k, 2k, ... 16k; anything not a whole multiple of 1024 stays a number.
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_tflops(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.2f}×"


def _impl_order(impls: Iterable[str]) -> list[str]:
    known = [i for i in DEFAULT_IMPLS if i in impls]
    return known + sorted(set(impls) - set(DEFAULT_IMPLS))


def _row_key(row: dict) -> tuple:
    return (row["impl"], row["mode"], row["dtype"], row["head_dim"], bool(row["causal"]), row["seqlen"])


@dataclass
class _Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    summaries: list[str]


def _group(
    rows: Sequence[dict],
) -> dict[tuple[str, str], dict[tuple[int, bool], dict[str, dict[int, float]]]]:
    """(mode, dtype) -> (head_dim, causal) -> impl -> seqlen -> TFLOP/s; a repeated point keeps its last."""
    out: dict = {}
    for r in rows:
        g = out.setdefault((r["mode"], r["dtype"]), {})
        g.setdefault((int(r["head_dim"]), bool(r["causal"])), {}).setdefault(r["impl"], {})[
            int(r["seqlen"])
        ] = float(r["tflops"])
    return out


def _ratios(points: dict[str, dict[int, float]], baseline: str) -> dict[int, float]:
    ours, base = points.get(OURS, {}), points.get(baseline, {})
    return {n: ours[n] / base[n] for n in ours if n in base and base[n] > 0}


def ratio_summary(
    rows: Sequence[dict], baseline: str, mode: str = "fwd", dtype: str | None = None
) -> dict | None:
    """min / median / max of ``flash_attention / baseline`` TFLOP/s over every point both measured.

    Returns ``{"baseline", "mode", "min", "median", "max", "points", "worst"}`` (``worst`` names the point of
    the minimum as ``(head_dim, causal, seqlen)``), or None when no point has both.
    """
    ratios: list[tuple[float, tuple[int, bool, int]]] = []
    for (m, dt), shapes in _group(rows).items():
        if m != mode or (dtype is not None and dt != dtype):
            continue
        for (d, causal), points in shapes.items():
            ratios += [(x, (d, causal, n)) for n, x in _ratios(points, baseline).items()]
    if not ratios:
        return None
    values = [x for x, _ in ratios]
    worst = min(ratios)[1]
    return {
        "baseline": baseline,
        "mode": mode,
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "points": len(values),
        "worst": worst,
    }


def _summary_line(s: dict) -> str:
    d, causal, n = s["worst"]
    return (
        f"{OURS} / {s['baseline']}: min {s['min']:.2f}× (d={d}, {'causal' if causal else 'non-causal'}, "
        f"seqlen {_seqlen_label(n)}), median {s['median']:.2f}×, max {s['max']:.2f}× "
        f"over {s['points']} point{'s' if s['points'] != 1 else ''}"
    )


def _tables(result: dict) -> list[_Table]:
    """One table per (mode, dtype): rows (head_dim, causal, impl) plus ratio rows, columns the seqlens."""
    tables = []
    grouped = _group(result.get("rows", []))
    for mode, dtype in sorted(grouped, key=lambda k: (MODES.index(k[0]) if k[0] in MODES else 99, k)):
        shapes = grouped[(mode, dtype)]
        seqlens = sorted({n for points in shapes.values() for per in points.values() for n in per})
        body: list[list[str]] = []
        for d, causal in sorted(shapes):
            points = shapes[(d, causal)]
            prefix = [str(d), "yes" if causal else "no"]
            for impl in _impl_order(points):
                body.append(prefix + [impl] + [_fmt_tflops(points[impl].get(n)) for n in seqlens])
            for base in RATIO_BASELINES:
                if OURS in points and base in points:
                    r = _ratios(points, base)
                    body.append(prefix + [f"{OURS} / {base}"] + [_fmt_ratio(r.get(n)) for n in seqlens])
        summaries = []
        for base in RATIO_BASELINES:
            s = ratio_summary(result.get("rows", []), base, mode, dtype)
            if s is not None:
                summaries.append(_summary_line(s))
        headers = ["d", "causal", "impl"] + [_seqlen_label(n) for n in seqlens]
        tables.append(_Table(f"{mode} (TFLOP/s, {dtype})", headers, body, summaries))
    return tables


def _config_notes(result: dict) -> list[str]:
    """Which kernel configuration our rows ran, per (mode, head_dim, causal), with the seqlens of each."""
    seen: dict[tuple, dict[str, list[int]]] = {}
    for r in result.get("rows", []):
        if r["impl"] == OURS and r.get("config"):
            key = (r["mode"], r["dtype"], int(r["head_dim"]), bool(r["causal"]))
            seen.setdefault(key, {}).setdefault(r["config"], []).append(int(r["seqlen"]))
    notes = []
    for (mode, dtype, d, causal), cfgs in sorted(seen.items()):
        for cfg, ns in cfgs.items():
            where = ", ".join(_seqlen_label(n) for n in sorted(set(ns)))
            notes.append(f"{mode} {dtype} d={d} {'causal' if causal else 'non-causal'} ({where}): `{cfg}`")
    return notes


def results_to_markdown(result: dict) -> str:
    """The README tables of a result: one per mode (and dtype), TFLOP/s, with ratio rows and summaries."""
    parts = []
    for t in _tables(result):
        align = ["---:", "---", "---"] + ["---:"] * (len(t.headers) - 3)
        lines = [f"### {t.title}", "", _md_row(t.headers), _md_row(align)]
        lines += [_md_row(r) for r in t.rows]
        if t.summaries:
            lines.append("")
            lines += [f"- {s}" for s in t.summaries]
        parts.append("\n".join(lines))
    notes = _config_notes(result)
    if notes:
        parts.append("<details><summary>Kernel configurations of the flash_attention rows</summary>\n\n")
        parts[-1] += "\n".join(f"- {n}" for n in notes) + "\n\n</details>"
    return "\n\n".join(parts) + "\n"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def results_to_text(result: dict) -> str:
    """The same tables as :func:`results_to_markdown`, aligned for a terminal."""
    out = []
    for t in _tables(result):
        widths = [max(len(c) for c in col) for col in zip(t.headers, *t.rows, strict=False)]
        fmt = [(str.rjust if i != 1 and i != 2 else str.ljust) for i in range(len(t.headers))]

        def line(cells: Sequence[str], widths: list[int] = widths, fmt: list = fmt) -> str:
            return "  ".join(f(c, w) for f, c, w in zip(fmt, cells, widths, strict=True)).rstrip()

        out += [t.title, line(t.headers), line(["-" * w for w in widths])]
        out += [line(r) for r in t.rows]
        out += t.summaries
        out.append("")
    return "\n".join(out)


def results_header(result: dict, results_path: str | None = None) -> str:
    """One line naming where and how a result file was measured."""
    ceiling = result.get("matmul_tflops")
    ceiling_txt = (
        f"{ceiling:.0f} TFLOP/s" if isinstance(ceiling, int | float) and math.isfinite(ceiling) else "n/a"
    )
    text = (
        f"Measured on {result.get('gpu', 'unknown GPU')} (driver {result.get('driver', 'unknown')}), "
        f"torch {result.get('torch', '?')}, CUDA {result.get('cuda', '?')}, "
        f"commit `{result.get('commit', '?')}`, "
        f"{result.get('date', 'unknown date')}; 8192³ bf16 matmul in the same run: {ceiling_txt}."
    )
    if results_path:
        text += f" Source: [`{results_path}`]({results_path})."
    return text


def _json_safe(x: Any) -> Any:
    # JSON has no NaN/Infinity; a NaN max-diff must still load in every tool, so it becomes null.
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def write_results(result: dict, path: str | os.PathLike) -> Path:
    """Write a result dict as JSON, one row per line (small git diffs), atomically (temp file + rename)."""
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"result is missing the keys {missing} that DESIGN.md requires")
    result = _json_safe(result)
    lines = []
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            items = ",\n".join("    " + json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_results(path: str | os.PathLike) -> dict:
    """Read a result file, checking the keys DESIGN.md fixes (so a tool fails here, not deep inside)."""
    path = Path(path)
    result = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(result, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    for i, row in enumerate(result["rows"]):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} is missing keys {missing}")
    return result


def _repo_root() -> Path:
    """The checkout holding the package when it is installed editable, else the current directory."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def default_results_dir() -> Path:
    return _repo_root() / "benchmarks" / "results"


def newest_results(directory: str | os.PathLike | None = None) -> Path:
    """The newest full-sweep result file in ``directory`` (default ``benchmarks/results``).

    Newest by the timestamp recorded inside (file times are meaningless after a git checkout); files of
    ``--quick`` runs are only chosen when there is nothing else.
    """
    directory = Path(directory) if directory is not None else default_results_dir()
    candidates = []
    for p in sorted(directory.glob("*.json")):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or "rows" not in r:
            continue
        quick = bool((r.get("settings") or {}).get("quick"))
        stamp = str(r.get("timestamp") or r.get("date") or "")
        candidates.append((not quick, stamp, p.stat().st_mtime, p.name, p))
    if not candidates:
        raise FileNotFoundError(f"no result files (*.json with rows) in {directory}")
    return max(candidates)[-1]


def replace_marked_region(readme_path: Path, begin_marker: str, end_marker: str, block: str) -> None:
    """Rewrite the text between two marker lines of a README; everything outside stays byte for byte."""
    text = readme_path.read_text(encoding="utf-8")
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin < 0 or end < 0 or end < begin:
        raise ValueError(f"{readme_path} must contain {begin_marker!r} followed by {end_marker!r}")
    new_text = text[: begin + len(begin_marker)] + "\n" + block + "\n" + text[end:]
    readme_path.write_text(new_text, encoding="utf-8")


def update_readme(readme_path: str | os.PathLike, results_path: str | os.PathLike) -> str:
    """Replace the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` (for a training-mode
    result, its own markers: :func:`readme_markers`) with a result's tables.

    Returns the new block. The markers stay; everything outside them is left byte for byte. A PNG plot with
    the result file's name next to it (``--plot``) is embedded when present.
    """
    readme_path, results_path = Path(readme_path), Path(results_path)
    result = load_results(results_path)
    begin, end = readme_markers(result)
    rel = os.path.relpath(results_path.resolve(), readme_path.resolve().parent).replace(os.sep, "/")
    block = [
        results_header(result, rel),
        "",
        f"Generated by `python -m flash_attention bench --update-readme {rel}`; do not edit by hand.",
        "",
    ]
    # The plots `bench --plot` writes beside the result file, one per head_dim.
    for plot in sorted(
        results_path.parent.glob(f"{results_path.stem}-d*.png"), key=lambda p: int(p.stem.rsplit("-d", 1)[1])
    ):
        plot_rel = os.path.relpath(plot.resolve(), readme_path.resolve().parent).replace(os.sep, "/")
        block += [f"![TFLOP/s by sequence length, {plot.stem.rsplit('-', 1)[1]}]({plot_rel})", ""]
    block.append(results_to_markdown(result).rstrip("\n"))
    new_block = "\n".join(block)
    replace_marked_region(readme_path, begin, end, new_block)
    return new_block


def readme_markers(result: dict) -> tuple[str, str]:
    """The README region a result file's tables go to: ``<!-- bench:begin -->`` for a file with forward
    rows, ``<!-- bench-<mode>:begin -->`` for one that measured only a training mode (fwd_bwd or bwd), so the
    forward and training tables are generated from their own runs side by side."""
    mode = result_mode(result)
    if mode == "fwd":
        return README_BEGIN, README_END
    return f"<!-- bench-{mode}:begin -->", f"<!-- bench-{mode}:end -->"


def result_mode(result: dict) -> str:
    """The mode a result file is about: ``fwd`` when it has forward rows (or none), else its training mode
    (``fwd_bwd`` before ``bwd``)."""
    modes = {r.get("mode", "fwd") for r in result.get("rows", [])}
    if not modes or "fwd" in modes:
        return "fwd"
    return "fwd_bwd" if "fwd_bwd" in modes else sorted(modes)[0]


# ================================================================================================
# Environment


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_commit() -> str:
    """Short commit of the checkout holding the package, ``-dirty`` when tracked files differ from it."""
    commit = _run(["git", "rev-parse", "--short", "HEAD"], cwd=_PACKAGE_DIR)
    if not commit:
        return "unknown"
    # Untracked files (scratch results, caches) don't change what was measured; modified tracked files do.
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_PACKAGE_DIR)
    return commit + ("-dirty" if status else "")


def _driver_version() -> str:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else "unknown"


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("flash_attention")
    except Exception:
        return getattr(sys.modules.get("flash_attention"), "__version__", "unknown")


def environment(device: Any) -> dict:
    """The metadata block of a result file for a CUDA ``device``."""
    import torch

    props = torch.cuda.get_device_properties(device)
    now = _dt.datetime.now().astimezone()
    env = {
        "gpu": torch.cuda.get_device_name(device),
        "driver": _driver_version(),
        "cuda": torch.version.cuda or "unknown",
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "flash_attention_version": _package_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    return env


# ================================================================================================
# Timing


@dataclass
class Timing:
    ms: float  # median
    ms_min: float
    reps: int


def time_cuda(
    fn: Callable[[int], Any],
    n_sets: int = 1,
    *,
    warmup: int = 3,
    min_reps: int = 25,
    min_time_s: float = 0.2,
    max_reps: int = 5000,
) -> Timing:
    """Median time of ``fn(i)`` in milliseconds, measured with CUDA events on the current stream.

    ``fn(i)`` runs on input set ``i % n_sets``. Rotating sets keeps small problems from being timed out of a
    warm L2, which is not how attention runs inside a model. Every call gets its own pair of events, so the
    median discards the odd slow call (clock changes, another process) instead of averaging it in. The calls
    are queued back to back: the CPU stays ahead of the GPU for any call longer than its launch overhead, so
    the events measure GPU time; for calls shorter than their launch, the launch is what a user pays anyway.
    """
    import torch

    for i in range(max(warmup, 1)):  # the first call compiles (JIT kernel, torch.compile of flex)
        fn(i % n_sets)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 3
    start.record()
    for i in range(probe):
        fn(i % n_sets)
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / probe, 1e-3)
    reps = int(min(max(min_reps, math.ceil(min_time_s * 1e3 / estimate)), max_reps))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(statistics.median(times), min(times), reps)


def _l2_bytes() -> int:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def input_sets_needed(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate so the data one call reads was not left in L2 by the call before.

    One set at least twice the L2 size already evicts itself; smaller ones are rotated until the sets
    together are that large, up to ``max_sets`` (beyond which launch overhead, not L2, dominates anyway).
    """
    if set_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / set_bytes)))


def measure_matmul_tflops(n: int = 8192, **timing: Any) -> float:
    """TFLOP/s of an n x n x n bf16 matmul: the tensor-core ceiling of this GPU, in this run."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda i: torch.matmul(a, b, out=c), 1, **timing)
    return 2.0 * n**3 / (t.ms * 1e-3) / 1e12


# ================================================================================================
# Implementations


class Skip(Exception):
    """An implementation cannot run this point; the message says why."""


#: (config name, causal) -> why its compile failed, so a sweep tries each failing kernel once.
_COMPILE_FAILURES: dict[tuple[str, bool], str] = {}


def _one_line(exc: BaseException, limit: int = 600) -> str:
    """An exception as one line: compiler errors span lines, and the second line is the useful one."""
    text = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return (text or type(exc).__name__)[:limit]


_SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


@dataclass
class Shape:
    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _sdpa_backend(impl: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, _SDPA_BACKENDS[impl])


_FLEX_COMPILED: Any = None


def _flex() -> Any:
    """``torch.compile(flex_attention)``, compiled once per process, with room for a recompile per shape."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # Each sweep point is a new static shape (dynamic=False: the papers' numbers are for specialised
        # kernels). Dynamo's default limit of 8 recompiles would silently drop the later shapes to eager
        # flex_attention, which is an order of magnitude slower and would be reported as flex's speed.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4096))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def _warning_text(caught: list) -> str:
    msgs = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return " | ".join(dict.fromkeys(msgs))[:500]


@dataclass
class Runner:
    """One implementation at one shape, ready to time.

    ``call(i)`` runs it on input set ``i``; ``context`` is entered around warm-up and timing (``sdpa_kernel``
    costs host time, so it is entered once, not per call); ``output(i)`` returns the output of set ``i`` in
    (batch, seqlen, heads, head_dim) layout for the correctness check; ``config`` is our kernel's name.
    """

    call: Callable[[int], Any]
    output: Callable[[int], Any]
    context: Callable[[], Any] = contextlib.nullcontext
    config: str | None = None


def _make_inputs(shape: Shape, n_sets: int, device: Any) -> list[tuple[Any, Any, Any]]:
    import torch

    dt = _torch_dtype(shape.dtype)
    size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    # Fresh random data for every shape: zeros or constants would let a kernel skip work or hide errors.
    return [tuple(torch.randn(size, device=device, dtype=dt) for _ in range(3)) for _ in range(n_sets)]


def _autograd_call(
    f: Callable[[Any, Any, Any], Any], inputs: list[tuple[Any, Any, Any]], mode: str
) -> Callable[[int], Any]:
    """Wrap a forward ``f`` into the timed call of a backward mode (fwd_bwd: both; bwd: backward alone)."""
    import torch

    leaves = [tuple(t.detach().requires_grad_(True) for t in s) for s in inputs]
    if mode == "fwd_bwd":

        def call(i: int) -> Any:
            out = f(*leaves[i])
            return torch.autograd.grad(out, leaves[i], torch.ones_like(out))

        return call
    # bwd: the forward (and its saved tensors) is built once per set; only the backward is timed.
    outs = [f(*s) for s in leaves]
    grads = [torch.randn_like(o) for o in outs]
    return lambda i: torch.autograd.grad(outs[i], leaves[i], grads[i], retain_graph=True)


def make_runner(
    impl: str, shape: Shape, inputs: list[tuple[Any, Any, Any]], mode: str, config: Any = None
) -> Runner:
    """The runner of ``impl`` on ``inputs`` (given in our (B, S, H, D) layout), or raise :class:`Skip`."""
    import torch

    if impl == OURS:
        import flash_attention
        from flash_attention import configs, ops

        q0 = inputs[0][0]
        reason = ops.cuda_unavailable_reason(q0)
        if reason is not None:
            # Timing the PyTorch fallback under our name would be a lie; the row is skipped with the reason.
            raise Skip(f"our CUDA kernel cannot run: {reason}")
        if config is not None:
            cfg = configs.parse_config(config)
            if cfg.dtype != shape.dtype or cfg.head_dim != configs.padded_head_dim(shape.head_dim):
                raise Skip(f"--config {cfg.name()} is not for {shape.dtype} head_dim {shape.head_dim}")
        elif hasattr(ops, "resolve_config"):
            # The very choice attention() makes for this call (defaults, and tuned winners once they exist),
            # so our rows time what a user gets; forward() then runs it without any fallback.
            cfg = ops.resolve_config(None, q0, shape.causal, shape.seqlen, shape.head_dim**-0.5)
        else:
            cfg = configs.default_config(
                shape.dtype, shape.head_dim, shape.causal, shape.seqlen, shape.seqlen
            )
        if mode == "fwd":
            key = (cfg.name(), shape.causal)
            if key in _COMPILE_FAILURES:
                raise Skip(_COMPILE_FAILURES[key])  # the same source fails the same way; don't compile again
            try:
                # Compile/load now, with the JIT's progress, so no compile lands inside warm-up or timing.
                ops.prepare(cfg, shape.causal, q0.device)
            except Exception as exc:
                _COMPILE_FAILURES[key] = f"compile of {cfg.name()} failed: {_one_line(exc)}"
                raise Skip(_COMPILE_FAILURES[key]) from exc
            outs: dict[int, Any] = {}

            def call(i: int) -> Any:
                q, k, v = inputs[i]
                return flash_attention.forward(cfg, q, k, v, causal=shape.causal)

            def output(i: int) -> Any:
                return outs.setdefault(i, call(i))

            return Runner(call, output, config=cfg.name())
        # Backward modes go through attention() and its autograd; the config is the one it picks.
        f = lambda q, k, v: flash_attention.attention(q, k, v, causal=shape.causal)  # noqa: E731
        return Runner(_autograd_call(f, inputs, mode), lambda i: f(*inputs[i]), config=cfg.name())

    if impl in _SDPA_BACKENDS:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(impl)
        # SDPA's native layout is (B, H, S, D) contiguous; giving it a transposed view would time a copy or a
        # slower strided path, so each set is laid out for it once, outside the timing.
        native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]

        def f(q: Any, k: Any, v: Any) -> Any:
            # seqlen_q == seqlen_k in the sweep, so SDPA's top-left causal mask equals our bottom-right one.
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        def context() -> Any:
            return sdpa_kernel(backend)

        call = (lambda i: f(*native[i])) if mode == "fwd" else None

        def output(i: int) -> Any:
            with context():
                return f(*native[i]).transpose(1, 2)

        if call is None:
            with context():
                call = _autograd_call(f, native, mode)
        return Runner(call, output, context)

    if impl == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as exc:
            raise Skip(f"FlexAttention is not in torch {torch.__version__}") from exc
        flex = _flex()
        native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]
        block_mask = None
        if shape.causal:

            def causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return q_idx >= kv_idx

            block_mask = create_block_mask(
                causal_mask,
                B=None,
                H=None,
                Q_LEN=shape.seqlen,
                KV_LEN=shape.seqlen,
                device=inputs[0][0].device,
            )

        def f(q: Any, k: Any, v: Any) -> Any:
            return flex(q, k, v, block_mask=block_mask)

        call = (lambda i: f(*native[i])) if mode == "fwd" else _autograd_call(f, native, mode)
        return Runner(call, lambda i: f(*native[i]).transpose(1, 2))

    raise Skip(f"unknown implementation {impl!r}; known: {', '.join(DEFAULT_IMPLS)}")


# ================================================================================================
# The sweep


@dataclass
class SweepSettings:
    impls: tuple[str, ...]
    seqlens: tuple[int, ...]
    head_dims: tuple[int, ...]
    causal: tuple[bool, ...]
    dtype: str = "bf16"
    mode: str = "fwd"
    tokens: int = 16384
    width: int = 2048
    config: str | None = None
    warmup: int = 3
    min_reps: int = 25
    min_time_s: float = 0.2
    quick: bool = False


def sweep_shapes(s: SweepSettings) -> list[Shape]:
    shapes = []
    for d in s.head_dims:
        for causal in s.causal:
            for n in s.seqlens:
                shapes.append(Shape(s.dtype, max(1, s.tokens // n), max(1, s.width // d), n, d, causal))
    return shapes


def _describe(shape: Shape) -> str:
    return (
        f"{shape.dtype} d={shape.head_dim:<3} {'causal    ' if shape.causal else 'non-causal'} "
        f"seqlen={shape.seqlen:<5} batch={shape.batch:<2} heads={shape.heads:<2}"
    )


def _max_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max().item())


def _anchor_output(shape: Shape, inputs: list[tuple[Any, Any, Any]]) -> tuple[Any, str | None]:
    """SDPA's output on set 0, the yardstick every row's ``max_diff_vs_sdpa`` is measured against.

    FLASH first (the baseline of our ratios), then cuDNN and EFFICIENT for shapes FLASH rejects. Never the
    math backend: at 16k it would materialise a 16 GB score matrix.
    """
    for impl in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = make_runner(impl, shape, inputs[:1], "fwd")
                out = r.output(0)
            return out, impl
        except Exception:
            continue
    return None, None


def _cuda_context_ok() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def run_sweep(
    s: SweepSettings, out_path: Path | None, merge: bool = False, commit: str | None = None
) -> tuple[dict, int]:
    """Measure every (shape, impl) of ``s``; returns the result dict and an exit status.

    Each finished row is printed at once; the result file is rewritten after every shape so an interrupted
    or crashed sweep still leaves what it measured.
    """
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    timing = dict(warmup=s.warmup, min_reps=s.min_reps, min_time_s=s.min_time_s)
    result: dict = environment(device)
    if commit is not None:
        git = result["commit"]
        # A copy without .git (the GPU machines get one) can't say what it is; the caller can. When git can,
        # its answer is kept beside the caller's so a mismatch shows.
        result["commit"] = commit
        if git != "unknown" and git != commit:
            result["git_commit"] = git
    previous = None
    if merge and out_path is not None and out_path.exists():
        previous = load_results(out_path)
        if previous.get("gpu") != result["gpu"]:
            # Rows of two GPU models in one file would be compared against one matmul ceiling.
            raise SystemExit(
                f"--merge: {out_path} was measured on {previous.get('gpu')}, not {result['gpu']}"
            )
    print(
        f"GPU: {result['gpu']} ({result['sm_count']} SMs, driver {result['driver']}), "
        f"torch {result['torch']}, "
        f"CUDA {result['cuda']}, commit {result['commit']}",
        flush=True,
    )
    result["matmul_tflops"] = round(measure_matmul_tflops(**timing), 1)
    print(f"8192³ bf16 matmul: {result['matmul_tflops']:.0f} TFLOP/s (the ceiling in this run)", flush=True)
    result["settings"] = {
        "impls": list(s.impls),
        "mode": s.mode,
        "tokens": s.tokens,
        "width": s.width,
        "config": s.config,
        "warmup": s.warmup,
        "min_reps": s.min_reps,
        "min_time_s": s.min_time_s,
        "quick": s.quick,
        "timing": "CUDA events per call, median; inputs rotated when one set is under 2x L2",
    }
    result["rows"] = []
    result["skipped"] = []
    status = 0
    l2 = _l2_bytes()
    shapes = sweep_shapes(s)
    t_start = time.perf_counter()
    try:
        for si, shape in enumerate(shapes):
            set_bytes = 4 * shape.batch * shape.seqlen * shape.heads * shape.head_dim * 2  # q, k, v, out
            n_sets = input_sets_needed(set_bytes, l2)
            inputs = _make_inputs(shape, n_sets, device)
            anchor, anchor_impl = _anchor_output(shape, inputs)
            print(
                f"[{si + 1}/{len(shapes)}, {time.perf_counter() - t_start:.0f} s] {_describe(shape)}"
                f" ({n_sets} input set{'s' if n_sets > 1 else ''})",
                flush=True,
            )
            for impl in s.impls:
                row_base = {
                    "impl": impl,
                    "mode": s.mode,
                    "dtype": shape.dtype,
                    "head_dim": shape.head_dim,
                    "causal": shape.causal,
                    "seqlen": shape.seqlen,
                    "batch": shape.batch,
                    "heads": shape.heads,
                }
                try:
                    row = _measure(impl, shape, inputs, s, timing, anchor, anchor_impl)
                except Exception as exc:
                    reason = (
                        _one_line(exc) if isinstance(exc, Skip) else f"{type(exc).__name__}: {_one_line(exc)}"
                    )
                    result["skipped"].append({**row_base, "reason": reason})
                    short = reason if len(reason) <= 240 else reason[:237] + "..."
                    print(f"    {impl:<16} skipped: {short}", flush=True)
                    if impl == OURS:
                        status = 1  # a baseline may lack a shape; ours must cover the whole sweep
                    if not _cuda_context_ok():
                        # An illegal access poisons the CUDA context: every later call would fail too.
                        raise RuntimeError(f"CUDA context lost after {impl} at {_describe(shape)}") from exc
                    continue
                row = {**row_base, **row}
                result["rows"].append(row)
                extra = f"  [{row['config']}]" if row.get("config") else ""
                bad = "  NaN/Inf IN OUTPUT" if row.get("nonfinite") else ""
                diff = row.get("max_diff_vs_sdpa")
                diff_txt = f"  maxdiff {diff:.2e}" if isinstance(diff, float) else ""
                print(
                    f"    {impl:<16} {row['ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s{diff_txt}{bad}{extra}",
                    flush=True,
                )
                if row.get("nonfinite"):
                    status = 1
            del inputs, anchor
            torch.cuda.empty_cache()
            if out_path is not None:
                write_results(_merged(previous, result), out_path)
    except KeyboardInterrupt:
        result["aborted"] = "interrupted"
        status = 130
    except RuntimeError as exc:
        result["aborted"] = str(exc)
        print(f"aborting: {exc}", flush=True)
        status = 1
    result = _merged(previous, result)
    if out_path is not None:
        write_results(result, out_path)
    return result, status


def _measure(
    impl: str,
    shape: Shape,
    inputs: list[tuple[Any, Any, Any]],
    s: SweepSettings,
    timing: dict,
    anchor: Any,
    anchor_impl: str | None,
) -> dict:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        # SDPA explains a rejected backend only through warnings; keep them for the skip reason.
        warnings.simplefilter("always")
        try:
            runner = make_runner(impl, shape, inputs, s.mode, s.config if impl == OURS else None)
            with runner.context():
                out = runner.output(0)
                t = time_cuda(runner.call, len(inputs), **timing)
        except Skip:
            raise
        except Exception as exc:
            why = _warning_text(caught)
            raise Skip(f"{type(exc).__name__}: {_one_line(exc)}" + (f" ({why})" if why else "")) from exc
    row: dict = {}
    if runner.config is not None:
        row["config"] = runner.config
    f = flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, shape.causal, s.mode)
    # Rounded well below the run-to-run noise (~1%) to keep the files readable.
    row["ms"] = round(t.ms, 5)
    row["tflops"] = round(f / (t.ms * 1e-3) / 1e12, 2)
    row["ms_min"] = round(t.ms_min, 5)
    row["reps"] = t.reps
    row["input_sets"] = len(inputs)
    row["nonfinite"] = not bool(torch.isfinite(out).all().item())
    if anchor is not None:
        row["max_diff_vs_sdpa"] = _max_diff(out, anchor)
        row["sdpa_ref"] = anchor_impl
    return row


def _merged(previous: dict | None, result: dict) -> dict:
    """``result`` with the rows of ``previous`` it did not re-measure (``--merge``)."""
    if previous is None:
        return result
    new_keys = {_row_key(r) for r in result["rows"]}
    merged = dict(result)
    merged["rows"] = [r for r in previous["rows"] if _row_key(r) not in new_keys] + result["rows"]
    runs = list(previous.get("merged_runs", []))
    runs.append({k: previous.get(k) for k in ("commit", "timestamp", "matmul_tflops", "torch")})
    merged["merged_runs"] = runs
    return merged


# ================================================================================================
# The main job: `python -m flash_attention`


def run_main_job() -> int:
    """Our attention against PyTorch's on one default shape; on a machine without CUDA, the CPU path."""
    import torch

    if not torch.cuda.is_available():
        return _main_job_cpu()
    return _main_job_gpu()


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=False)]
    for cells in [headers, ["-" * w for w in widths], *rows]:
        print(
            "  ".join(
                c.rjust(w) if i >= 2 else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )


def _main_job_cpu() -> int:
    import torch

    import flash_attention
    from flash_attention.reference import attention_reference

    b, n, h, d = 1, 256, 4, 64
    print("No CUDA GPU found: running the CPU (PyTorch) path of flash_attention.attention.")
    print(f"Shape: batch {b}, seqlen {n}, heads {h}, head_dim {d}, float32.")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    rows = []
    for causal in (False, True):
        ref, _ = attention_reference(q, k, v, causal=causal)
        for name, f in (
            ("flash_attention", lambda c=causal: flash_attention.attention(q, k, v, causal=c)),
            (
                "torch sdpa",
                lambda c=causal: torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c
                ).transpose(1, 2),
            ),
        ):
            out = f()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            tf = flops(b, h, n, n, d, causal) / (ms * 1e-3) / 1e12
            err = (out.double() - ref).abs().max().item()
            rows.append([name, "yes" if causal else "no", f"{ms:.3f}", f"{tf:.3f}", f"{err:.2e}"])
    _print_table(["impl", "causal", "ms", "TFLOP/s", "max err vs fp64"], rows)
    print("The CUDA kernels need an NVIDIA GPU; this machine ran the PyTorch fallback, same semantics.")
    return 0


def _main_job_gpu() -> int:
    import torch
    import torch.nn.functional as F

    import flash_attention
    from flash_attention import ops
    from flash_attention.reference import attention_reference

    b, n, h, d = 4, 2048, 16, 128
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"Shape: batch {b}, seqlen {n}, heads {h}, head_dim {d}, bf16")
    shape = Shape("bf16", b, h, n, d, False)
    n_sets = input_sets_needed(4 * b * n * h * d * 2, _l2_bytes())
    inputs = _make_inputs(shape, n_sets, device)
    reason = ops.cuda_unavailable_reason(inputs[0][0])
    print(
        f"flash_attention path: {'CUDA kernel' if reason is None else 'PyTorch fallback: ' + reason}",
        flush=True,
    )
    native = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in inputs]
    rows, errors, status = [], [], 0
    for causal in (False, True):
        q, k, v = inputs[0]
        ref, _ = attention_reference(q, k, v, causal=causal, compute_dtype=torch.float64)
        impls = (
            ("flash_attention", lambda i, c=causal: flash_attention.attention(*inputs[i], causal=c), False),
            ("torch sdpa", lambda i, c=causal: F.scaled_dot_product_attention(*native[i], is_causal=c), True),
        )
        for name, f, transposed in impls:
            try:
                out = f(0)
                if transposed:
                    out = out.transpose(1, 2)
                err = (out.double() - ref).abs().max().item()
                t = time_cuda(f, n_sets)
                tf = flops(b, h, n, n, d, causal) / (t.ms * 1e-3) / 1e12
                rows.append([name, "yes" if causal else "no", f"{t.ms:.3f}", f"{tf:.1f}", f"{err:.2e}"])
                if not math.isfinite(err):
                    status = 1
            except Exception as exc:
                rows.append([name, "yes" if causal else "no", "failed", "–", "–"])
                errors.append(f"{name}, causal={causal}: {type(exc).__name__}: {exc}")
                status = 1
        del ref
    _print_table(["impl", "causal", "ms", "TFLOP/s", "max err vs fp64"], rows)
    for e in errors:  # after the table: compiler messages span many lines
        print(e)
    print("Full sweep against every PyTorch backend: python -m flash_attention bench")
    return status


# ================================================================================================
# CLI


def _int_list(text: str) -> tuple[int, ...]:
    """``"512,1k,16k"`` -> (512, 1024, 16384)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers (1k = 1024); got {text!r}"
            ) from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return tuple(out)


def _impl_list(text: str) -> tuple[str, ...]:
    impls = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [i for i in impls if i not in DEFAULT_IMPLS]
    if unknown or not impls:
        raise argparse.ArgumentTypeError(f"unknown impls {unknown}; choose from {','.join(DEFAULT_IMPLS)}")
    return impls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flash_attention bench",
        description=(
            "Benchmark flash_attention against PyTorch's attention backends on the DESIGN.md sweep "
            "(16k tokens per batch, model width 2048) and write the result JSON."
        ),
    )
    # Options whose default depends on --quick or --config default to None and are resolved in main().
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="input dtype (default bf16)")
    p.add_argument(
        "--mode", choices=MODES, default="fwd", help="fwd (default); bwd and fwd_bwd need a backward"
    )
    p.add_argument(
        "--seqlens", type=_int_list, default=None, help="comma-separated, 1k = 1024 (default 512,...,16k)"
    )
    p.add_argument("--head-dims", type=_int_list, default=None, help="comma-separated (default 64,128,256)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="default both")
    p.add_argument(
        "--impls",
        type=_impl_list,
        default=DEFAULT_IMPLS,
        help=f"comma-separated (default {','.join(DEFAULT_IMPLS)})",
    )
    p.add_argument(
        "--config",
        default=None,
        help="time this kernel config (name or symbol) for our rows instead of the default choice; "
        "--dtype and --head-dims then default to the config's",
    )
    p.add_argument(
        "--tokens", type=int, default=16384, help="tokens per batch: batch = tokens // seqlen (16384)"
    )
    p.add_argument("--width", type=int, default=2048, help="model width: heads = width // head_dim (2048)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (3)")
    p.add_argument("--reps", type=int, default=None, help="minimum timed calls per point (25; --quick 10)")
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="minimum seconds of timed calls per point (0.2; --quick 0.05)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: seqlens 512,2048, head_dim 128, fewer reps"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result file (default benchmarks/results/<gpu>-<date>[-<tag>].json)",
    )
    p.add_argument("--tag", default=None, help="suffix of the default result file name (--quick: 'quick')")
    p.add_argument(
        "--commit",
        default=None,
        help="commit to record when the checkout has no git metadata (e.g. a copy on a GPU machine); "
        "default: git rev-parse --short HEAD, -dirty when tracked files changed",
    )
    p.add_argument("--no-save", action="store_true", help="don't write a result file")
    p.add_argument(
        "--merge", action="store_true", help="keep the rows of an existing --out that this run does not redo"
    )
    p.add_argument("--markdown", action="store_true", help="also print the README table (markdown)")
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="RESULTS.json",
        help="write a PNG per head_dim beside the result file (TFLOP/s vs seqlen, one line per impl); with a "
        "file, plot that file and measure nothing (needs no GPU)",
    )
    p.add_argument(
        "--progression",
        action="store_true",
        help="time the sequence of optimisation steps (plain -> swizzled -> ... -> tuned) instead of the "
        "sweep; default shape: head_dim 128, seqlen 4096 (--head-dims, --seqlens, --causal choose others)",
    )
    p.add_argument(
        "--update-readme",
        nargs="?",
        const="",
        default=None,
        metavar="RESULTS.json",
        help="measure nothing: regenerate the README table from RESULTS.json (default: newest in "
        "benchmarks/results); needs no GPU",
    )
    p.add_argument(
        "--readme", type=Path, default=None, help="README to update (default: the checkout's README.md)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.update_readme is not None:
        try:
            results = Path(args.update_readme) if args.update_readme else newest_results()
            readme = args.readme or (_repo_root() / "README.md")
            update_readme(readme, results)
        except (OSError, ValueError) as exc:
            print(f"--update-readme: {exc}", file=sys.stderr)
            return 2
        print(f"updated {readme} from {results}")
        return 0

    if args.plot:
        from flash_attention.plot import plot_results

        try:
            for path in plot_results(load_results(args.plot), args.plot):
                print(f"wrote {path}")
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"--plot: {exc}", file=sys.stderr)
            return 2
        return 0

    cfg = None
    if args.config is not None:
        from flash_attention.configs import parse_config

        try:
            cfg = parse_config(args.config)
        except ValueError as exc:
            print(f"--config: {exc}", file=sys.stderr)
            return 2
    dtype = args.dtype or (cfg.dtype if cfg is not None else "bf16")
    head_dims = args.head_dims or (
        (cfg.head_dim,) if cfg is not None else (128,) if args.quick else DEFAULT_HEAD_DIMS
    )
    seqlens = args.seqlens or ((512, 2048) if args.quick else DEFAULT_SEQLENS)
    reps = args.reps if args.reps is not None else (10 if args.quick else 25)
    min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.2)
    tag = args.tag if args.tag is not None else ("quick" if args.quick else None)

    if args.mode != "fwd" and OURS in args.impls and cfg is not None:
        # Backward modes time attention() through autograd (forward + our backward kernels), whose configs
        # are chosen per call.
        print("--config applies to --mode fwd only (backward modes run attention())", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print(
            "bench times CUDA kernels and needs a CUDA GPU; none was found. "
            "(--update-readme works without one.)",
            file=sys.stderr,
        )
        return 2

    if args.progression:
        from flash_attention.progression import run_progression

        run_progression(
            dtype,
            args.head_dims or (128,),
            args.seqlens or (4096,),
            {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal],
            dict(warmup=args.warmup, min_reps=reps, min_time_s=min_time),
        )
        return 0

    settings = SweepSettings(
        impls=args.impls,
        seqlens=seqlens,
        head_dims=head_dims,
        causal={"both": (False, True), "yes": (True,), "no": (False,)}[args.causal],
        dtype=dtype,
        mode=args.mode,
        tokens=args.tokens,
        width=args.width,
        config=args.config,
        warmup=args.warmup,
        min_reps=reps,
        min_time_s=min_time,
        quick=args.quick,
    )
    out_path = None
    if not args.no_save:
        if args.out is not None:
            out_path = args.out
        else:
            name = gpu_slug(torch.cuda.get_device_name()) + "-" + _dt.date.today().isoformat()
            out_path = default_results_dir() / (name + (f"-{tag}" if tag else "") + ".json")
        if out_path.exists() and not args.merge:
            print(f"note: {out_path} exists and will be overwritten (--merge keeps its other rows)")

    result, status = run_sweep(settings, out_path, merge=args.merge, commit=args.commit)
    print()
    print(results_to_text(result))
    if result.get("skipped"):
        print(f"{len(result['skipped'])} points skipped (reasons in the result file under 'skipped').")
    if args.markdown:
        print(results_to_markdown(result))
    if out_path is not None:
        print(f"wrote {out_path}")
        if args.plot is not None:
            from flash_attention.plot import plot_results

            try:
                for path in plot_results(result, out_path):
                    print(f"wrote {path}")
            except RuntimeError as exc:
                print(f"--plot: {exc}", file=sys.stderr)
    return status
