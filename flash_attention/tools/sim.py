"""The tile simulator: the forward kernel's computation replayed on the CPU, tile for tile.

:func:`simulate` computes attention exactly the way one :class:`~flash_attention.configs.KernelConfig` of the
forward kernel (``csrc/kernels/sm80/fwd/fwd_kernel.cuh``, or the warp-specialized Hopper kernel,
``csrc/kernels/sm90/fwd_ws/fwd_kernel.cuh``, whose consumer warps run the same steps on wgmma) does, so the
two can be compared number for number:

* the same tiling: row blocks of ``block_q`` query rows, split over the warps that own rows
  (``cfg.rows_per_warp`` each: ``block_q / num_warps``, or 16 per consumer warp of a warp-specialized block),
  against K/V tiles of ``block_kv`` keys; Q, K and V zero-padded to whole tiles and to the compiled
  head_dim, as the kernel's zero-filling copies (cp.async, or the TMA unit's out-of-bounds fill) leave them;
* the same K/V order (first to last, or last to first with ``reverse_kv``) and the same causal skipping:
  a row block visits the K/V blocks up to its last row's last visible key (bottom-right alignment), and
  masks keys past ``seqlen_k`` and above the diagonal with -inf;
* the same online softmax, operation for operation in fp32: the running max M of the raw scores and the
  ``exp2(s * scale*log2e - m * scale*log2e)`` FMA form when ``opt_softmax`` is on (else the scores scaled
  first and ``__expf``'s ``exp2(x * log2e)``), the -inf guard that subtracts 0 for a row that has seen no
  key, the rescale factor alpha applied to L and O, each lane's partial row sum (pairs of columns added in
  n-tile order) and their quad reduction at the end;
* the lazy reference of the warp-specialized kernel at head_dim 256 (fa/softmax.cuh kLazy;
  sm90/fwd_ws/mainloop.cuh kLazyMax, here lazy_reference): M moves only when a block's max exceeds it by
  more than LAZY_MARGIN in base 2, and alpha is then exactly 1;
* the same rounding points: each ``mma.sync`` step (16 products summed, then added to the fp32
  accumulator; a wgmma instruction is one such 16-deep step too) as one rounding, P rounded to fp16/bf16
  before P·V, O / L in fp32 and cast to the output dtype, LSE in fp32.

What cannot be mirrored is the tensor cores' internal summation order and the hardware's ``ex2.approx``
and ``logf``; they differ from ours by a few fp32 ulps. ``error_bound=True`` propagates exactly that
uncertainty through the same steps and returns, per output element, the largest difference a correct
kernel can show: where the fp32 value is not within that uncertainty of a rounding boundary of the output
dtype the bound is 0 (a correct kernel is bit-identical there), elsewhere it is one output ulp.

With ``trace=TraceSpec(batch, head, row_block, warp)`` the simulator also records that warp's intermediates
(:class:`Trace`), the same named tensors the kernel's debug build writes (flash_attention.debug).

The variants the kernels compute (fa/variant.cuh) are simulated as the kernels compute them: a sliding
``window`` and a packed batch's per-row key runs (``segments``, flash_attention.api.varlen) as masks, visiting
the blocks up to the last visible key (a block the kernel skips because it lies before every row's window
changes nothing when visited: fully masked, it multiplies by exactly 1 and adds exact zeros); ALiBi in the
forwards' folded form (``s - (slope / scale) |q - k|`` on the unscaled scores, one FMA, the distance exact in
float32); ``sinks`` in the epilogue as fa/softmax.cuh's sink_row, with its two exponentials' ex2.approx
uncertainty in the bounds. The scalar score functions (``score_values`` by name, spec.score_functions: its
``kernel`` form of each, applied before ALiBi as the composed policies do) run with exact transcendentals:
the hardware's approximations (soft-capping's tanh.approx, about 2^-11 relative) are not modelled, so a call
with one refuses ``error_bound`` and traces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flash_attention.configs import KernelConfig, parse_config
from flash_attention.jit.params import TRACE_STEP_FIELDS

__all__ = ["simulate", "TraceSpec", "Trace", "STEP_NAMES", "FINAL_NAMES", "n_blocks_per_row_block"]

#: fa/softmax.cuh kLazyMargin: how far (base 2) a block's max may pass the lazy reference before it moves.
LAZY_MARGIN = 8.0

#: Per-step quantities in the order the kernel computes them (the kernel trace's layout order).
STEP_NAMES = tuple(name for name, _ in TRACE_STEP_FIELDS)
#: Quantities recorded once, after the last step.
FINAL_NAMES = ("O", "LSE")

_LOG2E = 1.4426950408889634  # what ops passes as scale * log2(e) (rounded to fp32 in FwdParams)
_EPS = 2.0**-24  # fp32 unit roundoff
_FLT_MIN = 2.0**-126  # smallest normal fp32: ex2.approx.ftz flushes anything below to 0
# Allowances for what the simulator cannot mirror (see the module docstring). One mma k-step adds 16 exact
# products to the accumulator; the tensor cores align them to the largest and truncate, so a step may be
# off by a few ulps of the accumulator before and after and by up to one ulp of the largest product for
# each of the 16 (2^-23 * 16 = 2^-19). Generous on purpose: a real bug moves values by far more.
_MMA_ACC = 2.0**-21  # per mma k-step, relative to |accumulator in| + |accumulator out|
_MMA_PROD = 2.0**-19  # per mma k-step, relative to the largest |product| (bounded by max|a| * max|b|)
_EX2_REL = 2.0**-21  # ex2.approx against torch.exp2 (the hardware's error is about 2^-22.5)
#: fa/ptx.cuh exp2_poly's maximum relative error by P's type (degree 3 for bf16, 4 for fp16), for configs
#: that compute part of P by it (KernelConfig.exp_poly): the bound then takes it for every P.
_EXP_POLY_REL = {torch.bfloat16: 1.1e-4, torch.float16: 3.2e-6}


@dataclass(frozen=True)
class TraceSpec:
    """Which warp to trace: query head ``head`` of ``batch``, row block ``row_block`` (``block_q`` rows
    each, -1 = the last), warp ``warp`` of the block's computing warps (``cfg.rows_per_warp`` rows each; the
    warp-specialized kernel's producer warps do not count)."""

    batch: int = 0
    head: int = 0
    row_block: int = 0
    warp: int = 0

    @classmethod
    def parse(cls, text: str) -> TraceSpec:
        """``"batch,head,row_block,warp"`` (as in ``FLASH_ATTENTION_TRACE``)."""
        try:
            parts = [int(x) for x in text.split(",")]
            if len(parts) != 4:
                raise ValueError
            return cls(*parts)
        except ValueError:
            raise ValueError(
                f"a trace target is 'batch,head,row_block,warp' (four integers); got {text!r}"
            ) from None

    def resolve(self, cfg: KernelConfig, batch: int, heads_q: int, seqlen_q: int) -> TraceSpec:
        """This spec with ``row_block=-1`` replaced by the last row block, checked against the problem."""
        n_rb = max(1, math.ceil(seqlen_q / cfg.block_q))
        rb = self.row_block + n_rb if self.row_block < 0 else self.row_block
        for name, value, limit in (
            ("batch", self.batch, batch),
            ("head", self.head, heads_q),
            ("row_block", rb, n_rb),
            ("warp", self.warp, cfg.compute_warps),
        ):
            if not 0 <= value < limit:
                raise ValueError(
                    f"trace {name} must be in [0, {limit}) for this problem and config; got {value}"
                )
        return TraceSpec(self.batch, self.head, rb, self.warp)


@dataclass
class Trace:
    """One warp's intermediates, step by step, from the simulator or from the kernel's debug build.

    ``steps[i]`` maps each of :data:`STEP_NAMES` to a float32 tensor (rows are the warp's rows, including
    rows past ``seqlen_q`` that the kernel computes on zero-filled Q; columns run over the compiled
    head_dim): Q (rows x head_dim) and K, V (block_kv x head_dim) as the warp read them from shared memory;
    S = Q K^T before scaling and masking; M, the running row max after the step (of raw scores with
    opt_softmax, of scaled ones without); alpha, the factor that rescaled L and O in this step; P, the
    probabilities in fp32 before rounding; L, the running row sum; O, the unnormalised output after this
    step's P V. ``final`` holds O (the output rows as stored, in the output dtype's values) and LSE.
    ``bounds`` (simulator only) holds, for every entry, how far a correct kernel may differ.
    """

    source: str
    config: KernelConfig
    spec: TraceSpec
    causal: bool
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    scale: float
    n_blocks: int
    kv_blocks: list[int] = field(default_factory=list)
    steps: list[dict[str, torch.Tensor]] = field(default_factory=list)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    bounds: list[dict[str, torch.Tensor]] | None = None
    final_bounds: dict[str, torch.Tensor] | None = None

    @property
    def first_row(self) -> int:
        """Query row (in the sequence) of the warp's first row."""
        return self.spec.row_block * self.config.block_q + self.spec.warp * self.config.rows_per_warp

    def header(self) -> list[str]:
        cfg, s = self.config, self.spec
        wm = cfg.rows_per_warp
        return [
            f"# flash_attention trace ({self.source})",
            f"# config: {cfg.name()}",
            f"# problem: seqlen_q {self.seqlen_q}, seqlen_k {self.seqlen_k}, head_dim {self.head_dim} "
            f"(compiled {cfg.head_dim}), causal {self.causal}, softmax_scale {self.scale:.9g}",
            f"# traced: batch {s.batch}, head {s.head}, row block {s.row_block}, warp {s.warp}: query rows "
            f"{self.first_row}..{self.first_row + wm - 1}",
            f"# {self.n_blocks} K/V steps, blocks in visit order: {self.kv_blocks}",
        ]

    def dump(self) -> str:
        """The whole trace as text: a header, then every tensor of every step, then the final rows."""
        bc = self.config.block_kv
        lines = self.header()
        for i, step in enumerate(self.steps):
            j = self.kv_blocks[i]
            lines.append("")
            lines.append(f"## step {i}: K/V block {j} (keys {j * bc}..{j * bc + bc - 1})")
            for name in STEP_NAMES:
                lines += _format_tensor(name, step[name])
        lines.append("")
        lines.append("## final")
        for name in FINAL_NAMES:
            lines += _format_tensor(name, self.final[name])
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.dump())
        return path


def _format_tensor(name: str, t: torch.Tensor, per_line: int = 16) -> list[str]:
    """``name [shape]`` then rows of values, ``per_line`` to a line, each line led by its (row, column)."""
    shape = " x ".join(str(s) for s in t.shape)
    out = [f"{name} [{shape}]"]
    rows = t.reshape(1, -1) if t.dim() == 1 else t
    for r in range(rows.shape[0]):
        vals = rows[r].tolist()
        for c0 in range(0, len(vals), per_line):
            chunk = " ".join(f"{x:12.7g}" for x in vals[c0 : c0 + per_line])
            where = f"c{c0}" if t.dim() == 1 else f"r{r} c{c0}"
            out.append(f"  {where:>10}: {chunk}")
    return out


# --------------------------------------------------------------------------------------------------
# fp32 operations as the kernel performs them


def lazy_reference(cfg: KernelConfig) -> bool:
    """Whether the kernel keeps a lazy reference max (LAZY_MARGIN): the ws kernel's kLazyMax
    (csrc/kernels/sm90/fwd_ws/mainloop.cuh), at head_dim 256."""
    return cfg.warp_specialized and cfg.head_dim >= 256


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (how a Python float lands in a float field of FwdParams)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _fma(a: torch.Tensor, b: float | torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add with one rounding: the product of two fp32 values is exact in float64."""
    return (a.double() * b + c.double()).float()


def _ex2(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.f32`` (what ``__expf`` ends in), modelled by the correctly rounded 2^x."""
    return torch.exp2(x)


def _ex2_ftz(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32``: 2^x with results below the smallest normal flushed to 0."""
    r = _ex2(x)
    return torch.where(r < _FLT_MIN, torch.zeros_like(r), r)


def _mma(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One ``mma.sync`` k-step: ``acc + a @ b`` (a, b float64 holding fp16/bf16 values, k = 16) rounded
    once to fp32. The products are exact and float64 holds their sum exactly or nearly so."""
    return (acc.double() + a @ b).float()


def n_blocks_per_row_block(cfg: KernelConfig, seqlen_q: int, seqlen_k: int, causal: bool) -> list[int]:
    """How many K/V blocks each row block visits (the kernel's ``n_blocks``)."""
    nb = math.ceil(seqlen_k / cfg.block_kv)
    out = []
    for m in range(math.ceil(seqlen_q / cfg.block_q)):
        if not causal:
            out.append(nb)
            continue
        q_valid = min(cfg.block_q, seqlen_q - m * cfg.block_q)
        max_key = m * cfg.block_q + q_valid - 1 + seqlen_k - seqlen_q
        out.append(0 if max_key < 0 else min(nb, max_key // cfg.block_kv + 1))
    return out


def _dtype(cfg: KernelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float16


def _check(q, k, v, cfg: KernelConfig) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, seqlen, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must agree in batch and head_dim; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")
    if q.shape[3] > cfg.head_dim:
        raise ValueError(f"config {cfg.name()} is compiled for head_dim <= {cfg.head_dim}; got {q.shape[3]}")


def simulate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: KernelConfig | str,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    trace: TraceSpec | None = None,
    error_bound: bool = False,
    window: tuple[int, int] | None = None,
    segments: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_diagonal: torch.Tensor | None = None,
    **score_values: float,
):
    """Attention computed as the kernel of ``config`` computes it, on the CPU.

    Args:
        q, k, v: the layout of :func:`flash_attention.attention` ((batch, seqlen, heads, head_dim), heads_q
            a multiple of heads_kv), any device and float dtype; they are rounded to the config's dtype first,
            as the kernel's inputs are.
        config: a :class:`KernelConfig` or its name.
        causal, softmax_scale: as in :func:`flash_attention.attention`.
        trace: record this warp's intermediates; the trace is returned last.
        error_bound: also return, per element of out and lse, the largest difference from this result
            that a correct kernel can show (see the module docstring).
        window, alibi_slopes, sinks and the ``score_values`` by name: as in
            :func:`flash_attention.attention` (module docstring: how each is simulated). ``segments``: a
            packed batch's (seqlen_q, 2) per-row key runs (the ``row_keys`` of
            :func:`flash_attention.api.varlen.segments`), on a batch of one.
        alibi_diagonal: with ``segments`` and ALiBi, each row's diagonal key (seqlen_q,), as the kernels'
            packed builds measure the distance (``flash_attention.api.varlen.alibi_diagonals``, or
            :func:`flash_attention.fallback.reference.runs_alibi_diagonal` for causal runs); None: the packed
            row's own index (packed self-attention).

    Returns:
        ``(out, lse)`` like ``attention(..., return_lse=True)`` (out in the config's dtype, lse float32, on
        the CPU); with ``error_bound``, ``(out, lse, out_bound, lse_bound)`` (float64); with ``trace``, the
        :class:`Trace` is appended.
    """
    cfg = parse_config(config)
    _check(q, k, v, cfg)
    dt = _dtype(cfg)
    batch, sq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if cfg.opt_softmax and scale < 0:
        raise ValueError(f"softmax_scale must be positive for config {cfg.name()} (opt_softmax)")
    variants = _Variants.of(window, segments, alibi_slopes, sinks, q, k, alibi_diagonal, **score_values)
    if variants.score and (error_bound or trace is not None):
        names = ", ".join(name for name, _ in variants.score)
        raise ValueError(f"{names}: the hardware's approximations are not modelled: no error bound or trace")
    if (variants.window is not None or variants.runs is not None or variants.alibi is not None) and trace:
        raise ValueError("the debug (trace) build has no window, segments or score-function variant")
    spec = trace.resolve(cfg, batch, hq, sq) if trace is not None else None
    run = _Run(cfg, q, k, v, causal, scale, spec, error_bound or spec is not None, variants)
    out, lse, out_bound, lse_bound = run.result(sq, d)
    result: tuple = (out.to(dt), lse)
    if error_bound:
        result += (out_bound, lse_bound)
    if spec is not None:
        result += (run.trace,)
    return result


@dataclass
class _Variants:
    """A call's variants, checked and in the simulator's form."""

    window: tuple[int, int] | None = None
    runs: torch.Tensor | None = None  # (seqlen_q, 2) int64 key runs
    diagonal: torch.Tensor | None = None  # (seqlen_q,) int64 ALiBi diagonal keys of a packed batch
    alibi: torch.Tensor | None = None  # (batch, heads_q) float32 slopes, or per query row (below)
    alibi_per_row: bool = False  # alibi is (seqlen_q, heads_q): a packed batch's slope per query row
    score: tuple = ()  # the scalar score functions' (name, value) pairs (spec.ScoreSpec.values)
    sinks: torch.Tensor | None = None  # (heads_q,) float32

    @staticmethod
    def of(window, segments, alibi_slopes, sinks, q, k, alibi_diagonal=None, **score_values) -> _Variants:
        from flash_attention.spec.score_functions import SCORE_FUNCTIONS, check_value, values_of
        from flash_attention.spec.validate import check_window

        batch, sq, hq, _ = q.shape
        for name, value in score_values.items():
            check_value(name, value)
        var = _Variants(window=check_window(window), score=values_of(**score_values))
        unmodelled = [name for name, _ in var.score if SCORE_FUNCTIONS[name].kernel is None]
        if unmodelled:
            raise ValueError(f"the simulator has no model of the score function {unmodelled[0]!r}")
        if segments is not None:
            if batch != 1 or tuple(segments.shape) != (sq, 2):
                raise ValueError(f"segments must be (seqlen_q, 2) = ({sq}, 2) runs on a batch of one")
            var.runs = segments.detach().to("cpu", torch.int64)
            if alibi_diagonal is not None:
                if tuple(alibi_diagonal.shape) != (sq,):
                    raise ValueError(f"alibi_diagonal must be ({sq},) diagonal keys, one per query row")
                var.diagonal = alibi_diagonal.detach().to("cpu", torch.int64)
        elif alibi_diagonal is not None:
            raise ValueError("alibi_diagonal is a packed batch's: pass it with segments")
        if alibi_slopes is not None:
            slopes = alibi_slopes.detach().to("cpu", torch.float32)
            var.alibi = slopes.expand(batch, hq) if slopes.dim() == 1 else slopes
            # (the kernels' per-row builds: a packed batch's slope per query row)
            var.alibi_per_row = var.runs is not None and slopes.dim() == 2 and slopes.shape[0] > 1
            if var.alibi_per_row and tuple(slopes.shape) != (sq, hq):
                raise ValueError(f"alibi_slopes per query row must be (seqlen_q, heads_q) = ({sq}, {hq})")
        if sinks is not None:
            var.sinks = sinks.detach().to("cpu", torch.float32).reshape(hq)
        return var


class _Run:
    """One simulation: state for every row of every row block of every (batch, head), stepped together."""

    def __init__(self, cfg, q, k, v, causal, scale, spec, bounds, variants=None):
        self.cfg, self.causal, self.spec, self.bounds = cfg, causal, spec, bounds
        self.var = variants or _Variants()
        dt = _dtype(cfg)
        batch, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        br, bc, dd = cfg.block_q, cfg.block_kv, cfg.head_dim
        self.n_rb, self.nb = math.ceil(sq / br), math.ceil(sk / bc)
        self.sq, self.sk, self.d, self.scale = sq, sk, d, scale
        self.scale_f = _f32(scale)  # FwdParams::scale
        self.sl2 = _f32(scale * _LOG2E)  # FwdParams::scale_log2
        self.log2e_f = _f32(_LOG2E)  # the constant inside __expf
        self.lazy = lazy_reference(cfg)

        # Inputs rounded to the kernel's dtype, then exact in float64; zero padding where the kernel's copies
        # zero-fill (rows past the sequence, columns past head_dim).
        def padded(x, rows, heads):
            t = torch.zeros(x.shape[0], heads, rows, dd, dtype=torch.float64)
            t[:, :, : x.shape[1], :d] = x.detach().to("cpu").to(dt).double().permute(0, 2, 1, 3)
            return t

        head_map = torch.arange(hq) // (hq // hkv)
        self.q = padded(q, self.n_rb * br, hq).view(batch, hq, self.n_rb, br, dd)
        self.k = padded(k, self.nb * bc, hkv)[:, head_map].view(batch, hq, self.nb, bc, dd)
        self.v = padded(v, self.nb * bc, hkv)[:, head_map].view(batch, hq, self.nb, bc, dd)
        self.dt = dt
        # P's exponential's relative error: the SFU's, or the polynomial's where the config uses it.
        self.ex2_rel = max(_EX2_REL, _EXP_POLY_REL[dt]) if getattr(cfg, "exp_poly", 0) else _EX2_REL
        self.trace: Trace | None = None
        if spec is not None:
            self.trace = Trace(
                "simulator", cfg, spec, causal, sq, sk, d, scale, 0, bounds=[], final_bounds={}
            )
        self._simulate(batch, hq)

    def _simulate(self, batch: int, hq: int) -> None:
        cfg = self.cfg
        br, bc, dd = cfg.block_q, cfg.block_kv, cfg.head_dim
        n_k_chunks = math.ceil(self.d / 16)  # chunks of zero columns add exact zeros: skipped
        shape = (batch, hq, self.n_rb, br)
        self.o = torch.zeros(*shape, dd)
        self.m = torch.full(shape, float("-inf"))
        self.l_part = torch.zeros(*shape, 4)  # one partial sum per lane of the quad that holds the row
        if self.bounds:
            self.bnd = _Bounds(shape, dd)
            # An uncertainty of M in the exponent's natural-log units (M is of raw scores with opt_softmax).
            self.kappa = self.sl2 * math.log(2) if cfg.opt_softmax else 1.0

        n_blocks = torch.tensor(self._n_blocks())
        if self.trace is not None:
            self.trace.n_blocks = int(n_blocks[self.spec.row_block])
        rows = torch.arange(self.n_rb).unsqueeze(1) * br + torch.arange(br)  # (row block, row)
        shift = self.sk - self.sq
        for it in range(int(n_blocks.max()) if len(n_blocks) else 0):
            act = torch.nonzero(n_blocks > it).flatten()
            j = n_blocks[act] - 1 - it if cfg.reverse_kv else torch.full_like(act, it)
            qa, ka, va = self.q[:, :, act], self.k[:, :, j], self.v[:, :, j]

            # S = Q K^T: one rounding per mma k-step of 16 (products exact, then added to the accumulator).
            s = torch.zeros(batch, hq, len(act), br, bc)
            tol_s = torch.zeros(s.shape, dtype=torch.float64) if self.bounds else None
            for kk in range(n_k_chunks):
                c = slice(16 * kk, 16 * kk + 16)
                s_new = _mma(s, qa[..., c], ka[..., c].transpose(-1, -2))
                if self.bounds:
                    prod = qa[..., c].abs().amax(-1).unsqueeze(-1) * ka[..., c].abs().amax(-1).unsqueeze(-2)
                    tol_s += _MMA_ACC * (s.double().abs() + s_new.double().abs()) + _MMA_PROD * prod
                s = s_new

            keys = j.unsqueeze(1) * bc + torch.arange(bc)  # (A, bc)
            valid = (keys < self.sk).unsqueeze(1)  # (A, 1, bc)
            if self.causal:
                valid = valid & (keys.unsqueeze(1) <= rows[act].unsqueeze(2) + shift)
            diag = keys.unsqueeze(1) - rows[act].unsqueeze(2) - shift  # key minus the row's diagonal
            alibi_diag = diag
            if self.var.diagonal is not None:  # (a packed batch's own diagonals; tail rows: the last row's)
                own = self.var.diagonal[rows[act].clamp_max(self.sq - 1)]
                alibi_diag = keys.unsqueeze(1) - own.unsqueeze(2)
            if self.var.window is not None:
                left, right = self.var.window
                if left >= 0:
                    valid = valid & (diag >= -left)
                if right >= 0:
                    valid = valid & (diag <= right)
            if self.var.runs is not None:
                # (A, br, 2); a tile's tail rows read the last row's run, as the kernels' loads do
                runs = self.var.runs[rows[act].clamp_max(self.sq - 1)]
                kk = keys.unsqueeze(1)
                valid = valid & (kk >= runs[..., :1]) & (kk < runs[..., 1:])
            sx = s if cfg.opt_softmax else s * self.scale_f  # the non-opt path scales before masking
            sx = self._score(sx, alibi_diag.to(torch.float32), rows[act].clamp_max(self.sq - 1))
            sx = sx.masked_fill(~valid, float("-inf"))
            m_old = self.m[:, :, act]
            mx = torch.maximum(m_old, sx.amax(dim=-1))
            keep = None
            if self.lazy:
                # The kernel's reference moves only past the margin (fa/softmax.cuh kLazy); alpha is then 1.
                keep = (mx - m_old) * self.sl2 <= LAZY_MARGIN
                mx = torch.where(keep, m_old, mx)
            if cfg.opt_softmax:
                m_scaled = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx * self.sl2)
                alpha = _ex2_ftz(m_old * self.sl2 - m_scaled)
                if keep is not None:
                    alpha = torch.where(keep, torch.ones_like(alpha), alpha)
                p = _ex2_ftz(_fma(sx, self.sl2, -m_scaled.unsqueeze(-1)))
            else:
                m_use = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
                alpha = _ex2((m_old - m_use) * self.log2e_f)
                p = _ex2((sx - m_use.unsqueeze(-1)) * self.log2e_f)

            # Each lane of a quad sums its column pairs (8 n + 2 t, +1) in n-tile order; L_lane = L_lane *
            # alpha + sum is one FFMA.
            pairs = p.view(*p.shape[:-1], bc // 8, 4, 2)
            pairs = pairs[..., 0] + pairs[..., 1]
            acc = torch.zeros(*p.shape[:-1], 4)
            for n in range(bc // 8):
                acc = acc + pairs[..., n, :]
            l_old = self.l_part[:, :, act]
            l_new = _fma(l_old, alpha.unsqueeze(-1), acc)

            # O = O * alpha, then P (rounded to the input dtype) times V, one rounding per 16-key k-step.
            o_old = self.o[:, :, act]
            o = o_old * alpha.unsqueeze(-1)
            pr = p.to(self.dt).double()
            tol_pv = torch.zeros(o.shape, dtype=torch.float64) if self.bounds else None
            for ks in range(bc // 16):
                c = slice(16 * ks, 16 * ks + 16)
                o_new = _mma(o, pr[..., c], va[..., c, :])
                if self.bounds:
                    prod = pr[..., c].amax(-1).unsqueeze(-1) * va[..., c, :].abs().amax(-2).unsqueeze(-2)
                    tol_pv += _MMA_ACC * (o.double().abs() + o_new.double().abs()) + _MMA_PROD * prod
                o = o_new

            if self.bounds:
                tols = self._step_bounds(
                    act, it, va, tol_s, sx, valid, m_old, mx, alpha, p, pr, l_new, o, tol_pv
                )
            self.m[:, :, act], self.l_part[:, :, act], self.o[:, :, act] = mx, l_new, o
            if self.trace is not None and self.spec.row_block in act.tolist():
                a = act.tolist().index(self.spec.row_block)
                self._record(it, int(j[a]), a, qa, ka, va, s, mx, alpha, p, l_new, o, tols)

    def _n_blocks(self) -> list[int]:
        """The K/V blocks each row block visits: the kernel's last block (causal), a window's right edge, or
        the last row's last run key (segments); all blocks otherwise. (Blocks before the first visible one,
        which the kernels skip, are visited: fully masked, they change nothing.)"""
        cfg = self.cfg
        visits = n_blocks_per_row_block(cfg, self.sq, self.sk, self.causal)
        nb = math.ceil(self.sk / cfg.block_kv)
        shift = self.sk - self.sq
        for m in range(len(visits)):
            last_row = min(self.sq, (m + 1) * cfg.block_q) - 1
            end = None
            if self.var.window is not None and self.var.window[1] >= 0:
                end = last_row + shift + self.var.window[1] + 1
            if self.var.runs is not None:
                end = int(self.var.runs[last_row, 1])
            if end is not None:
                visits[m] = min(visits[m], max(0, min(nb, -(-end // cfg.block_kv))))
        return visits

    def _score(self, s: torch.Tensor, diag: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The score function on a block's scores ``s`` (b, h, A, br, bc): the scalar functions in their
        kernels' form (spec.score_functions: ``kernel``), then ALiBi in its folded form (opt softmax:
        fmaf(-slope / scale, |d|, s)) or the scaled one (fmaf(-slope, |d|, s)), the composed policies' order.
        ``diag``: key minus the row's diagonal, exact in float32; ``rows`` (A, br): the rows' indices, whose
        slopes a per-row table gives."""
        from flash_attention.spec.score_functions import SCORE_FUNCTIONS

        var = self.var
        for name, value in var.score:
            s = SCORE_FUNCTIONS[name].kernel(s, value, self.scale_f, self.cfg.opt_softmax)
        if var.alibi is not None:
            slopes = var.alibi.to(torch.float32)
            if var.alibi_per_row:  # (A, br, hq) -> (1, hq, A, br, 1)
                slopes = slopes[rows].permute(2, 0, 1)[None, :, :, :, None]
                if self.cfg.opt_softmax:  # AlibiFrom::for_row: the row's slope times 1 / scale, in float32
                    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(
                        self.scale_f, dtype=torch.float32
                    )
                    slopes = (slopes * inv).to(torch.float32)
            else:
                if self.cfg.opt_softmax:  # Alibi::slope_over_scale, one float32 division
                    slopes = (slopes / torch.tensor(self.scale_f, dtype=torch.float32)).to(torch.float32)
                slopes = slopes[:, :, None, None, None]
            dist = diag.abs().to(torch.float32)  # (A, br, bc)
            return _fma(-slopes, dist[None, None], s)
        return s

    def _step_bounds(self, act, it, va, tol_s, sx, valid, m_old, mx, alpha, p, pr, l_new, o, tol_pv):
        """Propagate the uncertainty of one step (see _Bounds); returns this step's bounds for the trace.

        The kernel's running max may differ from ours by some delta_t (|delta_t| <= tol_m). Everything
        unnormalised it computes is then scaled by 2^(-delta_t * scale*log2e) against ours, and that common
        factor telescopes through the alphas and cancels in O / L and in the LSE up to the difference
        between delta at different steps. So the per-element uncertainty of P (w) is kept apart from the
        common one of M, and the bounds of L and O are rebuilt from running sums rather than compounded
        step by step (which would count the same delta again at every step).
        """
        b = self.bnd
        cfg = self.cfg
        eps2 = 2 * _EPS
        kappa = self.kappa
        steps = it + 1

        def finite(x):
            return x.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

        if cfg.opt_softmax:
            tol_sx = tol_s
            # fp32 roundings of the exponent: the FMA and m * scale_log2, in natural-log units.
            arg_round = math.log(2) * eps2 * self.sl2 * (finite(sx).abs() + finite(mx).abs().unsqueeze(-1))
            alpha_round = math.log(2) * eps2 * self.sl2 * (finite(m_old).abs() + finite(mx).abs())
        else:
            tol_sx = abs(self.scale_f) * tol_s + eps2 * finite(sx).abs()
            diff = finite(sx) - finite(mx).unsqueeze(-1)
            arg_round = eps2 * (diff.abs() + finite(sx).abs() + finite(mx).abs().unsqueeze(-1))
            alpha_round = eps2 * 2 * (finite(m_old).abs() + finite(mx).abs())
        tol_sx = torch.where(valid, tol_sx, torch.zeros_like(tol_sx))
        tol_m_old = b.tol_m[:, :, act]
        tol_m = torch.maximum(tol_m_old, tol_sx.amax(dim=-1))

        pd, ad = p.double(), alpha.double()
        # each p's relative uncertainty, without the common M one
        w = kappa * tol_sx + arg_round + self.ex2_rel
        tol_p = torch.where(
            valid & (p > 0), pd * (w + kappa * tol_m.unsqueeze(-1)) + 2.0**-100, torch.zeros_like(pd)
        )
        tol_a = torch.where(
            alpha > 0, ad * (kappa * (tol_m_old + tol_m) + alpha_round + _EX2_REL), torch.zeros_like(ad)
        )

        # A P element whose uncertainty straddles a rounding boundary of the input dtype may round either
        # way: it then moves O by the gap between the two neighbours times |V|.
        lo, hi = (pd - tol_p).to(self.dt).double(), (pd + tol_p).to(self.dt).double()
        gap = torch.maximum(hi - pr, pr - lo)
        va_abs = va.abs()
        a1 = ad.unsqueeze(-1)
        b.err_l[:, :, act] = ad * b.err_l[:, :, act] + (pd * torch.where(valid, w, torch.zeros_like(w))).sum(
            -1
        )
        b.mag_o[:, :, act] = a1 * b.mag_o[:, :, act] + pr @ va_abs
        b.flip_o[:, :, act] = a1 * b.flip_o[:, :, act] + gap @ va_abs
        # tol_pv: this step's mma roundings; plus the rounding of O * alpha.
        b.acc_o[:, :, act] = a1 * b.acc_o[:, :, act] + tol_pv + eps2 * (o.double().abs() + tol_pv)
        b.tol_m[:, :, act] = tol_m

        # Per-step bounds of the trace's L and O, which do carry the common factor of M.
        lq = _quad(l_new).double()
        per_step_rel = steps * (self.ex2_rel + (cfg.block_kv // 8 + 4) * eps2)
        tol_l = lq * (kappa * tol_m + per_step_rel) + b.err_l[:, :, act]
        tol_o = b.mag_o[:, :, act] * (2 * kappa * tol_m + per_step_rel).unsqueeze(-1) + b.flip_o[:, :, act]
        tol_o = tol_o + b.acc_o[:, :, act]
        return {"S": tol_s, "M": tol_m, "alpha": tol_a, "P": tol_p, "L": tol_l, "O": tol_o}

    def _record(self, it, j, a, qa, ka, va, s, mx, alpha, p, l_new, o, tols):
        spec, wm = self.spec, self.cfg.rows_per_warp
        b, h, r = spec.batch, spec.head, slice(spec.warp * wm, spec.warp * wm + wm)
        values = {
            "Q": qa[b, h, a, r],
            "K": ka[b, h, a],
            "S": s[b, h, a, r],
            "M": mx[b, h, a, r],
            "alpha": alpha[b, h, a, r],
            "P": p[b, h, a, r],
            "L": _quad(l_new)[b, h, a, r],
            "V": va[b, h, a],
            "O": o[b, h, a, r],
        }
        self.trace.kv_blocks.append(j)
        self.trace.steps.append({n: values[n].float().clone() for n in STEP_NAMES})
        zero = {n: torch.zeros_like(values[n], dtype=torch.float64) for n in ("Q", "K", "V")}
        self.trace.bounds.append(
            {n: (zero[n] if n in zero else tols[n][b, h, a, r]).clone() for n in STEP_NAMES}
        )

    def result(self, sq: int, d: int):
        """(out fp32 values already rounded to the dtype, lse, and their bounds), cropped to the problem."""
        cfg = self.cfg
        lsum = _quad(self.l_part)
        inv = torch.where(lsum > 0, 1.0 / lsum, torch.zeros_like(lsum))
        pos = lsum > 0
        m_fin = torch.where(pos, self.m, torch.zeros_like(self.m))
        log_l = torch.log(torch.where(pos, lsum, torch.ones_like(lsum)))
        m_term = m_fin * self.scale_f if cfg.opt_softmax else m_fin
        lse = torch.where(pos, m_term + log_l, torch.full_like(lsum, float("-inf")))
        if self.var.sinks is not None:
            # fa/softmax.cuh sink_row: top = max(m, sink); keys = exp(m - top) (0 without a key);
            # total = fmaf(L, keys, exp(sink - top)); LSE = top + log(total); O's factor keys / total.
            sink = self.var.sinks.view(1, -1, 1, 1).expand_as(lsum)
            m_nat = torch.where(pos, m_term, torch.full_like(lsum, float("-inf")))
            top = torch.maximum(m_nat, sink)
            keys_w = torch.where(pos, torch.exp(m_nat - top), torch.zeros_like(lsum))
            total = _fma(lsum, keys_w, torch.exp(sink - top))
            lse = top + torch.log(total)
            inv = keys_w / total
        x = self.o * inv.unsqueeze(-1)
        out = x.to(self.dt).float()

        out_bound = lse_bound = None
        if self.bounds:
            b, eps2 = self.bnd, 2 * _EPS
            steps = torch.tensor(self._n_blocks(), dtype=torch.float64)
            steps = steps.view(1, 1, -1, 1)
            ld = torch.where(pos, lsum.double(), torch.ones_like(lsum, dtype=torch.float64))
            # Relative uncertainty of L without the common factor of M (it cancels in O / L and in the LSE).
            rel_l = b.err_l / ld + steps * (self.ex2_rel + (cfg.block_kv // 8 + 4) * eps2)
            if self.var.sinks is not None:  # sink_row's two __expf and a division
                rel_l = rel_l + 4 * _EX2_REL + 4 * _EPS
            rel_o = self.kappa * b.tol_m + (steps + 1) * _EX2_REL
            xd = x.double()
            tol_x = (b.mag_o * rel_o.unsqueeze(-1) + b.flip_o + b.acc_o) / ld.unsqueeze(-1) + xd.abs() * (
                rel_l + 4 * _EPS
            ).unsqueeze(-1)
            tol_x = torch.where(pos.unsqueeze(-1), tol_x, torch.zeros_like(tol_x))
            # The output may round either way only where x +- tol_x straddles a rounding boundary.
            lo, hi = (xd - tol_x).to(self.dt).double(), (xd + tol_x).to(self.dt).double()
            outd = out.double()
            out_bound = torch.maximum(hi - outd, outd - lo)
            tol_lse = (
                rel_l
                + 4 * _EPS * (abs(self.scale_f) if cfg.opt_softmax else 1.0) * b.tol_m
                + 4 * _EPS * (m_term.double().abs() + log_l.double().abs())
                + 2.0**-22 * (1 + log_l.double().abs())
            )
            lse_bound = torch.where(pos, tol_lse, torch.zeros_like(tol_lse))
            if self.trace is not None:
                self._final_trace(out, lse, out_bound, lse_bound)

        def crop(t):  # (b, h, row block, row, ...) -> (b, sq, h, d) / (b, h, sq)
            t = t.reshape(t.shape[0], t.shape[1], -1, *t.shape[4:])
            return (
                t[:, :, :sq, :d].permute(0, 2, 1, 3).contiguous()
                if t.dim() == 4
                else t[:, :, :sq].contiguous()
            )

        return (
            crop(out),
            crop(lse),
            crop(out_bound) if out_bound is not None else None,
            crop(lse_bound) if lse_bound is not None else None,
        )

    def _final_trace(self, out, lse, out_bound, lse_bound):
        spec, wm = self.spec, self.cfg.rows_per_warp
        b, h, m, r = spec.batch, spec.head, spec.row_block, slice(spec.warp * wm, spec.warp * wm + wm)
        self.trace.final = {"O": out[b, h, m, r].clone(), "LSE": lse[b, h, m, r].clone()}
        self.trace.final_bounds = {"O": out_bound[b, h, m, r].clone(), "LSE": lse_bound[b, h, m, r].clone()}


class _Bounds:
    """Running sums for the error bounds, per row (and per column of O)."""

    def __init__(self, shape: tuple, dd: int):
        f64 = torch.float64
        self.tol_m = torch.zeros(shape, dtype=f64)  # how far the kernel's running max may be from ours
        self.err_l = torch.zeros(shape, dtype=f64)  # sum of p * (its relative uncertainty), rescaled like L
        self.mag_o = torch.zeros(*shape, dd, dtype=f64)  # sum of |P~ V| terms, rescaled like O
        self.flip_o = torch.zeros(*shape, dd, dtype=f64)  # P elements that may round the other way, times |V|
        self.acc_o = torch.zeros(*shape, dd, dtype=f64)  # mma and rescale roundings of O


def _quad(l_part: torch.Tensor) -> torch.Tensor:
    """The epilogue's quad reduction: shuffle-add with lane^1, then with lane^2."""
    return (l_part[..., 0] + l_part[..., 1]) + (l_part[..., 2] + l_part[..., 3])
