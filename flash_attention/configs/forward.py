"""The forward kernel family's configuration: the one source of truth for a forward kernel's shape.

A :class:`KernelConfig` names one instantiation of a forward kernel (the portable sm80 kernel, or the
Hopper wgmma kernel when ``wgmma`` is set). From it come

* a canonical short name (``str(cfg)`` / :meth:`KernelConfig.name`) that :func:`parse_config` turns back
  into an equal object, e.g.
  ``(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax``;
* the C identifier used as the kernel's symbol (:meth:`KernelConfig.symbol`), which also parses back;
* the C++ ``struct`` of named compile-time constants the kernel template is instantiated with
  (:meth:`KernelConfig.cpp_struct`), never positional template arguments;
* the validity rules (:func:`validity_errors`), mirrored one for one by ``static_assert`` in
  ``csrc/include/fa/config_check.h``;
* the part of the JIT cache key that depends on the configuration (:meth:`KernelConfig.key`).

Nothing about the problem shape (batch, heads, sequence lengths) is compiled in: only the padded head
dimension and the tile.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .common import DTYPES, FP8_DTYPE, HEAD_DIMS, SMEM_LIMIT_SM80, SMEM_LIMIT_SM90, cpp_struct

__all__ = [
    "KernelConfig",
    "estimated_registers",
    "parse_config",
    "smem_bytes",
    "validity_errors",
    "wgmma_config",
    "ws_config",
]

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


@dataclass(frozen=True)
class KernelConfig:
    """One forward-kernel instantiation.

    Attributes:
        dtype: ``"fp16"`` or ``"bf16"`` (inputs and output; the softmax is always fp32), or ``"e4m3"``
            (FP8 inputs and P, output bf16; the persistent warp-specialized forward at head_dim 128 over
            128- or 256-key tiles: docs/fp8-study.md).
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
        warp_specialized: wgmma only: the warp-specialized Hopper kernel (csrc/kernels/sm90/fwd_ws): a
            producer warpgroup issues TMA loads into the ``stages``-deep K/V ring while ``block_q / 64``
            consumer warpgroups compute, so ``num_warps`` is ``4 + block_q / 16``. Named ``wgmma+ws+...``.
        overlap: warp_specialized only: intra-warpgroup overlap, S_{j+1} = Q K_{j+1}^T and O += P_j V_j are
            issued together and the softmax of S_{j+1} runs while P_j V_j occupies the tensor cores.
            Named ``...+overlap``.
        pingpong: warp_specialized with two consumer warpgroups only: the two take turns issuing their
            matrix products (named barriers), so one's softmax runs while the other's products occupy the
            tensor cores instead of both softmaxes falling together. Named ``...+pingpong``.
        persistent: warp_specialized only: one block per multiprocessor, each looping over query tiles,
            its K/V ring running on from one tile to the next. Named ``...+persistent``.
        tma_store: warp_specialized only: each consumer warpgroup hands its staged 64 output rows to the TMA
            unit (one store per 64-column panel, through a tensor map of O) instead of copying them out
            itself, and goes on to its next tile while the copy runs. Named ``...+tma_store``.
        tile_overlap: persistent with overlap and without ping-pong only: each consumer warpgroup issues the
            next tile's first S = Q K^T before this tile's epilogue, so the tensor cores work through the
            epilogue and the next tile starts with its first product done. Named ``...+tile_overlap``.
        exp_poly: warp_specialized only, 0-8: P's exponentials of the 8-key column groups n of a tile with
            n % 8 below it computed by a polynomial on the FMA pipe (fa/ptx.cuh exp2_poly) instead of the
            SFU, whose 16 a clock per multiprocessor match the tensor cores' time at head_dim 64 (kernel log
            139): N eighths of them where block_kv is a multiple of 64, a little more otherwise (176 keys at
            N = 4: 12 of 22 groups). Named ``...+ep_N``.
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
    warp_specialized: bool = False
    overlap: bool = False
    pingpong: bool = False
    persistent: bool = False
    tma_store: bool = False
    tile_overlap: bool = False
    # v's and the output's head_dim where it is not head_dim (0: head_dim's; the warp-specialized forward
    # only, a multiple of 64 below head_dim: DeepSeek's 192/128). Named ``...+dv_N``.
    head_dim_v: int = 0
    exp_poly: int = 0

    def __post_init__(self) -> None:
        if self.head_dim_v == self.head_dim:  # (one canonical config per problem)
            object.__setattr__(self, "head_dim_v", 0)
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
    def compute_warps(self) -> int:
        """The warps that own query rows: all but a warp-specialized block's producer warpgroup."""
        return self.num_warps - 4 if self.warp_specialized else self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_q // self.compute_warps

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self)

    @property
    def value_dim(self) -> int:
        """The head_dim of V and of the output (the kernel's kHeadDimV)."""
        return self.head_dim_v or self.head_dim

    # ----------------------------------------------------------------------------------------------
    # Names
    def flags(self) -> list[str]:
        if self.wgmma:
            return (
                ["wgmma"]
                + (["ws"] if self.warp_specialized else [])
                + (["overlap"] if self.overlap else [])
                + (["pingpong"] if self.pingpong else [])
                + (["persistent"] if self.persistent else [])
                + (["tma_store"] if self.tma_store else [])
                + (["tile_overlap"] if self.tile_overlap else [])
                + ([f"stages_{self.stages}"] if self.stages != 1 else [])
                + ([f"dv_{self.head_dim_v}"] if self.head_dim_v else [])
                + ([f"ep_{self.exp_poly}"] if self.exp_poly else [])
            )
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
            # (e4m3: the 16-bit type, of the output, is bf16)
            ("kIsBF16", "bool", self.dtype in ("bf16", FP8_DTYPE)),
            ("kHeadDim", "int", self.head_dim),
            ("kHeadDimV", "int", self.value_dim),
            ("kBlockQ", "int", self.block_q),
            ("kBlockKV", "int", self.block_kv),
            ("kNumWarps", "int", self.num_warps),
            ("kAsyncCopy", "bool", self.async_copy),
            ("kEager", "bool", self.eager),
            ("kSwizzle", "bool", self.swizzle),
            ("kQFrags", "int", self.q_frags),
            ("kKFrags", "int", self.k_frags),
            ("kVFrags", "int", self.v_frags),
            ("kDoubleBuffer", "bool", self.double_buffer),
            ("kOptSoftmax", "bool", self.opt_softmax),
            ("kReverseKV", "bool", self.reverse_kv),
            ("kWgmma", "bool", self.wgmma),
            ("kStages", "int", self.stages),
            ("kWarpSpecialized", "bool", self.warp_specialized),
            ("kOverlap", "bool", self.overlap),
            ("kPingpong", "bool", self.pingpong),
            ("kPersistent", "bool", self.persistent),
            ("kTmaStore", "bool", self.tma_store),
            ("kTileOverlap", "bool", self.tile_overlap),
            ("kExpPoly", "int", self.exp_poly),
            ("kProducerRegs", "int", register_split(self)[0]),
            ("kConsumerRegs", "int", register_split(self)[1]),
        ]
        if self.dtype == FP8_DTYPE:
            # Only e4m3 configs name it: the kernels read it through fa::CfgIsE4M3 (false when absent), so
            # every 16-bit build's source is what it was.
            fields.append(("kIsE4M3", "bool", True))
        return cpp_struct(struct_name, fields)


def wgmma_config(
    dtype: str, head_dim: int, block_q: int, block_kv: int, stages: int = 1, *, check: bool = True
) -> KernelConfig:
    """The Hopper (wgmma) config with ``block_q / 64`` warpgroups and a ``stages``-deep K/V copy ring
    (``check=False``: without the validity check, as :meth:`KernelConfig.unchecked`)."""
    make = KernelConfig if check else KernelConfig.unchecked
    return make(dtype, head_dim, block_q, block_kv, block_q // 16, wgmma=True, stages=stages, **_WGMMA_FIXED)


def register_split(cfg: KernelConfig) -> tuple[int, int]:
    """The registers per thread of a warp-specialized block's producer and consumer warpgroups after
    ``setmaxnreg``; (0, 0) where the block keeps its even split.

    The block is compiled for R = 65536 / threads registers per thread (one block per SM) and launched
    with threads x R of them: that allocation is the pool ``setmaxnreg.inc`` draws from, not the SM's 64K
    (at 384 threads R = 168, a pool of 64512). A split asking for more than the pool hangs the block: its
    consumers wait forever for registers nobody frees (measured: 32 + 240 at 384 threads). So 128 producer
    + 128 NC consumer registers per thread must fit threads x R, in multiples of 8 within [24, 256]. The
    producer holds only addresses and counters and gives the rest to the consumers' accumulators; a
    persistent producer's tile loop needs 32 (at 24 ptxas spilled 16 bytes of it), which leaves its
    consumers 232 at two warpgroups. One consumer warpgroup already gets 255 at 256 threads."""
    if not cfg.warp_specialized or cfg.block_q <= 64:
        return (0, 0)
    if cfg.block_q == 128:
        # pool 384 x 168 = 64512: 128 * 24 + 256 * 240 = 64512, 128 * 32 + 256 * 232 = 63488
        return (32, 232) if cfg.persistent else (24, 240)
    return (32, 160)  # three: pool 512 x 128 = 65536 = 128 * 32 + 384 * 160


def register_roles(cfg: KernelConfig) -> str:
    """What a block's register count means per role, for the report and ``sanity``: "" for a kernel without
    roles, else the warp-specialized split (the compiler reports only the launch-time allocation)."""
    if not cfg.warp_specialized:
        return ""
    producer, consumer = register_split(cfg)
    if not producer:
        return "producer and consumer warpgroups share the launch allocation"
    return f"setmaxnreg: producer warpgroup {producer}, consumer warpgroups up to {consumer}"


def block_registers(cfg: KernelConfig) -> int:
    """The registers per thread a warp-specialized block is compiled for (launch bounds of one block per
    multiprocessor), and the most its consumers may use when there is no reallocation."""
    return min(255, 65536 // cfg.threads // 8 * 8)


def ws_config(
    dtype: str,
    head_dim: int,
    block_q: int,
    block_kv: int,
    stages: int = 2,
    *,
    overlap: bool = False,
    pingpong: bool = False,
    persistent: bool = False,
    tma_store: bool = False,
    tile_overlap: bool = False,
    exp_poly: int = 0,
    check: bool = True,
) -> KernelConfig:
    """The warp-specialized Hopper config: a producer warpgroup and ``block_q / 64`` consumer warpgroups
    around a ``stages``-deep TMA ring of ``block_kv``-key tiles, with or without intra-warpgroup
    ``overlap`` (``check=False``: unchecked); the other flags are :class:`KernelConfig`'s."""
    make = KernelConfig if check else KernelConfig.unchecked
    warps = 4 + block_q // 16
    return make(
        dtype,
        head_dim,
        block_q,
        block_kv,
        warps,
        wgmma=True,
        stages=stages,
        warp_specialized=True,
        overlap=overlap,
        pingpong=pingpong,
        persistent=persistent,
        tma_store=tma_store,
        tile_overlap=tile_overlap,
        exp_poly=exp_poly,
        **_WGMMA_FIXED,
    )


# --------------------------------------------------------------------------------------------------
# Validity rules. Each rule has a twin static_assert in fwd_kernel.cuh (same wording); the test
# tests/test_configs.py compiles the kernel for every candidate and checks both sides agree.


def validity_errors(cfg: KernelConfig) -> list[str]:
    """Every rule ``cfg`` breaks, as readable sentences (empty when valid)."""
    e: list[str] = []
    if cfg.dtype not in (*DTYPES, FP8_DTYPE):
        e.append(f"dtype must be one of {(*DTYPES, FP8_DTYPE)}")
    if cfg.dtype == FP8_DTYPE and not (
        cfg.warp_specialized
        and cfg.persistent
        and not cfg.head_dim_v
        and (
            (cfg.head_dim in (64, 128) and cfg.block_kv in (128, 256))
            or (cfg.head_dim == 256 and cfg.block_kv == 64)
        )
    ):
        # (V^T's rows are block_kv keys of 1 byte: whole 128-byte swizzle panels, or one 64-byte panel of
        # the 64-byte swizzle at 64 keys (kVtPanelBytes); persistent: the bf16 output's own tile, which a
        # 1-byte Q tile cannot stage; head_dim 64's Q and K rows are 64 bytes, loaded and read with the
        # 64-byte swizzle (sm90/fwd_ws/pipeline.cuh kQKPanelBytes); head_dim 256 only on 64-key tiles: its
        # 128-key builds spilled 352-516 bytes, NVRTC 13.0, docs/fp8-study.md)
        e.append(
            "e4m3 needs the persistent warp-specialized forward, head_dim 64 or 128 on block_kv 128 or 256, "
            "or head_dim 256 on block_kv 64, and v of q's head_dim"
        )
    if cfg.head_dim not in HEAD_DIMS:
        e.append(f"head_dim must be one of {HEAD_DIMS}")
    if cfg.head_dim_v and not (
        cfg.warp_specialized and cfg.head_dim_v % 64 == 0 and 64 <= cfg.head_dim_v < cfg.head_dim
    ):
        # (fa/config_check.h says the same; O is staged in the Q tile, so it may not be wider than Q)
        e.append("head_dim_v other than head_dim needs warp_specialized, a multiple of 64 below head_dim")
    if not 0 <= cfg.exp_poly <= 8:
        e.append("exp_poly counts eighths of the exponentials: 0 to 8")
    elif cfg.exp_poly and not cfg.warp_specialized:
        e.append("exp_poly is the warp-specialized forward's (fwd_ws)")
    if cfg.warp_specialized:
        if not cfg.wgmma or cfg.stages < 2 or cfg.num_warps != 4 + cfg.block_q // 16:
            e.append(
                "warp_specialized needs wgmma, stages >= 2 and num_warps = 4 + block_q / 16 (a producer "
                "warpgroup besides the consumers)"
            )
    if cfg.overlap and not cfg.warp_specialized:
        e.append("overlap needs warp_specialized")
    if cfg.pingpong and not (cfg.warp_specialized and cfg.block_q == 128):
        e.append("pingpong needs warp_specialized with two consumer warpgroups (block_q 128)")
    if cfg.persistent and not cfg.warp_specialized:
        e.append("persistent needs warp_specialized")
    if cfg.tma_store and not cfg.warp_specialized:
        e.append("tma_store needs warp_specialized")
    if cfg.tile_overlap and not (cfg.persistent and cfg.overlap and not cfg.pingpong):
        e.append("tile_overlap needs persistent and overlap, without pingpong")
    warps = cfg.compute_warps
    if warps not in (1, 2, 4, 8) and not (cfg.warp_specialized and warps == 12):
        e.append("num_warps must be 1, 2, 4 or 8 (12 consumer warps beside a warp-specialized producer)")
        return e
    if cfg.wgmma:
        if warps not in (4, 8, 12) or cfg.block_q != 16 * warps:
            e.append(
                "wgmma needs num_warps 4 or 8 (12 warp-specialized) and block_q = 16 * num_warps (each "
                "warpgroup of 4 warps owns 64 query rows)"
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
    if cfg.block_q % (16 * warps) != 0:
        e.append("block_q must be a multiple of 16 * num_warps (each warp owns whole 16-row mma tiles)")
    elif cfg.block_q // warps > 64:
        e.append(
            "block_q / num_warps must be at most 64 (the accumulators of more rows exceed the registers)"
        )
    if cfg.warp_specialized:
        if cfg.block_kv % 16 or not 16 <= cfg.block_kv <= 256:
            e.append("block_kv of a warp-specialized config must be a multiple of 16 from 16 to 256")
    elif cfg.block_kv not in (16, 32, 64, 128, 256):
        e.append("block_kv must be 16, 32, 64, 128 or 256")
    if cfg.eager and not cfg.async_copy:
        e.append("eager loading needs async_copy (a plain load would stall the warp that issues it)")
    if cfg.head_dim in HEAD_DIMS:
        dk = cfg.head_dim // 16
        if cfg.q_frags < 0 or (cfg.q_frags and dk % cfg.q_frags):
            e.append("q_frags must be 0 or divide head_dim / 16")
        if cfg.k_frags < 0 or (cfg.k_frags and dk % cfg.k_frags):
            e.append("k_frags must be 0 or divide head_dim / 16")
    if cfg.block_kv % 16 == 0 and cfg.block_kv > 0:
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
    """Dynamic shared memory of one block: one Q tile, one K tile and one V tile (2-byte elements; e4m3's 1,
    its output bf16).

    One K and one V buffer suffice even with eager loading: V_j lands while S_j = Q K_j^T is computed,
    and K_{j+1} lands in K's buffer (free once S_j is done) while P_j V_j is computed. A wgmma config
    asks for 1 KB more: its tiles must start on a 1024-byte boundary (where the 128-byte swizzle repeats)
    and the dynamic shared memory window is only guaranteed 16-byte alignment.
    """
    q = cfg.block_q * (2 if cfg.tile_overlap else 1)  # tile_overlap: two Q buffers (fwd_ws)
    kv = cfg.block_kv * cfg.stages  # (a K and a V tile per stage: K of head_dim, V of value_dim)
    barriers = 256 if cfg.warp_specialized else 0  # the ring's mbarriers (fwd_ws: 8 bytes each)
    staging = cfg.block_q if cfg.persistent else 0  # a persistent block's output tile (fwd_ws), 2-byte
    d, dv = cfg.head_dim, cfg.value_dim
    inputs = (1 if cfg.dtype == FP8_DTYPE else 2) * (d * q + (d + dv) * kv)
    return inputs + 2 * dv * staging + (1024 if cfg.wgmma else 0) + barriers


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
        # One 16-row slice per warp; P (16-bit pairs) lives beside S while O += P V is issued. (For a
        # warp-specialized block: a consumer thread's.)
        return (cfg.value_dim + cfg.block_kv) // 2 + cfg.block_kv // 4 + 24  # (O: value_dim wide)
    o_acc = rows * cfg.head_dim // 32
    s_acc = rows * cfg.block_kv // 32
    q_resident = rows * cfg.head_dim // 64 if cfg.q_frags == 0 else 0
    return o_acc + s_acc + q_resident + 24


# --------------------------------------------------------------------------------------------------
# Parsing

_NAME_RE = re.compile(
    r"^\(\s*(?P<dtype>FP16|BF16|E4M3)\s*,\s*(?P<d>\d+)\s*,\s*(?P<bq>\d+)\s*,\s*(?P<bkv>\d+)\s*,\s*(?P<w>\d+)\s*\)\s*:\s*"
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
        stages, ws, overlap, pingpong, persistent, tma_store, tile_overlap = (
            1,
            False,
            False,
            False,
            False,
            False,
            False,
        )
        head_dim_v = exp_poly = 0
        for f in flags[1:]:
            m = re.fullmatch(r"stages_(\d+)", f)
            dv = re.fullmatch(r"dv_(\d+)", f)
            ep = re.fullmatch(r"ep_([1-8])", f)
            if f == "ws":
                ws = True
            elif f == "overlap":
                overlap = True
            elif f == "pingpong":
                pingpong = True
            elif f == "persistent":
                persistent = True
            elif f == "tma_store":
                tma_store = True
            elif f == "tile_overlap":
                tile_overlap = True
            elif m:
                stages = int(m[1])
            elif dv:
                head_dim_v = int(dv[1])
            elif ep:
                exp_poly = int(ep[1])
            else:
                raise ValueError(f"unknown flag {f!r} in kernel config name {text!r}")
        return KernelConfig(
            dtype.lower(),
            d,
            bq,
            bkv,
            w,
            wgmma=True,
            stages=stages,
            warp_specialized=ws,
            overlap=overlap,
            pingpong=pingpong,
            persistent=persistent,
            tma_store=tma_store,
            tile_overlap=tile_overlap,
            head_dim_v=head_dim_v,
            exp_poly=exp_poly,
            **_WGMMA_FIXED,
        )
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
