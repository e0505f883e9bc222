// The tile schedule of the warp-specialized forward: which query tile (m block, head, batch) a block works
// on, its rows and K/V blocks, and, persistent, which tile the block takes next.
//
// Non-persistent: the block's one tile, from blockIdx. Persistent: block b starts with tile b and then
// takes the next tile nobody has taken (tp.tile_counter, zeroed per launch: an atomic add by the producer),
// in the non-persistent grid's order. The tiles in flight at any time are then a window of consecutive
// tiles, as the hardware's own block scheduler would run them: the K/V heads they read stay in L2, and a
// block that drew short causal tiles takes more of them. (A static stride, block b taking b, b + gridDim.x,
// ..., lost 3-35% on causal shapes: kernel-log step 30.) The producer decides and tells the consumers
// through shared memory (FwdWsSmem::s_tile), published by its arrival on q_full; an index past the last
// tile tells them to stop.
//
// Contract: the scheduler holds no state that changes, only two values of the params it computes once (it
// is passed by value, and the params come with each call: a copy of a pointer to them would be, to the
// compiler, another pointer whose fields every asm statement might change). The producer draws
// (first_tile, draw, retire) and publishes each tile's index; both roles map an index to the same tile,
// rows and K/V blocks (tile_at, rows_of, blocks_of), so the consumers consume exactly the loads the
// producer issued, in its order.
#pragma once

#include "fa/block_range.cuh"
#include "fa/params.h"
#include "fa/tma_params.h"
#include "fa/variant.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class Mask>
struct FwdWsScheduler {
  static constexpr int BR = Cfg::kBlockQ;
  static constexpr int BC = Cfg::kBlockKV;
  // A packed batch (the segments build) with a tile table (p.q_tiles, FwdParams says what it holds): tile m
  // is rows [q_tiles[2 m], q_tiles[2 m + 1]) of one sequence, in the table's order (longest first), and
  // its K/V blocks are anchored at its first visible key (fa/block_range.cuh, kv_blocks_anchored), so that
  // no tile straddles two sequences' rows nor a block two sequences' keys. Without a table, tile m is
  // rows m BR .. of the packed row, as in a dense batch.
  static constexpr bool kSegments = MaskIsSegments<Mask>::value;

  struct Tile {
    int m_block, head, batch;
  };
  struct Rows {
    int start, count;  // the tile's first query row and how many of its BR rows are its own
  };

  const int num_tiles;
  const bool seq_tiles;

  __device__ __forceinline__ explicit FwdWsScheduler(const FwdParams& p)
      : num_tiles(p.num_m_blocks * p.heads_q * p.batch), seq_tiles(kSegments && p.q_tiles != nullptr) {}

  __device__ __forceinline__ Tile tile_at(const FwdParams& p, int tile) const {
    if constexpr (!Cfg::kPersistent) return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
    const int bh = tile / p.num_m_blocks;
    return {tile - bh * p.num_m_blocks, bh % p.heads_q, bh / p.heads_q};
  }
  // (Where later query blocks see more keys, causal: the longest, the last ones, first.)
  __device__ __forceinline__ int m_block_of(const FwdParams& p, const Tile& x) const {
    return Mask::kRowDependent ? p.num_m_blocks - 1 - x.m_block : x.m_block;
  }
  __device__ __forceinline__ Rows rows_of(const FwdParams& p, const Tile& x) const {
    if constexpr (kSegments) {
      if (seq_tiles) {
        const int start = __ldg(p.q_tiles + 2 * x.m_block);
        return {start, min(__ldg(p.q_tiles + 2 * x.m_block + 1) - start, BR)};
      }
    }
    const int start = m_block_of(p, x) * BR;
    return {start, min(BR, p.seqlen_q - start)};
  }
  // The K/V blocks of a tile's rows, and the key at which block 0 starts (`origin`).
  __device__ __forceinline__ auto blocks_of(const Mask& mask, const Rows& rows, int& origin) const {
    origin = 0;
    if constexpr (kSegments) {
      if (seq_tiles) return kv_blocks_anchored<BC>(mask.keys, rows.start, rows.count, origin);
    }
    return mask.template kv_blocks<BC>(rows.start, rows.count);
  }

  // The producer's side. Its first tile:
  __device__ __forceinline__ int first_tile() const { return Cfg::kPersistent ? (int)blockIdx.x : 0; }
  // The tile after this one, asked for now so the atomic's round trip hides behind this tile's loads.
  // (With no more tiles than blocks there is no counter: ops passes none.)
  __device__ __forceinline__ int draw(const FwdTmaParams& tp) const {
    return Cfg::kPersistent && (int)gridDim.x < num_tiles ? (int)gridDim.x + atomicAdd(tp.tile_counter, 1)
                                                          : num_tiles;
  }
  // After the producer has published the stop sign. The counter is the stream's, kept by ops from launch
  // to launch (a fill kernel per call cost a launch: 2.4 us beside a 280 us kernel at 1k tokens). Each
  // block's producer draws until it gets a stop sign, then counts itself done in tile_counter[1]; the last
  // one finds every draw made and zeroes both for the next launch, which stream order puts after this one.
  __device__ __forceinline__ void retire(const FwdTmaParams& tp) const {
    if ((int)gridDim.x < num_tiles) {
      __threadfence();  // this block's last draw is performed before it counts itself done
      if (atomicAdd(tp.tile_counter + 1, 1) == (int)gridDim.x - 1) {
        tp.tile_counter[0] = 0;
        tp.tile_counter[1] = 0;
      }
    }
  }
};

}  // namespace sm90
}  // namespace fa
