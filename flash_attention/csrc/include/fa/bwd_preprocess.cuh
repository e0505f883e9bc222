// The backward's first kernel, shared by both backward families (sm80 and wgmma): per query row,
// delta = rowsum(dO * O) and the LSE in base 2, into the (batch, heads_q, seqlen_q_pad) workspaces that the
// dK/dV and dQ kernels read; in the atomic mode it also clears the row's dQ accumulator (fa/dq_accum.cuh).
#pragma once

#include "fa/bwd_params.h"
#include "fa/dq_accum.cuh"
#include "fa/ptx.cuh"
#include "fa/tile_ptrs.cuh"

namespace fa {

// 128 threads, 64 query rows per block; eight lanes share a row so each 16-byte load of a row is part of a
// 128-byte coalesced segment. Grid: (seqlen_q_pad / 64, heads_q, batch): block x is the workspace's 64-row
// unit x, which holds packed rows [64 x, 64 x + 64), or with a packed batch's unit table (p.q_units,
// fa/bwd_params.h) rows [start, start + count) and padding after them (no key: base-2 LSE +inf, delta 0).
template <class Cfg>
__device__ __forceinline__ void bwd_preprocess_body(const BwdParams& p) {
  constexpr bool BF = Cfg::kIsBF16;
  // delta reads dO's and O's columns: v's head_dim (bounded by p.head_dim_v where a config compiles v's own,
  // ValueDimOf; elsewhere by p.head_dim as before, the same code).
  constexpr int DV = ValueDimOf<Cfg>::value;
  constexpr bool kOwnValueDim = DV != Cfg::kHeadDim;
  constexpr int C = DV / 8;
  const int tid = threadIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int lane8 = tid % 8;
  // The deterministic ws backward's four semaphores of this block's 64-row unit start at zero (the dK/dV
  // kernel, next on the stream, counts in them).
  if (p.dq_lanes != 0 && tid < 4) *dq_semaphore<Cfg::kHeadDim>(p, batch, head, blockIdx.x * 64, tid / 2, tid % 2) = 0;
  // The unit's packed rows: [src0, src0 + src_rows).
  int src0 = blockIdx.x * 64, src_rows = p.seqlen_q - src0;
  if (p.q_units != nullptr) {
    src0 = __ldg(p.q_units + 2 * blockIdx.x);
    src_rows = min(__ldg(p.q_units + 2 * blockIdx.x + 1), p.seqlen_q - src0);
  }
  // A lane's 16-byte chunks of a row (chunks lane8, lane8 + 8, ...), and how many of the four 16-row passes
  // load together: every load of a group is issued before the first sum, so a block waits for memory once
  // per group rather than once per pass (one pass at a time left the kernel at 60% of DRAM bandwidth on an
  // H200, ncu, 4 x 1024 x 32 x 128: kernel log). Up to 16 chunks in flight per thread (64 registers).
  constexpr int kChunks = (C + 7) / 8;
  constexpr int kGroup = 2 * kChunks <= 4 ? 4 : 2;
  const int width = kOwnValueDim ? p.head_dim_v : p.head_dim;  // the row's columns (a run-time head_dim)
#pragma unroll 1
  for (int group = 0; group < 4; group += kGroup) {
    uint4 o_chunk[kGroup][kChunks], do_chunk[kGroup][kChunks];
    float lse[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int r = (group + i) * 16 + tid / 8;  // the row within the unit
      const bool real = r < src_rows;
      const int src = src0 + r;  // its packed row, when real
      const u16* o = static_cast<const u16*>(p.o) + (real ? o_offset(p, batch, head, src) : 0);
      const u16* d = static_cast<const u16*>(p.dout) + (real ? do_offset(p, batch, head, src) : 0);
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane8 + 8 * j;
        const bool load = real && c < C && c * 8 < width;
        o_chunk[i][j] = load ? ld_global_16(o + c * 8) : make_uint4(0u, 0u, 0u, 0u);
        do_chunk[i][j] = load ? ld_global_16(d + c * 8) : make_uint4(0u, 0u, 0u, 0u);
      }
      lse[i] =
          real && lane8 == 0 ? p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + src] : neg_inf();
    }
    // The atomic mode's dQ workspace starts at zero: each row is cleared here, before the dK/dV kernel (next
    // on the stream) adds into it (null where a deterministic kernel writes dQ directly; the deterministic
    // warp-specialized ones add into dq_lanes accumulators, each cleared). ptxas issues all of the group's
    // O and dO loads first and these stores after the first sums (SASS, NVRTC 13.0); placed before the loads
    // in the source, the stores came first but ptxas then spread the loads between the sums, two round trips
    // instead of one, so the loads keep the lead.
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int row = blockIdx.x * 64 + (group + i) * 16 + tid / 8;  // the row's workspace row
      if (p.dq_accum != nullptr && row < p.seqlen_q_pad) {
        zero_dq_accum_row<Cfg::kHeadDim>(p.dq_accum, workspace_row(p, batch, head, row), lane8);
        if (p.dq_lanes == 2)  // the deterministic backward's second accumulator (fa/dq_accum.cuh)
          zero_dq_accum_row<Cfg::kHeadDim>(dq_lane<Cfg::kHeadDim>(p, 1), workspace_row(p, batch, head, row),
                                           lane8);
      }
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const int r = (group + i) * 16 + tid / 8;
      const int row = blockIdx.x * 64 + r;
      const bool real = r < src_rows;
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const u32 av[4] = {o_chunk[i][j].x, o_chunk[i][j].y, o_chunk[i][j].z, o_chunk[i][j].w};
        const u32 bv[4] = {do_chunk[i][j].x, do_chunk[i][j].y, do_chunk[i][j].z, do_chunk[i][j].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float a0, a1, b0, b1;
          unpack2<BF>(av[e], a0, a1);
          unpack2<BF>(bv[e], b0, b1);
          acc = fmaf(a0, b0, fmaf(a1, b1, acc));
        }
      }
      // The eight lanes of the row hold its partial sums (a chunk not loaded is zeros: it adds nothing).
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      acc += __shfl_xor_sync(0xffffffffu, acc, 4);
      if (lane8 == 0 && row < p.seqlen_q_pad) {
        const i64 idx = workspace_row(p, batch, head, row);
        // Padding rows and rows that see no key: base-2 LSE +inf, so probabilities exp2(s - inf) = 0.
        p.lse_log2[idx] = real && lse[i] != neg_inf() ? lse[i] * 1.4426950408889634f : pos_inf();
        p.delta[idx] = real ? acc : 0.f;
      }
    }
  }
}

}  // namespace fa
