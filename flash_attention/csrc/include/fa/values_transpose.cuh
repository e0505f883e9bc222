// V laid out for the FP8 forward's O += P V (flash_attention/ops/fp8_values.py says why): V^T, (batch,
// heads_kv, head_dim, keys) contiguous, the keys rounded up to a multiple of 16 with zeros and each group of
// 16 in P's fragment order, from V (batch, seqlen_k, heads_kv, head_dim) of any batch, row and head strides.
// One pass over V's bytes: the PyTorch form it replaces (zeros, a copy, index_select, permute + contiguous)
// is three kernels and about 320 us at 16k tokens x 16 heads x 128 on an H200, where reading V once and
// writing V^T once (32 MB each) is 15-25 us of DRAM bandwidth. The bytes are moved, never converted, so any
// 1-byte element type takes it.
//
// A block takes a tile of 128 keys (8 groups of 16: one 128-byte line of each of the tile's V^T rows) by
// every head_dim column of one (batch, head); grid (ceil(keys / 128), heads_kv, batch).
//  1. Load: the tile's key rows into shared memory by cp.async, 16 bytes a copy, eight consecutive threads on
//     one key's 128 consecutive bytes (coalesced). A key at or past seqlen_k is copied with a source size of
//     0, which writes 16 zeros without reading: the padding, and the tile's keys past V^T's end, for free.
//  2. Transpose: a thread takes one 16-key group g by one 4-byte column word c (columns 4 c .. 4 c + 3): 16
//     shared loads of 32 bits (the group's keys), four 4x4 byte transposes (prmt) that give V^T rows
//     4 c .. 4 c + 3 their 16 bytes of the group with the keys in fragment order, and four 16-byte global
//     stores. The eight groups of a word are eight consecutive threads, so every store instruction of a warp
//     writes 128 consecutive bytes (a whole line) of each of four V^T rows.
//
// Shared-memory banks. A key's row is kHeadDim bytes, a whole number of 128-byte lines, so unswizzled every
// key's column word c sits in bank c % 32, and step 2's loads (a warp: 8 groups x the 4 words of one 16-byte
// chunk Q, at the same key k of each group, rows 16 g + k) would hit 4 banks 8 times each. The tile stores
// chunk q of its row r at chunk q ^ g of the row, g = r / 16 the row's group (values_tile_chunk): the eight
// groups then hold chunk Q at eight different chunk positions of a line, (Q ^ g) % 8, whose four words are
// four banks: 32 banks, one word each, one wavefront per load. Step 1's copies stay conflict-free (a quarter
// warp's eight 16-byte stores are one row's chunks q ^ g, q = 0..7 or 8..15: eight distinct 16-byte bank
// groups), and the swizzle moves whole 16-byte chunks, so the copies stay 16-byte aligned. Head_dim 64's row
// is half a line (four chunks): the chunk swizzle alone reaches only four 16-byte bank groups, so its rows
// also swap within their pair by the group's third bit (row 16 g + (k ^ (g / 4 % 2))): the eight groups then
// read chunk Q from eight different (half, chunk) positions of a line, again one wavefront per load.
#pragma once

#include "fa/ptx.cuh"
#include "fa/values_transpose_params.h"

namespace fa {

// The key (within its group of 16) at V^T's position p of the group: position 4 t + j is byte j of lane t's
// register of P's 8-bit A fragment, which acc_to_a_frag_e4m3 (fa/frag.cuh) packs from the accumulator's keys
// 2 t, 2 t + 1, 8 + 2 t and 9 + 2 t, in that order. ops/fp8_values.py's KEY_ORDER_16 is the same order, and
// the generated translation unit static_asserts the two equal (jit/sources.py).
__host__ __device__ constexpr int values_key_at(int p) { return 8 * (p % 4 / 2) + 2 * (p / 4) + p % 2; }

// Keys of a block's tile: eight groups, 128 bytes of each V^T row.
constexpr int kValuesTileKeys = 128;

// The 16-byte chunk of the tile where chunk q (columns 16 q .. 16 q + 15) of key k of the tile's group g
// lives (tile row 16 g + k; the bank swizzle of the header comment): the swizzle depends on the group only,
// so a group's rows are kHeadDim / 16 chunks apart whatever the column. Head_dim 64: rows 16 g + k and
// 16 g + (k ^ 1) trade places in every group with g / 4 odd (values_row_swap), the chunk swizzle mod 4.
template <int kHeadDim>
__device__ __forceinline__ u32 values_row_swap(u32 g) {
  return kHeadDim < 128 ? (g >> 2) & 1u : 0u;
}
template <int kHeadDim>
__device__ __forceinline__ u32 values_tile_chunk(u32 g, u32 k, u32 q) {
  if constexpr (kHeadDim < 128)
    return (16 * g + (k ^ values_row_swap<kHeadDim>(g))) * (kHeadDim / 16) + ((q ^ g) & (kHeadDim / 16 - 1));
  else
    return (16 * g + k) * (kHeadDim / 16) + (q ^ g);
}

// Four 4-byte words (keys a, b, c, d; byte i of each is column i) transposed: out[i] holds column i's bytes
// of a, b, c, d in its bytes 0..3. __byte_perm (PTX's prmt): selector nibble n picks the result's byte n
// from x's bytes 0-3 and y's 4-7; two rounds of four.
__device__ __forceinline__ void transpose_4x4_bytes(u32 (&out)[4], u32 a, u32 b, u32 c, u32 d) {
  // ab_lo = a0 b0 a1 b1, ab_hi = a2 b2 a3 b3, and the same of c and d.
  const u32 ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const u32 cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);  // a2 b2 c2 d2
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);  // a3 b3 c3 d3
}

// The host (flash_attention/ops/fp8_values.py) checks: head_dim == kHeadDim with its columns contiguous, V's
// address and strides multiples of 16, V^T contiguous and 16-byte aligned, keys = seqlen_k rounded up to 16.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void values_transpose_body(const ValuesTransposeParams& p) {
  static_assert(kHeadDim == 64 || kHeadDim % 128 == 0,
                "a key's row must be whole 128-byte lines, or half of one (the bank swizzle)");
  constexpr int kChunks = kHeadDim / 16;                         // 16-byte chunks of a key's row
  constexpr int kWords = kHeadDim / 4;                           // 4-byte column words of a key's row
  constexpr int kGroups = kValuesTileKeys / 16;                  // 16-key groups of the tile
  constexpr int kCopies = kValuesTileKeys * kChunks / kThreads;  // step 1's copies per thread
  // Step 2's (group, word) items per thread; at head_dim 64 there are 128, so half of 256 threads idle there.
  constexpr int kItems = (kGroups * kWords + kThreads - 1) / kThreads;
  static_assert(kCopies * kThreads == kValuesTileKeys * kChunks, "kThreads must divide the tile's chunks");
  static_assert(kThreads % 32 == 0, "whole warps: the bank argument is per warp");
  __shared__ __align__(128) uint4 tile[kValuesTileKeys * kChunks];  // 16 KB at head_dim 128

  const int tile0 = blockIdx.x * kValuesTileKeys;
  const int head = blockIdx.y, batch = blockIdx.z;
  const unsigned char* v =
      static_cast<const unsigned char*>(p.v) + batch * p.v_batch_stride + head * p.v_head_stride;

  // 1. Every copy is issued before the first wait: a thread has kCopies in flight. (Unsigned index
  // arithmetic here and below: the divisions by powers of two are then shifts.)
#pragma unroll
  for (int j = 0; j < kCopies; ++j) {
    const u32 i = threadIdx.x + j * kThreads;
    const u32 r = i / kChunks, q = i % kChunks;  // the tile's key row, its 16-byte chunk
    const int key = tile0 + (int)r;
    const bool real = key < p.seqlen_k;
    cp_async_16(smem_addr(tile + values_tile_chunk<kHeadDim>(r / 16, r % 16, q)),
                v + (real ? key * p.v_row_stride + 16 * q : 0), real ? 16 : 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // 2. V^T row d of this (batch, head) starts at byte d * keys; the group's 16 bytes at key0.
  unsigned char* vt =
      static_cast<unsigned char*>(p.vt) + ((i64)batch * p.heads_kv + head) * kHeadDim * p.keys;
  const u32* words = reinterpret_cast<const u32*>(tile);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const u32 i = threadIdx.x + j * kThreads;
    if (kGroups * kWords % kThreads != 0 && i >= (u32)(kGroups * kWords)) continue;  // (head_dim 64)
    const u32 g = i % kGroups, c = i / kGroups;  // the group, the column word
    const int key0 = tile0 + 16 * (int)g;
    if (key0 >= p.keys) continue;  // past V^T's end (the last tile only)
    // w[k]: columns 4 c .. 4 c + 3 of the group's key k, in tile row 16 g + (k ^ swap) (swap 0 but at head_dim
    // 64, values_row_swap): one address, that of the group's first tile row, and sixteen offsets of whole
    // rows.
    const u32 swap = values_row_swap<kHeadDim>(g);
    const u32 at = smem_addr(words + 4 * values_tile_chunk<kHeadDim>(g, swap, c / 4) + c % 4);
    u32 w[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) w[k] = ld_shared_32(at + (k ^ swap) * kHeadDim);
    u32 rows[4][4];  // rows[ii][t]: V^T row 4 c + ii, the group's positions 4 t .. 4 t + 3
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      u32 col[4];
      transpose_4x4_bytes(col, w[values_key_at(4 * t)], w[values_key_at(4 * t + 1)],
                          w[values_key_at(4 * t + 2)], w[values_key_at(4 * t + 3)]);
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) rows[ii][t] = col[ii];
    }
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      st_global_16(vt + (i64)(4 * c + ii) * p.keys + key0,
                   make_uint4(rows[ii][0], rows[ii][1], rows[ii][2], rows[ii][3]));
    }
  }
}

}  // namespace fa
