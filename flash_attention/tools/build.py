"""``python -m flash_attention build``: compile every kernel a model can need ahead of time, and print the
compiler's resource report for each.

What ``pip install --no-build-isolation .`` did for the project this one descends from, but optional: the
kernels land in the same on-disk cache the first call would fill, so a machine (or a container image) can be
warmed once and every later process loads them in milliseconds. The list is
:func:`flash_attention.ops.catalog`: for each dtype, compiled head_dim, mask and length, the forward and
backward kernels of plain, key-padded and dropout calls (and both), as a default ``attention()`` call and its
backward choose them on that architecture; then the host library of the compiled training node
(:mod:`flash_attention.jit.host`, built with the C++ compiler if there is one). Works without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from flash_attention.configs import (
    DTYPES,
    HEAD_DIMS,
    BwdConfig,
    is_hopper,
    is_wgmma,
    parse_bwd_config,
    parse_config,
    smem_optin,
)
from flash_attention.configs.decode import parse_decode_config
from flash_attention.jit import compiler as _compiler
from flash_attention.jit import host
from flash_attention.jit.cache import build, cache_dir
from flash_attention.ops.select import BuildJob, catalog

from .report import launch_shape

__all__ = ["MAX_BWD_SPILL_BYTES", "MAX_DET_WS_BWD_SPILL_BYTES", "jobs_for", "main", "spill_bound"]

#: Spill bytes (stores or loads) the backward kernels may have. Their tiles sit at the 255-register limit and
#: ptxas spills outside the inner products (docs/kernel-log.md, step 14): up to 28/40 bytes (stores/loads) in
#: the sm_80 builds, and up to 52/60 in the portable backward compiled for sm_90, which Hopper runs for
#: key ranges, dropout, deterministic mode and head_dim 192/256 (NVRTC 13.0). The bound catches a kernel
#: that gets worse than that; the forward kernels must not spill at all.
MAX_BWD_SPILL_BYTES = 64
#: The deterministic warp-specialized dK/dV kernels (``dkdv_det`` of a ``_ws`` config): their dQ writers'
#: warpgroup leaves the consumers 232 registers instead of 240 (configs.backward.DET_WS_REGISTER_SPLIT):
#: up to 60 bytes, except with dropout at head_dim 64, up to 200 (NVRTC 13.0: the LSE and delta of all
#: sixteen query columns loaded at once next to the keep bits, inside the loop). Measured on an H100 with
#: those spills: docs/kernel-log.md, step 76. The wide kernel's deterministic form (head_dim 192/256,
#: its computing warpgroups at 240 registers after setmaxnreg, configs.backward.DET_WIDE_REGISTER_SPLIT)
#: spills up to 64/76 bytes at head_dim 256 (NVRTC 13.0) and has the same bound.
MAX_DET_WS_BWD_SPILL_BYTES = 224


def spill_bound(cfg, kernel: str) -> int:
    """The spill bytes kernel ``kernel`` of ``cfg``'s translation unit may have."""
    if not isinstance(cfg, BwdConfig):
        return 0
    if (cfg.warp_specialized or cfg.wide) and "dkdv_det" in kernel:
        return MAX_DET_WS_BWD_SPILL_BYTES
    return MAX_BWD_SPILL_BYTES


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
        help="forward or backward (bwd_...) config names (default: every kernel a model can need)",
    )
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="with the default list: dtypes (fp16,bf16)")
    ap.add_argument(
        "--head-dims", default=",".join(map(str, HEAD_DIMS)), help="with the default list: compiled head dims"
    )
    ap.add_argument("--list", action="store_true", help="print what would be compiled, compile nothing")
    ap.add_argument("--compiler", choices=["nvrtc", "nvcc"], default=None, help="default: NVRTC if found")
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel (default 2)")
    ap.add_argument("--force", action="store_true", help="recompile even when cached")
    ap.add_argument(
        "--strict",
        action="store_true",
        help=f"exit 1 if a forward kernel spills, a backward one spills more than {MAX_BWD_SPILL_BYTES} "
        f"bytes ({MAX_DET_WS_BWD_SPILL_BYTES} for the deterministic warp-specialized ones), a kernel "
        "exceeds its architecture's shared memory, or ptxas serialized a kernel's wgmma",
    )
    return ap.parse_args(argv)


def _parse(name: str):
    """A forward, backward or decode config from its name."""
    name = name.strip()
    if name.startswith("bwd_"):
        return parse_bwd_config(name)
    if name.startswith("decode_"):
        return parse_decode_config(name)
    return parse_config(name)


def jobs_for(archs: list[str], names: list[str] | None, dtypes=DTYPES, head_dims=HEAD_DIMS) -> list[BuildJob]:
    """The translation units to compile: the named configs (normal build) for each arch they run on, or
    the catalog of each arch."""
    if names:
        cfgs = [_parse(n) for n in names]
        # A wgmma config compiles only for an architecture that runs that family (configs/architectures.py:
        # sm_90; its instructions have no other target). A name given twice
        # is built once: two threads compiling the same kernel into the same cache entry left it without its
        # register report (an H100 run, where `sanity` then failed on the cached entry).
        jobs = [BuildJob(c, a) for c in cfgs for a in archs if not is_wgmma(c) or is_hopper(a)]
        return list(dict.fromkeys(jobs))
    jobs: list[BuildJob] = []
    for a in archs:
        jobs += catalog(a, dtypes, head_dims)
    return list(dict.fromkeys(jobs))


def _problems(job: BuildJob, resources: list[dict]) -> list[str]:
    out = []
    limit = smem_optin(job.arch)
    for r in resources:
        bound = spill_bound(job.cfg, r["kernel"])
        spill = max(r["spill_stores"], r["spill_loads"])
        if spill > bound:
            out.append(f"{r['kernel']} ({job.arch}) spills {spill} bytes (allowed: {bound})")
        if r.get("wgmma_serialized"):  # (absent from cache entries written before the check)
            out.append(f"{r['kernel']} ({job.arch}): ptxas serialized its wgmma ({r['wgmma_serialized']})")
    smem = max(job.cfg.smem_bytes, getattr(job.cfg, "dq_smem_bytes", 0))
    if smem > limit:
        out.append(f"{job.cfg.name()} needs {smem} bytes of shared memory; {job.arch} allows {limit}")
    return out


def _build_host_library() -> None:
    """The compiled training node (flash_attention.jit.host), which needs a C++ compiler, not a CUDA one;
    optional: without it training runs the same kernels through a Python autograd function."""
    t0 = time.perf_counter()
    reason = host.unavailable_reason()
    if reason is None:
        print(f"host library (training node) ready in {time.perf_counter() - t0:.1f} s")
    else:
        print(f"host library (training node) unavailable, training uses the Python path: {reason}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for a in archs:
        if not a.startswith("sm_"):
            print(f"--arch takes targets like sm_80,sm_90; got {a!r}", file=sys.stderr)
            return 2
    try:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        head_dims = [int(d) for d in args.head_dims.split(",") if d.strip()]
        jobs = jobs_for(archs, args.configs, dtypes, head_dims)
    except ValueError as exc:
        print(f"build: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for job in jobs:
            print(job.describe())
        print(f"{len(jobs)} kernels, and the host library (training node, repeat call) of csrc/host/")
        return 0
    kind = args.compiler or _compiler.choose_compiler()
    if kind is None:
        print(
            "no CUDA compiler found: install PyTorch's CUDA build (it ships NVRTC) or a CUDA toolkit (nvcc)",
            file=sys.stderr,
        )
        return 1
    print(f"building {len(jobs)} kernels with {_compiler.compiler_id(kind)} into {cache_dir()}", flush=True)
    t0 = time.perf_counter()
    done = 0
    problems: list[str] = []
    header = f"{'arch':6} {'regs':>4} {'smem':>7} {'spill st/ld':>11} {'stack':>5} {'time':>6}  kernel"
    rows: list[str] = []

    def one(job: BuildJob):
        return job, build(job.cfg, job.arch, kind, force=args.force, ranged=job.ranged, dropout=job.dropout)

    with ThreadPoolExecutor(max(1, args.jobs)) as ex:
        futures = [ex.submit(one, j) for j in jobs]
        for fut in futures:
            try:
                job, built = fut.result()
            except _compiler.CompileError as exc:
                problems.append(str(exc))
                print(str(exc), file=sys.stderr)
                continue
            done += 1
            when = "cached" if built.from_cache else f"{built.meta.get('compile_seconds', 0):.1f}s"
            for r in built.meta["resources"]:
                smem = launch_shape(job.cfg, r["kernel"])[1] + r["static_smem"]
                line = (
                    f"{built.arch:6} {r['registers']:4d} {smem:7d} "
                    f"{r['spill_stores']:5d}/{r['spill_loads']:<5d} "
                    f"{r['stack_frame']:5d} {when:>6}  {r['kernel']}"
                )
                rows.append(line)
            print(
                f"[{done}/{len(jobs)} {time.perf_counter() - t0:5.1f}s] {job.describe()} ({when})", flush=True
            )
            problems += _problems(job, built.meta["resources"])
    print()
    print(header)
    print("\n".join(rows))
    print(f"\n{done}/{len(jobs)} built in {time.perf_counter() - t0:.1f} s")
    _build_host_library()
    for p in problems:
        print(f"PROBLEM: {p.splitlines()[0]}")
    return 1 if problems and (args.strict or done < len(jobs)) else 0


if __name__ == "__main__":
    sys.exit(main())
