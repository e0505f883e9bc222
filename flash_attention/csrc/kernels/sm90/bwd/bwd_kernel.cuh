// FlashAttention-2 backward's dK/dV kernel (with atomic dQ) for Hopper (sm_90a), on wgmma.
//
// The structure is the sm80 kernel's (csrc/kernels/sm80/bwd/bwd_kernel.cuh; both run the preprocessing
// of fa/bwd_preprocess.cuh): one thread block per (K/V block, kv head, batch) keeps K_j and V_j in shared
// memory and walks every query block of every query head of its GQA group, so dK and dV are summed over
// the group in registers. Warpgroup w owns keys [64 w, 64 w + 64) of the block, and the whole chain stays
// transposed:
//   S^T  = K Q^T     wgmma SS, A = K rows (K-major), B = Q (K-major), N = block_q
//   dP^T = V dO^T    wgmma SS, A = V rows, B = dO, N = block_q
//   P^T  = exp2(S^T scale log2e - LSE2),  dS^T = scale P^T (dP^T - delta)   (registers)
//   dV  += P^T dO    wgmma RS, A = P^T from the S^T accumulator packed to 16 bits, B = dO MN-major
//   dK  += dS^T Q    wgmma RS, A = dS^T, B = Q MN-major
//   dQ  += dS K      wgmma SS with both operands transposed: A = dS (stored as dS^T, keys x queries, which
//                    is dS in M-major form), B = K (MN-major); added to the fp32 dQ workspace with atomics.
// dQ's 64 x head_dim products are shared between the two warpgroups: with block_q 128 each takes 64 query
// rows (head_dim 64), with block_q 64 each takes half of head_dim's columns (head_dim 128), so neither idles.
// Tiles are 64-column panels with the 128-byte swizzle (fa/smem_layout.cuh, PanelTile); Q/dO are
// double-buffered.
#pragma once

#include "fa/block_range.cuh"
#include "fa/bwd_params.h"
#include "fa/bwd_preprocess.cuh"
#include "fa/bwd_wgmma.cuh"
#include "fa/copy.cuh"
#include "fa/frag.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class V>
__device__ __forceinline__ void bwd_dkdv_body(const BwdParams& p) {
  using Mask = typename V::Mask;  // the variant (fa/variant.cuh)
  static_assert(V::ScoreMod::kIdentity, "the backward does not differentiate a score function yet");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;   // query rows per step
  constexpr int BC = Cfg::kBlockKV;  // key rows of the block: 64 per warpgroup
  constexpr int NT = Cfg::kNumWarps * 32;
  constexpr int NQ = BR / 8;   // query n-tiles of S^T / dP^T
  constexpr int KQ = BR / 16;  // k-steps of dV / dK
  // dQ per warpgroup: 64 query rows x DQN columns, at row DQ_ROW * wg and column DQ_COL * wg (DqSplit).
  constexpr int DQN = DqSplit<BR, D>::kCols;
  constexpr int DQ_ROW = DqSplit<BR, D>::kRow;
  constexpr int DQ_COL = DqSplit<BR, D>::kCol;
  static_assert(Cfg::kNumWarps == 8 && BC == 128, "two warpgroups of 64 keys");
  using QTile = PanelTile<BR>;   // Q and dO in shared memory
  using KVTile = PanelTile<BC>;  // K, V and dS^T

  extern __shared__ __align__(16) unsigned char smem[];
  const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
  const u32 sK = base;
  const u32 sV = sK + 2 * BC * D;
  const u32 sQ = sV + 2 * BC * D;  // two buffers
  const u32 sdO = sQ + 2 * 2 * BR * D;
  const u32 sdS = sdO + 2 * 2 * BR * D;  // dS^T: BC rows (keys) of BR queries, panels of 64 queries
  const u32 sStats = sdS + 2 * BC * BR;  // [buffer][LSE2 (BR floats), delta (BR floats)]
  float* const stats = reinterpret_cast<float*>(smem + (sStats - smem_addr(smem)));
  // The layout (K, V, two Q and two dO buffers, dS^T, two buffers of statistics) and the 1 KB the base is
  // rounded up by fit what the launch allocates (configs.backward.BwdConfig.smem_bytes).
  static_assert(1024 + 4 * BC * D + 8 * BR * D + 2 * BC * BR + 16 * BR <= Cfg::kSmemBytes,
                "the shared-memory layout exceeds the config's smem_bytes");

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warpgroup_index();
  const int g = lane / 4;
  const int t = lane % 4;
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_start = n_block * BC;
  const int row0 = 64 * wg + 16 * (warp % 4);  // the warp's first key row in the block

  // The keys this block's queries see (the variant's mask), and the query blocks
  // [m_begin, m_begin + m_count) that see some key of this block.
  const Mask mask(p, batch, kv_head);
  const auto blocks = mask.template q_blocks<BR, BC>(p, kv_start);
  const int m_begin = blocks.begin;
  const int m_count = blocks.count;
  const int n_iter = p.group * m_count;

  float dv[D / 2], dk[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dv[i] = dk[i] = 0.f;

  const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, kv_start);
  const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, kv_start);

  auto load_q_step = [&](int it, int buf) {
    const int head = kv_head * p.group + it / m_count;
    const int q_start = (m_begin + it % m_count) * BR;
    const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
    const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
    load_tile<BR, D, NT, QTile, true>(sQ + buf * 2 * BR * D, gQ, p.q_row_stride, p.seqlen_q - q_start,
                                      p.head_dim, tid);
    load_tile<BR, D, NT, QTile, true>(sdO + buf * 2 * BR * D, gdO, p.do_row_stride, p.seqlen_q - q_start,
                                      p.head_dim, tid);
    // The workspaces are padded to whole 128-row blocks: no bounds check.
    const i64 r0 = workspace_row(p, batch, head, q_start);
    if (tid < BR / 4) {
      cp_async_16(sStats + buf * 8 * BR + 16 * tid, p.lse_log2 + r0 + 4 * tid, 16);
    } else if (tid < BR / 2) {
      const int c = tid - BR / 4;
      cp_async_16(sStats + buf * 8 * BR + 4 * BR + 16 * c, p.delta + r0 + 4 * c, 16);
    }
  };

  if (n_iter > 0) {
    load_tile<BC, D, NT, KVTile, true>(sK, gK, p.k_row_stride, p.seqlen_k - kv_start, p.head_dim, tid);
    load_tile<BC, D, NT, KVTile, true>(sV, gV, p.v_row_stride, p.seqlen_k - kv_start, p.head_dim, tid);
    load_q_step(0, 0);
    cp_async_commit();
  }

  // Descriptors (fa/wgmma.cuh; the forward kernel explains the byte offsets). K-major tiles: 8-row groups
  // 1024 bytes apart. MN-major tiles: 64-column panels R * 128 bytes apart (the leading byte offset).
  const u64 k_desc = smem_desc_sw128(sK + wg * 64 * 128, 16, 1024);  // A of S^T: this warpgroup's keys
  const u64 v_desc = smem_desc_sw128(sV + wg * 64 * 128, 16, 1024);
  const u64 q_desc = smem_desc_sw128(sQ, 16, 1024);         // B of S^T (K-major)
  const u64 qt_desc = smem_desc_sw128(sQ, BR * 128, 1024);  // B of dK (MN-major)
  const u64 ds_desc = smem_desc_sw128(sdS + wg * (DQ_ROW / 64) * BC * 128, BC * 128, 1024);
  const u64 kt_desc = smem_desc_sw128(sK + wg * (DQ_COL / 64) * BC * 128, BC * 128, 1024);
  constexpr u32 kDOOff = 2 * 2 * BR * D;  // dO's buffers after Q's
  const float sl2 = p.scale_log2;
  const float scale = p.scale;

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    const int buf = it & 1;
    const u32 qoff = buf * 2 * BR * D;
    const int head = kv_head * p.group + it / m_count;
    const int q_start = (m_begin + it % m_count) * BR;
    // This step's Q, dO and statistics (and K, V on the first) landed; after the barrier every warpgroup is
    // also done with the previous step (it waited for all its wgmma), so the other buffer and the dS tile
    // may be rewritten.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (it + 1 < n_iter) {
      load_q_step(it + 1, buf ^ 1);
      cp_async_commit();
    }

    // ---- S^T = K Q^T, dP^T = V dO^T -------------------------------------------------------------------
    float s[BR / 2], dp[BR / 2];
    wgmma_fence();
    issue_key_rows_product<BR, BC, D, BF>(s, k_desc, q_desc, qoff);
    issue_key_rows_product<BR, BC, D, BF>(dp, v_desc, q_desc, kDOOff + qoff);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);
    wgmma_hold(dp);

    // ---- mask: keys past seqlen_k and the causal diagonal ------------------------------------------------
    // Register 4 n + e is key kv_start + row0 + g + 8 (e / 2) against query q_start + 8 n + 2 t + e % 2.
    // Queries past seqlen_q need no mask: their base-2 LSE is +inf, so their P is 0.
    mask.mask_key_rows(acc_tile(s), kv_start, row0, q_start, g, t);

    // ---- P^T, dS^T
    // -------------------------------------------------------------------------------------------
    const float* lse_s = stats + buf * 2 * BR;
    const float* del_s = lse_s + BR;
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * t);
      const float2 dl = *reinterpret_cast<const float2*>(del_s + 8 * n + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2_approx(fmaf(s[4 * n + e], sl2, -((e & 1) ? l2.y : l2.x)));
        s[4 * n + e] = pr;
        dp[4 * n + e] = pr * (dp[4 * n + e] - ((e & 1) ? dl.y : dl.x)) * scale;
      }
    }
    u32 pf[KQ][4], sf[KQ][4];
    pack_p_ds<BR, BF>(pf, sf, s, dp);

    // dS^T to shared memory for dQ (fa/bwd_wgmma.cuh).
    store_ds_t<BR, BC>(sdS, sf, row0, lane);

    // ---- dV += P^T dO, dK += dS^T Q
    // --------------------------------------------------------------------------
    wgmma_fence();
    issue_dv_dk<BR, D, BF>(dv, dk, pf, sf, qt_desc, qoff, kDOOff + qoff);
    wgmma_commit();

    // Every warpgroup's dS^T is written (and visible to the tensor cores).
    fence_proxy_async();
    __syncthreads();
    if constexpr (BR == 128) {
      // The 64-query S^T / dP^T fragments (pf, sf: 64 registers) stay live while dV / dK read them; with
      // the dQ accumulator on top that spills, so dQ waits for them here.
      wgmma_wait<0>();
      wgmma_hold(dv);
      wgmma_hold(dk);
    }

    // ---- dQ += dS K (this warpgroup's 64 x DQN part)
    // --------------------------------------------------------
    float dq[DQN / 2];
    wgmma_fence();
    issue_dq<BC, DQN, BF>(dq, ds_desc, kt_desc);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(dq);
    wgmma_hold(dv);
    wgmma_hold(dk);
    {
      // Register 4 n + e: query row 16 (warp % 4) + g + 8 (e / 2) of the warpgroup's 64, column 8 n + 2 t.
      float* const gdq = p.dq_accum +
                         (workspace_row(p, batch, head, q_start) + DQ_ROW * wg + 16 * (warp % 4) + g) * D +
                         DQ_COL * wg + 2 * t;
#pragma unroll
      for (int n = 0; n < DQN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          red_add_f32x2(gdq + 8 * r * D + 8 * n, dq[4 * n + 2 * r], dq[4 * n + 2 * r + 1]);
    }
  }

  // ---- epilogue: dK, dV (scale already folded into dS) ---------------------------------------------------
  store_dk_dv<D, BF>(p, batch, kv_head, kv_start, p.seqlen_k - kv_start, row0, g, t, dk, dv);
}

}  // namespace sm90
}  // namespace fa
