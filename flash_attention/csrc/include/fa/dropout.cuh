// Attention dropout's random numbers: a counter-based hash, so every kernel (forward, dK/dV, dQ) regenerates
// the same keep/drop decision for element (batch * heads_q + head, query i, key j) in whatever register
// layout it holds that element -- no mask is stored, and the backward's transposed tiles need no shuffle.
//
// The decision is a pure function of (key, bh, i, j): v = mix(mix(mix(key ^ bh C0) ^ i C1) ^ j C2), kept iff
// v >= threshold = round(p 2^32). mix is a 32-bit avalanche finaliser (two multiply-xorshift rounds). The
// per-launch key folds the seed and offset (flash_attention/dropout.py computes it, and the same function in
// PyTorch is the reference the tests and the CPU fallback use).
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

// Whether element (row, key) is kept.
__device__ __forceinline__ bool dropout_keep(u32 row_hash, int key, u32 threshold) {
  return dropout_mix(row_hash ^ (u32)key * 0xc2b2ae35u) >= threshold;
}

// The keep decisions of one n-tile of a warp's accumulator in the key-row orientation (the dK/dV kernels'
// S^T, fa/mask.cuh): bit e of the result is element (n, e), key `key` + 8 (e / 2) against query
// `query` + e % 2 (query = q_start + 8 n + 2 t, key = the thread's first key row).
__device__ __forceinline__ u32 dropout_keep_bits_key_rows(u32 head_hash, int query, int key, u32 threshold) {
  u32 bits = 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u32 hr = dropout_row_hash(head_hash, query + r);
    bits |= (u32)dropout_keep(hr, key, threshold) << r;
    bits |= (u32)dropout_keep(hr, key + 8, threshold) << (2 + r);
  }
  return bits;
}

// Dropout of the probabilities of 16-row tile mt of one warp's tile in the query-row orientation
// (fa/frag.cuh layout; the forward's P) of (batch, head): element (mt, n, e) is query
// q_row0 + 16 mt + g + 8 (e / 2) against key kv_start + 8 n + 2 t + e % 2. The key, threshold and scale are
// read from the params (FwdParams) here, in the order the expressions name them: passed in as arguments they
// are loaded in another order, which changes the kernels' machine code. A dropped element becomes 0, a kept
// one is scaled by 1 / (1 - p).
template <class Acc, class Params>
__device__ __forceinline__ void dropout_query_rows(const Acc& s, int mt, const Params& p, int batch, int head,
                                                   int q_row0, int kv_start, int g, int t) {
  const u32 hh = dropout_head_hash(p.dropout_key, batch * p.heads_q + head);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u32 hr = dropout_row_hash(hh, q_row0 + 16 * mt + g + 8 * r);
#pragma unroll
    for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool keep = dropout_keep(hr, kv_start + 8 * n + 2 * t + e, p.dropout_threshold);
        s(mt, n, 2 * r + e) = keep ? s(mt, n, 2 * r + e) * p.dropout_rp : 0.f;
      }
  }
}

}  // namespace fa
