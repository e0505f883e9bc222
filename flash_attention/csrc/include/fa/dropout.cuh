// Attention dropout's random numbers: a counter-based hash, so every kernel (forward, dK/dV, dQ) regenerates
// the same keep/drop decision for element (batch * heads_q + head, query i, key j) in whatever register
// layout it holds that element -- no mask is stored, and the backward's transposed tiles need no shuffle.
//
// The decision is a pure function of (key, bh, i, j). Keys pair up as j and j + 8 with bit 3 of j clear
// (8-key groups 2 m and 2 m + 1): v = mix(mix(mix(key ^ bh C0) ^ i C1) ^ j' C2) with j' = j & ~8 is one
// finaliser for the pair, whose low 16 bits decide j' and high 16 bits j' + 8: kept iff that half >=
// round(p 2^16). mix is a 32-bit avalanche finaliser (two multiply-xorshift rounds). Every kernel holds
// both keys of a pair in one thread, in either orientation (a query row's n-tiles n and n + 1, n even, of
// 16-key aligned tiles; a 16-row key tile's rows g and g + 8), so each finaliser serves two elements (a
// finaliser per element cost the d128 dK/dV kernel's dropout build 29% more instructions than the plain
// one: kernel log, "Where the dropout build's quarter goes"); 16 bits each resolve p in steps of 2^-16
// (kernel log 142). The per-launch key folds the seed and offset (flash_attention/dropout.py computes it,
// and the same function in PyTorch is the reference the tests and the CPU fallback use).
#pragma once

#include "fa/ptx.cuh"

namespace fa {

__device__ __forceinline__ u32 dropout_mix(u32 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Hash of (key, bh): one per thread block and query head.
__device__ __forceinline__ u32 dropout_head_hash(u32 key, int bh) {
  return dropout_mix(key ^ (u32)bh * 0x9e3779b9u);
}

// Hash of a query row, from the head's.
__device__ __forceinline__ u32 dropout_row_hash(u32 head_hash, int row) {
  return dropout_mix(head_hash ^ (u32)row * 0x85ebca6bu);
}

// The row hashes of queries q and q + 1 (q even) of a head into shared memory at dst (8 bytes). A kernel
// whose threads each need many rows' hashes, every thread of a quad column the same ones (the key-row dK/dV
// kernels: a thread's queries change with each n-tile, its keys not), has one thread per pair of rows draw
// them once per step beside its other copies, and its consumers read them as they read the LSE: in the d128
// dK/dV kernel's dropout build the row hashes were half of the step's hash work, two full finalisers for
// every four elements (kernel log 150).
__device__ __forceinline__ void dropout_stage_row_hashes(u32 dst, u32 head_hash, int q) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(dst), "r"(dropout_row_hash(head_hash, q)),
               "r"(dropout_row_hash(head_hash, q + 1))
               : "memory");
}

// Whether key `key` of a row is kept: its pair's finaliser, its half, moved to the top 16 bits and compared
// with threshold = round(p 2^16) 2^16 (FwdParams::dropout_threshold; the high half needs no shift).
__device__ __forceinline__ bool dropout_keep(u32 row_hash, int key, u32 threshold) {
  const u32 v = dropout_mix(row_hash ^ (u32)(key & ~8) * 0xc2b2ae35u);
  return ((key & 8) ? v : v << 16) >= threshold;
}

// Whether keys `key` (keep[0]) and `key` + 8 (keep[1]) of a row are kept. kPairs (fa/variant.cuh
// kDropoutKeyPairs: the kernel's key tiles start at multiples of 16 keys, so `key` has bit 3 clear): one
// finaliser for both; else (a packed batch's tiles, anchored at a sequence's first key) one for each.
template <bool kPairs>
__device__ __forceinline__ void dropout_keep_pair(bool (&keep)[2], u32 row_hash, int key, u32 threshold) {
  if constexpr (kPairs) {
    const u32 v = dropout_mix(row_hash ^ (u32)key * 0xc2b2ae35u);
    keep[0] = v << 16 >= threshold;
    keep[1] = v >= threshold;
  } else {
    keep[0] = dropout_keep(row_hash, key, threshold);
    keep[1] = dropout_keep(row_hash, key + 8, threshold);
  }
}

// The keep decisions of one n-tile of a warp's accumulator in the key-row orientation (the dK/dV kernels'
// S^T, fa/mask.cuh), from the row hashes of its two queries: keep[e] is element (n, e), key `key` + 8 (e / 2)
// against query hr[e % 2]'s (key = the thread's first key row: g of a 16-row tile).
template <bool kPairs>
__device__ __forceinline__ void dropout_keep_key_rows(bool (&keep)[4], const u32 (&hr)[2], int key,
                                                      u32 threshold) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    bool pair[2];
    dropout_keep_pair<kPairs>(pair, hr[r], key, threshold);
    keep[r] = pair[0];
    keep[2 + r] = pair[1];
  }
}

// The same as four bits (bit e: keep[e]), the row hashes drawn here: query `query` + e % 2 (query = q_start
// + 8 n + 2 t).
template <bool kPairs>
__device__ __forceinline__ u32 dropout_keep_bits_key_rows(u32 head_hash, int query, int key, u32 threshold) {
  const u32 hr[2] = {dropout_row_hash(head_hash, query), dropout_row_hash(head_hash, query + 1)};
  bool keep[4];
  dropout_keep_key_rows<kPairs>(keep, hr, key, threshold);
  return (u32)keep[0] | (u32)keep[1] << 1 | (u32)keep[2] << 2 | (u32)keep[3] << 3;
}

// The keep decisions of n-tiles n and n + 1 (n even) of one query row in the query-row orientation
// (fa/frag.cuh layout): keep[2 h + c] is key `key` + 8 h + c (key = kv_start + 8 n + 2 t).
template <bool kPairs>
__device__ __forceinline__ void dropout_keep_query_row(bool (&keep)[4], u32 row_hash, int key,
                                                       u32 threshold) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    bool pair[2];
    dropout_keep_pair<kPairs>(pair, row_hash, key + c, threshold);
    keep[c] = pair[0];
    keep[2 + c] = pair[1];
  }
}

// Dropout of the probabilities of 16-row tile mt of one warp's tile in the query-row orientation
// (fa/frag.cuh layout; the forward's P) of (batch, head): element (mt, n, e) is query
// q_row0 + 16 mt + g + 8 (e / 2) against key kv_start + 8 n + 2 t + e % 2 (kPairs: kv_start a multiple of
// 16). The key, threshold and scale are read from the params (FwdParams) here, in the order the expressions
// name them: passed in as arguments they are loaded in another order, which changes the kernels' machine
// code. A dropped element becomes 0, a kept one is scaled by 1 / (1 - p).
template <bool kPairs, class Acc, class Params>
__device__ __forceinline__ void dropout_query_rows(const Acc& s, int mt, const Params& p, int batch, int head,
                                                   int q_row0, int kv_start, int g, int t) {
  static_assert(Acc::kN % 2 == 0, "n-tiles in pairs: 16-key tiles");
  const u32 hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
  const u32 hr[2] = {dropout_row_hash(hh, q_row0 + 16 * mt + g),
                     dropout_row_hash(hh, q_row0 + 16 * mt + g + 8)};
  // (Row by row, pair by pair: of the six loop orders this one spills nowhere in the shipped forwards with
  // NVRTC 13.0 (the persistent d128 build with causal key ranges spilled 4 bytes under three of the others);
  // 176 keys at d128 spilled 68-104 bytes under each of the three orders tried, hence
  // select.dropout_config.)
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < Acc::kN; n += 2)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        bool keep[2];
        dropout_keep_pair<kPairs>(keep, hr[r], kv_start + 8 * n + 2 * t + e, p.dropout_threshold);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          s(mt, n + h, 2 * r + e) = keep[h] ? s(mt, n + h, 2 * r + e) * p.dropout_rp : 0.f;
      }
}

}  // namespace fa
