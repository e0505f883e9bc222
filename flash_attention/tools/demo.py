"""``python -m flash_attention demo``: a Transformer encoder with PyTorch's attention and with ours.

The model is a stock ``nn.TransformerEncoder`` (post-norm layers, feed-forward 4x wide, no dropout). It runs
inference three ways on the same weights and inputs:

* ``stock`` -- as PyTorch ships it. In inference ``nn.TransformerEncoderLayer`` takes its fused fast path,
  whose attention is ``scaled_dot_product_attention`` with whatever backend PyTorch picks (on a recent GPU
  with fp16/bf16: a FlashAttention kernel of its own, so memory is linear there too).
* ``stock_math`` -- the same, with SDPA held to its MATH backend: standard attention, which materialises the
  (seqlen x seqlen) score matrix of every head -- the memory that grows quadratically.
* ``flash_attention`` -- after :func:`flash_attention.nn.replace_attention`: our kernel.

For each sequence length it prints the time of one forward step (median of CUDA-event timings, after
warm-up) and the peak GPU memory the step allocates on top of the weights and the input, and checks that
ours computes what stock computes. Results go to ``./flash_attention_results/demo/<gpu>-<date>.json`` of the
current directory (``--out`` names another path; the committed ones are under ``benchmarks/results/demo/``);
the README section is generated from such a file (``--update-readme``), never typed.

Without a CUDA GPU it runs the CPU path at a small size, says so, and measures time only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention.nn import replace_attention
from flash_attention.ops.winners import gpu_slug

from . import provenance
from .bench.results import DEFAULT_OUTPUT
from .common import (
    PERFORMANCE_PAGE,
    environment,
    generated_by,
    ready_host_library,
    record_provenance,
    replace_marked_region,
    repo_root,
    time_cuda,
    write_json,
)

__all__ = ["IMPLS", "main", "run_demo", "results_to_markdown", "update_readme"]

IMPLS = ("stock", "stock_math", "flash_attention")
_IMPL_TEXT = {
    "stock": "PyTorch `nn.MultiheadAttention` (SDPA, backend of PyTorch's choice)",
    "stock_math": "PyTorch `nn.MultiheadAttention`, SDPA held to its MATH backend (standard attention)",
    "flash_attention": "`flash_attention.nn.MultiheadAttention` (after `replace_attention`)",
}
README_BEGIN = "<!-- demo:begin -->"
README_END = "<!-- demo:end -->"

GPU_DEFAULTS = {"d_model": 1024, "heads": 16, "layers": 4, "batch": 1, "dtype": "bf16"}
GPU_SEQLENS = (1024, 2048, 4096, 8192, 16384)
CPU_DEFAULTS = {"d_model": 256, "heads": 4, "layers": 2, "batch": 2, "dtype": "fp32"}
CPU_SEQLENS = (128, 256, 512)
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def build_encoder(d_model: int, heads: int, layers: int, *, device: Any, dtype: Any) -> Any:
    """The stock encoder every implementation starts from (random weights, eval mode)."""
    layer = nn.TransformerEncoderLayer(
        d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, device=device, dtype=dtype
    )
    # enable_nested_tensor only matters with a padding mask, which the demo does not use; off, it stays quiet
    # about layer settings that would rule it out.
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    with torch.no_grad():
        # nn.TransformerEncoder deep-copies one layer: give each layer its own random matrices (biases stay 0
        # and norms 1, as PyTorch initialises them).
        for p in encoder.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
    return encoder.eval()


def _time_cpu(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_demo(
    *,
    seqlens: Sequence[int] | None = None,
    d_model: int | None = None,
    heads: int | None = None,
    layers: int | None = None,
    batch: int | None = None,
    dtype: str | None = None,
    causal: bool = False,
    impls: Sequence[str] = IMPLS,
    log: Callable[[str], None] = print,
    commit: str | None = None,
    allow_dirty: bool = False,
) -> dict:
    """Run the comparison and return the result dict (also what the JSON file holds). ``commit`` and
    ``allow_dirty`` are the provenance of the run (tools/common.record_provenance)."""
    on_gpu = torch.cuda.is_available()
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    d_model = d_model or defaults["d_model"]
    heads = heads or defaults["heads"]
    layers = layers or defaults["layers"]
    batch = batch or defaults["batch"]
    dtype = dtype or defaults["dtype"]
    seqlens = tuple(seqlens or (GPU_SEQLENS if on_gpu else CPU_SEQLENS))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}; got {dtype!r}")
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"impls must be among {IMPLS}; got {unknown}")
    device = torch.device("cuda" if on_gpu else "cpu")
    tdtype = getattr(torch, _DTYPES[dtype])
    if on_gpu:
        ready_host_library("demo")  # (before anything is timed)

    if on_gpu:
        env = environment(device, commit, allow_dirty)
    else:
        impls = [i for i in impls if i != "stock_math"]  # on the CPU, stock SDPA is the math backend anyway
        # A CPU run measures PyTorch only and feeds no README table: its provenance is recorded, not enforced.
        env = {"gpu": None, "driver": None, "cuda": None, "torch": torch.__version__}
        env.update(record_provenance(commit, allow_dirty=True))
        env["date"] = _dt.date.today().isoformat()
        log(
            "No CUDA GPU found: running the CPU path at a small size (PyTorch computes every implementation "
            "here, so this shows the modules work, not the kernel's speed). Peak GPU memory is not measured."
        )

    config = {
        "d_model": d_model,
        "heads": heads,
        "head_dim": d_model // heads,
        "layers": layers,
        "batch": batch,
        "dtype": dtype,
        "causal": causal,
        "dim_feedforward": 4 * d_model,
    }
    log(
        f"Transformer encoder: {layers} layers, d_model {d_model}, {heads} heads "
        f"(head_dim {d_model // heads}), feed-forward {4 * d_model}, batch {batch}, {dtype}, "
        f"{'causal' if causal else 'non-causal'}, inference; on {env['gpu'] or 'CPU'}"
    )

    torch.manual_seed(0)
    stock = build_encoder(d_model, heads, layers, device=device, dtype=tdtype)
    ours = replace_attention(copy.deepcopy(stock))
    models = {"stock": stock, "stock_math": stock, "flash_attention": ours}

    rows = []
    header = f"{'seqlen':>7}  {'impl':<16}{'ms/step':>10}{'peak MiB':>11}  max |ours - stock|"
    log(header)
    for seqlen in seqlens:
        x = torch.randn(batch, seqlen, d_model, device=device, dtype=tdtype)
        kwargs: dict[str, Any] = {}
        if causal:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(seqlen, device=device, dtype=tdtype)
            kwargs = {"mask": mask, "is_causal": True}
        outputs = {}
        for impl in impls:
            row = _measure(impl, models[impl], x, kwargs, on_gpu)
            row.update({"seqlen": seqlen, "batch": batch})
            outputs[impl] = row.pop("output")
            rows.append(row)
        ref = outputs.get("stock")
        for row in rows[-len(impls) :]:
            out = outputs[row["impl"]]
            if ref is not None and out is not None:
                row["max_abs_diff_vs_stock"] = (out.float() - ref.float()).abs().max().item()
            ms = "OOM" if row.get("oom") else f"{row['ms']:.2f}"
            mib = "-" if row.get("peak_mib") is None else f"{row['peak_mib']:.0f}"
            diff = row.get("max_abs_diff_vs_stock")
            log(f"{seqlen:>7}  {row['impl']:<16}{ms:>10}{mib:>11}  {'' if diff is None else f'{diff:.3g}'}")
        del outputs, ref, x
    return {**env, "config": config, "impls": list(impls), "rows": rows}


def _measure(impl: str, model: Any, x: Any, kwargs: dict, on_gpu: bool) -> dict:
    row: dict[str, Any] = {"impl": impl, "ms": None, "peak_mib": None, "oom": False, "output": None}

    def step() -> Any:
        with (
            torch.inference_mode(),
            _standard_attention() if impl == "stock_math" else contextlib.nullcontext(),
        ):
            return model(x, **kwargs)

    try:
        if not on_gpu:
            row["output"] = step()
            row["ms"] = _time_cpu(step)
            return row
        # A warm-up step first: it compiles our kernel on first use and makes cuBLAS/cuDNN allocate their
        # workspaces, which stay for the whole process and are no cost of the step being measured.
        step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        row["output"] = step()
        torch.cuda.synchronize()
        # What one step allocates beyond the weights and the input it was given (its output included).
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["ms"] = time_cuda(lambda i: step(), warmup=2, min_reps=10, min_time_s=0.3).ms
    except torch.cuda.OutOfMemoryError:
        row.update({"oom": True, "ms": None, "peak_mib": None, "output": None})
        torch.cuda.empty_cache()
    return row


@contextlib.contextmanager
def _standard_attention() -> Iterator[None]:
    """PyTorch's attention as the textbook computes it: SDPA's MATH backend, and no fused layer fast path
    (``torch._transformer_encoder_layer_fwd`` would otherwise pick its own attention kernel)."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


# ------------------------------------------------------------------------------------------------------
# Result files and the README section


def default_result_path(result: dict) -> Path:
    """Where a run's result goes without --out: bench's default folder of the current directory
    (./flash_attention_results/demo/), never the checkout's committed results (pass --out for those)."""
    name = gpu_slug(result["gpu"]) if result.get("gpu") else "cpu"
    # A folder of its own: the bench's sweeps beside it are globbed by its tools.
    return DEFAULT_OUTPUT / "demo" / f"{name}-{result.get('date', _dt.date.today().isoformat())}.json"


def write_result(result: dict, path: str | os.PathLike) -> Path:
    return write_json(result, path)


def results_to_markdown(result: dict) -> str:
    """Two tables (time per step, peak memory), one column per sequence length, one row per implementation."""
    seqlens = sorted({r["seqlen"] for r in result["rows"]})
    impls = [i for i in result.get("impls", IMPLS) if any(r["impl"] == i for r in result["rows"])]
    cell = {(r["impl"], r["seqlen"]): r for r in result["rows"]}
    head = "| implementation | " + " | ".join(_seqlen_label(n) for n in seqlens) + " |"
    rule = "| --- | " + " | ".join("---:" for _ in seqlens) + " |"

    def table(title: str, fmt: Callable[[dict], str]) -> list[str]:
        lines = [f"**{title}**", "", head, rule]
        for impl in impls:
            cells = [fmt(cell[(impl, n)]) if (impl, n) in cell else "" for n in seqlens]
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        return lines

    def ms(r: dict) -> str:
        return "OOM" if r.get("oom") else f"{r['ms']:.2f}"

    def mib(r: dict) -> str:
        return "OOM" if r.get("oom") else ("-" if r.get("peak_mib") is None else f"{r['peak_mib']:,.0f}")

    lines = table("Time per forward step (ms)", ms)
    if any(r.get("peak_mib") is not None for r in result["rows"]):
        lines += ["", *table("Peak GPU memory of a step beyond weights and input (MiB)", mib)]
    lines += ["", *[f"- `{i}`: {_IMPL_TEXT[i]}" for i in impls]]
    diffs = [
        r["max_abs_diff_vs_stock"]
        for r in result["rows"]
        if r["impl"] == "flash_attention" and r.get("max_abs_diff_vs_stock") is not None
    ]
    if diffs:
        lines.append(
            f"- largest absolute difference between the outputs of flash_attention and stock: "
            f"{max(diffs):.3g} ({result['config']['dtype']})"
        )
    return "\n".join(lines) + "\n"


def _header(result: dict, rel: str) -> str:
    c = result["config"]
    where = (
        f"Measured on {result['gpu']} (driver {result.get('driver')}), torch {result['torch']}, "
        f"CUDA {result.get('cuda')}"
        if result.get("gpu")
        else f"Measured on the CPU (no GPU), torch {result['torch']}"
    )
    return (
        f"{where}, commit `{result.get('commit')}`, {result.get('date')}. Model: `nn.TransformerEncoder`, "
        f"{c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads (head_dim {c['head_dim']}), "
        f"feed-forward {c['dim_feedforward']}, batch {c['batch']}, {c['dtype']}, "
        f"{'causal' if c['causal'] else 'non-causal'}, inference. Source: [`{rel}`]({rel})."
    )


def update_readme(readme_path: str | os.PathLike, result_path: str | os.PathLike) -> str:
    """Replace the text between ``<!-- demo:begin -->`` and ``<!-- demo:end -->`` with a result's tables."""
    readme_path, result_path = Path(readme_path), Path(result_path)
    result = json.loads(result_path.read_text(encoding="utf-8"))
    provenance.check_result(result, repo_root(), str(result_path))
    rel = os.path.relpath(result_path.resolve(), readme_path.resolve().parent).replace(os.sep, "/")
    block = "\n".join(
        [
            _header(result, rel),
            "",
            generated_by("demo", result_path, readme_path),
            "",
            results_to_markdown(result).rstrip("\n"),
        ]
    )
    replace_marked_region(readme_path, README_BEGIN, README_END, block)
    return block


# ------------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flash_attention demo",
        description=(
            "Run a Transformer encoder with PyTorch's nn.MultiheadAttention and with flash_attention's, "
            "and print time per step and peak GPU memory by sequence length (GPU defaults: d_model 1024, "
            "16 heads, 4 layers, batch 1, bf16, seqlen 1k..16k). Without a GPU: the CPU path at a small size."
        ),
    )
    p.add_argument("--seqlens", help="comma-separated sequence lengths")
    p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--dtype", choices=sorted(_DTYPES))
    p.add_argument("--causal", action="store_true", help="causal self-attention (mask + is_causal)")
    p.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument(
        "--out",
        help="result JSON path (default on a GPU: ./flash_attention_results/demo/<gpu>-<date>.json; the "
        "README's table is generated from benchmarks/results/demo/)",
    )
    p.add_argument("--commit", help="commit to record (for a copy of the checkout without .git)")
    p.add_argument("--no-save", action="store_true", help="do not write a result file")
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="record a run of uncommitted code (marked dirty; the README generator refuses such a file)",
    )
    p.add_argument("--markdown", metavar="RESULT", help="print the README tables of a result file and exit")
    p.add_argument(
        "--update-readme", metavar="RESULT", help="regenerate the README's demo section from a result file"
    )
    p.add_argument(
        "--readme", default=None, help="page to update (default: the checkout's docs/performance.md)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.markdown:
        print(results_to_markdown(json.loads(Path(args.markdown).read_text(encoding="utf-8"))), end="")
        return 0
    if args.update_readme:
        readme = Path(args.readme) if args.readme else repo_root() / PERFORMANCE_PAGE
        update_readme(readme, args.update_readme)
        print(f"updated {readme} from {args.update_readme}")
        return 0

    seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else None
    impls = tuple(args.impls.split(",")) if args.impls else IMPLS
    result = run_demo(
        seqlens=seqlens,
        d_model=args.d_model,
        heads=args.heads,
        layers=args.layers,
        batch=args.batch,
        dtype=args.dtype,
        causal=args.causal,
        impls=impls,
        commit=args.commit,
        allow_dirty=args.allow_dirty,
    )
    if not args.no_save and (args.out or result.get("gpu")):
        path = write_result(result, args.out or default_result_path(result))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
