// The fp32 dQ workspace of the atomic backward: zeroed by the preprocessing kernel, accumulated into by the
// dK/dV kernel (red.global.add), and cast into q's layout and dtype by the convert kernel below.
//
// Both ends used to be PyTorch ops (a fill before the backward and a strided copy after it): two more
// launches through PyTorch's dispatcher per backward, which on the host cost more than the preprocessing
// and convert kernels take on the GPU for short sequences (docs/kernel-log.md, step 23).
#pragma once

#include "fa/bwd_params.h"
#include "fa/ptx.cuh"
#include "fa/tile_ptrs.cuh"

namespace fa {

// Zero workspace row `idx` (kHeadDim floats) with the eight lanes that share a row in the preprocessing
// kernel: lane l writes 16-byte vectors l, l + 8, ..., so the eight lanes together cover 128 contiguous
// bytes per step.
template <int kHeadDim>
__device__ __forceinline__ void zero_dq_accum_row(float* dq_accum, i64 idx, int lane8) {
  float4* row = reinterpret_cast<float4*>(dq_accum + idx * kHeadDim);
#pragma unroll
  for (int c = lane8; c < kHeadDim / 4; c += 8) row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dQ = the workspace rows of (batch, head), cast to 16 bits and stored in q's layout. 128 threads, 64 query
// rows per block, grid (ceil(seqlen_q / 64), heads_q, batch). A thread converts 8 columns at a time (two
// 16-byte loads, one 16-byte store); the threads of a row are consecutive, so loads and stores coalesce.
template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq_body(const BwdParams& p) {
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int C = D / 8;  // 8-column chunks per row
  constexpr int kRows = 64;
  constexpr int kThreads = 128;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int row0 = blockIdx.x * kRows;
  const i64 ws_row0 = workspace_row(p, batch, head, row0);
  u16* dq = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * C; idx += kThreads) {
    const int r = idx / C, c = idx % C;
    const int row = row0 + r;
    if (row >= p.seqlen_q || c * 8 >= p.head_dim) continue;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + (ws_row0 + r) * D + c * 8);
    const float4 a = src[0], b = src[1];
    const uint4 v = make_uint4(pack2<BF>(a.x, a.y), pack2<BF>(a.z, a.w), pack2<BF>(b.x, b.y), pack2<BF>(b.z, b.w));
    st_global_16(dq + (i64)row * p.dq_row_stride + c * 8, v);
  }
}

}  // namespace fa
