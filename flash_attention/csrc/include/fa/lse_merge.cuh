// Merging two attentions of the same query rows over disjoint sets of keys: the running result (O, L) and a
// part (O', L') become
//   L* = log(exp L + exp L'),   O* = exp(L - L*) O + exp(L' - L*) O',
// the softmax over the union of the keys regrouped by set. Context parallelism merges each ring step's part
// this way (flash_attention/distributed.py); the running result is fp32 and is updated in place, in one
// pass: each element of O is read and written once and O' read once, where the PyTorch expression took two
// passes over O and temporaries of the LSE's size per step.
//
// A row whose keys were all masked has L = -inf and weighs nothing; a row with no key in either set keeps
// O = 0 and L = -inf. A NaN LSE on either side (a poisoned input) makes the row NaN: the comparisons below
// are ordered so that NaN wins, where fmaxf would drop it and return a silently wrong row.
#pragma once

#include "fa/lse_merge_params.h"
#include "fa/ptx.cuh"

namespace fa {

// The part's element type: 0 fp32, 1 fp16, 2 bf16.
template <int kPart>
__device__ __forceinline__ float4 load_part4(const void* base, i64 offset) {
  if constexpr (kPart == 0) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + offset);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const u16*>(base) + offset);
    float4 r;
    unpack2<kPart == 2>(raw.x, r.x, r.y);
    unpack2<kPart == 2>(raw.y, r.z, r.w);
    return r;
  }
}

// One thread per 4 columns of a (batch, row, head) row, whole rows per block, rows in the tensors' own
// (batch, row, head) order so a warp reads contiguous memory. The host checks head_dim % 4 == 0 and the
// vector alignment of every row (flash_attention/ops/merge.py).
template <int kPart, int kThreads>
__device__ __forceinline__ void lse_merge_body(const LseMergeParams& p) {
  const int per_row = p.head_dim / 4;
  const int rows_per_block = kThreads / per_row;
  const int local = (int)threadIdx.x / per_row;
  const i64 row = (i64)blockIdx.x * rows_per_block + local;
  const int col = 4 * ((int)threadIdx.x % per_row);
  const i64 total = (i64)p.batch * p.rows * p.heads;
  const bool live = local < rows_per_block && row < total;
  const int head = (int)(row % p.heads);
  const int r = (int)((row / p.heads) % p.rows);
  const int b = (int)(row / ((i64)p.heads * p.rows));

  float* lse_at = p.lse + (i64)b * p.lse_batch_stride + (i64)head * p.lse_head_stride + r;
  float l_old = 0.f, l_new = 0.f;
  if (live) {
    l_old = *lse_at;
    l_new = p.part_lse[(i64)b * p.part_lse_batch_stride + (i64)head * p.part_lse_head_stride + r];
  }
  // Every thread of the block reads its row's running LSE before the row's first thread overwrites it
  // below: a row's threads span two warps at head_dim 256, and nothing orders warps but this barrier.
  __syncthreads();
  if (!live) return;

  // m: the larger LSE, or NaN when either is (l_new > l_old is false for a NaN l_new, which m then takes; a
  // NaN l_old passes to e_old below).
  const float m = l_new > l_old || l_new != l_new ? l_new : l_old;
  float w_old = 0.f, w_new = 0.f, l_star = m;
  if (m != neg_inf()) {  // both -inf: no key on either side, the row stays (0, -inf)
    // Precise expf/logf: the kernel is bound by memory, and s lies in [1, 2] where logf is exact to an ulp.
    const float e_old = expf(l_old - m), e_new = expf(l_new - m);
    const float s = e_old + e_new;
    l_star = m + logf(s);
    w_old = e_old / s;
    w_new = e_new / s;
  }
  float4* o = reinterpret_cast<float4*>(p.out + (i64)b * p.out_batch_stride + (i64)r * p.out_row_stride +
                                        (i64)head * p.out_head_stride + col);
  const float4 part = load_part4<kPart>(
      p.part, (i64)b * p.part_batch_stride + (i64)r * p.part_row_stride + (i64)head * p.part_head_stride + col);
  float4 acc = *o;
  acc.x = fmaf(w_new, part.x, w_old * acc.x);
  acc.y = fmaf(w_new, part.y, w_old * acc.y);
  acc.z = fmaf(w_new, part.z, w_old * acc.z);
  acc.w = fmaf(w_new, part.w, w_old * acc.w);
  *o = acc;
  if (col == 0) *lse_at = l_star;
}

}  // namespace fa
