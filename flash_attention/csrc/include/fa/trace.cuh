// Debug build of the forward kernels (the sm80 kernel, csrc/kernels/sm80/fwd, and the warp-specialized
// Hopper kernel, csrc/kernels/sm90/fwd_ws): one warp writes its intermediates to a device buffer.
//
// Compiled only when the JIT defines FA_TRACE=1 (flash_attention/jit/sources.py, kernel_source(trace=True));
// the normal build sees nothing of this file but the default below, so its code is unchanged. The traced
// warp is chosen at launch (FwdParams::trace_batch/_head/_m_block/_warp; warps are counted among those that
// own query rows, so a warp-specialized block's first consumer warp is warp 0); it records, for each K/V
// step, the tiles it read from shared memory (Q, K, V, through the kernel's own swizzle), its accumulators
// (S before scaling, P before rounding, O after the step), and its row statistics (M, the O rescale factor
// alpha, and L summed over the quad), then the output rows as stored and their LSE.
// flash_attention/tools/debug.py reads the buffer back into the same named tensors the simulator
// (flash_attention/tools/sim.py) produces.
//
// Why a buffer and not printf: thousands of threads printing interleave, truncate at the printf FIFO and
// serialise the kernel; one warp's plain global stores change no arithmetic of the kernel, so the trace
// build computes bit for bit what the normal build computes (tests/test_gpu_sim.py checks that).
//
// The layout (float offsets) is mirrored by flash_attention/jit/params.py (trace_layout); the generated
// translation unit static_asserts every offset against the Python side.
#pragma once

#ifndef FA_TRACE
#define FA_TRACE 0
#endif

#if FA_TRACE

#include "fa/frag.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"

namespace fa {
namespace trace {

// Planted faults (FwdParams::trace_fault), so a test can check that the trace comparison names the step
// where a known bug first shows. They apply to every block, like a real bug would.
enum Fault : int {
  kNoFault = 0,
  kSkipRescale = 1,   // O is not multiplied by alpha when the running max grows
  kWrongSwizzle = 2,  // K is read at the wrong place in shared memory: wrong values of K reach the mma
};

template <class Cfg>
struct Layout {
  // Rows per warp: the block's rows split over the warps that own query rows (a warp-specialized block's
  // producer warpgroup owns none), as KernelConfig.rows_per_warp.
  static constexpr int WM = Cfg::kBlockQ / (Cfg::kNumWarps - (Cfg::kWarpSpecialized ? 4 : 0));
  static constexpr int BC = Cfg::kBlockKV;
  static constexpr int D = Cfg::kHeadDim;
  // Header: a magic number (the buffer was written by a trace build), the block's number of K/V steps,
  // the number of steps recorded so far, one spare.
  static constexpr int kMagic = 0, kNumBlocks = 1, kStepsDone = 2;
  static constexpr int kHeader = 4;
  static constexpr int kFinalO = kHeader;             // WM x D, the output rows as stored (rounded)
  static constexpr int kFinalLse = kFinalO + WM * D;  // WM
  static constexpr int kFirstStep = kFinalLse + WM;
  // One step, at kFirstStep + step * kStep:
  static constexpr int kKVBlock = 0;
  static constexpr int kQ = 1;             // WM x D
  static constexpr int kK = kQ + WM * D;   // BC x D
  static constexpr int kS = kK + BC * D;   // WM x BC, Q K^T before scaling and masking
  static constexpr int kM = kS + WM * BC;  // WM, running max after this step
  static constexpr int kAlpha = kM + WM;   // WM, the factor O and L were rescaled by
  static constexpr int kP = kAlpha + WM;   // WM x BC, probabilities in fp32, before rounding
  static constexpr int kL = kP + WM * BC;  // WM, running sum after this step
  static constexpr int kV = kL + WM;       // BC x D
  static constexpr int kO = kV + BC * D;   // WM x D, unnormalised O after this step's P V
  static constexpr int kStep = kO + WM * D;
  static constexpr float kMagicValue = 20241122.f;
};

// 2-byte element of Q/K/V to fp32: bf16 is the high half of an fp32; fp16 through cvt.f32.f16 (PTX ISA
// 9.7.9.21).
template <bool kIsBF16>
__device__ __forceinline__ float to_float(u16 x) {
  if constexpr (kIsBF16) {
    return __uint_as_float(static_cast<u32>(x) << 16);
  } else {
    float r;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(r) : "h"(x));
    return r;
  }
}

template <class Cfg>
struct Tracer {
  using L = Layout<Cfg>;
  float* base;  // the traced warp's buffer; null in every other warp
  float* step_base;
  int fault;
  int lane;

  __device__ __forceinline__ Tracer(const FwdParams& p, int batch, int head, int m_block, int warp, int lane_)
      : base(nullptr), step_base(nullptr), fault(p.trace_fault), lane(lane_) {
    if (p.trace && batch == p.trace_batch && head == p.trace_head && m_block == p.trace_m_block &&
        warp == p.trace_warp)
      base = p.trace;
  }
  // Warp-uniform: every lane of the traced warp takes the same branches (the shuffles below need it).
  __device__ __forceinline__ bool on() const { return base != nullptr; }
  __device__ __forceinline__ bool skip_rescale() const { return fault == kSkipRescale; }

  __device__ __forceinline__ void begin(int n_blocks) const {
    if (on() && lane == 0) {
      base[L::kMagic] = L::kMagicValue;
      base[L::kNumBlocks] = static_cast<float>(n_blocks);
      base[L::kStepsDone] = 0.f;
    }
  }

  __device__ __forceinline__ void begin_step(int it, int kv_block) {
    if (!on()) return;
    step_base = base + L::kFirstStep + it * L::kStep;
    if (lane == 0) {
      step_base[L::kKVBlock] = static_cast<float>(kv_block);
      base[L::kStepsDone] = static_cast<float>(it + 1);
    }
  }

  // Back to step `it`, already begun, for what the kernel computes of it only later (the warp-specialized
  // kernel's overlapped schedule completes step j's P V inside step j + 1).
  __device__ __forceinline__ void resume_step(int it) {
    if (on()) step_base = base + L::kFirstStep + it * L::kStep;
  }

  // `rows` rows of a shared-memory tile (row0 onwards), read through the kernel's chunk offset function.
  template <class Offset>
  __device__ __forceinline__ void smem_tile(int off, const u16* tile, int row0, int rows,
                                            Offset offset_of) const {
    if (!on()) return;
    constexpr int D = L::D;
    for (int idx = lane; idx < rows * D; idx += 32) {
      const int row = idx / D, col = idx % D;
      step_base[off + idx] = to_float<Cfg::kIsBF16>(tile[offset_of(row0 + row, col / 8) + col % 8]);
    }
  }

  // An accumulator through its view (fa/frag.cuh: AccTile and AccTile1 for the sm80 kernel's mma tiles,
  // AccFlat for the warp's 16 rows of a wgmma m64nN fragment) into rows 0 .. 16 kMT - 1 of a row-major
  // array with 8 kN columns (PTX ISA 9.7.14.5.14 C layout: element (mt, n, e) is row 16 mt + g + 8 (e / 2),
  // column 8 n + 2 t + e % 2).
  template <class Acc>
  __device__ __forceinline__ void acc_view(int off, const Acc& x) const {
    if (!on()) return;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          step_base[off + (16 * mt + g + 8 * (e >> 1)) * 8 * Acc::kN + 8 * n + 2 * t + (e & 1)] = x(mt, n, e);
  }

  // One 16-row mma tile into rows 16 mt .. 16 mt + 15 of such an array, and all MT of them.
  template <int N>
  __device__ __forceinline__ void acc_tile(int off, int mt, float (&x)[N][4]) const {
    acc_view(off + 16 * mt * 8 * N, fa::acc_tile(x));
  }
  template <int MT, int N>
  __device__ __forceinline__ void acc(int off, float (&x)[MT][N][4]) const {
    acc_view(off, fa::acc_tile(x));
  }

  // A per-row value held identically by the four lanes of a quad (row 16 mt + g + 8 r).
  __device__ __forceinline__ void row_value(int off, int mt, int r, float v) const {
    if (on() && lane % 4 == 0) step_base[off + 16 * mt + lane / 4 + 8 * r] = v;
  }

  // The running sum L of a row: each lane holds a partial; added over the quad in the epilogue's order.
  __device__ __forceinline__ void row_sum(int off, int mt, int r, float partial) const {
    if (!on()) return;
    float l = partial;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    row_value(off, mt, r, l);
  }

  // Two adjacent output elements as stored (packed bf16/fp16 pair, `lo` at the lower column).
  __device__ __forceinline__ void final_pair(int row, int col, u32 packed) const {
    if (!on()) return;
    float lo, hi;
    unpack2<Cfg::kIsBF16>(packed, lo, hi);
    base[L::kFinalO + row * L::D + col] = lo;
    base[L::kFinalO + row * L::D + col + 1] = hi;
  }

  __device__ __forceinline__ void final_lse(int row, float lse) const {
    if (on()) base[L::kFinalLse + row] = lse;
  }

  // A block that sees no key: output rows 0 and LSE -inf, as the kernel stores them.
  __device__ __forceinline__ void empty_block() const {
    if (!on()) return;
    for (int i = lane; i < L::WM * L::D; i += 32) base[L::kFinalO + i] = 0.f;
    for (int i = lane; i < L::WM; i += 32) base[L::kFinalLse + i] = neg_inf();
  }
};

// kWrongSwizzle: point K's fragment bases at the chunk the XOR with the *next* row's bits selects, as a
// swizzle off by one row would. Swizzled or not, the mma then multiplies Q by chunks of other columns.
template <int D, class Addr>
__device__ __forceinline__ void plant_swizzle_fault(Addr& a, u32 tile, int lane_row, int b, int fault) {
  if (fault != kWrongSwizzle) return;
#pragma unroll
  for (int c = 0; c < 4; ++c) a.base[c] = tile + 2 * D * lane_row + 16 * ((2 * c + b) ^ ((lane_row + 1) & 7));
}

// kWrongSwizzle in the warp-specialized kernel, whose K operand the tensor cores read from shared memory
// themselves through a descriptor (no per-lane addresses to corrupt): the descriptor starts one 128-byte row
// past K's tile. The tensor cores then take each key's columns from where the next row's lie, undoing the
// swizzle with a pattern one row off (or, should they take the pattern from the address, the next key
// whole): either way K in shared memory is right and S = Q K^T is not. The last key reads the row after the
// tile, still inside the block's shared memory. Returns the bytes to add to K's tile address.
__device__ __forceinline__ u32 wrong_swizzle_bytes(int fault) { return fault == kWrongSwizzle ? 128u : 0u; }

}  // namespace trace
}  // namespace fa

#endif  // FA_TRACE
