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

}  // namespace fa
