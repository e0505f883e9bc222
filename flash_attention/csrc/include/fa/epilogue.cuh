// The forward kernels' output stores: the whole-block store of a block with no visible key, and the
// coalesced copy of an output tile staged in shared memory.
#pragma once

#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/softmax.cuh"

namespace fa {

// A block none of whose rows sees any key: out = 0 and, when the caller wants the LSE (gL not null), the LSE
// of an empty row: -inf, or the head's attention sink, which is then the row's whole denominator (as
// sink_row makes it for a row without keys in a block that has some: fa/softmax.cuh). For its rows_valid
// rows; R rows x D columns by the block's kThreads threads; columns past head_dim are not written. (The
// params are read here, not passed in: as arguments they are loaded in another order, which changes the
// kernel's machine code.)
template <int R, int D, int kThreads>
__device__ __forceinline__ void store_empty_block(const FwdParams& p, u16* gO, float* gL, int rows_valid,
                                                  int head, int tid) {
  constexpr int C = D / 8;
  for (int idx = tid; idx < R * C; idx += kThreads) {
    const int row = idx / C, chunk = idx % C;
    if (row < rows_valid && chunk * 8 < p.head_dim_v)
      st_global_16(gO + row * p.o_row_stride + chunk * 8, make_uint4(0, 0, 0, 0));
  }
  if (gL) {
    const float lse = head_sink(p, head);
    for (int row = tid; row < rows_valid; row += kThreads) gL[row] = lse;
  }
}

// Copy the R x D output tile staged in shared memory at `s_tile` (laid out by `Layout`,
// fa/smem_layout.cuh) to O at gO: consecutive threads store consecutive 16-byte chunks of a row
// (coalesced). Rows at or past rows_valid and columns past head_dim are not written. The caller synchronises
// the block between staging and this copy.
template <int R, int D, int kThreads, class Layout>
__device__ __forceinline__ void store_o_tile(const FwdParams& p, u16* gO, u32 s_tile, int rows_valid,
                                             int tid) {
  constexpr int C = D / 8;
#pragma unroll
  for (int i = 0; i < (R * C + kThreads - 1) / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    if ((R * C) % kThreads != 0 && idx >= R * C) break;
    const int row = idx / C, chunk = idx % C;
    if (row < rows_valid && chunk * 8 < p.head_dim_v)
      st_global_16(gO + row * p.o_row_stride + chunk * 8, ld_shared_16(s_tile + Layout::bytes(row, chunk)));
  }
}

// store_o_tile one chunk at a time (no unrolling): the copy-out of a packed batch's cut tiles in the
// warp-specialized forward, where the unrolled loop's loads in flight spilled registers of the kernel's
// main loop (fa/fwd_ws: 64-84 bytes in the persistent tile_overlap build).
template <int R, int D, int kThreads, class Layout>
__device__ __forceinline__ void store_o_tile_serial(const FwdParams& p, u16* gO, u32 s_tile, int rows_valid,
                                                    int tid) {
  constexpr int C = D / 8;
#pragma unroll 1
  for (int idx = tid; idx < R * C; idx += kThreads) {
    const int row = idx / C, chunk = idx % C;
    if (row < rows_valid && chunk * 8 < p.head_dim_v)
      st_global_16(gO + row * p.o_row_stride + chunk * 8, ld_shared_16(s_tile + Layout::bytes(row, chunk)));
  }
}

}  // namespace fa
