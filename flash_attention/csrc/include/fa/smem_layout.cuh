// Where a tile's elements live in shared memory: the sm80 kernels' row-major tiles (optionally
// XOR-swizzled) with the ldmatrix addresses into them, and the Hopper kernels' 64-column panels with the
// 128-byte swizzle that wgmma undoes itself. Every tile is addressed by (row, 16-byte chunk of the row).
#pragma once

#include "fa/ptx.cuh"

namespace fa {

// Element offset of 16-byte chunk `chunk` of row `row` in a shared-memory tile with rows of D elements.
// Swizzled: the chunk index is XORed with the row's low three bits, so the eight rows an ldmatrix phase
// reads at one logical chunk land in eight different 16-byte bank groups (D is a multiple of 64, so each
// row holds whole groups of eight chunks and the XOR never leaves the group). Unswizzled, those eight
// reads hit the same banks (row pitch is a multiple of 128 bytes): an 8-way conflict.
template <int D, bool kSwizzle>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  return row * D + (kSwizzle ? (chunk ^ (row & 7)) : chunk) * 8;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in an R-row tile of 64-column panels (128-byte rows),
// 128-byte swizzle: chunk c of row r sits at chunk c ^ (r % 8) of its row, the pattern wgmma's descriptors
// name (fa/wgmma.cuh). Panel p of the tile starts R * 128 bytes after panel p - 1.
template <int R>
__device__ __forceinline__ u32 panel_offset(int row, int chunk) {
  return (u32)((chunk >> 3) * (R * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// The two layouts as types, for code that is written once for both (fa/copy.cuh, fa/epilogue.cuh):
// `bytes(row, chunk)` is the byte offset of a 16-byte chunk from the tile's start.
template <int D, bool kSwizzle>
struct RowMajorTile {
  static __device__ __forceinline__ int bytes(int row, int chunk) {
    return 2 * tile_offset<D, kSwizzle>(row, chunk);
  }
};

template <int R>
struct PanelTile {
  static __device__ __forceinline__ u32 bytes(int row, int chunk) { return panel_offset<R>(row, chunk); }
};

// Shared-memory byte addresses of the 16x16 fragments one ldmatrix.x4 reads from a RowMajorTile, for one
// lane.
//
// The lane reads row `row0 + lane_row` (row0 a multiple of 8, so the row's low three bits are the lane's
// own) at 16-byte chunk 2 i + b, where b is the lane's half of the chunk pair. Swizzled, the physical chunk
// is (2 i + b) ^ (row & 7) = 8 (i / 4) + ((2 (i % 4) + b) ^ (lane_row & 7)): only four distinct per-lane
// values, precomputed here, plus a compile-time offset. Without this the compiler hoists one address
// register per (row, chunk) fragment out of the main loop -- dozens of registers, and spills
// (docs/kernel-log.md, step 2).
template <int D, bool kSwizzle>
struct FragAddr {
  u32 base[4];
  __device__ __forceinline__ FragAddr(u32 tile, int lane_row, int b) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
      base[c] = tile + 2 * D * lane_row + 16 * (kSwizzle ? ((2 * c + b) ^ (lane_row & 7)) : (2 * c + b));
  }
  __device__ __forceinline__ u32 operator()(int row0, int i) const {
    return base[i % 4] + 2 * D * row0 + 128 * (i / 4);
  }
};

}  // namespace fa
