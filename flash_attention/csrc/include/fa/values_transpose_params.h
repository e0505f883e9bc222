// The values-transpose kernel's parameters (fa/values_transpose.cuh): raw pointers, strides and sizes, no
// torch.
//
// Passed by value as the kernel's only argument; flash_attention/jit/params.py mirrors it with a
// ctypes.Structure (ValuesTransposeParams) and the JIT pins every field's offset with a static_assert.
#pragma once

namespace fa {

struct ValuesTransposeParams {
  const void* v;  // V, (batch, seqlen_k, heads_kv, head_dim), 1-byte elements, head_dim contiguous
  void* vt;       // V^T, (batch, heads_kv, head_dim, keys) contiguous, 1-byte elements
  // V's strides in elements, which are bytes: each a multiple of 16, as V's address is (the host checks).
  long long v_batch_stride, v_row_stride, v_head_stride;
  int batch, seqlen_k, heads_kv;
  int keys;  // V^T's row length: seqlen_k rounded up to a multiple of 16
};

}  // namespace fa
