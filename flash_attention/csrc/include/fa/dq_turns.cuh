// The deterministic backward's order of dQ additions: which query block a dK/dV block visits at each step,
// and whose turn it is to add into that query block's dQ.
//
// Bitwise-repeatable gradients need every element of dQ summed in the same order on every run. The blocks
// (one per K/V block) add their parts of a query block's dQ into an fp32 workspace one at a time, each
// waiting on a semaphore (one per query block and lane, fa/dq_accum.cuh) until it counts the block's rank,
// and counting it up once its addition is complete. The order decides the speed: a block that waits for a
// turn another block takes in the same step waits a whole reduction's latency (the completion of a 16 KB
// bulk reduce-add, about 3 us on an H100 with every multiprocessor adding), and a chain of such waits is a
// reduction per block. So the ranks follow the order in which the blocks reach a query block anyway, which
// makes every wait one for a turn taken a step earlier:
//
// * Walk: block n visits its query blocks upward starting at its own offset, head by head of the group
//   (step it: head it / m_count, query-block index it % m_count). With a row-dependent mask (causal: block n
//   sees query blocks m_begin(n) .. end, m_begin nondecreasing in n) the offset is m_begin(n) and block n + 1
//   reaches every (query block, head) it shares with n at least one step before n does (its walks are no
//   longer). Without one (every block visits all m_count query blocks), block n starts at offset
//   (n - first) m_count / count and wraps around, which spreads the blocks' first steps over the query
//   blocks. Heads outer, as in the atomic mode: with the heads inner (measured, H100, 32 query heads on 8,
//   4k tokens) the blocks of a group, a few query blocks apart, read all of the group's Q and dO at once,
//   4x what L2 then has to hold, and the kernel ran at 0.68x the atomic one.
// * Rank: a query block's visitors take turns in the order they arrive: descending block index. A wrapped
//   walk's second part (the query blocks below its offset) arrives after every unwrapped visit of the same
//   query block and before no one's, so it adds into a second accumulator, lane 1, in descending order too;
//   the convert kernel sums lane 0 and lane 1 in that order.
// * No deadlock: block n only ever waits for blocks of higher index, and the deterministic kernels map
//   blockIdx.x to block gridDim.x - 1 - blockIdx.x, so those were dispatched first (blocks are dispatched in
//   index order, the same assumption as every turn-taking scheme) and either run or are done.
#pragma once

#include "fa/block_range.cuh"
#include "fa/ptx.cuh"

namespace fa {

// One step's place in the order: query block m (an index from block 0), the accumulator lane, the rank.
struct DqTurn {
  int m, lane, rank;
};

template <int BR, int BC, class Mask>
struct DqTurns {
  int n_block, m_begin, m_count;
  int first, count;  // the visitors of every query block (masks that are not row-dependent)
  int offset;        // the walk's first query block, from m_begin

  template <class Blocks>
  __device__ __forceinline__ DqTurns(const Mask& mask, const Blocks& blocks, int n_block_)
      : n_block(n_block_), m_begin(blocks.begin), m_count(blocks.count), first(0), count(1), offset(0) {
    if constexpr (!Mask::kRowDependent) {
      const auto visitors = mask.template kv_blocks<BC>(0, BR);  // the same for every query block
      first = visitors.begin;
      count = max(1, visitors.end - visitors.begin);
      offset = m_count > 0 ? (n_block - first) * m_count / count : 0;
    }
  }

  // The query head of step `it` within the group.
  __device__ __forceinline__ int head(int it) const { return it / m_count; }

  // The query block of step `it` (an index from block 0).
  __device__ __forceinline__ int q_block(int it) const {
    int i = offset + it % m_count;
    if (i >= m_count) i -= m_count;
    return m_begin + i;
  }

  __device__ __forceinline__ DqTurn turn(const Mask& mask, int it) const {
    const int i = offset + it % m_count;
    DqTurn d;
    if constexpr (Mask::kRowDependent) {
      d.m = m_begin + i;
      d.lane = 0;
      // Every visitor of query block m walks from its own m_begin: the last visitor arrives first.
      d.rank = mask.template kv_blocks<BC>(d.m * BR, BR).end - 1 - n_block;
    } else if (i < m_count) {
      d.m = i;
      d.lane = 0;
      // The visitors whose offset is at most m, last first: first .. first + last_unwrapped.
      const int last_unwrapped = min(count - 1, ((i + 1) * count - 1) / m_count);
      d.rank = first + last_unwrapped - n_block;
    } else {
      d.m = i - m_count;
      d.lane = 1;
      d.rank = first + count - 1 - n_block;
    }
    return d;
  }
};

}  // namespace fa
