"""Kernel traces against the simulator: ``python -m flash_attention debug``.

The kernel's debug build (``csrc/include/fa/trace.cuh``, switched on per call by ``ops.cuda_forward(...,
trace=...)`` or for every call by ``FLASH_ATTENTION_TRACE=batch,head,row_block,warp``) makes one warp write
its intermediates into a device buffer. :func:`kernel_trace` reads that buffer back into a
:class:`~flash_attention.sim.Trace`, the same named tensors :func:`flash_attention.sim.simulate` records, and
:func:`compare` walks both in the order the kernel computes them and returns the first entry that differs by
more than the simulator's error bound (what accumulation order and the hardware's ``ex2``/``logf`` can
explain). The command runs both on one problem, writes ``sim.txt`` and ``kernel.txt`` side by side and
names the first difference, or says "match".
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from flash_attention import ops
from flash_attention.configs import KernelConfig, parse_config, portable_config
from flash_attention.jit.params import TRACE_FAULTS, TRACE_MAGIC, TRACE_STEP_FIELDS, TraceLayout
from flash_attention.ops.plans import device_facts
from flash_attention.spec.validate import validate

from .sim import FINAL_NAMES, STEP_NAMES, Trace, TraceSpec, simulate

__all__ = ["kernel_trace", "last_kernel_trace", "run_kernel", "compare", "Mismatch", "ranges_inputs", "main"]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_trace(raw: dict) -> Trace:
    """Decode a trace buffer (``ops.last_trace()``) into a :class:`Trace`."""
    cfg: KernelConfig = raw["config"]
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = raw["shape"]
    t = raw["target"]
    spec = TraceSpec(t.batch, t.head, t.row_block, t.warp)
    buf = raw["buffer"].detach().float().cpu()
    lay = TraceLayout.of(cfg)
    if not buf[lay.magic].item() == TRACE_MAGIC:
        raise RuntimeError(
            f"the trace buffer was not written by a trace build (first value {buf[0].item()}); "
            "was the launch made with the debug build (ops.cuda_forward(..., trace=...))?"
        )
    n_blocks, done = int(buf[lay.num_blocks].item()), int(buf[lay.steps_done].item())
    tr = Trace("kernel", cfg, spec, raw["causal"], seqlen_q, seqlen_k, head_dim, raw["scale"], n_blocks)
    offsets = lay.step_offsets
    for i in range(done):
        base = lay.first_step + i * lay.step_size
        tr.kv_blocks.append(int(buf[base].item()))
        step = {}
        for name, dims in TRACE_STEP_FIELDS:
            shape = lay.shape(dims)
            start = base + offsets[name]
            step[name] = buf[start : start + math.prod(shape)].view(shape).clone()
        tr.steps.append(step)
    tr.final = {
        "O": buf[lay.final_o : lay.final_o + lay.wm * lay.d].view(lay.wm, lay.d).clone(),
        "LSE": buf[lay.final_lse : lay.final_lse + lay.wm].clone(),
    }
    return tr


def last_kernel_trace() -> Trace | None:
    """The trace of the last traced launch (e.g. one made under ``FLASH_ATTENTION_TRACE``), or None."""
    raw = ops.last_trace()
    return kernel_trace(raw) if raw is not None else None


def run_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: KernelConfig | str,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    trace: TraceSpec,
    fault: str = "none",
) -> tuple[torch.Tensor, torch.Tensor, Trace]:
    """Run the debug build of ``config`` on CUDA tensors: ``(out, lse, kernel trace)``."""
    cfg = parse_config(config)
    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=None)
    reason = ops.cuda_unavailable_reason(q)
    if reason is not None:
        raise RuntimeError(f"the kernel cannot run: {reason}")
    spec = trace.resolve(cfg, q.shape[0], q.shape[2], q.shape[1])
    out, lse = ops.cuda_forward(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=problem.scale,
        return_lse=True,
        out=None,
        config=cfg,
        trace=spec,
        trace_fault=fault,
    )
    torch.cuda.synchronize(q.device)
    return out, lse, kernel_trace(ops.last_trace())


@dataclass
class Mismatch:
    """The first traced entry where the kernel and the simulator differ by more than the bound."""

    step: int | None  # None: the final output rows / LSE, or a difference in the step structure
    kv_block: int | None
    name: str
    index: tuple[int, ...]
    kernel: float
    simulator: float
    bound: float
    first_row: int = 0
    block_kv: int = 0

    def describe(self) -> str:
        where = "final" if self.step is None else f"step {self.step}"
        if self.step is not None and self.kv_block is not None:
            k0 = self.kv_block * self.block_kv
            where += f" (K/V block {self.kv_block}, keys {k0}..{k0 + self.block_kv - 1})"
        if self.name in ("Q", "S", "M", "alpha", "P", "L", "O", "LSE") and self.index:
            what = f"{self.name}[row {self.index[0]}" + (
                f", col {self.index[1]}" if len(self.index) > 1 else ""
            )
            what += f"] (query row {self.first_row + self.index[0]})"
        elif self.index:
            what = f"{self.name}[key row {self.index[0]}, col {self.index[1]}]"
        else:
            what = self.name
        diff = abs(self.kernel - self.simulator) if math.isfinite(self.kernel - self.simulator) else math.inf
        return (
            f"{where}, {what}: kernel {self.kernel:.8g} vs simulator {self.simulator:.8g} "
            f"(|difference| {diff:.3g} > bound {self.bound:.3g})"
        )


def _first_violation(kern: torch.Tensor, sim: torch.Tensor, bound: torch.Tensor):
    """Row-major index of the first element outside the bound (NaN, i.e. unwritten, is outside), or None."""
    k, s, b = kern.double(), sim.double(), bound.double()
    ok = (k == s) | ((k - s).abs() <= b)
    bad = torch.nonzero(~ok)
    return tuple(int(x) for x in bad[0]) if len(bad) else None


def compare(sim: Trace, kern: Trace) -> Mismatch | None:
    """The first entry, in the kernel's order of computation, where ``kern`` leaves ``sim``'s bound."""
    if sim.bounds is None or sim.final_bounds is None:
        raise ValueError(
            "compare() needs the simulator's trace (it carries the bounds) as its first argument"
        )
    if sim.config != kern.config or sim.spec != kern.spec:
        raise ValueError("the two traces are of different configs or warps")
    common = dict(first_row=sim.first_row, block_kv=sim.config.block_kv)
    if kern.n_blocks != sim.n_blocks or len(kern.steps) != len(sim.steps):
        return Mismatch(None, None, "number of K/V steps", (), len(kern.steps), len(sim.steps), 0, **common)
    for i, (ss, ks) in enumerate(zip(sim.steps, kern.steps, strict=True)):
        if kern.kv_blocks[i] != sim.kv_blocks[i]:
            return Mismatch(
                i, sim.kv_blocks[i], "K/V block", (), kern.kv_blocks[i], sim.kv_blocks[i], 0, **common
            )
        for name in STEP_NAMES:
            idx = _first_violation(ks[name], ss[name], sim.bounds[i][name])
            if idx is not None:
                return Mismatch(
                    i,
                    sim.kv_blocks[i],
                    name,
                    idx,
                    ks[name][idx].item(),
                    ss[name][idx].item(),
                    sim.bounds[i][name][idx].item(),
                    **common,
                )
    for name in FINAL_NAMES:
        idx = _first_violation(kern.final[name], sim.final[name], sim.final_bounds[name])
        if idx is not None:
            return Mismatch(
                None,
                None,
                name,
                idx,
                kern.final[name][idx].item(),
                sim.final[name][idx].item(),
                sim.final_bounds[name][idx].item(),
                **common,
            )
    return None


def ranges_inputs(
    batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small structured q, k, v (exact in fp16 and bf16) whose values name their own position.

    Row j, column c holds ``(j mod 16) + (c mod 16) / 16`` -- 3.5625 is row 3, column 9 (mod 16) -- so a
    wrong row or column in a trace's Q, K or V shows at a glance. With a softmax scale near
    ``1 / (32 * head_dim)`` (the command's default for them) the softmax is far from one-hot.
    """

    def pattern(rows: int, heads: int) -> torch.Tensor:
        r = (torch.arange(rows) % 16).view(rows, 1, 1).double()
        c = (torch.arange(head_dim) % 16).view(1, 1, head_dim).double() / 16
        return (r + c).expand(rows, heads, head_dim).unsqueeze(0).expand(batch, -1, -1, -1).to(dtype)

    return pattern(seqlen_q, heads_q), pattern(seqlen_k, heads_kv), pattern(seqlen_k, heads_kv)


# --------------------------------------------------------------------------------------------------
# The command


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attention debug",
        description=(
            "Run one kernel configuration's debug build and the tile simulator on the same problem, write "
            "both traces of one warp (every intermediate of every K/V step) to OUT/sim.txt and "
            "OUT/kernel.txt, and print the first intermediate where they differ beyond the simulator's "
            "rounding bound, or 'match'. Without a GPU only the simulator side runs."
        ),
    )
    ap.add_argument(
        "--config",
        required=True,
        help="a kernel config name, e.g. '(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles"
        "+buffer' or '(BF16, 128, 128, 128, 12): wgmma+ws+overlap+stages_2', or 'default': what a traced "
        "call runs on this GPU for --dtype and --head-dim (on Hopper the warp-specialized kernel; without a "
        "GPU the portable kernel's default)",
    )
    ap.add_argument(
        "--seqlen", type=int, required=True, help="query length (and key length unless --seqlen-k)"
    )
    ap.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    ap.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    ap.add_argument("--head-dim", type=int, default=None, help="head_dim (default: the config's)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="only with --config default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2, help="query heads (default 2)")
    ap.add_argument("--heads-kv", type=int, default=None, help="K/V heads (default: --heads)")
    ap.add_argument(
        "--ranges",
        action="store_true",
        help="structured inputs instead of random ones: row j, column c of Q, K and V = (j %% 16) + "
        "(c %% 16)/16, so a wrong index is visible by eye (softmax_scale 1/(32 head_dim) unless --scale)",
    )
    ap.add_argument("--scale", type=float, default=None, help="softmax_scale (default 1/sqrt(head_dim))")
    ap.add_argument(
        "--trace",
        default="0,0,-1,0",
        help="batch,head,row_block,warp to trace (row_block -1 = the last; default 0,0,-1,0)",
    )
    ap.add_argument(
        "--fault",
        choices=sorted(TRACE_FAULTS),
        default="none",
        help="plant a known bug in the kernel's debug build (to see the tool find it)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    ap.add_argument("--out", default="debug", help="folder for sim.txt and kernel.txt (default: debug)")
    return ap.parse_args(argv)


def _config(args) -> KernelConfig:
    if args.config.strip().lower() == "default":
        d = args.head_dim or 128
        sq, sk = args.seqlen, args.seqlen_k or args.seqlen
        if _kernel_unavailable() is not None:
            return portable_config(args.dtype, d, args.causal, sq, sk)
        # The launch layer's own choice for a traced call (tuned winners and heuristics, then the family
        # that has the debug build): on Hopper the warp-specialized kernel.
        return ops.forward_config(
            args.dtype,
            d,
            args.causal,
            sq,
            sk,
            max(1, args.heads // (args.heads_kv or args.heads)),
            **device_facts(torch.cuda.current_device()),
            features=["trace"] + (["negative_scale"] if args.scale is not None and args.scale < 0 else []),
        )
    return parse_config(args.config)


def _kernel_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to PyTorch"
    probe = torch.empty(1, 1, 1, 8, dtype=torch.float16, device="cuda")
    return ops.cuda_unavailable_reason(probe)


def _inputs(args, cfg: KernelConfig, d: int):
    sq, sk = args.seqlen, args.seqlen_k or args.seqlen
    hq = args.heads
    hkv = args.heads_kv or hq
    dtype = _TORCH_DTYPES[cfg.dtype]
    if args.ranges:
        return ranges_inputs(args.batch, sq, sk, hq, hkv, d, dtype)
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(args.batch, sq, hq, d, generator=gen).to(dtype)
    k = torch.randn(args.batch, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(args.batch, sk, hkv, d, generator=gen).to(dtype)
    return q, k, v


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        cfg = _config(args)
        d = args.head_dim or cfg.head_dim
        q, k, v = _inputs(args, cfg, d)
        scale = args.scale if args.scale is not None else (1 / (32 * d) if args.ranges else 1 / math.sqrt(d))
        spec = TraceSpec.parse(args.trace).resolve(cfg, q.shape[0], q.shape[2], q.shape[1])
        out_s, lse_s, out_b, lse_b, tr_s = simulate(
            q, k, v, cfg, causal=args.causal, softmax_scale=scale, trace=spec, error_bound=True
        )
    except ValueError as exc:
        print(f"debug: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    inputs = "ranges" if args.ranges else f"random (seed {args.seed})"
    print(f"config:    {cfg.name()}")
    print(
        f"problem:   batch {q.shape[0]}, seqlen_q {q.shape[1]}, seqlen_k {k.shape[1]}, heads {q.shape[2]}/"
        f"{k.shape[2]}, head_dim {d}, causal {args.causal}, softmax_scale {scale:.6g}, {inputs} inputs"
    )
    print(
        f"traced:    batch {spec.batch}, head {spec.head}, row block {spec.row_block}, warp {spec.warp} "
        f"(query rows {tr_s.first_row}..{tr_s.first_row + cfg.rows_per_warp - 1}), {tr_s.n_blocks} K/V steps"
    )
    print(f"simulator: {tr_s.save(out_dir / 'sim.txt')}")

    reason = _kernel_unavailable()
    if reason is not None:
        print(
            f"kernel:    not run: {reason}. The simulator side ran; run this command on a machine with a "
            "CUDA GPU (sm_80 or newer) to compare (python -m flash_attention sanity says what is missing)."
        )
        return 2
    try:
        dev = [x.cuda() for x in (q, k, v)]
        out_k, lse_k, tr_k = run_kernel(
            *dev, cfg, causal=args.causal, softmax_scale=scale, trace=spec, fault=args.fault
        )
    except Exception as exc:  # noqa: BLE001 - report any build/launch failure with what to do next
        print(f"kernel:    failed: {exc}")
        print("Run `python -m flash_attention sanity` to check the GPU and the compiler.")
        return 1
    fault = f"  (planted fault: {args.fault})" if args.fault != "none" else ""
    print(f"kernel:    {tr_k.save(out_dir / 'kernel.txt')}{fault}")

    out_k, lse_k = out_k.cpu(), lse_k.cpu()
    diff = (out_k.double() - out_s.double()).abs()
    outside = int((diff > out_b).sum())
    same = float((out_k == out_s).double().mean()) * 100
    lse_diff = (lse_k.double() - lse_s.double()).abs().nan_to_num(0.0)
    lse_outside = int(((lse_k != lse_s) & (lse_diff > lse_b)).sum())
    print(
        f"outputs:   max |kernel - simulator| {diff.max().item():.3g}, {same:.2f}% bit-identical; "
        f"{outside} of {diff.numel()} elements and {lse_outside} of {lse_diff.numel()} LSE values outside "
        "the bound (0 where no rounding boundary is within reach, else one ulp)"
    )
    mismatch = compare(tr_s, tr_k)
    if mismatch is None:
        print(
            f"match: every traced intermediate of the {tr_s.n_blocks} steps is within the simulator's bound"
        )
        return 0 if outside == 0 and lse_outside == 0 else 1
    print(f"first difference: {mismatch.describe()}")
    return 1
