// The parameters of the TMA (warp-specialized) kernels: the forward's FwdParams plus one tensor map per
// operand the TMA unit loads. Passed by value as the kernel's only argument (__grid_constant__), so the maps
// sit in the parameter space the TMA instruction may address; flash_attention/jit/params.py mirrors the
// layout (FwdTmaParams) and the JIT pins every offset with static_asserts.
#pragma once

#include "fa/bwd_params.h"
#include "fa/params.h"

namespace fa {

// A CUtensorMap (cuTensorMapEncodeTiled): opaque, 128 bytes, 64-byte aligned. Only the TMA unit reads it.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

struct FwdTmaParams {
  FwdParams p;
  // (head_dim, seqlen, heads, batch) views of q, k and v, innermost first; boxes of 64 columns (one
  // 128-byte swizzle panel) by a tile's rows (e4m3: 128 one-byte columns, or head_dim 64's 64 with the
  // 64-byte swizzle; v as V^T, ops/fp8_forward.py).
  TensorMap q_map, k_map, v_map;
  // Configs with tma_store: the (head_dim, seqlen_q, heads_q, batch) view of the output, boxes of 64
  // columns by 64 rows (one consumer warpgroup's staged panel); unused (zeros) otherwise.
  TensorMap o_map;
  // Persistent configs with more tiles than blocks: two ints, zero at launch, that the kernel leaves zero
  // for the next launch on the stream ([0] the tiles taken, [1] the blocks done taking; the fwd_ws kernel
  // says how); null otherwise.
  int* tile_counter;
  // The e4m3 build's descales (read by it alone; ops/fp8_forward.py): float32 on the device, q's, k's and v's
  // factor of (batch b, kv head h) at [b * descale_batch_stride + h * descale_head_stride] (both strides 0:
  // one number for the tensor); null: 1 (no descale given; ops/fp8_forward.py makes a Python number a
  // one-element tensor). After the tile counter, in the struct's 64-byte tail, so no other field moves.
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int descale_batch_stride, descale_head_stride;
};

// The warp-specialized backward's with TMA loads (BwdConfig.tma_loads): BwdParams, then the tensor maps of
// q and dO, (head_dim, seqlen_q, heads_q, batch) views in boxes of 64 columns by the query block's rows. The
// backward's other kernels (preprocessing, dQ's conversion) take BwdParams, the prefix of these bytes.
struct BwdTmaParams {
  BwdParams p;
  TensorMap q_map, do_map;
};

}  // namespace fa
