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

#include "fa/block_range.cuh"
#include "fa/config_check.h"
#include "fa/copy.cuh"
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
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class V, bool kDropout = false>
__device__ __forceinline__ void fwd_kernel_body(const FwdParams& p) {
  static_assert(check_config<Cfg>::ok, "");
  static_assert(Cfg::kWgmma, "the sm90 kernel runs wgmma configs only");
  static_assert(!Cfg::kWarpSpecialized, "ws configs run the warp-specialized kernel (sm90/fwd_ws)");
  using Mask = typename V::Mask;  // the variant's policies (fa/variant.cuh)
  constexpr bool kFold = kFoldsScale<V, true>;
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int NT = Cfg::kNumWarps * 32;
  constexpr int NS = BC / 8;    // 8-column n-tiles of S
  constexpr int KS = BC / 16;   // k-steps of O += P V
  constexpr int NO = D / 8;     // 8-column n-tiles of O
  using QTile = PanelTile<BR>;  // Q (and O, staged for the store) in shared memory
  using KVTile = PanelTile<BC>;

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
  const int m_block = Mask::kRowDependent ? (p.num_m_blocks - 1 - (int)blockIdx.x) : (int)blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.group;
  const int q_start = m_block * BR;
  const int q_valid = min(BR, p.seqlen_q - q_start);

  const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
  const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, 0);
  const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, 0);
  u16* gO = static_cast<u16*>(p.o) + o_offset(p, batch, head, q_start);
  float* gL = p.lse ? p.lse + lse_offset(p, batch, head, q_start) : nullptr;

  // The keys this block's rows see (the variant's mask) and the K/V blocks [j_lo, n_blocks) holding any
  // of them.
  const Mask mask(p, batch, head);
  const typename V::ScoreMod score_mod(p, batch, head);
  const auto blocks = mask.template kv_blocks<BC>(q_start, q_valid);
  const int j_lo = blocks.begin;
  const int n_blocks = blocks.end;
  const int kv_hi = mask.key_end();  // keys from here on are never read

  // Accumulator coordinates (PTX ISA 9.7.15.5.1.1.1, m64nNk16 D fragment): register 4 n + e of a thread holds
  // row 16 (warp % 4) + g + 8 (e / 2) of its warpgroup's 64, column 8 n + 2 t + e % 2.
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = 16 * warp;  // = 64 wg + 16 (warp % 4): the block row of the warp's first row

  // No key is visible to any row of this block: out = 0, lse = -inf. (This kernel's test is `<=` for both
  // variants; the sm80 kernel's own spelling is explained in fa/block_range.cuh.)
  if (n_blocks <= j_lo) {
    store_empty_block<BR, D, NT>(p, gO, gL, q_valid, head, tid);
    return;
  }

  const int n_iter = n_blocks - j_lo;
  auto load_k = [&](int buf, int blk) {
    load_tile<BC, D, NT, KVTile, true>(sK + buf * kTile, gK + (i64)blk * BC * p.k_row_stride, p.k_row_stride,
                                       kv_hi - blk * BC, p.head_dim, tid);
  };
  auto load_v = [&](int buf, int blk) {
    load_tile<BC, D, NT, KVTile, true>(sV + buf * kTile, gV + (i64)blk * BC * p.v_row_stride, p.v_row_stride,
                                       kv_hi - blk * BC, p.head_dim, tid);
  };
  load_tile<BR, D, NT, QTile, true>(sQ, gQ, p.q_row_stride, q_valid, p.head_dim, tid);
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
    issue_qk<BR, BC, D, BF>(s, q_desc, kd);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);

    // ---- score function and mask: the variant's (fa/variant.cuh) ----------------------------------------
    static_assert(kFold, "the wgmma kernels' softmax is the folded one");
    constexpr bool kOffsets = ScoreModRowOffsets<typename V::ScoreMod>::value;
    float offset[1][2];
    score_mod_query_rows_wgmma(acc_tile(s), score_mod, q_start + warp_row0, kv_start, g, t, offset);
    mask.mask_query_rows(acc_tile(s), q_start + warp_row0, kv_start, g, t);

    // ---- online softmax (exp2 form, scale folded into one FMA unless a score function needs it) ------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float alpha =
          online_softmax_row<kFold, kOffsets>(acc_tile(s), 0, r, row_max[r], row_sum[r], sl2, offset[0][r]);
      rescale_row(acc_tile(o), 0, r, alpha);
    }
    if constexpr (kDropout)
      dropout_query_rows<kDropoutKeyPairs<V>>(acc_tile(s), 0, p, batch, head, q_start + warp_row0, kv_start,
                                              g, t);
    u32 pf[KS][4];
    s_to_p<BC, BF>(pf, s);

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
    issue_pv<BC, D, BF>(o, pf, vd);
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
  stage_o_and_lse<D, QTile, BF, kFold>(p, o, row_max, row_sum, sQ, gL, warp_row0, g, t, q_valid,
                                       head_sink(p, head));
  // Every warpgroup's rows of O are staged before any thread copies whole rows out.
  __syncthreads();
  store_o_tile<BR, D, NT, QTile>(p, gO, sQ, q_valid, tid);
}

}  // namespace sm90
}  // namespace fa
