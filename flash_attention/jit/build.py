"""``python -m flash_attention build``: compile kernels ahead of time and print their resource report.

What ``pip install --no-build-isolation .`` did for the project this one descends from, but optional: the
kernels land in the same on-disk cache the first call would fill, so a machine (or a container image) can be
warmed once and every later process loads them in milliseconds. Works without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..configs import DTYPES, HEAD_DIMS, KernelConfig, default_config, parse_config
from . import compiler as _compiler
from .kernels import build, cache_dir

#: Dynamic shared memory a block may opt into, per architecture (the per-block limit, in bytes).
SMEM_LIMITS = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_90a": 227 * 1024,
}


def shipped_configs(arch: str = "sm_80") -> list[KernelConfig]:
    """Every configuration the heuristic can pick on ``arch``: per dtype, instantiated head_dim, mask and
    length. On sm_90 that is the wgmma configs and also the portable ones, which Hopper still runs for the
    debug build and for a negative softmax scale."""
    archs = ["sm_80"] + ([arch] if arch in ("sm_90", "sm_90a") else [])
    out: list[KernelConfig] = []
    for a in archs:
        for dtype in DTYPES:
            for d in HEAD_DIMS:
                for causal in (False, True):
                    for n in (512, 1024, 2048, 4096, 8192, 16384):
                        cfg = default_config(dtype, d, causal, n, n, a)
                        if cfg not in out:
                            out.append(cfg)
    return out


def shipped_bwd_configs(arch: str = "sm_80") -> list:
    """The backward configs the defaults pick on ``arch`` (the portable ones always, as on sm_90 they run
    the deterministic, key-range, dropout and head_dim 192/256 backward)."""
    from ..configs import default_bwd_config

    out = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for cfg in (default_bwd_config(dtype, d), default_bwd_config(dtype, d, arch)):
                if cfg not in out:
                    out.append(cfg)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention build",
        description="Pre-compile kernels into the cache and print registers, shared memory and spills.",
    )
    ap.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets (default: sm_80,sm_90)")
    ap.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="kernel config names (default: every shipped default config)",
    )
    ap.add_argument("--compiler", choices=["nvrtc", "nvcc"], default=None, help="default: NVRTC if found")
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel (default 2)")
    ap.add_argument("--force", action="store_true", help="recompile even when cached")
    ap.add_argument(
        "--strict", action="store_true", help="exit 1 if any kernel spills or exceeds shared memory"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for a in archs:
        if not a.startswith("sm_"):
            print(f"--arch takes targets like sm_80,sm_90; got {a!r}", file=sys.stderr)
            return 2
    try:
        cfgs = [parse_config(c) for c in args.configs] if args.configs else []
    except ValueError as exc:
        print(f"--configs: {exc}", file=sys.stderr)
        return 2
    kind = args.compiler or _compiler.choose_compiler()
    if kind is None:
        print(
            "no CUDA compiler found: install PyTorch's CUDA build (it ships NVRTC) or a CUDA toolkit (nvcc)",
            file=sys.stderr,
        )
        return 1
    if args.configs:
        # A wgmma config compiles for sm_90 only (its instructions have no other target).
        jobs = [(c, a) for c in cfgs for a in archs if not c.wgmma or a in ("sm_90", "sm_90a")]
    else:
        jobs = [(c, a) for a in archs for c in shipped_configs(a)]
    print(f"building {len(jobs)} kernels with {_compiler.compiler_id(kind)} into {cache_dir()}", flush=True)
    t0 = time.perf_counter()
    done = 0
    problems: list[str] = []
    header = f"{'arch':6} {'regs':>4} {'smem':>7} {'spill st/ld':>11} {'stack':>5} {'time':>6}  kernel"
    rows: list[str] = []

    def one(job):
        cfg, arch = job
        return job, build(cfg, arch, kind, force=args.force)

    with ThreadPoolExecutor(max(1, args.jobs)) as ex:
        futures = [ex.submit(one, j) for j in jobs]
        for fut in futures:
            try:
                (cfg, arch), built = fut.result()
            except _compiler.CompileError as exc:
                problems.append(str(exc))
                print(str(exc), file=sys.stderr)
                continue
            done += 1
            when = "cached" if built.from_cache else f"{built.meta.get('compile_seconds', 0):.1f}s"
            limit = SMEM_LIMITS.get(arch)
            for r in built.meta["resources"]:
                smem = cfg.smem_bytes + r["static_smem"]
                line = (
                    f"{arch:6} {r['registers']:4d} {smem:7d} {r['spill_stores']:5d}/{r['spill_loads']:<5d} "
                    f"{r['stack_frame']:5d} {when:>6}  {r['kernel']}"
                )
                rows.append(line)
                print(f"[{done}/{len(jobs)} {time.perf_counter() - t0:5.1f}s] {line}", flush=True)
                if r["spill_stores"] or r["spill_loads"]:
                    problems.append(f"{r['kernel']} ({arch}) spills {r['spill_stores']} bytes")
                if limit is not None and smem > limit:
                    problems.append(
                        f"{r['kernel']} needs {smem} bytes of shared memory; {arch} allows {limit}"
                    )
    print()
    print(header)
    print("\n".join(rows))
    print(f"\n{done}/{len(jobs)} built in {time.perf_counter() - t0:.1f} s")
    for p in problems:
        print(f"PROBLEM: {p.splitlines()[0]}")
    return 1 if problems and (args.strict or done < len(jobs)) else 0


if __name__ == "__main__":
    sys.exit(main())
