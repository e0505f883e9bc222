// One decode block's steps that do not depend on how it multiplies, shared by both decode kernel families
// (csrc/kernels/sm80/decode: mma.sync; csrc/kernels/sm90/decode: wgmma): which keys block (m_block, split)
// of a (batch row, K/V head) reads, its packed query rows and its K/V tiles into shared memory in the
// family's tile layout (fa/smem_layout.cuh: `Tile::bytes(row, chunk)`), a row's answer (the split's partial
// or the output itself), and the fused merge of the splits.
#pragma once

#include "fa/decode_combine.cuh"
#include "fa/decode_params.h"
#include "fa/kv_cache.cuh"
#include "fa/ptx.cuh"

namespace fa {

// The keys [k_lo, k_hi) one block reads: its split's slice of the row's keys, cut at the row's length and,
// causal, at the block's latest query's diagonal; with a sliding window, cut to the keys some query of the
// block sees.
struct DecodeBlockKeys {
  int shift;  // query i's diagonal is key i + shift (causal: the last it sees)
  int k_lo, k_hi;
  int n_tiles;  // K/V tiles of BC keys covering [k_lo, k_hi)
  bool bad;     // the row's length is out of range: nothing read, the row poisoned (fa/kv_cache.cuh)
};

// With a window (p.window_left >= 0) the row's splits divide the keys from its first query's window on,
// not from key 0: the host sizes keys_per_split for that span (flash_attention/ops/decode.py), so a 4k
// window over a 128k cache splits 4k keys. Every start is a multiple of BC, as without a window: a paged
// cache's copies take a thread's rows from one page (DecodeKVLoader), which needs tile-aligned starts.
template <bool kCausal, int BM, int BC>
__device__ __forceinline__ DecodeBlockKeys decode_block_keys(const DecodeParams& p, int batch, int m_block,
                                                             int split) {
  DecodeBlockKeys b;
  const int n_keys = cache_keys(p, batch);  // -1: a bad length
  b.bad = n_keys < 0;
  b.shift = n_keys - p.seqlen_q;
  const bool windowed = p.window_left >= 0;
  const int base = windowed ? max(0, b.shift - p.window_left) / BC * BC : 0;
  b.k_lo = base + split * p.keys_per_split;
  // The last split runs to the row's end: the host sizes keys_per_split for the rows it expects (a cache's
  // capacity bucket, which every row fits; a packed batch's typical sequence, which a longer one may pass:
  // flash_attention/api/few_queries.py's route_varlen), so no row's keys are ever left uncovered.
  const bool last_split = split == p.num_splits - 1;
  b.k_hi = b.bad ? b.k_lo : (last_split ? n_keys : min(n_keys, b.k_lo + p.keys_per_split));
  // The block's first and last packed rows hold its earliest and latest queries.
  const int last_query = (min(p.rows, m_block * BM + BM) - 1) / p.group;
  if (kCausal) b.k_hi = min(b.k_hi, last_query + b.shift + 1);
  if (p.window_right >= 0) b.k_hi = min(b.k_hi, last_query + b.shift + p.window_right + 1);
  if (windowed) {
    const int first_query = m_block * BM / p.group;
    b.k_lo = max(b.k_lo, max(0, first_query + b.shift - p.window_left) / BC * BC);
  }
  b.n_tiles = b.k_hi > b.k_lo ? (b.k_hi - b.k_lo + BC - 1) / BC : 0;
  return b;
}

// What one packed query row of a block needs for its scores besides the split's [k_lo, k_hi): the keys it
// sees, first .. last, from its diagonal (query + shift): causal up to it, a window's sides about it (-1
// unbounded); and its diagonal and ALiBi slope (0 without ALiBi) for the bias. The kernels mask a tile's
// scores only when a row's range cuts it (a test on the thread's first and last row).
struct DecodeRowKeys {
  int first, last, diag;
  float slope;
};

// Packed row `row` of K/V head kv_head is query row / group of head kv_head * group + row % group.
template <bool kCausal>
__device__ __forceinline__ DecodeRowKeys decode_row_keys(const DecodeParams& p, int batch, int kv_head, int row,
                                                         int shift) {
  DecodeRowKeys r;
  r.diag = row / p.group + shift;
  r.last = kCausal ? r.diag : 0x7fffffff;
  if (p.window_right >= 0) r.last = min(r.last, r.diag + p.window_right);
  r.first = p.window_left >= 0 ? r.diag - p.window_left : -0x7fffffff;
  const int head = kv_head * p.group + row % p.group;
  r.slope = p.alibi_slopes && row < p.rows ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
  return r;
}

// A scaled score after soft-capping (p.softcap > 0): cap * tanh(s / cap) with the prefill kernels' tanh
// (fa/variant.cuh), else the score itself. A uniform branch on a parameter: the decode kernels are bound by
// memory, and one build serves capped and uncapped calls.
__device__ __forceinline__ float decode_score(const DecodeParams& p, float scaled) {
  return p.softcap > 0.f ? p.softcap * tanh_approx(scaled * p.softcap_inv) : scaled;
}

// ALiBi's bias on a scaled score: s - slope |diag - key| (a masked -inf stays -inf). The kernels apply it
// in a pass of its own under `if (p.alibi_slopes)`: inside the scale-and-mask loop it made the sm80-
// instruction kernel's contiguous forms keep each element's key live (168 -> 212 registers at head_dim 128).
__device__ __forceinline__ float alibi_score(float s, const DecodeRowKeys& row, int key) {
  return fmaf(-row.slope, fabsf((float)(row.diag - key)), s);
}

// The block's BM packed query rows into shared memory: packed row r is query r / group of head
// kv_head * group + r % group; rows past p.rows and columns past head_dim are zeros. One cp.async group
// with whatever the caller commits next.
template <int BM, int D, int kThreads, class Tile>
__device__ __forceinline__ void load_decode_q(u32 sQ, const DecodeParams& p, int batch, int kv_head, int row0,
                                              int tid) {
  constexpr int C = D / 8;
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

// K and V rows of tile t (keys k_lo + t * BC ...) into a stage of the ring. Thread tid copies chunk
// tid % C of kRows consecutive rows, from (tid / C) * kRows on (a warp's copies still cover whole
// 16-byte-chunked rows, fully coalesced). Consecutive rows so that one address computation serves them all:
// a paged cache whose page size is a power of two at least kRows (every size engines use but 1 to 8) holds
// a thread's rows in one page, so the thread reads one page entry per tile and steps by the row stride;
// other page sizes look each row up. Measured on an H100 (bf16, head_dim 128, batch 8, 32k keys, page 16),
// the per-row lookup executed 1.7x the instructions of the contiguous kernel and ran at half its bandwidth:
// the warps that issue the copies also do the math, so every address instruction delays the next copies.
// Positions at or past k_hi, and any behind a page index outside the cache, are zero-filled (never read):
// the scores there are masked, and zero V rows keep 0 * garbage out of O.
template <int BC, int D, int kThreads, bool kPaged, class Ring, class Tile>
struct DecodeKVLoader {
  static constexpr int C = D / 8;  // 16-byte chunks per row
  static_assert(kThreads % C == 0 && BC % (kThreads / C) == 0, "the block's threads must tile a K/V tile's rows");
  static constexpr int kRows = BC / (kThreads / C);
  // One page entry serves a thread's rows only if they cannot straddle a page: kRows a power of two, so a
  // power-of-two page of at least kRows positions holds whole, aligned groups of them.
  static_assert((kRows & (kRows - 1)) == 0, "a thread's rows per K/V tile must be a power of two");
  // (Head_dim 256 holds 192 registers of Q fragments and O in the sm80 kernel; unrolling all 16 of its
  // rows spilled.)
  static constexpr int kUnroll = D > 128 ? 4 : kRows;

  const CachePositions<kPaged>& positions;
  const Ring& pages;  // fa/kv_cache.cuh TilePageRing
  const u16* gK;  // the row's (contiguous) or the cache's (paged) K, at this K/V head
  const u16* gV;
  int k_lo, k_hi;
  int chunk, first_row;
  bool col_ok, one_page;

  __device__ __forceinline__ DecodeKVLoader(const DecodeParams& p, const CachePositions<kPaged>& positions_,
                                            const Ring& pages_, int batch, int kv_head,
                                            int k_lo_, int k_hi_, int tid)
      : positions(positions_),
        pages(pages_),
        gK(static_cast<const u16*>(p.k) + (kPaged ? 0 : (i64)batch * p.k_batch_stride) +
           (i64)kv_head * p.k_head_stride),
        gV(static_cast<const u16*>(p.v) + (kPaged ? 0 : (i64)batch * p.v_batch_stride) +
           (i64)kv_head * p.v_head_stride),
        k_lo(k_lo_),
        k_hi(k_hi_),
        chunk(tid % C),
        first_row((tid / C) * kRows),
        col_ok(chunk * 8 < p.head_dim),
        one_page(!kPaged || positions_.page_shift >= log2_of(kRows)) {}  // uniform over the block

  // Tile t into the K tile at sK and the V tile at sV; `bad` set when a page index lies outside the cache.
  __device__ __forceinline__ void operator()(int t, u32 sK, u32 sV, const DecodeParams& p, bool& bad) const {
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
  }
};

// A decode config's page-entry ring (fa/kv_cache.cuh TilePageRing), whose lead follows the main loop's
// order. Cfg::kRefillFirst: each iteration issues tile t + S - 1's copies (into the stage tile t - 1 held,
// after a barrier that says every warp is done with it) before it waits for tile t's, so S tiles are in flight
// while the block waits, one more than in the order with one barrier per tile (wait for tile t, barrier,
// refill). Where a block's bytes in flight set its pace -- one block per SM, or the 2-deep ring the wgmma
// kernel needs for two -- that is half (3 deep) or twice (2 deep) the bytes on the way, for a second
// barrier per tile. (configs.decode.DecodeConfig.refill_first; kernel log 159.)
template <class Cfg, bool kPaged>
using PageRing = TilePageRing<kPaged, Cfg::kBlockKV, Cfg::kStages, Cfg::kRefillFirst>;

// Main-loop iteration t's refill, in either order of the loop: tile t + S - 1's copies into the stage tile
// t - 1 held (none past the last tile), and a later tile's page entries (TilePageRing::request), as one commit
// group, so that the group count, and cp_async_wait's argument, is the same for every iteration.
template <int S, bool kPaged, class Ring, class LoadKV>
__device__ __forceinline__ void decode_ring_refill(int t, const Ring& pages, const CachePositions<kPaged>& positions,
                                                   const DecodeBlockKeys& keys, int tid, LoadKV&& load_kv) {
  if (t + S - 1 < keys.n_tiles) load_kv(t + S - 1);
  pages.request(positions, t, keys.k_lo, keys.k_hi, tid);
  cp_async_commit();
}

// The ring's prologue: Q (already issued by the caller) lands with tile 0, then tiles 1 .. S - 2, one commit
// group each (empty groups past the last tile keep the group count, and so cp_async_wait's argument, the
// same for every iteration). A paged cache's entries of the first tiles (fa/kv_cache.cuh: TilePageRing)
// are fetched together and published by one barrier: the loads are independent, so the block waits one
// round trip for them, not one per tile. `load_kv(t)` issues tile t into its stage.
template <int S, bool kPaged, class Ring, class LoadKV>
__device__ __forceinline__ void decode_ring_prologue(const Ring& pages,
                                                     const CachePositions<kPaged>& positions,
                                                     const DecodeBlockKeys& keys, int tid, LoadKV&& load_kv) {
  if (kPaged) {
    pages.prologue(positions, keys.k_lo, keys.k_hi, tid);
    __syncthreads();
  }
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    if (t < keys.n_tiles) load_kv(t);
    cp_async_commit();
  }
}

// Columns col .. col + N - 1 (N = 2 or 4) of packed row `row` of (batch row, K/V head): the normalised
// output and its LSE (written by the thread that passes with_lse) -- as split `split`'s fp32 partial when
// the keys are split, else as the answer.
template <bool BF, int D, int N>
__device__ __forceinline__ void store_decode_row(const DecodeParams& p, int batch, int kv_head, int split,
                                                 int row, int col, const float (&v)[N], float lse,
                                                 bool with_lse) {
  static_assert(N == 2 || N == 4, "two or four columns");
  const int query = row / p.group;
  const int head = kv_head * p.group + row % p.group;
  if (p.num_splits > 1) {
    const i64 idx_row = (((i64)split * p.batch + batch) * p.heads_q + head) * p.seqlen_q + query;
    float* dst = p.o_partial + idx_row * D + col;
    if constexpr (N == 4) {
      *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
    }
    if (with_lse) p.lse_partial[idx_row] = lse;
  } else {
    u16* dst = static_cast<u16*>(p.o) + (i64)batch * p.o_batch_stride + (i64)query * p.o_row_stride +
               (i64)head * p.o_head_stride + col;
    if constexpr (N == 4) {
      const u32 lo = pack2<BF>(v[0], v[1]), hi = pack2<BF>(v[2], v[3]);
      asm volatile("st.global.v2.u32 [%0], {%1, %2};\n" ::"l"(dst), "r"(lo), "r"(hi));
    } else {
      *reinterpret_cast<u32*>(dst) = pack2<BF>(v[0], v[1]);
    }
    if (with_lse && p.lse) p.lse[(i64)batch * p.lse_batch_stride + (i64)head * p.lse_head_stride + query] = lse;
  }
}

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

// The fused combine (split_counters set, opt-in): the row block's last split to finish merges the splits.
// Called by every thread of the block after its partials are written.
template <bool BF, int D, int BM, int kThreads>
__device__ __forceinline__ void decode_fused_combine(const DecodeParams& p, int batch, int kv_head,
                                                     int m_block, int row0, int tid) {
  if (p.num_splits <= 1 || p.split_counters == nullptr) return;
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

}  // namespace fa
