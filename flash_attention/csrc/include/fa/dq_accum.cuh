// The fp32 dQ workspace of the atomic backward: zeroed by the preprocessing kernel, accumulated into by the
// dK/dV kernel (red.global.add, or bulk reduce-adds in the warp-specialized kernel), and cast into q's layout
// and dtype by the convert kernel below.
//
// Both ends used to be PyTorch ops (a fill before the backward and a strided copy after it): two more
// launches through PyTorch's dispatcher per backward, which on the host cost more than the preprocessing
// and convert kernels take on the GPU for short sequences (docs/kernel-log.md, step 23).
#pragma once

#include "fa/bwd_params.h"
#include "fa/ptx.cuh"
#include "fa/tile_ptrs.cuh"

namespace fa {

// Zero workspace row `idx`'s kHeadDim floats of the row-major layout with the eight lanes that share a row in
// the preprocessing kernel: lane l writes 16-byte vectors l, l + 8, ..., so the eight lanes together cover
// 128 contiguous bytes per step. Every row of the padded workspace is zeroed, so in the tiled layout below,
// which only permutes floats within 64-row blocks, the whole accumulator is zeroed all the same.
template <int kHeadDim>
__device__ __forceinline__ void zero_dq_accum_row(float* dq_accum, i64 idx, int lane8) {
  float4* row = reinterpret_cast<float4*>(dq_accum + idx * kHeadDim);
#pragma unroll
  for (int c = lane8; c < kHeadDim / 4; c += 8) row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// Where column `col` of workspace row `ws_row` (fa/tile_ptrs.cuh, workspace_row) lives in the accumulator.
// Row-major (kTiled false): rows of kHeadDim floats, what the sm80 and wgmma kernels add into one pair at a
// time. Tiled (the warp-specialized backward and the wide one, csrc/kernels/sm90/bwd_wide, which add dQ in
// 64 x 64 parts with bulk reduce-adds, and a bulk copy needs a contiguous source and destination): each 64-row block of rows is
// kHeadDim / 64 tiles of 64 x 64 floats, one after the other, 16 KB each; inside a tile, 16-byte chunk c of
// row r sits at chunk c ^ (r % 8) of the row (the XOR stays within the row's 128-byte half). The swizzle is
// the staging tile's in shared memory, where it keeps the eight rows a warp writes at once in different
// banks (unswizzled, 256-byte rows put them all in the same ones: an 8-way conflict). Blocks start at
// multiples of 64 rows: seqlen_q_pad is a multiple of 128.
template <int kHeadDim, bool kTiled>
__device__ __forceinline__ i64 dq_accum_offset(i64 ws_row, int col) {
  if constexpr (!kTiled) {
    return ws_row * kHeadDim + col;
  } else {
    const int r = (int)(ws_row % 64);
    return (ws_row - r) * kHeadDim + (col / 64) * 4096 + r * 64 + (((col % 64) / 4) ^ (r % 8)) * 4 + col % 4;
  }
}

// One warpgroup's dQ part of 64 query rows x N columns (N / 2 registers of the wgmma accumulator, register
// 4 n + e: row 16 (warp % 4) + g + 8 (e / 2), column 8 n + 2 t + e % 2) staged in the tiled layout above as
// N / 64 tiles of 64 x 64 floats, tile i at stage[i], for one bulk reduce-add each. In tile n / 8 the pair
// is 16-byte chunk 2 (n % 8) + t / 2 of its row, swizzled by the row's low three bits, which are g.
template <int N, int kTiles>
__device__ __forceinline__ void stage_dq_tiles(const u32 (&stage)[kTiles], const float (&dq)[N / 2],
                                               int warp_in_wg, int g, int t) {
  static_assert(N % 64 == 0 && N / 64 <= kTiles, "whole 64-column tiles, one address each");
  const u32 row_off = (16 * warp_in_wg + g) * 256 + 8 * (t % 2);
  const int chunk_bit = (t / 2) ^ g;
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      st_shared_f32x2(stage[n / 8] + row_off + r * 8 * 256 + (((2 * (n % 8)) ^ chunk_bit) << 4),
                      dq[4 * n + 2 * r], dq[4 * n + 2 * r + 1]);
}

// The deterministic warp-specialized backward's workspace (p.dq_lanes 1 or 2, fa/dq_turns.cuh): dq_lanes
// accumulators of the layout above, one after the other (lane 1 holds the additions of the wrapped walks),
// then four int semaphores per (batch, head, 64-row unit of the padded query rows): (lane, consumer
// warpgroup). A semaphore counts the blocks whose part of that dQ tile has been added.
__device__ __forceinline__ i64 dq_lane_floats(const BwdParams& p, int head_dim) {
  return (i64)p.batch * p.heads_q * p.seqlen_q_pad * head_dim;
}

template <int kHeadDim>
__device__ __forceinline__ float* dq_lane(const BwdParams& p, int lane) {
  return p.dq_accum + lane * dq_lane_floats(p, kHeadDim);
}

template <int kHeadDim>
__device__ __forceinline__ int* dq_semaphore(const BwdParams& p, int batch, int head, int q_start, int lane,
                                             int wg) {
  int* const base = reinterpret_cast<int*>(p.dq_accum + p.dq_lanes * dq_lane_floats(p, kHeadDim));
  return base + ((workspace_row(p, batch, head, 0) / 64 + q_start / 64) * 4 + 2 * lane + wg);
}

// dQ = the workspace rows of (batch, head), cast to 16 bits and stored in q's layout. 128 threads, 64 query
// rows per block, grid (ceil(seqlen_q / 64), heads_q, batch): block x casts workspace unit x into packed
// rows [64 x, 64 x + 64); with a packed batch's unit table (p.q_units, fa/bwd_params.h) the grid is
// (seqlen_q_pad / 64, ..) and unit x holds rows [start, start + count). A thread converts 8 columns at a
// time (two 16-byte loads, one 16-byte store); the threads of a row are consecutive, so loads and stores
// coalesce.
template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq_body(const BwdParams& p) {
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int C = D / 8;  // 8-column chunks per row
  constexpr int kRows = 64;
  constexpr int kThreads = 128;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const i64 ws_row0 = workspace_row(p, batch, head, blockIdx.x * kRows);
  int row0 = blockIdx.x * kRows, rows = p.seqlen_q - row0;  // the unit's packed rows
  if (p.q_units != nullptr) {
    row0 = __ldg(p.q_units + 2 * blockIdx.x);
    rows = min(__ldg(p.q_units + 2 * blockIdx.x + 1), p.seqlen_q - row0);
  }
  u16* dq = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * C; idx += kThreads) {
    const int r = idx / C, c = idx % C;
    const int row = row0 + r;
    if (r >= rows || c * 8 >= p.head_dim) continue;
    // Two 16-byte chunks; tiled, their order in the row may be swapped.
    constexpr bool kTiled = Cfg::kTiledDq;
    const i64 ia = dq_accum_offset<D, kTiled>(ws_row0 + r, c * 8);
    const i64 ib = dq_accum_offset<D, kTiled>(ws_row0 + r, c * 8 + 4);
    float4 a = *reinterpret_cast<const float4*>(p.dq_accum + ia);
    float4 b = *reinterpret_cast<const float4*>(p.dq_accum + ib);
    if (p.dq_lanes == 2) {
      // The deterministic backward's second lane, added after the first (fa/dq_turns.cuh).
      const float* lane1 = dq_lane<D>(p, 1);
      const float4 a1 = *reinterpret_cast<const float4*>(lane1 + ia);
      const float4 b1 = *reinterpret_cast<const float4*>(lane1 + ib);
      a = make_float4(a.x + a1.x, a.y + a1.y, a.z + a1.z, a.w + a1.w);
      b = make_float4(b.x + b1.x, b.y + b1.y, b.z + b1.z, b.w + b1.w);
    }
    const uint4 v =
        make_uint4(pack2<BF>(a.x, a.y), pack2<BF>(a.z, a.w), pack2<BF>(b.x, b.y), pack2<BF>(b.z, b.w));
    st_global_16(dq + (i64)row * p.dq_row_stride + c * 8, v);
  }
}

}  // namespace fa
