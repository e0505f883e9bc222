"""The tables of a result file: TFLOP/s per (mode, dtype), head_dim, mask and implementation by sequence
length, with ratio rows against the baselines and min / median / max summaries; as markdown (the README) and
as aligned text (the terminal)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..common import MODES, seqlen_label
from .results import DEFAULT_IMPLS, OURS
from .tiny import tiny_markdown

__all__ = ["RATIO_BASELINES", "ratio_summary", "results_header", "results_to_markdown", "results_to_text"]

#: Baselines of our ratio rows and summaries: cuDNN (PyTorch's default on Hopper) and FlashAttention-4 (the
#: strongest open peer there), the bars of the project, and FlashAttention-2 inside PyTorch. A baseline
#: without rows in a result file (fa4 not installed) has no ratio row.
RATIO_BASELINES = ("sdpa_flash", "sdpa_cudnn", "fa4")


def _fmt_tflops(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.2f}×"


def _impl_order(impls: Iterable[str]) -> list[str]:
    known = [i for i in DEFAULT_IMPLS if i in impls]
    return known + sorted(set(impls) - set(DEFAULT_IMPLS))


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
        if r.get("tiny"):
            continue  # tiny calls have their own table (time per call): tiny.py
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
        f"seqlen {seqlen_label(n)}), median {s['median']:.2f}×, max {s['max']:.2f}× "
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
        headers = ["d", "causal", "impl"] + [seqlen_label(n) for n in seqlens]
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
            where = ", ".join(seqlen_label(n) for n in sorted(set(ns)))
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
    tiny = tiny_markdown(result)
    if tiny:
        parts.append(tiny.rstrip("\n"))
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
    tiny = tiny_markdown(result)
    if tiny:
        out.append(tiny)
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
    if ceiling is None and isinstance(result.get("copy_tb_s"), int | float):  # a decode run: memory-bound
        text = text.replace(
            f"8192³ bf16 matmul in the same run: {ceiling_txt}",
            f"1 GiB device-to-device copy in the same run: {result['copy_tb_s']:.2f} TB/s",
        )
    if results_path:
        text += f" Source: [`{results_path}`]({results_path})."
    return text
