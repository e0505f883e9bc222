// The LSE merge kernel's parameters (fa/lse_merge.cuh): raw pointers, element strides and sizes, no torch.
//
// Passed by value as the kernel's only argument; flash_attention/jit/params.py mirrors it with a
// ctypes.Structure (LseMergeParams) and the JIT pins every field's offset with a static_assert.
#pragma once

namespace fa {

struct LseMergeParams {
  float* out;             // the running output, fp32, (batch, rows, heads, head_dim), columns contiguous
  float* lse;             // the running LSE, fp32, (batch, heads, rows), rows contiguous
  const void* part;       // the part's output, (batch, rows, heads, head_dim) in its own dtype
  const float* part_lse;  // the part's LSE, fp32, (batch, heads, rows), rows contiguous
  long long out_batch_stride, out_row_stride, out_head_stride;
  long long lse_batch_stride, lse_head_stride;
  long long part_batch_stride, part_row_stride, part_head_stride;
  long long part_lse_batch_stride, part_lse_head_stride;
  int batch, rows, heads, head_dim;
};

}  // namespace fa
