"""Which configuration a call runs when nobody tuned this GPU: readable rules, with the measurement behind
each in its docstring (docs/kernel-log.md has the sweeps)."""

from __future__ import annotations

from functools import lru_cache

from .backward import BwdConfig, hopper_bwd_config
from .common import is_hopper, padded_head_dim, smem_optin
from .forward import KernelConfig, wgmma_config, ws_config

__all__ = ["classic_hopper_config", "default_bwd_config", "default_config", "portable_config"]


@lru_cache(maxsize=4096)
def default_config(
    dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int, arch: str = "sm_80"
) -> KernelConfig:
    """The configuration used when the caller names none and no autotuned winner exists.

    On Hopper (``arch`` sm_90 / sm_90a) that is a warp-specialized config (:func:`_hopper_default`) or, where
    that is not ahead, the sm90 kernel's (:func:`classic_hopper_config`); on any other GPU the portable sm80
    kernel's (:func:`portable_config`). Every choice fits the shared memory of ``arch``
    (tests/test_arch_defaults.py compiles each one for its architecture).
    """
    if is_hopper(arch):
        return _hopper_default(dtype, padded_head_dim(head_dim), max(seqlen_q, seqlen_k), causal)
    return portable_config(dtype, head_dim, causal, seqlen_q, seqlen_k)


@lru_cache(maxsize=4096)
def portable_config(dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int) -> KernelConfig:
    """The portable (sm80-instruction) kernel's configuration: the default on every GPU but Hopper, and on
    Hopper the kernel of the cases the wgmma family does not cover (configs.families). Each fits 99 KB of
    shared memory, the smallest per-block limit of the GPUs from sm_80 on (sm_86, sm_89), so one choice
    serves every architecture.

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


#: Eighths of P's exponentials that the warp-specialized forward computes on the FMA pipe by default, by
#: (head_dim, causal) (KernelConfig.exp_poly). None: in bf16 at head_dims 64 and 128 it measured 1.06-1.24x
#: the forward's time at 4k on an H200 (kernel log 139; the consumers are issue-bound, not SFU-bound). The
#: option stays for the FP8 forward, whose products run twice as fast against the same SFU
#: (docs/fp8-study.md).
HOPPER_FWD_EXP_POLY_DEFAULT: dict[tuple[int, bool], int] = {}


def _ws(dtype: str, head_dim: int, *shape: int, causal: bool, **knobs) -> KernelConfig:
    """A warp-specialized default: :func:`ws_config` with the output's TMA stores (and, where
    HOPPER_FWD_EXP_POLY_DEFAULT lists its head_dim and mask, that share of the exponentials on the FMA
    pipe)."""
    exp_poly = HOPPER_FWD_EXP_POLY_DEFAULT.get((head_dim, causal), 0)
    return ws_config(dtype, head_dim, *shape, tma_store=True, exp_poly=exp_poly, **knobs)


def _hopper_default(dtype: str, d: int, n: int, causal: bool) -> KernelConfig:
    """The Hopper config for head_dim ``d`` at sequence length ``n`` (the longer of q and k).

    From two H100 autotuning sweeps of the sm90 and warp-specialized kernels together
    (benchmarks/results/h100-2026-11-23-autotune-ws-{3,4}.json; docs/kernel-log.md, step 35): on average over
    the two, every pick is within 5% of the winner at every length from 512 to 16k, causal or not. All picks
    are warp-specialized with intra-warpgroup overlap (K and V slots freed apart, so a 2-deep ring suffices
    and leaves room for larger tiles) except at head_dim 256 and 512 keys.
    * Up to 1k keys at head_dim 64 (2k causal), up to 1k (2k causal) at 128, the persistent grid: one
      block per SM takes query tiles from an atomic counter, and loads the next tile's Q and K/V while the
      current one finishes. Short blocks are where the launch and prologue of a new block cost most: +12% at
      head_dim 128, 512 keys.
    * Beyond, one block per tile, and key tiles as large as a 2-deep ring allows: 128 x 128 at head_dim 128
      (176 keys from 4k non-causal and 8k causal, where the longer tile's fewer barriers pay), three
      consumer warpgroups of 64 rows over 128-key tiles at head_dim 64 (160 registers each), 112 keys at
      head_dim 192, 80 at 256 (what fits 227 KB beside a 128-row Q tile).
    * Every pick writes its output with TMA stores (``tma_store``): on the H100, +1-4% at head_dim 128 and
      256 from 512 to 4k keys and level at 64 (docs/kernel-log.md, step 62).
    * The persistent grid with each tile's epilogue under the next tile's first S (``tile_overlap``, two
      Q buffers) where it led the previous pick in both of two H100 runs
      (benchmarks/results/h100-2026-11-26-tile-overlap-2q-ab.json; docs/kernel-log.md, steps 63-64): head_dim
      64 non-causal up to 1k (+0.1-3.0%) and head_dim 128 non-causal at 4k (+2.4%). It loses 1-3% at head_dim
      128 non-causal 512-1k and is level at 64 causal.
    * Two picks from an H200's in-process A/B of the configs (kernel log 171;
      benchmarks/results/ab/h200-2026-11-30-fwd-picks-d{64,128}-9af4672.json), each within 5% of the winner
      of both H100 sweeps above too: head_dim 64 non-causal at 2k on the 192-row tile (7% faster there than
      the persistent 176-key tile with overlap), head_dim 128 causal at 1k and 2k on the persistent grid
      without the tile overlap (2.1% and 0.9% faster; the H100 runs had the overlap 0.4% and 3.5% ahead).
    * The persistent grid on head_dim 64's 192-row tile at 1k-2k non-causal and 2k causal, once its
      epilogue no longer held registers through the mainloop (kernel log 181; an H200's in-process A/B,
      benchmarks/results/ab/h200-2026-11-30-fwd-picks-d64-181.json): 2.3-2.5% faster than the previous
      picks non-causal, 1.0% causal; level or slower from 4k, where one block per tile stays.
    * Ping-pong between the consumer warpgroups is not a default: on top of overlap it beat the best config
      without it by more than 1.5% at 3 of the two sweeps' 96 points, none in both (docs/kernel-log.md, step
      36, has its progression step).
    """
    short = n < 3072  # the 512, 1k and 2k buckets
    if d == 64:
        if causal and n < 1536:
            return _ws(dtype, 64, 128, 128, 2, overlap=True, persistent=True, causal=causal)
        if not causal and n < 768:
            return _ws(
                dtype, 64, 128, 176, 3, overlap=True, persistent=True, tile_overlap=True, causal=causal
            )
        return _ws(dtype, 64, 192, 128, 2, overlap=True, persistent=short, causal=causal)
    if d == 128:
        if not causal and 3072 <= n < 6144:
            return _ws(
                dtype, 128, 128, 128, 2, overlap=True, persistent=True, tile_overlap=True, causal=causal
            )
        if n < 1536 or (causal and short):
            return _ws(dtype, 128, 128, 128, 2, overlap=True, persistent=True, causal=causal)
        wide = n >= 12288 if causal else n >= 3072  # causal from 16k, non-causal from 4k
        return _ws(dtype, 128, 128, 176 if wide else 128, 2, overlap=True, causal=causal)
    if d == 192:
        if n < 1536:
            return _ws(dtype, 192, 128, 64, 3, overlap=True, causal=causal)
        if n < 3072 and not causal:
            return _ws(dtype, 192, 128, 64, 2, overlap=True, causal=causal)
        return _ws(dtype, 192, 128, 112, 2, overlap=True, causal=causal)
    if n < 768:
        return _ws(dtype, 256, 128, 64, 2, causal=causal)
    return _ws(dtype, 256, 128, 80, 2, overlap=True, causal=causal)


@lru_cache(maxsize=4096)
def classic_hopper_config(dtype: str, d: int, n: int, causal: bool) -> KernelConfig:
    """The sm90 (wgmma, cp.async) kernel's config for head_dim ``d`` at sequence length ``n``: where the
    warp-specialized kernel is not (yet) ahead, and for layouts its TMA loads cannot address.

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


#: The portable backward configs by head dim, largest first: the largest tiles that compile without spilling
#: (docs/kernel-log.md, steps 14-15), then smaller ones for GPUs with less shared memory per block. At
#: head_dim 128, 64 keys by 64 queries on 4 warps takes 74 KB, under the 99 KB of sm_86/sm_89; at 192, 32
#: keys on 2 warps (78 KB). Nothing fits 99 KB at head_dim 256: its K, V, Q and dO tiles alone are 96 KB
#: (dS and the row statistics bring the smallest tile to 100.5 KB), so such GPUs train head_dim 256 through
#: the PyTorch fallback.
_BWD_CANDIDATES = {
    64: (dict(block_q=128, block_kv=128, num_warps=8, split=1, double_buffer=False),),
    128: (
        dict(block_q=64, block_kv=128, num_warps=8, split=1, double_buffer=True),
        dict(block_q=64, block_kv=64, num_warps=4, split=1, double_buffer=False),
    ),
    192: (
        dict(block_q=64, block_kv=64, num_warps=4, split=3, double_buffer=False),
        dict(block_q=64, block_kv=32, num_warps=2, split=3, double_buffer=False),
    ),
    256: (dict(block_q=64, block_kv=64, num_warps=4, split=2, double_buffer=False),),
}


@lru_cache(maxsize=256)
def default_bwd_config(
    dtype: str, head_dim: int, arch: str = "sm_80", *, causal: bool = False, portable: bool = False
) -> BwdConfig | None:
    """The backward config for a problem's dtype and head_dim (padded up to a compiled size) on ``arch``,
    or None when no config of ours fits its shared memory (head_dim 256 on sm_86/sm_89: the caller falls
    back to PyTorch).

    On Hopper every compiled head dim gets a wgmma dK/dV kernel unless ``portable`` (the features the wgmma
    families lack: configs.families): the warp-specialized one at 64 and 128 and the warp-specialized wide
    one at 192 and 256 (csrc/kernels/sm90/bwd_wide_ws; forward+backward 0.81-0.84x the wide kernel's time
    at 256 on an H200, step 126, 0.78-0.81x at 192, step 136), whose dropout and deterministic calls take
    the wide kernel (csrc/kernels/sm90/bwd_wide, ops.select); their producer
    loads Q and dO by TMA (configs.backward.HOPPER_BWD_TMA_DEFAULT, every head_dim and mask now), with dQ's
    writer warps at 64 and 128 (dq_writer).
    Elsewhere the first of the portable candidates whose dK/dV and dQ kernels both fit ``arch``'s opt-in
    shared memory."""
    d = padded_head_dim(head_dim)
    if is_hopper(arch) and not portable and d in (64, 128, 192, 256):
        return hopper_bwd_config(dtype, d, causal=causal)
    limit = smem_optin(arch)
    for fields in _BWD_CANDIDATES[d]:
        cfg = BwdConfig(dtype, d, **fields)
        if max(cfg.smem_bytes, cfg.dq_smem_bytes) <= limit:
            return cfg
    return None
