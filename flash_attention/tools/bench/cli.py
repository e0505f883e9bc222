"""``python -m flash_attention bench``: the command line of the benchmark.

Without options: the DESIGN.md forward sweep (16k tokens per batch, model width 2048, seqlen 512..16k,
head_dim 64/128/256, causal both, bf16) of ours against every PyTorch backend, written to
``<--output>/<gpu>-<date>.json``: by default ``./flash_attention_results`` of the current directory (git
ignores it in a checkout), so a user's run never touches the committed results; the repository's own are
written with ``--output benchmarks/results``. ``--mode fwd_bwd`` times training steps, ``--tiny`` the small,
latency-bound calls where host overhead shows, ``--progression`` the optimisation steps, ``--plot`` and
``--update-readme`` turn a result file into plots and README tables without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from flash_attention.configs import parse_config
from flash_attention.ops.winners import gpu_slug
from flash_attention.spec.score_functions import SCORE_FUNCTIONS

from ..common import MODES, PERFORMANCE_PAGE, environment, ready_host_library, repo_root
from .plot import plot_results
from .progression import run_backward_progression, run_progression
from .readme import update_readme
from .results import (
    DEFAULT_IMPLS,
    DEFAULT_OUTPUT,
    KNOWN_IMPLS,
    OURS,
    OURS_DETERMINISTIC,
    OURS_FP8,
    OURS_PLAIN_CALL,
    load_results,
    newest_results,
    write_results,
)
from .sweep import DEFAULT_HEAD_DIMS, DEFAULT_SEQLENS, SweepSettings, run_sweep
from .tables import results_to_markdown, results_to_text
from .tiny import TINY_SHAPES

__all__ = ["build_parser", "main"]


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


def _int_list_with_zero(text: str) -> tuple[int, ...]:
    """:func:`_int_list` that also takes 0 (a contiguous cache among page sizes)."""
    parts = [p for p in text.split(",") if p.strip()]
    zeros = tuple(0 for p in parts if p.strip() == "0")
    rest = ",".join(p for p in parts if p.strip() != "0")
    return zeros + (_int_list(rest) if rest else ())


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def sweep_tag(tag: str | None, head_dim_v: int) -> str | None:
    """The tag of a sweep's default result file name: ``dv<N>`` for ``--head-dim-v N`` (its rows are another
    problem than the plain sweep's, so never the same file by default), then ``--tag``'s (or --quick's)."""
    parts = [f"dv{head_dim_v}"] if head_dim_v else []
    if tag:
        parts.append(tag)
    return "-".join(parts) or None


def _impl_list(text: str) -> tuple[str, ...]:
    impls = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [i for i in impls if i not in KNOWN_IMPLS]
    if unknown or not impls:
        raise argparse.ArgumentTypeError(f"unknown impls {unknown}; choose from {','.join(KNOWN_IMPLS)}")
    return impls


def _score_args(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """The score functions given on the command line (``--<name> VALUE``), as Shape.score holds them."""
    return tuple((name, getattr(args, name)) for name in SCORE_FUNCTIONS if getattr(args, name))


def _repeat_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [m for m in modes if m not in ("off", "python", "native")]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown repeat-call forms {unknown}; choose from off, python, native"
        )
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flash_attention bench",
        description=(
            "Benchmark flash_attention against PyTorch's attention backends on the DESIGN.md sweep "
            "(16k tokens per batch, model width 2048) and write the result JSON."
        ),
    )
    # Options whose default depends on --quick or --config default to None and are resolved in main().
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default): the kernels against PyTorch's backends on the sweep; cpu: the PyTorch fallback "
        "against SDPA on CPU tensors (forward and forward+backward, float32 and bfloat16, the shapes of "
        "tools/bench/fallback.py; file tag 'cpu')",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="input dtype (default bf16). fp32 on cuda runs the PyTorch fallback against SDPA's own float32 "
        "choice (forward and forward+backward, the CUDA shapes of tools/bench/fallback.py; file tag 'fp32'); "
        "with --device cpu it keeps only that dtype",
    )
    p.add_argument(
        "--mode",
        choices=(*MODES, "decode", "model", "cold-start"),
        default="fwd",
        help="fwd (default); bwd and fwd_bwd need a backward; decode: attention_with_kvcache against a long "
        "cache, contiguous and paged, with the K/V bandwidth (--seqlens are then cache lengths, default "
        "1k,8k,32k,128k; --batches, --page-sizes, --seqlens-q; heads 32 / --kv-heads 8, head_dim 128; file "
        "tag 'decode'); model: a training step of a Llama-style transformers model with random weights, "
        "ours against transformers' sdpa (--layers 8, --width 2048, head_dim 128, --kv-heads 8, --batches "
        "1, --seqlens 4k; file tag 'model'); cold-start: each first call (forward, forward+backward, decode, "
        "a transformers generate() with and without precompile_model) in a fresh process with an empty "
        "kernel cache, with and without a C++ compiler, beside sdpa_cudnn's and fa4's first calls (file tag "
        "'cold-start')",
    )
    p.add_argument("--batches", type=_int_list, default=None, help="--mode decode: batch sizes (1,8,64)")
    p.add_argument(
        "--page-sizes",
        type=_int_list_with_zero,
        default=None,
        help="--mode decode: page sizes, 0 = contiguous (0,16,256)",
    )
    p.add_argument(
        "--seqlens-q", type=_int_list, default=None, help="--mode decode: query tokens per row (1)"
    )
    p.add_argument(
        "--num-splits",
        type=int,
        default=0,
        help="--mode decode: our split count (default 0: the heuristic's), to compare against it",
    )
    p.add_argument(
        "--seqlens", type=_int_list, default=None, help="comma-separated, 1k = 1024 (default 512,...,16k)"
    )
    p.add_argument("--head-dims", type=_int_list, default=None, help="comma-separated (default 64,128,256)")
    p.add_argument(
        "--head-dim-v",
        type=_positive_int,
        default=0,
        metavar="N",
        help="the sweep (--mode fwd, bwd, fwd_bwd) with v of its own head_dim N on every shape (the output "
        "and dO too; q and k keep --head-dims, heads = width // q's head_dim), e.g. DeepSeek's MLA prefill: "
        "--head-dims 192 --head-dim-v 128; a head_dim under N and an implementation that takes no v of its "
        "own are skipped with the reason; FLOPs: forward 2·B·H·S²·(d + dv), backward 2·B·H·S²·(3d + 2dv), "
        "halved for causal; rows record head_dim_v; file tag 'dv<N>'",
    )
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="default both")
    p.add_argument(
        "--impls",
        type=_impl_list,
        default=DEFAULT_IMPLS,
        help=f"comma-separated (default {','.join(DEFAULT_IMPLS)}; also {OURS_DETERMINISTIC}: ours with "
        f"deterministic=True, backward modes; {OURS_PLAIN_CALL}: plain attention(), --mode decode, where the "
        f"default is flash_attention,sdpa_cudnn,sdpa_flash and it; {OURS_FP8}: ours on the inputs quantized "
        "to e4m3 per (batch, kv head), rows of dtype fp8_e4m3; backward modes: attention(..., fp8=True), its "
        "quantizing pass timed)",
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
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help="model width: heads = width // head_dim (2048; --ring: 4096, a long-context model's 32 heads)",
    )
    p.add_argument("--layers", type=int, default=8, help="--mode model: decoder layers (8)")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="K/V heads of every shape (grouped-query attention, e.g. Llama-style: --width 4096 "
        "--kv-heads 8); default: as many as query heads",
    )
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="causal shapes only: a sliding window of this many keys before each query (attention()'s "
        "window=(W, 0); SDPA gets the explicit mask, FlexAttention the block mask); FLOPs count the band",
    )
    for fn in SCORE_FUNCTIONS.values():  # (one option per scalar score function, spec.score_functions)
        p.add_argument(
            f"--{fn.name}",
            type=float,
            default=0.0,
            help=f"every shape's scores through this function at this value: it {fn.doc} (attention()'s "
            f"{fn.name}=; FlexAttention gets it as a score_mod, SDPA has none and is skipped); with "
            f"--features, its row's value (default {fn.typical:g})",
        )
    p.add_argument(
        "--alibi",
        action="store_true",
        help="ALiBi on every shape with the geometric slopes 2^(-8h/heads) (attention()'s alibi_slopes=; "
        "FlexAttention gets the score_mod, SDPA the additive mask)",
    )
    p.add_argument(
        "--ring",
        action="store_true",
        help="context parallelism: ring_attention (and head_parallel_attention, where the heads divide "
        "among the GPUs) on every visible GPU against one GPU, forward+backward of one causal sequence per "
        "--seqlens (default 16k to 128k; heads from --width, --kv-heads default 8), with peak memory (file "
        "tag 'ring')",
    )
    p.add_argument(
        "--varlen",
        action="store_true",
        help="a packed batch of ragged documents (lengths uniform in 128..8192, --tokens of them, default "
        "64k) through attention_varlen, against the padded dense batch's useful work, FlexAttention's "
        "document mask and SDPA's block-diagonal mask (--mode fwd or fwd_bwd; with --alibi, ALiBi on each "
        "document, SDPA skipped; file tag 'varlen', 'varlen-alibi')",
    )
    p.add_argument(
        "--features",
        action="store_true",
        help="instead of the sweep, each feature of the backward beside the plain call, forward+backward at "
        "one shape (--head-dims, default 128; --seqlens, default 4k; --tokens, --width, --causal): "
        "deterministic, dropout, key ranges, a sliding window (--window, default 1024; causal), each scalar "
        "score function (its option's value, or its typical one), ALiBi, sinks with their gradient, GQA 4:1, "
        "a packed batch; each row's "
        "time and useful TFLOP/s against the plain call's (file tag 'features')",
    )
    p.add_argument(
        "--sinks",
        action="store_true",
        help="attention sinks on every shape, a logit per query head (attention()'s sinks=; SDPA and "
        "FlexAttention have none and are skipped)",
    )
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
        "--tiny",
        action="store_true",
        help="instead of the sweep, the small latency-bound calls where host overhead shows: "
        + ", ".join(s.label() for s in TINY_SHAPES)
        + " (time per call; file tag 'tiny')",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="with --tiny (default 1), --mode decode or --mode model (default 3): time every implementation "
        "this many times in turn (host-bound calls move between runs: compare rounds taken side by side; "
        "the table shows the median)",
    )
    p.add_argument(
        "--repeat-calls",
        type=_repeat_modes,
        default=(),
        help="with --tiny: our rows once per form of repeat calls, in turn (comma-separated of off, python, "
        "native; default: FLASH_ATTENTION_REPEAT_CALLS's)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        metavar="DIR",
        help=f"folder of the result file and the plots (default: {DEFAULT_OUTPUT} in the current directory; "
        "the result files of this repository are written with --output benchmarks/results)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="result file (default <--output>/<gpu>-<date>[-<tag>].json)"
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
        "--allow-dirty",
        action="store_true",
        help="record a run of uncommitted code (marked dirty; no README table accepts such a file)",
    )
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
        "file, plot that file into --output and measure nothing (needs no GPU)",
    )
    p.add_argument(
        "--progression",
        action="store_true",
        help="time the sequence of optimisation steps (plain -> swizzled -> ... -> tuned) instead of the "
        "sweep; with --mode fwd_bwd the backward's (portable -> wgmma -> warp-specialized, then the "
        "deterministic mode); default shape: head_dim 128, seqlen 4096 (--head-dims, --seqlens, --causal "
        "choose others)",
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
        "--readme",
        type=Path,
        default=None,
        help="page to update (default: the checkout's docs/performance.md; README.md has the headline "
        "fwd_bwd region)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.width is None and not args.ring:
        args.width = 2048

    if args.update_readme is not None:
        try:
            results = Path(args.update_readme) if args.update_readme else newest_results()
            readme = args.readme or (repo_root() / PERFORMANCE_PAGE)
            update_readme(readme, results)
        except (OSError, ValueError) as exc:
            print(f"--update-readme: {exc}", file=sys.stderr)
            return 2
        print(f"updated {readme} from {results}")
        return 0

    if args.plot:
        try:
            for path in plot_results(load_results(args.plot), args.plot, out_dir=args.output):
                print(f"wrote {path}")
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"--plot: {exc}", file=sys.stderr)
            return 2
        return 0

    if args.head_dim_v and (
        args.mode not in MODES
        or args.tiny
        or args.progression
        or args.ring
        or args.varlen
        or args.device == "cpu"
        or args.dtype == "fp32"
    ):
        # (the other modes, --tiny, --progression, --ring, --varlen and the fallback's bench (--device cpu,
        # --dtype fp32) have shapes of their own)
        print("--head-dim-v goes with the CUDA sweep: --mode fwd, bwd or fwd_bwd", file=sys.stderr)
        return 2

    if args.device == "cpu" or args.dtype == "fp32":
        return _main_fallback(args)

    cfg = None
    if args.config is not None:
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
    tag = args.tag if args.tag is not None else ("quick" if args.quick else "tiny" if args.tiny else None)
    if args.repeat_calls and not args.tiny:
        # The sweep's tables read one row per (impl, point); forms are for host-bound A/Bs.
        print("--repeat-calls goes with --tiny", file=sys.stderr)
        return 2
    if args.rounds is not None and not (args.tiny or args.mode in ("decode", "model")):
        print("--rounds goes with --tiny, --mode decode or --mode model", file=sys.stderr)
        return 2
    if args.rounds is None:
        args.rounds = 3 if args.mode in ("decode", "model") and not args.tiny else 1
    if args.rounds < 1:
        print(f"--rounds must be at least 1; got {args.rounds}", file=sys.stderr)
        return 2

    if args.mode != "fwd" and OURS in args.impls and cfg is not None:
        # Backward modes time attention() through autograd (forward + our backward kernels), whose configs
        # are chosen per call.
        print("--config applies to --mode fwd only (backward modes run attention())", file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        print(
            "bench times CUDA kernels and needs a CUDA GPU; none was found. On this machine, --device cpu "
            "times the PyTorch fallback against SDPA on the CPU (--plot RESULTS.json and --update-readme "
            "need no GPU either).",
            file=sys.stderr,
        )
        return 2

    if args.mode == "cold-start":
        return _main_cold_start(args)  # (its processes start from nothing: no host library built here)
    ready_host_library("bench")  # (before anything is timed)

    if args.ring:
        return _main_ring(args)
    if args.varlen:
        return _main_varlen(args, reps, min_time)
    if args.mode == "decode":
        return _main_decode(args, reps, min_time)
    if args.mode == "model":
        return _main_model(args, reps, min_time)
    if args.features:
        return _main_features(args, reps, min_time)

    if args.progression:
        # --mode fwd_bwd: the backward's steps (timed alone); otherwise the forward's.
        progression = run_backward_progression if args.mode == "fwd_bwd" else run_progression
        steps = progression(
            dtype,
            args.head_dims or (128,),
            args.seqlens or (4096,),
            {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal],
            dict(warmup=args.warmup, min_reps=reps, min_time_s=min_time),
        )
        if args.out is not None:
            # Its own schema ("steps", no "rows"), so the README tools never take it for a sweep.
            result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
            result.update(mode="progression", steps=steps)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {args.out}")
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
        kv_heads=args.kv_heads,
        window=args.window,
        score=_score_args(args),
        alibi=args.alibi,
        sinks=args.sinks,
        head_dim_v=args.head_dim_v,
        config=args.config,
        warmup=args.warmup,
        min_reps=reps,
        min_time_s=min_time,
        quick=args.quick,
        shapes=tuple(s.shape(dtype) for s in TINY_SHAPES) if args.tiny else None,
        rounds=args.rounds,
        repeat_modes=args.repeat_calls,
    )
    out_path = None
    if not args.no_save:
        if args.out is not None:
            out_path = args.out
        else:
            name = gpu_slug(torch.cuda.get_device_name()) + "-" + _dt.date.today().isoformat()
            tag = sweep_tag(tag, args.head_dim_v)
            out_path = args.output / (name + (f"-{tag}" if tag else "") + ".json")
        if out_path.exists() and not args.merge:
            print(f"note: {out_path} exists and will be overwritten (--merge keeps its other rows)")

    result, status = run_sweep(
        settings, out_path, merge=args.merge, commit=args.commit, allow_dirty=args.allow_dirty
    )
    print()
    print(results_to_text(result))
    if result.get("skipped"):
        print(f"{len(result['skipped'])} points skipped (reasons in the result file under 'skipped').")
    if args.markdown:
        print(results_to_markdown(result))
    if out_path is not None:
        print(f"wrote {out_path}")
        if args.plot is not None:
            try:
                for path in plot_results(result, out_path):
                    print(f"wrote {path}")
            except RuntimeError as exc:
                print(f"--plot: {exc}", file=sys.stderr)
    return status


def _main_fallback(args: argparse.Namespace) -> int:
    """``--device cpu`` or ``--dtype fp32``: the PyTorch fallback against SDPA on the same tensors, saved like
    a sweep (file tag 'cpu', or 'fp32' after the GPU's name)."""
    from .fallback import fallback_environment, fallback_results_to_text, run_fallback_bench

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "--dtype fp32 times the fallback on a CUDA GPU, and none is available (--device cpu --dtype fp32 "
            "times it on the CPU)",
            file=sys.stderr,
        )
        return 2
    if device == "cpu" and args.dtype == "fp16":
        print("--device cpu times fp32 and bf16 (--dtype picks one of them)", file=sys.stderr)
        return 2
    result = fallback_environment(device, args.commit, args.allow_dirty)
    print(fallback_results_to_text({**result, "rows": []}).splitlines()[0])
    timing = {}
    if args.reps is not None:
        timing["min_reps"] = args.reps
    if args.min_time is not None:
        timing["min_time_s"] = args.min_time
    result["rows"] = run_fallback_bench(device, dtypes=(args.dtype,) if args.dtype else None, **timing)
    print(fallback_results_to_text(result))
    if not args.no_save:
        if device == "cpu":
            stem = f"cpu-{result['date']}"
        else:
            stem = f"{gpu_slug(result['gpu'])}-{result['date']}-fp32"
        out_path = args.out or args.output / (f"{stem}-{args.tag}.json" if args.tag else f"{stem}.json")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out_path}")
    return 0


def decode_impls(requested: tuple[str, ...]) -> tuple[str, ...]:
    """The implementations ``--mode decode`` times: without ``--impls`` the decode grid's own set (plain
    ``attention()`` included, which the sweeps' default does not name); with it, those it names that decode
    has."""
    from .decode import DECODE_IMPLS

    return DECODE_IMPLS if requested == DEFAULT_IMPLS else tuple(i for i in DECODE_IMPLS if i in requested)


def _main_decode(args: argparse.Namespace, reps: int, min_time: float) -> int:
    """``--mode decode``: :mod:`.decode`'s grid, saved with the same run's copy bandwidth (tag 'decode')."""
    from .decode import (
        DECODE_BATCHES,
        DECODE_PAGE_SIZES,
        DECODE_SEQLENS,
        DecodeSettings,
        decode_markdown,
        decode_text,
        measure_copy_tb_s,
        run_decode,
    )

    settings = DecodeSettings(
        impls=decode_impls(args.impls),
        batches=args.batches or DECODE_BATCHES,
        seqlens=args.seqlens or DECODE_SEQLENS,
        page_sizes=args.page_sizes if args.page_sizes is not None else DECODE_PAGE_SIZES,
        seqlens_q=args.seqlens_q or (1,),
        num_splits=args.num_splits,
        heads_kv=args.kv_heads or 8,
        head_dim=(args.head_dims or (128,))[0],
        dtype=args.dtype or "bf16",
        warmup=args.warmup,
        min_reps=reps,
        min_time_s=min_time,
        rounds=args.rounds,
    )
    timing = dict(warmup=args.warmup, min_reps=reps, min_time_s=min_time)
    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    result.update(mode="decode", matmul_tflops=None, copy_tb_s=round(measure_copy_tb_s(**timing), 3))
    print(f"device-to-device copy: {result['copy_tb_s']:.2f} TB/s (the ceiling in this run)", flush=True)
    result["rows"] = run_decode(settings)
    print()
    print(decode_text(result))
    if args.markdown:
        print(decode_markdown(result))
    _save_tagged(result, args, "decode")
    return 0


def _main_model(args: argparse.Namespace, reps: int, min_time: float) -> int:
    """``--mode model``: :mod:`.model`'s training step for each (batch, seqlen), saved with tag 'model'."""
    from .model import MODEL_IMPLS, ModelSettings, model_text, run_model

    rows = []
    for batch in args.batches or (1,):
        for seqlen in args.seqlens or (4096,):
            settings = ModelSettings(
                impls=MODEL_IMPLS,
                layers=args.layers,
                width=args.width,
                head_dim=(args.head_dims or (128,))[0],
                heads_kv=args.kv_heads or 8,
                batch=batch,
                seqlen=seqlen,
                dtype=args.dtype or "bf16",
                rounds=args.rounds,
                warmup=args.warmup,
                min_reps=min(reps, 10),
                min_time_s=max(min_time, 0.5),
            )
            rows += run_model(settings)
            print(model_text(rows[-len(MODEL_IMPLS) :]), flush=True)
    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    result.update(mode="model", matmul_tflops=None, rows=rows)
    print()
    print(model_text(rows))
    _save_tagged(result, args, "model")
    return 0


def _main_cold_start(args: argparse.Namespace) -> int:
    """``--mode cold-start``: :mod:`.cold_start`'s first calls, each in a fresh process (tag 'cold-start')."""
    from .cold_start import cold_start_text, run_cold_start

    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    print(cold_start_text([]), flush=True)
    rows = run_cold_start()
    result.update(mode="cold-start", matmul_tflops=None, rows=rows)
    print()
    print(cold_start_text(rows))
    _save_tagged(result, args, "cold-start")
    return 0


def _main_ring(args: argparse.Namespace) -> int:
    """``--ring``: :mod:`.ring`'s one-GPU against ring comparison, saved with tag 'ring'."""
    import tempfile

    from .ring import RingSettings, run_ring

    world = torch.cuda.device_count()
    if world < 2:
        print("--ring needs at least two visible GPUs", file=sys.stderr)
        return 2
    d = (args.head_dims or (128,))[0]
    settings = RingSettings(
        seqlens=tuple(args.seqlens) if args.seqlens else RingSettings.seqlens,
        heads=max(1, (args.width or 4096) // d),
        kv_heads=args.kv_heads or 8,
        head_dim=d,
        dtype=args.dtype or "bf16",
        world=world,
    )
    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_ring(settings, os.path.join(tmp, "init"))
    result.update(mode="ring", matmul_tflops=None, rows=rows)
    _save_tagged(result, args, "ring")
    return 0


def _main_varlen(args: argparse.Namespace, reps: int, min_time: float) -> int:
    """``--varlen``: :mod:`.varlen`'s packed batch, saved with tag 'varlen'."""
    from .varlen import VARLEN_IMPLS, VarlenSettings, run_varlen

    d = (args.head_dims or (128,))[0]
    # --impls picks among them (flash_attention brings its padded twin along).
    picked = [i for i in VARLEN_IMPLS if i in args.impls or (i.startswith(OURS) and OURS in args.impls)]
    settings = VarlenSettings(
        impls=VARLEN_IMPLS if args.impls == DEFAULT_IMPLS else tuple(picked),
        head_dim=d,
        heads=max(1, args.width // d),
        kv_heads=args.kv_heads,
        tokens=args.tokens if args.tokens != 16384 else 65536,
        causal={"both": (True, False), "yes": (True,), "no": (False,)}[args.causal],
        mode=args.mode if args.mode in ("fwd", "fwd_bwd") else "fwd",
        dtype=args.dtype or "bf16",
        alibi=args.alibi,
        warmup=args.warmup,
        min_reps=min(reps, 10),
        min_time_s=min_time,
    )
    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    result.update(mode="varlen", matmul_tflops=None, rows=run_varlen(settings))
    _save_tagged(result, args, "varlen-alibi" if args.alibi else "varlen")
    return 0


def _main_features(args: argparse.Namespace, reps: int, min_time: float) -> int:
    """``--features``: :mod:`.features`' rows, saved with tag 'features'."""
    from .features import FeaturesSettings, run_features

    defaults = FeaturesSettings()
    settings = FeaturesSettings(
        head_dim=(args.head_dims or (defaults.head_dim,))[0],
        seqlen=(args.seqlens or (defaults.seqlen,))[0],
        tokens=args.tokens,
        width=args.width,
        causal={"both": (False, True), "yes": (True,), "no": (False,)}[args.causal],
        dtype=args.dtype or "bf16",
        window=args.window or defaults.window,
        score_values=_score_args(args),
        warmup=args.warmup,
        min_reps=reps,
        min_time_s=min_time,
    )
    result = environment(torch.cuda.current_device(), args.commit, args.allow_dirty)
    result.update(mode="features", matmul_tflops=None, rows=run_features(settings))
    _save_tagged(result, args, "features")
    return 0


def _save_tagged(result: dict, args: argparse.Namespace, default_tag: str) -> None:
    """Write a mode's result file: ``--out``, else ``<gpu>-<date>-<tag>.json`` in ``--output`` (``--tag`` or
    the mode's own); nothing with ``--no-save``."""
    if args.no_save:
        return
    name = gpu_slug(torch.cuda.get_device_name()) + "-" + _dt.date.today().isoformat()
    out_path = args.out or args.output / f"{name}-{args.tag or default_tag}.json"
    write_results(result, out_path)
    print(f"wrote {out_path}")
