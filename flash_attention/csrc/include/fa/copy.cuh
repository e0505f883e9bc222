// Global -> shared copies of whole tiles, written once for every kernel and both shared-memory layouts.
#pragma once

#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"

namespace fa {

// Copy a tile of R rows x D elements from global memory (rows `row_stride` elements apart) into shared
// memory at `s_tile`, laid out by `Layout` (fa/smem_layout.cuh: RowMajorTile or PanelTile), by the block's
// kThreads threads. Rows at or past `rows_valid` and chunks at or past `head_dim` are zero-filled: zero K
// rows give scores that are masked anyway, zero V rows keep NaN-free products with the masked (zero)
// probabilities, and zero head_dim columns add nothing to Q K^T. kAsync: cp.async (the caller commits and
// waits); otherwise plain 16-byte loads and shared stores through registers.
template <int R, int D, int kThreads, class Layout, bool kAsync>
__device__ __forceinline__ void load_tile(u32 s_tile, const u16* g, i64 row_stride, int rows_valid,
                                          int head_dim, int tid) {
  constexpr int C = D / 8;
  constexpr int kTotal = R * C;
  // When the block's threads cover whole rows (kNested), thread tid copies chunk tid % C of rows tid / C,
  // tid / C + kRowStep, ...: consecutive threads read consecutive 16-byte chunks of a row (coalesced) and
  // the source pointer advances by a fixed step. Otherwise (head_dim 192 with 8 warps) each copy's
  // coordinates are computed afresh.
  constexpr bool kNested = kThreads % C == 0;
  constexpr int kRowStep = kNested ? kThreads / C : 1;
  const int chunk0 = tid % C;
  const int row0 = tid / C;
  const bool col_ok = chunk0 * 8 < head_dim;
  // (unsigned) row0: a zero-extended 64-bit product needs no register for its high half, which is what
  // keeps the causal 128x64 head_dim-128 forward tile spill-free (docs/kernel-log.md, step 5).
  const u16* src = g + (i64)(unsigned)row0 * row_stride + chunk0 * 8;
  const i64 step = kRowStep * row_stride;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    if (kTotal % kThreads != 0 && tid + i * kThreads >= kTotal) break;
    const int row = kNested ? row0 + i * kRowStep : (tid + i * kThreads) / C;
    const int chunk = kNested ? chunk0 : (tid + i * kThreads) % C;
    const bool ok = row < rows_valid && (kNested ? col_ok : chunk * 8 < head_dim);
    const u16* p = kNested ? src + i * step : g + row * row_stride + chunk * 8;
    const u32 dst = s_tile + Layout::bytes(row, chunk);
    if constexpr (kAsync) {
      cp_async_16(dst, ok ? p : g, ok ? 16 : 0);
    } else {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (ok) v = ld_global_16(p);
      st_shared_16(dst, v);
    }
  }
}

// load_tile's cp.async form for a warp-specialized producer, which copies on a budget of a few dozen
// registers (setmaxnreg): the same tile, layout and zero-fill, but the row loop is not unrolled and the
// source pointer advances by one row step per copy, so it holds one 64-bit address instead of one per row
// (load_tile unrolled made ptxas spill 100-400 bytes in a 40-register producer). kThreads must cover whole
// rows (rows of 8, 16 or 32 chunks for 64 or 128 threads; load_panel_tile_rolled below takes the others).
template <int R, int D, int kThreads, class Layout>
__device__ __forceinline__ void load_tile_rolled(u32 s_tile, const u16* g, i64 row_stride, int rows_valid,
                                                 int head_dim, int tid) {
  constexpr int C = D / 8;
  static_assert(kThreads % C == 0 && R % (kThreads / C) == 0, "threads cover whole rows of the tile");
  constexpr int kRowStep = kThreads / C;
  const int chunk = tid % C;
  const bool col_ok = chunk * 8 < head_dim;
  int row = tid / C;
  const u16* src = g + (i64)(unsigned)row * row_stride + chunk * 8;
  const i64 step = kRowStep * row_stride;
#pragma unroll 1
  for (; row < R; row += kRowStep, src += step) {
    const bool ok = col_ok && row < rows_valid;
    cp_async_16(s_tile + Layout::bytes(row, chunk), ok ? src : g, ok ? 16 : 0);
  }
}

// load_tile_rolled into a PanelTile<R> of any head_dim: where the threads cover whole rows, that load;
// where they do not (head_dim 192: 24 chunks per row, 128 threads), one 64-column panel after the other,
// each a D = 64 tile the threads do cover, `head_dim` taken per panel (a panel past it is zero-filled).
template <int R, int D, int kThreads>
__device__ __forceinline__ void load_panel_tile_rolled(u32 s_tile, const u16* g, i64 row_stride,
                                                       int rows_valid, int head_dim, int tid) {
  static_assert(D % 64 == 0, "whole 64-column panels");
  if constexpr (kThreads % (D / 8) == 0) {
    load_tile_rolled<R, D, kThreads, PanelTile<R>>(s_tile, g, row_stride, rows_valid, head_dim, tid);
  } else {
#pragma unroll 1
    for (int c = 0; c < D / 64; ++c)
      load_tile_rolled<R, 64, kThreads, PanelTile<R>>(s_tile + c * R * 128, g + 64 * c, row_stride,
                                                      rows_valid, head_dim - 64 * c, tid);
  }
}

}  // namespace fa
