// FlashAttention forward for Hopper (sm_90a), warp-specialized: one warpgroup only loads, the others only
// compute. The matrix products, masks and online softmax are those of the sm90 wgmma kernel
// (csrc/kernels/sm90/fwd/fwd_kernel.cuh), whose comments on the wgmma operand layouts apply here.
//
// Roles (Cfg::kNumWarps = 4 + 4 * NC, NC = kBlockQ / 64 consumer warpgroups):
// * warpgroup 0, the producer: one thread issues every TMA load (Q once, then K_j and V_j into a ring of
//   kStages buffers) and waits only for buffers to come free. It gives its registers back (setmaxnreg.dec)
//   and its other 127 threads leave at once.
// * warpgroups 1..NC, the consumers: warpgroup c owns query rows [64 (c - 1), 64 c) of the block. Each
//   waits for a tile to land, computes S = Q K_j^T, the mask and the softmax step, then O += P V_j, and
//   releases the ring slot when its matrix products have read it. They take the producer's registers
//   (setmaxnreg.inc): the 64 x kHeadDim O and 64 x kBlockKV S accumulators of a thread are 128 of its
//   registers at head_dim 128.
// Loads no longer come from the computing warps (the sm90 kernel's cp.async needed every thread to
// issue, fence and meet at a block barrier per tile): a TMA load is one instruction per 64-column panel,
// its completion a transaction count on an mbarrier, and the only block-wide barrier is the one after
// the barriers' initialisation.
//
// Shared memory: Q (kBlockQ rows), kStages K tiles, kStages V tiles, each in 64-column panels with the
// 128-byte swizzle (the TMA unit writes that layout itself), persistent an output staging tile, then the
// mbarriers. Per ring slot s: k_full[s] and v_full[s] complete when the producer's expected bytes landed
// (one arrival, its own), and k_empty[s] / v_empty[s] when every consumer warp has finished reading the
// slot's K / V (4 NC arrivals). K and V are freed apart: a slot's K is read by S = Q K^T, which completes
// a softmax before the P V that reads its V, so the producer can refill K early. With the overlapped
// schedule (one slot's V is read while the next slot's S is computed) this lets a two-deep ring keep the
// next K in flight; one barrier for both made the producer wait for the later of the two reads
// (docs/kernel-log.md, step 34). q_full completes when a query tile landed; q_empty (persistent) when
// every consumer thread is past the tile's last S = Q K^T, so the next Q may land over it.
//
// Tiles (Cfg::kPersistent): one query tile per block as the grid says, or a persistent grid of one block
// per multiprocessor taking tiles dynamically (below, "The tile schedule"). The K/V ring runs on across
// tiles, so the producer loads the next tile's Q and first K/V blocks while the consumers finish the
// current one, whose output goes through its own staging buffer.
//
// Debug build (FA_TRACE, fa/trace.cuh): one consumer warp of the traced tile records what it reads and
// computes. Q and K_j are read back from shared memory as soon as S_j has landed, before the warp releases
// K_j's slot (and, after the tile's last S, the Q buffer); M, alpha, L and P in the softmax step; V_j and O
// once P_j V_j has completed (in the overlapped schedule, inside step j + 1 or after the loop), before V_j's
// slot is released and O is rescaled again. Nothing of it is in the normal build.
#pragma once

#include "fa/block_range.cuh"
#include "fa/config_check.h"
#include "fa/dropout.cuh"
#include "fa/epilogue.cuh"
#include "fa/frag.cuh"
#include "fa/fwd_wgmma.cuh"
#include "fa/mask.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/softmax.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/timeline.cuh"
#include "fa/tma.cuh"
#include "fa/trace.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class V, bool kDropout = false>
__device__ __forceinline__ void fwd_ws_body(const FwdTmaParams& tp) {
  static_assert(check_config<Cfg>::ok, "");
  static_assert(Cfg::kWgmma && Cfg::kWarpSpecialized, "the warp-specialized kernel runs ws configs only");
  using Mask = typename V::Mask;  // the variant's policies (fa/variant.cuh)
  constexpr bool kFold = kFoldsScale<V, true>;
  // The output through TMA stores (the epilogue says how), except in the dropout builds: there NVRTC's
  // register allocation of the largest tiles (head_dim 128 x 176 keys, 256 x 80) spilled 52-96 bytes with
  // it and none without, whichever of the two epilogue schedules below the store took.
  constexpr bool kTmaStore = Cfg::kTmaStore && !kDropout;
  // A tile's epilogue deferred to run under the next tile's first S = Q K^T (the tile loop says how). Not
  // in the trace build, whose tracer is the tile's own (there the epilogue runs at the tile's end, and the
  // traced values are the same), nor in the dropout builds (NVRTC spilled 28-68 bytes with it).
  constexpr bool kTileOverlap = Cfg::kTileOverlap && !FA_TRACE && !kDropout;
  const FwdParams& p = tp.p;
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int NST = Cfg::kStages;
  constexpr int NC = BR / 64;  // consumer warpgroups
  constexpr int NT = Cfg::kNumWarps * 32;
  constexpr int NCT = NC * 128;  // consumer threads
  constexpr int NS = BC / 8;     // 8-column n-tiles of S
  constexpr int KS = BC / 16;    // k-steps of O += P V
  constexpr int NO = D / 8;      // 8-column n-tiles of O
  constexpr int NP = D / 64;     // 64-column panels of a tile
  static_assert(NT == 128 * (NC + 1), "a producer warpgroup and one consumer warpgroup per 64 query rows");
  // setmaxnreg moves registers within the block's launch allocation (NT x the launch bound's per-thread
  // count): a split asking for more than that makes the consumers wait forever (configs.register_split).
  static_assert(128 * Cfg::kProducerRegs + (NT - 128) * Cfg::kConsumerRegs <= NT * (65536 / NT / 8 * 8),
                "the register split exceeds the block's allocation");

  // Tiles start on 1024-byte boundaries (the 128-byte swizzle's period, assumed by TMA and the wgmma
  // descriptors alike); the dynamic window is only 16-byte aligned, so the block asks for 1 KB more.
  extern __shared__ __align__(16) unsigned char smem[];
  // (kSumPackedP and kSumOnCudaCores below; early, as the ones tile is set up with the barriers)
  constexpr bool kSumPackedPOnes =
      BF && !Cfg::kPingpong && ScoreModBounded<typename V::ScoreMod>::value && !kDropout && D <= 128;
  const u32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
  // Q buffers: with tile_overlap two, the tiles taking turns, so that the next tile's Q is loaded as soon
  // as the producer reaches that tile (a ring depth ahead of the consumers) rather than when every consumer
  // is past this tile's last S: the deferred epilogue runs under the next tile's first S, which needs that
  // Q, and with one buffer the Q arrived after the epilogue would have run (kernel-log step 63).
  constexpr int NQ = Cfg::kTileOverlap ? 2 : 1;
  constexpr u32 kQBytes = 2 * BR * D;  // bytes of one Q buffer
  constexpr u32 kTile = 2 * BC * D;    // bytes of one K or V tile
  const u32 sK = sQ + NQ * kQBytes;
  const u32 sV = sK + NST * kTile;
  // Persistent: the output is staged in a buffer of its own (each consumer warpgroup its 64 rows as a
  // PanelTile<64>), so the next tile's Q can land while this one's output is written out.
  const u32 sO = sV + NST * kTile;
  constexpr u32 kOBytes = Cfg::kPersistent ? 2 * BR * D : 0;
  // 8 bytes each: q_full[NQ], q_empty[NQ], k_full[NST], v_full[NST], k_empty[NST], v_empty[NST] (at most
  // 20: 160 of the 256 bytes configs.forward.smem_bytes reserves), then (persistent) the index of the tile
  // in each Q buffer (4 bytes each).
  const u32 bars = sO + kOBytes;
  auto q_full = [&](int b) { return bars + 8 * b; };
  auto q_empty = [&](int b) { return bars + 8 * (NQ + b); };
  auto k_full = [&](int s) { return bars + 8 * (2 * NQ + s); };
  auto v_full = [&](int s) { return bars + 8 * (2 * NQ + NST + s); };
  auto k_empty = [&](int s) { return bars + 8 * (2 * NQ + 2 * NST + s); };
  auto v_empty = [&](int s) { return bars + 8 * (2 * NQ + 3 * NST + s); };
  auto s_tile = [&](int b) { return bars + 8 * (2 * NQ + 4 * NST) + 4 * b; };

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int b = 0; b < NQ; ++b) {
      mbar_init(q_full(b), 1);
      mbar_init(q_empty(b), NCT);
    }
    for (int s = 0; s < NST; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), 4 * NC);
      mbar_init(v_empty(s), 4 * NC);
    }
    mbar_init_fence();
  }
  // The bounded softmax's L_r on the tensor cores (kSumPackedPOnes builds): P V's P fragments against a 16 x 8
  // tile of bf16 ones (0x3F80). With both of its descriptor's strides 0 every core matrix of the B operand
  // is these 128 bytes, so the tile needs no more room than one core matrix. Written by the generic proxy
  // and read by wgmma (the async proxy): fenced before the barrier below.
  __shared__ __align__(128) unsigned s_ones[kSumPackedPOnes ? 32 : 1];
  if constexpr (kSumPackedPOnes) {
    if (threadIdx.x < 32) s_ones[threadIdx.x] = 0x3F803F80u;
    fence_proxy_async();
  }
  // The only block-wide barrier: the mbarriers are initialised before anyone waits on or completes them.
  __syncthreads();

  // The tile schedule. Non-persistent: the block's one tile, from blockIdx. Persistent: block b starts
  // with tile b and then takes the next tile nobody has taken (tp.tile_counter, zeroed per launch: an
  // atomic add by the producer), in the non-persistent grid's order. The tiles in flight at any time are
  // then a window of consecutive tiles, as the hardware's own block scheduler would run them: the K/V
  // heads they read stay in L2, and a block that drew short causal tiles takes more of them. (A static
  // stride, block b taking b, b + gridDim.x, ..., lost 3-35% on causal shapes: kernel-log step 30.)
  // The producer decides and tells the consumers through shared memory (s_tile), published by its arrival
  // on q_full; an index past the last tile tells them to stop.
  const int num_tiles = p.num_m_blocks * p.heads_q * p.batch;
  struct Tile {
    int m_block, head, batch;
  };
  auto tile_at = [&](int tile) -> Tile {
    if constexpr (!Cfg::kPersistent) return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
    const int bh = tile / p.num_m_blocks;
    return {tile - bh * p.num_m_blocks, bh % p.heads_q, bh / p.heads_q};
  };
  // (Where later query blocks see more keys, causal: the longest, the last ones, first.)
  auto m_block_of = [&](const Tile& x) { return Mask::kRowDependent ? p.num_m_blocks - 1 - x.m_block : x.m_block; };
  // A packed batch (the segments build) with a tile table (p.q_tiles, FwdParams says what it holds): tile m
  // is rows [q_tiles[2 m], q_tiles[2 m + 1]) of one sequence, in the table's order (longest first), and
  // its K/V blocks are anchored at its first visible key (fa/block_range.cuh, kv_blocks_anchored), so that
  // no tile straddles two sequences' rows nor a block two sequences' keys. Without a table, tile m is
  // rows m BR .. of the packed row, as in a dense batch.
  constexpr bool kSegments = MaskIsSegments<Mask>::value;
  const bool seq_tiles = kSegments && p.q_tiles != nullptr;
  struct Rows {
    int start, count;  // the tile's first query row and how many of its BR rows are its own
  };
  auto rows_of = [&](const Tile& x) -> Rows {
    if constexpr (kSegments) {
      if (seq_tiles) {
        const int start = __ldg(p.q_tiles + 2 * x.m_block);
        return {start, min(__ldg(p.q_tiles + 2 * x.m_block + 1) - start, BR)};
      }
    }
    const int start = m_block_of(x) * BR;
    return {start, min(BR, p.seqlen_q - start)};
  };
  // The K/V blocks of a tile's rows, and the key at which block 0 starts (`origin`).
  auto blocks_of = [&](const Mask& mask, const Rows& rows, int& origin) {
    origin = 0;
    if constexpr (kSegments) {
      if (seq_tiles) return kv_blocks_anchored<BC>(mask.keys, rows.start, rows.count, origin);
    }
    return mask.template kv_blocks<BC>(rows.start, rows.count);
  };

  const int wg = tid / 128;
  if (wg == 0) {
    // ---- producer --------------------------------------------------------------------------------------
    // The producer keeps a few dozen registers and the consumers take the rest (Cfg::kProducerRegs /
    // kConsumerRegs: configs.forward.register_split says why these numbers).
    if constexpr (Cfg::kProducerRegs > 0) setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid != 0) return;
#if FA_TIMELINE
    timeline::Recorder tl(p, 0);  // (fa/timeline.cuh: the timeline build's event stamps)
#endif
    tma_prefetch_map(&tp.k_map);
    tma_prefetch_map(&tp.v_map);
    int ring = 0;     // K/V blocks loaded so far (slot ring % NST, its use ring / NST)
    int q_loads = 0;  // q_full completions so far (persistent: one per tile, empty tiles included)
    int tile = Cfg::kPersistent ? (int)blockIdx.x : 0;
    for (;;) {
      if constexpr (Cfg::kPersistent) {
        // A Q buffer (and its s_tile) is free once every consumer thread is past the last S = Q K^T of the
        // tile that used it before (which also means it has read that tile's index): the (q_loads / NQ)-th
        // use of buffer q_loads % NQ waits for the previous use's q_empty completion.
        if (q_loads >= NQ) mbar_wait(q_empty(q_loads % NQ), ((q_loads - NQ) / NQ) & 1);
        st_shared_32(s_tile(q_loads % NQ), (u32)tile);
        if (tile >= num_tiles) {
          mbar_arrive(q_full(q_loads % NQ));  // no bytes: the consumers read the stop sign and leave
          // The counter is the stream's, kept by ops from launch to launch (a fill kernel per call cost a
          // launch: 2.4 us beside a 280 us kernel at 1k tokens). Each block's producer draws until it gets
          // a stop sign, then counts itself done in tile_counter[1]; the last one finds every draw made
          // and zeroes both for the next launch, which stream order puts after this one.
          if ((int)gridDim.x < num_tiles) {
            __threadfence();  // this block's last draw is performed before it counts itself done
            if (atomicAdd(tp.tile_counter + 1, 1) == (int)gridDim.x - 1) {
              tp.tile_counter[0] = 0;
              tp.tile_counter[1] = 0;
            }
          }
          break;
        }
      }
      // The tile after this one, asked for now so the atomic's round trip hides behind this tile's loads.
      // (With no more tiles than blocks there is no counter: ops passes none.)
      const int next = Cfg::kPersistent && (int)gridDim.x < num_tiles
                           ? (int)gridDim.x + atomicAdd(tp.tile_counter, 1)
                           : num_tiles;
      const Tile x = tile_at(tile);
      const Rows rows = rows_of(x);
      const int q_start = rows.start;
      const Mask mask(p, x.batch, x.head);
      int origin;
      const auto blocks = blocks_of(mask, rows, origin);
      const int n_iter = blocks.end - blocks.begin;
      const int qb = q_loads % NQ;  // this tile's Q buffer
      if (n_iter <= 0) {
        // The consumers write its empty output without any load; persistent, they still need the index.
        if constexpr (Cfg::kPersistent) mbar_arrive(q_full(qb));
        ++q_loads;
      } else {
        mbar_arrive_expect_tx(q_full(qb), kQBytes);
#pragma unroll
        for (int pn = 0; pn < NP; ++pn)
          tma_load_4d(sQ + qb * kQBytes + pn * BR * 128, &tp.q_map, q_full(qb), 64 * pn, q_start, x.head,
                      x.batch);
        FA_TIMELINE_EVENT(tl, kQIssued, tile);
        ++q_loads;
        const int kv_head = x.head / p.group;
        for (int it = 0; it < n_iter; ++it, ++ring) {
          const int s = ring % NST;
          // The slot's previous K (load ring - NST) must have been read by every consumer warp: that was
          // the (ring / NST - 1)-th completion of k_empty[s]; the same for V below.
          const u32 reuse = (ring / NST - 1) & 1;
          if (ring >= NST) mbar_wait(k_empty(s), reuse);
          const int row = origin + (blocks.begin + it) * BC;
          mbar_arrive_expect_tx(k_full(s), kTile);
#pragma unroll
          for (int pn = 0; pn < NP; ++pn)
            tma_load_4d(sK + s * kTile + pn * BC * 128, &tp.k_map, k_full(s), 64 * pn, row, kv_head, x.batch);
          FA_TIMELINE_EVENT(tl, kKIssued, ring);
          if (ring >= NST) mbar_wait(v_empty(s), reuse);
          mbar_arrive_expect_tx(v_full(s), kTile);
#pragma unroll
          for (int pn = 0; pn < NP; ++pn)
            tma_load_4d(sV + s * kTile + pn * BC * 128, &tp.v_map, v_full(s), 64 * pn, row, kv_head, x.batch);
          FA_TIMELINE_EVENT(tl, kVIssued, ring);
        }
      }
      if constexpr (!Cfg::kPersistent) break;
      tile = next;
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------------------
  if constexpr (Cfg::kConsumerRegs > 0) setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int ctid = tid - 128;  // thread index among the consumers
  const int cwg = ctid / 128;  // this warpgroup's 64 rows of the block
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = 16 * (ctid / 32);  // the block row of this warp's first row
#if FA_TIMELINE
  timeline::Recorder tl(p, tid / 32);
#endif

  // Descriptors as in the sm90 kernel: Q and K K-major, V MN-major, 64-column panels of 128-byte rows.
  const u64 q_desc = smem_desc_sw128(sQ + cwg * 64 * 128, 16, 1024);
#if FA_TRACE
  // (The planted fault kWrongSwizzle starts K's descriptor one row late: fa/trace.cuh.)
  const u64 k_desc = smem_desc_sw128(sK + trace::wrong_swizzle_bytes(p.trace_fault), 16, 1024);
  // Tiles are read back through generic pointers, element (row, col) where the TMA unit wrote it: 64-column
  // panels of 128-byte rows, 128-byte swizzle.
  using TL = trace::Layout<Cfg>;
  auto trace_tile = [&](u32 tile) { return reinterpret_cast<const u16*>(smem + (tile - smem_addr(smem))); };
  auto trace_q_elem = [](int row, int chunk) { return (int)(PanelTile<BR>::bytes(row, chunk) / 2); };
  auto trace_kv_elem = [](int row, int chunk) { return (int)(PanelTile<BC>::bytes(row, chunk) / 2); };
#else
  const u64 k_desc = smem_desc_sw128(sK, 16, 1024);
#endif
  const u64 v_desc = smem_desc_sw128(sV, BC * 128, 1024);
  const float sl2 = p.scale_log2;
  // Bounded scores (soft-capping in bf16, cap <= kFixedMaxCap): the softmax without a running max
  // (fa/softmax.cuh bounded_softmax_row), its origin cap / 2 kept as row_max for the LSE; a uniform
  // branch on the cap, so larger caps take the online softmax in the same build. Every head_dim without
  // ping-pong (the 176-key ping-pong build spilled 44 -> 120 bytes with it). The second path spills in
  // some builds (NVRTC 13.0): d64's 192-row causal and window builds (0 -> 108 and 0 -> 136 bytes, their
  // 128-register consumers), d256's 80-key window and packed builds (12 -> 48, 16 -> 32), d192's packed
  // build (0 -> 16); d256's 80-key dense build went 12 -> 0. Measured all the same (kernel log 105, H200,
  // cap 50): d256 12-18% faster dense, windowed and packed, d64 4-6% faster dense and packed, its causal
  // window unchanged against plain attention; d128 took it first (kernel log 99).
  constexpr bool kBoundable = BF && !Cfg::kPingpong && ScoreModBounded<typename V::ScoreMod>::value;
  // O is divided by the sum of P as P V takes it, rounded to bf16 (L_r, row_sum_p below), and the LSE keeps
  // the fp32 sum (fa/softmax.cuh says why). L_r comes from the tensor cores at head_dim 64 and 128 (256:
  // below): each P V group also multiplies the packed P by a tile of ones (m64n8k16 per k-step, 1/16 of
  // P V's work at head_dim 128), whose result is every row's sum in every column; the CUDA cores keep only
  // the fp32 sum they had. With dropout P changes before it is packed, so the softmax rounds and sums it
  // itself. Rejected: summing the packed P on the CUDA cores under P V at head_dim 128 (+11%, kernel log
  // 116); packing S_j's P into a second register set before the wait, which made ptxas serialize every
  // wgmma (C7513): +21% d128, +46% d256.
  constexpr bool kSumPackedP = kBoundable && !kDropout;
  // Head_dim 256 sums the packed P on the CUDA cores instead (add_p_row_sums, under P V): the ones product
  // was 2.2% slower causal and 0.5% non-causal there, against 7-9% faster at head_dim 64 (H200, kernel
  // log 120).
  constexpr bool kSumOnCudaCores = kSumPackedP && D > 128;
  static_assert(kSumPackedPOnes == (kSumPackedP && !kSumOnCudaCores),
                "the ones tile is set up for exactly the tensor cores' packed-sum builds");
  // No swizzle (layout 0), both strides 0: every core matrix of B is the ones tile (above).
  const u64 ones_desc = (u64)((smem_addr(s_ones) & 0x3FFFFu) >> 4);
  // The online softmax's reference max moves only by more than kLazyMargin (fa/softmax.cuh), and O's
  // rescale (D / 2 multiplies per thread) is skipped where no row of a warp moved it. At head_dim 256 only,
  // where two A/B runs agreed (kernel log 106, H200, random inputs: -4% by the fastest rounds, either
  // mode); at 128 and 64 the runs disagreed within their spread, so those builds keep the running max. The
  // trace build too (the tile simulator, flash_attention/tools/sim.py, models the lazy reference).
  constexpr bool kLazyMax = D >= 256;
  const bool bounded = kBoundable && p.softcap <= kFixedMaxCap;
  const float bounded_max = 0.5f * p.softcap / p.scale;  // the origin in row_max's (unscaled) units
  const float cap_log2 = p.softcap * 1.4426950408889634f;
  if constexpr (kTmaStore) {
    if (ctid % 128 == 0) tma_prefetch_map(&tp.o_map);  // each warpgroup's store issuer (the epilogue)
  }

  // Ping-pong (Cfg::kPingpong, two consumer warpgroups): the warpgroups take turns at every point where
  // they issue matrix products. Warpgroup c waits at named barrier kTurn + c for the other to have passed
  // it the turn (bar.arrive at the same barrier, 256 threads in all), issues, and passes the turn back. The
  // tensor cores then run one warpgroup's products while the other runs its softmax, instead of both
  // softmaxes falling in the same window. Per tile, warpgroup 1 passes first, so warpgroup 0 starts; both
  // issue the same number of times (same K/V blocks), and warpgroup 0 takes the one turn left over at the
  // end, so no arrival is pending when the tile ends.
  constexpr int kTurn = 2;  // named barriers 2 and 3 (0: __syncthreads, 1, 4 and 5: the epilogue's)
  auto take_turn = [&] {
    if constexpr (Cfg::kPingpong) named_barrier_sync(kTurn + cwg, 256);
  };
  auto pass_turn = [&] {
    if constexpr (Cfg::kPingpong) named_barrier_arrive(kTurn + (1 - cwg), 256);
  };
  // This warp's matrix products have read the slot's K (or V): one arrival per warp frees it once all
  // 4 NC consumer warps are past this point.
  auto release = [&](u32 bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  // A warpgroup's 64 x D output accumulator and the running max and sum of its rows, for the tile in hand;
  // with Cfg::kTileOverlap held past the tile's end until its epilogue has run (below).
  float o[NO * 4];
  float row_max[2], row_sum[2];
  // The bounded softmax's L_r (kSumPackedP builds; dead code elsewhere): the m64n8 accumulator of P times
  // the ones tile, whose every column is a row's sum; this thread holds rows g (0, 1) and g + 8 (2, 3)
  // (add_p_row_sums, the CUDA cores' form, keeps its partial sums in 0 and 2).
  float row_sum_p[4];
  // Where this warpgroup stages its output rows in the per-warpgroup epilogue below: persistent, its part of
  // the output tile sO (PanelTile<64>); otherwise its own rows of the Q tile (PanelTile<BR>).
  const u32 sOw = Cfg::kPersistent ? sO + cwg * 64 * D * 2 : sQ + cwg * 64 * 128;
  // The output (and LSE) rows of this warpgroup for tile `tile_index`, from o and the row statistics: the
  // epilogue of the persistent and ping-pong configs (below, in the tile loop; with kTileOverlap, under the
  // next tile's first S). The staged rows stay in sOw until the warpgroup's next epilogue.
  auto warpgroup_epilogue = [&](const Tile& x, int q_start, int q_valid, float* gL) {
    // Each warpgroup stages and copies out its own 64 rows, meeting only its own warps (named barrier
    // 4 + cwg, 128 threads): the warpgroups drift apart (ping-pong makes them) and need not wait for each
    // other. Persistent, the rows go to the warpgroup's part of sO (PanelTile<64>), so the next tile's Q
    // can land meanwhile; otherwise to its own rows of the Q tile (its wgmma read no others). The first
    // barrier orders every warp's copy-out of the previous tile (persistent), or its last wgmma read of
    // those rows of Q, before any warp stages over them; the second orders the staging before the copy,
    // which reads other warps' rows.
    // Ping-pong takes this path even without the persistent grid: with the 256-thread barrier of the
    // path above, racecheck reported hazards between the staging and the copy (it does not follow the
    // bar.arrive turns), though the outputs were right. Other configs keep that path: this one costs the
    // non-persistent kernels 16 instructions and, compiled by NVRTC, spills in the 176-key dropout tiles
    // (docs/kernel-log.md, step 36).
    // With tma_store, one thread of the warpgroup hands the staged rows to the TMA unit,
    // one store per 64-column panel, and the warpgroup goes on: the copy-out's shared loads and global
    // stores (2 D / 16 of each per thread) leave the path between this tile's last P V and the next
    // tile's first S. The store reads the staging buffer after the warpgroup has moved on, so before the
    // next staging over it the issuing thread waits for its reads (bulk_wait_read, ahead of the first
    // barrier, which then holds the other warps back), and before the block exits for the whole copy.
    using OTile = PanelTile<Cfg::kPersistent ? 64 : BR>;
    constexpr int kOTileRows = Cfg::kPersistent ? 64 : BR;  // rows of one panel of the staging tile
    const int rows = q_valid - 64 * cwg;
    const bool store_issuer = ctid % 128 == 0;
    if constexpr (kTmaStore) {
      if (store_issuer) bulk_wait_read<0>();  // the previous tile's stores have read sOw
    }
    named_barrier_sync(4 + cwg, 128);
    stage_o_and_lse<D, OTile, BF, kFold>(p, o, row_max, row_sum, sOw, gL ? gL + 64 * cwg : nullptr,
                                         warp_row0 - 64 * cwg, g, t, rows, head_sink(p, x.head));
    // A TMA store writes the panel's 64 rows, clipped only at the tensor's end: a packed batch's tile that
    // ends inside the tensor (its sequence's last rows) copies its rows out itself, or it would write
    // over the next sequence's (another tile's) output. (Warpgroup-uniform.) That copy goes one chunk at a
    // time: unrolled, its loads in flight spilled the main loop of the tile_overlap builds (64-84 bytes,
    // 168-196 with soft-capping), and so did a second epilogue call site that ran cut tiles at their end
    // instead of deferring them (60-72 bytes with soft-capping).
    if (kTmaStore && (!kSegments || rows >= 64)) {
      // Each thread's staging stores (generic proxy) are made visible to the TMA unit (async proxy)
      // before the barrier lets the issuing thread start the copy.
      fence_proxy_async();
      named_barrier_sync(4 + cwg, 128);
      if (store_issuer) {
#pragma unroll
        for (int pn = 0; pn < NP; ++pn)
          tma_store_4d(&tp.o_map, sOw + pn * kOTileRows * 128, 64 * pn, q_start + 64 * cwg, x.head, x.batch);
        bulk_commit();
      }
    } else {
      named_barrier_sync(4 + cwg, 128);
      u16* gO = static_cast<u16*>(p.o) + o_offset(p, x.batch, x.head, q_start + 64 * cwg);
      if constexpr (kTmaStore)  // (only a cut tile comes here: the serial copy, which spills nothing)
        store_o_tile_serial<64, D, 128, OTile>(p, gO, sOw, rows, ctid % 128);
      else
        store_o_tile<64, D, 128, OTile>(p, gO, sOw, rows, ctid % 128);
    }
  };

  // kTileOverlap: a tile's epilogue does not run at its end but in the next tile, once that tile's first
  // S = Q K^T is issued, so the tensor cores run that product through the epilogue instead of idling
  // between the tiles (the epilogue, then the first S and its wait, took about 2,500 of a 25,000-cycle
  // tile at head_dim 128 and 1k keys: kernel-log step 58). o and the row statistics stay as the finished
  // tile left them until then, `pending` names it, and the next tile resets them after its epilogue; the
  // block's last tile (or one before an empty tile) has its epilogue where the loop finds no product to
  // hide it under.
  int pending = -1;
  auto pending_epilogue = [&] {
    const Tile x = tile_at(pending);
    const Rows rows = rows_of(x);
    float* gL = p.lse ? p.lse + lse_offset(p, x.batch, x.head, rows.start) : nullptr;
    warpgroup_epilogue(x, rows.start, rows.count, gL);
    pending = -1;
  };
  int ring = 0;     // K/V blocks consumed so far, as the producer counts them
  int q_loads = 0;  // q_full completions consumed so far
  for (int tile = 0;; ++q_loads) {
    if constexpr (Cfg::kPersistent) {
      // The producer's index of this tile, and its Q if it has keys (buffer q_loads % NQ, its
      // (q_loads / NQ)-th use).
      mbar_wait(q_full(q_loads % NQ), (q_loads / NQ) & 1);
      tile = (int)ld_shared_32(s_tile(q_loads % NQ));
      if (tile >= num_tiles) break;
    } else if (q_loads > 0) {
      break;  // the block's one tile is done
    }
    FA_TIMELINE_EVENT(tl, kTileBegin, tile);
    const Tile x = tile_at(tile);
    const int batch = x.batch, head = x.head;
    const Rows rows = rows_of(x);
    const int q_start = rows.start;
    const int q_valid = rows.count;
    u16* gO = static_cast<u16*>(p.o) + o_offset(p, batch, head, q_start);
    float* gL = p.lse ? p.lse + lse_offset(p, batch, head, q_start) : nullptr;
    const Mask mask(p, batch, head);
    const typename V::ScoreMod score_mod(p, batch, head);
    int origin;
    const auto blocks = blocks_of(mask, rows, origin);
    const int j_lo = blocks.begin;
    const int n_iter = blocks.end - j_lo;
    // The first key of the tile's first block (the origin folded in, so one value lives through the loop).
    const int kv_first = origin + j_lo * BC;
#if FA_TRACE
    // Per tile: the persistent grid's block runs several, of which at most one is the traced one.
    trace::Tracer<Cfg> tr(p, batch, head, m_block_of(x), ctid / 32, lane);
    tr.begin(blocks.end);
#endif
    if (n_iter <= 0) {  // no key visible to any row: out = 0, lse = -inf
      if (kTileOverlap && pending >= 0) {
        pending_epilogue();
      }
#if FA_TRACE
      tr.empty_block();
#endif
      store_empty_block<BR, D, NCT>(p, gO, gL, q_valid, head, ctid);
      if constexpr (Cfg::kPersistent) mbar_arrive(q_empty(q_loads % NQ));  // this thread has read s_tile
      continue;
    }

    auto reset_accumulators = [&] {
#pragma unroll
      for (int i = 0; i < NO * 4; ++i) o[i] = 0.f;
      row_max[0] = row_max[1] = bounded ? bounded_max : neg_inf();
      row_sum[0] = row_sum[1] = 0.f;
      row_sum_p[0] = row_sum_p[1] = row_sum_p[2] = row_sum_p[3] = 0.f;
    };
    if constexpr (!kTileOverlap) reset_accumulators();  // (tile_overlap: after the previous tile's epilogue)

    // The pieces of one K/V block, shared by both schedules below.
    auto slot = [&](int it) { return (ring + it) % NST; };
    auto phase = [&](int it) { return (u32)(((ring + it) / NST) & 1); };  // the slot's use, mod 2
    auto issue_s_at = [&](float (&sacc)[NS* 4], int it) {                    // S = Q K^T of block it
      wgmma_fence();
      const u64 q_buffer = q_desc + ((q_loads % NQ * kQBytes) >> 4);
      issue_qk<BR, BC, D, BF>(sacc, q_buffer, k_desc + ((slot(it) * kTile) >> 4));
      wgmma_commit();
    };
    auto issue_pv_at = [&](const u32(&pf)[KS][4], int it) {  // O += P V of block it
      wgmma_fence();
      issue_pv<BC, D, BF>(o, pf, v_desc + ((slot(it) * kTile) >> 4));
      // L_r += P 1, in the same group (fa/softmax.cuh). At head_dim 128 issued whatever `bounded` is (a cap
      // past kFixedMaxCap then pays an unused product): behind the run-time condition ptxas injected a
      // warpgroup.arrive (C7519) eight times per build, on which the causal build's warps stalled three times
      // as often as main's (22% of stall samples; that build 7% slower than main, kernel log 119).
      // Unconditional, the head_dim-128 builds have none (the persistent one keeps the two injected
      // warpgroup.waits, C7517, that main's has too), but the head_dim-64 build spilled, so the condition
      // stays there.
      constexpr bool kOnesAlways = D == 128;
      if constexpr (kSumPackedPOnes) {
        if (kOnesAlways || bounded) {
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) Wgmma<8, true>::rs_bt(row_sum_p, pf[ks], ones_desc, 1);
        }
      }
      wgmma_commit();
    };
    // The variant's score function and mask (fa/variant.cuh), the online softmax step and dropout of S in
    // place (fa/softmax.cuh, fa/dropout.cuh); alpha gets the factors O's two rows must be rescaled by.
    auto softmax_step = [&](float (&sacc)[NS* 4], int it, float (&alpha)[2]) {
      const int kv_start = kv_first + it * BC;
      static_assert(kFold, "the wgmma kernels' softmax is the folded one");
      constexpr bool kOffsets = ScoreModRowOffsets<typename V::ScoreMod>::value;
      float offset[1][2];
      if constexpr (kBoundable) {
        if (bounded) {
          // tanh(s scale / cap) in place (cap log2 e goes into the exponent's FFMA), the mask, then P.
#pragma unroll
          for (int i = 0; i < NS * 4; ++i) sacc[i] = score_mod.unit(sacc[i]);
          mask.mask_query_rows(acc_tile(sacc), q_start + warp_row0, kv_start, g, t);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            row_sum[r] += bounded_softmax_row<!kSumPackedP>(acc_tile(sacc), 0, r, cap_log2, row_sum_p[2 * r]);
            alpha[r] = 1.f;
          }
          if constexpr (kDropout)
            dropout_query_rows(acc_tile(sacc), 0, p, batch, head, q_start + warp_row0, kv_start, g, t);
          return;
        }
      }
      score_mod_query_rows_wgmma(acc_tile(sacc), score_mod, q_start + warp_row0, kv_start, g, t, offset);
      mask.mask_query_rows(acc_tile(sacc), q_start + warp_row0, kv_start, g, t);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        alpha[r] = online_softmax_row<kFold, kOffsets, kLazyMax>(acc_tile(sacc), 0, r, row_max[r], row_sum[r],
                                                                 sl2, offset[0][r]);
      if constexpr (kDropout)
        dropout_query_rows(acc_tile(sacc), 0, p, batch, head, q_start + warp_row0, kv_start, g, t);
    };
    auto rescale_o = [&](const float (&alpha)[2]) {
      if (bounded) return;  // (alpha is 1)
      // A warp whose rows all kept their reference (kLazyMax) skips the D / 2 multiplies (a vote, and
      // a uniform branch).
      if (kLazyMax && __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
      for (int r = 0; r < 2; ++r) rescale_row(acc_tile(o), 0, r, alpha[r]);
    };

    // S_j = Q K_j^T has completed in this warp: K_j's slot may be refilled, and after the tile's last one
    // (persistent) the Q buffer too, so the next tile's Q lands under this tile's last P V and epilogue.
    // Every consumer thread arrives on q_empty itself (NCT arrivals), not one lane per warp: each thread
    // read s_tile, and a per-thread release orders that read before the producer's next write without
    // relying on __syncwarp (compute-sanitizer's racecheck does not follow that chain and reported it).
    auto s_done = [&](int it) {
      release(k_empty(slot(it)));
      if constexpr (Cfg::kPersistent)
        if (it == n_iter - 1) mbar_arrive(q_empty(q_loads % NQ));
    };

#if FA_TRACE
    // S_j has landed and neither K_j's slot nor Q has been released (trace before s_done).
    auto trace_s = [&](float (&sacc)[NS* 4], int it) {
      tr.begin_step(it, j_lo + it);
      tr.smem_tile(TL::kQ, trace_tile(sQ + q_loads % NQ * kQBytes), warp_row0, 16, trace_q_elem);
      tr.smem_tile(TL::kK, trace_tile(sK + slot(it) * kTile), 0, BC, trace_kv_elem);
      tr.acc_view(TL::kS, acc_tile(sacc));
    };
    // After the softmax step, before s_to_p rounds P; then the planted fault that leaves O unrescaled (for
    // every block, as a real bug would be).
    auto trace_softmax = [&](float (&sacc)[NS* 4], float (&alpha)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tr.row_value(TL::kM, 0, r, row_max[r]);
        tr.row_value(TL::kAlpha, 0, r, alpha[r]);
        tr.row_sum(TL::kL, 0, r, row_sum[r]);
      }
      tr.acc_view(TL::kP, acc_tile(sacc));
      if (tr.skip_rescale()) alpha[0] = alpha[1] = 1.f;
    };
    // P_j V_j has completed, and neither has V_j's slot been released nor O rescaled for step j + 1.
    auto trace_pv = [&](int it) {
      tr.resume_step(it);
      tr.smem_tile(TL::kV, trace_tile(sV + slot(it) * kTile), 0, BC, trace_kv_elem);
      tr.acc_view(TL::kO, acc_tile(o));
    };
    // The output rows as staged for the copy-out at `staged`, this warp's first at row0 (read back: what is
    // stored), and their LSE as computed for gL. Both epilogues below stage in 64-row panels per warpgroup
    // when persistent, else in the BR-row panels of the Q tile.
    auto trace_final = [&](u32 staged, int row0) {
      using OTile = PanelTile<Cfg::kPersistent ? 64 : BR>;
      if (!tr.on()) return;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int n = 0; n < NO; ++n)
          tr.final_pair(g + 8 * r, 8 * n + 2 * t,
                        ld_shared_32(staged + OTile::bytes(row0 + g + 8 * r, n) + 4 * t));
        const float l = quad_sum(row_sum[r]);
        if (t == 0) tr.final_lse(g + 8 * r, row_lse<kFold>(p, row_max[r], l));
      }
    };
#endif

    if (cwg == 1) pass_turn();
    if constexpr (!Cfg::kPersistent) mbar_wait(q_full(0), 0);  // (persistent: waited for with the index)
    if constexpr (!Cfg::kOverlap) {
      // In order: S_j, its softmax, then P_j V_j; the tensor cores idle while the softmax runs.
      for (int it = 0; it < n_iter; ++it) {
        mbar_wait(k_full(slot(it)), phase(it));
        float sacc[NS * 4];
        take_turn();  // (ping-pong: this warpgroup's softmax below runs under the other's P V)
        issue_s_at(sacc, it);
        FA_TIMELINE_EVENT(tl, kSIssued, it);
        wgmma_wait<0>();
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, it);
#if FA_TRACE
        trace_s(sacc, it);
#endif
        s_done(it);
        float alpha[2];
        softmax_step(sacc, it, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, it);
#if FA_TRACE
        trace_softmax(sacc, alpha);
#endif
        rescale_o(alpha);
        u32 pf[KS][4];
        s_to_p<BC, BF>(pf, sacc);
        if constexpr (kSumOnCudaCores)
          if (bounded) add_p_row_sums<BC>(row_sum_p, pf);
        mbar_wait(v_full(slot(it)), phase(it));
        issue_pv_at(pf, it);
        pass_turn();
        wgmma_wait<0>();
        wgmma_hold(o);
        if constexpr (kSumPackedPOnes) wgmma_hold(row_sum_p);
        FA_TIMELINE_EVENT(tl, kPVDone, it);
#if FA_TRACE
        trace_pv(it);
#endif
        release(v_empty(slot(it)));
      }
    } else {
      // Intra-warpgroup overlap: iteration j issues S_j and then P_{j-1} V_{j-1}, waits for S_j only
      // (wgmma groups complete in order) and runs S_j's softmax while P_{j-1} V_{j-1} occupies the tensor
      // cores. O may be rescaled by S_j's factors, and P_j written over P_{j-1}, only once that product
      // has completed. Costs the registers of P_{j-1} beside S_j (32 more at 128 keys).
      u32 pf[KS][4];
      {
        mbar_wait(k_full(slot(0)), phase(0));
        float sacc[NS * 4];
        take_turn();
        issue_s_at(sacc, 0);
        FA_TIMELINE_EVENT(tl, kSIssued, 0);
        pass_turn();
        if constexpr (kTileOverlap) {
          if (pending >= 0) {  // the previous tile's epilogue, under this first S
            FA_TIMELINE_EVENT(tl, kEpilogueBegin, pending);
            const int finished = pending;
            pending_epilogue();
            FA_TIMELINE_EVENT(tl, kEpilogueEnd, finished);
          }
          reset_accumulators();
        }
        wgmma_wait<0>();
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, 0);
#if FA_TRACE
        trace_s(sacc, 0);
#endif
        s_done(0);
        float alpha[2];  // O is still zero: nothing to rescale
        softmax_step(sacc, 0, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, 0);
#if FA_TRACE
        trace_softmax(sacc, alpha);
#endif
        s_to_p<BC, BF>(pf, sacc);
      }
      for (int it = 1; it < n_iter; ++it) {
        mbar_wait(k_full(slot(it)), phase(it));
        float sacc[NS * 4];
        mbar_wait(v_full(slot(it - 1)), phase(it - 1));
        take_turn();
        issue_s_at(sacc, it);
        issue_pv_at(pf, it - 1);
        if constexpr (kSumOnCudaCores)
          if (bounded) add_p_row_sums<BC>(row_sum_p, pf);  // P_{j-1}'s, under its product
        FA_TIMELINE_EVENT(tl, kSIssued, it);
        pass_turn();
        wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, it);
#if FA_TRACE
        trace_s(sacc, it);
#endif
        s_done(it);
        float alpha[2];
        softmax_step(sacc, it, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, it);
#if FA_TRACE
        trace_softmax(sacc, alpha);
#endif
#if !FA_NO_SOFTMAX_ORDER  // (defined only by tools/ws_timeline.py --old-order and A/B scripts: the old schedule)
        // The softmax step runs under P_{j-1} V_{j-1}, not after it: its sums (which need every exponential
        // and the max) must be done before the wait (fa/wgmma.cuh says why ptxas would hoist the wait).
        // Measured on the H100 against ptxas's own order (kernel-log step 58): +1-5% at head_dim 128 and
        // 256, -1-3% at 64, whose P V is half as long, so head_dim 64 keeps ptxas's order.
        // (sQ only names a shared address for the store, which never executes: head_dim > 0.)
        if constexpr (D >= 128) order_before_wgmma_wait(row_sum[0] + row_sum[1], sQ, p.head_dim);
#endif
        wgmma_wait<0>();
        wgmma_hold(o);
        if constexpr (kSumPackedPOnes) wgmma_hold(row_sum_p);
        FA_TIMELINE_EVENT(tl, kPVDone, it - 1);
#if FA_TRACE
        trace_pv(it - 1);  // the previous step's O, before this step's rescale
#endif
        release(v_empty(slot(it - 1)));
        rescale_o(alpha);
        s_to_p<BC, BF>(pf, sacc);
      }
      mbar_wait(v_full(slot(n_iter - 1)), phase(n_iter - 1));
      take_turn();
      issue_pv_at(pf, n_iter - 1);
      if constexpr (kSumOnCudaCores)
        if (bounded) add_p_row_sums<BC>(row_sum_p, pf);
      pass_turn();
      wgmma_wait<0>();
      wgmma_hold(o);
      if constexpr (kSumPackedPOnes) wgmma_hold(row_sum_p);
      FA_TIMELINE_EVENT(tl, kPVDone, n_iter - 1);
#if FA_TRACE
      trace_pv(n_iter - 1);
#endif
      release(v_empty(slot(n_iter - 1)));
    }
    if constexpr (kBoundable) {
      if (bounded) {  // O / L_r with the LSE of L (fa/softmax.cuh bounded_lse_from_fp32_sum)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          bounded_lse_from_fp32_sum(row_max[r], row_sum[r], row_sum_p[2 * r], p.scale, !kSumPackedPOnes);
      }
    }
    if (cwg == 0) take_turn();  // the turn warpgroup 1 passed after its last issue
    ring += n_iter;
    if constexpr (!kTileOverlap) FA_TIMELINE_EVENT(tl, kEpilogueBegin, tile);  // (else: where it runs)

    // ---- epilogue: O / L and the LSE ------------------------------------------------------------------------
    if constexpr (!Cfg::kPersistent && !Cfg::kPingpong) {
      // O staged in this warpgroup's own rows of the Q tile: each consumer warpgroup's wgmma read only its
      // own 64 rows of Q, and its last one has completed.
      stage_o_and_lse<D, PanelTile<BR>, BF, kFold>(p, o, row_max, row_sum, sQ, gL, warp_row0, g, t, q_valid,
                                                   head_sink(p, head));
#if FA_TRACE
      trace_final(sQ, warp_row0);
#endif
      const int wg_rows = q_valid - 64 * cwg;
      if (kTmaStore && kSegments && wg_rows < 64) {
        // A packed batch's tile ending inside the tensor: this warpgroup copies its own rows out (a TMA
        // store would write all 64, over the next sequence's; warpgroup_epilogue says the same).
        named_barrier_sync(4 + cwg, 128);
        if (wg_rows > 0)
          store_o_tile_serial<64, D, 128, PanelTile<BR>>(p, gO + 64 * cwg * p.o_row_stride, sQ + cwg * 64 * 128,
                                                         wg_rows, ctid % 128);
      } else if constexpr (kTmaStore) {
        // One thread per warpgroup stores the warpgroup's own rows (one TMA store per 64-column panel) once
        // its four warps have staged them (fence: visible to the TMA unit; named barrier 4 + cwg: only this
        // warpgroup's threads). The block's one tile: nothing stages over the rows again, and the block
        // waits for the stores at its exit. (The warpgroup-per-warpgroup path below costs this schedule the
        // extra barrier and, compiled by NVRTC, 92-96 spilled bytes in head_dim 256's dropout tiles.)
        fence_proxy_async();
        named_barrier_sync(4 + cwg, 128);
        if (ctid % 128 == 0) {
#pragma unroll
          for (int pn = 0; pn < NP; ++pn)
            tma_store_4d(&tp.o_map, sQ + pn * BR * 128 + cwg * 64 * 128, 64 * pn, q_start + 64 * cwg, head,
                         batch);
          bulk_commit();
        }
      } else {
        // Every consumer's rows of O are staged before any of them copies whole rows out (named barrier 1:
        // the producer warpgroup does not take part).
        named_barrier_sync(1, NCT);
        store_o_tile<BR, D, NCT, PanelTile<BR>>(p, gO, sQ, q_valid, ctid);
      }
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, tile);
    } else if constexpr (kTileOverlap) {
      pending = tile;  // its epilogue runs under the next tile's first S, or after the loop
    } else {
      warpgroup_epilogue(x, q_start, q_valid, gL);
#if FA_TRACE
      trace_final(sOw, warp_row0 - 64 * cwg);  // (read back after the copy-out, which only reads them)
#endif
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, tile);
    }
  }
  if constexpr (kTileOverlap) {
    if (pending >= 0) {
      FA_TIMELINE_EVENT(tl, kEpilogueBegin, pending);
      const int finished = pending;
      pending_epilogue();
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, finished);
    }
  }
  // The block's shared memory must outlive the last TMA stores that read it, and their writes must be done
  // before the grid is (a later kernel on the stream reads O).
  if constexpr (kTmaStore) {
    if (ctid % 128 == 0) bulk_wait<0>();
  }
}

}  // namespace sm90
}  // namespace fa
