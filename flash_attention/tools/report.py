"""``python -m flash_attention report``: what the compiler made of each kernel.

Per kernel: registers, shared memory, spill bytes, stack frame and the theoretical occupancy they allow; with
``--sass`` the instruction histogram of the machine code (HMMA, LDSM, LDGSTS, FFMA, MUFU.EX2, IMAD, ...),
read with cuobjdump; with ``--compare A B`` the same for two configurations side by side. This is how the
project this one descends from found its integer-overhead wins. Needs no GPU: it compiles for ``--arch``.

An attention variant's build (``--score`` a score function's build name, ``--window``, ``--segments``, as
the launch layer compiles them for a call with those arguments) is reported in place of the plain one;
``--against-plain`` puts the plain build's histogram beside it, the question every variant's cost starts
with (kernel log 100).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

from flash_attention import ops
from flash_attention.configs import BwdConfig, KernelConfig, parse_bwd_config, parse_config
from flash_attention.configs.architectures import architecture
from flash_attention.configs.backward import bwd_register_roles
from flash_attention.configs.decode import DecodeConfig, decode_register_roles, parse_decode_config
from flash_attention.configs.forward import register_roles
from flash_attention.jit.cache import build
from flash_attention.jit.sources import DECODE_AUX_THREADS, SCORE_MODS, SEGMENTS, kernel_symbol, mask_causals

#: A config of any kernel family: forward, backward or decode.
AnyConfig = KernelConfig | BwdConfig | DecodeConfig


@dataclass
class Occupancy:
    blocks: int
    warps: int
    max_warps: int
    limiter: str

    @property
    def fraction(self) -> float:
        return self.warps / self.max_warps


def occupancy(arch: str, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    """Theoretical resident blocks per SM and what limits them (CUDA occupancy rules)."""
    lim = architecture(arch)  # (its multiprocessor's limits: configs/architectures.py)
    warps = -(-threads // 32)
    # Registers are allocated per warp in units of 256 (8 per thread).
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by = {
        "registers": lim.regs_per_sm // (regs_per_warp * warps),
        "shared memory": lim.smem_per_sm // (smem_bytes + lim.reserved_smem),
        "threads": lim.threads_per_sm // (warps * 32),
        "blocks": lim.blocks_per_sm,
    }
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    return Occupancy(blocks, blocks * warps, lim.threads_per_sm // 32, limiter)


# --------------------------------------------------------------------------------------------------
# SASS


def find_cuobjdump() -> tuple[str, dict] | None:
    """cuobjdump and the environment it needs (it calls nvdisasm), from PATH, a toolkit or a pip wheel."""
    cands = [shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "cuobjdump"))
    for entry in sys.path:
        cands += glob.glob(os.path.join(entry, "nvidia", "cu*", "bin", "cuobjdump"))
        cands += glob.glob(os.path.join(entry, "nvidia", "cuda_cuobjdump", "bin", "cuobjdump"))
    for c in cands:
        if c and os.path.isfile(c):
            env = dict(os.environ)
            here = os.path.dirname(c)
            if not shutil.which("nvdisasm") and os.path.isfile(os.path.join(here, "nvdisasm")):
                env["PATH"] = here + os.pathsep + env.get("PATH", "")
            return c, env
    return None


# One SASS instruction line: address, optional predicate, opcode, its modifiers, the operands.
_INSTR = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)([^;]*)"
)


def sass_by_function(cubin: bytes) -> dict[str, str]:
    """The SASS text (cuobjdump -sass) of each kernel in ``cubin``, by symbol."""
    found = find_cuobjdump()
    if found is None:
        raise RuntimeError(
            "cuobjdump was not found: install a CUDA toolkit, or `pip install nvidia-cuda-cuobjdump "
            "nvidia-cuda-nvdisasm`"
        )
    tool, env = found
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {proc.stderr.strip()}")
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in proc.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m[1], [])
        elif current is not None and line.strip():
            current.append(line.rstrip())
    return {name: "\n".join(lines) + "\n" for name, lines in out.items()}


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction of one kernel's SASS; MUFU keeps its function
    (MUFU.EX2), other opcodes drop their modifiers."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.search(line)
        if m:
            op = m[2] + ("." + m[3].split(".")[1] if m[2] == "MUFU" and m[3] else "")
            out.append((int(m[1], 16), op, m[4]))
    return out


def _branch_target(instr: tuple[int, str, str]) -> int | None:
    """The address a BRA instruction jumps to; None for any other instruction."""
    _, op, rest = instr
    target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
    return int(target[1], 16) if target else None


def branch_ranges(ins: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(target, branch) positions in ``ins`` (:func:`instructions`) of every backward branch: the loops, and
    the jumps back into one from code after it (a retry that ptxas put out of line)."""
    at = {addr: i for i, (addr, _, _) in enumerate(ins)}
    ranges = []
    for i, instr in enumerate(ins):
        target = _branch_target(instr)
        if target is not None and target <= instr[0] and target in at:
            ranges.append((at[target], i))
    return ranges


def step_loop(ins: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """(first, last) positions in ``ins`` (:func:`instructions`) of the kernel's step loop: the longest loop
    (a backward branch and its target) that runs matrix instructions (HGMMA, HMMA) and holds no other such
    loop whole (a persistent tile loop holds its step loop; a wait's retry inside a step is no matrix loop).
    None without one.

    A wait's retry that ptxas puts out of line, after the loop, is entered by a forward branch from the loop's
    middle and jumps back to the instruction after that branch: its range crosses the loop's end (loops nest,
    they never cross). Such a range is recognised by that entry (the instruction before its target branches
    forward past the crossed loop's end, to the retry's block) whatever its length, so a retry near the loop's
    end, whose range is the shorter of the two, does not hide the loop. Two crossing ranges without that
    entry fall back to the rule that the longer is not a loop."""
    ranges = branch_ranges(ins)

    def jumps_back_in(x: int, y: int) -> bool:
        entry = _branch_target(ins[x - 1]) if x > 0 else None  # (a forward branch: past the crossed loop)
        return entry is not None and any(c < x <= d < y and ins[d][0] < entry <= ins[y][0] for c, d in ranges)

    ranges = [(a, b) for a, b in ranges if not jumps_back_in(a, b)]

    def crosses_shorter(a: int, b: int) -> bool:
        return any((c < a <= d < b or a < c <= b < d) and d - c < b - a for c, d in ranges)

    loops = [(a, b) for a, b in ranges if not crosses_shorter(a, b)]
    matrix = [(a, b) for a, b in loops if any(ins[k][1] in ("HGMMA", "HMMA") for k in range(a, b + 1))]

    def innermost(a: int, b: int) -> bool:
        return not any(a <= c and d <= b and (c, d) != (a, b) for c, d in matrix)

    return max((ab for ab in matrix if innermost(*ab)), key=lambda ab: ab[1] - ab[0], default=None)


def registers_of(ins: list[tuple[int, str, str]]) -> set[int]:
    """The general registers (R0, R1, ...) the instructions use; RZ is none of them. A matrix instruction
    names only the first register of each fragment, so its ranges are counted whole: a wgmma's m64nN
    accumulator N / 2 registers in fp32 (N / 4 in fp16) and its A fragment 4; an mma.sync's accumulators 4
    (fp32, the kernels' only accumulation), A 4, B 2."""
    used: set[int] = set()
    for _, op, rest in ins:
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", rest)]
        if op == "HGMMA" and regs:
            # (instructions() leaves the shape's "x<N>x<K>.<accumulator type>" at the head of the operands)
            shape = re.match(r"x(\d+)x\d+\.(F32|F16)", rest)
            acc = int(shape[1]) // (2 if shape[2] == "F32" else 4) if shape else 1
            spans = [acc if r == regs[0] else 4 for r in regs]
        elif op == "HMMA" and len(regs) == 4:
            spans = [4, 4, 2, 4]
        else:
            spans = [1] * len(regs)
        for r, n in zip(regs, spans, strict=True):
            used.update(range(r, r + n))
    return used


def loop_lines(sass: str) -> list[str]:
    """What a kernel's step loop holds: its length, the registers it names, and the kernel's registers it
    never names. Those are held through the loop by values the code after it needs (or belong to another
    warp role of a warp-specialized kernel): values ptxas hoisted out of an enclosing loop land there and
    take registers from the step loop (kernel log 181)."""
    ins = instructions(sass)
    found = step_loop(ins)
    if found is None:
        return ["no loop with matrix instructions"]
    a, b = found
    body = ins[a : b + 1]
    inside, everywhere = registers_of(body), registers_of(ins)
    outside = sorted(everywhere - inside)
    return [
        f"step loop: {len(body)} instructions ({ins[a][0]:#06x}-{ins[b][0]:#06x}), "
        f"names {len(inside)} of the kernel's {len(everywhere)} registers",
        f"not named in it ({len(outside)}): " + (" ".join(f"R{r}" for r in outside) or "none"),
    ]


def sass_histograms(cubin: bytes) -> dict[str, Counter]:
    """Instruction counts per kernel (opcode; MUFU keeps its function, e.g. MUFU.EX2)."""
    return {
        name: Counter(op for _, op, _ in instructions(text)) for name, text in sass_by_function(cubin).items()
    }


# Shown first, in this order: the instructions the kernel's design is about.
KEY_OPS = (
    "HGMMA",
    "HMMA",
    "LDSM",
    "LDGSTS",
    "LDG",
    "STG",
    "STS",
    "LDS",
    "FFMA",
    "FMUL",
    "FADD",
    "FMNMX",
    "MUFU.EX2",
    "F2FP",
    "SHFL",
    "IMAD",
    "IADD3",
    "LOP3",
    "SHF",
    "LEA",
    "ISETP",
    "FSEL",
    "SEL",
    "BAR",
    "BRA",
    "STL",
    "LDL",
)


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """The build a report is of: ``window`` False, True (the sliding window's) or SEGMENTS (a packed batch's),
    ``score`` a score function of jit.sources.SCORE_MODS or None."""

    window: bool | str = False
    score: str | None = None

    def __str__(self) -> str:
        mask = {False: "", True: "window", SEGMENTS: SEGMENTS}[self.window]
        return "+".join(x for x in (mask, self.score or "") if x) or "plain"


PLAIN = Variant()


def _build(cfg: AnyConfig, arch: str, compiler: str | None, variant: Variant = PLAIN):
    if variant == PLAIN:
        return build(cfg, arch, compiler)
    if isinstance(cfg, DecodeConfig):
        raise RuntimeError(f"{cfg.name()}: the decode family's variants are runtime values, not builds")
    return build(cfg, arch, compiler, window=variant.window, score=variant.score)


def main_symbol(cfg, causal: bool, variant: Variant = PLAIN) -> str:
    """The entry point a histogram is of: a forward config's kernel, a backward config's dK/dV kernel (its
    main one). A mask build has one entry point, named as not causal (the window or the runs carry causal)."""
    causal = causal and True in mask_causals(variant.window)
    if isinstance(cfg, BwdConfig):
        return cfg.symbol("dkdv", causal, window=variant.window, score=variant.score)
    if isinstance(cfg, DecodeConfig):
        return cfg.symbol("decode", causal)
    return kernel_symbol(cfg, causal, window=variant.window, score=variant.score)


def launch_shape(cfg, kernel: str) -> tuple[int, int]:
    """Threads and dynamic shared memory of one entry point (the backward family has three kernels, the
    decode family three: the decode kernel, the split combine and the cache append)."""
    if kernel.endswith(("__combine", "__append", "__append__paged")) and "decode" in kernel:
        return DECODE_AUX_THREADS, 0
    if isinstance(cfg, BwdConfig):
        if kernel.endswith(("__pre", "__convert")):
            return 128, 0
        if "__dq" in kernel:
            return cfg.dq_threads, cfg.dq_smem_bytes
        if "__dkdv_det" in kernel:
            return cfg.kernel_threads("dkdv_det"), cfg.smem_bytes
    return cfg.threads, cfg.smem_bytes


def shipped_configs(arch: str) -> list[AnyConfig]:
    """Every configuration a default call can run on ``arch``: forward, backward, decode (ops.catalog)."""
    cfgs = list(dict.fromkeys(job.cfg for job in ops.catalog(arch)))
    return (
        [c for c in cfgs if isinstance(c, KernelConfig)]
        + [c for c in cfgs if isinstance(c, BwdConfig)]
        + [c for c in cfgs if isinstance(c, DecodeConfig)]
    )


def parse_any(text: str) -> AnyConfig:
    """A forward config name or symbol, or a backward (``bwd_...``) or decode (``decode_...``) config name."""
    if text.strip().startswith("decode_"):
        return parse_decode_config(text.strip())
    return parse_bwd_config(text) if text.strip().startswith("bwd_") else parse_config(text)


# Each family states its own register roles: the forward's and backward's warp-specialized kernels split
# registers between warpgroups with setmaxnreg, the decode kernels never do.
_REGISTER_ROLES = {
    KernelConfig: register_roles,
    BwdConfig: bwd_register_roles,
    DecodeConfig: decode_register_roles,
}


def register_roles_of(cfg: AnyConfig) -> str:
    """What ``cfg``'s reported register count means per role ("" where all threads hold the same)."""
    roles = _REGISTER_ROLES.get(type(cfg))
    if roles is None:
        raise TypeError(f"cfg must be a KernelConfig, BwdConfig or DecodeConfig; got {type(cfg).__name__}")
    return roles(cfg)


def resource_lines(cfg, arch: str, compiler: str | None, variant: Variant = PLAIN) -> list[str]:
    built = _build(cfg, arch, compiler, variant)
    lines = []
    for r in sorted(built.meta["resources"], key=lambda r: r["kernel"]):
        threads, dyn_smem = launch_shape(cfg, r["kernel"])
        smem = dyn_smem + r["static_smem"]
        occ = occupancy(arch, threads, r["registers"], smem)
        lines.append(
            f"{arch:6} {r['registers']:4d} {smem:7d} {r['spill_stores']:5d}/{r['spill_loads']:<5d} "
            f"{r['stack_frame']:5d}  {occ.blocks:2d} blk {occ.warps:2d}/{occ.max_warps} warps "
            f"({occ.fraction:4.0%}, {occ.limiter:13})  {r['kernel']}"
        )
        if r.get("wgmma_serialized"):  # (absent from cache entries written before the check)
            lines.append(f"{'':6} ptxas serialized this kernel's wgmma: {r['wgmma_serialized']}")
    roles = register_roles_of(cfg)
    if roles:
        lines.append(f"{'':6} registers by role: {roles}")
    return lines


def _hist_table(hists: list[tuple[str, Counter]]) -> str:
    ops = [o for o in KEY_OPS if any(h[o] for _, h in hists)]
    others = sorted({o for _, h in hists for o in h} - set(ops), key=lambda o: -max(h[o] for _, h in hists))
    ops += others
    width = max(12, *(len(n) for n, _ in hists)) if len(hists) > 1 else 12
    head = f"{'instruction':12}" + "".join(f" {n[-width:]:>{width}}" for n, _ in hists)
    if len(hists) == 2:
        head += f" {'B - A':>8}"
    rows = [head]
    for o in ops:
        row = f"{o:12}" + "".join(f" {h[o]:>{width}d}" for _, h in hists)
        if len(hists) == 2:
            row += f" {hists[1][1][o] - hists[0][1][o]:>+8d}"
        rows.append(row)
    rows.append(f"{'total':12}" + "".join(f" {sum(h.values()):>{width}d}" for _, h in hists))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention report",
        description="Registers, shared memory, spills, occupancy, (--sass) instruction counts and (--loop) "
        "step loops per kernel.",
    )
    ap.add_argument("--configs", nargs="*", default=None, help="config names (default: shipped configs)")
    ap.add_argument("--arch", default="sm_90", help="target architecture (default sm_90)")
    ap.add_argument("--compiler", choices=["nvrtc", "nvcc"], default=None)
    ap.add_argument("--sass", action="store_true", help="instruction histogram of each kernel (cuobjdump)")
    ap.add_argument(
        "--loop",
        action="store_true",
        help="each kernel's step loop: its length, registers and the kernel's registers it never names",
    )
    ap.add_argument(
        "--causal", action="store_true", help="with --sass/--compare/--loop: the causal entry point"
    )
    ap.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), help="two configs side by side (implies --sass)"
    )
    ap.add_argument("--score", choices=sorted(SCORE_MODS), default=None, help="a score function's build")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--window", action="store_true", help="the sliding window's build")
    mask.add_argument("--segments", action="store_true", help="the packed batch's (attention_varlen) build")
    ap.add_argument(
        "--against-plain",
        action="store_true",
        help="with a variant: its histogram beside the plain build's, per config (implies --sass)",
    )
    args = ap.parse_args(argv)
    variant = Variant(SEGMENTS if args.segments else args.window, args.score)
    if args.against_plain and (variant == PLAIN or args.compare):
        print("--against-plain needs --score, --window or --segments, and no --compare", file=sys.stderr)
        return 2
    try:
        if args.compare:
            cfgs = [parse_any(c) for c in args.compare]
        elif args.configs:
            cfgs = [parse_any(c) for c in args.configs]
        else:
            cfgs = shipped_configs(args.arch)
    except ValueError as exc:
        print(f"config: {exc}", file=sys.stderr)
        return 2

    print(f"{'arch':6} {'regs':>4} {'smem':>7} {'spill st/ld':>11} {'stack':>5}  occupancy{'':31}kernel")
    entry = "causal" if args.causal and True in mask_causals(variant.window) else "non-causal"
    try:
        for cfg in cfgs:
            for line in resource_lines(cfg, args.arch, args.compiler, variant):
                print(line)
        if args.against_plain:
            for cfg in cfgs:
                pair = [
                    (str(v), sass_histograms(_build(cfg, args.arch, args.compiler, v).cubin)[
                        main_symbol(cfg, args.causal, v)
                    ])
                    for v in (PLAIN, variant)
                ]  # fmt: skip
                print(f"\n{cfg.name()}: A = plain, B = {variant} ({entry} entry point, {args.arch})")
                print(_hist_table([("A", pair[0][1]), ("B", pair[1][1])]))
        elif args.loop:
            for cfg in cfgs:
                text = sass_by_function(_build(cfg, args.arch, args.compiler, variant).cubin)
                print(f"\n{cfg.name()} ({variant} build, {entry}, {args.arch})")
                for line in loop_lines(text[main_symbol(cfg, args.causal, variant)]):
                    print("  " + line)
        elif args.sass or args.compare:
            hists = []
            for cfg in cfgs:
                h = sass_histograms(_build(cfg, args.arch, args.compiler, variant).cubin)
                # A backward config's main kernel is its dK/dV kernel.
                hists.append((cfg.name(), h[main_symbol(cfg, args.causal, variant)]))
            print()
            if args.compare:
                where = f"{variant} build, {entry} entry point, {args.arch}"
                print(f"A = {hists[0][0]}\nB = {hists[1][0]}  ({where})")
                print(_hist_table([("A", hists[0][1]), ("B", hists[1][1])]))
            else:
                for name, h in hists:
                    print(f"{name} ({variant} build, {entry}, {args.arch})")
                    print(_hist_table([("count", h)]))
                    print()
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
