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

#include "fa/decode_combine.cuh"
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
// (fa/kv_cache.cuh: TilePageRing; kept for contiguous caches too, 512 bytes, so one formula serves both)
// during the main loop, the warps' states in fp32 for the merge afterwards (the same bytes, reused).
template <class Cfg>
struct DecodeSmem {
  static constexpr int D = Cfg::kHeadDim;
  static constexpr int kQ = Cfg::kBlockM * D * 2;
  static constexpr int kKVStage = 2 * Cfg::kBlockKV * D * 2;
  static constexpr int kPages = 2 * Cfg::kBlockKV * 4;
  static constexpr int kMainLoop = kQ + Cfg::kStages * kKVStage + kPages;
  static constexpr int kRowPitch = D + 4;  // fp32 elements; the pad spreads a quad's rows over banks
  static constexpr int kMerge = Cfg::kWarpsN * Cfg::kBlockM * (kRowPitch + 2) * 4;
  static constexpr int kBytes = kMainLoop > kMerge ? kMainLoop : kMerge;
};

// The fused combine of packed rows row0 .. row0 + BM - 1 of one (batch row, K/V head).
template <bool BF, int D, int BM, int kThreads>
__device__ __forceinline__ void combine_row_block(const DecodeParams& p, int batch, int kv_head, int row0) {
  for (int idx = threadIdx.x; idx < BM * (D / 4); idx += kThreads) {
    const int r = idx / (D / 4), col = 4 * (idx % (D / 4));
    const int row = row0 + r;
    if (row >= p.rows || col >= p.head_dim) continue;
    const int query = row / p.group;
    const int head = kv_head * p.group + row % p.group;
    combine_row<BF, D, 1>(p, (batch * p.heads_q + head) * p.seqlen_q + query, col);
  }
}

template <bool BF, int D, int BM, int kThreads>
__device__ __noinline__ void combine_row_block_call(const DecodeParams& p, int batch, int kv_head, int row0) {
  combine_row_block<BF, D, BM, kThreads>(p, batch, kv_head, row0);
}

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
  constexpr int C = D / 8;            // 16-byte chunks per row
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

  // ---- which keys this block reads ---------------------------------------------------------------------
  const int n_keys = cache_keys(p, batch);  // -1: a bad length, the row is poisoned
  bool bad = n_keys < 0;
  const int shift = n_keys - p.seqlen_q;  // causal: query i sees keys j <= i + shift
  const int row0 = m_block * BM;
  const int k_lo = split * p.keys_per_split;
  int k_hi = bad ? k_lo : min(n_keys, k_lo + p.keys_per_split);
  if (kCausal) {
    // The block's last packed row holds its latest query.
    const int last_query = (min(p.rows, row0 + BM) - 1) / p.group;
    k_hi = min(k_hi, last_query + shift + 1);
  }
  const int n_tiles = k_hi > k_lo ? (k_hi - k_lo + BC - 1) / BC : 0;

  const CachePositions<kPaged> positions(p, batch);
  const TilePageRing<kPaged, BC> pages(reinterpret_cast<int*>(smem + Smem::kQ + S * Smem::kKVStage));
  const i64 kv_row_base = kPaged ? 0 : (i64)batch * p.k_batch_stride;
  const u16* gK = static_cast<const u16*>(p.k) + kv_row_base + (i64)kv_head * p.k_head_stride;
  const u16* gV = static_cast<const u16*>(p.v) + (kPaged ? 0 : (i64)batch * p.v_batch_stride) +
                  (i64)kv_head * p.v_head_stride;

  // ---- loads ---------------------------------------------------------------------------------------------
  // Q: packed row r is query r / group of head kv_head * group + r % group; rows past p.rows are zeros.
  {
    const u16* gQ = static_cast<const u16*>(p.q) + (i64)batch * p.q_batch_stride;
    for (int idx = tid; idx < BM * C; idx += kThreads) {
      const int r = idx / C, chunk = idx % C;
      const int row = row0 + r;
      const bool ok = row < p.rows && chunk * 8 < p.head_dim;
      const int query = row / p.group;
      const int head = kv_head * p.group + row % p.group;
      const u16* src = gQ + (i64)query * p.q_row_stride + (i64)head * p.q_head_stride + chunk * 8;
      cp_async_16(sQ + Tile::bytes(r, chunk), ok ? src : static_cast<const u16*>(p.q), ok ? 16 : 0);
    }
  }
  // K and V rows of tile t into stage t % S. Thread tid copies chunk tid % C of kRows consecutive rows,
  // from (tid / C) * kRows on (a warp's copies still cover whole 16-byte-chunked rows, fully coalesced).
  // Consecutive rows so that one address computation serves them all: a paged cache whose page size is a
  // power of two at least kRows (every size engines use but 1 to 8) holds a thread's rows in one page, so
  // the thread reads one page entry per tile and steps by the row stride; other page sizes look each row
  // up. Measured on an H100 (bf16, head_dim 128, batch 8, 32k keys, page 16), the per-row lookup executed
  // 1.7x the instructions of the contiguous kernel and ran at half its bandwidth: the warps that issue the
  // copies also do the math, one warp per scheduler, so every address instruction delays the next copies.
  // Positions at or past k_hi, and any behind a page index outside the cache, are zero-filled (never read):
  // the scores there are masked, and zero V rows keep 0 * garbage out of O.
  static_assert(kThreads % C == 0 && BC % (kThreads / C) == 0, "the block's threads must tile a K/V tile's rows");
  constexpr int kRows = BC / (kThreads / C);
  // One page entry serves a thread's rows only if they cannot straddle a page: kRows a power of two, so a
  // power-of-two page of at least kRows positions holds whole, aligned groups of them.
  static_assert((kRows & (kRows - 1)) == 0, "a thread's rows per K/V tile must be a power of two");
  // (Head_dim 256 holds 192 registers of Q fragments and O; unrolling all 16 of its rows spilled.)
  constexpr int kUnroll = D > 128 ? 4 : kRows;
  const int chunk = tid % C;
  const int first_row = (tid / C) * kRows;
  const bool col_ok = chunk * 8 < p.head_dim;
  const bool one_page = !kPaged || positions.page_shift >= log2_of(kRows);  // uniform over the block
  auto load_kv = [&](int t) {
    const u32 sK = sKV + (t % S) * Smem::kKVStage;
    const u32 sV = sK + BC * D * 2;
    const int start = k_lo + t * BC;
    const int j0 = start + first_row;
    if (one_page) {
      i64 k_off = 0, v_off = 0;
      const bool page_ok = j0 >= k_hi || pages.offsets(positions, t, start, j0, k_off, v_off);
      bad |= !page_ok;
#pragma unroll kUnroll
      for (int i = 0; i < kRows; ++i) {
        const bool ok = j0 + i < k_hi && col_ok && page_ok;
        const int r = first_row + i;
        cp_async_16(sK + Tile::bytes(r, chunk), ok ? gK + k_off + i * p.k_row_stride + chunk * 8 : gK, ok ? 16 : 0);
        cp_async_16(sV + Tile::bytes(r, chunk), ok ? gV + v_off + i * p.v_row_stride + chunk * 8 : gV, ok ? 16 : 0);
      }
    } else {
#pragma unroll kUnroll
      for (int i = 0; i < kRows; ++i) {
        const int j = j0 + i;
        i64 k_off = 0, v_off = 0;
        bool ok = j < k_hi && col_ok;
        if (j < k_hi && !pages.offsets(positions, t, start, j, k_off, v_off)) {
          ok = false;
          bad = true;
        }
        const int r = first_row + i;
        cp_async_16(sK + Tile::bytes(r, chunk), ok ? gK + k_off + chunk * 8 : gK, ok ? 16 : 0);
        cp_async_16(sV + Tile::bytes(r, chunk), ok ? gV + v_off + chunk * 8 : gV, ok ? 16 : 0);
      }
    }
  };

  // Prologue: Q with tile 0, then tiles 1 .. S - 2, one commit group each (empty groups past the last tile
  // keep the group count, and so cp_async_wait's argument, the same for every iteration). A paged cache's
  // entries of each of these tiles are fetched and waited for here, once per block; those of tile S - 1,
  // the main loop's first load, too. Each barrier publishes the entries just stored, and (the ring having
  // two slots) says every thread is done reading the slot the next store overwrites.
#pragma unroll
  for (int t = 0; t < S; ++t) {
    if (kPaged) {
      pages.store(t, pages.fetch(positions, k_lo + t * BC, k_hi, tid, bad), tid);
      __syncthreads();
    }
    if (t < S - 1) {
      if (t < n_tiles) load_kv(t);
      cp_async_commit();
    }
  }

  // ---- main loop: each warp's online softmax over its keys of each tile ------------------------------------
  const int g = lane / 4;
  const int t4 = lane % 4;
  const int warp_row0 = wm * MT * 16;  // within the block's rows
  float o[MT][NO][4];
  float row_max[MT][2];
  float row_sum[MT][2];
  // Causal: the last key each of this thread's rows sees (its query's diagonal), per (mt, r).
  int diag[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = neg_inf();
      row_sum[mt][r] = 0.f;
      diag[mt][r] = (row0 + warp_row0 + 16 * mt + g + 8 * r) / p.group + shift;
    }
  }
  u32 qf[MT][DK][4];
  const FragAddr<D, true> q_addr(sQ, warp_row0 + lane % 16, lane / 16);
  const FragAddr<D, true> k_addr(sKV, 8 * (lane / 16) + lane % 8, (lane / 8) % 2);
  const FragAddr<D, true> v_addr(sKV + BC * D * 2, 8 * ((lane / 8) % 2) + lane % 8, lane / 16);

  for (int t = 0; t < n_tiles; ++t) {
    // Tile t (and Q, with tile 0) has landed for this thread; the barrier makes every thread's copies
    // visible, and says every warp is done with tile t - 1, whose stage the load below refills.
    cp_async_wait<S - 2>();
    __syncthreads();
    if (t + S - 1 < n_tiles) load_kv(t + S - 1);
    cp_async_commit();
    // Tile t + S's page entries: loaded now, stored after this tile's math, read after the next barrier.
    // Their slot was last read by the load of tile t + S - 2, in the previous iteration, before the barrier.
    const int next_entry = pages.fetch(positions, k_lo + (t + S) * BC, k_hi, tid, bad);
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

    // Scale, then mask: keys at or past k_hi (the split's end, the row's length), and causal keys past
    // each row's diagonal.
    const bool tail = key0 + BCW > k_hi;
    bool masked = tail;
    if (kCausal) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) masked |= key0 + BCW - 1 > diag[mt][0];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][n][e] * p.scale;
          if (masked) {
            const int key = key0 + 8 * n + 2 * t4 + (e & 1);
            if (key >= k_hi || (kCausal && key > diag[mt][e >> 1])) x = neg_inf();
          }
          s[mt][n][e] = x;
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
    pages.store(t + S, next_entry, tid);
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
  const bool split_out = p.num_splits > 1;
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
    const int query = row / p.group;
    const int head = kv_head * p.group + row % p.group;
    if (split_out) {
      const i64 idx_row = (((i64)split * p.batch + batch) * p.heads_q + head) * p.seqlen_q + query;
      *reinterpret_cast<float4*>(p.o_partial + idx_row * D + col) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (col == 0) p.lse_partial[idx_row] = lse;
    } else {
      u16* dst = static_cast<u16*>(p.o) + (i64)batch * p.o_batch_stride + (i64)query * p.o_row_stride +
                 (i64)head * p.o_head_stride + col;
      const u32 lo = pack2<BF>(acc[0], acc[1]), hi = pack2<BF>(acc[2], acc[3]);
      asm volatile("st.global.v2.u32 [%0], {%1, %2};\n" ::"l"(dst), "r"(lo), "r"(hi));
      if (col == 0 && p.lse)
        p.lse[(i64)batch * p.lse_batch_stride + (i64)head * p.lse_head_stride + query] = lse;
    }
  }

  // ---- the fused combine: the row block's last split to finish merges the splits ----------------------
  if (split_out && p.split_counters != nullptr) {
    // Release: this block's partials are visible GPU-wide before its arrival is counted. Every thread
    // fences its own writes; the barrier then holds thread 0's atomic until every warp has written and
    // fenced (__syncthreads_or below evaluates its argument before it waits, so it cannot be that barrier).
    __threadfence();
    __syncthreads();
    int* counter = p.split_counters + ((i64)batch * p.heads_kv + kv_head) * p.num_m_blocks + m_block;
    const bool last = __syncthreads_or(tid == 0 && atomicAdd(counter, 1) == p.num_splits - 1);
    if (last) {
      // Acquire: the other splits counted after their fences; the partials are read at L2 (combine_row).
      __threadfence();
      // Head_dim 256 calls it out of line: inlined into that kernel it spilled (112 bytes at 255
      // registers); the smaller head dims inline it (the call's register saves spilled 12 bytes at d64).
      if constexpr (D > 128) {
        combine_row_block_call<BF, D, BM, kThreads>(p, batch, kv_head, row0);
      } else {
        combine_row_block<BF, D, BM, kThreads>(p, batch, kv_head, row0);
      }
      // Zero again for the next call on this stream (kernels of one stream run in order).
      if (tid == 0) *counter = 0;
    }
  }
}

}  // namespace fa
