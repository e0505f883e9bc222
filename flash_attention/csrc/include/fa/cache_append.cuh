// The KV-cache append: new token t of batch row b goes to cache position cache_seqlens[b] + t
// (fa/kv_cache.cuh says where that is), for K and V, before the decode kernel reads the cache. A row whose
// length is out of range writes nothing (the decode kernel poisons its output), and a position behind a
// page index outside the cache is skipped (the decode kernel poisons the row when it reaches it): nothing
// is ever written outside the cache.
//
// Grid (seqlen_new, batch); the block's threads copy the token's heads_kv x head_dim elements of K and V in
// 16-byte chunks, consecutive threads on consecutive chunks of a head.
#pragma once

#include "fa/decode_params.h"
#include "fa/kv_cache.cuh"
#include "fa/ptx.cuh"

namespace fa {

template <bool kPaged, int kThreads>
__device__ __forceinline__ void cache_append_body(const DecodeParams& p) {
  const int token = blockIdx.x;
  const int batch = blockIdx.y;
  if (cache_keys(p, batch) < 0) return;
  const int j = cache_length(p, batch) + token;
  const CachePositions<kPaged> positions(p, batch);
  i64 k_off, v_off;
  if (!positions.offsets(j, k_off, v_off)) return;
  if constexpr (!kPaged) {
    k_off += (i64)batch * p.k_batch_stride;  // (a row's start is in positions' offsets)
    v_off += (i64)batch * p.v_batch_stride;
  }
  const int chunks = p.head_dim / 8;
  const u16* kn = static_cast<const u16*>(p.k_new) + (i64)batch * p.kn_batch_stride + (i64)token * p.kn_row_stride;
  const u16* vn = static_cast<const u16*>(p.v_new) + (i64)batch * p.vn_batch_stride + (i64)token * p.vn_row_stride;
  u16* k = static_cast<u16*>(p.k) + k_off;
  u16* v = static_cast<u16*>(p.v) + v_off;
  for (int idx = threadIdx.x; idx < p.heads_kv * chunks; idx += kThreads) {
    const int head = idx / chunks, c = 8 * (idx % chunks);
    st_global_16(k + (i64)head * p.k_head_stride + c, ld_global_16(kn + (i64)head * p.kn_head_stride + c));
    st_global_16(v + (i64)head * p.v_head_stride + c, ld_global_16(vn + (i64)head * p.vn_head_stride + c));
  }
}

}  // namespace fa
