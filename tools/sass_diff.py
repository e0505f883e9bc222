"""Did a source change move the machine code? Compile every kernel of two checkouts and compare the SASS.

    python tools/sass_diff.py dump  CHECKOUT OUT [--arch sm_80,sm_86,sm_90] [--compilers nvrtc] [--jobs 2]
                                    [--family all|sm80|wgmma|fwd_ws|bwd_ws] [--trace] [--variants]
                                    [--configs NAME ...]
    python tools/sass_diff.py diff  BASE_OUT NEW_OUT [--subset]

`dump` imports the package of CHECKOUT (not the installed one), compiles the translation units of
``ops.catalog(arch)`` -- every kernel a default call and its backward can run, key-range and dropout
variants included -- into OUT/cache (its own kernel cache, so two checkouts never share entries), and writes
each entry point's SASS (cuobjdump -sass) and ptxas resources to OUT/<compiler>/<arch>/<symbol>.{sass,json}.
``--trace`` adds the debug build of the first eight portable forward configs. ``--family fwd_ws`` keeps
the warp-specialized forward's configs only, ``--family bwd_ws`` the warp-specialized backwards' (bwd_ws and
bwd_wide_ws). ``--variants`` compiles every forward and backward config in
every build a call can ask of its family (``variant_builds``: key ranges, dropout, the sliding window, the
packed batch's segments, each score function, the debug build), not only the catalog's key-range and
dropout ones: what a refactor of one kernel family is checked against. ``--configs`` adds configs by name
(e.g. ones no default call picks, whose code paths the catalog would leave unchecked).

`diff` compares two dumps entry point by entry point: byte-identical, or different with the registers, spills,
instruction histogram and loop-body histogram (instructions between a backward branch and its target) side
by side, and "worse" when any of those grew. Refactors of csrc/include/fa are held to "identical, or
different and nowhere worse" (docs/kernel-log.md, step 24). Exit status 1 when an entry point is worse or
missing.

Needs cuobjdump (a CUDA toolkit); a full dump of three architectures with NVRTC takes about 15 minutes on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The score functions a call can ask of a build that is not a packed batch's (ops.plans.kernel_score
#: gives the others, the "_runs", "_table" and "_rows" forms of ALiBi, to segments builds only).
_DENSE_SCORES = ("softcap", "alibi", "softcap_alibi")


def variant_builds(cfg) -> list[dict]:
    """Every build of ``cfg`` a call can ask for, as cache.build's keywords (trace, ranged, dropout, window,
    score): the mask builds (plain, key ranges, the sliding window with and without them, segments) times the
    score functions (none, and those of jit.sources.SCORE_MODS the launch layer passes with that mask) times
    dropout, each where the config's family has the features (configs.families), and the debug build where
    the family has one. A decode config has none but its one build (its variants are runtime values)."""
    from flash_attention.configs import BwdConfig, KernelConfig
    from flash_attention.configs.families import supports
    from flash_attention.jit.sources import SCORE_MODS, SEGMENTS

    plain = dict(trace=False, ranged=False, dropout=False, window=False, score=None)
    if not isinstance(cfg, KernelConfig | BwdConfig):
        return [plain]

    def has(*features: str) -> bool:
        return all(supports(cfg, f) for f in features)

    def score_ok(score: str | None) -> bool:
        return score is None or has(*(f for f in ("softcap", "alibi") if f in score))

    masks = [(False, False)]
    masks += [(False, True)] if has("key_range") else []
    masks += [(True, False)] if has("window") else []
    masks += [(True, True)] if has("window", "key_range") else []
    masks += [(SEGMENTS, False)] if has("segments") else []  # (the runs carry any key ranges)
    builds = []
    for window, ranged in masks:
        scores = [None, *(SCORE_MODS if window == SEGMENTS else _DENSE_SCORES)]
        for score in filter(score_ok, scores):
            for dropout in (False, True) if has("dropout") else (False,):
                builds.append(dict(plain, ranged=ranged, dropout=dropout, window=window, score=score))
    if isinstance(cfg, KernelConfig) and has("trace"):
        builds.append(dict(plain, trace=True))
    return builds


def _jobs(
    archs: list[str], family: str, trace: bool, variants: bool = False, extra: tuple[str, ...] = ()
) -> list[tuple]:
    """(cfg, arch, build keywords) of each translation unit to compile; the keywords as a sorted tuple of
    pairs, so that jobs deduplicate."""
    from flash_attention.configs import BwdConfig, KernelConfig, parse_bwd_config, parse_config
    from flash_attention.configs.families import is_wgmma
    from flash_attention.ops.select import catalog

    def keep(cfg) -> bool:
        if family == "fwd_ws":
            return isinstance(cfg, KernelConfig) and cfg.warp_specialized
        if family == "bwd_ws":
            return isinstance(cfg, BwdConfig) and cfg.warp_specialized
        return family == "all" or (family == "wgmma") == is_wgmma(cfg)

    def job(cfg, arch, **kw) -> tuple:
        kw = dict(dict(trace=False, ranged=False, dropout=False, window=False, score=None), **kw)
        return (cfg, arch, tuple(sorted(kw.items())))

    jobs = []
    for arch in archs:
        cat = catalog(arch)
        named = [parse_bwd_config(n) if n.startswith("bwd_") else parse_config(n) for n in extra]
        for j in cat:
            if keep(j.cfg):
                jobs.append(job(j.cfg, arch, ranged=j.ranged, dropout=j.dropout))
        jobs += [job(cfg, arch) for cfg in named]
        if variants:
            for cfg in dict.fromkeys([j.cfg for j in cat if keep(j.cfg)] + named):
                jobs += [job(cfg, arch, **kw) for kw in variant_builds(cfg)]
        if trace and family not in ("wgmma", "fwd_ws", "bwd_ws"):
            portable = [j.cfg for j in cat if isinstance(j.cfg, KernelConfig) and not is_wgmma(j.cfg)]
            jobs += [job(cfg, arch, trace=True) for cfg in list(dict.fromkeys(portable))[:8]]
    return list(dict.fromkeys(jobs))


def dump(
    checkout: Path,
    out: Path,
    archs: list[str],
    compilers: list[str],
    jobs_n: int,
    family: str,
    trace: bool,
    variants: bool = False,
    extra: tuple[str, ...] = (),
) -> int:
    # The cache directory is read when the package compiles, so it is set before the import.
    os.environ["FLASH_ATTENTION_CACHE_DIR"] = str(out / "cache")
    os.environ["FLASH_ATTENTION_QUIET"] = "1"
    sys.path.insert(0, str(checkout))
    import flash_attention

    if not Path(flash_attention.__file__).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"imported {flash_attention.__file__}, not the checkout {checkout}")
    from flash_attention.jit import cache
    from flash_attention.tools.report import find_cuobjdump, sass_by_function

    if find_cuobjdump() is None:
        raise SystemExit("cuobjdump not found: install a CUDA toolkit or set CUDA_HOME")

    todo = [(comp, *job) for comp in compilers for job in _jobs(archs, family, trace, variants, extra)]
    print(f"{len(todo)} translation units", flush=True)

    def one(item):
        comp, cfg, arch, kw = item
        built = cache.build(cfg, arch, comp, **dict(kw))
        sass = sass_by_function(built.cubin)
        folder = out / comp / built.arch
        folder.mkdir(parents=True, exist_ok=True)
        for res in built.meta["resources"]:
            (folder / f"{res['kernel']}.sass").write_text(sass[res["kernel"]])
            (folder / f"{res['kernel']}.json").write_text(json.dumps(res))

    failed = 0
    with ThreadPoolExecutor(jobs_n) as ex:
        for item, fut in [(item, ex.submit(one, item)) for item in todo]:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - report every failure, then fail
                failed += 1
                print(
                    f"FAILED {item[0]} {item[2]} {item[1].name()} {dict(item[3])}: {str(exc)[:2000]}",
                    flush=True,
                )
    print(f"{len(todo) - failed}/{len(todo)} translation units", flush=True)
    return 1 if failed else 0


#: Opcodes whose growth marks an entry point "worse" (the ones that carry the inner loops' cost).
WATCHED = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "FFMA", "MUFU.EX2", "IMAD")


def histograms(sass: str) -> tuple[Counter, Counter]:
    """Opcode counts of the whole function and of its loop bodies."""
    from flash_attention.tools.report import branch_ranges, instructions

    ins = instructions(sass)
    in_loop = [False] * len(ins)
    for first, last in branch_ranges(ins):
        for j in range(first, last + 1):
            in_loop[j] = True
    looped = [op for (_, op, _), loop in zip(ins, in_loop, strict=True) if loop]
    return Counter(op for _, op, _ in ins), Counter(looped)


def diff(base: Path, new: Path, subset: bool) -> int:
    stats: Counter = Counter()
    rows, missing = [], []
    for base_json in sorted((new if subset else base).glob("*/*/*.json")):
        rel = base_json.relative_to(new if subset else base)
        comp, arch = rel.parts[0], rel.parts[1]
        other = base if subset else new  # (the side the listing did not come from)
        if not (other / rel).exists() or not (other / rel).with_suffix(".sass").exists():
            missing.append(str(rel))
            continue
        b_sass, n_sass = (
            (base / rel).with_suffix(".sass").read_text(),
            (new / rel).with_suffix(".sass").read_text(),
        )
        b_res, n_res = json.loads((base / rel).read_text()), json.loads((new / rel).read_text())
        if b_sass == n_sass and b_res == n_res:  # (the machine code, and ptxas's resource report of it)
            stats[(comp, arch, "identical")] += 1
            continue
        stats[(comp, arch, "different")] += 1
        (bt, bl), (nt, nl) = histograms(b_sass), histograms(n_sass)
        worse = [
            f"{k} {b_res[k]}->{n_res[k]}"
            for k in ("registers", "spill_stores", "spill_loads", "stack_frame")
            if n_res[k] > b_res[k]
        ]
        if sum(nt.values()) > sum(bt.values()):
            worse.append(f"instructions {sum(bt.values())}->{sum(nt.values())}")
        if sum(nl.values()) > sum(bl.values()):
            worse.append(f"loop instructions {sum(bl.values())}->{sum(nl.values())}")
        worse += [f"{k} {bt[k]}->{nt[k]}" for k in WATCHED if nt[k] > bt[k]]
        worse += [f"loop {k} {bl[k]}->{nl[k]}" for k in WATCHED if nl[k] > bl[k]]
        stats[(comp, arch, "worse")] += bool(worse)
        rows.append((comp, arch, rel.stem, b_res, n_res, bt, nt, bl, nl, worse))
    for comp, arch in sorted({k[:2] for k in stats}):
        print(
            f"{comp:6} {arch:7} identical {stats[(comp, arch, 'identical')]:4d}  different "
            f"{stats[(comp, arch, 'different')]:4d}  (worse on some count: {stats[(comp, arch, 'worse')]})"
        )
    for comp, arch, name, b_res, n_res, bt, nt, bl, nl, worse in rows:
        print(f"\n{'WORSE' if worse else 'DIFF '} {comp} {arch} {name}")
        print(
            f"   registers {b_res['registers']}->{n_res['registers']}, spills "
            f"{b_res['spill_stores']}/{b_res['spill_loads']}->"
            f"{n_res['spill_stores']}/{n_res['spill_loads']}, instructions "
            f"{sum(bt.values())}->{sum(nt.values())}, in loops {sum(bl.values())}->{sum(nl.values())}"
        )
        print(
            "   total: "
            + ", ".join(f"{k} {bt[k]}->{nt[k]}" for k in sorted(set(bt) | set(nt)) if bt[k] != nt[k])
        )
        print(
            "   loops: "
            + ", ".join(f"{k} {bl[k]}->{nl[k]}" for k in sorted(set(bl) | set(nl)) if bl[k] != nl[k])
        )
        if worse:
            print("   worse: " + "; ".join(worse))
    if missing:
        print(f"\nmissing in {new}: {len(missing)}: " + " ".join(missing[:20]))
    n_worse = sum(1 for row in rows if row[-1])
    n_same = sum(v for k, v in stats.items() if k[2] == "identical")
    print(
        f"\n{n_same} identical, {len(rows)} different ({n_worse} worse on some count), {len(missing)} missing"
    )
    return 1 if n_worse or missing else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="compile a checkout's kernels and write their SASS")
    d.add_argument("checkout", type=Path)
    d.add_argument("out", type=Path)
    d.add_argument("--arch", default="sm_80,sm_86,sm_90")
    d.add_argument("--compilers", default="nvrtc", help="nvrtc, nvcc or both (comma-separated)")
    d.add_argument("--jobs", type=int, default=2)
    d.add_argument("--family", choices=("all", "sm80", "wgmma", "fwd_ws", "bwd_ws"), default="all")
    d.add_argument("--trace", action="store_true", help="also the debug build of eight portable configs")
    d.add_argument("--variants", action="store_true", help="every build a call can ask of each config")
    d.add_argument("--configs", nargs="*", default=(), help="configs to add by name (forward, or bwd_...)")
    c = sub.add_parser("diff", help="compare two dumps")
    c.add_argument("base", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--subset", action="store_true", help="compare only the entry points NEW has")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        return dump(
            args.checkout,
            args.out,
            args.arch.split(","),
            args.compilers.split(","),
            args.jobs,
            args.family,
            args.trace,
            args.variants,
            tuple(args.configs),
        )
    # The opcode parser is the report command's: this checkout's package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    return diff(args.base, args.new, args.subset)


if __name__ == "__main__":
    sys.exit(main())
