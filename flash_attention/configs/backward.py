"""The backward kernel family's configuration (csrc/kernels/sm80/bwd and, with ``wgmma``, sm90/bwd)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .common import DTYPES, HEAD_DIMS, SMEM_LIMIT_SM90, cpp_struct

__all__ = [
    "WS_REGISTER_SPLIT",
    "BwdConfig",
    "bwd_register_roles",
    "bwd_validity_errors",
    "hopper_bwd_config",
    "parse_bwd_config",
]

#: Registers per thread of the warp-specialized backward's producer and consumer warpgroups after
#: setmaxnreg. The block (384 threads, one per multiprocessor) is launched with 384 x 168 = 64512:
#: 128 x 24 + 256 x 240 = 64512. The producer copies with a rolled loop (fa/copy.cuh, load_tile_rolled) so 24
#: hold its addresses; with the unrolled copy it spilled 300-640 bytes at any split up to 96 / 200. The
#: consumers' dK, dV, S^T, dP^T and dQ part fit 240 without spills (at 232: 12 bytes, head_dim 64 causal).
WS_REGISTER_SPLIT = (24, 240)
#: The same kernel's deterministic form (kDeterministic) launches a fourth warpgroup for its two dQ writers
#: (fa/dq_turns.cuh): 512 threads of 128 registers, 128 x 24 (copies) + 128 x 24 (writers) + 256 x 232
#: (consumers) = 65536. Rejected: the writers in the producer warpgroup (64 copying threads), which needs
#: 56 / 224 there (at 40 / 232 the producer spilled 100-300 bytes), and at 224 ptxas serialised the
#: consumers' wgmma at head_dim 128 and with dropout at 64 (measured 0.85-0.93x of the atomic mode's
#: forward+backward at 128 that way, docs/kernel-log.md step 76).
DET_WS_REGISTER_SPLIT = (24, 24, 232)
#: With dQ's writer warps in the producer warpgroup (dq_writer, kernel log 133): 128 x 40 + 256 x 232 = 64512.
#: At 24 / 240 the producer's region spilled 60-88 bytes with the writers' loop in it; the builds that keep
#: the consumers' reductions (dropout, a score function of non-unit gradient) keep 24 / 240.
WRITER_WS_REGISTER_SPLIT = (40, 232)
#: The wide backward's deterministic form (head_dim 192/256, csrc/kernels/sm90/bwd_wide) adds a third
#: warpgroup for its dQ writer: 384 x 168 launched, 128 x 24 (writer) + 256 x 240 (the two computing
#: warpgroups, which use up to 255 in the atomic form's 256-thread block).
DET_WIDE_REGISTER_SPLIT = (24, 240)


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time shape of the backward kernels.

    The dK/dV kernel gives each thread block ``block_kv`` keys (``block_kv / num_warps`` per warp, whole
    16-row mma tiles) and walks the queries ``block_q`` at a time. ``split`` > 1 divides the dK/dV/dQ
    columns among that many blocks, each recomputing S and dP over the whole head_dim: for head dims whose
    two accumulators would not fit the registers. ``double_buffer`` prefetches the next Q/dO tile during the
    current step. The deterministic dQ kernel uses ``block_q`` rows with one warp per 16 of them.

    ``wgmma``: the Hopper dK/dV kernel (csrc/kernels/sm90/bwd, sm_90a): two warpgroups of 64 keys, Q/dO
    double-buffered, atomic dQ only (deterministic mode, key ranges and dropout run the sm80 kernels). At
    head_dim 192 and 256 (:attr:`wide`) its wide form (csrc/kernels/sm90/bwd_wide): 64 keys per block,
    which both warpgroups see, one keeping dV and the other dK; it has key-range and dropout builds and a
    deterministic kernel (dQ added in a fixed order by a third warpgroup's writer).
    ``warp_specialized`` (with ``wgmma``, ``num_warps`` 12): its warp-specialized form
    (csrc/kernels/sm90/bwd_ws): a producer warpgroup copies Q/dO into two slots while the two consumer
    warpgroups compute, and dQ leaves through bulk reduce-adds. ``tma_loads`` (the warp-specialized kernels,
    bwd_ws and bwd_wide_ws): Q and dO arrive by TMA from tensor maps the call encodes (BwdTmaParams),
    issued by one producer thread, instead of each producer thread's cp.async rows (kernel log 130).
    ``dq_writer`` (bwd_ws with ``tma_loads``): dQ's bulk reductions are issued by two writer warps of the
    producer warpgroup instead of each computing warpgroup's first thread (kernel log 133); the builds with
    dropout, a score function of non-unit gradient or the deterministic kernel keep the consumers' form.
    ``exp_poly`` (bwd_ws, 0-8): that many eighths of P's exponentials are computed by a polynomial on the
    FMA pipe (fa/ptx.cuh exp2_poly) instead of the SFU's MUFU.EX2, whose 16 per clock per multiprocessor
    bound the exponentials' phase at 512 cycles a d128 step (kernel log 138).
    ``head_dim_v`` (bwd_wide_ws at head_dim 192: 64 or 128; 0 is head_dim): v's own head_dim, read as it is
    (V, dO and dV at that width, dP's and dV's products narrower) instead of v, the output and dO padded to
    q's (docs/value-head-dim-study.md section 7).
    """

    dtype: str
    head_dim: int
    block_q: int
    block_kv: int
    num_warps: int
    split: int = 1
    double_buffer: bool = False
    wgmma: bool = False
    warp_specialized: bool = False
    tma_loads: bool = False
    dq_writer: bool = False
    exp_poly: int = 0
    head_dim_v: int = 0

    #: Q/dO slots of the warp-specialized kernel's ring (a third does not fit 227 KB at head_dim 64 or 128).
    WS_STAGES = 2

    def __post_init__(self) -> None:
        errors = bwd_validity_errors(self)
        if errors:
            raise ValueError(f"invalid backward config {self.name()}: " + "; ".join(errors))

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    def kernel_threads(self, kind: str) -> int:
        """Threads of entry point ``kind`` (``dkdv``, ``dkdv_det``, ...) of the per-mask kernels: the
        deterministic kernels of the warp-specialized and wide forms have one more warpgroup, for their dQ
        writers (DET_WS_REGISTER_SPLIT, DET_WIDE_REGISTER_SPLIT)."""
        if kind == "dkdv_det" and (self.warp_specialized or self.wide) and not self.wide_ws:
            return self.threads + 128
        return self.threads

    @property
    def wide(self) -> bool:
        """Whether this is the wide-head-dim form of the Hopper backward (csrc/kernels/sm90/bwd_wide)."""
        return self.wgmma and self.head_dim > 128

    @property
    def wide_ws(self) -> bool:
        """Whether this is the warp-specialized wide backward (head_dim 192 and 256;
        csrc/kernels/sm90/bwd_wide_ws): S and dP with queries as rows split by keys between the computing
        warpgroups, dK and dV with head_dim as rows (split by head_dim at 256, by product at 192); no dropout
        or deterministic build (the wide kernel takes those)."""
        return self.warp_specialized and self.head_dim > 128

    @property
    def value_dim(self) -> int:
        """v's head_dim as the kernels read it: head_dim_v, or head_dim where that is 0."""
        return self.head_dim_v or self.head_dim

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
        if self.wide_ws:
            # Mirrors fa::sm90::BwdWideWsSmem: K, V (v's head_dim); Q and dO per slot (both at q's head_dim:
            # dQ's staging takes both); P and dS (bf16, whole 64-key panels); LSE and delta per slot; full and
            # empty mbarriers per slot; +1 KB to align the tiles.
            st = self.WS_STAGES
            panels = -(-bkv // 64)
            kv = 2 * bkv * d + 2 * bkv * self.value_dim
            return 1024 + kv + 4 * st * bq * d + 4 * bq * 64 * panels + 8 * st * bq + 16 * st
        if self.warp_specialized:
            # K, V; Q and dO per slot; two dS^T buffers; two warpgroups' 64 x 64 fp32 dQ staging tiles;
            # LSE and delta per slot, and at head_dim 128 a word more per row for the dropout builds' row
            # hashes (csrc/kernels/sm90/bwd_ws kRowHashes; allocated for every d128 build, which has one
            # block per multiprocessor either way); the slots' two mbarriers, the deterministic dQ
            # hand-off's four and its (head, query row) per slot (+1 KB to align the tiles).
            st = self.WS_STAGES
            return (
                4 * bkv * d
                + 4 * st * bq * d
                + 4 * bkv * bq
                + 2 * 64 * 64 * 4
                + (12 if d == 128 else 8) * st * bq
                + 16 * st
                + 32
                + 8 * st
                + 1024
            )
        if self.wide:
            # Mirrors fa::sm90::BwdWideSmem: K, V; two Q and two dO buffers; P^T in fp32; dS^T; LSE and delta
            # per buffer; +1 KB to align the tiles.
            return 1024 + 4 * bkv * d + 8 * bq * d + 4 * bkv * bq + 2 * bkv * bq + 16 * bq
        # K, V; Q and dO per buffer; the dS tile; LSE and delta per buffer (+1 KB to align the wgmma tiles).
        return 4 * bkv * d + 4 * nb * bq * d + 2 * bkv * bq + 8 * nb * bq + (1024 if self.wgmma else 0)

    @property
    def dq_smem_bytes(self) -> int:
        return 4 * self.block_q * self.head_dim + 4 * self.dq_block_kv * self.head_dim

    def name(self) -> str:
        return (
            f"bwd_{self.dtype}_d{self.head_dim}_q{self.block_q}_kv{self.block_kv}_w{self.num_warps}"
            f"_s{self.split}"
            + ("_buffer" if self.double_buffer else "")
            + ("_wgmma" if self.wgmma else "")
            + ("_ws" if self.warp_specialized else "")
            + ("_tma" if self.tma_loads else "")
            + ("_dqw" if self.dq_writer else "")
            + (f"_ep{self.exp_poly}" if self.exp_poly else "")
            + (f"_v{self.head_dim_v}" if self.head_dim_v else "")
        )

    def __str__(self) -> str:
        return self.name()

    #: The kernels of a translation unit that do not depend on the mask: the preprocessing kernel (delta, the
    #: base-2 LSE, and zeroing the dQ workspace) and the cast of the dQ workspace into q's layout.
    MASK_FREE_KINDS = ("pre", "convert")

    def entry_kinds(self) -> tuple[str, ...]:
        """The per-mask kernels of this config's translation unit: the dK/dV kernel with atomic dQ, and
        (sm80 family) the deterministic pair of dK/dV without atomics and dQ, or (warp-specialized) the
        deterministic dK/dV kernel whose dQ reductions take turns."""
        if self.wide_ws:
            return ("dkdv",)  # (deterministic calls take the wide kernel)
        if self.warp_specialized or self.wide:
            return ("dkdv", "dkdv_det")  # the deterministic one adds dQ in a fixed order itself
        return ("dkdv",) if self.wgmma else ("dkdv", "dkdv_det", "dq")

    def symbol(
        self,
        kernel: str,
        causal: bool = False,
        ranged: bool = False,
        dropout: bool = False,
        window: bool | str = False,
        score: str | None = None,
    ) -> str:
        """Entry point of one kernel of the family: ``pre``, ``convert``, ``dkdv`` (atomic dQ), ``dkdv_det``
        or ``dq``."""
        if kernel not in ("pre", "convert", "dkdv", "dkdv_det", "dq"):
            raise ValueError(f"kernel must be pre, convert, dkdv, dkdv_det or dq; got {kernel!r}")
        base = "flash_" + self.name() + "__" + kernel
        if kernel in self.MASK_FREE_KINDS:
            return base
        return (
            base
            + ("__causal" if causal else "")
            + (("__segments" if window == "segments" else "__window") if window else "")
            + (f"__{score}" if score else "")
            + ("__ranged" if ranged else "")
            + ("__dropout" if dropout else "")
        )

    def replace(self, **changes) -> BwdConfig:
        return dataclasses.replace(self, **changes)

    def cpp_struct(self, struct_name: str = "Cfg") -> str:
        fields = [
            ("kIsBF16", "bool", self.dtype == "bf16"),
            ("kHeadDim", "int", self.head_dim),
            ("kBlockQ", "int", self.block_q),
            ("kBlockKV", "int", self.block_kv),
            ("kNumWarps", "int", self.num_warps),
            ("kSplit", "int", self.split),
            ("kDoubleBuffer", "bool", self.double_buffer),
            # load_tile (shared with the forward) reads these two.
            ("kSwizzle", "bool", "true"),
            ("kAsyncCopy", "bool", "true"),
            ("kWgmma", "bool", self.wgmma),
            ("kWarpSpecialized", "bool", self.warp_specialized),
            # The dQ workspace's layout (fa/dq_accum.cuh): tiled where dQ leaves through bulk reduce-adds.
            ("kTiledDq", "bool", self.warp_specialized or self.wide),
            ("kStages", "int", self.WS_STAGES),
            # What the launch allocates (smem_bytes): the Hopper kernels assert their layout fits it.
            ("kSmemBytes", "int", self.smem_bytes),
            ("kProducerRegs", "int", WS_REGISTER_SPLIT[0]),
            ("kConsumerRegs", "int", WS_REGISTER_SPLIT[1]),
            ("kWriterProducerRegs", "int", WRITER_WS_REGISTER_SPLIT[0]),
            ("kWriterConsumerRegs", "int", WRITER_WS_REGISTER_SPLIT[1]),
            ("kDetWriterRegs", "int", DET_WS_REGISTER_SPLIT[1]),
            ("kDetConsumerRegs", "int", DET_WS_REGISTER_SPLIT[2]),
            ("kDetWideWriterRegs", "int", DET_WIDE_REGISTER_SPLIT[0]),
            ("kDetWideComputeRegs", "int", DET_WIDE_REGISTER_SPLIT[1]),
            ("kExpPoly", "int", self.exp_poly),
        ]
        if self.head_dim_v:  # (absent otherwise: fa/bwd_params.h ValueDimOf reads kHeadDim then)
            fields.append(("kHeadDimV", "int", self.head_dim_v))
        return cpp_struct(struct_name, fields)


def bwd_validity_errors(cfg: BwdConfig) -> list[str]:
    """Why ``cfg`` cannot be compiled (empty when it can); the kernel static_asserts the tile rules too."""
    errors = []
    if cfg.dtype not in DTYPES:
        errors.append(f"dtype must be one of {DTYPES}")
    if cfg.head_dim not in HEAD_DIMS:
        errors.append(f"head_dim must be one of {HEAD_DIMS}")
    if cfg.block_q not in (64, 128):
        errors.append("block_q must be 64 or 128 (the dS tile's swizzle needs rows of 64 elements or more)")
    if cfg.tma_loads and not cfg.warp_specialized:
        errors.append("tma_loads is the warp-specialized backwards' (bwd_ws, bwd_wide_ws)")
    if cfg.dq_writer and not (cfg.tma_loads and cfg.warp_specialized and cfg.head_dim <= 128):
        errors.append("dq_writer is bwd_ws's with tma_loads (its producer's copies are one thread's)")
    if cfg.head_dim_v and not (
        cfg.warp_specialized and cfg.head_dim_v in WIDE_WS_VALUE_DIMS.get(cfg.head_dim, ())
    ):
        errors.append(
            "head_dim_v is the warp-specialized wide backward's at head_dim 192: 64 or 128 (0: head_dim)"
        )
    if not 0 <= cfg.exp_poly <= 8:
        errors.append("exp_poly counts eighths of the exponentials: 0 to 8")
    elif cfg.exp_poly and not (cfg.warp_specialized and cfg.head_dim <= 128):
        errors.append("exp_poly is bwd_ws's (the warp-specialized backward at head_dim 64 and 128)")
    if cfg.warp_specialized:
        errors += _ws_shape_errors(cfg)
    elif cfg.wide:
        errors += _wide_shape_errors(cfg)
    else:
        errors += _tile_shape_errors(cfg)
    if not errors and cfg.smem_bytes > SMEM_LIMIT_SM90:
        errors.append("shared memory exceeds the sm_90 limit of 232448")
    return errors


def _ws_shape_errors(cfg: BwdConfig) -> list[str]:
    """The warp-specialized kernels' fixed shapes (csrc/kernels/sm90/bwd_ws; bwd_wide_ws at head_dim 192 and
    256)."""
    errors = []
    if cfg.head_dim > 128:
        shape = (cfg.block_q, cfg.num_warps, cfg.split, cfg.double_buffer, cfg.wgmma)
        kv_ok = cfg.block_kv == 64 or (cfg.block_kv == 96 and cfg.head_dim == 192)
        if cfg.head_dim not in (192, 256) or shape != (64, 12, 1, True, True) or not kv_ok:
            errors.append(
                "the warp-specialized wide backward is head_dim 192 or 256, block_q 64, block_kv 64 (or 96 "
                "at head_dim 192), a producer and two computing warpgroups (num_warps 12), double buffered, "
                "unsplit, wgmma"
            )
        return errors
    if not cfg.wgmma or cfg.num_warps != 12 or cfg.block_kv != 128 or cfg.split != 1:
        errors.append(
            "warp-specialized backward configs are wgmma configs of a producer and two consumer "
            "warpgroups (num_warps 12, block_kv 128, unsplit)"
        )
    if (cfg.block_q, cfg.head_dim) not in ((128, 64), (64, 128)) or not cfg.double_buffer:
        errors.append(
            "warp-specialized backward configs are double buffered with block_q 128 at "
            "head_dim 64 or 64 at head_dim 128 (dQ's split)"
        )
    return errors


def _wide_shape_errors(cfg: BwdConfig) -> list[str]:
    """The wide kernel's fixed shapes (csrc/kernels/sm90/bwd_wide): both warpgroups on 64 keys."""
    shape = (cfg.block_q, cfg.block_kv, cfg.num_warps, cfg.split, cfg.double_buffer)
    if cfg.head_dim in (192, 256) and shape == (64, 64, 8, 1, True):
        return []
    return [
        "wide wgmma backward configs (head_dim 192, 256) are two warpgroups on 64 keys (num_warps 8, "
        "block_kv 64), block_q 64, double buffered, unsplit"
    ]


def _tile_shape_errors(cfg: BwdConfig) -> list[str]:
    """The sm80 kernels' tile rules, and the sm90 wgmma kernel's fixed shapes."""
    errors = []
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
    return errors


def bwd_register_roles(cfg: BwdConfig) -> str:
    """What a backward block's register count means per role, for ``report``: "" for a kernel without roles
    (the compiler reports only the launch-time allocation of those that move registers with setmaxnreg:
    the warp-specialized kernels, and the wide one's deterministic form)."""
    if cfg.wide_ws:
        producer, compute = WS_REGISTER_SPLIT
        return (
            f"setmaxnreg: producer warpgroup {producer}, computing warpgroups up to {compute} (no "
            "deterministic build: the wide kernel's runs those calls)"
        )
    if cfg.warp_specialized:
        producer, consumer = WS_REGISTER_SPLIT
        copies, writers, det_consumers = DET_WS_REGISTER_SPLIT
        if cfg.dq_writer:
            producer, consumer = WRITER_WS_REGISTER_SPLIT
        return (
            f"setmaxnreg: producer warpgroup {producer}, consumer warpgroups up to {consumer}; deterministic "
            f"kernel: producer {copies}, dQ writers' warpgroup {writers}, consumers up to {det_consumers}"
        )
    if cfg.wide:
        writer, compute = DET_WIDE_REGISTER_SPLIT
        return (
            f"deterministic kernel (setmaxnreg): dQ writer's warpgroup {writer}, the others up to {compute}"
        )
    return ""


#: Where the Hopper backward's warp-specialized defaults load Q and dO by TMA (BwdConfig.tma_loads) rather
#: than by the producer warpgroup's cp.async: (head_dim, causal) pairs, each measured against the cp.async
#: producer in forward+backward time on an H200 (docs/kernel-log.md steps 130-133). TMA alone won at head_dim
#: 256 (0.94-0.98x the time, causal and not, 1k-4k tokens) and 128 causal (0.94-0.97x) and lost at 128
#: non-causal (1.005-1.027x) and 64 causal (1.011x); with dQ's writer warps, which need it (dq_writer, step
#: 133), it wins at 64 and 128 both ways (0.90-0.99x at 4k). Every producer stays selectable by name
#: (``..._ws``, ``..._ws_tma`` and ``..._ws_tma_dqw``).
#: (192: the warp-specialized wide kernel, HOPPER_BWD_WIDE_WS_DEFAULT, whose cp.async producer spills 12 bytes
#: there and the TMA one none, kernel log 136.)
HOPPER_BWD_TMA_DEFAULT = frozenset({(d, causal) for d in (64, 128, 192, 256) for causal in (False, True)})

#: The head dims above 128 whose default Hopper backward is the warp-specialized wide kernel
#: (csrc/kernels/sm90/bwd_wide_ws): 256, and 192 since kernel log 136 measured it at 0.78-0.81x the wide
#: kernel's forward+backward time at 4k and 0.73-0.79x at 1k on an H200 (``warp_specialized=False`` selects
#: the wide kernel, which keeps dropout and the deterministic mode).
HOPPER_BWD_WIDE_WS_DEFAULT = frozenset({192, 256})

#: Keys per block of the warp-specialized wide backward by head_dim: 64, or at 192 96 (its m64n48 products and
#: the query step's loads and dQ reduction spread over more keys, as FlashAttention-4 tiles 192): forward+
#: backward at head_dim 192 on an H200 measured 0.80x (non-causal) and 0.86x (causal) the 64-key blocks' time
#: at 4k, 0.82-0.85x at 1k (kernel log 140). ``BwdConfig.replace(block_kv=64)`` keeps the 64-key form.
HOPPER_BWD_WIDE_WS_BLOCK_KV = {192: 96, 256: 64}

#: The value head dims (BwdConfig.head_dim_v) the warp-specialized wide backward reads apart from q's, by
#: head_dim (docs/value-head-dim-study.md section 7).
WIDE_WS_VALUE_DIMS = {192: (64, 128)}

#: Whether a Hopper backward call whose v is narrower than q and k runs, where it can, on the warp-specialized
#: wide kernel reading v's head_dim (BwdConfig.head_dim_v: head_dim 192 with v at 64 or 128, no dropout or
#: deterministic mode) instead of on v, the output and dO padded to q's (docs/value-head-dim-study.md section
#: 7): forward+backward at 192 / 128 on an H200 measured 0.92x (non-causal) and 0.89x (causal) the padded
#: path's time at 4k (kernel log 141). False restores the padded path.
HOPPER_BWD_READS_VALUE_DIM = True

#: Eighths of P's exponentials that bwd_ws computes on the FMA pipe by default, by (head_dim, causal)
#: (BwdConfig.exp_poly). None: forward+backward at 4k on an H200 measured d128 non-causal 0.97x (ep 2 and 4,
#: rounds overlapping), d128 causal level, d64 1.05-1.09x (it spills), and level to slower at 1k (kernel log
#: 138); the autotune space keeps ep 2 and 4 at 128.
HOPPER_BWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {}


def hopper_bwd_config(
    dtype: str,
    head_dim: int,
    *,
    causal: bool = False,
    warp_specialized: bool | None = None,
    tma_loads: bool | None = None,
    dq_writer: bool | None = None,
    exp_poly: int | None = None,
) -> BwdConfig:
    """The Hopper backward's config at head_dim 64 or 128 (its shape is fixed by the kernel: 128 keys per
    block, 128 query rows per step at head_dim 64 and 64 at 128): the warp-specialized kernel (Q and dO by
    TMA with ``tma_loads``, by default where HOPPER_BWD_TMA_DEFAULT lists the head_dim and mask), or with
    ``warp_specialized=False`` the sm90 wgmma kernel it replaced. At head_dim 256 the warp-specialized wide
    kernel (64 keys, 64 query rows per step, csrc/kernels/sm90/bwd_wide_ws), at 192 as well
    (HOPPER_BWD_WIDE_WS_DEFAULT; on HOPPER_BWD_WIDE_WS_BLOCK_KV's 96 keys), or with
    ``warp_specialized=False`` the wide kernel. ``exp_poly``: bwd_ws's
    share of P's exponentials on the FMA pipe (default HOPPER_BWD_EXP_POLY_DEFAULT's)."""
    if warp_specialized is None:
        warp_specialized = head_dim <= 128 or head_dim in HOPPER_BWD_WIDE_WS_DEFAULT
    if tma_loads is None:
        tma_loads = (head_dim, bool(causal)) in HOPPER_BWD_TMA_DEFAULT
    tma = warp_specialized and tma_loads
    # dQ's writer warps (kernel log 133) wherever bwd_ws has the TMA producer, unless asked otherwise.
    writer = tma and head_dim <= 128 if dq_writer is None else dq_writer
    if exp_poly and (head_dim > 128 or not warp_specialized):
        raise ValueError(
            f"exp_poly is bwd_ws's (the warp-specialized backward at head_dim 64 and 128); got "
            f"head_dim {head_dim}, warp_specialized={warp_specialized}"
        )
    if head_dim in (192, 256) and warp_specialized:
        kv = HOPPER_BWD_WIDE_WS_BLOCK_KV[head_dim]
        return BwdConfig(
            dtype, head_dim, 64, kv, 12, 1, True, wgmma=True, warp_specialized=True, tma_loads=tma
        )
    if head_dim in (192, 256):
        return BwdConfig(dtype, head_dim, 64, 64, 8, 1, True, wgmma=True)
    return BwdConfig(
        dtype,
        head_dim,
        128 if head_dim == 64 else 64,
        128,
        12 if warp_specialized else 8,
        1,
        True,
        wgmma=True,
        warp_specialized=warp_specialized,
        tma_loads=tma,
        dq_writer=writer,
        exp_poly=(
            (HOPPER_BWD_EXP_POLY_DEFAULT.get((head_dim, bool(causal)), 0) if warp_specialized else 0)
            if exp_poly is None
            else exp_poly
        ),
    )


def parse_bwd_config(text: str | BwdConfig) -> BwdConfig:
    """The inverse of :meth:`BwdConfig.name`."""
    if isinstance(text, BwdConfig):
        return text
    m = re.fullmatch(
        r"bwd_(fp16|bf16)_d(\d+)_q(\d+)_kv(\d+)_w(\d+)_s(\d+)(_buffer)?(_wgmma)?(_ws)?(_tma)?(_dqw)?(?:_ep([1-8]))?(?:_v(\d+))?",
        str(text),
    )
    if not m:
        raise ValueError(f"not a backward config name: {text!r}")
    dt, d, bq, bkv, w, s, buf, wg, ws, tma, dqw, ep, dv = m.groups()
    return BwdConfig(
        dt, int(d), int(bq), int(bkv), int(w), int(s), buf is not None, wg is not None, ws is not None,
        tma is not None, dqw is not None, int(ep or 0), int(dv or 0),
    )  # fmt: skip
