// The FP8 cast kernels' parameters (fa/fp8_cast.cuh): raw pointers, strides and sizes, no torch.
//
// Passed by value as the kernels' only argument; flash_attention/jit/params.py mirrors it with a
// ctypes.Structure (Fp8CastParams) and the JIT pins every field's offset with a static_assert.
#pragma once

namespace fa {

struct Fp8CastParams {
  const void* src;  // (batch, seqlen, heads, head_dim), head_dim contiguous: bf16/fp16/fp32, or e4m3
  void* dst;        // (batch, seqlen, heads, head_dim) contiguous: e4m3 (quantize) or bf16 (dequantize)
  // (batch, heads_kv): each kv head's amax of |x| as float bits (an unsigned max orders non-negative floats
  // as floats, NaN above inf), zeroed by the host before the amax pass, which raises them; quantize reads.
  unsigned* amax;
  // (batch, heads_kv) float32: quantize writes each kv head's descale; dequantize reads one per kv head
  // (descale_per_head), or descale[0] for all, or takes 1 where it is null.
  float* descale;
  long long src_batch_stride, src_row_stride, src_head_stride;  // in elements, multiples of 8 (the host checks)
  int batch, seqlen, heads, heads_kv, head_dim;                  // head_dim a multiple of 8
  int rows_per_block;                                            // a block: one (batch, head), these rows
  int descale_per_head;
};

}  // namespace fa
