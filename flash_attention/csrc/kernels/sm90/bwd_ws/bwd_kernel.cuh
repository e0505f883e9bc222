// FlashAttention-2 backward's dK/dV kernel (dQ accumulated in an fp32 workspace) for Hopper (sm_90a),
// warp-specialized: one warpgroup only loads, two only compute.
//
// The matrix products are those of the sm90 wgmma backward (csrc/kernels/sm90/bwd/bwd_kernel.cuh, whose
// comments on the transposed chain S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ = dS K and on
// the operand layouts apply here), written once for both in fa/bwd_wgmma.cuh. What changes is who waits for
// what:
//
// * warpgroup 0, the producer: its 128 threads copy K_j and V_j once, then each query step's Q, dO, base-2
//   LSE and delta into a ring of kStages slots (cp.async into the 128-byte-swizzled panels wgmma reads,
//   fa/copy.cuh's load_tile_rolled, so any row stride works and the call needs no tensor maps: the
//   compiled training node, ops/training.py, replays a backward by patching pointers alone). Each thread
//   waits for its own copies, fences them for the tensor cores (fence.proxy.async) and arrives on the slot's
//   full barrier (128 arrivals complete it); it then waits for the slot it refills to be released. It gives
//   most of its registers to the consumers (setmaxnreg).
// * warpgroups 1 and 2, the consumers: warpgroup c owns keys [64 (c - 1), 64 c) of the block, as in the
//   sm90 kernel. Per step it issues S^T and dP^T as two wgmma groups and computes P = exp2(...) while dP^T
//   is still on the tensor cores (wait_group 1, then 0), writes dS^T to shared memory, issues dV and dK,
//   meets the other consumer warpgroup at one named barrier (both halves of dS^T written), issues its part
//   of dQ = dS K, and releases the slot once all of it has completed.
// * dQ leaves through the copy engine: each consumer warpgroup stages its 64 x 64 fp32 part of dQ in shared
//   memory and one thread adds it into the workspace with a single bulk reduce-add (cp.reduce.async.bulk,
//   fa/tma.cuh) of 16 KB. That needs a contiguous tile at both ends, so this kernel's workspace has the
//   tiled layout of fa/dq_accum.cuh (its convert kernel reads that layout), the staging tile's own register
//   order, so the warps' writes into it are free of bank conflicts. Measured against the alternatives on an
//   H100 (docs/kernel-log.md, step 45): 32 red.global.v2 per thread per step, as the sm90 kernel adds dQ,
//   took 1.11-1.14x the bulk kernel's time at 4k tokens, and one 256-byte bulk reduce per row of the
//   row-major workspace (64 per warpgroup per step, which the compiler issues one lane at a time) 1.5x.
// * kDeterministic (deterministic=True): a fourth warpgroup (warpgroup 1; the consumers are then 2 and 3)
//   holds two writers, the first lanes of its first two warps, one per consumer warpgroup, which add the
//   staged dQ tiles in a fixed order, taking turns on semaphores in the workspace; the walk over the query
//   blocks and the order of the turns are fa/dq_turns.cuh's (docs/kernel-log.md, steps 49 and 76).
// * kDropout: P is kept undropped for dS, with the keep decisions in one bit per element (fa/dropout.cuh).
// * kDqWriter (BwdConfig.dq_writer, the TMA producer's atomic builds; kernel log 133): as in
//   FlashAttention-3/-4's Hopper backward, the reductions leave the consumers' path: warps 2 and 3 of the
//   producer warpgroup (whose Q and dO copies are one thread's TMA) each issue one consumer warpgroup's dQ
//   reduction and wait for the copy engine's read, so a consumer warpgroup stages its tile and arrives
//   (dq_full) instead of meeting at named 2 + c, and waits only for the staging tile to be free (dq_empty)
//   before it rewrites it; warps 0 and 1 copy K, V and the statistics.
//
// Barriers, each for one hazard:
//   full[s]  (mbarrier, one arrival per copying producer thread): slot s holds this use's Q, dO and
//            statistics (and, for the first step, K and V).
//   empty[s] (mbarrier, 256 consumer-thread arrivals): every product that reads slot s has completed, and
//            so have this thread's reads of the slot's statistics. Each thread arrives itself: one lane per
//            warp after __syncwarp orders the same reads, but compute-sanitizer's racecheck does not follow
//            that chain and reported the producer's next copy into the statistics as a race.
//   named 1  (256 consumer threads), once per step: both warpgroups' dS^T rows are written and fenced, so dQ
//            may read them. dS^T is double-buffered: a warpgroup writing buffer (it & 1) at step it is past
//            step it - 1's barrier, and so is the other one, which had then finished step it - 2 (the last
//            reader of that buffer). The thread that issues a warpgroup's dQ reduction also waits there for
//            its previous one to have read the staging tile (bulk_wait_read), so after it the tile may be
//            rewritten.
//   named 2 + c (128 threads of warpgroup c): its dQ tile is staged and fenced; one thread then issues it.
//   dq_full[c], dq_empty[c] (mbarriers, deterministic or kDqWriter, in place of named 2 + c): warpgroup c's
//            tile is staged (128 arrivals, each thread's during the next step: at head_dim 64 after its S^T
//            and dP^T are issued, at 128 after dP^T's wait; the last tile's after the loop) / has been read
//            by the writer's reduction (1 arrival).
//
// Shared memory (bytes from a 1024-aligned base): K (BC x D), V, kStages Q slots, kStages dO slots, two dS^T
// buffers, the two warpgroups' 16 KB dQ staging tiles, kStages slots of statistics (LSE2 then delta, BR
// floats each, and the d128 atomic dropout build's BR row-hash words), then the barriers (and,
// deterministic, each slot's head and first query row). About 200 KB at head_dim 64 and 128 with two slots;
// a third slot (+32 KB) does not fit the 227 KB a block may have.
#pragma once

#include "fa/block_range.cuh"
#include "fa/bwd_params.h"
#include "fa/bwd_preprocess.cuh"
#include "fa/bwd_wgmma.cuh"
#include "fa/copy.cuh"
#include "fa/dq_accum.cuh"
#include "fa/dq_turns.cuh"
#include "fa/dropout.cuh"
#include "fa/frag.cuh"
#include "fa/grid_dependency.cuh"
#include "fa/kv_block_order.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/timeline.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/tma.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

// kTma (BwdConfig.tma_loads): Q and dO arrive by TMA (q_map, do_map: BwdTmaParams' maps in the parameter
// space), issued by the producer's first thread, instead of each producer thread's cp.async rows.
// kWriterWarps (BwdConfig.dq_writer, with kTma): kDqWriter below where the build allows it.
template <class Cfg, class V, bool kDropout = false, bool kDeterministic = false, bool kTma = false,
          bool kWriterWarps = false>
__device__ __forceinline__ void bwd_ws_dkdv_body(const BwdParams& p, const TensorMap* q_map = nullptr,
                                                 const TensorMap* do_map = nullptr) {
  using Mask = typename V::Mask;  // the variant (fa/variant.cuh)
  static_assert(ScoreModHasGradient<typename V::ScoreMod>::value,
                "the backward does not differentiate a score function without its derivative "
                "(kUnitGradient, gradient)");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;   // query rows per step
  constexpr int BC = Cfg::kBlockKV;  // key rows of the block: 64 per consumer warpgroup
  constexpr int NST = Cfg::kStages;
  constexpr int NQ = BR / 8;   // query n-tiles of S^T / dP^T
  constexpr int KQ = BR / 16;  // k-steps of dV / dK
  // dQ per warpgroup: 64 query rows x DQN columns, at row DQ_ROW * wg and column DQ_COL * wg (DqSplit).
  constexpr int DQN = DqSplit<BR, D>::kCols;
  constexpr int DQ_ROW = DqSplit<BR, D>::kRow;
  constexpr int DQ_COL = DqSplit<BR, D>::kCol;
  static_assert(Cfg::kNumWarps == 12 && BC == 128, "a producer and two consumer warpgroups of 64 keys");
  static_assert(DQN == 64, "one staged dQ row is 256 bytes");
  // setmaxnreg moves registers within the block's launch allocation: 384 x 168 = 64512, or in the
  // deterministic mode, whose dQ writers have a warpgroup of their own (warpgroup 1; the consumers are then
  // warpgroups 2 and 3), 512 x 128 = 65536 (configs.backward.WS_REGISTER_SPLIT, DET_WS_REGISTER_SPLIT).
  constexpr int kThreads = kDeterministic ? 512 : 384;
  constexpr int kConsumerBase = kThreads - 256;  // the first consumer thread
  // (not with dropout or a score function with a derivative: at 232 registers those consumers spilled)
  constexpr bool kDqWriter =
      kWriterWarps && kTma && !kDeterministic && !kDropout && V::ScoreMod::kUnitGradient;
  // With kDqWriter the producer warpgroup's two writer warps share its region: at 24 registers the
  // producer spilled 60-88 bytes (NVRTC 13.0), so that build moves 8 registers of each consumer thread to it
  // (40 / 232, configs.backward.WRITER_WS_REGISTER_SPLIT).
  constexpr int kProducerRegs = kDqWriter ? Cfg::kWriterProducerRegs : Cfg::kProducerRegs;
  constexpr int kConsumerRegs =
      kDeterministic ? Cfg::kDetConsumerRegs : kDqWriter ? Cfg::kWriterConsumerRegs : Cfg::kConsumerRegs;
  static_assert(128 * kProducerRegs + (kDeterministic ? 128 * Cfg::kDetWriterRegs : 0) +
                        256 * kConsumerRegs <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "the register split exceeds the block's allocation");
  using QTile = PanelTile<BR>;   // Q and dO in shared memory
  using KVTile = PanelTile<BC>;  // K, V and dS^T
  // The descriptors' offsets as 64-bit adds (fa/wgmma.cuh desc_advance) where the mask does not depend on
  // the row; causal measured slower with them (kernel log 173). The dropout and deterministic builds take
  // them too (0.5-0.7% faster at d64 and d128 deterministic and d64 dropout, level at d128 dropout; 179),
  // but for key ranges with dropout, which then spilled 4-8 bytes.
  constexpr bool kPlainAdd = !Mask::kRowDependent && !(kDropout && Mask::kLowerBound);

  extern __shared__ __align__(16) unsigned char smem[];
  const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
  constexpr u32 kKV = 2 * BC * D;  // bytes of K or V
  constexpr u32 kQ = 2 * BR * D;   // bytes of one Q or dO slot
  constexpr u32 kDS = 2 * BC * BR;
  const u32 sK = base;
  const u32 sV = sK + kKV;
  const u32 sQ = sV + kKV;
  const u32 sdO = sQ + NST * kQ;
  const u32 sdS = sdO + NST * kQ;
  const u32 sdQ = sdS + 2 * kDS;
  // A slot's statistics: LSE2 and delta (BR floats each), and with dropout in the atomic kernel the step's
  // query row hashes (BR words), drawn by the producer so that each consumer thread reads the 16 it needs
  // instead of drawing them (fa/dropout.cuh dropout_stage_row_hashes; kernel log 150). The deterministic
  // kernel draws its keep bits in a loop of its own before the S^T wait and keeps the 8 * BR slot; so does
  // head_dim 64, whose causal dropout build spilled 12 bytes with the staged hashes (0 before; NVRTC 13.0).
  constexpr bool kRowHashes = kDropout && !kDeterministic && D == 128;
  constexpr u32 kStatsSlot = (kRowHashes ? 12 : 8) * BR;
  // Dropout's rp = 1 / (1 - p), folded where it costs once per row or block, not per element: dS takes
  // scale rp as one factor of an FFMA, and dV accumulates P Z, scaled by rp at the epilogue (kernel log
  // 151). Not in head_dim 64's atomic builds, where either fold spilled 12-64 bytes (0 before; NVRTC 13.0);
  // in the deterministic ones it took the spills from 4-84 bytes to 0-8.
  constexpr bool kFoldRp = kDropout && (D == 128 || kDeterministic);
  const u32 sStats = sdQ + 2 * 64 * 64 * 4;  // [slot][LSE2, delta (, row hashes)]
  const u32 bars = sStats + NST * kStatsSlot;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (NST + s); };
  // Deterministic mode: consumer warpgroup w's staged dQ tile is complete (dq_full, its 128 threads) and has
  // been read by the copy engine (dq_empty, the writer thread).
  auto dq_full = [&](int w) { return bars + 8 * (2 * NST + w); };
  auto dq_empty = [&](int w) { return bars + 8 * (2 * NST + 2 + w); };
  // Deterministic mode: slot s's (query head, first query row), written by the producer before it arrives
  // on full[s], so the consumers need not keep the walk's state (fa/dq_turns.cuh) in their registers.
  const u32 sStep = bars + 8 * (2 * NST + 4);
  // The producer warpgroup's copying threads: all of them, or with kDqWriter its first two warps (whole rows
  // of K and V per pass: 64 threads are 4 rows of 16 chunks at head_dim 128, 8 of 8 at 64).
  constexpr int kLoaders = kDqWriter ? 64 : 128;
  const float* const stats = reinterpret_cast<const float*>(smem + (sStats - smem_addr(smem)));
  // The layout above (its mbarriers: full and empty per slot, the deterministic hand-off's four) and the
  // 1 KB the base is rounded up by fit what the launch allocates (configs.backward.BwdConfig.smem_bytes).
  static_assert(1024 + 2 * kKV + 2 * NST * kQ + 2 * kDS + 2 * 64 * 64 * 4 + NST * kStatsSlot +
                        8 * (2 * NST + 4) + 8 * NST <=
                    Cfg::kSmemBytes,
                "the shared-memory layout exceeds the config's smem_bytes");

  const int tid = threadIdx.x;
  if (tid == 0) FA_BLOCK_SPAN_BEGIN(p);  // (FA_BLOCK_SPANS builds only: fa/timeline.cuh)
  // Which block this is, in the order the blocks start (fa/kv_block_order.cuh): causal, the heaviest
  // first within groups of heads; deterministic mode, the last K/V block first, so that the blocks a turn
  // waits for were dispatched before it (fa/dq_turns.cuh).
  const KvBlock at = kv_block_of<kDeterministic, MaskIsCausal<Mask>::value>(p);
  const int n_block = at.n_block;
  const int kv_head = at.kv_head;
  const int batch = at.batch;
  // A packed batch's key-tile table may give the block its keys (below).
  constexpr bool kKeyTiles = MaskIsSegments<Mask>::value && !kDeterministic;
  int kv_start = n_block * BC;
  int kv_rows = p.seqlen_k - kv_start;  // with kKeyTiles: the block's own keys
  // The block's keys (fewer than BC in the last). (Other builds compute it where it is used, as before the
  // table: held from the prologue, it moved ptxas's allocation in three head_dim 64 builds.)
  auto block_keys = [&] { return kKeyTiles ? kv_rows : p.seqlen_k - kv_start; };
  // Query block m holds rows q_origin + m BR ..; its workspace rows (LSE, delta, dQ) are ws_shift further.
  int q_origin = 0, ws_shift = 0;

  // The query blocks [m_begin, m_begin + m_count) that see some key of this block (the variant's mask); the
  // block walks them for every query head of its GQA group, so dK and dV are summed over the group.
  Mask mask(p, batch, kv_head);
  auto blocks = mask.template q_blocks<BR, BC>(p, kv_start);
  // A packed batch with a key-tile table (p.k_tiles and p.q_units, BwdParams says what they hold): block n
  // is keys [k0, k1) of one sequence, so that no block straddles two sequences' keys and walks both
  // sequences' query rows, masked; keys past the tile's end are another tile's, masked whole
  // (SegmentKeys::end_keys_at), loaded as zeros and not stored. Its query blocks are anchored at the
  // sequence's first row (fa/block_range.cuh, q_blocks_anchored) over a workspace laid out by sequence, in
  // which each sequence starts a 128-row block, so a query block is whole 64-row units of the tiled dQ
  // accumulator (fa/dq_accum.cuh) and 16-byte aligned statistics. Rows of a sequence's last block past its
  // end are the next sequence's: masked (the runs), and their workspace rows padding (base-2 LSE +inf).
  // The key tiles alone, with query blocks on the packed row's grid, gained nothing: a straddling tile
  // walks as many query blocks as the two that split it (kernel log 97).
  if constexpr (kKeyTiles) {
    if (p.k_tiles != nullptr) {
      const int4 tile = __ldg(reinterpret_cast<const int4*>(p.k_tiles) + 2 * n_block);
      const int q_end = __ldg(p.k_tiles + 8 * n_block + 4);
      kv_start = tile.x;
      kv_rows = min(tile.y - tile.x, BC);
      q_origin = tile.z;
      ws_shift = tile.w - tile.z;
      if (kv_rows > 0) {
        mask.keys.end_keys_at(kv_start + kv_rows);
        blocks = q_blocks_anchored<BR>(mask.keys, kv_start, kv_start + kv_rows, q_origin, q_end);
      } else {
        blocks.begin = blocks.count = 0;  // the table's unused tail
      }
    }
  }
  const int m_begin = blocks.begin;
  const int m_count = blocks.count;
  const int n_iter = p.group * m_count;
  // The order of the steps. Default: head by head, query blocks upward. Deterministic: fa/dq_turns.cuh's
  // walk (head by head, query blocks upward from the block's own offset), which its turns follow.
  const DqTurns<BR, BC, Mask> turns(mask, blocks, n_block);
  auto head_of = [&](int it) { return kv_head * p.group + (kDeterministic ? turns.head(it) : it / m_count); };
  auto q_start_of = [&](int it) {
    return q_origin + (kDeterministic ? turns.q_block(it) : m_begin + it % m_count) * BR;
  };

  if (tid == 0) {
    for (int s = 0; s < NST; ++s) {
      mbar_init(full(s), kLoaders);
      mbar_init(empty(s), 256);
    }
    if constexpr (kDeterministic || kDqWriter) {
      for (int w = 0; w < 2; ++w) {
        mbar_init(dq_full(w), 128);
        mbar_init(dq_empty(w), 1);
      }
    }
    mbar_init_fence();
  }
  // The only block-wide barrier: the mbarriers are initialised before anyone waits on or arrives at them.
  __syncthreads();

  if constexpr (kDeterministic) {
    if (tid >= 128 && tid < 256) {
      // ---- the dQ writers' warpgroup (deterministic mode) --------------------------------------------------
      setmaxnreg_dec<Cfg::kDetWriterRegs>();
      if (tid == 128 || tid == 160) {
        // ---- a dQ writer (deterministic mode): consumer warpgroup w's tile of every step ---------------
        // Added when this block's turn comes (fa/dq_turns.cuh): the semaphore of (query block, head, lane,
        // w) counts the blocks that have added theirs, and the next block's turn comes once this addition
        // is complete (the fence orders the copy engine's writes before the release). Rejected: confirming
        // the completion a step later, after issuing the next addition, so that the writer never waits for
        // it (measured, H100: 0.76-0.83x of this at head_dim 64, where the next block reaches the same
        // query block one step later and then waits for the late release; +2-3% at 128 non-causal).
        const int w = (tid - 128) / 32;
        grid_dependency_wait();  // (the semaphores and the workspace: the preprocessing kernel's zeros)
        // Addresses from one 32-bit index, the 64-row unit of (batch, head, query row) (fa/dq_accum.cuh:
        // a unit's tiles are 64 x D floats, tile c of its columns 4096 floats in; four semaphores per unit
        // after the lanes), which keeps the writer within its 24 registers.
        int* const sems = dq_semaphore<D>(p, 0, 0, 0, 0, w);
        const int units_per_head = p.seqlen_q_pad / 64;
#pragma unroll 1
        for (int it = 0; it < n_iter; ++it) {
          const DqTurn turn = turns.turn(mask, it);
          const int unit = (batch * p.heads_q + head_of(it)) * units_per_head + turn.m * (BR / 64);
          int* const sem = sems + 4 * unit + 2 * turn.lane;
          float* const tile = dq_lane<D>(p, turn.lane) + (i64)(unit + (DQ_ROW / 64) * w) * (64 * D) +
                              (DQ_COL / 64) * w * 4096;
          mbar_wait_parked(dq_full(w), (u32)(it & 1));
          while (ld_acquire_gpu(sem) != turn.rank) __nanosleep(32);
          fence_proxy_async_global();  // the previous adder's writes before this reduction's
          bulk_reduce_add_f32(tile, sdQ + w * 64 * 64 * 4, 64 * 64 * 4);
          bulk_commit();
          // Read: the consumers may stage the next step's tile. Complete: the next block's turn.
          bulk_wait_read<0>();
          mbar_arrive(dq_empty(w));
          bulk_wait<0>();
          fence_proxy_async_global();
          red_release_gpu_add(sem, 1);
        }
      }
      return;
    }
  }

  if (tid < 128) {
    // ---- producer ----------------------------------------------------------------------------------------
    setmaxnreg_dec<kProducerRegs>();
    if constexpr (kDqWriter) {
      if (tid >= kLoaders) {
        // ---- a dQ writer (kDqWriter): consumer warpgroup w's tile of every step, one lane of warp 2 + w --
        if (tid % 32 == 0) {
          const int w = (tid - kLoaders) / 32;
          grid_dependency_wait();  // (the workspace: the preprocessing kernel's zeros)
#pragma unroll 1
          for (int it = 0; it < n_iter; ++it) {
            const i64 ws_row = workspace_row(p, batch, head_of(it), q_start_of(it) + ws_shift) + DQ_ROW * w;
            mbar_wait_parked(dq_full(w), (u32)(it & 1));
            bulk_reduce_add_f32(p.dq_accum + dq_accum_offset<D, true>(ws_row, DQ_COL * w),
                                sdQ + w * 64 * 64 * 4, 64 * 64 * 4);
            bulk_commit();
            bulk_wait_read<0>();  // the consumers may stage the next step's tile
            mbar_arrive(dq_empty(w));
          }
          bulk_wait<0>();  // (no reduction outlives the block's shared memory)
        }
        return;
      }
    }
#if FA_TIMELINE
    timeline::Recorder tl(p, tid / 32);
#endif
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % NST;
      // The slot's previous use (step it - NST) has been released by every consumer warp.
      if (it >= NST) mbar_wait_parked(empty(s), (u32)((it / NST - 1) & 1));
      FA_TIMELINE_EVENT(tl, kBwdSlotFree, it);
      if (it == 0) {
        const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, kv_start);
        const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, kv_start);
        load_tile_rolled<BC, D, kLoaders, KVTile>(sK, gK, p.k_row_stride, block_keys(), p.head_dim,
                                                  tid);
        load_tile_rolled<BC, D, kLoaders, KVTile>(sV, gV, p.v_row_stride, block_keys(), p.head_dim,
                                                  tid);
      }
      const int head = head_of(it);
      const int q_start = q_start_of(it);
      if constexpr (kTma) {
        // One thread: the slot's expected bytes first (its own arrival, below, keeps the phase open until
        // then), then one box per 64-column panel of Q and of dO. Rows past seqlen_q and columns past
        // head_dim land as zeros, as the copies' zero-fill gives them (the maps' extents).
        // Why TMA (kernel log 130): the cp.async rows cost the producer about 18 instructions per 16-byte copy
        // (addresses, the swizzle, the bounds) -- a third of the d128 kernel's instructions.
        if (tid == 0) {
          mbar_expect_tx(full(s), 2 * kQ);
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            tma_load_4d(sQ + s * kQ + c * BR * 128, q_map, full(s), 64 * c, q_start, head, batch);
            tma_load_4d(sdO + s * kQ + c * BR * 128, do_map, full(s), 64 * c, q_start, head, batch);
          }
        }
      } else {
        const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
        const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
        load_tile_rolled<BR, D, kLoaders, QTile>(sQ + s * kQ, gQ, p.q_row_stride, p.seqlen_q - q_start,
                                                 p.head_dim, tid);
        load_tile_rolled<BR, D, kLoaders, QTile>(sdO + s * kQ, gdO, p.do_row_stride, p.seqlen_q - q_start,
                                                 p.head_dim, tid);
      }
      // Queued programmatically (fa/grid_dependency.cuh), this kernel may start while the preprocessing
      // kernel still runs: K, V and the first step's Q and dO (the forward's inputs) are already on their
      // way, but the statistics (the base-2 LSE and delta) are that kernel's output, so the first step
      // waits for it here, and the other roles at their start (the dQ workspace it zeroes). The entry
      // point does not wait (jit/sources.py).
      if (it == 0) grid_dependency_wait();
      // The workspaces are padded to whole 128-row blocks (laid out by sequence, each sequence's rows): no
      // bounds check.
      const i64 r0 = workspace_row(p, batch, head, q_start + ws_shift);
      if (tid < BR / 4) {
        cp_async_16(sStats + s * kStatsSlot + 16 * tid, p.lse_log2 + r0 + 4 * tid, 16);
      } else if (tid < BR / 2) {
        const int c = tid - BR / 4;
        cp_async_16(sStats + s * kStatsSlot + 4 * BR + 16 * c, p.delta + r0 + 4 * c, 16);
      }
      if constexpr (kRowHashes) {
        // Threads BR / 2 .. BR - 1 (a warp the copies above leave idle): queries 2 c and 2 c + 1 each, stored
        // before this thread's arrival on full[s] publishes them with the copies.
        static_assert(kLoaders >= BR, "a loader thread per pair of rows");
        const int c = tid - BR / 2;
        if (c >= 0 && c < BR / 2)
          dropout_stage_row_hashes(sStats + s * kStatsSlot + 8 * BR + 8 * c,
                                   dropout_head_hash(p.dropout_key, batch * p.heads_q + head),
                                   q_start + 2 * c);
      }
      if (kDeterministic && tid == 0) {
        st_shared_32(sStep + 8 * s, (u32)head);
        st_shared_32(sStep + 8 * s + 4, (u32)q_start);
      }
      cp_async_commit();
      // This thread's copies have landed and are visible to the tensor cores before its arrival publishes
      // them. Waiting here costs nothing the consumers see: the slot's next refill needs their release
      // first, which comes a step later.
      cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(full(s));
      FA_TIMELINE_EVENT(tl, kBwdSlotIssued, it);
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------------------
  setmaxnreg_inc<kConsumerRegs>();
  grid_dependency_wait();  // (the statistics and the dQ workspace: the preprocessing kernel's output)
  const int ctid = tid - kConsumerBase;
  if (ctid == 0) FA_BLOCK_SPAN_READY(p);  // (FA_BLOCK_SPANS builds only)
  const int wg = warpgroup_index() - kConsumerBase / 128;  // this warpgroup's 64 keys of the block
  const int warp = ctid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int row0 = 64 * wg + 16 * (warp % 4);  // the warp's first key row in the block
#if FA_TIMELINE
  timeline::Recorder tl(p, tid / 32);
#endif
  FA_TIMELINE_EVENT(tl, kBwdBlockBegin, 0);

  float dv[D / 2], dk[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dv[i] = dk[i] = 0.f;

  // Descriptors as in the sm90 kernel. K-major tiles: 8-row groups 1024 bytes apart. MN-major tiles:
  // 64-column panels R * 128 bytes apart (the leading byte offset).
  const u64 k_desc = smem_desc_sw128(sK + wg * 64 * 128, 16, 1024);  // A of S^T: this warpgroup's keys
  const u64 v_desc = smem_desc_sw128(sV + wg * 64 * 128, 16, 1024);
  const u64 q_desc = smem_desc_sw128(sQ, 16, 1024);         // B of S^T, dP^T (K-major)
  const u64 qt_desc = smem_desc_sw128(sQ, BR * 128, 1024);  // B of dK, dV (MN-major)
  const u64 ds_desc = smem_desc_sw128(sdS + wg * (DQ_ROW / 64) * BC * 128, BC * 128, 1024);
  const u64 kt_desc = smem_desc_sw128(sK + wg * (DQ_COL / 64) * BC * 128, BC * 128, 1024);
  constexpr u32 kDOOff = NST * kQ;  // dO's slots after Q's
  const u32 sdQ_wg = sdQ + wg * 64 * 64 * 4;
  // exp2's multiplier (fa/variant.cuh backward_score: the scale folded in for the identity).
  const float sl2 = backward_exp2_multiplier<typename V::ScoreMod>(p);
  const float scale = p.scale;
  // (Kernel log 135 measured dK issued a step later, under the next step's exponentials: 1.00-1.09x the
  // time at head_dim 64 and 128, not kept; its code is in the history at 6f58970.)

  // A staged dQ tile goes to its writer (kDqWriter; the deterministic adder) through the proxy fence and an
  // arrival on dq_full. ptxas makes the fence a MEMBAR.ALL.CTA, which holds the warp until the tile's
  // stores have landed, so the tile is published at the next step, where that wait costs least:
  // * the 128-query step (head_dim 64): after S^T and dP^T are issued, so the wait overlaps them rather than
  //   delaying their issue: 1.8-2.5% faster forward+backward, 1.3% deterministic (kernel log 191);
  // * the 64-query step (head_dim 128): after dP^T's wait, with no product in flight. Published after the
  //   issue, as at d64, it measured 2-2.9% slower (191), after S^T's wait 2.2-2.9% slower (192a); here it
  //   is level to 1.3% faster (192). There the early exponentials between S^T's landing and dP^T's are on
  //   the step's critical path, and a fence ahead of them delays them.
  // (Not in the deterministic dropout builds, at their register limit: there it spilled 12-84 bytes.)
  constexpr bool kDeferDqPublish = (kDeterministic || kDqWriter) && !(kDeterministic && kDropout);
  auto publish_dq = [&]() {
    fence_proxy_async();
    mbar_arrive(dq_full(wg));
  };
#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    const int s = it % NST;
    const u32 qoff = s * kQ;
    const u32 dsoff = (it & 1) * kDS;
    mbar_wait(full(s), (u32)((it / NST) & 1));
    FA_TIMELINE_EVENT(tl, kBwdFull, it);
    // (Kept in registers, the deterministic walk's state made ptxas spill inside this loop.)
    const int head = kDeterministic ? (int)ld_shared_32(sStep + 8 * s) : head_of(it);
    const int q_start = kDeterministic ? (int)ld_shared_32(sStep + 8 * s + 4) : q_start_of(it);

    // ---- S^T = K Q^T, dP^T = V dO^T, as two groups: P is computed while dP^T runs ---------------------
    float sc[BR / 2], dp[BR / 2];
    const typename V::ScoreMod score_mod(p, batch, head);
    wgmma_fence();
    issue_key_rows_product<BR, BC, D, BF, kPlainAdd>(sc, k_desc, q_desc, qoff);
    wgmma_commit();
    issue_key_rows_product<BR, BC, D, BF, kPlainAdd>(dp, v_desc, q_desc, kDOOff + qoff);
    wgmma_commit();
    if constexpr (kDeferDqPublish && BR == 128)
      if (it > 0) publish_dq();  // the previous step's staged tile, with S^T and dP^T running

    // Dropout (kDropout; keep mask Z, kept elements scaled by rp = 1 / (1 - p), fa/dropout.cuh): dV takes
    // P Z rp and dS = P (dP Z rp - delta), so P itself stays undropped in `sc` and the decisions wait in one
    // bit per element (register 4 n + e is bit 4 n + e of `keep`). They are drawn while the products are on
    // the tensor cores: in the atomic kernel inside the exponentials' loop below (the form measured in step
    // 48); in the deterministic one here, in a loop that is not unrolled, because there, at 232 registers,
    // the unrolled forms had the compiler draw all sixteen row hashes at once and spill 100-200 bytes
    // inside the loop (NVRTC 13.0).
    u32 keep[kDropout ? BR / 64 : 1] = {};
    if constexpr (kDropout && kDeterministic) {
      const u32 hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
#pragma unroll 1
      for (int n = 0; n < NQ; ++n) {
        // Word n / 8 of `keep` by selects: a run-time index would put the array in local memory.
        const u32 bits = dropout_keep_bits_key_rows<kDropoutKeyPairs<V>>(
                             hh, q_start + 8 * n + 2 * t, kv_start + row0 + g, p.dropout_threshold)
                         << (4 * (n % 8));
#pragma unroll
        for (int w = 0; w < BR / 64; ++w) keep[w] |= n / 8 == w ? bits : 0u;
      }
    }
    wgmma_wait<1>();  // (dP^T may still run)
    wgmma_hold(sc);
    FA_TIMELINE_EVENT(tl, kBwdSLanded, it);

    // ---- P^T: the mask (keys past seqlen_k, the causal diagonal), then exp2 against the saved LSE ---------
    // Register 4 n + e is key kv_start + row0 + g + 8 (e / 2) against query q_start + 8 n + 2 t + e % 2.
    // Queries past seqlen_q need no mask: their base-2 LSE is +inf, so their P is 0.
    // A score function (fa/variant.cuh) on the scaled scores first, as the forward applies it.
    score_mod_key_rows(acc_tile(sc), score_mod, scale, kv_start, row0, q_start, g, t);
    // The segments' tile test keeps its two bounds in registers at head_dim 128 in the atomic kernel: per
    // block, their loads sat after the wait for S^T (bench --varlen's documents, H200: 0.988x causal, 0.991x
    // non-causal backward kept; kernel log 98). Elsewhere the three registers spill (NVRTC 13.0): head_dim
    // 64 12-212 -> 12-244 bytes, the deterministic kernel at 128 4-48 -> 24-60, and ALiBi measured from
    // the runs (its diagonal loads) 0 -> 4, reloaded in the loop.
    // (Asked of the segments' policy alone: the variant interface's mask_key_rows takes no such flag.)
    constexpr bool kKeepMaskBounds = MaskIsSegments<Mask>::value && D == 128 && !kDeterministic &&
                                     !ScoreModLoadsDiagonal<typename V::ScoreMod>::value;
    if constexpr (kKeepMaskBounds)
      mask.template mask_key_rows<true>(acc_tile(sc), kv_start, row0, q_start, g, t);
    else
      mask.mask_key_rows(acc_tile(sc), kv_start, row0, q_start, g, t);
    const float* lse_s = stats + s * (kStatsSlot / 4);
    const float* del_s = lse_s + BR;
    const u32* rh_s = reinterpret_cast<const u32*>(lse_s + 2 * BR);  // (kRowHashes)
    u32 head_hash = 0;
    if constexpr (kDropout && !kDeterministic && !kRowHashes)
      head_hash = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
    // A score function with a derivative (soft-capping), without dropout: the derivative is taken here, from
    // the modified score itself, and P is packed for dV at once, so that sc can hold P times the derivative
    // for dS. Recovering the score from P after the wait for dP instead cost a MUFU.LG2 per score, a third
    // SFU operation beside the tanh and the exponential (kernel log 95); pf's 16 registers now live across
    // that wait. (Not in the deterministic kernel at head_dim 64, whose consumers have the fewest registers:
    // there the 16 spilled 16-24 -> 84-88 bytes, where at 128 they took it from 44 to 4.)
    constexpr bool kGradAtP = !V::ScoreMod::kUnitGradient && !kDropout && !(kDeterministic && D < 128);
    // P's exponentials: Cfg::kExpPoly eighths of them (the rows 8 n + 2 t of n % 8 below it) as a polynomial
    // on the FMA pipe, the rest on the SFU, whose 16 a clock per multiprocessor make 512 cycles of a d128
    // step's 8,192 (fa/ptx.cuh exp2_share; BwdConfig.exp_poly, kernel log 138).
    auto exp2_p = [](int n, float x) { return exp2_share<Cfg::kExpPoly, BF>(n, x); };
    u32 pf[KQ][4], sf[KQ][4];
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * t);
      if constexpr (kGradAtP) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = sc[4 * n + e];
          pr[e] = exp2_p(n, fmaf(x, sl2, -((e & 1) ? l2.y : l2.x)));
          // (score_mod_for_key: with per-row slopes, the key row's; its loads are the CTA's, hoisted)
          const int key = kv_start + row0 + g + 8 * (e >> 1);
          sc[4 * n + e] = pr[e] * backward_gradient(score_mod_for_key(score_mod, key), x, pr[e],
                                                    q_start + 8 * n + 2 * t + (e & 1), key);
        }
        // (pf's layout, pack_p_ds's: register pair r of k-step ks is elements 8 ks + 2 r and + 1)
        pf[n / 2][2 * (n % 2)] = pack2<BF>(pr[0], pr[1]);
        pf[n / 2][2 * (n % 2) + 1] = pack2<BF>(pr[2], pr[3]);
        continue;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[4 * n + e] = exp2_p(n, fmaf(sc[4 * n + e], sl2, -((e & 1) ? l2.y : l2.x)));
      if constexpr (kDropout && !kDeterministic) {
        // (Not the deterministic path's dropout_keep_bits_key_rows, the same bits as one word shifted into
        // place: here that form compiled to 32-520 more instructions per build, NVRTC 13.0.)
        u32 hr[2];
        if constexpr (kRowHashes) {
          const uint2 h2 = *reinterpret_cast<const uint2*>(rh_s + 8 * n + 2 * t);
          hr[0] = h2.x;
          hr[1] = h2.y;
        } else {
          hr[0] = dropout_row_hash(head_hash, q_start + 8 * n + 2 * t);
          hr[1] = dropout_row_hash(head_hash, q_start + 8 * n + 2 * t + 1);
        }
        bool keep4[4];
        dropout_keep_key_rows<kDropoutKeyPairs<V>>(keep4, hr, kv_start + row0 + g, p.dropout_threshold);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (keep4[e]) keep[(4 * n + e) / 32] |= 1u << ((4 * n + e) % 32);
      }
    }
    // Element i's keep decision (Z); rp as kFoldRp says.
    auto kept = [&](int i) { return !kDropout || ((keep[i / 32] >> (i % 32)) & 1u); };
    const float rp = kDropout && !kFoldRp ? p.dropout_rp : 1.f;
    const float scale_rp = kFoldRp ? scale * p.dropout_rp : scale;
    // While dP^T is still on the tensor cores, what the phase after its wait needs and P alone gives: the
    // tensor cores idle from dP^T's end until dV is issued (both warpgroups pass that phase at once), so
    // that phase should hold only dS's arithmetic, its packing and its store. With the TMA producer, at 64
    // queries per step (16 + 16 more registers live across the wait), without dropout, with a score function
    // of unit gradient and not in the deterministic kernel (its consumers spilled 24-44 bytes with it):
    // delta times the scale is loaded, and P packed for dV, here, and dS is one FFMA and one FMUL per element
    // (below). Measured (kernel log 132, H200, fwd+bwd 4 x 4096 x 16): d128 causal (TMA producer) 0.958x
    // time; with the cp.async producer, d128 non-causal 1.033x and d64 1.012x, so those keep the previous
    // form. Pinning the exponentials above the wait as well (an XOR of the packed P read by a store that
    // never runs: ptxas otherwise sinks the MUFU.EX2 below it) measured slower again: 0.986x and 1.047x.
    constexpr bool kEarly =
        kTma && BR == 64 && !kDropout && !kGradAtP && V::ScoreMod::kUnitGradient && !kDeterministic;
    float2 dls[kEarly ? NQ : 1];
    if constexpr (kEarly) {
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        const float2 dl = *reinterpret_cast<const float2*>(del_s + 8 * n + 2 * t);
        dls[n] = make_float2(dl.x * scale, dl.y * scale);
      }
      pack_acc<BR, BF>(pf, sc);
    }
    FA_TIMELINE_EVENT(tl, kBwdExpDone, it);
    wgmma_wait<0>();
    wgmma_hold(dp);
    if constexpr (kDeferDqPublish && BR == 64)
      if (it > 0) publish_dq();  // the previous step's staged tile, with nothing in flight (kernel log 192)
    FA_TIMELINE_EVENT(tl, kBwdDPLanded, it);

    // ---- dS^T = scale P^T (dP^T Z rp - delta) -------------------------------------------------------------
    // (kEarly: as P^T (scale dP^T - scale delta), one FFMA and one FMUL per element, the scaled delta loaded
    // before the wait)
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const float2 dl = kEarly ? dls[n] : *reinterpret_cast<const float2*>(del_s + 8 * n + 2 * t);
      float2 l2 = make_float2(0.f, 0.f);  // (the score function's derivative recovers its score from P)
      if constexpr (!V::ScoreMod::kUnitGradient && !kGradAtP)
        l2 = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * n + e;
        const float d = (e & 1) ? dl.y : dl.x;
        // (kGradAtP: sc is P times the derivative)
        if constexpr (kFoldRp) {
          // P (dP Z rp - delta) scale as P (dP Z (scale rp) - delta scale): a select, an FFMA and a product,
          // where dP Z rp took a product and a select before the subtraction and two products.
          const float dz = kept(i) ? dp[i] : 0.f;
          dp[i] = sc[i] * fmaf(dz, scale_rp, -d * scale);
        } else if constexpr (kDropout) {
          const float dpz = kept(i) ? dp[i] * rp : 0.f;
          dp[i] = sc[i] * (dpz - d) * scale;
        } else {
          dp[i] = kEarly ? sc[i] * fmaf(dp[i], scale, -d) : sc[i] * (dp[i] - d) * scale;
        }
        if constexpr (!V::ScoreMod::kUnitGradient && !kGradAtP) {
          const int key = kv_start + row0 + g + 8 * (e >> 1);  // (key rows: fa/mask.cuh)
          const float lse2 = (e & 1) ? l2.y : l2.x;
          dp[i] *= score_mod_gradient_from_p(score_mod_for_key(score_mod, key), sc[i], lse2,
                                             q_start + 8 * n + 2 * t + (e & 1), key);
        }
      }
    }
    if constexpr (kGradAtP) {
#pragma unroll
      for (int ks = 0; ks < KQ; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) sf[ks][r] = pack2<BF>(dp[8 * ks + 2 * r], dp[8 * ks + 2 * r + 1]);
    } else if constexpr (kDropout) {
      // The dropped P for dV: P Z (kFoldRp: rp at the epilogue), else P Z rp.
#pragma unroll
      for (int ks = 0; ks < KQ; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 8 * ks + 2 * r;
          pf[ks][r] = pack2<BF>(kept(i) ? sc[i] * rp : 0.f, kept(i + 1) ? sc[i + 1] * rp : 0.f);
          sf[ks][r] = pack2<BF>(dp[i], dp[i + 1]);
        }
    } else if constexpr (kEarly) {
      pack_acc<BR, BF>(sf, dp);  // (pf was packed before the wait)
    } else {
      pack_p_ds<BR, BF>(pf, sf, sc, dp);
    }

    // dS^T to shared memory for dQ (fa/bwd_wgmma.cuh), this step's buffer.
    store_ds_t<BR, BC>(sdS + dsoff, sf, row0, lane);

    // ---- dV += P^T dO (group A) while the warpgroups meet below; then dQ (B) and dK (C) -----------------
    // dQ is issued before dK so that it lands first (wgmma groups complete in order): its staging, fence,
    // barrier and reduction then run while dK is on the tensor cores, instead of after all three products
    // with the tensor cores idle (the order of FlashAttention-3's and -4's Hopper backward;
    // docs/backward-study.md, stage 1).
    wgmma_fence();
    issue_key_rows_acc<BR, D, BF, kPlainAdd>(dv, pf, qt_desc, kDOOff + qoff);
    wgmma_commit();
    // dS^T's proxy fence after dV's issue, not before it: ptxas makes the fence a MEMBAR.ALL.CTA, which
    // holds the warp until its stmatrix stores have landed, and dV (P from registers, dO from the slot)
    // does not read dS^T; only dQ, after barrier 1, does. With the fence first, dV waited for the stores
    // (2% of the d64 loop's stall samples sat on the fence and dV's wgmma fence); dV first is 1.7-3.3%
    // faster forward+backward at d128 non-causal (kernel log 189). dV issued before the stores as well
    // measured 17-24% slower at d128.
    fence_proxy_async();
    FA_TIMELINE_EVENT(tl, kBwdDSStored, it);

    // The staging tile of this warpgroup's previous dQ has been read by the copy engine (the thread that
    // issued that reduction waits), and both warpgroups' dS^T of this step is written.
    if (!kDeterministic && !kDqWriter && ctid % 128 == 0) bulk_wait_read<0>();
    named_barrier_sync(1, 256);
    FA_TIMELINE_EVENT(tl, kBwdMet, it);

    // ---- dQ = dS K (this warpgroup's 64 x DQN part), then dK += dS^T Q ------------------------------------
    float dq[DQN / 2];
    wgmma_fence();
    issue_dq<BC, DQN, BF, kPlainAdd>(dq, desc_advance<kPlainAdd>(ds_desc, dsoff), kt_desc);
    wgmma_commit();
    issue_key_rows_acc<BR, D, BF, kPlainAdd>(dk, sf, qt_desc, qoff);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ have landed; dK may still run
    wgmma_hold(dq);
    wgmma_hold(dv);
    FA_TIMELINE_EVENT(tl, kBwdDQLanded, it);

    // ---- dQ out: a staged 64 x 64 tile, then one bulk reduce-add of it (fa/dq_accum.cuh, tiled) --------
    // Deterministic: the writer thread adds it when this block's turn comes; kDqWriter: at once. Either way
    // it must have read the previous tile first.
    if constexpr (kDeterministic || kDqWriter)
      if (it > 0) mbar_wait(dq_empty(wg), (u32)((it - 1) & 1));
    // In the warpgroup's register order (fa/dq_accum.cuh): eight 16-byte stores, consecutive threads to
    // consecutive chunks. (Before kernel log 127: sixteen 8-byte stores into a swizzled row-major tile, from
    // four per-thread addresses.)
    const u32 stage[1] = {sdQ_wg};
    stage_dq_tiles<DQN>(stage, dq, ctid % 128);
    if constexpr (kDeterministic || kDqWriter) {
      if constexpr (!kDeferDqPublish) publish_dq();
    } else {
      fence_proxy_async();
      named_barrier_sync(2 + wg, 128);
      if (ctid % 128 == 0) {
        // The warpgroup's tile: rows [DQ_ROW wg, + 64) of the query block, columns [DQ_COL wg, + 64).
        const i64 ws_row = workspace_row(p, batch, head, q_start + ws_shift) + DQ_ROW * wg;
        bulk_reduce_add_f32(p.dq_accum + dq_accum_offset<D, true>(ws_row, DQ_COL * wg), sdQ_wg, 64 * 64 * 4);
        bulk_commit();
      }
    }
    FA_TIMELINE_EVENT(tl, kBwdDQOut, it);
    wgmma_wait<0>();
    wgmma_hold(dk);
    FA_TIMELINE_EVENT(tl, kBwdStepEnd, it);
    // Every product reading slot s (S^T, dP^T, dV, dK) and this step's dS^T buffer has completed.
    mbar_arrive(empty(s));
  }
  if constexpr (kDeferDqPublish)
    if (n_iter > 0) publish_dq();  // the last step's tile
  // No reduction may outlive the shared memory it reads.
  if (!kDeterministic && !kDqWriter && ctid % 128 == 0) bulk_wait<0>();

  // ---- epilogue: dK and dV through K's and V's tiles (the softmax scale is already in dS) ----------------
  // Once both warpgroups are here, every product that reads K (S^T, both warpgroups' dQ) or V (dP^T) has
  // completed: each waited for all of its own (wgmma_wait<0>) at the end of its last step. Each warp then
  // stages its 16 key rows of dK into K's tile and of dV into V's (fa/bwd_wgmma.cuh, stage_key_rows) and,
  // once its lanes' writes are ordered before their reads (__syncwarp), copies those rows out itself in
  // 16-byte chunks, so no second barrier. Why: stored from registers (store_dk_dv) the rows took 128
  // st.global.b32 per thread of 8 rows each, 9,244 cycles from the last step's end to the last store's issue
  // at 4 x 1024 x 32 x 128 causal, 13% of a block there with the block's start (tools/bwd_timeline.py, H200;
  // kernel log 147).
  if constexpr (kFoldRp) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dv[i] *= p.dropout_rp;  // (dV accumulated P Z: kernel log 151)
  }
  named_barrier_sync(1, 256);
  stage_key_rows<D, BF>(sK, dk, row0, lane);
  stage_key_rows<D, BF>(sV, dv, row0, lane);
  __syncwarp();
  copy_out_key_rows<16, D, 32>(static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start),
                               p.dk_row_stride, block_keys(), p.head_dim, sK, row0, lane);
  copy_out_key_rows<16, D, 32>(static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start),
                               p.dv_row_stride, block_keys(), p.head_dim, sV, row0, lane);
  FA_TIMELINE_EVENT(tl, kBwdBlockEnd, n_iter);
  if (ctid % 128 == 0) FA_BLOCK_SPAN_END(p, wg, n_iter);
}

}  // namespace sm90
}  // namespace fa
