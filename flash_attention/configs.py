"""Kernel configurations: the one source of truth for a forward kernel's compile-time shape.

A :class:`KernelConfig` names one instantiation of the forward kernel family. From it come

* a canonical short name (``str(cfg)`` / :meth:`KernelConfig.name`) that :func:`parse_config` turns back
  into an equal object, e.g.
  ``(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax``;
* the C identifier used as the kernel's symbol (:meth:`KernelConfig.symbol`), which also parses back;
* the C++ ``struct`` of named compile-time constants the kernel template is instantiated with
  (:meth:`KernelConfig.cpp_struct`), never positional template arguments;
* the validity rules (:func:`validity_errors`), mirrored one for one by ``static_assert`` in
  ``csrc/kernels/sm80/fwd/fwd_kernel.cuh``;
* the part of the JIT cache key that depends on the configuration (:meth:`KernelConfig.key`).

Nothing about the problem shape (batch, heads, sequence lengths) is compiled in: only the padded head
dimension and the tile.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "KernelConfig",
    "parse_config",
    "validity_errors",
    "HEAD_DIMS",
    "padded_head_dim",
    "default_config",
    "smem_bytes",
    "estimated_registers",
    "SMEM_LIMIT_SM80",
    "SMEM_LIMIT_SM90",
    "wgmma_config",
    "BwdConfig",
    "bwd_validity_errors",
    "default_bwd_config",
    "parse_bwd_config",
]

#: Head dimensions a kernel is instantiated for. Any other multiple of 8 up to 256 runs on the next size up
#: with the tail masked: loads zero-fill the missing columns and stores skip them. All are multiples of 64
#: so a shared-memory row holds whole groups of eight 16-byte chunks, which the XOR swizzle needs.
HEAD_DIMS = (64, 128, 192, 256)

DTYPES = ("fp16", "bf16")

#: The largest dynamic shared memory one block may opt into on sm_80 (A100: 163 KB); sm_90 allows 227 KB.
#: Shipped configs must fit the smaller so one config list serves both architectures.
SMEM_LIMIT_SM80 = 163 * 1024
#: The sm_90 opt-in limit, which bounds the wgmma configs (they run on sm_90a only).
SMEM_LIMIT_SM90 = 227 * 1024

#: The only flags a wgmma config has: its kernel copies with cp.async, loads V_j and K_{j+1} eagerly into
#: swizzled tiles and uses the folded softmax; the fragment knobs are the sm80 kernel's.
_WGMMA_FIXED = dict(
    async_copy=True,
    eager=True,
    swizzle=True,
    q_frags=0,
    k_frags=0,
    v_frags=0,
    double_buffer=False,
    opt_softmax=True,
    reverse_kv=False,
)


def padded_head_dim(head_dim: int) -> int:
    """The instantiated head dimension a problem of ``head_dim`` runs on."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {HEAD_DIMS[-1]}; got {head_dim}")


@dataclass(frozen=True)
class KernelConfig:
    """One forward-kernel instantiation.

    Attributes:
        dtype: ``"fp16"`` or ``"bf16"`` (inputs and output; the softmax is always fp32).
        head_dim: instantiated head dimension, one of :data:`HEAD_DIMS`.
        block_q: B_r, query rows per thread block.
        block_kv: B_c, keys per K/V tile.
        num_warps: warps per block; query rows are split evenly over them (``block_q / num_warps`` each).
        async_copy: global->shared copies with ``cp.async`` (else plain loads and stores through registers).
        eager: issue the load of V_j before computing S_j and of K_{j+1} before computing P_j V_j, so copies
            overlap the matrix work (needs ``async_copy``).
        swizzle: XOR-swizzle 16-byte chunks in shared memory so ``ldmatrix`` is free of bank conflicts.
        q_frags: 16-wide slices of head_dim of Q loaded from shared memory per step; 0 keeps all of Q in
            registers for the whole kernel.
        k_frags: 16-wide slices of head_dim of K loaded per step (0: all of them at once).
        v_frags: 16-key slices of V loaded per step (0: all of them at once).
        double_buffer: load the next group of fragments into a second register buffer while the mma
            instructions consume the current one.
        opt_softmax: fold the softmax scale and log2(e) into one FMA feeding ``ex2`` (else scale S, then exp).
        reverse_kv: visit K/V blocks from last to first (causal: the masked diagonal blocks come first).
        wgmma: the Hopper kernel (csrc/kernels/sm90/fwd, sm_90a only): the matrix products on wgmma, which
            reads K and V from shared memory itself, so the fragment-loading knobs do not apply. Each
            warpgroup (4 warps) owns 64 query rows. Its canonical name is ``(...): wgmma``.
        stages: wgmma only: K/V buffers in the copy ring (1: one K and one V buffer loaded eagerly, as the
            sm80 kernel does; S >= 2: block j + S - 1 is requested while block j is computed). Named
            ``wgmma+stages_S`` when S > 1.
    """

    dtype: str
    head_dim: int
    block_q: int
    block_kv: int
    num_warps: int
    async_copy: bool = True
    eager: bool = True
    swizzle: bool = True
    q_frags: int = 0
    k_frags: int = 2
    v_frags: int = 2
    double_buffer: bool = True
    opt_softmax: bool = True
    reverse_kv: bool = False
    wgmma: bool = False
    stages: int = 1

    def __post_init__(self) -> None:
        errors = validity_errors(self)
        if errors:
            raise ValueError(f"invalid kernel config {self.name()}: " + "; ".join(errors))

    @classmethod
    def unchecked(cls, *args, **kwargs) -> KernelConfig:
        """Build a config without the validity check (tests use it to feed invalid ones to the compiler)."""
        obj = object.__new__(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        values = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        values.update(zip(names[: len(args)], args, strict=True))
        values.update(kwargs)
        for name in names:
            object.__setattr__(obj, name, values[name])
        return obj

    # ----------------------------------------------------------------------------------------------
    # Derived quantities
    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_q // self.num_warps

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self)

    # ----------------------------------------------------------------------------------------------
    # Names
    def flags(self) -> list[str]:
        if self.wgmma:
            return ["wgmma"] + ([f"stages_{self.stages}"] if self.stages != 1 else [])
        out = ["async" if self.async_copy else "sync"]
        if self.eager:
            out.append("eager")
        if self.swizzle:
            out.append("swizzled")
        out.append(f"load_{self.q_frags}_{self.k_frags}_{self.v_frags}_tiles")
        if self.double_buffer:
            out.append("buffer")
        if self.opt_softmax:
            out.append("opt_softmax")
        if self.reverse_kv:
            out.append("reverse")
        return out

    def name(self) -> str:
        head = f"({self.dtype.upper()}, {self.head_dim}, {self.block_q}, {self.block_kv}, {self.num_warps})"
        return f"{head}: " + "+".join(self.flags())

    def __str__(self) -> str:
        return self.name()

    def symbol(self, causal: bool = False) -> str:
        """C identifier of the kernel entry point (what a profiler shows)."""
        parts = [
            "flash_fwd",
            self.dtype,
            f"d{self.head_dim}",
            f"q{self.block_q}",
            f"kv{self.block_kv}",
            f"w{self.num_warps}",
            *self.flags(),
        ]
        if causal:
            parts.append("causal")
        return "__".join(parts)

    def key(self) -> str:
        """Stable text used in the JIT cache key."""
        return self.symbol()

    def replace(self, **changes) -> KernelConfig:
        return dataclasses.replace(self, **changes)

    def cpp_struct(self, struct_name: str = "Cfg") -> str:
        """The C++ struct of named constants the kernel template is instantiated with."""
        fields = [
            ("kIsBF16", "bool", _b(self.dtype == "bf16")),
            ("kHeadDim", "int", str(self.head_dim)),
            ("kBlockQ", "int", str(self.block_q)),
            ("kBlockKV", "int", str(self.block_kv)),
            ("kNumWarps", "int", str(self.num_warps)),
            ("kAsyncCopy", "bool", _b(self.async_copy)),
            ("kEager", "bool", _b(self.eager)),
            ("kSwizzle", "bool", _b(self.swizzle)),
            ("kQFrags", "int", str(self.q_frags)),
            ("kKFrags", "int", str(self.k_frags)),
            ("kVFrags", "int", str(self.v_frags)),
            ("kDoubleBuffer", "bool", _b(self.double_buffer)),
            ("kOptSoftmax", "bool", _b(self.opt_softmax)),
            ("kReverseKV", "bool", _b(self.reverse_kv)),
            ("kWgmma", "bool", _b(self.wgmma)),
            ("kStages", "int", str(self.stages)),
        ]
        return _cpp_struct(struct_name, fields)


def wgmma_config(
    dtype: str, head_dim: int, block_q: int, block_kv: int, stages: int = 1, *, check: bool = True
) -> KernelConfig:
    """The Hopper (wgmma) config with ``block_q / 64`` warpgroups and a ``stages``-deep K/V copy ring
    (``check=False``: without the validity check, as :meth:`KernelConfig.unchecked`)."""
    make = KernelConfig if check else KernelConfig.unchecked
    return make(dtype, head_dim, block_q, block_kv, block_q // 16, wgmma=True, stages=stages, **_WGMMA_FIXED)


def _cpp_struct(struct_name: str, fields: list[tuple[str, str, str]]) -> str:
    """A C++ struct of named compile-time constants: (name, type, value) per field."""
    body = "\n".join(f"  static constexpr {t} {n} = {v};" for n, t, v in fields)
    return f"struct {struct_name} {{\n{body}\n}};\n"


def _b(x: bool) -> str:
    return "true" if x else "false"


# --------------------------------------------------------------------------------------------------
# Validity rules. Each rule has a twin static_assert in fwd_kernel.cuh (same wording); the test
# tests/test_configs.py compiles the kernel for every candidate and checks both sides agree.


def validity_errors(cfg: KernelConfig) -> list[str]:
    """Every rule ``cfg`` breaks, as readable sentences (empty when valid)."""
    e: list[str] = []
    if cfg.dtype not in DTYPES:
        e.append(f"dtype must be one of {DTYPES}")
    if cfg.head_dim not in HEAD_DIMS:
        e.append(f"head_dim must be one of {HEAD_DIMS}")
    if cfg.num_warps not in (1, 2, 4, 8):
        e.append("num_warps must be 1, 2, 4 or 8")
        return e
    if cfg.wgmma:
        if cfg.num_warps not in (4, 8) or cfg.block_q != 16 * cfg.num_warps:
            e.append(
                "wgmma needs num_warps 4 or 8 and block_q = 16 * num_warps (each warpgroup of 4 warps owns "
                "64 query rows)"
            )
        if cfg.stages not in (1, 2, 3, 4):
            e.append("stages must be 1, 2, 3 or 4")
        if any(getattr(cfg, k) != v for k, v in _WGMMA_FIXED.items()):
            e.append(
                "wgmma fixes async+eager+swizzled+opt_softmax with no fragment loads, double buffer "
                "or reverse"
            )
    elif cfg.stages != 1:
        e.append("stages other than 1 need wgmma (the sm80 kernel has one K and one V buffer)")
    if cfg.block_q % (16 * cfg.num_warps) != 0:
        e.append("block_q must be a multiple of 16 * num_warps (each warp owns whole 16-row mma tiles)")
    elif cfg.block_q // cfg.num_warps > 64:
        e.append(
            "block_q / num_warps must be at most 64 (the accumulators of more rows exceed the registers)"
        )
    if cfg.block_kv not in (16, 32, 64, 128, 256):
        e.append("block_kv must be 16, 32, 64, 128 or 256")
    if cfg.eager and not cfg.async_copy:
        e.append("eager loading needs async_copy (a plain load would stall the warp that issues it)")
    if cfg.head_dim in HEAD_DIMS:
        dk = cfg.head_dim // 16
        if cfg.q_frags < 0 or (cfg.q_frags and dk % cfg.q_frags):
            e.append("q_frags must be 0 or divide head_dim / 16")
        if cfg.k_frags < 0 or (cfg.k_frags and dk % cfg.k_frags):
            e.append("k_frags must be 0 or divide head_dim / 16")
    if cfg.block_kv in (16, 32, 64, 128, 256):
        ks = cfg.block_kv // 16
        if cfg.v_frags < 0 or (cfg.v_frags and ks % cfg.v_frags):
            e.append("v_frags must be 0 or divide block_kv / 16")
    if cfg.double_buffer and not _has_fragment_groups(cfg):
        e.append(
            "double_buffer needs more than one fragment group of K or V (k_frags or v_frags smaller than all)"
        )
    if cfg.wgmma:
        if smem_bytes(cfg) > SMEM_LIMIT_SM90:
            e.append(f"shared memory ({smem_bytes(cfg)} bytes) exceeds the sm_90 limit of {SMEM_LIMIT_SM90}")
    elif smem_bytes(cfg) > SMEM_LIMIT_SM80:
        e.append(f"shared memory ({smem_bytes(cfg)} bytes) exceeds the sm_80 limit of {SMEM_LIMIT_SM80}")
    return e


def _has_fragment_groups(cfg: KernelConfig) -> bool:
    k_groups = (cfg.head_dim // 16) // cfg.k_frags if cfg.k_frags > 0 else 1
    v_groups = (cfg.block_kv // 16) // cfg.v_frags if cfg.v_frags > 0 else 1
    return k_groups > 1 or v_groups > 1


def smem_bytes(cfg: KernelConfig) -> int:
    """Dynamic shared memory of one block: one Q tile, one K tile and one V tile (2-byte elements).

    One K and one V buffer suffice even with eager loading: V_j lands while S_j = Q K_j^T is computed,
    and K_{j+1} lands in K's buffer (free once S_j is done) while P_j V_j is computed. A wgmma config
    asks for 1 KB more: its tiles must start on a 1024-byte boundary (where the 128-byte swizzle repeats)
    and the dynamic shared memory window is only guaranteed 16-byte alignment.
    """
    kv = 2 * cfg.block_kv * cfg.stages
    return 2 * cfg.head_dim * (cfg.block_q + kv) + (1024 if cfg.wgmma else 0)


def estimated_registers(cfg: KernelConfig) -> int:
    """A lower estimate of the 32-bit registers per thread: what must be live at the peak of the loop.

    The O accumulator (rows x head_dim fp32 over 32 lanes), the S accumulator (rows x block_kv), Q when it
    stays resident, and ~24 for addresses, indices and softmax statistics. The K/V fragment groups are left
    out: ptxas streams them (a 4-slice group at head_dim 128 compiles to 254 registers, not the 318 a
    buffer-by-buffer count gives). Calibrated on 60 compiled candidates: every config above 255 here spilled,
    and the ones below that still spill are caught by the compiler's report after the build.
    """
    rows = cfg.rows_per_warp
    if cfg.wgmma:
        # One 16-row slice per warp; P (16-bit pairs) lives beside S while O += P V is issued.
        return (cfg.head_dim + cfg.block_kv) // 2 + cfg.block_kv // 4 + 24
    o_acc = rows * cfg.head_dim // 32
    s_acc = rows * cfg.block_kv // 32
    q_resident = rows * cfg.head_dim // 64 if cfg.q_frags == 0 else 0
    return o_acc + s_acc + q_resident + 24


# --------------------------------------------------------------------------------------------------
# Parsing

_NAME_RE = re.compile(
    r"^\(\s*(?P<dtype>FP16|BF16)\s*,\s*(?P<d>\d+)\s*,\s*(?P<bq>\d+)\s*,\s*(?P<bkv>\d+)\s*,\s*(?P<w>\d+)\s*\)\s*:\s*"
    r"(?P<flags>[A-Za-z0-9_+]+)\s*$",
    re.IGNORECASE,
)
_LOAD_RE = re.compile(r"^load_(\d+)_(\d+)_(\d+)_tiles$")


def _from_flags(dtype: str, d: int, bq: int, bkv: int, w: int, flags: list[str], text: str) -> KernelConfig:
    kw: dict = dict(
        async_copy=False,
        eager=False,
        swizzle=False,
        q_frags=0,
        k_frags=0,
        v_frags=0,
        double_buffer=False,
        opt_softmax=False,
        reverse_kv=False,
    )
    simple = {
        "eager": "eager",
        "swizzled": "swizzle",
        "buffer": "double_buffer",
        "opt_softmax": "opt_softmax",
        "reverse": "reverse_kv",
    }
    if flags and flags[0] == "wgmma":
        stages = 1
        for f in flags[1:]:
            m = re.fullmatch(r"stages_(\d+)", f)
            if not m:
                raise ValueError(f"unknown flag {f!r} in kernel config name {text!r}")
            stages = int(m[1])
        return KernelConfig(dtype.lower(), d, bq, bkv, w, wgmma=True, stages=stages, **_WGMMA_FIXED)
    seen_copy = False
    for f in flags:
        m = _LOAD_RE.match(f)
        if f in ("async", "sync"):
            kw["async_copy"] = f == "async"
            seen_copy = True
        elif f in simple:
            kw[simple[f]] = True
        elif m:
            kw["q_frags"], kw["k_frags"], kw["v_frags"] = (int(x) for x in m.groups())
        else:
            raise ValueError(f"unknown flag {f!r} in kernel config name {text!r}")
    if not seen_copy:
        raise ValueError(f"kernel config name {text!r} must say 'async' or 'sync'")
    return KernelConfig(dtype.lower(), d, bq, bkv, w, **kw)


def parse_config(text: str | KernelConfig) -> KernelConfig:
    """Parse a canonical name or a kernel symbol back into a :class:`KernelConfig`."""
    if isinstance(text, KernelConfig):
        return text
    s = text.strip()
    m = _NAME_RE.match(s)
    if m:
        return _from_flags(
            m["dtype"], int(m["d"]), int(m["bq"]), int(m["bkv"]), int(m["w"]), m["flags"].split("+"), text
        )
    if s.startswith("flash_fwd__"):
        parts = s.split("__")[1:]
        if parts and parts[-1] == "causal":
            parts = parts[:-1]
        try:
            dtype, d, bq, bkv, w = parts[:5]
            return _from_flags(dtype, int(d[1:]), int(bq[1:]), int(bkv[2:]), int(w[1:]), parts[5:], text)
        except (ValueError, IndexError) as exc:
            if "unknown flag" in str(exc) or "invalid kernel config" in str(exc):
                raise
            raise ValueError(f"cannot parse kernel symbol {text!r}") from exc
    raise ValueError(
        f"cannot parse kernel config {text!r}; expected e.g. "
        "'(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax'"
    )


# --------------------------------------------------------------------------------------------------
# Defaults


@lru_cache(maxsize=4096)
def default_config(
    dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, arch: str = "sm_80"
) -> KernelConfig:
    """The configuration used when the caller names none and no autotuned winner exists.

    On Hopper (``arch`` sm_90 / sm_90a) that is a wgmma config (:func:`_hopper_default`); on any other GPU
    the portable sm80 kernel, chosen as follows.

    Chosen from two H200 autotuning sweeps on different machines (docs/kernel-log.md,
    benchmarks/results/h200-2026-11-22-autotune*.json). The tile shape is what carries from one machine to
    the next; the fragment-loading variants rank differently on different machines of the same model
    (within about 5%), so the choices below are the ones that held up on both sweeps and in the full
    benchmark runs. The reasons:
    * head_dim 128: 128 query rows over 4 warps, so each warp owns two 16-row mma tiles and every K/V
      fragment read from shared memory feeds two mma instructions (shared-memory bandwidth is what limits
      mma.sync on Hopper). The O accumulator (32 x 128 fp32) and S (32 x 64) then need 252 of the 255
      registers, which is why the K/V tile stops at 64 keys. It won all 12 shapes.
    * head_dim 64: O is half as large, so one 16-row tile per warp with a 128-key K/V tile and Q resident
      in registers keeps the most independent mma work per warp at medium lengths. Long sequences (where
      the per-block prologue is amortised) prefer two tiles per warp, 128 x 64; short causal ones prefer
      64 x 64 tiles, whose finer diagonal wastes less work on masked keys.
    * head_dim 256: O alone is 128 registers for 16 rows; 64 x 64 tiles with single-slice fragment loads
      are what fits without spilling, and without the second fragment buffer the compiler schedules the
      loads as well at fewer registers.
    * head_dim 192 (not a tuned size): its 24-chunk rows do not nest with 128 threads, so the copy loops
      need more registers; 32-key tiles keep it spill-free.
    """
    d = padded_head_dim(head_dim)
    n = max(seqlen_q, seqlen_k)
    if arch in ("sm_90", "sm_90a"):
        return _hopper_default(dtype, d, n, causal)
    if d == 64:
        if n >= 12288 or (not causal and n >= 6144):
            return KernelConfig(dtype, 64, 128, 64, 4, q_frags=0, k_frags=1, v_frags=1, double_buffer=False)
        if causal and n <= 1536:
            return KernelConfig(dtype, 64, 64, 64, 4, q_frags=0, k_frags=1, v_frags=1, double_buffer=False)
        return KernelConfig(dtype, 64, 64, 128, 4, q_frags=0, k_frags=0, v_frags=1)
    if d == 128:
        return KernelConfig(dtype, 128, 128, 64, 4, q_frags=4, k_frags=4, v_frags=1)
    if d == 192:
        return KernelConfig(dtype, 192, 64, 32, 4, q_frags=1, k_frags=1, v_frags=1)
    return KernelConfig(dtype, 256, 64, 64, 4, q_frags=1, k_frags=1, v_frags=1, double_buffer=False)


def _hopper_default(dtype: str, d: int, n: int, causal: bool) -> KernelConfig:
    """The wgmma config for head_dim ``d`` at sequence length ``n`` (the longer of q and k).

    From the H100 autotuning sweep of docs/kernel-log.md (step 17, every point within 5% of the sweep's
    winner). Two shapes of block compete: one warpgroup (64 query rows, two or three blocks per SM) and
    two warpgroups sharing each K/V tile (128 rows, one block of 8 warps per SM), which halves the K/V
    copies per query row but makes both warpgroups meet at every barrier.
    * head_dim 256: two warpgroups and a 2-deep ring of 64-key tiles everywhere: its K/V tiles are the
      largest, so sharing them pays most (5-10% over one warpgroup from 2k on).
    * head_dim 64: the same 128 x 64 two-stage block without a mask. Causal blocks differ in length, and
      one warpgroup per block balances them better: 64 x 64 tiles in a 2-deep ring up to 4k (less work
      wasted on the diagonal), 128-key tiles with one buffer each beyond (half the barriers per key).
    * head_dim 128: one warpgroup with 128-key tiles and one K and one V buffer (the 64 x 128 S
      accumulator is 64 registers; a ring costs a block per SM); at 512 keys, and causal up to 1k, the
      blocks are so short that 32-key tiles in a 2-deep ring start computing sooner and win by 5-13%.
    * head_dim 192 (not a tuned size): its 24-chunk rows do not nest with 128 threads, so the copy loops
      need more registers and 64-key tiles spill; 32-key tiles in a 2-deep ring fit.
    """
    if d == 64:
        if causal:
            return wgmma_config(dtype, 64, 64, 64, 2) if n <= 4096 else wgmma_config(dtype, 64, 64, 128, 1)
        return wgmma_config(dtype, 64, 128, 64, 2)
    if d == 128:
        if n <= 512 or (causal and n <= 1024):
            return wgmma_config(dtype, 128, 64, 32, 2)
        return wgmma_config(dtype, 128, 64, 128, 1)
    if d == 192:
        return wgmma_config(dtype, 192, 64, 32, 2)
    return wgmma_config(dtype, 256, 128, 64, 2)


# --------------------------------------------------------------------------------------------------
# The backward kernel family (csrc/kernels/sm80/bwd/bwd_kernel.cuh)


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time shape of the backward kernels.

    The dK/dV kernel gives each thread block ``block_kv`` keys (``block_kv / num_warps`` per warp, whole
    16-row mma tiles) and walks the queries ``block_q`` at a time. ``split`` > 1 divides the dK/dV/dQ
    columns among that many blocks, each recomputing S and dP over the whole head_dim: for head dims whose
    two accumulators would not fit the registers. ``double_buffer`` prefetches the next Q/dO tile during the
    current step. The deterministic dQ kernel uses ``block_q`` rows with one warp per 16 of them.

    ``wgmma``: the Hopper dK/dV kernel (csrc/kernels/sm90/bwd, sm_90a): two warpgroups of 64 keys, Q/dO
    double-buffered, atomic dQ only (deterministic mode, key ranges and dropout run the sm80 kernels).
    """

    dtype: str
    head_dim: int
    block_q: int
    block_kv: int
    num_warps: int
    split: int = 1
    double_buffer: bool = False
    wgmma: bool = False

    def __post_init__(self) -> None:
        errors = bwd_validity_errors(self)
        if errors:
            raise ValueError(f"invalid backward config {self.name()}: " + "; ".join(errors))

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def dq_threads(self) -> int:
        return 32 * (self.block_q // 16)

    @property
    def dq_block_kv(self) -> int:
        """K/V rows per step of the deterministic dQ kernel (DqCfg in the kernel)."""
        return 32 if self.head_dim > 128 else min(self.block_kv, 64)

    @property
    def smem_bytes(self) -> int:
        nb = 2 if self.double_buffer else 1
        d, bq, bkv = self.head_dim, self.block_q, self.block_kv
        # K, V; Q and dO per buffer; the dS tile; LSE and delta per buffer (+1 KB to align the wgmma tiles).
        return 4 * bkv * d + 4 * nb * bq * d + 2 * bkv * bq + 8 * nb * bq + (1024 if self.wgmma else 0)

    @property
    def dq_smem_bytes(self) -> int:
        return 4 * self.block_q * self.head_dim + 4 * self.dq_block_kv * self.head_dim

    def name(self) -> str:
        return (
            f"bwd_{self.dtype}_d{self.head_dim}_q{self.block_q}_kv{self.block_kv}_w{self.num_warps}"
            f"_s{self.split}" + ("_buffer" if self.double_buffer else "") + ("_wgmma" if self.wgmma else "")
        )

    def __str__(self) -> str:
        return self.name()

    def symbol(self, kernel: str, causal: bool = False, ranged: bool = False, dropout: bool = False) -> str:
        """Entry point of one kernel of the family: ``pre``, ``dkdv`` (atomic dQ), ``dkdv_det`` or ``dq``."""
        if kernel not in ("pre", "dkdv", "dkdv_det", "dq"):
            raise ValueError(f"kernel must be pre, dkdv, dkdv_det or dq; got {kernel!r}")
        base = "flash_" + self.name() + "__" + kernel
        if kernel == "pre":
            return base
        return (
            base
            + ("__causal" if causal else "")
            + ("__ranged" if ranged else "")
            + ("__dropout" if dropout else "")
        )

    def replace(self, **changes) -> BwdConfig:
        return dataclasses.replace(self, **changes)

    def cpp_struct(self, struct_name: str = "Cfg") -> str:
        fields = [
            ("kIsBF16", "bool", _b(self.dtype == "bf16")),
            ("kHeadDim", "int", str(self.head_dim)),
            ("kBlockQ", "int", str(self.block_q)),
            ("kBlockKV", "int", str(self.block_kv)),
            ("kNumWarps", "int", str(self.num_warps)),
            ("kSplit", "int", str(self.split)),
            ("kDoubleBuffer", "bool", _b(self.double_buffer)),
            # load_tile (shared with the forward) reads these two.
            ("kSwizzle", "bool", "true"),
            ("kAsyncCopy", "bool", "true"),
            ("kWgmma", "bool", _b(self.wgmma)),
        ]
        return _cpp_struct(struct_name, fields)


def bwd_validity_errors(cfg: BwdConfig) -> list[str]:
    """Why ``cfg`` cannot be compiled (empty when it can); the kernel static_asserts the tile rules too."""
    errors = []
    if cfg.dtype not in DTYPES:
        errors.append(f"dtype must be one of {DTYPES}")
    if cfg.head_dim not in HEAD_DIMS:
        errors.append(f"head_dim must be one of {HEAD_DIMS}")
    if cfg.block_q not in (64, 128):
        errors.append("block_q must be 64 or 128 (the dS tile's swizzle needs rows of 64 elements or more)")
    if cfg.num_warps not in (2, 4, 8):
        errors.append("num_warps must be 2, 4 or 8")
    elif cfg.block_kv % (16 * cfg.num_warps) or cfg.block_kv > 128:
        errors.append("block_kv must be a multiple of 16 * num_warps, at most 128")
    if cfg.split < 1 or cfg.head_dim % cfg.split or (cfg.head_dim // cfg.split) % 64:
        errors.append("head_dim / split must be a whole multiple of 64 (slices move whole swizzle groups)")
    elif cfg.num_warps in (2, 4, 8) and cfg.block_q in (64, 128):
        wqm = min(cfg.num_warps, cfg.block_q // 16)
        if (cfg.head_dim // cfg.split // (cfg.num_warps // wqm)) % 64:
            errors.append(
                "each warp's dQ columns (head_dim / split / column groups) must be a multiple of 64"
            )
    if cfg.wgmma and (
        cfg.num_warps != 8
        or cfg.block_kv != 128
        or (cfg.block_q, cfg.head_dim) not in ((128, 64), (64, 128))
        or cfg.split != 1
        or not cfg.double_buffer
    ):
        errors.append(
            "wgmma backward configs are two warpgroups of 64 keys (num_warps 8, block_kv 128), double "
            "buffered, unsplit, with block_q 128 at head_dim 64 or 64 at head_dim 128 (dQ's split)"
        )
    if not errors and cfg.smem_bytes > 227 * 1024:
        errors.append("shared memory exceeds the sm_90 limit of 232448")
    return errors


#: The backward configs by head dim: the largest tiles that compile without spilling (docs/kernel-log.md).
_BWD_DEFAULTS = {
    64: dict(block_q=128, block_kv=128, num_warps=8, split=1, double_buffer=False),
    128: dict(block_q=64, block_kv=128, num_warps=8, split=1, double_buffer=True),
    192: dict(block_q=64, block_kv=64, num_warps=4, split=3, double_buffer=False),
    256: dict(block_q=64, block_kv=64, num_warps=4, split=2, double_buffer=False),
}


def default_bwd_config(dtype: str, head_dim: int, arch: str = "sm_80") -> BwdConfig:
    """The backward config for a problem's dtype and head_dim (padded up to a compiled size). On Hopper
    (``arch`` sm_90) head dims 64 and 128 get the wgmma dK/dV kernel; the larger ones keep the sm80 kernel
    (two head_dim-wide fp32 accumulators of 64 key rows would not fit a warpgroup's registers)."""
    d = padded_head_dim(head_dim)
    if arch in ("sm_90", "sm_90a") and d in (64, 128):
        return BwdConfig(dtype, d, 128 if d == 64 else 64, 128, 8, 1, True, wgmma=True)
    return BwdConfig(dtype, d, **_BWD_DEFAULTS[d])


def parse_bwd_config(text: str | BwdConfig) -> BwdConfig:
    """The inverse of :meth:`BwdConfig.name`."""
    if isinstance(text, BwdConfig):
        return text
    m = re.fullmatch(r"bwd_(fp16|bf16)_d(\d+)_q(\d+)_kv(\d+)_w(\d+)_s(\d+)(_buffer)?(_wgmma)?", str(text))
    if not m:
        raise ValueError(f"not a backward config name: {text!r}")
    dt, d, bq, bkv, w, s, buf, wg = m.groups()
    return BwdConfig(dt, int(d), int(bq), int(bkv), int(w), int(s), buf is not None, wg is not None)
