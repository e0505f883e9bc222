// The element mask of one warp's accumulator tile (fa/frag.cuh layout), from the rule of
// fa/visible_keys.cuh, in both orientations the kernels hold scores in:
//  * query rows (the forward's S, the dQ kernel's S): rows are queries, columns keys;
//  * key rows (the dK/dV kernels' transposed chain S^T): rows are keys, columns queries.
// Masked scores become -inf (their probability exp2(-inf) = 0). Each function first makes a warp-uniform
// test of the whole tile, so tiles wholly inside the visible region pay one comparison per condition.
#pragma once

#include "fa/ptx.cuh"
#include "fa/visible_keys.cuh"

namespace fa {

// Query-row orientation. Element (mt, n, e) is query q_row0 + 16 mt + g + 8 (e / 2) against key
// kv_start + 8 n + 2 t + e % 2; q_row0 is the warp's first query row (in the sequence), the tile holds
// 8 * Acc::kN keys.
template <class Acc, bool kCausal, bool kRanged>
__device__ __forceinline__ void mask_query_rows(const Acc& s, const VisibleKeys<kCausal, kRanged>& keys,
                                                int q_row0, int kv_start, int g, int t) {
  constexpr int BC = 8 * Acc::kN;
  const bool tail = kv_start + BC > keys.kv_hi;
  const bool lead = kRanged && kv_start < keys.kv_lo;
  const bool diag = kCausal && kv_start + BC - 1 > q_row0 + keys.shift;
  if (tail || lead || diag) {
    // Column 8 n + 2 t + e1 of the tile against row 16 mt + g + 8 e2 of the warp, with the per-lane parts
    // folded into two integers so each element costs one compare against a constant.
    const int col_limit = keys.kv_hi - kv_start - 2 * t;  // masked if 8n + e1 >= this
    const int col_first = keys.kv_lo - kv_start - 2 * t;  // masked if 8n + e1 < this (kRanged only)
    const int diag_limit = q_row0 + g + keys.shift - kv_start - 2 * t;  // masked if 8n+e1-16mt-8e2 > this
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * n + (e & 1);
          if (c >= col_limit || (kRanged && c < col_first) ||
              (kCausal && c - 16 * mt - 8 * (e >> 1) > diag_limit))
            s(mt, n, e) = neg_inf();
        }
  }
}

// Key-row orientation. Element (mt, n, e) is key kv_start + warp_row0 + 16 mt + g + 8 (e / 2) against
// query q_start + 8 n + 2 t + e % 2; the warp holds 16 * Acc::kMT keys from row warp_row0 of the key block
// at kv_start. Queries past seqlen_q need no mask: the backward's base-2 LSE of such a row is +inf, so its
// P is 0.
template <class Acc, bool kCausal, bool kRanged>
__device__ __forceinline__ void mask_key_rows(const Acc& s, const VisibleKeys<kCausal, kRanged>& keys,
                                              int kv_start, int warp_row0, int q_start, int g, int t) {
  constexpr int WN = 16 * Acc::kMT;
  const int key0 = kv_start + warp_row0;  // the warp's first key
  const bool tail = key0 + WN > keys.kv_hi;
  const bool lead = kRanged && key0 < keys.kv_lo;
  const bool diag = kCausal && key0 + WN - 1 > q_start + keys.shift;
  if (tail || lead || diag) {
    const int key_l = key0 + g;
    const int dlim = q_start + 2 * t + keys.shift - key_l;  // masked if 16 mt + 8 e2 - 8 n - e1 > dlim
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_l + 16 * mt + 8 * (e >> 1);
          // (`|` between the two key-range tests: with `||` the compiler ordered them the other way round
          // than when this code was written in the dK/dV kernel.)
          if ((key >= keys.kv_hi) | (kRanged && key < keys.kv_lo) ||
              (kCausal && 16 * mt + 8 * (e >> 1) - 8 * n - (e & 1) > dlim))
            s(mt, n, e) = neg_inf();
        }
  }
}

// Sliding window (WindowKeys), query-row orientation (as mask_query_rows above): also masked where the key
// lies outside the row's window [i + shift - left, i + shift + right].
template <class Acc, bool kRanged>
__device__ __forceinline__ void mask_query_rows(const Acc& s, const WindowKeys<kRanged>& keys, int q_row0,
                                                int kv_start, int g, int t) {
  constexpr int BC = 8 * Acc::kN;
  constexpr int WM = 16 * Acc::kMT;  // the warp's query rows
  const bool tail = kv_start + BC > keys.kv_hi;
  const bool lead = kRanged && kv_start < keys.kv_lo;
  const bool above = kv_start + BC - 1 > q_row0 + keys.shift + keys.right;
  const bool below = kv_start < q_row0 + WM - 1 + keys.shift - keys.left;
  if (tail || lead || above || below) {
    const int col_limit = keys.kv_hi - kv_start - 2 * t;  // masked if 8n + e1 >= this
    const int col_first = keys.kv_lo - kv_start - 2 * t;  // masked if 8n + e1 < this (kRanged only)
    // With c = 8n + e1 and r = 16mt + 8e2: key - row = c - r + (kv_start + 2t - q_row0 - g).
    const int base = q_row0 + g + keys.shift - kv_start - 2 * t;
    const int hi_limit = base + keys.right;  // masked if c - r > this
    const int lo_limit = base - keys.left;   // masked if c - r < this
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * n + (e & 1);
          const int d = c - 16 * mt - 8 * (e >> 1);
          if ((c >= col_limit) | (kRanged && c < col_first) | (d > hi_limit) | (d < lo_limit)) s(mt, n, e) = neg_inf();
        }
  }
}

// Sliding window, key-row orientation (as mask_key_rows above).
template <class Acc, bool kRanged>
__device__ __forceinline__ void mask_key_rows(const Acc& s, const WindowKeys<kRanged>& keys, int kv_start,
                                              int warp_row0, int q_start, int g, int t) {
  constexpr int WN = 16 * Acc::kMT;
  constexpr int QN = 8 * Acc::kN;  // the tile's queries
  const int key0 = kv_start + warp_row0;
  const bool tail = key0 + WN > keys.kv_hi;
  const bool lead = kRanged && key0 < keys.kv_lo;
  const bool above = key0 + WN - 1 > q_start + keys.shift + keys.right;
  const bool below = key0 < q_start + QN - 1 + keys.shift - keys.left;
  if (tail || lead || above || below) {
    const int key_l = key0 + g;
    // With d = 16mt + 8e2 - 8n - e1: key - query = d + key_l - q_start - 2t.
    const int base = q_start + 2 * t + keys.shift - key_l;
    const int hi_limit = base + keys.right;  // masked if d > this
    const int lo_limit = base - keys.left;   // masked if d < this
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_l + 16 * mt + 8 * (e >> 1);
          const int d = 16 * mt + 8 * (e >> 1) - 8 * n - (e & 1);
          if ((key >= keys.kv_hi) | (kRanged && key < keys.kv_lo) | (d > hi_limit) | (d < lo_limit))
            s(mt, n, e) = neg_inf();
        }
  }
}

// Segments (SegmentKeys), query-row orientation: a key outside the row's run [first_key, end_key) is masked.
// The tile is wholly visible when its keys lie within the last row's first key and the first row's end
// (two loads, the same address across the warp); otherwise each of the thread's rows loads its run.
template <class Acc>
__device__ __forceinline__ void mask_query_rows(const Acc& s, const SegmentKeys& keys, int q_row0, int kv_start,
                                                int g, int t) {
  constexpr int BC = 8 * Acc::kN;
  constexpr int WM = 16 * Acc::kMT;
  int first_of_last, end_of_first;
  keys.rows_bounds(q_row0, WM, first_of_last, end_of_first);
  if (kv_start < first_of_last || kv_start + BC > end_of_first) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + 16 * mt + g + 8 * h;
        const int first = keys.first_key(row) - kv_start - 2 * t;  // masked if 8n + e1 < this
        const int end = keys.end_key(row) - kv_start - 2 * t;      // masked if 8n + e1 >= this
#pragma unroll
        for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * n + c;
            if ((col < first) | (col >= end)) s(mt, n, 2 * h + c) = neg_inf();
          }
      }
  }
}

// Segments, key-row orientation: a query outside the key's run [first_row, end_row) is masked. The tile is
// wholly visible when its queries lie within the warp's last key's first row and its first key's end: two
// loads per block, after the wait for S^T and so on the step's critical path (the wgmma waits' asm keeps
// the compiler from hoisting them), or with kKeepBounds loaded at the first block and kept in three
// registers (SegmentKeys::keys_bounds), which kernels with registers to spare ask for (kernel log 98).
template <bool kKeepBounds, class Acc>
__device__ __forceinline__ void mask_key_rows_segments(const Acc& s, const SegmentKeys& keys, int kv_start,
                                                       int warp_row0, int q_start, int g, int t) {
  constexpr int WN = 16 * Acc::kMT;
  constexpr int QN = 8 * Acc::kN;
  const int key0 = kv_start + warp_row0;
  bool partial;
  if constexpr (kKeepBounds) {
    int first_of_last, end_of_first;
    keys.keys_bounds(key0, WN, first_of_last, end_of_first);
    partial = key0 + WN > keys.seqlen_k || q_start < first_of_last || q_start + QN > end_of_first;
  } else {
    partial = key0 + WN > keys.seqlen_k || q_start < keys.first_row(key0 + WN - 1) ||
              q_start + QN > keys.end_row(key0);
  }
  if (partial) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = key0 + 16 * mt + g + 8 * h;
        // Keys past seqlen_k (a tile's tail) are masked whole.
        const bool past = key >= keys.seqlen_k;
        const int first = keys.first_row(key) - q_start - 2 * t;  // masked if 8n + e1 < this
        const int end = keys.end_row(key) - q_start - 2 * t;      // masked if 8n + e1 >= this
#pragma unroll
        for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * n + c;
            if (past | (col < first) | (col >= end)) s(mt, n, 2 * h + c) = neg_inf();
          }
      }
  }
}
template <class Acc>
__device__ __forceinline__ void mask_key_rows(const Acc& s, const SegmentKeys& keys, int kv_start, int warp_row0,
                                              int q_start, int g, int t) {
  mask_key_rows_segments<false>(s, keys, kv_start, warp_row0, q_start, g, t);
}

// mask_key_rows with its tile test's bounds kept across blocks where a rule loads them (the segments);
// the rules above compute theirs from the params and have nothing to keep.
template <class Acc, class Keys>
__device__ __forceinline__ void mask_key_rows_keeping_bounds(const Acc& s, const Keys& keys, int kv_start,
                                                             int warp_row0, int q_start, int g, int t) {
  mask_key_rows(s, keys, kv_start, warp_row0, q_start, g, t);
}
template <class Acc>
__device__ __forceinline__ void mask_key_rows_keeping_bounds(const Acc& s, const SegmentKeys& keys,
                                                             int kv_start, int warp_row0, int q_start, int g,
                                                             int t) {
  mask_key_rows_segments<true>(s, keys, kv_start, warp_row0, q_start, g, t);
}

}  // namespace fa
