// Which keys a query may see under the library's own mask policy (fa/variant.cuh, CausalRangeMask): the
// rule its block ranges (fa/block_range.cuh) and element masks (fa/mask.cuh) are derived from. Another rule
// (a sliding window, per-sequence lengths, ...) is another mask policy (docs/design.md, "Adding an attention
// variant"); a term that only widens this one may be a field here plus its term in those two headers.
#pragma once

#include "fa/ptx.cuh"

namespace fa {

// Query row i (0-based in its sequence) of batch row b sees key j iff
//   kv_lo <= j < kv_hi                     (the sequence's keys; kRanged: the batch row's key_range), and
//   j <= i + shift, shift = seqlen_k - seqlen_q   (kCausal: the diagonal aligned to the bottom-right corner).
// kRanged: batch row b attends only keys key_range[2 b] <= j < key_range[2 b + 1] (key padding, left or
// right); the causal alignment stays on the full key axis. Out-of-range values are clamped, so a bad range
// can mask too much but never make a kernel read outside K/V. Params: FwdParams or BwdParams (the fields
// read here have the same names in both).
template <bool kCausal, bool kRanged>
struct VisibleKeys {
  static constexpr bool kIsCausal = kCausal;
  static constexpr bool kIsRanged = kRanged;
  int kv_lo, kv_hi;
  int shift;

  template <class Params>
  __device__ __forceinline__ VisibleKeys(const Params& p, int batch) : kv_lo(0), kv_hi(p.seqlen_k) {
    if constexpr (kRanged) {
      kv_lo = min(max(p.key_range[2 * batch], 0), p.seqlen_k);
      kv_hi = min(max(p.key_range[2 * batch + 1], kv_lo), p.seqlen_k);
    }
    shift = p.seqlen_k - p.seqlen_q;
  }
};

// Sliding window (WindowMask, fa/variant.cuh): query row i of batch row b sees key j iff
//   kv_lo <= j < kv_hi                           (as above; kRanged: the batch row's key_range), and
//   i + shift - left <= j <= i + shift + right   (the window around the diagonal, bottom-right aligned).
// Causal is the window (left, 0). The host passes left and right >= 0, an unbounded side as a bound no row
// can reach (ops: at most seqlen_q + seqlen_k, so the sums below stay in int range).
template <bool kRanged>
struct WindowKeys {
  static constexpr bool kIsRanged = kRanged;
  int kv_lo, kv_hi;
  int shift;
  int left, right;

  template <class Params>
  __device__ __forceinline__ WindowKeys(const Params& p, int batch)
      : kv_lo(0), kv_hi(p.seqlen_k), left(p.window_left), right(p.window_right) {
    if constexpr (kRanged) {
      kv_lo = min(max(p.key_range[2 * batch], 0), p.seqlen_k);
      kv_hi = min(max(p.key_range[2 * batch + 1], kv_lo), p.seqlen_k);
    }
    shift = p.seqlen_k - p.seqlen_q;
  }
};

// Segments (SegmentMask, fa/variant.cuh): every query row sees one contiguous run of keys, given per row:
// query row i sees key j iff row_keys[2 i] <= j < row_keys[2 i + 1], and equivalently key j is seen by rows
// key_rows[2 j] <= i < key_rows[2 j + 1]. The host builds both arrays from a packed batch of sequences
// (flash_attention/varlen.py: each sequence's keys, its causal diagonal and sliding window), with both
// bounds nondecreasing along the rows and along the keys, so that a tile's visible keys (rows) lie between
// its first row's first key and its last row's last key, and a tile is wholly visible when its keys lie
// between its last row's first key and its first row's last key. The row and key indices are those of
// the packed tensors (batch 1). Rows past seqlen_q (a tile's tail) read the last row's range.
struct SegmentKeys {
  const int* row_keys;
  const int* key_rows;
  int seqlen_q, seqlen_k;
  int kv_hi;  // no row sees a key at or past it (RuleMask::key_end)

  template <class Params>
  __device__ __forceinline__ SegmentKeys(const Params& p, int /*batch*/)
      : row_keys(p.row_keys), key_rows(p.key_rows), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k),
        kv_hi(p.seqlen_k) {}
  __device__ __forceinline__ int first_key(int row) const {
    return __ldg(row_keys + 2 * min(row, seqlen_q - 1));
  }
  __device__ __forceinline__ int end_key(int row) const {
    return __ldg(row_keys + 2 * min(row, seqlen_q - 1) + 1);
  }
  __device__ __forceinline__ int first_row(int key) const {
    return __ldg(key_rows + 2 * min(key, seqlen_k - 1));
  }
  __device__ __forceinline__ int end_row(int key) const {
    return __ldg(key_rows + 2 * min(key, seqlen_k - 1) + 1);
  }
  // A key tile of one sequence (the warp-specialized dK/dV kernel's tile table): keys at or past `end` are
  // another tile's, masked whole here as keys past seqlen_k are (mask_key_rows), and the tile's query
  // blocks end with its own last key's rows (q_blocks). end > 0.
  __device__ __forceinline__ void end_keys_at(int end) { seqlen_k = end; }

  // The two bounds a warp's "wholly visible" test in the query-row orientation reads (fa/mask.cuh): for its
  // rows [row0, row0 + n), the last row's first key and the first row's end. A warp's rows stay put through
  // a tile's key loop, but each test loaded them again after the wait for S, on the softmax's critical path
  // (one or two dependent L1 loads per block: the wgmma waits' asm keeps the compiler from hoisting them),
  // so they are loaded at the first test with a given first row and kept (kernel log 93). The key-row
  // orientation's test (the dK/dV kernels) keeps its bounds only where a kernel asks (keys_bounds below,
  // fa/mask.cuh's kKeepBounds): three more live registers spill most dK/dV kernels (kernel log 98).
  mutable int tested_row0 = -1, first_of_last_row = 0, end_of_first_row = 0;
  __device__ __forceinline__ void rows_bounds(int row0, int n, int& first_of_last, int& end_of_first) const {
    if (tested_row0 != row0) {
      tested_row0 = row0;
      first_of_last_row = first_key(row0 + n - 1);
      end_of_first_row = end_key(row0);
    }
    first_of_last = first_of_last_row;
    end_of_first = end_of_first_row;
  }
  // The key-row orientation's (fa/mask.cuh, the dK/dV kernels): for the warp's keys [key0, key0 + n), the
  // last key's first row and the first key's end, loaded at the first test with a given first key.
  mutable int tested_key0 = -1, first_of_last_key = 0, end_of_first_key = 0;
  __device__ __forceinline__ void keys_bounds(int key0, int n, int& first_of_last, int& end_of_first) const {
    if (tested_key0 != key0) {
      tested_key0 = key0;
      first_of_last_key = first_row(key0 + n - 1);
      end_of_first_key = end_row(key0);
    }
    first_of_last = first_of_last_key;
    end_of_first = end_of_first_key;
  }
};

}  // namespace fa
