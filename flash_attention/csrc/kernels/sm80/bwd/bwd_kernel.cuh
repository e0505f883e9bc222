// FlashAttention-2 backward on the sm_80 instruction set (mma.sync m16n8k16, ldmatrix, cp.async).
//
// Three kernels (flash_attention/ops.py launches them in this order):
//  1. bwd_preprocess_body: delta_i = rowsum(dO_i * O_i) and the LSE in base 2, per query row, into
//     workspaces padded to whole query blocks.
//  2. bwd_dkdv_body: one thread block per (K/V block, kv head, batch, column slice). K_j and V_j stay in
//     shared memory while the block walks every query block of every query head of its GQA group, so dK and
//     dV of a kv head are summed over the group in registers (no atomics, no expanded copy). Warps own key
//     rows, so the whole chain stays in registers in the transposed form: S^T = K Q^T, P^T = exp(S^T - LSE),
//     dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q. The accumulator layout of two
//     adjacent S^T n-tiles is the A layout of one k-step, as in the forward's P V. With kAtomicDQ it also
//     writes dS^T to shared memory and adds dS K_j into an fp32 dQ workspace with atomics.
//  3. bwd_dq_body (deterministic mode): one thread block per query block, walking K/V like the forward and
//     recomputing S and dP to accumulate dQ in registers. No atomics, so the bits do not depend on timing;
//     the cost is the second S and dP (about 1.4x the backward's matmuls).
//
// Head dims whose dK+dV accumulators would not fit the registers are split into column slices
// (Cfg::kSplit): each slice's block recomputes S^T and dP^T over the full head_dim and accumulates only its
// columns of dK, dV and dQ.
#pragma once

#include "fa/block_range.cuh"
#include "fa/bwd_params.h"
#include "fa/bwd_preprocess.cuh"
#include "fa/copy.cuh"
#include "fa/dropout.cuh"
#include "fa/frag.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/variant.cuh"

namespace fa {

// ---- 1. preprocessing: fa/bwd_preprocess.cuh (shared with the wgmma backward) -----------------------------

// ---- 2. dK, dV (and atomic dQ) --------------------------------------------------------------------------
template <class Cfg, class V, bool kAtomicDQ, bool kDropout = false>
__device__ __forceinline__ void bwd_dkdv_body(const BwdParams& p) {
  using Mask = typename V::Mask;  // the variant (fa/variant.cuh)
  using ScoreMod = typename V::ScoreMod;
  static_assert(ScoreModHasGradient<typename V::ScoreMod>::value,
                "the backward does not differentiate a score function without its derivative "
                "(kUnitGradient, gradient)");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;   // query rows per step
  constexpr int BC = Cfg::kBlockKV;  // key rows of the block
  constexpr int NW = Cfg::kNumWarps;
  constexpr int DS = Cfg::kSplit;
  constexpr int DO = D / DS;   // output columns of this block
  constexpr int WN = BC / NW;  // key rows per warp
  constexpr int MT = WN / 16;
  constexpr int NQ = BR / 8;   // query n-tiles of S^T
  constexpr int KQ = BR / 16;  // k-steps of dV += P^T dO
  constexpr int DK = D / 16;   // k-steps of S^T = K Q^T
  constexpr int NO = DO / 8;   // n-tiles of the dK / dV accumulators
  constexpr int NB = Cfg::kDoubleBuffer ? 2 : 1;
  // dQ = dS K: warps tile the (BR x DO) output as WQM row groups x WQN column groups.
  constexpr int WQM = NW < BR / 16 ? NW : BR / 16;
  constexpr int WQN = NW / WQM;
  constexpr int MQ = BR / 16 / WQM;  // 16-row tiles per warp
  constexpr int DOW = DO / WQN;      // columns per warp
  // Columns per atomic pass: one swizzle group, so a pass's column offset is a plain byte offset. (With
  // 32-column passes the loop index reached FragAddr's per-lane base array at run time, which put that array
  // in local memory: the first profile showed local loads as the kernel's top stall.)
  constexpr int QC = 64;
  static_assert(WN % 16 == 0 && BR % 64 == 0 && DO % 64 == 0 && DOW % 64 == 0, "bad backward tile");
  constexpr int kThreads = NW * 32;
  using Tile = RowMajorTile<D, true>;  // K, V, Q and dO in shared memory, swizzled

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sK = smem_addr(smem);
  const u32 sV = sK + 2 * BC * D;
  const u32 sQ = sV + 2 * BC * D;
  const u32 sdO = sQ + NB * 2 * BR * D;
  const u32 sdS = sdO + NB * 2 * BR * D;
  float* const sL = reinterpret_cast<float*>(smem + 4 * BC * D + 4 * NB * BR * D + 2 * BC * BR);
  float* const sDelta = sL + NB * BR;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int n_block = blockIdx.x / DS;
  const int d0 = (blockIdx.x % DS) * DO;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_start = n_block * BC;
  const int warp_row0 = warp * WN;

  // The keys this block's queries see (the variant's mask), and the query blocks
  // [m_begin, m_begin + m_count) that see some key of this block.
  const Mask mask(p, batch, kv_head);
  const auto blocks = mask.template q_blocks<BR, BC>(p, kv_start);
  const int m_begin = blocks.begin;
  const int m_count = blocks.count;
  const int kv_hi = mask.key_end();
  const int n_iter = p.group * m_count;

  float dv[MT][NO][4], dk[MT][NO][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[mt][n][e] = dk[mt][n][e] = 0.f;

  const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, kv_start);
  const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, kv_start);

  // Query block `it` of the flattened (query head of the group, query block) walk, into buffer `buf`.
  auto load_q_step = [&](int it, int buf) {
    const int head = kv_head * p.group + it / m_count;
    const int q_start = (m_begin + it % m_count) * BR;
    const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
    const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
    load_tile<BR, D, kThreads, Tile, true>(sQ + buf * 2 * BR * D, gQ, p.q_row_stride, p.seqlen_q - q_start,
                                           p.head_dim, tid);
    load_tile<BR, D, kThreads, Tile, true>(sdO + buf * 2 * BR * D, gdO, p.do_row_stride, p.seqlen_q - q_start,
                                           p.head_dim, tid);
    // The workspaces are padded to whole blocks: no bounds check.
    const i64 row0 = workspace_row(p, batch, head, q_start);
    if (tid < BR / 4) {
      cp_async_16(smem_addr(sL + buf * BR + 4 * tid), p.lse_log2 + row0 + 4 * tid, 16);
    } else if (tid < BR / 2) {
      const int c = tid - BR / 4;
      cp_async_16(smem_addr(sDelta + buf * BR + 4 * c), p.delta + row0 + 4 * c, 16);
    }
  };

  if (n_iter > 0) {
    load_tile<BC, D, kThreads, Tile, true>(sK, gK, p.k_row_stride, kv_hi - kv_start, p.head_dim, tid);
    load_tile<BC, D, kThreads, Tile, true>(sV, gV, p.v_row_stride, kv_hi - kv_start, p.head_dim, tid);
    load_q_step(0, 0);
    cp_async_commit();
  }

  // ldmatrix addresses (see the forward for the fragment layouts). A from K / V rows (keys x head_dim);
  // B from Q / dO rows, not transposed (S^T, dP^T: n = queries, k = head_dim); B from Q / dO transposed
  // (dK, dV: k = queries, n = head_dim); B from K transposed (dQ: k = keys, n = head_dim).
  const FragAddr<D, true> a_kv(sK, lane % 16, lane / 16);
  const FragAddr<D, true> b_qd(sQ, 8 * (lane / 16) + lane % 8, (lane / 8) % 2);
  const FragAddr<D, true> bt_qd(sQ, 8 * ((lane / 8) % 2) + lane % 8, lane / 16);
  constexpr u32 kVOff = 2 * BC * D;        // V's tile after K's
  constexpr u32 kDOOff = NB * 2 * BR * D;  // dO's tiles after Q's
  // exp2's multiplier (fa/variant.cuh backward_score: the scale folded in for the identity).
  const float sl2 = backward_exp2_multiplier<ScoreMod>(p);

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    const int buf = NB == 2 ? (it & 1) : 0;
    const u32 qoff = buf * 2 * BR * D;
    const int head = kv_head * p.group + it / m_count;
    const int q_start = (m_begin + it % m_count) * BR;
    // Q, dO, LSE and delta of this step (and K, V on the first) have landed for this thread; the barrier
    // publishes every thread's copies and tells us every warp is done with the previous step's dS tile.
    cp_async_wait<0>();
    __syncthreads();
    if (NB == 2 && it + 1 < n_iter) {
      // The other buffer was last read by the previous step's dK/dV products, which every warp finished
      // before its dS barrier.
      load_q_step(it + 1, buf ^ 1);
      cp_async_commit();
    }

    // ---- S^T = K Q^T and dP^T = V dO^T (warp: WN key rows x BR queries) ---------------------------------
    float s[MT][NQ][4], dp[MT][NQ][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a_kv(warp_row0 + 16 * mt, kk));
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        u32 b[4];
        ldmatrix_x4(b, b_qd(16 * np, kk) + qoff);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816<BF>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a_kv(warp_row0 + 16 * mt, kk) + kVOff);
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        u32 b[4];
        ldmatrix_x4(b, b_qd(16 * np, kk) + kDOOff + qoff);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(dp[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816<BF>(dp[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // ---- the variant's score function, then its mask, keys as rows (fa/variant.cuh) --------------------
    const ScoreMod score_mod(p, batch, head);
    score_mod_key_rows(acc_tile(s), score_mod, p.scale, kv_start, warp_row0, q_start, g, t);
    mask.mask_key_rows(acc_tile(s), kv_start, warp_row0, q_start, g, t);

    // ---- P^T = exp2(S^T scale log2e - LSE2), dS^T = scale P^T (dP^T - delta)
    // --------------------------------
    const float* lse_s = sL + buf * BR;
    const float* del_s = sDelta + buf * BR;
    const float scale = p.scale;
    // With dropout (mask Z, kept elements scaled by rp = 1 / (1 - p)): dV takes P Z rp, and dS = P (dP Z rp
    // - delta), where dP = dO V^T and delta = rowsum(dO O) as without dropout.
    u32 hh = 0;
    if constexpr (kDropout) hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * t);
      const float2 dl = *reinterpret_cast<const float2*>(del_s + 8 * n + 2 * t);
      u32 hr[2] = {0, 0};
      if constexpr (kDropout) {
        hr[0] = dropout_row_hash(hh, q_start + 8 * n + 2 * t);
        hr[1] = dropout_row_hash(hh, q_start + 8 * n + 2 * t + 1);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // (Z of the tile's four elements: its keys' pairs, fa/dropout.cuh)
        bool keep4[4] = {};
        if constexpr (kDropout)
          dropout_keep_key_rows<kDropoutKeyPairs<V>>(keep4, hr, kv_start + warp_row0 + 16 * mt + g,
                                                     p.dropout_threshold);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pr = exp2_approx(fmaf(s[mt][n][e], sl2, -((e & 1) ? l2.y : l2.x)));
          // The score function's derivative, from its backward score (still in s here; 0 where masked).
          const int key = kv_start + warp_row0 + 16 * mt + g + 8 * (e >> 1), query = q_start + 8 * n + 2 * t + (e & 1);
          // (score_mod_for_key: with per-row slopes, the key row's, loaded once per key row)
          const float grad =
              backward_gradient(score_mod_for_key(score_mod, key), s[mt][n][e], pr, query, key);
          if constexpr (kDropout) {
            const bool keep = keep4[e];
            s[mt][n][e] = keep ? pr * p.dropout_rp : 0.f;
            dp[mt][n][e] =
                pr * ((keep ? dp[mt][n][e] * p.dropout_rp : 0.f) - ((e & 1) ? dl.y : dl.x)) * scale * grad;
          } else {
            s[mt][n][e] = pr;
            dp[mt][n][e] = pr * (dp[mt][n][e] - ((e & 1) ? dl.y : dl.x)) * scale * grad;
          }
        }
      }
    }
    u32 pf[MT][KQ][4], sf[MT][KQ][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KQ; ++ks) {
        acc_to_a_frag<BF>(pf[mt][ks], acc_tile(s), mt, ks);
        acc_to_a_frag<BF>(sf[mt][ks], acc_tile(dp), mt, ks);
      }

    if constexpr (kAtomicDQ) {
      // dS^T to shared memory (rows = keys, BR wide, swizzled) for dQ = dS K after the barrier below; stored
      // from the packed fragments, so the fp32 dS^T dies here rather than living through dK/dV.
      // sf[mt][ks] holds rows g (regs 0, 2) and g + 8 (regs 1, 3) of query n-tiles 2 ks (regs 0, 1) and
      // 2 ks + 1 (regs 2, 3).
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KQ; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = warp_row0 + 16 * mt + g + 8 * (e & 1);
            st_shared_32(sdS + RowMajorTile<BR, true>::bytes(row, 2 * ks + (e >> 1)) + 4 * t, sf[mt][ks][e]);
          }
    }

    // ---- dV += P^T dO, dK += dS^T Q (this block's DO columns, starting at d0)
    // ------------------------------ d0 is a multiple of 64 elements, so the column offset moves whole
    // swizzle groups: a byte offset.
    const u32 col_off = 2 * d0;
#pragma unroll
    for (int ks = 0; ks < KQ; ++ks) {
#pragma unroll
      for (int dq = 0; dq < NO / 2; ++dq) {
        u32 b[4];
        ldmatrix_x4_trans(b, bt_qd(16 * ks, dq) + kDOOff + qoff + col_off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(dv[mt][2 * dq], pf[mt][ks], b[0], b[1]);
          mma_16816<BF>(dv[mt][2 * dq + 1], pf[mt][ks], b[2], b[3]);
        }
        ldmatrix_x4_trans(b, bt_qd(16 * ks, dq) + qoff + col_off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(dk[mt][2 * dq], sf[mt][ks], b[0], b[1]);
          mma_16816<BF>(dk[mt][2 * dq + 1], sf[mt][ks], b[2], b[3]);
        }
      }
    }

    // Every warp's dS^T is in shared memory, and every warp is past its dK/dV products (so with one buffer
    // the next Q/dO may overwrite this step's).
    __syncthreads();
    if (NB == 1 && it + 1 < n_iter) {
      load_q_step(it + 1, 0);
      cp_async_commit();
    }
    if constexpr (kAtomicDQ) {
      const int wq_row = (warp / WQN) * (BR / WQM);
      const int wq_col = d0 + (warp % WQN) * DOW;  // a multiple of 64
      // A operand from dS^T, transposed on load: lane l supplies key row 8 (l / 16) + l % 8 at query chunk
      // 2 (wq_row / 16 + mq) + (l / 8) % 2.
      u32 a_ds[MQ];
      {
        const int row = 8 * (lane / 16) + lane % 8;
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq) {
          const int chunk = 2 * (wq_row / 16 + mq) + (lane / 8) % 2;
          a_ds[mq] = sdS + 2 * BR * row + 16 * (chunk ^ (row & 7));
        }
      }
      // This lane's two rows of the warp's first 16-row tile; every other offset is a compile-time constant.
      float* const gdq =
          p.dq_accum + (workspace_row(p, batch, head, q_start) + wq_row + g) * D + wq_col + 2 * t;
      // Not unrolled: unrolled, the compiler keeps every pass's atomic addresses live at once.
#pragma unroll 1
      for (int c = 0; c < DOW / QC; ++c) {
        float acc[MQ][QC / 8][4];
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
          for (int n = 0; n < QC / 8; ++n)
            acc[mq][n][0] = acc[mq][n][1] = acc[mq][n][2] = acc[mq][n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < BC / 16; ++ks) {
          u32 a[MQ][4];
#pragma unroll
          for (int mq = 0; mq < MQ; ++mq) ldmatrix_x4_trans(a[mq], a_ds[mq] + 2 * BR * 16 * ks);
#pragma unroll
          for (int dq = 0; dq < QC / 16; ++dq) {
            u32 b[4];
            // K transposed: the same lane pattern as Q/dO transposed, on K's tile.
            ldmatrix_x4_trans(b, bt_qd(16 * ks, dq) - (sQ - sK) + 2 * (wq_col + c * QC));
#pragma unroll
            for (int mq = 0; mq < MQ; ++mq) {
              mma_16816<BF>(acc[mq][2 * dq], a[mq], b[0], b[1]);
              mma_16816<BF>(acc[mq][2 * dq + 1], a[mq], b[2], b[3]);
            }
          }
        }
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
          for (int n = 0; n < QC / 8; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              red_add_f32x2(gdq + (16 * mq + 8 * r) * D + c * QC + 8 * n, acc[mq][n][2 * r],
                            acc[mq][n][2 * r + 1]);
      }
    }
  }

  // ---- epilogue: dK, dV (scale already folded into dS) ---------------------------------------------------
  u16* gdK = static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start);
  u16* gdV = static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + 16 * mt + g + 8 * r;
      if (kv_start + row < p.seqlen_k) {
#pragma unroll
        for (int n = 0; n < NO; ++n) {
          const int col = d0 + 8 * n + 2 * t;
          if (col < p.head_dim) {
            st_global_32(gdK + (i64)row * p.dk_row_stride + col,
                         pack2<BF>(dk[mt][n][2 * r], dk[mt][n][2 * r + 1]));
            st_global_32(gdV + (i64)row * p.dv_row_stride + col,
                         pack2<BF>(dv[mt][n][2 * r], dv[mt][n][2 * r + 1]));
          }
        }
      }
    }
}

// ---- 3. dQ without atomics (deterministic mode) ----------------------------------------------------------
// The forward's structure: warps own 16 query rows each (kBlockQ / 16 warps), K/V blocks of DqCfg::kBlockKV
// keys stream through shared memory, S = Q K^T and dP = dO V^T stay in registers, and dS (already in the
// A-operand layout) multiplies K_j straight from the accumulators.
template <class Cfg>
struct DqCfg : Cfg {
  static constexpr int kNumWarps = Cfg::kBlockQ / 16;
  static constexpr int kBlockKV = Cfg::kHeadDim > 128 ? 32 : (Cfg::kBlockKV < 64 ? Cfg::kBlockKV : 64);
};

template <class Cfg, class V, bool kDropout = false>
__device__ __forceinline__ void bwd_dq_body(const BwdParams& p) {
  using Mask = typename V::Mask;
  using ScoreMod = typename V::ScoreMod;
  static_assert(ScoreModHasGradient<typename V::ScoreMod>::value,
                "the backward does not differentiate a score function without its derivative "
                "(kUnitGradient, gradient)");
  using QCfg = DqCfg<Cfg>;
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int BC = QCfg::kBlockKV;
  constexpr int DS = Cfg::kSplit;
  constexpr int DO = D / DS;
  constexpr int NS = BC / 8;
  constexpr int KS = BC / 16;
  constexpr int DK = D / 16;
  constexpr int NO = DO / 8;
  constexpr int kThreads = QCfg::kNumWarps * 32;
  using Tile = RowMajorTile<D, true>;  // Q, dO, K and V in shared memory, swizzled

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sQ = smem_addr(smem);
  const u32 sdO = sQ + 2 * BR * D;
  const u32 sK = sdO + 2 * BR * D;
  const u32 sV = sK + 2 * BC * D;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int m_block = blockIdx.x / DS;
  const int d0 = (blockIdx.x % DS) * DO;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.group;
  const int q_start = m_block * BR;
  const int warp_row0 = 16 * warp;

  // The keys this block's rows see (the variant's mask) and the K/V blocks [n_begin, n_end) holding any
  // of them (for all BR rows: rows past seqlen_q only add blocks, their P is 0).
  const Mask mask(p, batch, head);
  const ScoreMod score_mod(p, batch, head);
  const auto blocks = mask.template kv_blocks<BC>(q_start, BR);
  const int n_end = blocks.end;
  int n_begin = 0;
  if constexpr (Mask::kLowerBound) n_begin = blocks.begin;
  const int kv_hi = mask.key_end();

  const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
  const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
  const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, 0);
  const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, 0);
  load_tile<BR, D, kThreads, Tile, true>(sQ, gQ, p.q_row_stride, p.seqlen_q - q_start, p.head_dim, tid);
  load_tile<BR, D, kThreads, Tile, true>(sdO, gdO, p.do_row_stride, p.seqlen_q - q_start, p.head_dim, tid);
  cp_async_commit();

  // Per-thread rows g and g + 8 of the warp's tile: their base-2 LSE and delta.
  float lse2[2], del[2];
  {
    const i64 row0 = workspace_row(p, batch, head, q_start) + warp_row0 + g;
    lse2[0] = p.lse_log2[row0];
    lse2[1] = p.lse_log2[row0 + 8];
    del[0] = p.delta[row0];
    del[1] = p.delta[row0 + 8];
  }
  u32 hr[2] = {0, 0};
  if constexpr (kDropout) {
    const u32 hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
    hr[0] = dropout_row_hash(hh, q_start + warp_row0 + g);
    hr[1] = dropout_row_hash(hh, q_start + warp_row0 + g + 8);
  }

  float acc[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  const FragAddr<D, true> a_qd(sQ, warp_row0 + lane % 16, lane / 16);
  const FragAddr<D, true> b_kv(sK, 8 * (lane / 16) + lane % 8, (lane / 8) % 2);
  const FragAddr<D, true> bt_k(sK, 8 * ((lane / 8) % 2) + lane % 8, lane / 16);
  constexpr u32 kDOOff = 2 * BR * D;
  constexpr u32 kVOff = 2 * BC * D;
  // exp2's multiplier (fa/variant.cuh backward_score: the scale folded in for the identity).
  const float sl2 = backward_exp2_multiplier<ScoreMod>(p);
  const u32 col_off = 2 * d0;

#pragma unroll 1
  for (int j = n_begin; j < n_end; ++j) {
    const int kv_start = j * BC;
    // Every warp is done with the previous K/V block.
    __syncthreads();
    load_tile<BC, D, kThreads, Tile, true>(sK, gK + (i64)kv_start * p.k_row_stride, p.k_row_stride,
                                           kv_hi - kv_start, p.head_dim, tid);
    load_tile<BC, D, kThreads, Tile, true>(sV, gV + (i64)kv_start * p.v_row_stride, p.v_row_stride,
                                           kv_hi - kv_start, p.head_dim, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float s[NS][4], dp[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      u32 a[4], a2[4];
      ldmatrix_x4(a, a_qd(0, kk));
      ldmatrix_x4(a2, a_qd(0, kk) + kDOOff);
#pragma unroll
      for (int np = 0; np < NS / 2; ++np) {
        u32 b[4];
        ldmatrix_x4(b, b_kv(16 * np, kk));
        mma_16816<BF>(s[2 * np], a, b[0], b[1]);
        mma_16816<BF>(s[2 * np + 1], a, b[2], b[3]);
        ldmatrix_x4(b, b_kv(16 * np, kk) + kVOff);
        mma_16816<BF>(dp[2 * np], a2, b[0], b[1]);
        mma_16816<BF>(dp[2 * np + 1], a2, b[2], b[3]);
      }
    }

    score_mod_query_rows<true>(acc_tile(s), score_mod, p.scale, q_start + warp_row0, kv_start, g, t);
    mask.mask_query_rows(acc_tile(s), q_start + warp_row0, kv_start, g, t);
    static_assert(NS % 2 == 0, "n-tiles in pairs (fa/dropout.cuh)");
    bool keep4[2][4] = {};  // Z of the rows g and g + 8 over n-tiles n and n + 1 (n even)
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      if constexpr (kDropout) {
        if (n % 2 == 0) {
#pragma unroll
          for (int r = 0; r < 2; ++r)
            dropout_keep_query_row<kDropoutKeyPairs<V>>(keep4[r], hr[r], kv_start + 8 * n + 2 * t,
                                                        p.dropout_threshold);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2_approx(fmaf(s[n][e], sl2, -lse2[e >> 1]));
        const int query = q_start + warp_row0 + g + 8 * (e >> 1), key = kv_start + 8 * n + 2 * t + (e & 1);
        const float grad = backward_gradient(score_mod, s[n][e], pr, query, key);
        float dpv = dp[n][e];
        if constexpr (kDropout)
          dpv = keep4[e >> 1][2 * (n % 2) + (e & 1)] ? dpv * p.dropout_rp : 0.f;
        dp[n][e] = pr * (dpv - del[e >> 1]) * p.scale * grad;
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[4];
      acc_to_a_frag<BF>(a, acc_tile(dp), 0, ks);
#pragma unroll
      for (int dq = 0; dq < NO / 2; ++dq) {
        u32 b[4];
        ldmatrix_x4_trans(b, bt_k(16 * ks, dq) + col_off);
        mma_16816<BF>(acc[2 * dq], a, b[0], b[1]);
        mma_16816<BF>(acc[2 * dq + 1], a, b[2], b[3]);
      }
    }
  }

  u16* gdQ = static_cast<u16*>(p.dq) + dq_offset(p, batch, head, q_start);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + g + 8 * r;
    if (q_start + row < p.seqlen_q) {
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const int col = d0 + 8 * n + 2 * t;
        if (col < p.head_dim)
          st_global_32(gdQ + (i64)row * p.dq_row_stride + col, pack2<BF>(acc[n][2 * r], acc[n][2 * r + 1]));
      }
    }
  }
}

}  // namespace fa
