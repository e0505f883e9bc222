"""Autotuning: the candidate space, its pruning rules, the timing loop and the winners' cache.

``python -m flash_attention autotune`` times every candidate that survives the pruning rules for each
(GPU, dtype, head_dim, causal, sequence-length bucket, GQA group) and writes the winners to a JSON cache.
:func:`lookup` is what ``attention()`` consults first; without an entry it uses the readable heuristic
:func:`flash_attention.configs.default_config`.

A cache is only used when it was made on a GPU of the same name, with the same compiler and the same kernel
sources (a hash of every file under ``csrc/``): a winner measured on an older kernel is never applied to a
newer one. Two caches are read: the user's (``<cache dir>/autotune.json``, written by the command) and the
one shipped with the package for the GPU we measure on (``flash_attention/tuned/<gpu>.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .configs import (
    KernelConfig,
    default_config,
    estimated_registers,
    padded_head_dim,
    validity_errors,
    wgmma_config,
)

SEQLEN_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
CACHE_FILE = "autotune.json"
FORMAT_VERSION = 1


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


# --------------------------------------------------------------------------------------------------
# The space and its pruning rules


def candidate_space(dtype: str, head_dim: int, causal: bool, arch: str = "sm_80") -> list[KernelConfig]:
    """Every structurally valid combination of the knobs the tuner varies, before pruning.

    Fixed on: cp.async, eager K/V loading, swizzled shared memory and the exp2-folded softmax. Each is a
    step of ``bench --progression``, measured to help on every shape we run (docs/kernel-log.md); varying
    them would only multiply the space by configurations known to lose. Fixed off: reverse K/V order,
    measured within 1% of forward order for causal at head_dim 128 (kernel-log, step 4), so not worth
    doubling the causal space for. K/V fragment groups of 1, 2 or 4 slices: 4 already spans all of
    head_dim 64 and half of 128, and longer groups only hold more registers for the same loads.

    On sm_90 (``arch``) the space is the wgmma kernel's configs instead: one or two warpgroups per block,
    32- to 128-key tiles and a K/V ring 1 to 3 deep (its other knobs are fixed by the kernel). The sm80
    kernel's configs cannot win there: its tuned defaults measured 11-42% below the best wgmma config at every
    point of a scratch sweep on an H100 (docs/kernel-log.md, steps 17-18), so timing them is wasted.
    """
    d = padded_head_dim(head_dim)
    dk = d // 16
    out: list[KernelConfig] = []
    if arch in ("sm_90", "sm_90a"):
        for block_q, block_kv, stages in itertools.product((64, 128), (32, 64, 128), (1, 2, 3)):
            if not validity_errors(wgmma_config(dtype, d, block_q, block_kv, stages, check=False)):
                out.append(wgmma_config(dtype, d, block_q, block_kv, stages))
        return out
    for block_q, warps, block_kv in itertools.product((64, 128, 256), (4, 8), (32, 64, 128)):
        for q_frags, k_frags, v_frags, buffered in itertools.product(
            (0, 1, 2, 4), (1, 2, 4), (1, 2), (False, True)
        ):
            for reverse in (False,):
                if (q_frags and dk % q_frags) or dk % k_frags:
                    continue
                cfg = KernelConfig.unchecked(
                    dtype,
                    d,
                    block_q,
                    block_kv,
                    warps,
                    q_frags=q_frags,
                    k_frags=k_frags,
                    v_frags=v_frags,
                    double_buffer=buffered,
                    reverse_kv=reverse,
                )
                if not validity_errors(cfg):
                    out.append(KernelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}))
    return out


def _rule_rows_per_warp(cfg: KernelConfig) -> str | None:
    # One or two 16-row mma tiles per warp. Three or more need 48+ rows of O and S accumulators per warp,
    # over the 255-register limit at every head_dim we ship.
    if cfg.rows_per_warp not in (16, 32):
        return "rows per warp must be 16 or 32"
    return None


def _rule_registers(cfg: KernelConfig) -> str | None:
    # The accumulators, Q (if resident) and the K/V fragment buffers must fit in 255 registers; a config
    # that does not would spill in its inner loop. (The compiler's report is checked again after the build.)
    if estimated_registers(cfg) > 255:
        return "estimated registers above 255"
    return None


def _rule_occupancy(cfg: KernelConfig) -> str | None:
    # A block must leave room for a second block on the SM: with a single resident block, its softmax
    # phase leaves the tensor cores idle (measured: 128x128x8 at head_dim 64 ran 20% slower than 128x64x4).
    # A wgmma block of two warpgroups is the exception: its second warpgroup is that other party. Checked
    # here against the shared memory of Hopper (227 KB) and the estimated registers; after the build, again
    # against the compiler's actual register count (prepare_candidates).
    return occupancy_problem(cfg, estimated_registers(cfg))


def occupancy_problem(cfg: KernelConfig, registers: int) -> str | None:
    blocks = blocks_per_sm(cfg, registers)
    if cfg.wgmma:
        return None if blocks * cfg.num_warps >= 8 else "fewer than 2 warpgroups per SM"
    return None if blocks >= 2 else "fewer than 2 blocks per SM"


def blocks_per_sm(cfg: KernelConfig, registers: int) -> int:
    from .report import occupancy

    return occupancy("sm_90", cfg.threads, registers, cfg.smem_bytes).blocks


def _rule_fragment_order(cfg: KernelConfig) -> str | None:
    # Q and K slices are consumed together in the k-step loop: loading Q in groups other than K's (when Q
    # is not resident) only reorders the same loads, so one grouping per K grouping is tried.
    if cfg.q_frags not in (0, cfg.k_frags):
        return "q_frags must be 0 (resident) or equal to k_frags"
    return None


def _rule_resident_q(cfg: KernelConfig) -> str | None:
    # Q resident in registers costs rows x head_dim / 64 registers for the whole kernel: worth it only when
    # that is small next to the accumulators (head_dim 64 with 16 rows per warp: 16 registers).
    if not cfg.wgmma and cfg.q_frags == 0 and cfg.rows_per_warp * cfg.head_dim // 64 > 32:
        return "resident Q would take more than 32 registers"
    return None


PRUNING_RULES: tuple[Callable[[KernelConfig], str | None], ...] = (
    _rule_rows_per_warp,
    _rule_fragment_order,
    _rule_resident_q,
    _rule_registers,
    _rule_occupancy,
)


def prune(cands: Iterable[KernelConfig]) -> tuple[list[KernelConfig], dict[str, int]]:
    """The candidates no rule rejects, and how many each rule rejected (first matching rule)."""
    kept: list[KernelConfig] = []
    rejected: dict[str, int] = {}
    for cfg in cands:
        for rule in PRUNING_RULES:
            why = rule(cfg)
            if why:
                rejected[why] = rejected.get(why, 0) + 1
                break
        else:
            kept.append(cfg)
    return kept, rejected


def search_space(dtype: str, head_dim: int, causal: bool, arch: str = "sm_80") -> list[KernelConfig]:
    """The surviving candidates, with the heuristic's choices (at every length bucket) always among them."""
    kept, _ = prune(candidate_space(dtype, head_dim, causal, arch))
    for n in SEQLEN_BUCKETS:
        heuristic = default_config(dtype, head_dim, causal, n, n, arch)
        if heuristic not in kept:
            kept.append(heuristic)
    return kept


# --------------------------------------------------------------------------------------------------
# The cache


def _environment_key(gpu: str | None = None) -> dict:
    from .jit import compiler as _compiler
    from .jit.kernels import sources_digest

    kind = _compiler.choose_compiler()
    env = {"compiler": _compiler.compiler_id(kind) if kind else "none", "sources": sources_digest()}
    if gpu is not None:
        env["gpu"] = gpu
    return env


def user_cache_path() -> Path:
    from .jit.kernels import cache_dir

    return cache_dir() / CACHE_FILE


def shipped_cache_path(gpu: str) -> Path:
    from .bench import gpu_slug

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
            want = _environment_key(gpu)
            table = dict(_load(shipped_cache_path(gpu), want))
            table.update(_load(user_cache_path(), want))  # the user's own tuning wins
            _tables[gpu] = table
    return table


def clear_memo() -> None:
    _tables.clear()
    _lookup.cache_clear()
    from .autotune_bwd import _lookup_bwd

    _lookup_bwd.cache_clear()


def lookup(
    gpu: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, group: int
) -> KernelConfig | None:
    """The tuned winner for this problem on this GPU, or None."""
    return _lookup(
        gpu, dtype, padded_head_dim(head_dim), causal, seqlen_bucket(max(seqlen_q, seqlen_k)), group > 1
    )


@cache
def _lookup(gpu: str, dtype: str, d: int, causal: bool, bucket: int, gqa: bool) -> KernelConfig | None:
    from .configs import parse_config

    # fp16 and bf16 kernels differ only in the mma and convert instructions' type suffix, so a winner
    # tuned for one dtype stands in for the other when that one was not tuned.
    other = "fp16" if dtype == "bf16" else "bf16"
    keys = [entry_key(dt, d, causal, bucket, g) for dt in (dtype, other) for g in ((2, 1) if gqa else (1,))]
    found = table_entry(gpu, keys)
    try:
        return parse_config(found).replace(dtype=dtype) if found else None
    except ValueError:
        return None


def table_entry(gpu: str, keys: list[str]) -> str | None:
    """The config name of the first of ``keys`` this GPU's tables have a winner for (GQA classes fall back
    to the multi-head entry, one dtype to the other, by the order of ``keys``), or None."""
    table = _table(gpu)
    for key in keys:
        entry = table.get(key)
        if entry:
            return entry["config"]
    return None


def write_cache(path: Path, gpu: str, entries: dict[str, dict]) -> None:
    from .jit.kernels import _atomic_write

    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    env = _environment_key(gpu)
    merged = old.get("entries", {}) if all(old.get(k) == v for k, v in env.items()) else {}
    merged.update(entries)
    data = {"format": FORMAT_VERSION, **env, "entries": dict(sorted(merged.items()))}
    _atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())


# --------------------------------------------------------------------------------------------------
# Timing


@dataclass
class Result:
    cfg: KernelConfig
    ms: float | None
    error: str | None = None
    tflops: float | None = None


class Progress:
    """One status line: candidates done, elapsed, best so far."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.done = total, what, 0
        self.t0 = time.perf_counter()
        self.best: tuple[float, str] | None = None
        self.tty = sys.stderr.isatty()

    def step(self, tflops: float | None, name: str) -> None:
        self.done += 1
        if tflops is not None and (self.best is None or tflops > self.best[0]):
            self.best = (tflops, name)
        best = f"best {self.best[0]:.0f} TFLOP/s {self.best[1]}" if self.best else "best -"
        bar = "#" * int(20 * self.done / self.total)
        line = (
            f"{self.what} [{bar:<20}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.1f}s {best}"
        )
        if self.tty:
            print("\r" + line[:200], end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)
        elif self.done == self.total:
            print(line, file=sys.stderr, flush=True)


def check_candidate(cfg: KernelConfig, causal: bool, device) -> str | None:
    """None if ``cfg`` computes attention correctly on a small odd-shaped problem; else what went wrong."""
    import torch

    from . import interface
    from .reference import attention_reference

    gen = torch.Generator(device=device).manual_seed(1234)
    dt = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    d = cfg.head_dim
    q = torch.randn(1, 333, 4, d, generator=gen, device=device).to(dt)
    k = torch.randn(1, 301, 2, d, generator=gen, device=device).to(dt)
    v = torch.randn(1, 301, 2, d, generator=gen, device=device).to(dt)
    out = torch.full_like(q, float("nan"))
    o = interface.forward(cfg, q, k, v, causal=causal, out=out)
    ref, _ = attention_reference(q, k, v, causal=causal)
    err = (o.double() - ref).abs().nan_to_num(float("inf")).max().item()
    # Far above bf16 rounding of a correct kernel (~1e-2 worst case here), far below any indexing error.
    return None if err < 0.05 else f"wrong result: max error {err:.3g} against the float64 reference"


def tune_shape(
    cands: list[KernelConfig],
    dtype: str,
    head_dim: int,
    causal: bool,
    seqlen: int,
    group: int,
    *,
    tokens: int = 16384,
    width: int = 2048,
    budget_s: float = 0.05,
    finalists: int = 4,
) -> list[Result]:
    """Time every candidate on the benchmark shape of ``seqlen``; the best few again, longer.

    Successive halving in two rounds: a short timing of everyone, then ``finalists`` re-timed with 4x the
    budget, so the winner is not a lucky sample and the sweep stays affordable.
    """
    import torch

    from . import interface
    from .bench import flops, time_cuda

    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    batch, heads = max(1, tokens // seqlen), max(1, width // head_dim)
    heads_kv = max(1, heads // group)
    heads = heads_kv * group
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dt)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    fl = flops(batch, heads, seqlen, seqlen, head_dim, causal, "fwd")

    def measure(cfg: KernelConfig, budget: float) -> float:
        t = time_cuda(
            lambda i: interface.forward(cfg, q, k, v, causal=causal),
            1,
            warmup=2,
            min_reps=5,
            min_time_s=budget,
        )
        return t.ms

    return time_candidates(cands, measure, budget_s, finalists, fl)


def time_candidates(
    cands: list, measure: Callable[[Any, float], float], budget_s: float, finalists: int, flop: float
) -> list[Result]:
    """Successive halving in two rounds, for either kernel family: ``measure(cfg, budget)`` (ms) for
    everyone, then the ``finalists`` fastest again with 4x the budget. A candidate that raises is reported
    and ranked last; the rest fastest first."""
    results = []
    for cfg in cands:
        try:
            results.append(Result(cfg, measure(cfg, budget_s)))
        except Exception as exc:  # noqa: BLE001 - a failing candidate is reported and skipped
            results.append(Result(cfg, None, str(exc).splitlines()[0]))
    timed = sorted((r for r in results if r.ms is not None), key=lambda r: r.ms)
    for r in timed[:finalists]:
        r.ms = min(r.ms, measure(r.cfg, 4 * budget_s))
    for r in results:
        r.tflops = flop / (r.ms * 1e9) if r.ms else None
    return sorted(results, key=lambda r: (r.ms is None, r.ms or 0))


def screen_candidates(
    cands: list, build_problem: Callable[[Any], str | None], check: Callable[[Any], str | None], jobs: int
) -> tuple[list, dict[str, str]]:
    """Compile in parallel (``build_problem`` builds one config and says why it cannot win, or None), then
    run the correctness ``check`` of every survivor in turn. Returns the survivors and, by name, why each
    other candidate was skipped."""
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(cfg):
        try:
            return cfg, build_problem(cfg)
        except Exception as exc:  # noqa: BLE001 - reported and skipped
            return cfg, f"compile failed: {str(exc).splitlines()[0]}"

    with ThreadPoolExecutor(jobs) as ex:
        compiled = list(ex.map(compile_one, cands))
    ok, skipped = [], {}
    for cfg, why in compiled:
        if why is None:
            try:
                why = check(cfg)
            except Exception as exc:  # noqa: BLE001
                why = f"failed to run: {str(exc).splitlines()[0]}"
        if why:
            skipped[cfg.name()] = why
        else:
            ok.append(cfg)
    return ok, skipped


def prepare_candidates(cands: list[KernelConfig], causal: bool, jobs: int = 16) -> tuple[list, dict]:
    """Compile all candidates in parallel; drop those that fail, spill, or compute a wrong result."""
    import torch

    from .jit.kernels import build, device_arch

    arch = device_arch(torch.cuda.current_device())

    def build_problem(cfg: KernelConfig) -> str | None:
        built = build(cfg, arch)
        spills = sum(r["spill_stores"] + r["spill_loads"] for r in built.meta["resources"])
        regs = max(r["registers"] for r in built.meta["resources"])
        # A spilling kernel moves registers through local memory inside its main loop: never a winner.
        if spills:
            return f"spills {spills} bytes"
        if occupancy_problem(cfg, regs):
            return f"{regs} registers: {occupancy_problem(cfg, regs)}"
        return None

    return screen_candidates(
        cands, build_problem, lambda cfg: check_candidate(cfg, causal, torch.device("cuda")), jobs
    )


# --------------------------------------------------------------------------------------------------
# The command


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention autotune",
        description="Time every surviving kernel configuration per shape class and cache the winners.",
    )
    ap.add_argument("--dtype", default="bf16", help="bf16, fp16 or both (comma-separated)")
    ap.add_argument("--head-dim", default="64,128,256", help="comma-separated head dims")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLEN_BUCKETS)))
    ap.add_argument("--groups", default="1", help="GQA group sizes to tune (1 = multi-head)")
    ap.add_argument("--budget", type=float, default=0.05, help="seconds of timing per candidate and shape")
    ap.add_argument("--out", default=None, help=f"cache file (default: <cache dir>/{CACHE_FILE})")
    ap.add_argument("--report", default=None, help="also write every timing to this JSON file")
    ap.add_argument("--space", action="store_true", help="print the search space and pruning, time nothing")
    ap.add_argument(
        "--backward",
        action="store_true",
        help="tune the backward kernels (BwdConfig) instead of the forward (flash_attention.autotune_bwd)",
    )
    ap.add_argument(
        "--arch", default="sm_90", help="the architecture whose space --space prints (default sm_90)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dtypes = ["bf16", "fp16"] if args.dtype == "both" else args.dtype.split(",")
    head_dims = [int(x) for x in args.head_dim.split(",")]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]

    if args.space and args.backward:
        from .autotune_bwd import bwd_candidate_space

        for dtype, d in itertools.product(dtypes, head_dims):
            cands = bwd_candidate_space(dtype, d, args.arch)
            print(f"backward {dtype} d={d}: {len(cands)} candidates")
            for c in cands:
                print(f"    {c.name()}")
        return 0
    if args.space:
        for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
            all_c = candidate_space(dtype, d, causal, args.arch)
            kept, rejected = prune(all_c)
            print(
                f"{dtype} d={d} {'causal' if causal else 'full'}: {len(all_c)} candidates, {len(kept)} kept"
            )
            for why, n in sorted(rejected.items(), key=lambda x: -x[1]):
                print(f"    pruned {n:4d}: {why}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            "autotune times kernels on a CUDA GPU; none was found (try --space to see the search space)",
            file=sys.stderr,
        )
        return 2
    from .jit.kernels import device_arch

    gpu = torch.cuda.get_device_name()
    arch = device_arch(torch.cuda.current_device())
    out_path = Path(args.out) if args.out else user_cache_path()
    report: list[dict] = []
    entries: dict[str, dict] = {}
    t0 = time.perf_counter()
    if args.backward:
        from . import autotune_bwd

        entries, report = autotune_bwd.run(args, out_path, gpu, arch)
    for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
        if args.backward:
            break
        cands = search_space(dtype, d, causal, arch)
        ok, skipped = prepare_candidates(cands, causal)
        print(
            f"{dtype} d={d} {'causal' if causal else 'full'}: {len(ok)} of {len(cands)} candidates ready "
            f"({time.perf_counter() - t0:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        for name, why in skipped.items():
            print(f"    skipped {name}: {why}", file=sys.stderr)
        for seqlen, group in itertools.product(seqlens, groups):
            heuristic = default_config(dtype, d, causal, seqlen, seqlen, arch)
            prog = Progress(len(ok), f"  n={seqlen:5d} g={group}")
            results = tune_shape(ok, dtype, d, causal, seqlen, group, budget_s=args.budget)
            for r in results:
                prog.step(r.tflops, r.cfg.name())
            best = results[0]
            if best.ms is None:
                print(
                    f"    every candidate failed at n={seqlen}; first error: {results[0].error}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            heur = next((r for r in results if r.cfg == heuristic), None)
            key = entry_key(dtype, d, causal, seqlen, group)
            entries[key] = {
                "config": best.cfg.name(),
                "ms": round(best.ms, 5),
                "tflops": round(best.tflops, 1),
                "heuristic": heuristic.name(),
                "heuristic_tflops": round(heur.tflops, 1) if heur and heur.ms else None,
                "candidates": len(ok),
            }
            ratio = heur.tflops / best.tflops if heur and heur.ms else float("nan")
            print(
                f"    {key}: {best.tflops:6.1f} TFLOP/s {best.cfg.name()}  (heuristic {ratio:.3f}x)",
                file=sys.stderr,
                flush=True,
            )
            report += [
                {"key": key, "config": r.cfg.name(), "ms": r.ms, "tflops": r.tflops, "error": r.error}
                for r in results
            ]
        write_cache(out_path, gpu, entries)  # after every class, so an interrupted run keeps its work
    if args.report:
        Path(args.report).write_text(json.dumps({"gpu": gpu, **_environment_key(), "rows": report}, indent=1))
    clear_memo()
    print(f"wrote {len(entries)} winners to {out_path} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
