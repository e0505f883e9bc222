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

// Row b's length before the append: its cache_seqlens entry, or the call's one length for every row.
__device__ __forceinline__ int cache_length(const DecodeParams& p, int batch) {
  return p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlen;
}

// Row b's first cache row in a contiguous cache: its cache_starts entry, or 0.
__device__ __forceinline__ int cache_start(const DecodeParams& p, int batch) {
  return p.cache_starts != nullptr ? p.cache_starts[batch] : 0;
}

// Row b's key count after the append, or -1 when its length is out of range (or, from a start, past the
// cache's end: capacity counts rows from the buffer's start).
__device__ __forceinline__ int cache_keys(const DecodeParams& p, int batch) {
  const int before = cache_length(p, batch);
  const int n = before + p.seqlen_new;
  const int start = cache_start(p, batch);
  return (before < 0 || start < 0 || n > p.capacity - start || n < before) ? -1 : n;
}

// Element offsets of cache position j of one (batch row, K/V head) in K and in V; false when the position's
// page index lies outside the cache (the offsets are then unusable).
template <bool kPaged>
struct CachePositions {
  const int* table;  // the row's block_table entries (paged)
  i64 k_row, v_row;  // strides between positions (within a page)
  // A contiguous row's first cache row (cache_starts; 0 without them), added to every position here, not to
  // the loader's K/V base pointers: that form spilled the head_dim-256, 16-row decode kernels (sm_80 36
  // bytes, sm_90 12), which sit at 254-255 registers; one int here does not.
  int first;
  i64 k_page, v_page;  // strides between pages (paged) or 0
  int page_size, num_pages;
  int page_shift;  // log2(page_size) when it is a power of two (every size serving engines use), else -1

  __device__ __forceinline__ CachePositions(const DecodeParams& p, int batch)
      : table(kPaged ? p.block_table + (i64)batch * p.block_table_stride : nullptr),
        k_row(p.k_row_stride),
        v_row(p.v_row_stride),
        k_page(kPaged ? p.k_batch_stride : 0),
        v_page(kPaged ? p.v_batch_stride : 0),
        page_size(p.page_size),
        num_pages(p.num_pages),
        page_shift(__popc(p.page_size) == 1 ? __ffs(p.page_size) - 1 : -1),
        first(kPaged ? 0 : cache_start(p, batch)) {}

  // Position j's page-table entry and its slot in that page. A shift and a mask for power-of-two page sizes:
  // the general division is a ~20-instruction sequence, paid per row of every tile by the warps that also
  // do the math (they issue the copies), which delays the copies.
  __device__ __forceinline__ int entry_of(int j) const {
    return page_shift >= 0 ? j >> page_shift : j / page_size;
  }
  __device__ __forceinline__ int slot_of(int j, int entry) const { return j - entry * page_size; }

  // Entry e of the row's page table: a page of the cache, or -1 when the entry lies outside it.
  __device__ __forceinline__ int page_entry(int e) const {
    // The page table is read by every K/V head's blocks and every split that covers the position: it
    // stays in L1/L2. A plain load, not the non-coherent path (__ldg): a call's first kernel may be queued
    // programmatically (ops.decode), so the kernel that wrote the table may still be running when this one
    // starts; its grid_dependency_wait makes that kernel's writes visible to coherent loads only.
    const int page = table[e];
    return page < 0 || page >= num_pages ? -1 : page;
  }

  // Offsets of position j, which lies in page `page` (a page of the cache).
  __device__ __forceinline__ void offsets_in_page(int page, int j, int entry, i64& k_off, i64& v_off) const {
    const int slot = slot_of(j, entry);
    k_off = (i64)page * k_page + (i64)slot * k_row;
    v_off = (i64)page * v_page + (i64)slot * v_row;
  }

  __device__ __forceinline__ bool offsets(int j, i64& k_off, i64& v_off) const {
    if constexpr (!kPaged) {
      // (first + j <= capacity, an int: cache_keys bounds a row's keys by the rows after its start)
      k_off = (i64)(first + j) * k_row;
      v_off = (i64)(first + j) * v_row;
      return true;
    } else {
      const int entry = entry_of(j);
      const int page = page_entry(entry);
      if (page < 0) return false;
      offsets_in_page(page, j, entry, k_off, v_off);
      return true;
    }
  }
};

// The page-table entries of the streamed K/V tiles, requested into a ring of shared-memory slots ahead of
// the tiles' copies.
//
// Why ahead: a tile's copies cannot be issued before its positions' pages are known, so looking a page up at
// issue time puts a dependent global load (an L2 round trip) in front of every tile's cp.async -- measured
// on an H100 (bf16, head_dim 128, 32/8 heads), that halved the paged decode's bandwidth (1.3-1.6 TB/s
// against 2.8-3.1 contiguous, page sizes 16 and 256 alike). Issuing a tile then reads shared memory only.
//
// Why cp.async, not a load into a register stored later: a load's register is waited on by whatever first
// uses it (a range check, the store, a register copy), within the iteration that loaded it, and the load
// queues behind the block's own streaming copies -- when it missed L1 it took about as long as a tile's
// bytes. Measured on an H100 (bf16, 32/8 heads, head_dim 128, split to one block per SM, so that no second
// block hid the wait), the decode took 1.13x the contiguous time at page 16 and 1.24x at page 8, the excess
// growing as the table lines a block crosses (one 128-byte line serves page_size / 2 tiles of 64 keys),
// where pages of 128-256 positions took 1.02-1.03x; a sequential table (the contiguous cache's very
// addresses) cost as much as a random one, so it was not the pages' placement. cp.async writes the entry
// into its slot with the iteration's commit group, and the ring's cp_async_wait and barrier publish it.
//
// How far ahead: a main loop over a kStages-deep K/V ring waits, at iteration i, for the commit groups up
// to iteration i - kStages + 1's, and issues tile i + kStages - 1's copies; so entries requested at
// iteration t are readable from iteration t + kStages - 1 on, by the copies of tile t + 2 * kStages - 2.
// That is kLead tiles ahead. A ring that refills first (kRefillFirst: iteration i issues tile
// i + kStages - 1's copies before it waits for tile i's, so the copies it reads the entries for have seen
// the waits of iteration i - 1 only) reads them one iteration later: a lead one tile longer. The prologue
// fetches tiles 0 .. kLead - 1 (one round trip, published by its barrier); iteration t requests tile
// t + kLead. The live slots at iteration t hold tiles t + kStages - 1 (read by this iteration's copies) to
// t + kLead (requested now), and the prologue's kLead at once, so kSlots = kLead + 1 slots, each reused
// only after the barrier that follows its last read.
//
// A tile of kBlockKV positions from `start` spans at most kBlockKV entries (page_size >= 1), from entry
// start / page_size on: thread i < kBlockKV requests the i-th. An entry that covers no position below k_hi
// is not read (its slot gets a zero, never used). The entries are stored as the table holds them and
// checked where a copy reads them: one outside the cache flags the row bad and its positions are zero-filled,
// never followed. A contiguous cache has no entries: every member compiles away.
template <bool kPaged, int kBlockKV, int kStages, bool kRefillFirst = false>
struct TilePageRing {
  static constexpr int kLead = 2 * kStages - (kRefillFirst ? 1 : 2);
  static constexpr int kSlots = kLead + 1;
  static constexpr int kBytes = kSlots * kBlockKV * 4;  // shared memory (kept for contiguous caches too)

  int* slots;  // kSlots * kBlockKV ints; tile t's entries in slot t % kSlots

  __device__ __forceinline__ explicit TilePageRing(int* shared) : slots(shared) {}

  // Whether thread `tid` has an entry of the tile starting at `start`, and which (its index in the table).
  __device__ __forceinline__ bool entry_index(const CachePositions<kPaged>& pos, int start, int k_hi, int tid,
                                              int& e) const {
    e = pos.entry_of(start) + tid;
    return tid < kBlockKV && start < k_hi && e * pos.page_size < k_hi;
  }

  // The prologue's part: tiles 0 .. kLead - 1's entries, loaded together and stored; the caller's barrier
  // publishes them.
  __device__ __forceinline__ void prologue(const CachePositions<kPaged>& pos, int k_lo, int k_hi, int tid) const {
    if constexpr (kPaged) {
      int entry[kLead];
#pragma unroll
      for (int t = 0; t < kLead; ++t) {
        int e;
        entry[t] = entry_index(pos, k_lo + t * kBlockKV, k_hi, tid, e) ? pos.table[e] : 0;  // (plain: page_entry)
      }
#pragma unroll
      for (int t = 0; t < kLead; ++t) {
        if (tid < kBlockKV) slots[(t % kSlots) * kBlockKV + tid] = entry[t];
      }
    }
  }

  // Main-loop iteration t, after its barrier and before its commit: tile t + kLead's entries into their
  // slot, landing with this iteration's commit group. (The table is read by every K/V head's blocks and
  // every split that covers the position: .ca keeps it in L1.)
  __device__ __forceinline__ void request(const CachePositions<kPaged>& pos, int t, int k_lo, int k_hi,
                                          int tid) const {
    if constexpr (kPaged) {
      if (tid >= kBlockKV) return;
      const int u = t + kLead;
      int e;
      const bool ok = entry_index(pos, k_lo + u * kBlockKV, k_hi, tid, e);
      cp_async_4(smem_addr(slots + (u % kSlots) * kBlockKV + tid), ok ? pos.table + e : pos.table, ok ? 4 : 0);
    }
  }

  // Offsets of position j of tile t (which starts at `start`); false when its page lies outside the cache.
  __device__ __forceinline__ bool offsets(const CachePositions<kPaged>& pos, int t, int start, int j,
                                          i64& k_off, i64& v_off) const {
    if constexpr (!kPaged) {
      return pos.offsets(j, k_off, v_off);
    } else {
      const int entry = pos.entry_of(j);
      const int page = slots[(t % kSlots) * kBlockKV + entry - pos.entry_of(start)];
      if (page < 0 || page >= pos.num_pages) return false;
      pos.offsets_in_page(page, j, entry, k_off, v_off);
      return true;
    }
  }
};

}  // namespace fa
