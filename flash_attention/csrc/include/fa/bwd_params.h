// The backward kernels' parameters: raw pointers, strides and sizes, no torch.
//
// Mirrored by flash_attention/jit/params.py (BwdParams); the generated translation unit static_asserts every
// field offset, as for FwdParams.
#pragma once

#include "fa/params.h"  // kScoreValues

namespace fa {

// v's head_dim as a backward config compiles it: Cfg::kHeadDimV where the config has one (BwdConfig
// head_dim_v, the warp-specialized wide kernel at head_dim 192), else Cfg::kHeadDim. (A trait, not a field
// every config carries: the other configs' Cfg structs stay as they were.)
template <class Cfg, class = void>
struct ValueDimOf {
  static constexpr int value = Cfg::kHeadDim;
};
template <class Cfg>
struct ValueDimOf<Cfg, decltype(void(Cfg::kHeadDimV))> {
  static constexpr int value = Cfg::kHeadDimV;
};

struct BwdParams {
  const void* q;     // (batch, seqlen_q, heads_q, head_dim), last dim contiguous
  const void* k;     // (batch, seqlen_k, heads_kv, head_dim)
  const void* v;     // (batch, seqlen_k, heads_kv, head_dim)
  const void* o;     // the forward's output, q's layout
  const void* dout;  // dL/dO, q's layout
  const float* lse;  // the forward's LSE (batch, heads_q, seqlen_q), natural log, rows contiguous
  // Workspaces of (batch, heads_q, seqlen_q_pad) floats written by the preprocessing kernel: the LSE in base 2
  // (+inf where a row sees no key, and in the padding rows, so their probabilities come out 0 rather than
  // NaN) and delta = rowsum(dO * O) (0 in the padding rows).
  float* lse_log2;
  float* delta;
  // (batch, heads_q, seqlen_q_pad, kHeadDim) fp32, zeroed: dQ (already scaled) accumulated atomically by the
  // dK/dV kernel. Padded rows and columns absorb the tile's tails, so the atomics need no bounds checks.
  float* dq_accum;
  void* dq;  // q's layout: written by the deterministic dQ kernel
  void* dk;  // k's layout
  void* dv;  // v's layout
  const int* key_range;  // (batch, 2) [start, end) per batch row; read only by the kRanged instantiations

  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long do_batch_stride, do_row_stride, do_head_stride;
  long long dq_batch_stride, dq_row_stride, dq_head_stride;
  long long dk_batch_stride, dk_row_stride, dk_head_stride;
  long long dv_batch_stride, dv_row_stride, dv_head_stride;
  long long lse_batch_stride, lse_head_stride;

  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  int head_dim;     // the problem's head_dim (<= the compiled kHeadDim)
  int group;        // heads_q / heads_kv
  int seqlen_q_pad;  // seqlen_q rounded up to a multiple of 128 (every block_q divides it)
  int num_m_blocks;  // ceil(seqlen_q / kBlockQ)
  int num_n_blocks;  // ceil(seqlen_k / kBlockKV)
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e)
  unsigned dropout_key;        // as in FwdParams (kDropout instantiations only)
  unsigned dropout_threshold;
  float dropout_rp;
  // 0: the workspace holds one dQ accumulator (or none). 1 or 2: the deterministic warp-specialized
  // backward's accumulator lanes, then its semaphores (fa/dq_accum.cuh, fa/dq_turns.cuh), which the
  // preprocessing kernel zeroes and the convert kernel sums. Last, so the pointer fields' offsets stay where
  // the compiled training node patches them.
  int dq_lanes;
  int window_left, window_right;  // as in FwdParams (WindowMask instantiations only)
  float score_values[kScoreValues];  // as in FwdParams (the score functions' instantiations only)
  const float* alibi_slopes;
  int alibi_batch_stride;
  const int* row_keys;  // as in FwdParams (SegmentMask instantiations only)
  const int* key_rows;
  // A packed batch's tables (flash_attention/ops/query_tiles.py; both null, or both set for the
  // warp-specialized dK/dV kernel's segments build in atomic mode):
  // * k_tiles, 8 ints per tile (key_tiles): tile n covers keys [k0, k1) of one sequence (at most kBlockKV),
  //   and walks its query blocks from q0, the sequence's first row, whose workspace row is w0, to no
  //   further than q1, its end (then three unused ints); longest first; num_n_blocks is the table's
  //   length. Null: tile n covers keys n kBlockKV .. of the packed row.
  // * q_units, 2 ints per unit (query_units): the workspace (lse_log2, delta, dq_accum) laid out by
  //   sequence, seqlen_q_pad / 64 units per head: unit u's rows hold packed rows [start, start + count),
  //   count <= 64, the rest padding. The preprocessing and cast kernels run over the units. Null: workspace
  //   row r is packed row r.
  const int* k_tiles;
  const int* q_units;
  const int* alibi_diagonal;  // as in FwdParams (the "..._table" score builds only)
  // The dK/dV blocks' start order (fa/kv_block_order.cuh): 0 the grid's own; G > 0 heaviest first within
  // groups of G (K/V head, batch row) pairs (the warp-specialized kernel's causal builds).
  int kv_block_group;
  // v's head_dim (<= the compiled ValueDimOf<Cfg>; its tail masked): V's, dO's, O's and dV's columns. Set by
  // every launch (head_dim where v has q's width); in the 4 bytes before `trace`, which stays where it was.
  int head_dim_v;
  // The timeline build's record buffer (fa/timeline.cuh, tools/bwd_timeline.py); null in every library call.
  // Last, after the fields the compiled training node patches, and within the 64 bytes before
  // BwdTmaParams' maps, which stay where they were.
  void* trace;
};

}  // namespace fa
