"""The backward kernel family's configuration (csrc/kernels/sm80/bwd and, with ``wgmma``, sm90/bwd)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .common import DTYPES, HEAD_DIMS, SMEM_LIMIT_SM90, cpp_struct

__all__ = ["BwdConfig", "bwd_validity_errors", "parse_bwd_config"]


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

    #: The kernels of a translation unit that do not depend on the mask: the preprocessing kernel (delta, the
    #: base-2 LSE, and zeroing the dQ workspace) and the cast of the dQ workspace into q's layout.
    MASK_FREE_KINDS = ("pre", "convert")

    def entry_kinds(self) -> tuple[str, ...]:
        """The per-mask kernels of this config's translation unit: the dK/dV kernel with atomic dQ, and
        (sm80 family only) the deterministic pair of dK/dV without atomics and dQ."""
        return ("dkdv",) if self.wgmma else ("dkdv", "dkdv_det", "dq")

    def symbol(self, kernel: str, causal: bool = False, ranged: bool = False, dropout: bool = False) -> str:
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
        ]
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
    if not errors and cfg.smem_bytes > SMEM_LIMIT_SM90:
        errors.append("shared memory exceeds the sm_90 limit of 232448")
    return errors


def parse_bwd_config(text: str | BwdConfig) -> BwdConfig:
    """The inverse of :meth:`BwdConfig.name`."""
    if isinstance(text, BwdConfig):
        return text
    m = re.fullmatch(r"bwd_(fp16|bf16)_d(\d+)_q(\d+)_kv(\d+)_w(\d+)_s(\d+)(_buffer)?(_wgmma)?", str(text))
    if not m:
        raise ValueError(f"not a backward config name: {text!r}")
    dt, d, bq, bkv, w, s, buf, wg = m.groups()
    return BwdConfig(dt, int(d), int(bq), int(bkv), int(w), int(s), buf is not None, wg is not None)
