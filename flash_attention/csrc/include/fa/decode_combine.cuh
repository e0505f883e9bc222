// The split-KV combine: each split of a row's keys left its normalised output O_s and its LSE l_s
// (fa/decode_params.h, o_partial / lse_partial); the row's answer is
//   lse = log sum_s exp(l_s),   O = sum_s exp(l_s - lse) O_s,
// the softmax over all keys regrouped by split. Splits that saw no key have l_s = -inf and weigh nothing;
// a row none of whose splits saw a key gets O = 0 and lse = -inf, like every row without keys. A poisoned
// split (NaN, fa/kv_cache.cuh) poisons the row. Shared by every decode kernel family.
//
// Two forms: the standalone combine kernel (the default), a thread per 4 columns of a row (kHeadDim / 4
// threads per row), rows in (batch, head, query) order so a block's rows share their splits' cache lines;
// or fused into the decode kernel (opt-in, DecodeParams::split_counters), where the last of a row block's
// splits to finish merges that block's rows: one launch per step instead of two (~5 us of host time), but
// one block does all of the row block's merging after every split has finished. Measured on an H100 it
// lost where that is a lot of work: seqlen_q 16 (64 packed rows) at batch 1 with 8k keys took 4.7x the
// one-token time against 1.4x with the combine kernel; see docs/kernel-log.md.
#pragma once

#include "fa/decode_params.h"
#include "fa/ptx.cuh"

namespace fa {

// Columns col .. col + 3 of output row `row` ((batch, head, query) order): the merge of its splits. The
// partials are read at L2 (ld.global.cg): in the fused form other blocks of the same kernel wrote them, and
// a line of them in this SM's L1 would not be coherent with those writes.
// kUnroll: split iterations issued together (4 in the combine kernel; 1 fused, where 4 made head_dim 256's
// decode kernel spill).
template <bool kIsBF16, int D, int kUnroll>
__device__ __forceinline__ void combine_row(const DecodeParams& p, int row, int col) {
  const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
  const int query = row % p.seqlen_q;
  const int head = (row / p.seqlen_q) % p.heads_q;
  const int batch = row / (p.seqlen_q * p.heads_q);

  // Pass 1: the max of the splits' LSEs (NaN-aware: fmaxf would drop a NaN).
  float m = neg_inf();
  bool poisoned = false;
  // (Unrolled: the splits' loads are independent, and issued together they overlap their L2 latency.)
#pragma unroll kUnroll
  for (int s = 0; s < p.num_splits; ++s) {
    const float l = __ldcg(p.lse_partial + s * rows + row);
    poisoned |= l != l;
    m = fmaxf(m, l);
  }
  const float m_use = m == neg_inf() ? 0.f : m;
  // Pass 2: the weights and the weighted outputs. A split whose LSE is -inf has weight 0 and its O_s
  // (zeros) is still read: no branch per split.
  float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll kUnroll
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = __expf(__ldcg(p.lse_partial + s * rows + row) - m_use);
    const float4 o = __ldcg(reinterpret_cast<const float4*>(p.o_partial + (s * rows + row) * D + col));
    sum += w;
    acc[0] += w * o.x;
    acc[1] += w * o.y;
    acc[2] += w * o.z;
    acc[3] += w * o.w;
  }
  const float nan = __int_as_float(0x7fffffff);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  float out[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = poisoned ? nan : acc[e] * inv;
  u16* dst = static_cast<u16*>(p.o) + (i64)batch * p.o_batch_stride + (i64)query * p.o_row_stride +
             (i64)head * p.o_head_stride + col;
  const u32 lo = pack2<kIsBF16>(out[0], out[1]), hi = pack2<kIsBF16>(out[2], out[3]);
  asm volatile("st.global.v2.u32 [%0], {%1, %2};\n" ::"l"(dst), "r"(lo), "r"(hi));
  if (col == 0 && p.lse) {
    const float lse = poisoned ? nan : (sum > 0.f ? m_use + logf(sum) : neg_inf());
    p.lse[(i64)batch * p.lse_batch_stride + (i64)head * p.lse_head_stride + query] = lse;
  }
}

// The standalone combine kernel's body (split_counters null).
template <bool kIsBF16, int D, int kThreads>
__device__ __forceinline__ void decode_combine_body(const DecodeParams& p) {
  constexpr int kPerRow = D / 4;
  constexpr int kRowsPerBlock = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0, "a block holds whole rows");
  const int row = (int)blockIdx.x * kRowsPerBlock + (int)threadIdx.x / kPerRow;
  const int col = 4 * ((int)threadIdx.x % kPerRow);
  const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
  if (row >= rows || col >= p.head_dim) return;
  combine_row<kIsBF16, D, 4>(p, row, col);
}

}  // namespace fa
