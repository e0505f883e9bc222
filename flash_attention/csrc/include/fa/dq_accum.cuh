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
// time. Tiled (the Hopper backwards, csrc/kernels/sm90/bwd_ws, bwd_wide and bwd_wide_ws, which add dQ in
// 64 x 64 parts with bulk reduce-adds, and a bulk copy needs a contiguous source and destination): each
// 64-row block of rows is kHeadDim / 64 tiles of 64 x 64 floats, one after the other, 16 KB each, and a tile
// is in the register order of the warpgroup that computed it (a wgmma m64nN accumulator, fa/frag.cuh):
// thread u = 32 w + 4 g + t's registers 4 n + e of the tile's n-tile n (8 columns) are the 16-byte chunk
// n * 128 + u, i.e. rows 16 w + g (e = 0, 1) and 16 w + g + 8 (e = 2, 3), columns 8 n + 2 t + e % 2. Each
// thread stages its part with one 16-byte store per n-tile, consecutive threads to consecutive chunks (no
// bank conflict and no swizzle arithmetic: kernel log 127); the convert kernel below undoes the order. Blocks
// start at multiples of 64 rows: seqlen_q_pad is a multiple of 128.
template <int kHeadDim, bool kTiled>
__device__ __forceinline__ i64 dq_accum_offset(i64 ws_row, int col) {
  if constexpr (!kTiled) {
    return ws_row * kHeadDim + col;
  } else {
    const int r = (int)(ws_row % 64), c = col % 64;
    const int u = 32 * (r / 16) + 4 * (r % 8) + (c % 8) / 2;
    return (ws_row - r) * kHeadDim + (col / 64) * 4096 + ((c / 8) * 128 + u) * 4 + 2 * ((r / 8) % 2) + c % 2;
  }
}

// One warpgroup's dQ part of 64 query rows x N columns (N / 2 registers of the wgmma accumulator) staged in
// the tiled layout above in pieces of kPiece n-tiles (8 columns each), piece i at stage[i], for one bulk
// reduce-add each: n-tile n's four registers are one 16-byte store, chunk (n % kPiece) * 128 + u of piece
// n / kPiece (u: the thread's index in its warpgroup). A piece of 8 n-tiles is a whole 64 x 64 tile (16 KB);
// one of 4 is half a tile (8 KB), contiguous in the tiled layout too (n-tiles 4 h .. 4 h + 3 of a tile are
// its chunks 512 h .. 512 h + 511), for a kernel whose free shared memory comes in pieces smaller than a
// tile (bwd_wide_ws at head_dim 192).
template <int N, int kPiece, int kPieces>
__device__ __forceinline__ void stage_dq_pieces(const u32 (&stage)[kPieces], const float (&dq)[N / 2],
                                                int u) {
  static_assert(N % (8 * kPiece) == 0 && N / (8 * kPiece) <= kPieces, "whole pieces, one address each");
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
    st_shared_16(stage[n / kPiece] + (u32)((n % kPiece) * 128 + u) * 16,
                 make_uint4(__float_as_uint(dq[4 * n]), __float_as_uint(dq[4 * n + 1]),
                            __float_as_uint(dq[4 * n + 2]), __float_as_uint(dq[4 * n + 3])));
}

// In whole tiles (N / 64 of them), or in half tiles (N / 32).
template <int N, int kTiles>
__device__ __forceinline__ void stage_dq_tiles(const u32 (&stage)[kTiles], const float (&dq)[N / 2], int u) {
  stage_dq_pieces<N, 8>(stage, dq, u);
}
template <int N>
__device__ __forceinline__ void stage_dq_halves(const u32 (&stage)[N / 32], const float (&dq)[N / 2], int u) {
  stage_dq_pieces<N, 4>(stage, dq, u);
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
// (seqlen_q_pad / 64, ..) and unit x holds rows [start, start + count). Row-major workspace: a thread
// converts 8 columns at a time (two 16-byte loads, one 16-byte store); the threads of a row are consecutive,
// so loads and stores coalesce. Tiled: a thread converts one group of a tile, the 64 contiguous bytes of
// n-tile n of the four threads 32 w + 4 g + (0..3) (rows 16 w + g and + 8, columns 8 n .. 8 n + 7), into two
// 16-byte stores; consecutive threads take consecutive n, so each warp writes whole 128-byte row pieces
// and reads 64-byte pieces (two full sectors each).
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
  const float* lane1 = p.dq_lanes == 2 ? dq_lane<D>(p, 1) : nullptr;  // (deterministic: fa/dq_turns.cuh)
  if constexpr (Cfg::kTiledDq) {
    // Group idx: tile i, warp w, row g of the 8, n-tile n (fastest).
#pragma unroll 1
    for (int idx = threadIdx.x; idx < kRows * C / 2; idx += kThreads) {
      const int n = idx % 8, g = (idx / 8) % 8, w = (idx / 64) % 4, i = idx / 256;
      const int r = 16 * w + g, col = 64 * i + 8 * n;
      if (col >= p.head_dim) continue;
      const i64 at = ws_row0 * D + i * 4096 + ((n * 128 + 32 * w + 4 * g) * 4);
      float f[16];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float4 x = *reinterpret_cast<const float4*>(p.dq_accum + at + 4 * j);
        if (lane1 != nullptr) {
          // The deterministic backward's second lane, added after the first.
          const float4 y = *reinterpret_cast<const float4*>(lane1 + at + 4 * j);
          x = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
        }
        f[4 * j] = x.x, f[4 * j + 1] = x.y, f[4 * j + 2] = x.z, f[4 * j + 3] = x.w;
      }
      // Thread t's floats 4 t + e: row r + 8 (e / 2), column col + 2 t + e % 2.
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r + 8 * h < rows)
          st_global_16(dq + (i64)(row0 + r + 8 * h) * p.dq_row_stride + col,
                       make_uint4(pack2<BF>(f[2 * h], f[2 * h + 1]), pack2<BF>(f[4 + 2 * h], f[5 + 2 * h]),
                                  pack2<BF>(f[8 + 2 * h], f[9 + 2 * h]), pack2<BF>(f[12 + 2 * h], f[13 + 2 * h])));
    }
  } else {
#pragma unroll 1
    for (int idx = threadIdx.x; idx < kRows * C; idx += kThreads) {
      const int r = idx / C, c = idx % C;
      const int row = row0 + r;
      if (r >= rows || c * 8 >= p.head_dim) continue;
      const i64 ia = ws_row0 * D + r * D + c * 8;
      float4 a = *reinterpret_cast<const float4*>(p.dq_accum + ia);
      float4 b = *reinterpret_cast<const float4*>(p.dq_accum + ia + 4);
      if (lane1 != nullptr) {
        const float4 a1 = *reinterpret_cast<const float4*>(lane1 + ia);
        const float4 b1 = *reinterpret_cast<const float4*>(lane1 + ia + 4);
        a = make_float4(a.x + a1.x, a.y + a1.y, a.z + a1.z, a.w + a1.w);
        b = make_float4(b.x + b1.x, b.y + b1.y, b.z + b1.z, b.w + b1.w);
      }
      const uint4 v =
          make_uint4(pack2<BF>(a.x, a.y), pack2<BF>(a.z, a.w), pack2<BF>(b.x, b.y), pack2<BF>(b.z, b.w));
      st_global_16(dq + (i64)row * p.dq_row_stride + c * 8, v);
    }
  }
}

}  // namespace fa
