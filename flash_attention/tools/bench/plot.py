"""PNG plots of a benchmark result file: TFLOP/s against sequence length, one figure per head_dim.

Each figure has a non-causal and a causal panel, one line per implementation, and the matmul ceiling
measured in the same run as a dashed line. Needs matplotlib (``pip install matplotlib``); works from the
JSON alone, so plots can be remade on a machine without a GPU.
"""

from __future__ import annotations

from pathlib import Path

from .results import result_mode

_STYLE = {
    "flash_attention": dict(color="#d62728", linewidth=2.6, marker="o"),
    "sdpa_flash": dict(color="#1f77b4", marker="s"),
    "sdpa_cudnn": dict(color="#2ca02c", marker="^"),
    "sdpa_efficient": dict(color="#9467bd", marker="v"),
    "flex": dict(color="#ff7f0e", marker="D"),
    "fa4": dict(color="#17becf", marker="P"),
}


def plot_paths(results_path: str | Path, head_dims, out_dir: str | Path | None = None) -> list[Path]:
    """``<results stem>-d<head_dim>.png`` in ``out_dir`` (default: beside the result file)."""
    p = Path(results_path)
    folder = Path(out_dir) if out_dir is not None else p.parent
    return [folder / f"{p.stem}-d{d}.png" for d in head_dims]


def plot_results(
    result: dict, results_path: str | Path, mode: str | None = None, out_dir: str | Path | None = None
) -> list[Path]:
    """Write ``<results stem>-d<head_dim>.png`` into ``out_dir`` (default: beside the result file, where
    the README generator looks for them); returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from exc

    if mode is None:
        mode = result_mode(result)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    if mode == "ring":
        return [_plot_ring(plt, result, results_path, out_dir)]
    rows = [r for r in result["rows"] if r.get("mode") == mode and r.get("tflops")]
    head_dims = sorted({r["head_dim"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    written = []
    for d, path in zip(head_dims, plot_paths(results_path, head_dims, out_dir), strict=True):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, causal in zip(axes, (False, True), strict=True):
            for impl in impls:
                pts = sorted(
                    (r["seqlen"], r["tflops"])
                    for r in rows
                    if r["head_dim"] == d and r["causal"] == causal and r["impl"] == impl
                )
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, label=impl, **_STYLE.get(impl, {}))
            if result.get("matmul_tflops"):
                ax.axhline(result["matmul_tflops"], color="gray", linestyle="--", linewidth=1)
                ax.text(
                    0.01,
                    result["matmul_tflops"],
                    " bf16 matmul ceiling",
                    transform=ax.get_yaxis_transform(),
                    va="bottom",
                    fontsize=8,
                    color="gray",
                )
            ax.set_xscale("log", base=2)
            seqlens = sorted({r["seqlen"] for r in rows})
            ax.set_xticks(seqlens)
            ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
            ax.set_title(f"head_dim {d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel(f"{mode} TFLOP/s")
        # Room above the highest of the data and the ceiling, so the ceiling's label is never clipped.
        top = max([r["tflops"] for r in rows] + [result.get("matmul_tflops") or 0])
        axes[0].set_ylim(bottom=0, top=1.12 * top)
        axes[1].legend(fontsize=8, loc="lower right")
        fig.suptitle(
            f"{result.get('gpu', '?')}, {rows[0]['dtype'] if rows else ''}, commit {result.get('commit')}"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def _plot_ring(plt, result: dict, results_path: str | Path, out_dir: str | Path | None) -> Path:
    """A ``--ring`` result: time per forward+backward step and peak memory per GPU against sequence
    length, one GPU against the ring, the speedup and memory ratio written at each point."""
    rows = result["rows"]
    one = sorted((r for r in rows if r["impl"] == "flash_attention"), key=lambda r: r["seqlen"])
    ring = sorted((r for r in rows if r["impl"] == "ring_attention"), key=lambda r: r["seqlen"])
    world = ring[0]["world"]
    path = plot_paths(results_path, [ring[0]["head_dim"]], out_dir)[0]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((ax_t, "ms", "ms per forward+backward"), (ax_m, "peak_gib", "peak GiB per GPU")):
        one_xy = [r["seqlen"] for r in one], [r[key] for r in one]
        ax.plot(*one_xy, label="one GPU", **_STYLE["flash_attention"])
        ax.plot(
            [r["seqlen"] for r in ring], [r[key] for r in ring], label=f"ring_attention, {world} GPUs",
            color="#1f77b4", marker="s", linewidth=2,
        )  # fmt: skip
        ratio_key = "speedup" if key == "ms" else "memory_ratio"
        for r in ring:
            if r.get(ratio_key) is not None:
                at = (r["seqlen"], r[key])
                ax.annotate(
                    f"{r[ratio_key]:.2f}x", at, textcoords="offset points", xytext=(0, 7), ha="center",
                    fontsize=8, color="#1f77b4",
                )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(_ticker().FuncFormatter(lambda y, _: f"{y:g}"))
        seqlens = [r["seqlen"] for r in ring]
        ax.set_xticks(seqlens)
        ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
        ax.set_xlabel("sequence length (one causal sequence)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax_t.set_title("time (the speedup at each ring point)")
    ax_m.set_title("memory (the ratio to one GPU at each ring point)")
    first = ring[0]
    fig.suptitle(
        f"{world} x {result.get('gpu', '?')}, {first['dtype']}, {first['heads']}/{first['kv_heads']} heads, "
        f"head_dim {first['head_dim']}, commit {result.get('commit')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
