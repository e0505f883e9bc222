// FlashAttention-2 backward's dK/dV kernel (dQ added into an fp32 workspace) for Hopper (sm_90a) at the wide
// head dims (192, 256), on wgmma: the two warpgroups split the work by product, not by keys.
//
// Why not the sm90 kernel (csrc/kernels/sm90/bwd/bwd_kernel.cuh, whose comments on the transposed chain
// and the operand layouts apply here): there each warpgroup owns 64 keys and keeps both dK and dV for them,
// 2 x 64 x head_dim fp32 accumulators -- 256 registers per thread at head_dim 256 before anything else.
// Here the block has 64 keys, both warpgroups see all of them, and each keeps one accumulator (128
// registers at head_dim 256):
//   warpgroup 0:  S^T  = K Q^T,  P^T = exp2(S^T scale log2e - LSE2),  dV += P^T dO   (P^T from registers)
//   warpgroup 1:  dP^T = V dO^T, dS^T = scale P^T (dP^T - delta),     dK += dS^T Q   (dS^T from registers)
//   both:         dQ  += dS K, warpgroup 0 head_dim's first 128 columns, warpgroup 1 the rest.
// The products are the same five as the sm90 kernel's, shared evenly at head_dim 256 (each warpgroup: one
// 64 x 64 x D product, one 64 x D x 64, one 64 x D/2 x 64; at 192 dQ splits 128 / 64), and the two
// warpgroups run one instruction stream: only the elementwise steps between the products differ. Warpgroup 1 needs P^T, which warpgroup 0 passes through
// shared memory in fp32 (the other kernels compute dS from the fp32 P as well). Rejected: splitting head_dim
// between the warpgroups for dK and dV too (each then needs both P^T and dS^T, and S^T and dP^T are
// products over the whole head_dim, so one of them would be computed twice or exchanged in halves); and two
// passes over the queries, one per accumulator (a fifth more products and every load twice).
//
// Per query step:
//   A  __syncthreads: this step's Q, dO and statistics have landed (cp.async, double-buffered as in the sm90
//      kernel), every product of the previous step has completed, so the other buffer, P^T's and dS^T's
//      tiles may be rewritten.
//   warpgroup 0: S^T; mask; P^T into registers and into sP; arrives at barrier 1.
//   warpgroup 1: dP^T; waits at barrier 1 for P^T; dS^T into registers and into sdS (for dQ).
//   both: issue dV / dK (register A operand, asynchronous), meet at barrier 2 (dS^T written and fenced for
//   the tensor cores), issue their half of dQ, wait for everything, stage dQ in the step's dO (warpgroup 0)
//   or Q buffer (warpgroup 1), meet at barrier 3 + wg (the warpgroup's 128 threads), and one thread adds
//   it into the tiled fp32 workspace with bulk reduce-adds of 16 KB (fa/dq_accum.cuh). Measured on an H100
//   (bf16, 8 heads, 16k tokens): with 32 red.global.v2 per thread per step instead, as the sm90 kernel
//   adds dQ, the atomics took a third of the kernel's time (5.51 ms against 3.71 without any dQ at all,
//   non-causal 4k; 2.99 against 2.04 causal): at head_dim 256 and 64 keys per block a step adds 64 KB of
//   dQ for 10 MFLOP of products, twice the sm90 kernel's rate per product at head_dim 128. The bulk form
//   took 5.26 and 2.86 ms there; staged but never added, 3.91 and 2.14: the adds are bound by the rate at
//   which L2 takes fp32 reductions (about 1.65 TB/s here), so what is left to win is fewer of them.
//   Rejected: blocks in clusters of two neighbouring key blocks that sum their dQ in shared memory
//   (distributed shared memory, two cluster-barrier phases per step) before one bulk add, half the adds:
//   measured 0.63-0.75x this kernel's speed, the pair held in step and the 64 KB read across multiprocessors
//   every step.
//
// Dropout (kDropout; keep mask Z, kept elements scaled by rp = 1 / (1 - p), fa/dropout.cuh): dV takes the
// dropped P^T Z rp and dS^T = scale P^T (dP^T Z rp - delta) the undropped one with Z. Warpgroup 0 draws Z
// and hands P^T over with each dropped element negated (P >= 0, and a dropped zero's sign does not matter:
// its dS is zero either way), so warpgroup 1 reads Z from the sign bit instead of drawing it again.
//
// Shared memory (bytes from a 1024-aligned base): K and V (64 x D), two Q and two dO buffers (64 x D each),
// P^T (64 x 64 fp32, laid out per thread), dS^T (64 keys x 64 queries), two buffers of statistics (LSE2
// then delta, 64 floats each). 223 KB at head_dim 256, 170 KB at 192: one block per multiprocessor.
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
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/tma.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

// Shared memory of the wide backward, in bytes (mirrored by configs.backward.BwdConfig.smem_bytes).
template <int BR, int BC, int D>
struct BwdWideSmem {
  static constexpr int kKV = BC * D * 2;  // K, and V
  static constexpr int kQ = BR * D * 2;   // one Q or dO buffer
  static constexpr int kP = BC * BR * 4;  // P^T in fp32
  static constexpr int kDS = BC * BR * 2;
  static constexpr int kStats = 2 * BR * 4;  // one buffer: LSE2, delta
  static constexpr int kBytes = 1024 + 2 * kKV + 4 * kQ + kP + kDS + 2 * kStats;
};

// One warpgroup's part of dQ += dS K, its N columns from 128 wg on: the product (which also waits for the
// accumulator's), then out through the copy engine. Staged as 64 x 64 fp32 tiles, tile i at stage[i], in the
// tiled workspace's layout (fa/dq_accum.cuh), then one bulk reduce-add per tile into the workspace rows
// from ws_row (fa/dq_accum.cuh, stage_dq_tiles).
template <int N, int BC, int D, bool BF, bool kDeterministic>
__device__ __forceinline__ void bwd_wide_dq_part(const BwdParams& p, float (&acc)[D / 2], u64 ds_desc,
                                                 u64 kt_desc, const u32 (&stage)[2], i64 ws_row, int wg,
                                                 int tid) {
  static_assert(N == 64 || N == 128, "one or two 64-column tiles");
  float dq[N / 2];
  wgmma_fence();
  issue_dq<BC, N, BF>(dq, ds_desc, kt_desc);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(dq);
  wgmma_hold(acc);

  stage_dq_tiles<N>(stage, dq, tid % 128);
  fence_proxy_async();
  if constexpr (kDeterministic) {
    // Handed to the dQ writer, which waits at the same barrier (the warpgroup goes on).
    if (wg == 0) {
      named_barrier_arrive(3, 128 + 32);
    } else {
      named_barrier_arrive(4, 128 + 32);
    }
    return;
  }
  // The warpgroup's tiles are staged and fenced for the copy engine (ids fixed at compile time: a run-time
  // id makes ptxas reserve all sixteen barriers).
  if (wg == 0) {
    named_barrier_sync(3, 128);
  } else {
    named_barrier_sync(4, 128);
  }
  if (tid % 128 == 0) {
#pragma unroll
    for (int tile = 0; tile < N / 64; ++tile)
      bulk_reduce_add_f32(p.dq_accum + dq_accum_offset<D, true>(ws_row, 128 * wg + 64 * tile), stage[tile],
                          64 * 64 * 4);
    bulk_commit();
  }
}

// P^T's 32 fp32 values of one warpgroup-0 thread, written where the warpgroup-1 thread of the same warp
// position and lane (the same keys and queries of the accumulator layout) reads them: 128 bytes per thread,
// its eight 16-byte chunks rotated by the lane so that a warp's 16-byte accesses spread over all banks.
__device__ __forceinline__ u32 p_exchange_chunk(u32 sP, int warp_in_wg, int lane, int chunk) {
  return sP + (u32)((warp_in_wg * 32 + lane) * 128 + ((chunk + lane) & 7) * 16);
}

// Deterministic mode (kDeterministic): the walk and the turns of fa/dq_turns.cuh, as in the warp-specialized
// backward. A third warpgroup is launched whose first warp's lane 0 is the dQ writer: at each step it waits
// at barrier 3 and 4 for warpgroup 0's and 1's staged tiles, takes their turns (the semaphores of the
// query block, head, lane and warpgroup: warpgroup 0 adds dQ's columns [0, 128), 1 the rest) and adds
// them; once the copy engine has read both it arrives at barrier A (here a named barrier of the two
// compute warpgroups and the writer's warp), and once the additions are complete it releases the turns.
// The computing warpgroups neither wait for turns nor for a reduction's completion (about 3 us under
// load, longer than a step). Registers: 384 x 168 launched, 128 x 24 (writer) + 256 x 240 (compute)
// after setmaxnreg (configs.backward.DET_WIDE_REGISTER_SPLIT).
template <class Cfg, class V, bool kDropout = false, bool kDeterministic = false>
__device__ __forceinline__ void bwd_wide_dkdv_body(const BwdParams& p) {
  using Mask = typename V::Mask;  // the variant (fa/variant.cuh)
  static_assert(ScoreModHasGradient<typename V::ScoreMod>::value,
                "the backward does not differentiate a score function without its derivative "
                "(kUnitGradient, gradient)");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;   // query rows per step
  constexpr int BC = Cfg::kBlockKV;  // key rows of the block, seen by both warpgroups
  constexpr int NT = Cfg::kNumWarps * 32;
  constexpr int NQ = BR / 8;   // query n-tiles of S^T / dP^T
  constexpr int KQ = BR / 16;  // k-steps of dV / dK
  static_assert(Cfg::kNumWarps == 8 && BC == 64 && BR == 64, "two warpgroups on one 64-key block, 64 queries");
  static_assert(D == 192 || D == 256, "the wide backward is for head_dim 192 and 256");
  using QTile = PanelTile<BR>;   // Q and dO in shared memory
  using KVTile = PanelTile<BC>;  // K, V and dS^T
  using Smem = BwdWideSmem<BR, BC, D>;
  static_assert(Smem::kBytes <= Cfg::kSmemBytes, "the shared-memory layout exceeds the config's smem_bytes");

  extern __shared__ __align__(16) unsigned char smem[];
  const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
  const u32 sK = base;
  const u32 sV = sK + Smem::kKV;
  const u32 sQ = sV + Smem::kKV;       // two buffers
  const u32 sdO = sQ + 2 * Smem::kQ;   // two buffers
  const u32 sP = sdO + 2 * Smem::kQ;   // P^T, per thread (p_exchange_chunk)
  const u32 sdS = sP + Smem::kP;       // dS^T: BC rows (keys) of BR queries, one 64-query panel
  const u32 sStats = sdS + Smem::kDS;  // [buffer][LSE2 (BR floats), delta (BR floats)]
  const float* const stats = reinterpret_cast<const float*>(smem + (sStats - smem_addr(smem)));

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // 0: S^T, P^T, dV; 1: dP^T, dS^T, dK. (Not warpgroup_index(): with the descriptors made from it in uniform
  // registers, d256 spilled 4 bytes and its deterministic build 44 -> 112; NVRTC 13.0, kernel log 124.)
  const int wg = warp / 4;
  const int g = lane / 4;
  const int t = lane % 4;
  // Which block this is: deterministic mode, the last K/V block first, so that the blocks a turn waits for
  // were dispatched before it (fa/dq_turns.cuh). Written out rather than through fa/kv_block_order.cuh
  // (the warp-specialized kernel's, with its causal builds' heaviest-first groups): at 255 registers even
  // that helper's plain path moved ptxas's allocation into 12-32 bytes of spills, the groups as well.
  const int n_block = kDeterministic ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_start = n_block * BC;
  const int row0 = 16 * (warp % 4);  // the warp's first key row in the block (both warpgroups)

  // The keys this block's queries see (the variant's mask), and the query blocks
  // [m_begin, m_begin + m_count) that see some key of this block.
  const Mask mask(p, batch, kv_head);
  const auto blocks = mask.template q_blocks<BR, BC>(p, kv_start);
  const int m_begin = blocks.begin;
  const int m_count = blocks.count;
  const int n_iter = p.group * m_count;
  // The order of the steps. Default: head by head, query blocks upward. Deterministic: fa/dq_turns.cuh's
  // walk, which its turns follow.
  const DqTurns<BR, BC, Mask> turns(mask, blocks, n_block);
  auto head_of = [&](int it) { return kv_head * p.group + (kDeterministic ? turns.head(it) : it / m_count); };
  auto q_start_of = [&](int it) { return (kDeterministic ? turns.q_block(it) : m_begin + it % m_count) * BR; };

  if constexpr (kDeterministic) {
    if (tid >= 256) {
      // ---- the dQ writer's warpgroup --------------------------------------------------------------------
      setmaxnreg_dec<Cfg::kDetWideWriterRegs>();
      if (tid >= 256 + 32) return;
      // Step j's two additions are complete (the caller waited): the next blocks' turns on their tiles.
      auto release_turns = [&](int j) {
        fence_proxy_async_global();
        const DqTurn done = turns.turn(mask, j);
        const int h = head_of(j);
        red_release_gpu_add(dq_semaphore<D>(p, batch, h, done.m * BR, done.lane, 0), 1);
        red_release_gpu_add(dq_semaphore<D>(p, batch, h, done.m * BR, done.lane, 1), 1);
      };
#pragma unroll 1
      for (int it = 0; it < n_iter; ++it) {
        // Barrier A of step it: the previous step's staged tiles have been read (their buffers are
        // reloaded after it).
        __syncwarp();
        named_barrier_arrive(5, 256 + 32);
        if (tid == 256 && it > 0) {
          bulk_wait<0>();
          release_turns(it - 1);
        }
        const DqTurn turn = turns.turn(mask, it);
        const int head = head_of(it);
        const i64 ws_row = workspace_row(p, batch, head, turn.m * BR);
        float* const lane_acc = dq_lane<D>(p, turn.lane);
        const u32 qoff = (it & 1) * Smem::kQ;
#pragma unroll 1
        for (int w = 0; w < 2; ++w) {
          // Warpgroup w's tiles are staged (w is a compile-time id in each branch). (The warp meets lane 0
          // before each barrier: bar.sync and bar.arrive are warp-aligned.)
          __syncwarp();
          if (w == 0) {
            named_barrier_sync(3, 128 + 32);
          } else {
            named_barrier_sync(4, 128 + 32);
          }
          if (tid == 256) {
            const int* const sem = dq_semaphore<D>(p, batch, head, turn.m * BR, turn.lane, w);
            while (ld_acquire_gpu(sem) != turn.rank) __nanosleep(32);
            fence_proxy_async_global();  // the previous adder's writes before this reduction's
            // Where bwd_wide_dq_part staged them: warpgroup 0 in the step's dO buffer (its second tile
            // at head_dim 192 in P^T's), warpgroup 1 in the step's Q buffer.
            const u32 buffer = (w == 0 ? sdO : sQ) + qoff;
            const int tiles = (w == 0 || D == 256) ? 2 : 1;
            for (int tile = 0; tile < tiles; ++tile)
              bulk_reduce_add_f32(lane_acc + dq_accum_offset<D, true>(ws_row, 128 * w + 64 * tile),
                                  tile == 0 ? buffer : (D == 256 ? buffer + 64 * 64 * 4 : sP), 64 * 64 * 4);
            bulk_commit();
          }
        }
        if (tid == 256) bulk_wait_read<0>();
      }
      if (tid == 256 && n_iter > 0) {
        bulk_wait<0>();
        release_turns(n_iter - 1);
      }
      return;
    }
    setmaxnreg_inc<Cfg::kDetWideComputeRegs>();
  }

  // dV (warpgroup 0) or dK (warpgroup 1) of the warp's key rows.
  float acc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;

  auto load_q_step = [&](int it, int buf) {
    const int head = head_of(it);
    const int q_start = q_start_of(it);
    const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
    const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
    load_tile<BR, D, NT, QTile, true>(sQ + buf * Smem::kQ, gQ, p.q_row_stride, p.seqlen_q - q_start,
                                      p.head_dim, tid);
    load_tile<BR, D, NT, QTile, true>(sdO + buf * Smem::kQ, gdO, p.do_row_stride, p.seqlen_q - q_start,
                                      p.head_dim, tid);
    // The workspaces are padded to whole 128-row blocks: no bounds check.
    const i64 r0 = workspace_row(p, batch, head, q_start);
    if (tid < BR / 4) {
      cp_async_16(sStats + buf * Smem::kStats + 16 * tid, p.lse_log2 + r0 + 4 * tid, 16);
    } else if (tid < BR / 2) {
      const int c = tid - BR / 4;
      cp_async_16(sStats + buf * Smem::kStats + 4 * BR + 16 * c, p.delta + r0 + 4 * c, 16);
    }
  };

  if (n_iter > 0) {
    const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, kv_start);
    const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, kv_start);
    load_tile<BC, D, NT, KVTile, true>(sK, gK, p.k_row_stride, p.seqlen_k - kv_start, p.head_dim, tid);
    load_tile<BC, D, NT, KVTile, true>(sV, gV, p.v_row_stride, p.seqlen_k - kv_start, p.head_dim, tid);
    load_q_step(0, 0);
    cp_async_commit();
  }

  // Descriptors (fa/wgmma.cuh; the sm90 kernel explains them). This warpgroup's first product: S^T = K Q^T
  // (warpgroup 0) or dP^T = V dO^T (warpgroup 1), A K-major over all 64 keys, B K-major. Its accumulator's
  // product: dV += P^T dO (0) or dK += dS^T Q (1), B MN-major. Its half of dQ = dS K: A = dS^T M-major, B =
  // K's columns [128 wg, D) MN-major.
  const u64 a_desc = smem_desc_sw128(wg == 0 ? sK : sV, 16, 1024);
  const u64 q_desc = smem_desc_sw128(sQ, 16, 1024);
  const u64 qt_desc = smem_desc_sw128(sQ, BR * 128, 1024);
  const u64 ds_desc = smem_desc_sw128(sdS, BC * 128, 1024);
  const u64 kt_desc = smem_desc_sw128(sK + wg * 2 * BC * 128, BC * 128, 1024);
  constexpr u32 kDOOff = 2 * Smem::kQ;               // dO's buffers after Q's
  const u32 first_b_off = wg == 0 ? 0u : kDOOff;     // B of the first product: Q or dO
  const u32 acc_b_off = wg == 0 ? kDOOff : 0u;       // B of the accumulator's product: dO or Q
  // exp2's multiplier (fa/variant.cuh backward_score: the scale folded in for the identity).
  const float sl2 = backward_exp2_multiplier<typename V::ScoreMod>(p);
  const float scale = p.scale;

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    const int buf = it & 1;
    const u32 qoff = buf * Smem::kQ;
    const int head = head_of(it);
    const int q_start = q_start_of(it);
    // Barrier A (see the header): this step's loads landed (and are fenced for the tensor cores); the
    // previous step is done everywhere, and the copy engine has read its staged dQ (the buffer it was
    // staged in is reloaded below). Deterministic: the writer issued that copy and arrives here once it
    // has been read. Rejected: each warpgroup waiting for its own staged tiles' reads after issuing the next
    // step's first product and loading its own buffer then (rolled, 128 threads), so the wait hides under
    // S^T / dP^T: 0.4-1.6% slower at head_dim 256 (kernel log 118; the reads are not what the step waits on).
    if (!kDeterministic && tid % 128 == 0) bulk_wait_read<0>();
    cp_async_wait<0>();
    fence_proxy_async();
    if constexpr (kDeterministic) {
      named_barrier_sync(5, 256 + 32);
    } else {
      __syncthreads();
    }
    if (it + 1 < n_iter) {
      load_q_step(it + 1, buf ^ 1);
      cp_async_commit();
    }

    // ---- S^T = K Q^T (warpgroup 0) or dP^T = V dO^T (warpgroup 1) ---------------------------------------
    float s[BR / 2];
    wgmma_fence();
    issue_key_rows_product<BR, BC, D, BF>(s, a_desc, q_desc, first_b_off + qoff);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);

    // ---- P^T (warpgroup 0), dS^T (warpgroup 1): packed as the A operand of the accumulator's product ----
    // Register 4 n + e is key kv_start + row0 + g + 8 (e / 2) against query q_start + 8 n + 2 t + e % 2.
    const float* lse_s = stats + buf * 2 * BR;
    const float* del_s = lse_s + BR;
    u32 af[KQ][4];
    const typename V::ScoreMod score_mod(p, batch, head);
    if (wg == 0) {
      // Keys past seqlen_k and past the causal diagonal; queries past seqlen_q need no mask (their base-2
      // LSE is +inf, so their P is 0). A score function (fa/variant.cuh) first, as the forward applies it.
      score_mod_key_rows(acc_tile(s), score_mod, scale, kv_start, row0, q_start, g, t);
      mask.mask_key_rows(acc_tile(s), kv_start, row0, q_start, g, t);
      u32 head_hash = 0;
      if constexpr (kDropout) head_hash = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * n + e] = exp2_approx(fmaf(s[4 * n + e], sl2, -((e & 1) ? l2.y : l2.x)));
        float handed[4] = {s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3]};
        if constexpr (kDropout) {
          // Z for the four elements: handed over as the sign of P^T, applied here for dV.
          const u32 hr[2] = {dropout_row_hash(head_hash, q_start + 8 * n + 2 * t),
                             dropout_row_hash(head_hash, q_start + 8 * n + 2 * t + 1)};
          bool keep4[4];
          dropout_keep_key_rows<kDropoutKeyPairs<V>>(keep4, hr, kv_start + row0 + g, p.dropout_threshold);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool keep = keep4[e];
            handed[e] = keep ? s[4 * n + e] : -s[4 * n + e];
            s[4 * n + e] = keep ? s[4 * n + e] * p.dropout_rp : 0.f;
          }
        }
        st_shared_16(p_exchange_chunk(sP, warp % 4, lane, n),
                     make_uint4(__float_as_uint(handed[0]), __float_as_uint(handed[1]),
                                __float_as_uint(handed[2]), __float_as_uint(handed[3])));
      }
      // Barrier 1: P^T written, for warpgroup 1 (which waits; this one goes on).
      named_barrier_arrive(1, 256);
    } else {
      named_barrier_sync(1, 256);
#pragma unroll
      for (int c = 0; c < BR / 8; ++c) {
        const uint4 v = ld_shared_16(p_exchange_chunk(sP, warp % 4, lane, c));
        const float pr[4] = {__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                             __uint_as_float(v.w)};
        const float2 dl = *reinterpret_cast<const float2*>(del_s + 8 * c + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float dp = s[4 * c + e], pe = pr[e];
          if constexpr (kDropout) {
            // Z from the sign warpgroup 0 gave the element: dP^T Z rp, against the undropped P^T.
            dp = signbit(pe) ? 0.f : dp * p.dropout_rp;
            pe = fabsf(pe);
          }
          s[4 * c + e] = pe * (dp - ((e & 1) ? dl.y : dl.x)) * scale;
          if constexpr (!V::ScoreMod::kUnitGradient) {
            // (The derivative recovers the modified score from P and the row's LSE.)
            const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * c + 2 * t);
            const int key = kv_start + row0 + g + 8 * (e >> 1);  // (key rows: fa/mask.cuh)
            const float lse2 = (e & 1) ? l2.y : l2.x;
            s[4 * c + e] *= score_mod_gradient_from_p(score_mod_for_key(score_mod, key), pe, lse2,
                                                      q_start + 8 * c + 2 * t + (e & 1), key);
          }
        }
      }
    }
#pragma unroll
    for (int ks = 0; ks < KQ; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) af[ks][r] = pack2<BF>(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
    if (wg == 1) {
      store_ds_t_words<BR, BC>(sdS, af, row0, lane);  // for dQ (fa/bwd_wgmma.cuh)
      fence_proxy_async();
    }

    // ---- dV += P^T dO (warpgroup 0) or dK += dS^T Q (warpgroup 1) ----------------------------------------
    wgmma_fence();
    issue_key_rows_acc<BR, D, BF>(acc, af, qt_desc, acc_b_off + qoff);
    wgmma_commit();

    // Barrier 2: dS^T is written and fenced for the tensor cores.
    named_barrier_sync(2, 256);

    // ---- dQ += dS K: warpgroup 0 its columns [0, 128), warpgroup 1 [128, D) -----------------------------
    // (At head_dim 192 that is 128 and 64: splitting 96 / 96 would start warpgroup 1's part of K, read
    // MN-major, in the middle of a 64-column panel.) Staged where this step's dO (warpgroup 0) or Q
    // (warpgroup 1) was: this warpgroup's own products were the last to read it (the other warpgroup's read
    // it before barrier 1), and it is not reloaded before the next step's barrier A, before which the
    // issuing thread waits for the copy engine's reads. A buffer holds two 16 KB tiles at head_dim 256 and
    // one at 192, where warpgroup 0's second tile goes to P^T's (read by warpgroup 1 before barrier 2,
    // rewritten after the next barrier A).
    const u32 buffer = (wg == 0 ? sdO : sQ) + qoff;
    const u32 stage[2] = {buffer, D == 256 ? buffer + 64 * 64 * 4 : sP};
    static_assert(D != 256 || Smem::kQ == 2 * 64 * 64 * 4, "two staged tiles per Q / dO buffer");
    static_assert(D != 192 || (Smem::kQ >= 64 * 64 * 4 && Smem::kP == 64 * 64 * 4), "one tile each");
    const i64 ws_row = workspace_row(p, batch, head, q_start);
    if constexpr (D == 256) {
      // One instance for both warpgroups (two, in branches, spilled 4 bytes).
      bwd_wide_dq_part<128, BC, D, BF, kDeterministic>(p, acc, ds_desc, kt_desc, stage, ws_row, wg, tid);
    } else if (wg == 0) {
      bwd_wide_dq_part<128, BC, D, BF, kDeterministic>(p, acc, ds_desc, kt_desc, stage, ws_row, wg, tid);
    } else {
      bwd_wide_dq_part<D - 128, BC, D, BF, kDeterministic>(p, acc, ds_desc, kt_desc, stage, ws_row, wg, tid);
    }
  }
  // No reduction may outlive the shared memory it reads (deterministic: the writer's, which it waits for).
  if (!kDeterministic && tid % 128 == 0) bulk_wait<0>();

  // ---- epilogue: dV (warpgroup 0) through V's tile, dK (warpgroup 1) through K's; the softmax scale is
  // already in dS. Once both warpgroups meet here, every product that reads K (S^T, dQ) or V (dP^T) has
  // completed (each step's dQ part waits for all of its warpgroup's products), so each warp stages its 16
  // key rows into a tile no one reads any more and copies the same rows out itself in 16-byte chunks after
  // __syncwarp, as bwd_ws and the wide ws kernel do (fa/bwd_wgmma.cuh stage_key_rows, copy_out_key_rows;
  // kernel log 147): per thread D / 16 stmatrix, D / 16 ld.shared.v4 and D / 16 st.global.v4 where the
  // register form issued D / 4 st.global.b32 of 8 rows each (kernel log 152). (Barrier 2: every step's
  // meeting of the two warpgroups; all 256 threads pass it the same number of times, so its use here
  // cannot join a step's.) Not in the deterministic kernel: there
  // ptxas moved spills into the d256 loop with it (4 -> 20 bytes, four local accesses a step; NVRTC 13.0),
  // so it keeps the register form.
  if constexpr (!kDeterministic) {
    named_barrier_sync(2, 256);
    const u32 tile = wg == 0 ? sV : sK;
    stage_key_rows<D, BF>(tile, acc, row0, lane);
    __syncwarp();
    if (wg == 0) {
      copy_out_key_rows<16, D, 32>(static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start),
                                   p.dv_row_stride, p.seqlen_k - kv_start, p.head_dim, tile, row0, lane);
    } else {
      copy_out_key_rows<16, D, 32>(static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start),
                                   p.dk_row_stride, p.seqlen_k - kv_start, p.head_dim, tile, row0, lane);
    }
  } else if (wg == 0) {
    store_key_rows<D, BF>(static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start), p.dv_row_stride,
                          p.seqlen_k - kv_start, p.head_dim, row0, g, t, acc);
  } else {
    store_key_rows<D, BF>(static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start), p.dk_row_stride,
                          p.seqlen_k - kv_start, p.head_dim, row0, g, t, acc);
  }
}

}  // namespace sm90
}  // namespace fa
