// Where a KV cache keeps a row's keys, and whether a row's length may be trusted: written once for the
// append kernel and every decode kernel.
//
// Position j of batch row b lives at k[b, j] in a contiguous cache and at k[block_table[b, j / page_size],
// j % page_size] in a paged one. The lengths and the page table are device data the host never reads (a
// decode step replayed as a CUDA graph cannot synchronise), so the kernels check them: a row whose length is
// negative or whose new tokens do not fit is neither written nor attended, and a page index outside the
// cache is never followed. Such a row's output and LSE are NaN (fa/decode_fwd.cuh): loud, never a silently
// wrong answer, and nothing is read or written outside the cache.
#pragma once

#include "fa/decode_params.h"
#include "fa/ptx.cuh"

namespace fa {

// Row b's key count after the append, or -1 when its cache_seqlens entry is out of range.
__device__ __forceinline__ int cache_keys(const DecodeParams& p, int batch) {
  const int before = p.cache_seqlens[batch];
  const int n = before + p.seqlen_new;
  return (before < 0 || n > p.capacity || n < before) ? -1 : n;
}

// Element offsets of cache position j of one (batch row, K/V head) in K and in V; false when the position's
// page index lies outside the cache (the offsets are then unusable).
template <bool kPaged>
struct CachePositions {
  const int* table;  // the row's block_table entries (paged)
  i64 k_row, v_row;  // strides between positions (within a page)
  i64 k_page, v_page;  // strides between pages (paged) or 0
  int page_size, num_pages;

  __device__ __forceinline__ CachePositions(const DecodeParams& p, int batch)
      : table(kPaged ? p.block_table + (i64)batch * p.block_table_stride : nullptr),
        k_row(p.k_row_stride),
        v_row(p.v_row_stride),
        k_page(kPaged ? p.k_batch_stride : 0),
        v_page(kPaged ? p.v_batch_stride : 0),
        page_size(p.page_size),
        num_pages(p.num_pages) {}

  __device__ __forceinline__ bool offsets(int j, i64& k_off, i64& v_off) const {
    if constexpr (!kPaged) {
      k_off = (i64)j * k_row;
      v_off = (i64)j * v_row;
      return true;
    } else {
      const int slot = j % page_size;
      // The page table is read by every K/V head's blocks and every split that covers the position: it
      // stays in L1/L2, the non-coherent path is fine for data no kernel of the call writes.
      const int page = __ldg(table + j / page_size);
      if (page < 0 || page >= num_pages) return false;
      k_off = (i64)page * k_page + (i64)slot * k_row;
      v_off = (i64)page * v_page + (i64)slot * v_row;
      return true;
    }
  }
};

}  // namespace fa
