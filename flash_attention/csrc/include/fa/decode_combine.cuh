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
// kUnroll: split iterations issued together (8 in the combine kernel; 1 fused, where 4 made head_dim 256's
// decode kernel spill).
template <bool kIsBF16, int D, int kUnroll>
__device__ __forceinline__ void combine_row(const DecodeParams& p, int row, int col) {
  const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
  const int query = row % p.seqlen_q;
  const int head = (row / p.seqlen_q) % p.heads_q;
  const int batch = row / (p.seqlen_q * p.heads_q);

  // One pass, the running max carried as the online softmax carries it, over groups of kUnroll splits whose
  // LSEs and O_s are all loaded before any is used: the row then costs about num_splits / kUnroll L2 round
  // trips. (The first form read every LSE for the max, then every LSE and O_s again, and the compiler
  // interleaved each load with the math of the one before: at one token per row, a chain of L2 latencies
  // was most of this kernel's time.) A split whose LSE is -inf weighs 0. A NaN LSE (a poisoned row) never
  // raises the max; the flag makes the row NaN at the end.
  float m = neg_inf(), sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  bool poisoned = false;
  for (int s0 = 0; s0 < p.num_splits; s0 += kUnroll) {
    float l[kUnroll];
    float4 o[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int s = s0 + j;
      const bool live = s < p.num_splits;
      l[j] = live ? __ldcg(p.lse_partial + s * rows + row) : neg_inf();
      o[j] = live ? __ldcg(reinterpret_cast<const float4*>(p.o_partial + (s * rows + row) * D + col))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      poisoned |= l[j] != l[j];
      if (l[j] > m) {  // rescale what is summed so far to the new max (exp(-inf) = 0 while nothing is)
        const float scale = __expf(m - l[j]);
        sum *= scale;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] *= scale;
        m = l[j];
      }
      const float w = l[j] == neg_inf() ? 0.f : __expf(l[j] - m);  // (-inf - -inf would be NaN)
      sum += w;
      acc[0] += w * o[j].x;
      acc[1] += w * o[j].y;
      acc[2] += w * o[j].z;
      acc[3] += w * o[j].w;
    }
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
    const float lse = poisoned ? nan : (sum > 0.f ? m + logf(sum) : neg_inf());
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
  combine_row<kIsBF16, D, 8>(p, row, col);
}

}  // namespace fa
