// Where a tile starts in global memory, from the params structs (fa/params.h, fa/bwd_params.h).
//
// Q, K, V, O and their gradients are (batch, seqlen, heads, head_dim) with arbitrary element strides and a
// contiguous last dimension: row `row` of head `head` of batch row `batch` starts at element
// batch * batch_stride + head * head_stride + row * row_stride. K and V are indexed by the kv head
// (query head / group: GQA reads them in place). The templates take FwdParams or BwdParams, whose shared
// fields have the same names.
//
// These return element offsets, and the kernel adds them to the tensor's pointer itself
// (`static_cast<const u16*>(p.q) + q_offset(...)`): pointer arithmetic inside a helper reaches the
// optimiser in another form than the same arithmetic in the kernel and moved instructions of the dK/dV
// kernels' epilogue. Each function reads its params fields in its own body, in the order of the
// expression: passed in as arguments they are loaded in another order, which also changes the code.
#pragma once

#include "fa/bwd_params.h"
#include "fa/params.h"
#include "fa/ptx.cuh"

namespace fa {

template <class P>
__device__ __forceinline__ i64 q_offset(const P& p, int batch, int head, int row) {
  return batch * p.q_batch_stride + head * p.q_head_stride + row * p.q_row_stride;
}
template <class P>
__device__ __forceinline__ i64 k_offset(const P& p, int batch, int kv_head, int row) {
  return batch * p.k_batch_stride + kv_head * p.k_head_stride + row * p.k_row_stride;
}
template <class P>
__device__ __forceinline__ i64 v_offset(const P& p, int batch, int kv_head, int row) {
  return batch * p.v_batch_stride + kv_head * p.v_head_stride + row * p.v_row_stride;
}
template <class P>
__device__ __forceinline__ i64 o_offset(const P& p, int batch, int head, int row) {
  return batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride;
}

// The forward's LSE output: (batch, heads_q, seqlen_q), rows contiguous.
__device__ __forceinline__ i64 lse_offset(const FwdParams& p, int batch, int head, int row) {
  return batch * p.lse_batch_stride + head * p.lse_head_stride + row;
}

__device__ __forceinline__ i64 do_offset(const BwdParams& p, int batch, int head, int row) {
  return batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride;
}
__device__ __forceinline__ i64 dq_offset(const BwdParams& p, int batch, int head, int row) {
  return batch * p.dq_batch_stride + head * p.dq_head_stride + row * p.dq_row_stride;
}
__device__ __forceinline__ i64 dk_offset(const BwdParams& p, int batch, int kv_head, int row) {
  return batch * p.dk_batch_stride + kv_head * p.dk_head_stride + row * p.dk_row_stride;
}
__device__ __forceinline__ i64 dv_offset(const BwdParams& p, int batch, int kv_head, int row) {
  return batch * p.dv_batch_stride + kv_head * p.dv_head_stride + row * p.dv_row_stride;
}

// Row index of query row `row` of (batch, head) in the backward's (batch, heads_q, seqlen_q_pad) workspaces
// (lse_log2, delta; times kHeadDim for dq_accum). They are padded to whole blocks, so a tile's rows need no
// bounds check.
__device__ __forceinline__ i64 workspace_row(const BwdParams& p, int batch, int head, int row) {
  return ((i64)batch * p.heads_q + head) * p.seqlen_q_pad + row;
}

}  // namespace fa
