// Which (key block, K/V head, batch row) a dK/dV block computes: the order in which the GPU starts them.
//
// The dK/dV grid is (key blocks, K/V heads, batch rows), and blocks start in the order of their linear
// index, key blocks fastest. Under a causal mask key block n walks the query blocks from its diagonal on,
// so the work of a (head, batch row)'s blocks falls from the first to the last, and the grid's last blocks
// to start include a whole (head, batch row)'s heaviest one: the multiprocessors that finish early wait for
// it. A list-scheduling model of the H100/H200 grids (132 multiprocessors, one block each, the work of a
// block its query blocks plus one for its fixed cost) put that tail at 13% of the kernel at (4, 1024, 32,
// 128), 7% at 16 x 1k and 4 x 4k with 16 heads, 1% at 16k.
//
// With p.kv_block_group = G > 0 the linear index is read differently: the (head, batch row) pairs form
// groups of G, a group's blocks start together, and within a group every pair's key block 0 starts before
// any pair's key block 1, and so on: the heaviest first, so the grid ends on its lightest blocks (the same
// model: 1-3% at those shapes). G bounds how many heads' queries and output gradients the running blocks
// read at once, which the host sizes to stay in L2 (flash_attention/ops/backward.py: _kv_block_group);
// longest-first over the whole grid would have every running block read another head's. G = 0 keeps the
// natural order (no causal mask: every block has the same work; the deterministic kernels, whose turns
// need their own order, fa/dq_turns.cuh; a packed batch's key tiles, which its table already lists
// longest first).
#pragma once

#include "fa/bwd_params.h"

namespace fa {

struct KvBlock {
  int n_block, kv_head, batch;
};

// kReversed: the deterministic kernels' order, the last key block first (fa/dq_turns.cuh). kGrouped: a
// build that reads p.kv_block_group (the causal ones); the others compile the grid's own order, so that
// the block's coordinates stay special registers ptxas may read again instead of holding them.
template <bool kReversed, bool kGrouped>
__device__ __forceinline__ KvBlock kv_block_of(const BwdParams& p) {
  if (kReversed) return {(int)(gridDim.x - 1 - blockIdx.x), (int)blockIdx.y, (int)blockIdx.z};
  const int group = kGrouped ? p.kv_block_group : 0;
  if (group <= 0) return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
  const int n_blocks = gridDim.x, heads = gridDim.y;
  const int linear = blockIdx.x + n_blocks * (blockIdx.y + heads * blockIdx.z);
  const int per_group = group * n_blocks;
  const int g = linear / per_group;
  const int r = linear - g * per_group;
  const int pairs = heads * gridDim.z;
  const int in_group = min(group, pairs - g * group);  // the last group may hold fewer pairs
  const int pair = g * group + r % in_group;
  return {r / in_group, pair % heads, pair / heads};
}

}  // namespace fa
