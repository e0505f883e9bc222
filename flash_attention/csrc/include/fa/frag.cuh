// One warp's accumulator tile in registers, and its reuse as a 16-bit A operand.
//
// The mma.sync m16n8 C/D fragment (PTX ISA 9.7.14.5.14) and a warp's 16 rows of the wgmma m64nN D fragment
// (PTX ISA 9.7.15.5.1.1.1) place the elements alike: with g = lane / 4 and t = lane % 4, register e of
// 8-column n-tile n holds row g + 8 (e / 2), column 8 n + 2 t + e % 2 of the warp's 16-row tile. The kernels
// store those registers as float[MT][N][4] (MT 16-row tiles per warp), float[N][4] (one tile) or, for the
// wgmma wrappers, flat float[4 N]. AccTile views any of the three as (mt, n, e) so masking, softmax and
// dropout are written once for every kernel (fa/mask.cuh, fa/softmax.cuh, fa/dropout.cuh); the views
// are references, so after inlining they cost nothing.
#pragma once

#include "fa/ptx.cuh"

namespace fa {

template <int MT, int N>
struct AccTile {
  static constexpr int kMT = MT;  // 16-row tiles per warp
  static constexpr int kN = N;    // 8-column n-tiles per row
  float (&x)[MT][N][4];
  __device__ __forceinline__ float& operator()(int mt, int n, int e) const { return x[mt][n][e]; }
};

template <int N>
struct AccTile1 {
  static constexpr int kMT = 1;
  static constexpr int kN = N;
  float (&x)[N][4];
  __device__ __forceinline__ float& operator()(int, int n, int e) const { return x[n][e]; }
};

// The wgmma D fragment of one warp: register 4 n + e.
template <int N4>
struct AccFlat {
  static constexpr int kMT = 1;
  static constexpr int kN = N4 / 4;
  float (&x)[N4];
  __device__ __forceinline__ float& operator()(int, int n, int e) const { return x[4 * n + e]; }
};

template <int MT, int N>
__device__ __forceinline__ AccTile<MT, N> acc_tile(float (&x)[MT][N][4]) {
  return {x};
}
template <int N>
__device__ __forceinline__ AccTile1<N> acc_tile(float (&x)[N][4]) {
  return {x};
}
template <int N4>
__device__ __forceinline__ AccFlat<N4> acc_tile(float (&x)[N4]) {
  return {x};
}

// The accumulator layout of two adjacent n-tiles (2 ks, 2 ks + 1) of 16-row tile mt, rounded to 16 bits,
// is exactly the A-fragment layout of one 16-deep k-step (mma.sync m16n8k16 and wgmma's register A alike):
// so P and dS feed the next product straight from the registers that computed them.
template <bool kIsBF16, class Acc>
__device__ __forceinline__ void acc_to_a_frag(u32 (&a)[4], const Acc& acc, int mt, int ks) {
  a[0] = pack2<kIsBF16>(acc(mt, 2 * ks, 0), acc(mt, 2 * ks, 1));
  a[1] = pack2<kIsBF16>(acc(mt, 2 * ks, 2), acc(mt, 2 * ks, 3));
  a[2] = pack2<kIsBF16>(acc(mt, 2 * ks + 1, 0), acc(mt, 2 * ks + 1, 1));
  a[3] = pack2<kIsBF16>(acc(mt, 2 * ks + 1, 2), acc(mt, 2 * ks + 1, 3));
}

// The same for an 8-bit (e4m3) A operand, one 32-deep k-step = n-tiles 4 ks .. 4 ks + 3: the fragment gives
// a thread positions 4 t .. 4 t + 3 of each 16-key half in one register (docs/fp8-study.md A.3.2), where
// the accumulator holds keys 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t of that half; register r packs row g + 8 (r % 2)
// of half r / 2 in that key order, and V^T's tile holds its keys in the same order
// (ops/fp8_values.py KEY_ORDER_16; tests/test_fp8_values.py checks the pair against P V).
template <class Acc>
__device__ __forceinline__ void acc_to_a_frag_e4m3(u32 (&a)[4], const Acc& acc, int mt, int ks) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int n = 4 * ks + 2 * (r / 2), e = 2 * (r % 2);
    a[r] = pack4_e4m3(acc(mt, n, e), acc(mt, n, e + 1), acc(mt, n + 1, e), acc(mt, n + 1, e + 1));
  }
}

}  // namespace fa
