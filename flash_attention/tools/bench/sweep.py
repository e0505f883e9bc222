"""The sweep of DESIGN.md: every (shape, implementation) timed in one process, each row printed as it is
measured and the result file rewritten after every shape, so an interrupted sweep keeps what it measured."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...ops import repeat
from ..common import environment, flops, input_sets_needed, l2_bytes, measure_matmul_tflops, time_cuda
from .results import OURS, OURS_FP8, load_results, merged, write_results
from .runners import Shape, Skip, make_inputs, make_runner, one_line

__all__ = ["DEFAULT_HEAD_DIMS", "DEFAULT_SEQLENS", "SweepSettings", "run_sweep", "sweep_shapes"]

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128, 256)


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
    #: K/V heads of every shape (grouped-query attention); 0: as many as query heads.
    kv_heads: int = 0
    #: A causal sliding window of this many keys before each query (``--window``); 0: none.
    window: int = 0
    #: The scalar score functions on every shape's scores and their values (``--<name>``, one option per
    #: function of spec.score_functions); (): none.
    score: tuple[tuple[str, float], ...] = ()
    #: ALiBi on every shape (``--alibi``).
    alibi: bool = False
    #: Attention sinks on every shape (``--sinks``).
    sinks: bool = False
    #: v's own head_dim on every shape (``--head-dim-v``; q and k keep ``head_dims``); 0: head_dim.
    head_dim_v: int = 0
    config: str | None = None
    warmup: int = 3
    min_reps: int = 25
    min_time_s: float = 0.2
    quick: bool = False
    #: The shapes to time instead of the convention's (``--tiny``); their rows are marked ``"tiny"``.
    shapes: tuple[Shape, ...] | None = None
    #: Times every implementation of a shape this many times in turn (``--rounds``): host-bound calls move
    #: by tens of percent between runs, so an A/B is read from rounds taken side by side in one process.
    rounds: int = 1
    #: Our rows once per form of repeat calls (ops.repeat.MODE: "off", "python", "native"), in turn within
    #: each round (``--repeat-calls``); empty: the process's own.
    repeat_modes: tuple[str, ...] = ()


def sweep_shapes(s: SweepSettings) -> list[Shape]:
    shapes = []
    for d in s.head_dims:
        for causal in s.causal:
            for n in s.seqlens:
                heads = max(1, s.width // d)  # (q's head_dim, also where v has its own)
                shapes.append(
                    Shape(
                        s.dtype,
                        max(1, s.tokens // n),
                        heads,
                        n,
                        d,
                        causal,
                        s.kv_heads,
                        s.window if causal else 0,
                        s.score,
                        s.alibi,
                        s.sinks,
                        s.head_dim_v,
                    )
                )
    return shapes


def _describe(shape: Shape) -> str:
    return (
        f"{shape.dtype} d={shape.head_dim:<3}"
        + (f" dv={shape.dv:<3}" if shape.head_dim_v else "")
        + f" {'causal    ' if shape.causal else 'non-causal'} "
        f"seqlen={shape.seqlen:<5} batch={shape.batch:<2} heads={shape.heads:<2}"
        + (f" kv_heads={shape.kv}" if shape.kv != shape.heads else "")
        + (f" window={shape.window}" if shape.window else "")
        + "".join(f" {name}={value:g}" for name, value in shape.score)
        + (" alibi" if shape.alibi else "")
        + (" sinks" if shape.sinks else "")
    )


def _max_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max().item())


def _anchor_output(shape: Shape, inputs: list[tuple[Any, Any, Any]]) -> tuple[Any, str | None]:
    """SDPA's output on set 0, the yardstick every row's ``max_diff_vs_sdpa`` is measured against.

    FLASH first (the baseline of our ratios), then cuDNN and EFFICIENT for shapes FLASH rejects, and
    FlexAttention for a score function no SDPA mask expresses (soft-capping). Never the math backend: at 16k
    it would materialise a 16 GB score matrix. With v of its own head_dim (--head-dim-v) FLASH refuses the
    shape and cuDNN, EFFICIENT or FlexAttention, which take it, give the (batch, seqlen, heads, head_dim_v)
    output every row is compared with.
    """
    for impl in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"):
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
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def run_sweep(
    s: SweepSettings,
    out_path: Path | None,
    merge: bool = False,
    commit: str | None = None,
    allow_dirty: bool = False,
) -> tuple[dict, int]:
    """Measure every (shape, impl) of ``s``; returns the result dict and an exit status.

    Each finished row is printed at once; the result file is rewritten after every shape so an interrupted
    or crashed sweep still leaves what it measured. ``commit`` is what the code is, for a copy without git
    metadata (the result records it with a digest of the sources that ran: tools/provenance.py); where git
    can tell, uncommitted package sources are refused unless ``allow_dirty``.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    timing = dict(warmup=s.warmup, min_reps=s.min_reps, min_time_s=s.min_time_s)
    result: dict = environment(device, commit, allow_dirty)
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
        "kv_heads": s.kv_heads,
        **({"head_dim_v": s.head_dim_v} if s.head_dim_v else {}),
        "config": s.config,
        "warmup": s.warmup,
        "min_reps": s.min_reps,
        "min_time_s": s.min_time_s,
        "quick": s.quick,
        "tiny": bool(s.shapes),
        "rounds": s.rounds,
        "repeat_calls": list(s.repeat_modes) or [repeat.MODE],
        "timing": "CUDA events per call, median; inputs rotated when one set is under 2x L2",
    }
    result["rows"] = []
    result["skipped"] = []
    status = 0
    l2 = l2_bytes()
    shapes = list(s.shapes) if s.shapes else sweep_shapes(s)
    t_start = time.perf_counter()
    try:
        for si, shape in enumerate(shapes):
            # q and out with the query heads, k and v with the kv heads, 2 bytes an element (q and k head_dim
            # wide, v and out v's head_dim)
            widths = shape.head_dim + shape.dv
            set_bytes = shape.batch * shape.seqlen * (shape.heads + shape.kv) * widths * 2
            n_sets = input_sets_needed(set_bytes, l2)
            inputs = make_inputs(shape, n_sets, device)
            anchor, anchor_impl = _anchor_output(shape, inputs)
            print(
                f"[{si + 1}/{len(shapes)}, {time.perf_counter() - t_start:.0f} s] {_describe(shape)}"
                f" ({n_sets} input set{'s' if n_sets > 1 else ''})",
                flush=True,
            )
            for impl, round_, repeat_mode in _turns(s):
                row_base = _row_base(impl, shape, s, round_, repeat_mode)
                try:
                    with _repeat_mode(repeat_mode):
                        row = _measure(impl, shape, inputs, s, timing, anchor, anchor_impl)
                except Exception as exc:
                    reason = (
                        one_line(exc) if isinstance(exc, Skip) else f"{type(exc).__name__}: {one_line(exc)}"
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
                if s.repeat_modes and impl == OURS:
                    extra += f"  (repeat calls: {repeat_mode})"
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
                write_results(merged(previous, result), out_path)
    except KeyboardInterrupt:
        result["aborted"] = "interrupted"
        status = 130
    except RuntimeError as exc:
        result["aborted"] = str(exc)
        print(f"aborting: {exc}", flush=True)
        status = 1
    result = merged(previous, result)
    if out_path is not None:
        write_results(result, out_path)
    return result, status


def _row_base(impl: str, shape: Shape, s: SweepSettings, round_: int, repeat_mode: str) -> dict:
    """What a row (measured or skipped) says about its point: the implementation, the shape, its variant."""
    row = {
        "impl": impl,
        "mode": s.mode,
        # (OURS_FP8: the sweep's tensors quantized to e4m3 for that row alone)
        "dtype": "fp8_e4m3" if impl == OURS_FP8 else shape.dtype,
        "head_dim": shape.head_dim,
        "causal": shape.causal,
        "seqlen": shape.seqlen,
        "batch": shape.batch,
        "heads": shape.heads,
        "kv_heads": shape.kv,
    }
    if shape.head_dim_v:
        row["head_dim_v"] = shape.dv  # (absent: v has head_dim, as in every file before --head-dim-v)
    if shape.window:
        row["window"] = shape.window
    row.update(shape.score)  # (each function's value under its name)
    if shape.alibi:
        row["alibi"] = True
    if shape.sinks:
        row["sinks"] = True
    if s.shapes:
        row["tiny"] = True
    if s.rounds > 1:
        row["round"] = round_
    if impl == OURS:
        row["repeat_calls"] = repeat_mode
    return row


def _turns(s: SweepSettings) -> list[tuple[str, int, str]]:
    """``(impl, round, repeat mode)`` in the order a shape's rows are timed: each round times every
    implementation, ours once per repeat mode."""
    modes = s.repeat_modes or (repeat.MODE,)
    return [
        (impl, r, mode)
        for r in range(s.rounds)
        for impl in s.impls
        for mode in (modes if impl == OURS else (repeat.MODE,))
    ]


@contextlib.contextmanager
def _repeat_mode(mode: str):
    """Our calls with repeat calls in ``mode`` (and none remembered from another mode)."""
    before = repeat.MODE
    if mode == before:
        yield
        return
    repeat.MODE = mode
    repeat.clear()
    try:
        yield
    finally:
        repeat.MODE = before
        repeat.clear()


def _warning_text(caught: list) -> str:
    msgs = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return " | ".join(dict.fromkeys(msgs))[:500]


def _measure(
    impl: str,
    shape: Shape,
    inputs: list[tuple[Any, Any, Any]],
    s: SweepSettings,
    timing: dict,
    anchor: Any,
    anchor_impl: str | None,
) -> dict:
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
            raise Skip(f"{type(exc).__name__}: {one_line(exc)}" + (f" ({why})" if why else "")) from exc
    row: dict = {}
    if runner.config is not None:
        row["config"] = runner.config
    f = flops(
        shape.batch,
        shape.heads,
        shape.seqlen,
        shape.seqlen,
        shape.head_dim,
        shape.causal,
        s.mode,
        shape.window,
        shape.dv,
    )
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
