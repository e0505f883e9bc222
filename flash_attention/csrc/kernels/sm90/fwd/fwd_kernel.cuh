// FlashAttention forward for Hopper (sm_90a): the matrix products on wgmma, everything else as in the sm80
// kernel (csrc/kernels/sm80/fwd/fwd_kernel.cuh), whose comments on masking and the online softmax apply here.
//
// One thread block is kBlockQ / 64 warpgroups; warpgroup w owns query rows [64 w, 64 w + 64) of the block
// and warp i of it rows 16 i .. 16 i + 15 of those. mma.sync reads its operands from registers, so on sm_80
// every K/V fragment has to pass through ldmatrix first, and on Hopper that shared-memory traffic, not the
// tensor cores, is what limits the sm80 kernel. wgmma reads B (and A, for S) straight from shared memory:
//   S = Q K_j^T   wgmma m64n{kBlockKV}k16, A = Q and B = K both from shared memory (K-major),
//   O += P V_j    wgmma m64n{kHeadDim}k16, A = P from registers (the S accumulator layout, packed to 16
//                 bits, is the A-fragment layout), B = V from shared memory read transposed (MN-major).
// Tiles live in shared memory as 64-column panels (128-byte rows) with the 128-byte swizzle the tensor cores
// undo themselves: 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row. cp.async writes them
// (through the generic proxy), so each thread fences the async proxy before the barrier that publishes a
// tile (fence_proxy_async).
//
// Two schedules (Cfg::kStages):
// * 1: the sm80 kernel's eager one with one K and one V buffer: V_j streams in while S_j is computed,
//   K_{j+1} while P_j V_j is; two barriers per K/V block.
// * S >= 2: a ring of S (K, V) buffers. Block j + S - 1 is requested at the top of iteration j, so a copy
//   has S - 1 whole iterations to land (a K/V tile from L2 takes longer than one half-iteration of matrix
//   work at these tile sizes); one barrier per block.
// Two or more thread blocks per multiprocessor (where shared memory and registers allow) overlap one
// block's softmax with another's matrix products.
#pragma once

#include "fa/config_check.h"
#include "fa/dropout.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

// Byte offset of 16-byte chunk `chunk` of row `row` in an R-row tile of 64-column panels, 128-byte swizzle.
template <int R>
__device__ __forceinline__ u32 panel_offset(int row, int chunk) {
  return (u32)((chunk >> 3) * (R * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Copy R rows x D columns from global memory (rows `row_stride` elements apart) into the panel layout.
// Rows at or past `rows_valid` and columns at or past `head_dim` are zero-filled (the sm80 kernel's
// load_tile says why zeros are the right filler).
template <int R, int D, int kThreads>
__device__ __forceinline__ void load_panels(u32 s_tile, const u16* g, i64 row_stride, int rows_valid,
                                            int head_dim, int tid) {
  constexpr int C = D / 8;
  constexpr int kTotal = R * C;
  constexpr bool kNested = kThreads % C == 0;
  constexpr int kRowStep = kNested ? kThreads / C : 1;
  const int chunk0 = tid % C;
  const int row0 = tid / C;
  const bool col_ok = chunk0 * 8 < head_dim;
  const u16* src = g + (i64)(unsigned)row0 * row_stride + chunk0 * 8;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    if (kTotal % kThreads != 0 && tid + i * kThreads >= kTotal) break;
    const int row = kNested ? row0 + i * kRowStep : (tid + i * kThreads) / C;
    const int chunk = kNested ? chunk0 : (tid + i * kThreads) % C;
    const bool ok = row < rows_valid && (kNested ? col_ok : chunk * 8 < head_dim);
    const u16* p = kNested ? src + i * kRowStep * row_stride : g + row * row_stride + chunk * 8;
    cp_async_16(s_tile + panel_offset<R>(row, chunk), ok ? p : g, ok ? 16 : 0);
  }
}

template <class Cfg, bool kCausal, bool kRanged = false, bool kDropout = false>
__device__ __forceinline__ void fwd_kernel_body(const FwdParams& p) {
  static_assert(check_config<Cfg>::ok, "");
  static_assert(Cfg::kWgmma, "the sm90 kernel runs wgmma configs only");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int NT = Cfg::kNumWarps * 32;
  constexpr int NS = BC / 8;   // 8-column n-tiles of S
  constexpr int KS = BC / 16;  // k-steps of O += P V
  constexpr int NO = D / 8;    // 8-column n-tiles of O
  constexpr int DK = D / 16;   // k-steps of S = Q K^T

  // The 128-byte swizzle repeats every 1024 bytes and the descriptors assume tiles start on that boundary;
  // the dynamic shared memory window is only 16-byte aligned, so the block asks for 1 KB more and rounds up.
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 sQ = (smem_addr(smem) + 1023u) & ~1023u;
  constexpr int NST = Cfg::kStages;
  constexpr u32 kTile = 2 * BC * D;  // bytes of one K or V tile
  const u32 sK = sQ + 2 * BR * D;    // NST K tiles, then NST V tiles
  const u32 sV = sK + NST * kTile;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warp / 4;
  const int m_block = kCausal ? (p.num_m_blocks - 1 - (int)blockIdx.x) : (int)blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.group;
  const int q_start = m_block * BR;
  const int q_valid = min(BR, p.seqlen_q - q_start);

  const u16* gQ = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                  q_start * p.q_row_stride;
  const u16* gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const u16* gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  u16* gO =
      static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride + q_start * p.o_row_stride;
  float* gL = p.lse ? p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start : nullptr;

  int kv_lo = 0, kv_hi = p.seqlen_k;
  if constexpr (kRanged) {
    kv_lo = min(max(p.key_range[2 * batch], 0), p.seqlen_k);
    kv_hi = min(max(p.key_range[2 * batch + 1], kv_lo), p.seqlen_k);
  }
  const int shift = p.seqlen_k - p.seqlen_q;
  int n_blocks = (kv_hi + BC - 1) / BC;
  const int j_lo = kRanged ? kv_lo / BC : 0;
  if (kCausal) {
    const int max_key = q_start + q_valid - 1 + shift;
    n_blocks = max_key < 0 ? 0 : min(n_blocks, max_key / BC + 1);
  }

  // Accumulator coordinates (PTX ISA 9.7.15.5.1.1.1, m64nNk16 D fragment): register 4 n + e of a thread holds
  // row 16 (warp % 4) + g + 8 (e / 2) of its warpgroup's 64, column 8 n + 2 t + e % 2.
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = 16 * warp;  // = 64 wg + 16 (warp % 4): the block row of the warp's first row

  if (n_blocks <= j_lo) {
    // No key is visible to any row of this block: out = 0, lse = -inf.
    constexpr int C = D / 8;
    for (int idx = tid; idx < BR * C; idx += NT) {
      const int row = idx / C, chunk = idx % C;
      if (row < q_valid && chunk * 8 < p.head_dim)
        st_global_16(gO + row * p.o_row_stride + chunk * 8, make_uint4(0, 0, 0, 0));
    }
    if (gL)
      for (int row = tid; row < q_valid; row += NT) gL[row] = neg_inf();
    return;
  }

  const int n_iter = n_blocks - j_lo;
  auto load_k = [&](int buf, int blk) {
    load_panels<BC, D, NT>(sK + buf * kTile, gK + (i64)blk * BC * p.k_row_stride, p.k_row_stride,
                           kv_hi - blk * BC, p.head_dim, tid);
  };
  auto load_v = [&](int buf, int blk) {
    load_panels<BC, D, NT>(sV + buf * kTile, gV + (i64)blk * BC * p.v_row_stride, p.v_row_stride,
                           kv_hi - blk * BC, p.head_dim, tid);
  };
  load_panels<BR, D, NT>(sQ, gQ, p.q_row_stride, q_valid, p.head_dim, tid);
  load_k(0, j_lo);
  if constexpr (NST > 1) {
    // Blocks 0 .. NST - 2 in flight, one copy group each (an empty group past the end keeps the count).
    load_v(0, j_lo);
    cp_async_commit();
#pragma unroll
    for (int st = 1; st < NST - 1; ++st) {
      if (st < n_iter) {
        load_k(st, j_lo + st);
        load_v(st, j_lo + st);
      }
      cp_async_commit();
    }
  } else {
    cp_async_commit();
  }

  // Descriptors. Q and K: K-major with 128-byte rows, 8-row groups 1024 bytes apart (the stride byte
  // offset); the leading byte offset is unused for swizzled K-major tiles. A k-step of 16 columns is 32
  // bytes along a row; every fourth starts the next panel. V: MN-major, its 16 keys of a k-step are two
  // 8-row groups 1024 bytes apart, and the 64-column panels of head_dim are BC * 128 bytes apart (the
  // leading byte offset).
  const u64 q_desc = smem_desc_sw128(sQ + wg * 64 * 128, 16, 1024);
  const u64 k_desc = smem_desc_sw128(sK, 16, 1024);
  const u64 v_desc = smem_desc_sw128(sV, BC * 128, 1024);

  float o[NO * 4];
#pragma unroll
  for (int i = 0; i < NO * 4; ++i) o[i] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};
  const float sl2 = p.scale_log2;

  for (int it = 0; it < n_iter; ++it) {
    const int j = j_lo + it;
    const int kv_start = j * BC;
    const int buf = NST > 1 ? it % NST : 0;
    if constexpr (NST > 1) {
      // Block j's group is complete once at most NST - 2 newer ones are pending. P_{j-1} V_{j-1} must be
      // done before the barrier, after which buffer (j - 1) % NST is refilled with block j + NST - 1.
      cp_async_wait<NST - 2>();
      wgmma_wait<0>();
      wgmma_hold(o);
      fence_proxy_async();
      __syncthreads();
      if (it + NST - 1 < n_iter) {
        load_k((it + NST - 1) % NST, j + NST - 1);
        load_v((it + NST - 1) % NST, j + NST - 1);
      }
      cp_async_commit();
    } else {
      // K_j (and Q) landed; after the barrier every warpgroup is also done with P_{j-1} V_{j-1} (it waited
      // for its wgmma), so V's buffer may be refilled.
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      load_v(0, j);
      cp_async_commit();
    }
    const u64 kd = k_desc + ((buf * kTile) >> 4);
    const u64 vd = v_desc + ((buf * kTile) >> 4);

    // ---- S = Q K_j^T -----------------------------------------------------------------------------------
    float s[NS * 4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      const u32 q_off = (kk / 4) * BR * 128 + (kk % 4) * 32;
      const u32 k_off = (kk / 4) * BC * 128 + (kk % 4) * 32;
      Wgmma<BC, BF>::ss(s, q_desc + (q_off >> 4), kd + (k_off >> 4), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);

    // ---- mask -------------------------------------------------------------------------------------------
    const bool tail = kv_start + BC > kv_hi;
    const bool lead = kRanged && kv_start < kv_lo;
    const bool diag = kCausal && kv_start + BC - 1 > q_start + warp_row0 + shift;
    if (tail || lead || diag) {
      const int col_limit = kv_hi - kv_start - 2 * t;
      const int col_first = kv_lo - kv_start - 2 * t;
      const int diag_limit = q_start + warp_row0 + g + shift - kv_start - 2 * t;
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * n + (e & 1);
          if (c >= col_limit || (kRanged && c < col_first) || (kCausal && c - 8 * (e >> 1) > diag_limit))
            s[4 * n + e] = neg_inf();
        }
    }

    // ---- online softmax (exp2 form, scale folded into one FMA) ---------------------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_scaled = mx == neg_inf() ? 0.f : mx * sl2;
      const float alpha = exp2_approx(row_max[r] * sl2 - m_scaled);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
        s[4 * n + 2 * r] = exp2_approx(fmaf(s[4 * n + 2 * r], sl2, -m_scaled));
        s[4 * n + 2 * r + 1] = exp2_approx(fmaf(s[4 * n + 2 * r + 1], sl2, -m_scaled));
        sum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
      }
      row_max[r] = mx;
      row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        o[4 * n + 2 * r] *= alpha;
        o[4 * n + 2 * r + 1] *= alpha;
      }
    }
    if constexpr (kDropout) {
      const u32 hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const u32 hr = dropout_row_hash(hh, q_start + warp_row0 + g + 8 * r);
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool keep = dropout_keep(hr, kv_start + 8 * n + 2 * t + e, p.dropout_threshold);
            s[4 * n + 2 * r + e] = keep ? s[4 * n + 2 * r + e] * p.dropout_rp : 0.f;
          }
      }
    }
    // Two adjacent 8-column n-tiles of the S accumulator are one k-step's A fragment of P V.
    u32 pf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      pf[ks][0] = pack2<BF>(s[8 * ks + 0], s[8 * ks + 1]);
      pf[ks][1] = pack2<BF>(s[8 * ks + 2], s[8 * ks + 3]);
      pf[ks][2] = pack2<BF>(s[8 * ks + 4], s[8 * ks + 5]);
      pf[ks][3] = pack2<BF>(s[8 * ks + 6], s[8 * ks + 7]);
    }

    if constexpr (NST == 1) {
      // V_j landed; every warpgroup's S_j wgmma has completed (each waited before its softmax), so K's
      // buffer is free for K_{j+1}.
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      if (it + 1 < n_iter) {
        load_k(0, j + 1);
        cp_async_commit();
      }
    }

    // ---- O += P V_j --------------------------------------------------------------------------------------
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) Wgmma<D, BF>::rs_bt(o, pf[ks], vd + ((ks * 16 * 128) >> 4), 1);
    wgmma_commit();
    if constexpr (NST == 1) {
      wgmma_wait<0>();
      wgmma_hold(o);
    }
    // (With a ring, P_j V_j runs on while the next iteration waits for its copies.)
  }
  wgmma_wait<0>();
  wgmma_hold(o);

  // ---- epilogue: O / L and LSE; O staged in the warpgroup's own rows of the Q tile for coalesced stores --
  // Each warpgroup read only its own 64 rows of Q, and its last wgmma has completed.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = warp_row0 + g + 8 * r;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      const u32 v = pack2<BF>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      st_shared_32(sQ + panel_offset<BR>(row, n) + 4 * t, v);
    }
    if (gL && t == 0 && row < q_valid) gL[row] = l > 0.f ? row_max[r] * p.scale + logf(l) : neg_inf();
  }
  __syncthreads();
  {
    constexpr int C = D / 8;
#pragma unroll
    for (int i = 0; i < (BR * C + NT - 1) / NT; ++i) {
      const int idx = tid + i * NT;
      if ((BR * C) % NT != 0 && idx >= BR * C) break;
      const int row = idx / C, chunk = idx % C;
      if (row < q_valid && chunk * 8 < p.head_dim)
        st_global_16(gO + row * p.o_row_stride + chunk * 8, ld_shared_16(sQ + panel_offset<BR>(row, chunk)));
    }
  }
}

}  // namespace sm90
}  // namespace fa
