// Which blocks a tile visits, from the rule of fa/visible_keys.cuh: the K/V blocks of a query tile (the
// forward kernels, the dQ kernel) and the query blocks of a key tile (the dK/dV kernels). Blocks holding
// no visible key are never loaded or computed.
#pragma once

#include "fa/visible_keys.cuh"

namespace fa {

// K/V blocks [begin, end) of kBlockKV keys. Unranged, begin is the compile-time constant 0, so that
// expressions of it fold before the optimiser sees them (a run-time 0 changed the loop code of the sm80
// forward).
//
// A kernel tests for "no block" itself, as `kRanged ? end <= begin : end == 0`, written out in the if: the
// equivalent `end <= begin` with begin 0 changed the register allocation of the 252-255-register sm80
// forward tiles enough to spill (docs/kernel-log.md, step 13), and so does the same test behind a function
// call (the compiler then lays out the kernel's branches differently).
template <bool kRanged>
struct KVBlocks {
  int begin, end;
};

template <>
struct KVBlocks<false> {
  static constexpr int begin = 0;
  int end;
};

// The first K/V block (BC keys each) holding a key >= kv_lo (0 without a key range).
template <int BC, bool kCausal, bool kRanged>
__device__ __forceinline__ int first_kv_block(const VisibleKeys<kCausal, kRanged>& keys) {
  return keys.kv_lo / BC;
}

// The K/V blocks (BC keys each) that query rows [q_start, q_start + q_rows) see some key of: from the
// first block holding a key >= kv_lo to the last holding a key < kv_hi and, causal, <= the last row's
// diagonal.
template <int BC, bool kCausal, bool kRanged>
__device__ __forceinline__ KVBlocks<kRanged> kv_blocks(const VisibleKeys<kCausal, kRanged>& keys, int q_start,
                                                       int q_rows) {
  KVBlocks<kRanged> blocks;
  blocks.end = (keys.kv_hi + BC - 1) / BC;
  if constexpr (kRanged) blocks.begin = first_kv_block<BC>(keys);
  if (kCausal) {
    const int max_key = q_start + q_rows - 1 + keys.shift;
    blocks.end = max_key < 0 ? 0 : min(blocks.end, max_key / BC + 1);
  }
  return blocks;
}

// Query blocks [begin, begin + count) of BR rows. Without the causal mask, begin is the compile-time
// constant 0 (as KVBlocks' begin without a key range).
template <bool kCausal>
struct QBlocks {
  int begin, count;
};

template <>
struct QBlocks<false> {
  static constexpr int begin = 0;
  int count;
};

// The query blocks (BR rows each, p.num_m_blocks in the sequence) that see some key of keys
// [kv_start, kv_start + BC): causal, query q sees key kv_start iff q >= kv_start - shift; ranged, none
// when the block lies wholly outside [kv_lo, kv_hi). (The two range tests are combined with `|`, both
// evaluated: with `||` the compiler shaped the dK/dV kernels' prologue differently than when this code was
// written in them.)
template <int BR, int BC, bool kCausal, bool kRanged, class Params>
__device__ __forceinline__ QBlocks<kCausal> q_blocks(const VisibleKeys<kCausal, kRanged>& keys,
                                                     const Params& p, int kv_start) {
  QBlocks<kCausal> blocks;
  if constexpr (kCausal) blocks.begin = max(0, kv_start - keys.shift) / BR;
  blocks.count = max(0, p.num_m_blocks - blocks.begin);
  if (kRanged && ((kv_start >= keys.kv_hi) | (kv_start + BC <= keys.kv_lo))) blocks.count = 0;
  return blocks;
}

// Sliding window (WindowKeys): the K/V blocks that query rows [q_start, q_start + q_rows) see some key of:
// from the block of the first row's first key to the block of the last row's last key (the rows' windows
// overlap, so every block between holds a visible key), within [kv_lo, kv_hi). Empty: end == begin.
template <int BC, bool kRanged>
__device__ __forceinline__ KVBlocks<true> kv_blocks(const WindowKeys<kRanged>& keys, int q_start, int q_rows) {
  const int lo = max(keys.kv_lo, q_start + keys.shift - keys.left);
  const int hi = min(keys.kv_hi, q_start + q_rows + keys.shift + keys.right);  // one past the last key
  KVBlocks<true> blocks;
  blocks.begin = max(lo, 0) / BC;
  blocks.end = hi > max(lo, 0) ? (hi + BC - 1) / BC : blocks.begin;
  return blocks;
}

// Sliding window: the query blocks (BR rows each, p.num_m_blocks of them) that see some key of
// [kv_start, kv_start + BC): query q sees one iff its window meets the block's visible keys [a, b), i.e.
// a - shift - right <= q <= b - 1 - shift + left. kv_blocks above and this agree on which (query block,
// key block) pairs meet (the deterministic backward's turns count on it, fa/dq_turns.cuh).
template <int BR, int BC, bool kRanged, class Params>
__device__ __forceinline__ QBlocks<true> q_blocks(const WindowKeys<kRanged>& keys, const Params& p,
                                                  int kv_start) {
  const int a = max(kv_start, keys.kv_lo);
  const int b = min(kv_start + BC, keys.kv_hi);
  const int q_last = b - 1 - keys.shift + keys.left;
  QBlocks<true> blocks;
  blocks.begin = max(0, a - keys.shift - keys.right) / BR;
  const int end = q_last < 0 ? 0 : min(p.num_m_blocks, q_last / BR + 1);
  blocks.count = b > a ? max(0, end - blocks.begin) : 0;
  return blocks;
}

// Segments (SegmentKeys): the K/V blocks from the first row's first key to the last row's last key (both
// bounds are nondecreasing along the rows). Empty: end == begin.
template <int BC>
__device__ __forceinline__ KVBlocks<true> kv_blocks(const SegmentKeys& keys, int q_start, int q_rows) {
  const int lo = keys.first_key(q_start);
  const int hi = keys.end_key(q_start + q_rows - 1);
  KVBlocks<true> blocks;
  blocks.begin = lo / BC;
  blocks.end = hi > lo ? (hi + BC - 1) / BC : blocks.begin;
  return blocks;
}

// Segments, a query tile of one sequence (the warp-specialized forward's tile table, FwdParams::q_tiles):
// the blocks on a grid anchored at the tile's first visible key, `origin`, instead of at key 0 (block j
// holds keys origin + j BC ..). A sequence's keys then start a block as in a dense batch: the grid at key 0
// cut each sequence's first and last block, one extra block and two masked ones per tile on average, which
// cost the packed non-causal forward 7% against the same documents rounded to whole tiles (kernel log 96).
// Empty (end == begin == 0) for a tile without rows (the table's unused tail) or without keys.
template <int BC>
__device__ __forceinline__ KVBlocks<true> kv_blocks_anchored(const SegmentKeys& keys, int q_start, int q_rows,
                                                             int& origin) {
  KVBlocks<true> blocks;
  blocks.begin = 0;
  blocks.end = 0;
  origin = 0;
  if (q_rows > 0) {
    origin = keys.first_key(q_start);
    const int hi = keys.end_key(q_start + q_rows - 1);
    blocks.end = hi > origin ? (hi - origin + BC - 1) / BC : 0;
  }
  return blocks;
}

// Segments: the query blocks (BR rows each) from the first key's first row to the last key's last row.
template <int BR, int BC, class Params>
__device__ __forceinline__ QBlocks<true> q_blocks(const SegmentKeys& keys, const Params& p, int kv_start) {
  const int lo = keys.first_row(kv_start);
  const int hi = keys.end_row(min(kv_start + BC, keys.seqlen_k) - 1);
  QBlocks<true> blocks;
  blocks.begin = lo / BR;
  blocks.count = hi > lo ? min(p.num_m_blocks, (hi + BR - 1) / BR) - blocks.begin : 0;
  return blocks;
}

// Segments, a key tile of one sequence (the warp-specialized dK/dV kernel's tile table, BwdParams::k_tiles):
// the query blocks that see some key of [kv_start, kv_end), on a grid anchored at `origin`, the sequence's
// first row, instead of at row 0 (block m holds rows origin + m BR ..). A sequence's rows then start a
// block, as in a dense batch: the packed row's grid cut each sequence's first and last query block, which
// every key tile of the sequence walked (kernel log 98). The keys' runs bound the rows (both nondecreasing
// along the keys); a run before origin (a key no row sees) counts from the grid's first block, and none
// reaches past `end`, the sequence's last row + 1: offsets that break the caller's promise give runs past
// the tensors (the runs are built from the offsets as given), which would walk blocks past the sequence's
// workspace rows, and past the workspace.
template <int BR>
__device__ __forceinline__ QBlocks<true> q_blocks_anchored(const SegmentKeys& keys, int kv_start, int kv_end,
                                                           int origin, int end) {
  const int lo = keys.first_row(kv_start);
  const int hi = min(keys.end_row(kv_end - 1), end);
  QBlocks<true> blocks;
  blocks.begin = max(lo - origin, 0) / BR;
  blocks.count = hi > lo ? max((hi - origin + BR - 1) / BR - blocks.begin, 0) : 0;
  return blocks;
}

}  // namespace fa
