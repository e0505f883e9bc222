"""The tuning loop every kernel family shares: compile the candidates in parallel and check each against the
reference, time every survivor on the benchmark shape of each length, re-time the best few, and write each
shape class's winner to the tuned-winners cache (:mod:`flash_attention.ops.winners`) as soon as it is
known."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flash_attention.ops.winners import write_cache

__all__ = ["Family", "Progress", "Result", "run", "screen_candidates", "time_candidates"]


@dataclass
class Result:
    cfg: Any  # KernelConfig or BwdConfig
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


@dataclass(frozen=True)
class Family:
    """What the loop needs to know about one kernel family."""

    name: str
    #: (dtype, head_dim, causal, arch) -> the candidates worth compiling
    candidates: Callable[[str, int, bool, str], list]
    #: (candidates, causal) -> (those that compiled and computed right, {name: why skipped})
    prepare: Callable[[list, bool], tuple[list, dict[str, str]]]
    #: (candidates, dtype, head_dim, causal, seqlen, group, budget seconds) -> results, fastest first
    tune: Callable[[list, str, int, bool, int, int, float], list[Result]]
    #: (dtype, head_dim, causal, seqlen, arch) -> what runs without tuning
    default: Callable[[str, int, bool, int, str], Any]
    #: (dtype, head_dim, causal, seqlen, group) -> the winners-cache key
    key: Callable[[str, int, bool, int, int], str]


def run(
    family: Family,
    *,
    dtypes: list[str],
    head_dims: list[int],
    causals: list[bool],
    seqlens: list[int],
    groups: list[int],
    budget: float,
    out_path: Path,
    gpu: str,
    arch: str,
) -> tuple[dict[str, dict], list[dict]]:
    """Tune ``family`` on every class; returns the winners (also written to ``out_path`` after every class,
    so an interrupted run keeps its work) and every timing."""
    entries: dict[str, dict] = {}
    report: list[dict] = []
    t0 = time.perf_counter()
    for dtype, d, causal in itertools.product(dtypes, head_dims, causals):
        mask = "causal" if causal else "full"
        cands = family.candidates(dtype, d, causal, arch)
        ok, skipped = family.prepare(cands, causal)
        print(
            f"{family.name} {dtype} d={d} {mask}: {len(ok)} of {len(cands)} candidates ready "
            f"({time.perf_counter() - t0:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        for name, why in skipped.items():
            print(f"    skipped {name}: {why}", file=sys.stderr)
        if not ok:
            continue
        for seqlen, group in itertools.product(seqlens, groups):
            default = family.default(dtype, d, causal, seqlen, arch)
            prog = Progress(len(ok), f"  n={seqlen:5d} g={group}")
            results = family.tune(ok, dtype, d, causal, seqlen, group, budget)
            for r in results:
                prog.step(r.tflops, r.cfg.name())
            best = results[0]
            if best.ms is None:
                print(
                    f"    every candidate failed at n={seqlen}; first error: {best.error}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            dflt = next((r for r in results if r.cfg == default and r.ms), None)
            key = family.key(dtype, d, causal, seqlen, group)
            entries[key] = {
                "config": best.cfg.name(),
                "ms": round(best.ms, 5),
                "tflops": round(best.tflops, 1),
                "heuristic": default.name() if default is not None else None,
                "heuristic_tflops": round(dflt.tflops, 1) if dflt else None,
                "candidates": len(ok),
            }
            ratio = dflt.tflops / best.tflops if dflt else float("nan")
            print(
                f"    {key}: {best.tflops:6.1f} TFLOP/s {best.cfg.name()}  (heuristic {ratio:.3f}x)",
                file=sys.stderr,
                flush=True,
            )
            report += [
                {"key": key, "config": r.cfg.name(), "ms": r.ms, "tflops": r.tflops, "error": r.error}
                for r in results
            ]
        write_cache(out_path, gpu, entries)
    return entries, report
