// The steps of one query step that both Hopper backward kernels (csrc/kernels/sm90/bwd: cp.async, and
// csrc/kernels/sm90/bwd_ws: warp-specialized) run the same way on a warpgroup's 64 keys: the five matrix
// products of the transposed chain, the packing of P^T and dS^T into A fragments, dS^T's store for dQ, and
// the dK/dV epilogue, from registers or staged through shared memory (the wide-head-dim kernels,
// csrc/kernels/sm90/bwd_wide and bwd_wide_ws, use some of them too). kPlainAdd: desc_advance's form for
// the descriptors (fa/wgmma.cuh).
//
// Operand layouts (csrc/kernels/sm90/bwd/bwd_kernel.cuh says more): tiles in shared memory as 64-column
// panels of 128-byte rows with the 128-byte swizzle (fa/smem_layout.cuh, PanelTile); K, V, Q and dO read
// K-major for S^T and dP^T, Q and dO MN-major for dK and dV, dS^T and K both transposed for dQ. The callers
// bracket the products with wgmma_fence / wgmma_commit and wait for them themselves: when they wait is what
// their schedules differ in.
#pragma once

#include "fa/bwd_params.h"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/wgmma.cuh"

namespace fa {

// How the two computing warpgroups share a query step's dQ = dS K, each a 64 x kCols part so neither idles:
// with 128 query rows (head_dim 64) warpgroup c takes rows [64 c, 64 c + 64) and every column; with 64 rows
// (head_dim 128) it takes all rows and columns [64 c, 64 c + 64). Part c starts at row kRow * c, column
// kCol * c.
template <int BR, int D>
struct DqSplit {
  static_assert((BR == 128 && D == 64) || (BR == 64 && D == 128), "dQ split between the warpgroups");
  static constexpr int kCols = BR == 128 ? D : D / 2;
  static constexpr int kRow = BR == 128 ? 64 : 0;
  static constexpr int kCol = BR == 128 ? 0 : D / 2;
};

// acc (64 keys x BR queries) = A B^T over head_dim D, A the warpgroup's 64 rows of K or V (a_desc) and B a
// Q or dO tile (b_desc, starting b_off bytes in): S^T = K Q^T and dP^T = V dO^T. D / 16 k-steps of 16
// columns, 32 bytes along a row, every fourth starting the next panel (BC * 128 bytes on in K's and V's
// tiles, BR * 128 in Q's and dO's).
template <int BR, int BC, int D, bool BF, bool kPlainAdd = false>
__device__ __forceinline__ void issue_key_rows_product(float (&acc)[BR / 2], u64 a_desc, u64 b_desc,
                                                       u32 b_off) {
  // (The step's offset once, the k-steps' constants after it: advanced together, (b_off + c) >> 4 cost a
  // shift and an add per wgmma.)
  const u64 b_step = desc_advance<kPlainAdd>(b_desc, b_off);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u32 a_off = (kk / 4) * BC * 128 + (kk % 4) * 32;
    const u32 b_k = (kk / 4) * BR * 128 + (kk % 4) * 32;
    Wgmma<BR, BF>::ss(acc, desc_advance<kPlainAdd>(a_desc, a_off), desc_advance<kPlainAdd>(b_step, b_k),
                      kk > 0);
  }
}

// Register pairs (2 i, 2 i + 1) of the 64 x BR accumulators P^T and dS^T packed to 16 bits: k-step ks's
// A fragments of dV += P^T dO and dK += dS^T Q are pairs 4 ks .. 4 ks + 3.
template <int BR, bool BF>
__device__ __forceinline__ void pack_p_ds(u32 (&pf)[BR / 16][4], u32 (&sf)[BR / 16][4],
                                          const float (&p)[BR / 2], const float (&ds)[BR / 2]) {
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      pf[ks][r] = pack2<BF>(p[8 * ks + 2 * r], p[8 * ks + 2 * r + 1]);
      sf[ks][r] = pack2<BF>(ds[8 * ks + 2 * r], ds[8 * ks + 2 * r + 1]);
    }
}

// One of them alone (pack_p_ds's layout), for a kernel that packs P before dP^T has landed.
template <int BR, bool BF>
__device__ __forceinline__ void pack_acc(u32 (&f)[BR / 16][4], const float (&x)[BR / 2]) {
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) f[ks][r] = pack2<BF>(x[8 * ks + 2 * r], x[8 * ks + 2 * r + 1]);
}

// dS^T into its tile (BC key rows of BR queries, panels of 64 queries) for dQ: register pair r of k-step ks
// is key row g + 8 (r % 2) of the warp (its first row row0, a multiple of 16) at queries 16 ks + 8 (r / 2)
// + 2 t (+1), i.e. 16-byte chunk 2 ks + r / 2 of the key's row: the four 8x8 pieces of one stmatrix_x4,
// piece r. Lane l addresses row l % 8 of piece l / 8 (key row row0 + l % 8 + 8 ((l / 8) % 2), chunk 2 ks +
// l / 16), whose swizzled chunk (fa/smem_layout.cuh) depends on ks only through ks % 4 and a panel offset:
// four addresses per lane, made once. (Four st.shared.b32 per k-step before, kernel log 124.)
template <int BR, int BC>
__device__ __forceinline__ void store_ds_t(u32 s_ds, const u32 (&sf)[BR / 16][4], int row0, int lane) {
  const int row_in = lane % 8, half = lane / 16;
  const u32 row_base = s_ds + (u32)(row0 + row_in + 8 * ((lane / 8) % 2)) * 128;
  u32 base[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) base[c] = row_base + (((2 * c + half) ^ row_in) << 4);
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks) stmatrix_x4(base[ks % 4] + (ks / 4) * (BC * 128), sf[ks]);
}
// store_ds_t with four st.shared.b32 per k-step and no address kept across calls: for the wide kernel, whose
// 255 registers have no room for store_ds_t's four (with them, d256 spilled 28 bytes causal and its
// deterministic build 44 -> 68 bytes; NVRTC 13.0, kernel log 124).
template <int BR, int BC>
__device__ __forceinline__ void store_ds_t_words(u32 s_ds, const u32 (&sf)[BR / 16][4], int row0, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      st_shared_32(s_ds + PanelTile<BC>::bytes(row0 + g + 8 * (r & 1), 2 * ks + (r >> 1)) + 4 * t, sf[ks][r]);
}

// dV += P^T dO and dK += dS^T Q, A from registers, B = dO / Q read MN-major (qt_desc on the Q/dO tiles;
// q_off and do_off the byte offsets of this step's Q and dO): k-step ks covers queries 16 ks .. 16 ks + 15.
template <int BR, int D, bool BF>
__device__ __forceinline__ void issue_dv_dk(float (&dv)[D / 2], float (&dk)[D / 2],
                                            const u32 (&pf)[BR / 16][4], const u32 (&sf)[BR / 16][4],
                                            u64 qt_desc, u32 q_off, u32 do_off) {
  const u64 do_step = desc_advance(qt_desc, do_off), q_step = desc_advance(qt_desc, q_off);
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks) {
    Wgmma<D, BF>::rs_bt(dv, pf[ks], desc_advance(do_step, ks * 16 * 128), 1);
    Wgmma<D, BF>::rs_bt(dk, sf[ks], desc_advance(q_step, ks * 16 * 128), 1);
  }
}

// One of issue_dv_dk's two products on its own: acc (dV or dK) += A (P^T or dS^T, from registers) times B
// (dO or Q, read MN-major at byte offset b_off of qt_desc's tiles), for a kernel that issues something
// between them (bwd_ws: dV, then dQ, then dK, so that dQ lands while dK still runs) or one product per
// warpgroup (the wide kernel).
template <int BR, int D, bool BF, bool kPlainAdd = false>
__device__ __forceinline__ void issue_key_rows_acc(float (&acc)[D / 2], const u32 (&a)[BR / 16][4], u64 qt_desc,
                                                   u32 b_off) {
  const u64 b_step = desc_advance<kPlainAdd>(qt_desc, b_off);
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks)
    Wgmma<D, BF>::rs_bt(acc, a[ks], desc_advance<kPlainAdd>(b_step, ks * 16 * 128), 1);
}

// dQ (64 queries x N columns) = dS K over the block's BC keys, both operands transposed: A = dS^T's tile
// read M-major (ds_desc), B = K read MN-major (kt_desc), 16 keys per k-step.
template <int BC, int N, bool BF, bool kPlainAdd = false>
__device__ __forceinline__ void issue_dq(float (&dq)[N / 2], u64 ds_desc, u64 kt_desc) {
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk)
    Wgmma<N, BF>::ss_tt(dq, desc_advance<kPlainAdd>(ds_desc, kk * 16 * 128),
                        desc_advance<kPlainAdd>(kt_desc, kk * 16 * 128), kk > 0);
}

// One head_dim-wide fp32 accumulator of the warp's two key rows (row0 + g, row0 + g + 8 of the block) into
// a dK or dV layout (`dst` at the block's first key, `row_stride` elements apart); rows at or past
// `rows_left` and columns past head_dim are not written. Each st.global.b32 of a warp writes 16 bytes into
// each of 8 rows, so the store unit takes 8 passes for 128 bytes: 128 of them per thread at head_dim 128
// for dK and dV. Where shared memory is free at the end, stage_key_rows + copy_out_key_rows below write
// the same rows in 16-byte chunks (kernel log 147).
template <int D, bool BF>
__device__ __forceinline__ void store_key_rows(u16* dst, i64 row_stride, int rows_left, int head_dim, int row0,
                                               int g, int t, const float (&acc)[D / 2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row < rows_left) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int col = 8 * n + 2 * t;
        if (col < head_dim) st_global_32(dst + (i64)row * row_stride + col, pack2<BF>(acc[4 * n + 2 * r], acc[4 * n + 2 * r + 1]));
      }
    }
  }
}

// dK and dV of the warp's two key rows (row0 + g, row0 + g + 8 of the block at kv_start) into k's and v's
// layouts, of the block's first rows_left keys. The softmax scale is already in dS, so dK needs none.
template <int D, bool BF>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, int batch, int kv_head, int kv_start,
                                            int rows_left, int row0, int g, int t, const float (&dk)[D / 2],
                                            const float (&dv)[D / 2]) {
  store_key_rows<D, BF>(static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start), p.dk_row_stride,
                        rows_left, p.head_dim, row0, g, t, dk);
  store_key_rows<D, BF>(static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start), p.dv_row_stride,
                        rows_left, p.head_dim, row0, g, t, dv);
}

// The staged epilogue of a key-row accumulator (dK or dV), in two halves with the caller's ordering between
// them (the warp's __syncwarp when a warp copies out its own rows, a named barrier when the copying threads
// span warps).
//
// stage_key_rows: the warp's 16 key rows of `acc` (register 4 n + e: key row row0 + g + 8 (e / 2), column
// 8 n + 2 t + e % 2; row0 a multiple of 16) as 16-bit rows of 2 D bytes in the tile at s_tile, key row k at
// k * 2 D, its 16-byte chunk c at c ^ (k % 8): the eight rows one 8x8 matrix writes then fall in eight bank
// groups. One stmatrix_x4 per pair of 8-column n-tiles: matrix i is rows 8 (i % 2) on of n-tile n + i / 2,
// the pieces store_ds_t's k-steps hold in the same order; lane 8 i + j addresses its row j.
template <int D, bool BF>
__device__ __forceinline__ void stage_key_rows(u32 s_tile, const float (&acc)[D / 2], int row0, int lane) {
  const int i = lane / 8, j = lane % 8;
  const u32 row = s_tile + (u32)(row0 + j + 8 * (i % 2)) * (2 * D);
#pragma unroll
  for (int n = 0; n < D / 8; n += 2) {
    const u32 r[4] = {pack2<BF>(acc[4 * n], acc[4 * n + 1]), pack2<BF>(acc[4 * n + 2], acc[4 * n + 3]),
                      pack2<BF>(acc[4 * n + 4], acc[4 * n + 5]), pack2<BF>(acc[4 * n + 6], acc[4 * n + 7])};
    stmatrix_x4(row + (((n + i / 2) ^ j) << 4), r);
  }
}

// copy_out_key_rows: rows [first_row, first_row + ROWS) of a tile in stage_key_rows' layout (or
// store_head_rows_transposed's, the wide kernel's) out to dK's or dV's layout (dst at the block's first key,
// rows row_stride elements apart), THREADS threads (tid their index) 16 bytes each per pass, consecutive
// threads on consecutive chunks of a row: a warp's store covers 512 contiguous bytes of whole rows at
// head_dim 128, 4 passes of the store unit where the register form above takes 8 for 128 bytes. Keys at or
// past rows_left and chunks at or past head_dim are not written. The callers' rows are 16-byte aligned: dK
// and dV are contiguous with head_dim a multiple of 8 (ops/backward.py).
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void copy_out_key_rows(u16* dst, i64 row_stride, int rows_left, int head_dim,
                                                  u32 s_tile, int first_row, int tid) {
  constexpr int C = D / 8;  // chunks per key row
  static_assert(ROWS * C % THREADS == 0, "the threads cover the rows in whole passes");
#pragma unroll
  for (int i = 0; i < ROWS * C / THREADS; ++i) {
    const int id = i * THREADS + tid, row = first_row + id / C, c = id % C;
    if (row < rows_left && 8 * c < head_dim)
      st_global_16(dst + (i64)row * row_stride + 8 * c,
                   ld_shared_16(s_tile + row * (2 * D) + ((c ^ (row % 8)) << 4)));
  }
}

}  // namespace fa
