// Split-KV decode attention on the sm_80 instruction set (mma.sync m16n8k16, ldmatrix, cp.async): a few
// query tokens per batch row against a long KV cache, contiguous or paged. Runs on sm_80 to sm_90.
//
// Why not the forward kernel: with one query token its grid has one block per (head, batch row), a
// handful of blocks for 132 multiprocessors, each streaming the whole cache of its row alone, and every
// query head of a GQA group reads its K/V head again. Here
//  * the query heads sharing a K/V head are packed into the rows of one tile ("GQA packing": packed row
//    r is query r / group of head kv_head * group + r % group), so each K/V byte is read once per block;
//  * the key axis is cut into num_splits slices of keys_per_split keys, one block each, so batch x heads_kv
//    x splits blocks fill the GPU; each writes its slice's normalised output and LSE, which the combine
//    kernel (fa/decode_combine.cuh) merges -- with num_splits == 1 the block writes the answer itself;
//  * the block's warps split each K/V tile's keys between them (kWarpsN) rather than the rows, since a
//    decode tile has few rows (16 for one token and a group of up to 16): each warp keeps its own online
//    softmax over its keys, and the warps' states are merged once, at the end, through shared memory, in a
//    fixed order (bitwise reproducible). For spec decoding / chunked prefill with more rows, kWarpsM warps
//    split the rows as in the forward kernel;
//  * K/V tiles stream through a kStages-deep cp.async ring, so a block keeps kStages - 1 tiles of loads in
//    flight while it computes one: the kernel is bound by memory bandwidth, and bytes in flight are what
//    reach it.
// Memory-bound, so the softmax takes the unfolded form (scores scaled first, fa/softmax.cuh): one more
// multiply per score costs nothing here and any scale sign works.
//
// Grid: (num_m_blocks * num_splits, heads_kv, batch). Block: kWarpsM * kWarpsN warps.
#pragma once

#include "fa/decode_block.cuh"
#include "fa/decode_params.h"
#include "fa/frag.cuh"
#include "fa/kv_cache.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/softmax.cuh"

namespace fa {

// Compile-time rules of a decode configuration (mirrored by configs.DecodeConfig.validity_errors).
template <class Cfg>
struct check_decode_config {
  static_assert(Cfg::kHeadDim == 64 || Cfg::kHeadDim == 128 || Cfg::kHeadDim == 256,
                "head_dim must be one of (64, 128, 256)");
  static_assert(Cfg::kBlockM % (16 * Cfg::kWarpsM) == 0, "block_m must be a multiple of 16 * warps_m");
  static_assert(Cfg::kBlockKV % (16 * Cfg::kWarpsN) == 0, "block_kv must be a multiple of 16 * warps_n");
  static_assert(Cfg::kStages >= 2, "stages must be at least 2");
  static_assert(Cfg::kWarpsM * Cfg::kWarpsN <= 8, "at most 8 warps");
  static constexpr bool ok = true;
};

// Shared memory of a decode configuration, in bytes: the Q tile, the K/V ring and the page-entry ring
// (fa/kv_cache.cuh: TilePageRing, 2 * kStages - 1 slots of kBlockKV entries, one more for a ring that
// refills first; kept for contiguous caches too, a kilobyte or less, so one formula serves both) during the
// main loop, the warps' states in fp32 for the merge afterwards (the same bytes, reused).
template <class Cfg>
struct DecodeSmem {
  static constexpr int D = Cfg::kHeadDim;
  static constexpr int kQ = Cfg::kBlockM * D * 2;
  static constexpr int kKVStage = 2 * Cfg::kBlockKV * D * 2;
  static constexpr int kPages = PageRing<Cfg, true>::kBytes;  // page entries
  static constexpr int kMainLoop = kQ + Cfg::kStages * kKVStage + kPages;
  static constexpr int kRowPitch = D + 4;  // fp32 elements; the pad spreads a quad's rows over banks
  static constexpr int kMerge = Cfg::kWarpsN * Cfg::kBlockM * (kRowPitch + 2) * 4;
  static constexpr int kBytes = kMainLoop > kMerge ? kMainLoop : kMerge;
};

template <class Cfg, bool kCausal, bool kPaged>
__device__ __forceinline__ void decode_kernel_body(const DecodeParams& p) {
  static_assert(check_decode_config<Cfg>::ok, "");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BM = Cfg::kBlockM;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int WM = Cfg::kWarpsM;
  constexpr int WN = Cfg::kWarpsN;
  constexpr int S = Cfg::kStages;
  constexpr int kThreads = 32 * WM * WN;
  constexpr int MT = BM / (16 * WM);  // 16-row mma tiles per warp
  constexpr int BCW = BC / WN;        // keys per warp per tile
  constexpr int NS = BCW / 8;         // 8-key n-tiles of a warp's S
  constexpr int KS = BCW / 16;        // k-steps of a warp's P V
  constexpr int DK = D / 16;          // k-steps of S = Q K^T
  constexpr int NO = D / 8;           // 8-column n-tiles of O
  using Tile = RowMajorTile<D, true>;
  using Smem = DecodeSmem<Cfg>;

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sQ = smem_addr(smem);
  const u32 sKV = sQ + Smem::kQ;  // stage s: K at sKV + s * kKVStage, V BC * D * 2 bytes after it

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wm = warp / WN;  // which rows
  const int wn = warp % WN;  // which keys of each tile
  const int m_block = (int)blockIdx.x / p.num_splits;
  const int split = (int)blockIdx.x % p.num_splits;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;

  // ---- which keys this block reads (fa/decode_block.cuh) ----------------------------------------------
  const DecodeBlockKeys keys = decode_block_keys<kCausal, BM, BC>(p, batch, m_block, split);
  bool bad = keys.bad;
  const int shift = keys.shift, k_lo = keys.k_lo, k_hi = keys.k_hi, n_tiles = keys.n_tiles;
  const int row0 = m_block * BM;

  const CachePositions<kPaged> positions(p, batch);
  const PageRing<Cfg, kPaged> pages(reinterpret_cast<int*>(smem + Smem::kQ + S * Smem::kKVStage));

  // ---- loads: Q, and the K/V tiles through the ring (K at the stage's start, V BC * D * 2 bytes on) -------
  load_decode_q<BM, D, kThreads, Tile>(sQ, p, batch, kv_head, row0, tid);
  const DecodeKVLoader<BC, D, kThreads, kPaged, PageRing<Cfg, kPaged>, Tile> loader(p, positions, pages, batch, kv_head,
                                                                                  k_lo, k_hi, tid);
  auto load_kv = [&](int t) {
    const u32 sK = sKV + (t % S) * Smem::kKVStage;
    loader(t, sK, sK + BC * D * 2, p, bad);
  };

  decode_ring_prologue<S, kPaged>(pages, positions, keys, tid, load_kv);

  // ---- main loop: each warp's online softmax over its keys of each tile ------------------------------------
  const int g = lane / 4;
  const int t4 = lane % 4;
  const int warp_row0 = wm * MT * 16;  // within the block's rows
  float o[MT][NO][4];
  float row_max[MT][2];
  float row_sum[MT][2];
  // The keys each of this thread's rows sees (causal: up to its query's diagonal; a window's sides), per
  // (mt, r); r = 1 is the later row.
  DecodeRowKeys row_keys[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = neg_inf();
      row_sum[mt][r] = 0.f;
      row_keys[mt][r] = decode_row_keys<kCausal>(p, batch, kv_head, row0 + warp_row0 + 16 * mt + g + 8 * r, shift);
    }
  }
  u32 qf[MT][DK][4];
  const FragAddr<D, true> q_addr(sQ, warp_row0 + lane % 16, lane / 16);
  const FragAddr<D, true> k_addr(sKV, 8 * (lane / 16) + lane % 8, (lane / 8) % 2);
  const FragAddr<D, true> v_addr(sKV + BC * D * 2, 8 * ((lane / 8) % 2) + lane % 8, lane / 16);

  for (int t = 0; t < n_tiles; ++t) {
    if constexpr (Cfg::kRefillFirst) {
      // Every warp is done with tile t - 1, whose stage the load below refills, before its copies are
      // issued; then tile t (and Q, with tile 0) has landed for this thread, and the second barrier makes
      // every thread's copies visible. A barrier more per tile for S tiles in flight while the block waits
      // for tile t, where the single-barrier order below has S - 1 (fa/decode_block.cuh, PageRing).
      __syncthreads();
      decode_ring_refill<S, kPaged>(t, pages, positions, keys, tid, load_kv);
      cp_async_wait<S - 1>();
      __syncthreads();
    } else {
      // Tile t (and Q, with tile 0) has landed for this thread; the barrier makes every thread's copies
      // visible, and says every warp is done with tile t - 1, whose stage the load below refills.
      cp_async_wait<S - 2>();
      __syncthreads();
      decode_ring_refill<S, kPaged>(t, pages, positions, keys, tid, load_kv);
    }
    if (t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) ldmatrix_x4(qf[mt][kk], q_addr(16 * mt, kk));
    }
    const u32 stage = (t % S) * Smem::kKVStage;
    const int key0 = k_lo + t * BC + wn * BCW;  // this warp's first key in the tile

    // S = Q K^T over the warp's BCW keys.
    float s[MT][NS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
#pragma unroll
      for (int np = 0; np < NS / 2; ++np) {
        u32 kb[4];
        ldmatrix_x4(kb, k_addr(wn * BCW + 16 * np, kk) + stage);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(s[mt][2 * np], qf[mt][kk], kb[0], kb[1]);
          mma_16816<BF>(s[mt][2 * np + 1], qf[mt][kk], kb[2], kb[3]);
        }
      }
    }

    // Scale and soft-cap, then mask: keys at or past k_hi (the split's end, the row's length), and keys
    // outside a row's range (causal: past its diagonal; a window's sides). The earlier row of a pair sees
    // the fewest later keys, the later row the fewest earlier ones.
    bool masked = key0 + BCW > k_hi;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      masked |= key0 + BCW - 1 > row_keys[mt][0].last || key0 < row_keys[mt][1].first;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = decode_score(p, s[mt][n][e] * p.scale);
          if (masked) {
            const int key = key0 + 8 * n + 2 * t4 + (e & 1);
            const DecodeRowKeys& rk = row_keys[mt][e >> 1];
            if (key >= k_hi || key > rk.last || key < rk.first) x = neg_inf();
          }
          s[mt][n][e] = x;
        }
    if (p.alibi_slopes) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][n][e] = alibi_score(s[mt][n][e], row_keys[mt][e >> 1], key0 + 8 * n + 2 * t4 + (e & 1));
    }

    // Online softmax, then O += P V over the warp's keys.
    u32 pf[MT][KS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float alpha = online_softmax_row<false>(acc_tile(s), mt, r, row_max[mt][r], row_sum[mt][r], 0.f);
        rescale_row(acc_tile(o), mt, r, alpha);
      }
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) acc_to_a_frag<BF>(pf[mt][ks], acc_tile(s), mt, ks);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int dp = 0; dp < NO / 2; ++dp) {
        u32 vb[4];
        ldmatrix_x4_trans(vb, v_addr(wn * BCW + 16 * ks, dp) + stage);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<BF>(o[mt][2 * dp], pf[mt][ks], vb[0], vb[1]);
          mma_16816<BF>(o[mt][2 * dp + 1], pf[mt][ks], vb[2], vb[3]);
        }
      }
    }
  }

  // ---- merge the warps' states, in a fixed order ----------------------------------------------------------
  // Every warp is past its last ldmatrix and every copy has landed (the empty groups included) before the
  // ring's bytes are reused for the states.
  cp_async_wait<0>();
  bad = __syncthreads_or(bad);
  float* merge = reinterpret_cast<float*>(smem);
  constexpr int P = Smem::kRowPitch;
  // Warp wn's row r: O at merge[(wn * BM + r) * (P + 2)], its max and sum after the P columns.
  auto state = [&](int w, int r) { return merge + (w * BM + r) * (P + 2); };
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + 16 * mt + g + 8 * r;
      float* st = state(wn, row);
      const float l = quad_sum(row_sum[mt][r]);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        st[8 * n + 2 * t4] = o[mt][n][2 * r];
        st[8 * n + 2 * t4 + 1] = o[mt][n][2 * r + 1];
      }
      if (t4 == 0) {
        st[P] = row_max[mt][r];
        st[P + 1] = l;
      }
    }
  }
  __syncthreads();

  // Thread per (row, 4 columns): the block's max over the warps, each warp's weight exp(m_w - m), and
  // O = sum_w weight_w O_w / sum_w weight_w l_w.
  const float nan = __int_as_float(0x7fffffff);
  for (int idx = tid; idx < BM * (D / 4); idx += kThreads) {
    const int r = idx / (D / 4), col = 4 * (idx % (D / 4));
    const int row = row0 + r;
    if (row >= p.rows || col >= p.head_dim) continue;
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < WN; ++w) m = fmaxf(m, state(w, r)[P]);
    const float m_use = m == neg_inf() ? 0.f : m;
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WN; ++w) {
      const float* st = state(w, r);
      const float weight = __expf(st[P] - m_use);
      l += weight * st[P + 1];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += weight * st[col + e];
    }
    const float inv = inv_row_sum(l);
    const float lse = bad ? nan : (l > 0.f ? m + logf(l) : neg_inf());
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = bad ? nan : acc[e] * inv;
    store_decode_row<BF, D, 4>(p, batch, kv_head, split, row, col, acc, lse, col == 0);
  }

  // ---- the fused combine (opt-in): the row block's last split to finish merges the splits -----------------
  decode_fused_combine<BF, D, BM, kThreads>(p, batch, kv_head, m_block, row0, tid);
}

}  // namespace fa
