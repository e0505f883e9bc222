// The steps of one K/V block that both Hopper forwards (csrc/kernels/sm90/fwd: cp.async, and
// csrc/kernels/sm90/fwd_ws: warp-specialized) run the same way on a warpgroup's 64 query rows: the two
// matrix products, S to P fragments, and the staging of the normalised output with its LSE.
//
// Operand layouts (the sm90 kernel's header says more): tiles in shared memory as 64-column panels of
// 128-byte rows with the 128-byte swizzle; Q and K read K-major, V MN-major. The callers bracket each product
// with wgmma_fence / wgmma_commit and wait for it themselves, since when they wait is what their schedules
// differ in.
#pragma once

#include "fa/frag.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/softmax.cuh"
#include "fa/wgmma.cuh"

namespace fa {

// S (64 x BC) = Q K^T over head_dim D: D / 16 k-steps of 16 columns, 32 bytes along a row, every fourth
// starting the next panel (BR * 128 bytes on in Q's tile, BC * 128 in K's).
template <int BR, int BC, int D, bool BF>
__device__ __forceinline__ void issue_qk(float (&s)[BC / 2], u64 q_desc, u64 k_desc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u32 q_off = (kk / 4) * BR * 128 + (kk % 4) * 32;
    const u32 k_off = (kk / 4) * BC * 128 + (kk % 4) * 32;
    Wgmma<BC, BF>::ss(s, q_desc + (q_off >> 4), k_desc + (k_off >> 4), kk > 0);
  }
}

// O (64 x D) += P V: BC / 16 k-steps of 16 keys, P from registers, V's 16 keys two 8-row groups on.
template <int BC, int D, bool BF>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const u32 (&pf)[BC / 16][4], u64 v_desc) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ++ks) Wgmma<D, BF>::rs_bt(o, pf[ks], v_desc + ((ks * 16 * 128) >> 4), 1);
}

// Two adjacent 8-column n-tiles of the S accumulator are one k-step's A fragment of P V.
template <int BC, bool BF>
__device__ __forceinline__ void s_to_p(u32 (&pf)[BC / 16][4], float (&s)[BC / 2]) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ++ks) acc_to_a_frag<BF>(pf[ks], acc_tile(s), 0, ks);
}

// FP8 (e4m3; docs/fp8-study.md): the same three steps with 8-bit operands, k = 32.
// S = Q K^T: D / 32 k-steps of 32 one-byte columns, 32 bytes along a row and PB / 32 to a swizzle panel of
// PB bytes (128: which holds 128 columns, so the offsets are issue_qk's; head_dim 64: one 64-byte panel of
// the 64-byte swizzle, two k-steps).
template <int BR, int BC, int D, int PB = 128>
__device__ __forceinline__ void issue_qk_e4m3(float (&s)[BC / 2], u64 q_desc, u64 k_desc) {
  constexpr int KP = PB / 32;  // k-steps per panel
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    const u32 q_off = (kk / KP) * BR * PB + (kk % KP) * 32;
    const u32 k_off = (kk / KP) * BC * PB + (kk % KP) * 32;
    WgmmaE4m3<BC>::ss(s, q_desc + (q_off >> 4), k_desc + (k_off >> 4), kk > 0);
  }
}

// O (64 x DV) += P V from V^T's tile (DV rows of BC keys in acc_to_a_frag_e4m3's key order,
// ops/fp8_values.py), read K-major: BC / 32 k-steps of 32 keys, 32 bytes along a row, VPB / 32 to a panel of
// VPB keys (128; 64 at 64-key tiles, the 64-byte swizzle), the next panel DV * VPB bytes on.
template <int BC, int DV, int VPB = 128>
__device__ __forceinline__ void issue_pv_e4m3(float (&o)[DV / 2], const u32 (&pf)[BC / 32][4], u64 vt_desc) {
  constexpr int KP = VPB / 32;  // k-steps per panel
#pragma unroll
  for (int ks = 0; ks < BC / 32; ++ks) {
    const u32 off = (ks / KP) * DV * VPB + (ks % KP) * 32;
    WgmmaE4m3<DV>::rs(o, pf[ks], vt_desc + (off >> 4), 1);
  }
}

// S's accumulator to P's 8-bit A fragments, one per 32-key k-step.
template <int BC>
__device__ __forceinline__ void s_to_p_e4m3(u32 (&pf)[BC / 32][4], float (&s)[BC / 2]) {
#pragma unroll
  for (int ks = 0; ks < BC / 32; ++ks) acc_to_a_frag_e4m3(pf[ks], acc_tile(s), 0, ks);
}

// The bounded softmax's L_r on the CUDA cores (fa/softmax.cuh bounded_softmax_row; head_dim 256, where the
// tensor cores' ones product measured slower, fwd_ws): this thread's partial sums of its two rows += P
// exactly as P V takes it, from the packed bf16 pairs of s_to_p (registers 0 and 2 of a k-step hold row g,
// 1 and 3 row g + 8); unpacking is exact, two integer operations per pair. The sums go where the ones
// product's m64n8 accumulator keeps its rows (row g in 0, row g + 8 in 2), so both forms share one array.
template <int BC>
__device__ __forceinline__ void add_p_row_sums(float (&row_sum)[4], const u32 (&pf)[BC / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ++ks)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 4; h += 2) {
        float lo, hi;
        unpack2<true>(pf[ks][r + h], lo, hi);
        row_sum[2 * r] += lo + hi;
      }
}

// O / L of this thread's two rows, packed and stored into the rows' place in the staging tile `s_tile`
// (laid out by Tile, fa/smem_layout.cuh), and the rows' LSE when the caller wants it (gL not null; kFolded:
// the softmax's form, fa/softmax.cuh); with the head's attention sink `sink` (head_sink; -inf: none) in
// both. The caller synchronises its warps before the tile is copied out (fa/epilogue.cuh, store_o_tile).
// o_factor multiplies O and lse_factor the folded scores' scale in the LSE: the e4m3 build's descales
// (sm90/fwd_ws/descales.cuh); 1 elsewhere, where they fold away. (No sink with them: the e4m3 call takes
// none.)
template <int D, class Tile, bool BF, bool kFolded = true>
__device__ __forceinline__ void stage_o_and_lse(const FwdParams& p, const float (&o)[D / 2],
                                                const float (&row_max)[2], const float (&row_sum)[2],
                                                u32 s_tile, float* gL, int warp_row0, int g, int t,
                                                int q_valid, float sink, float o_factor = 1.f,
                                                float lse_factor = 1.f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row_sum[r]);
    float inv = inv_row_sum(l) * o_factor, sink_lse = 0.f;
    if (sink != neg_inf()) inv = sink_row<kFolded>(p, row_max[r], l, sink, sink_lse);
    const int row = warp_row0 + g + 8 * r;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const u32 v = pack2<BF>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      st_shared_32(s_tile + Tile::bytes(row, n) + 4 * t, v);
    }
    if (gL && t == 0 && row < q_valid)
      gL[row] = sink != neg_inf() ? sink_lse : row_lse<kFolded>(p, row_max[r] * lse_factor, l);
  }
}

}  // namespace fa
