// The decode kernels' parameters (split-KV attention against a KV cache, its combine, and the cache append):
// raw pointers, strides and sizes, no torch.
//
// Passed by value as each kernel's only argument; flash_attention/jit/params.py mirrors it with a
// ctypes.Structure and the JIT pins every field's offset with a static_assert, as for FwdParams.
#pragma once

namespace fa {

struct DecodeParams {
  const void* q;  // (batch, seqlen_q, heads_q, head_dim)
  // The cache. Contiguous: (batch, capacity, heads_kv, head_dim), k_batch_stride apart per batch row.
  // Paged: (num_pages, page_size, heads_kv, head_dim), k_batch_stride apart per page.
  void* k;
  void* v;
  const void* k_new;  // (batch, seqlen_new, heads_kv, head_dim): the append kernel's source; null without
  const void* v_new;
  void* o;     // (batch, seqlen_q, heads_q, head_dim), written by the decode kernel when num_splits == 1,
               // else by the combine kernel
  float* lse;  // (batch, heads_q, seqlen_q) or null
  // num_splits > 1: each split's normalised output and LSE, (num_splits, batch, heads_q, seqlen_q, kHeadDim)
  // and (num_splits, batch, heads_q, seqlen_q), fp32; the combine kernel merges them.
  float* o_partial;
  float* lse_partial;
  // (batch,) each row's length before the append; null when every row has the same length, cache_seqlen (an
  // int length from the caller: passed by value, so no fill kernel runs and no device buffer is needed).
  const int* cache_seqlens;
  const int* block_table;    // (batch, max_pages), block_table_stride apart; null for a contiguous cache
  // Contiguous caches only: (batch,) the cache row where each batch row's position 0 lies, so that rows may
  // share one buffer at other offsets (k_batch_stride 0: a packed batch's keys, attention_varlen's route to
  // these kernels); null: 0 for every row.
  const int* cache_starts;
  // num_splits > 1: one arrival counter per (batch, K/V head, row block), zero before the call and left zero
  // after it: the last split block of a row block to finish merges the splits (fa/decode_combine.cuh) and
  // resets its counter. Null: a separate combine kernel merges them.
  int* split_counters;

  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long kn_batch_stride, kn_row_stride, kn_head_stride;  // k_new
  long long vn_batch_stride, vn_row_stride, vn_head_stride;  // v_new
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long lse_batch_stride, lse_head_stride;
  long long block_table_stride;

  int batch, heads_q, heads_kv, seqlen_q;
  int head_dim;    // the problem's (<= the compiled kHeadDim, a multiple of 8)
  int group;       // heads_q / heads_kv
  int seqlen_new;  // tokens appended per row: row b attends cache_seqlens[b] + seqlen_new keys
  int cache_seqlen;  // every row's length before the append when cache_seqlens is null
  int capacity;    // keys one row can hold: the contiguous cache's length, or max_pages * page_size
  int page_size;   // 0 for a contiguous cache
  int num_pages;   // pages in a paged cache: a block_table entry outside [0, num_pages) is never followed
  int rows;            // seqlen_q * group: the query rows of one K/V head, packed (fa/decode_rows.cuh)
  int num_m_blocks;    // ceil(rows / kBlockM)
  int num_splits;      // thread blocks sharing one row's keys
  int keys_per_split;  // a multiple of kBlockKV
  float scale;         // softmax scale
  // A sliding window about each query's diagonal (query i of a row of n keys sees keys up to i + n -
  // seqlen_q under causal): keys diag - window_left .. diag + window_right; -1 leaves that side unbounded.
  int window_left, window_right;
  // Logit soft-capping (Gemma 2): scores s -> softcap * tanh(s / softcap) before the softmax; 0: none.
  float softcap, softcap_inv;
  // ALiBi (float32 slopes, one per (batch row, query head): alibi_batch_stride 0 for a (heads_q,) table):
  // each score s -> s - slope |diag - key|, aligned like causal, after the cap when both are set; null: none.
  const float* alibi_slopes;
  long long alibi_batch_stride;
};

}  // namespace fa
