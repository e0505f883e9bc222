// The forward kernel's parameters: raw pointers, strides and sizes, no torch.
//
// Passed by value as the kernel's only argument. flash_attention/jit/launch.py mirrors this layout with a
// ctypes.Structure; the JIT emits static_asserts on every field's offset (from the Python side) into each
// translation unit, so the two cannot drift apart without the compile failing.
#pragma once

namespace fa {

// The slots of the scalar score functions' numbers in the params structs (score_values): one, since no build
// combines two of them (jit/params.py SCORE_VALUES; a build that did would raise both).
constexpr int kScoreValues = 1;

struct FwdParams {
  const void* q;  // (batch, seqlen_q, heads_q, head_dim), element strides below, last dim contiguous
  const void* k;  // (batch, seqlen_k, heads_kv, head_dim)
  const void* v;  // (batch, seqlen_k, heads_kv, head_dim)
  void* o;        // (batch, seqlen_q, heads_q, head_dim)
  float* lse;     // (batch, heads_q, seqlen_q) or null when the caller does not want it
  // (batch, 2) int32 [start, end) of the keys each batch row attends (key padding); read only by the kRanged
  // instantiation, null otherwise.
  const int* key_range;

  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long lse_batch_stride, lse_head_stride;  // lse's row stride is 1

  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  int head_dim;      // the problem's head_dim (<= the kernel's compiled kHeadDim; the tail is masked)
  int group;         // heads_q / heads_kv: query head h reads K/V head h / group (GQA/MQA, no copy)
  int num_m_blocks;  // ceil(seqlen_q / kBlockQ)
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e), for the exp2 form of the softmax

  // Attention dropout (read only by the kDropout instantiation; fa/dropout.cuh): the call's hash key,
  // elements whose 16-bit half of their key pair's hash, in the top 16 bits, is below the threshold
  // (round(p 2^16) 2^16) are dropped, the kept ones are scaled by 1 / (1 - p).
  unsigned dropout_key;
  unsigned dropout_threshold;
  float dropout_rp;
  int head_dim_v;  // v's and the output's head_dim (<= the kernel's kHeadDimV; the tail is masked)

  // Debug build only (FA_TRACE, fa/trace.cuh): the buffer the chosen warp writes its intermediates to, which
  // warp that is, and a planted fault. The normal build never reads them (null / 0 from ops).
  float* trace;
  int trace_batch, trace_head, trace_m_block, trace_warp;
  int trace_fault;
  // Sliding window (read only by the WindowMask instantiations, fa/visible_keys.cuh): row i sees keys
  // [i + shift - window_left, i + shift + window_right], both >= 0 (an unbounded side: seqlen_q + seqlen_k).
  int window_left, window_right;
  // Score functions (fa/variant.cuh; read only by their instantiations): the numbers of the build's scalar
  // functions (spec/score_functions.py), the active ones in that table's order from slot 0 (soft-capping's
  // cap > 0), and ALiBi's slopes, slope of (batch b, query head h) at alibi_slopes[b * alibi_batch_stride +
  // h].
  float score_values[kScoreValues];
  const float* alibi_slopes;
  int alibi_batch_stride;
  // Attention sinks: query head h's logit at sinks[h] (float32) joins each row's softmax denominator in the
  // epilogue (fa/softmax.cuh, sink_row); null: none. Read by every build (one branch per row), so sinks add
  // no instantiation.
  const float* sinks;
  // Per-row key ranges (read only by the SegmentMask instantiations, fa/visible_keys.cuh SegmentKeys):
  // query row i sees keys [row_keys[2 i], row_keys[2 i + 1]); key j is seen by query rows
  // [key_rows[2 j], key_rows[2 j + 1]) (the backward's dK/dV side; the same relation).
  const int* row_keys;
  const int* key_rows;
  // A packed batch's query tiles (read only by the warp-specialized forward's segments build, and only when
  // not null; flash_attention/ops/query_tiles.py): tile m covers query rows [q_tiles[2 m],
  // q_tiles[2 m + 1]) of one sequence, at most kBlockQ of them, in the order the tiles are scheduled
  // (longest first); num_m_blocks is the table's length, its unused tail empty tiles. Null: tile m covers
  // rows m kBlockQ .. of the packed row, straddling sequences.
  const int* q_tiles;
  // A packed batch's ALiBi diagonals (read only by the "..._table" score builds, fa/variant.cuh
  // TableDiagonal): query row i's distance is measured from key alibi_diagonal[i] (packed coordinates),
  // for sequences whose diagonal the runs cannot give (without causal, other query and key counts).
  const int* alibi_diagonal;
};

}  // namespace fa
