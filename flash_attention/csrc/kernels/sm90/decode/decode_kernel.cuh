// Split-KV decode attention on Hopper (sm_90a), the matrix products on wgmma, for 64 packed query rows per
// block: speculative decoding and chunked prefill against a cache (seqlen_q x group rows, e.g. 16 tokens of a
// group of 4). Everything but the products is the sm80 decode kernel's (csrc/kernels/sm80/decode, whose
// header says why decode has a kernel of its own): the same keys per block, the same cp.async ring of K/V
// tiles with the page entries requested ahead (fa/kv_cache.cuh), the same answers and fused merge
// (fa/decode_block.cuh).
//
// Why wgmma here: with 64 rows a decode block does 64x the one-token call's math on the same bytes. On the
// sm80 instruction set one block per SM (four warps, one 16-row tile each) issued its mma.sync and ldmatrix
// between the copies, and seqlen_q 16 at batch 64 with 1k keys took 1.21-1.22x the one-token time (the one
// seqlen_q 16 point over the issue's 1.2x). One warpgroup's wgmma m64nBCk16 covers the block's 64 rows
// straight from shared memory, asynchronously, so the products overlap the copies and the softmax. The
// one-token config (16 rows) keeps the sm80 kernel: a 64-row wgmma tile would be three quarters padding,
// and that kernel already streams at the device copy's rate (docs/kernel-log.md, steps 40 and 65).
//
//   S = Q K_t^T  wgmma m64n{BC}k16, Q and K K-major from shared memory (fa/fwd_wgmma.cuh issue_qk);
//   O += P V_t   wgmma m64n{D}k16, P from registers, V MN-major from shared memory (issue_pv).
// Tiles are 64-column panels with the 128-byte swizzle (fa/smem_layout.cuh PanelTile); cp.async writes them
// through the generic proxy, so each thread fences the async proxy before the barrier that publishes a tile.
// The accumulator layout gives a thread two rows (g and g + 8 of its warp's 16) and, per 8-column n-tile,
// two adjacent columns, the layout of the sm80 kernels' fragments: fa/softmax.cuh runs on it unchanged.
//
// Grid: (num_m_blocks * num_splits, heads_kv, batch). Block: one warpgroup (128 threads).
#pragma once

#include "fa/decode_block.cuh"
#include "fa/decode_params.h"
#include "fa/frag.cuh"
#include "fa/fwd_wgmma.cuh"
#include "fa/kv_cache.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/softmax.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

// Compile-time rules of a wgmma decode configuration (mirrored by configs.decode.decode_validity_errors).
template <class Cfg>
struct check_decode_config {
  static_assert(Cfg::kWgmma, "the sm90 decode kernel runs wgmma configs only");
  static_assert(Cfg::kHeadDim == 64 || Cfg::kHeadDim == 128, "head_dim must be 64 or 128");
  static_assert(Cfg::kBlockM == 64 && Cfg::kWarpsM == 4 && Cfg::kWarpsN == 1,
                "one warpgroup of 64 rows: block_m 64, warps 4 x 1");
  static_assert(Cfg::kBlockKV == 64 || Cfg::kBlockKV == 128, "block_kv must be 64 or 128");
  static_assert(Cfg::kStages >= 2, "stages must be at least 2");
  static constexpr bool ok = true;
};

// Shared memory, in bytes: 1 KB of alignment slack (the swizzle's descriptors assume tiles on 1024-byte
// boundaries; the dynamic window is only 16-byte aligned), the Q tile, kStages K tiles then kStages V tiles,
// and the page-entry ring (fa/kv_cache.cuh TilePageRing).
template <class Cfg>
struct DecodeSmem {
  static constexpr int kQ = Cfg::kBlockM * Cfg::kHeadDim * 2;
  static constexpr int kTile = Cfg::kBlockKV * Cfg::kHeadDim * 2;  // one K or V tile
  static constexpr int kPages = PageRing<Cfg, true>::kBytes;  // page entries
  static constexpr int kBytes = 1024 + kQ + 2 * Cfg::kStages * kTile + kPages;
};

template <class Cfg, bool kCausal, bool kPaged>
__device__ __forceinline__ void decode_kernel_body(const DecodeParams& p) {
  static_assert(check_decode_config<Cfg>::ok, "");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BM = Cfg::kBlockM;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int S = Cfg::kStages;
  constexpr int kThreads = 128;
  constexpr int NS = BC / 8;  // 8-key n-tiles of S
  constexpr int KS = BC / 16;  // k-steps of O += P V
  constexpr int NO = D / 8;   // 8-column n-tiles of O
  using QTile = PanelTile<BM>;
  using KVTile = PanelTile<BC>;
  using Smem = DecodeSmem<Cfg>;

  extern __shared__ __align__(16) unsigned char smem[];
  const u32 base = smem_addr(smem);
  const u32 sQ = (base + 1023u) & ~1023u;
  const u32 sK = sQ + Smem::kQ;        // stage s: K at sK + s * kTile
  const u32 sV = sK + S * Smem::kTile;  // and V at sV + s * kTile
  int* page_slots = reinterpret_cast<int*>(smem + (sV + S * Smem::kTile - base));

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int m_block = (int)blockIdx.x / p.num_splits;
  const int split = (int)blockIdx.x % p.num_splits;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int row0 = m_block * BM;

  // ---- which keys this block reads, and the loads (fa/decode_block.cuh) ---------------------------------
  const DecodeBlockKeys keys = decode_block_keys<kCausal, BM, BC>(p, batch, m_block, split);
  bool bad = keys.bad;
  const int k_lo = keys.k_lo, k_hi = keys.k_hi, n_tiles = keys.n_tiles;
  const CachePositions<kPaged> positions(p, batch);
  const PageRing<Cfg, kPaged> pages(page_slots);
  load_decode_q<BM, D, kThreads, QTile>(sQ, p, batch, kv_head, row0, tid);
  const DecodeKVLoader<BC, D, kThreads, kPaged, PageRing<Cfg, kPaged>, KVTile> loader(p, positions, pages, batch,
                                                                                     kv_head, k_lo, k_hi, tid);
  auto load_kv = [&](int t) { loader(t, sK + (t % S) * Smem::kTile, sV + (t % S) * Smem::kTile, p, bad); };

  decode_ring_prologue<S, kPaged>(pages, positions, keys, tid, load_kv);

  // Descriptors (fa/fwd_wgmma.cuh's layouts): Q and K K-major, 8-row groups 1024 bytes apart; V MN-major,
  // its 64-column panels BC * 128 bytes apart.
  const u64 q_desc = smem_desc_sw128(sQ, 16, 1024);
  const u64 k_desc = smem_desc_sw128(sK, 16, 1024);
  const u64 v_desc = smem_desc_sw128(sV, BC * 128, 1024);

  // Accumulator coordinates (PTX ISA, wgmma m64nNk16 D fragment): register 4 n + e of a thread holds row
  // 16 warp + g + 8 (e / 2) of the block's 64, column 8 n + 2 t + e % 2.
  const int g = lane / 4;
  const int t4 = lane % 4;
  const int warp_row0 = 16 * warp;
  float o[NO * 4];
#pragma unroll
  for (int i = 0; i < NO * 4; ++i) o[i] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};
  // The keys each of this thread's rows sees (causal: up to its query's diagonal; a window's sides); r = 1
  // is the later row.
  DecodeRowKeys row_keys[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    row_keys[r] = decode_row_keys<kCausal>(p, batch, kv_head, row0 + warp_row0 + g + 8 * r, keys.shift);

  for (int t = 0; t < n_tiles; ++t) {
    if constexpr (Cfg::kRefillFirst) {
      // P V of tile t - 1 has completed in every thread (its V stage is the one refilled below; wgmma's
      // reads are done once the wait returns, so the copies may overwrite them without a proxy fence) before
      // the copies are issued; then tile t has landed for this thread, the fence hands the generic proxy's
      // writes to wgmma's async proxy and the second barrier makes every thread's copies visible. With the
      // 2-deep ring this keeps two tiles in flight while the block waits for tile t, where the order below
      // keeps one (fa/decode_block.cuh, PageRing).
      wgmma_wait<0>();
      wgmma_hold(o);
      __syncthreads();
      decode_ring_refill<S, kPaged>(t, pages, positions, keys, tid, load_kv);
      cp_async_wait<S - 1>();
      fence_proxy_async();
      __syncthreads();
    } else {
      // Tile t (and Q, with tile 0) has landed for this thread, and P V of tile t - 1 has completed (its V
      // stage is the one refilled below); the fence hands the generic proxy's writes to wgmma's async proxy,
      // and the barrier makes every thread's copies visible.
      cp_async_wait<S - 2>();
      wgmma_wait<0>();
      wgmma_hold(o);
      fence_proxy_async();
      __syncthreads();
      decode_ring_refill<S, kPaged>(t, pages, positions, keys, tid, load_kv);
    }
    const u32 stage = (t % S) * Smem::kTile;

    // ---- S = Q K_t^T -------------------------------------------------------------------------------------
    float s[NS * 4];
    wgmma_fence();
    issue_qk<BM, BC, D, BF>(s, q_desc, k_desc + (stage >> 4));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_hold(s);

    // Scale and soft-cap, then mask: keys at or past k_hi (the split's end, the row's length), and keys
    // outside a row's range (causal: past its diagonal; a window's sides). The earlier row of the pair sees
    // the fewest later keys, the later row the fewest earlier ones.
    const int key0 = k_lo + t * BC;
    const bool masked = key0 + BC > k_hi || key0 + BC - 1 > row_keys[0].last || key0 < row_keys[1].first;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = decode_score(p, s[4 * n + e] * p.scale);
        if (masked) {
          const int key = key0 + 8 * n + 2 * t4 + (e & 1);
          const DecodeRowKeys& rk = row_keys[e >> 1];
          if (key >= k_hi || key > rk.last || key < rk.first) x = neg_inf();
        }
        s[4 * n + e] = x;
      }
    if (p.alibi_slopes) {  // (fa/decode_block.cuh, alibi_score: a pass of its own)
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[4 * n + e] = alibi_score(s[4 * n + e], row_keys[e >> 1], key0 + 8 * n + 2 * t4 + (e & 1));
    }

    // ---- online softmax (the unfolded form: fa/softmax.cuh), then O += P V_t ------------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float alpha = online_softmax_row<false>(acc_tile(s), 0, r, row_max[r], row_sum[r], 0.f);
      rescale_row(acc_tile(o), 0, r, alpha);
    }
    u32 pf[KS][4];
    s_to_p<BC, BF>(pf, s);
    wgmma_fence();
    issue_pv<BC, D, BF>(o, pf, v_desc + (stage >> 4));
    wgmma_commit();
    // (P V_t runs on while the next iteration waits for its copies.)
  }
  wgmma_wait<0>();
  wgmma_hold(o);
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);

  // ---- the rows' answers: each thread holds two columns per n-tile of its two rows ----------------------
  const float nan = __int_as_float(0x7fffffff);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + warp_row0 + g + 8 * r;
    const float l = quad_sum(row_sum[r]);
    const float inv = inv_row_sum(l);
    const float lse = bad ? nan : (l > 0.f ? row_max[r] + logf(l) : neg_inf());
    if (row >= p.rows) continue;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      const int col = 8 * n + 2 * t4;
      if (col >= p.head_dim) continue;
      const float v[2] = {bad ? nan : o[4 * n + 2 * r] * inv, bad ? nan : o[4 * n + 2 * r + 1] * inv};
      store_decode_row<BF, D, 2>(p, batch, kv_head, split, row, col, v, lse, col == 0);
    }
  }

  // ---- the fused combine (opt-in): the row block's last split to finish merges the splits -----------------
  decode_fused_combine<BF, D, BM, kThreads>(p, batch, kv_head, m_block, row0, tid);
}

}  // namespace sm90
}  // namespace fa
