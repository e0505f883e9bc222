"""The decode kernel family's configuration (csrc/kernels/sm80/decode: split-KV attention against a KV cache),
its rules, its default per GPU, and the split-count heuristic."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from .common import DTYPES, cpp_struct, is_hopper, smem_optin

__all__ = [
    "DECODE_HEAD_DIMS",
    "COMBINE_COST",
    "DecodeConfig",
    "cache_length_bucket",
    "decode_register_roles",
    "decode_validity_errors",
    "default_decode_config",
    "num_splits_heuristic",
    "split_cost",
    "parse_decode_config",
]

#: Head dims the decode kernel is compiled for (a problem's head_dim runs on the next one up).
DECODE_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time shape of the decode kernel.

    A block computes ``block_m`` packed query rows (the query tokens of one K/V head's query heads: rows =
    seqlen_q * group) against one split of a row's keys, ``block_kv`` keys per tile through a ``stages``
    deep cp.async ring. ``warps_m`` warps split the rows (16 per mma tile), ``warps_n`` the keys of each tile;
    the warps' softmax states are merged at the end. ``wgmma``: the Hopper kernel (csrc/kernels/sm90/decode,
    sm_90a only), one warpgroup whose wgmma products cover the block's 64 rows (block_m 64, warps 4 x 1);
    otherwise the sm80 instruction set's kernel (csrc/kernels/sm80/decode), which runs on sm_80 to sm_90.
    ``refill_first``: each main-loop iteration issues its refill before it waits for its tile, with a
    second barrier, so the ring keeps ``stages`` tiles in flight during the wait instead of ``stages - 1``
    (fa/decode_block.cuh PageRing; its page-entry ring holds one slot more); name suffix ``_rf``.
    """

    dtype: str
    head_dim: int
    block_m: int
    block_kv: int
    warps_m: int
    warps_n: int
    stages: int
    wgmma: bool = False
    refill_first: bool = False

    def __post_init__(self) -> None:
        errors = decode_validity_errors(self)
        if errors:
            raise ValueError(f"invalid decode config {self.name()}: " + "; ".join(errors))

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def rows_per_copy_thread(self) -> int:
        """Mirrors fa::DecodeKVLoader::kRows: the consecutive K/V rows of a tile each thread copies. A paged
        cache whose page size is a power of two at least this holds a thread's rows in one page (one page
        lookup per thread and tile); smaller or other page sizes look each row up."""
        return self.block_kv // (self.threads // (self.head_dim // 8))

    def looks_up_each_row(self, page_size: int) -> bool:
        """Whether the kernel looks up the page of each K/V row it copies for caches of ``page_size``."""
        return page_size & (page_size - 1) != 0 or page_size < self.rows_per_copy_thread

    @property
    def page_slot_bytes(self) -> int:
        """Mirrors fa::TilePageRing::kBytes: a paged cache's page entries are requested 2 * stages - 2 tiles
        ahead of the tiles' copies (one more with ``refill_first``), into that many slots plus one, of
        block_kv ints each."""
        return (2 * self.stages - 1 + self.refill_first) * self.block_kv * 4

    @property
    def smem_bytes(self) -> int:
        """Mirrors fa::DecodeSmem (fa::sm90::DecodeSmem for wgmma: 1 KB of alignment slack for the swizzle,
        no merge of warps' states): the Q tile, the K/V ring and the ring of page entries
        (:meth:`page_slot_bytes`), or the warps' fp32 states (reused bytes)."""
        if self.wgmma:
            return (
                1024
                + 2 * self.block_m * self.head_dim
                + self.stages * 4 * self.block_kv * self.head_dim
                + self.page_slot_bytes
            )
        main_loop = (
            2 * self.block_m * self.head_dim
            + self.stages * 4 * self.block_kv * self.head_dim
            + self.page_slot_bytes
        )
        merge = self.warps_n * self.block_m * (self.head_dim + 6) * 4
        return max(main_loop, merge)

    def name(self) -> str:
        return (
            f"decode_{self.dtype}_d{self.head_dim}_m{self.block_m}_kv{self.block_kv}"
            f"_w{self.warps_m}x{self.warps_n}_s{self.stages}"
            + ("_wgmma" if self.wgmma else "")
            + ("_rf" if self.refill_first else "")
        )

    def __str__(self) -> str:
        return self.name()

    def symbol(self, kernel: str, causal: bool = False, paged: bool = False) -> str:
        """Entry point of one kernel of the family: ``decode`` (per causal flag and cache layout),
        ``combine``, or ``append`` (per cache layout)."""
        if kernel not in ("decode", "combine", "append"):
            raise ValueError(f"kernel must be decode, combine or append; got {kernel!r}")
        base = "flash_" + self.name() + "__" + kernel
        if kernel == "combine":
            return base
        if kernel == "append":
            return base + ("__paged" if paged else "")
        return base + ("__causal" if causal else "") + ("__paged" if paged else "")

    def replace(self, **changes) -> DecodeConfig:
        return dataclasses.replace(self, **changes)

    def cpp_struct(self, struct_name: str = "Cfg") -> str:
        fields = [
            ("kIsBF16", "bool", self.dtype == "bf16"),
            ("kHeadDim", "int", self.head_dim),
            ("kBlockM", "int", self.block_m),
            ("kBlockKV", "int", self.block_kv),
            ("kWarpsM", "int", self.warps_m),
            ("kWarpsN", "int", self.warps_n),
            ("kStages", "int", self.stages),
            ("kWgmma", "bool", self.wgmma),
            ("kRefillFirst", "bool", self.refill_first),
        ]
        return cpp_struct(struct_name, fields)


def decode_validity_errors(cfg: DecodeConfig) -> list[str]:
    """Why ``cfg`` cannot be compiled (empty when it can); fa::check_decode_config asserts the same."""
    errors = []
    if cfg.dtype not in DTYPES:
        errors.append(f"dtype must be one of {DTYPES}")
    if cfg.head_dim not in DECODE_HEAD_DIMS:
        errors.append(f"head_dim must be one of {DECODE_HEAD_DIMS}")
    if cfg.warps_m < 1 or cfg.warps_n < 1 or cfg.warps_m * cfg.warps_n > 8:
        errors.append("warps_m and warps_n must be >= 1, at most 8 warps in all")
    elif cfg.block_m % (16 * cfg.warps_m) or cfg.block_m < 16:
        errors.append("block_m must be a multiple of 16 * warps_m")
    elif cfg.block_kv % (16 * cfg.warps_n) or cfg.block_kv < 16:
        errors.append("block_kv must be a multiple of 16 * warps_n")
    if cfg.stages < 2:
        errors.append("stages must be at least 2")
    if not errors:
        # The copy loop's rules (decode_kernel.cuh): the block's threads tile a K/V tile's rows in
        # 16-byte chunks, each thread a power-of-two run of consecutive rows (one page lookup per run).
        chunks, threads = cfg.head_dim // 8, cfg.threads
        rows_per_pass = threads // chunks if threads % chunks == 0 else 0
        if not rows_per_pass or cfg.block_kv % rows_per_pass:
            errors.append("block_kv must be a multiple of threads / (head_dim / 8)")
        elif (cfg.block_kv // rows_per_pass) & (cfg.block_kv // rows_per_pass - 1):
            errors.append("block_kv / (threads / (head_dim / 8)) must be a power of two (rows per thread)")
    if not errors and cfg.block_m // (16 * cfg.warps_m) * cfg.head_dim > 256:
        errors.append("(block_m / 16 / warps_m) * head_dim must be at most 256 (O and Q stay in registers)")
    if cfg.wgmma:  # fa::sm90::check_decode_config
        if (cfg.block_m, cfg.warps_m, cfg.warps_n) != (64, 4, 1):
            errors.append("wgmma: one warpgroup of 64 rows (block_m 64, warps 4 x 1)")
        if cfg.head_dim > 128:
            errors.append("wgmma: head_dim 64 or 128")
        if cfg.block_kv not in (64, 128):
            errors.append("wgmma: block_kv 64 or 128")
    return errors


def decode_register_roles(cfg: DecodeConfig) -> str:
    """What a decode block's register count means per role, for ``report``: always "". Every warp of the
    decode kernels (the sm80 one and the wgmma one) loads and computes alike and none moves registers with
    setmaxnreg, so the count the compiler reports is what each thread holds; there is no split to state."""
    return ""


def parse_decode_config(text: str | DecodeConfig) -> DecodeConfig:
    """The inverse of :meth:`DecodeConfig.name`."""
    if isinstance(text, DecodeConfig):
        return text
    pattern = r"decode_(fp16|bf16)_d(\d+)_m(\d+)_kv(\d+)_w(\d+)x(\d+)_s(\d+)(_wgmma)?(_rf)?"
    m = re.fullmatch(pattern, str(text))
    if not m:
        raise ValueError(f"not a decode config name: {text!r}")
    dt, *numbers, wgmma, refill_first = m.groups()
    return DecodeConfig(dt, *(int(x) for x in numbers), wgmma=bool(wgmma), refill_first=bool(refill_first))


def default_decode_config(dtype: str, head_dim: int, rows: int, arch: str) -> DecodeConfig:
    """The decode config for ``rows`` packed query rows (seqlen_q * group) on ``arch``.

    Hopper, more than 16 rows (speculative decoding, chunked prefill) and head_dim up to 128: the wgmma kernel
    (csrc/kernels/sm90/decode) with a 2-deep ring, whose 83 KB let two blocks share an SM; the split
    heuristic then sizes its waves for those two blocks (ops.decode.DecodePlan). A wgmma block is one
    warpgroup that waits for its own S = Q K^T before its softmax, so the second block's products and
    softmax fill the first one's waits. Measured on an H200 (bf16, 32/8 heads, seqlen_q 16: 64 rows; µs per
    call; the sm80 64-row kernel (3-deep, one block per SM) / wgmma 2-deep at one block per SM / wgmma
    2-deep at two / wgmma 3-deep / the one-token call): batch 8 with 32k keys 347.8 / 318.9 / 281.4 / 325.2
    / 240.1; with 128k 1367 / 1269 / 1092 / 1252 / 924; batch 1 with 128k 181.9 / 167.6 / 145.0 / 168.5 /
    126.4; batch 64 with 32k (unsplit) 2138 / 2141 / 2087 / 2509 / 1883 (docs/kernel-log/decode.md, step
    157). On an H100 the sm80 kernel had been as fast where keys are split (step 72): there the cache's bytes
    took longer than its math; the H200's 1.4x bandwidth exposed the math. Its ring refills before it
    waits (``refill_first``; step 159, an H200 at seqlen_q 16: 0.979-0.998x the time, batch 1 with 128k keys
    155.7 -> 151.7 µs, 6 of 6 rounds faster); the one-token kernel keeps the wait first (1.002-1.011x there).

    Up to 16 rows (one token, a group of up to 16): one 16-row tile, four warps splitting each 64-key tile's
    keys. More rows elsewhere: 64-row blocks, the warps splitting the rows (head_dim 256: still 16-row
    blocks, more of them).
    The ring holds 3 tiles where the GPU's shared memory allows (2 in flight while one is computed), else 2;
    where even 2 tiles of 64 keys do not fit (head_dim 256 on a 99 KB GPU), tiles of 32 keys. Not 4: on an
    H100 (bf16, head_dim 128) a 4-deep ring (135 KB) runs one block per SM, and the warps that issue the
    copies also do the math; 3 deep (103 KB) runs two, which hide each other's math. Measured over batch
    1-64 and 8k-128k keys, the 3-deep ring was as fast on contiguous caches and up to 1.16x faster on paged
    ones (page size 16: 2.58 -> 2.79 TB/s at batch 1 with 128k keys, 2.67 -> 2.95 at batch 8 with 32k).
    """
    d = next(x for x in DECODE_HEAD_DIMS if head_dim <= x)
    if rows > 16 and d <= 128 and is_hopper(arch):
        return DecodeConfig(dtype, d, 64, 64, 4, 1, 2, wgmma=True, refill_first=True)
    if rows <= 16 or d > 128:
        # (head_dim 256 keeps 16-row blocks for any row count: 32-row blocks of 2 x 2 warps spilled, 64 to 255
        # registers at 255.)
        block_m, warps_m = 16, 1
    else:
        block_m, warps_m = 64, 4
    limit = smem_optin(arch)
    # 64-key tiles, the ring as deep as fits; then 32-key tiles (head_dim 256 on the 99 KB GPUs), whose
    # 16-key warp slices allow two warps splitting the keys.
    candidates = [(64, stages) for stages in (3, 2)] + [(32, stages) for stages in (3, 2)]
    for block_kv, stages in candidates:
        warps_n = 1 if warps_m > 1 else block_kv // 16
        cfg = DecodeConfig(dtype, d, block_m, block_kv, warps_m, warps_n, stages)
        if cfg.smem_bytes <= limit:
            return cfg
    return cfg


def num_splits_heuristic(
    blocks: int, n_keys: int, block_kv: int, sm_count: int, blocks_per_sm: int = 1, max_splits: int = 128
) -> int:
    """How many blocks share one row's keys, for ``blocks`` (batch x heads_kv x row blocks) blocks on a GPU
    with ``sm_count`` multiprocessors that each run ``blocks_per_sm`` of them at once.

    The kernel is bound by memory bandwidth, which only a full GPU reaches, and its blocks run in waves of
    ``sm_count * blocks_per_sm``: the call takes about (waves) x (tiles per block + the block's fixed cost,
    taken as two tiles: its prologue, before the ring is full, and its share of the partial output), plus,
    with more than one split, the combine kernel's launch and pass (:data:`COMBINE_COST` tiles). The
    heuristic takes the split count that minimises that, the smallest on a tie (each split costs a partial
    output the combine reads back). Why not "fill the GPU twice over" (the first rule): measured on an H100
    (bf16, head_dim 128, 8 K/V heads, batch 8, 32k keys, two blocks per SM), 5 splits made 320 blocks for 264
    slots, 1.2 waves, and ran at 2.05 TB/s where 3 or 7 splits ran at 2.6-2.7. Never a split shorter than
    four K/V tiles, never more than ``max_splits``.
    """
    if blocks <= 0 or n_keys <= 0:
        return 1
    tiles = math.ceil(n_keys / block_kv)
    slots = sm_count * max(1, blocks_per_sm)
    most = max(1, min(tiles // 4, max_splits))
    return min(range(1, most + 1), key=lambda s: (split_cost(blocks, tiles, s, slots), s))


#: The combine kernel's cost in the split heuristic, in K/V tiles of one block: its launch (a second launch
#: per call, which host-bound calls pay in full) and its pass over the partials. Measured on an H100 (bf16,
#: 32/8 heads, head_dim 128, one token, 1k keys; per call as bench times it / GPU time in a CUDA graph):
#: batch 8, 2 splits 35.6 / 17.6 us against 1 split 30.4 / 16.0 (cuDNN 33.9 / 17.8); batch 4, 4 splits
#: 30.1 / 11.7 against 1 split 29.9 / 14.3; batch 1, 4 splits 31.7 / 7.8 against 1 split 31.3 / 13.3
#: (benchmarks/results/h100-2026-11-26-decode-small-splits.txt). Eight tiles makes the model pick 1, 4
#: and 4 there, and changes nothing at 8k keys or more.
COMBINE_COST = 8


def split_cost(blocks: int, tiles: int, splits: int, slots: int) -> int:
    """The split heuristic's model of a decode call's time, in K/V tiles: waves of ``slots`` blocks, each
    wave as long as one block's tiles plus two (its fixed cost), and the combine's cost with splits."""
    waves = math.ceil(blocks * splits / slots) * (math.ceil(tiles / splits) + 2)
    return waves + (COMBINE_COST if splits > 1 else 0)


def cache_length_bucket(capacity: int) -> int:
    """The largest capacity of ``capacity``'s bucket: ``capacity`` rounded up to one eighth of its octave
    (to a multiple of 2**(floor(log2 capacity) - 3); capacities up to 16 are their own bucket).

    A contiguous cache's decode plan is kept per bucket and splits its keys for the bucket's largest capacity
    (ops/decode.py), so a cache that grows a token per step makes eight plans per doubling, and a call whose
    capacity lies below its bucket's top pays for at most 1/8 more keys than it has: splits past the keys
    write empty partials. Powers of two are the top of their bucket, so a cache of 1k, 8k, 32k or 128k keys
    splits exactly as it would unbucketed.
    """
    if capacity <= 16:
        return max(capacity, 0)
    step = 1 << (capacity.bit_length() - 4)
    return -(-capacity // step) * step
