// attention(fp8=True)'s casts as kernels (flash_attention/ops/fp8_cast.py says where they run): the per
// (batch, kv head) quantization of bf16/fp16/fp32 q, k and v to e4m3 with a power-of-two descale, and the
// dequantization of e4m3 tensors to bf16 for the backward. Both compute exactly what spec.fp8's PyTorch
// forms compute on a GPU, bit for bit (tests/test_gpu_fp8_cast.py compares the bytes): those forms are
// about ten elementwise kernels and reductions for each of the three tensors, which cost a training step
// more GPU and host time than its e4m3 forward saved (kernel log 169 has the profile).
//
// Quantizing is two passes over the input, each one launch for a tensor: the amax pass (fp8_amax_body)
// reads every element once and raises its kv head's amax by an atomic max; the converting pass
// (fp8_quantize_body) turns each kv head's amax into the descale and its inverse, as spec.fp8.quantize
// does, and writes the e4m3 tensor (and, once per kv head, the descale). Dequantizing (fp8_dequantize_body)
// is one pass. A block takes rows_per_block rows of one (batch, head): grid (row blocks, heads, batch);
// a thread takes eight consecutive elements of a row at a time (16-byte loads of 16-bit inputs), so
// head_dim, the strides and the address are multiples of eight elements (the host checks, and takes
// spec.fp8's forms otherwise).
#pragma once

#include "fa/fp8_cast_params.h"
#include "fa/ptx.cuh"

namespace fa {

// The source element types, as entry points are named for them.
enum Fp8CastSource { kCastBF16 = 0, kCastFP16 = 1, kCastFP32 = 2 };

constexpr float kE4m3Max = 448.f;  // e4m3's largest finite value (spec.fp8.E4M3_MAX)

// Eight consecutive source elements from `src` (eight-element aligned) as floats, exactly.
template <int kSrc>
__device__ __forceinline__ void load8_as_float(const void* src, float (&x)[8]) {
  if constexpr (kSrc == kCastFP32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(src));
    const float4 b = __ldg(reinterpret_cast<const float4*>(src) + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(src));
    unpack2<kSrc == kCastBF16>(w.x, x[0], x[1]);
    unpack2<kSrc == kCastBF16>(w.y, x[2], x[3]);
    unpack2<kSrc == kCastBF16>(w.z, x[4], x[5]);
    unpack2<kSrc == kCastBF16>(w.w, x[6], x[7]);
  }
}

// The element size of a source type, in bytes.
template <int kSrc>
__host__ __device__ constexpr int cast_source_bytes() {
  return kSrc == kCastFP32 ? 4 : 2;
}

// The block's (batch, head) and rows: where its source rows start, and how many eight-element items it has.
struct CastBlock {
  int batch, head, kv_head, row0, items, per_row;
  __device__ __forceinline__ explicit CastBlock(const Fp8CastParams& p) {
    batch = blockIdx.z;
    head = blockIdx.y;
    kv_head = head / (p.heads / p.heads_kv);
    row0 = blockIdx.x * p.rows_per_block;
    per_row = p.head_dim / 8;
    items = min(p.rows_per_block, p.seqlen - row0) * per_row;
  }
  // Item i's source element offset (row and column of the block's rows), and its contiguous one.
  __device__ __forceinline__ i64 src_offset(const Fp8CastParams& p, int row, int col) const {
    return batch * p.src_batch_stride + (i64)(row0 + row) * p.src_row_stride + head * p.src_head_stride + 8 * col;
  }
  __device__ __forceinline__ i64 dst_offset(const Fp8CastParams& p, int row, int col) const {
    return (((i64)batch * p.seqlen + row0 + row) * p.heads + head) * p.head_dim + 8 * col;
  }
};

// The amax pass: the block's largest |x| raised into its kv head's amax. |x| as float bits compares as the
// float does (non-negative), and a NaN (its sign cleared) above inf, so the amax is NaN where any element
// is, as torch.amax's.
template <int kSrc>
__device__ __forceinline__ void fp8_amax_body(const Fp8CastParams& p) {
  __shared__ u32 warp_max[32];
  const CastBlock blk(p);
  const char* src = static_cast<const char*>(p.src);
  u32 m = 0;
  for (int i = threadIdx.x; i < blk.items; i += blockDim.x) {
    const int row = i / blk.per_row, col = i - row * blk.per_row;
    float x[8];
    load8_as_float<kSrc>(src + blk.src_offset(p, row, col) * cast_source_bytes<kSrc>(), x);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, __float_as_uint(fabsf(x[j])));
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();  // (every warp's maximum in shared memory before warp 0 reads them)
  if (threadIdx.x < 32) {
    m = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
    if (threadIdx.x == 0) atomicMax(p.amax + blk.batch * p.heads_kv + blk.kv_head, m);
  }
}

// spec.fp8.quantize's descale and its inverse from a kv head's amax, as PyTorch computes them on a GPU:
// amax / 448 taken as amax times float32's 1 / 448 (PyTorch's CUDA division by a scalar), frexp's exponent
// less one where the mantissa is exactly 0.5, at least -126; 1 for an amax of 0, NaN for inf or NaN.
__device__ __forceinline__ void fp8_descales(float amax, float& descale, float& inverse) {
  int e;
  const float m = frexpf(amax * (1.f / kE4m3Max), &e);
  e = max(e - (m == 0.5f ? 1 : 0), -126);
  const bool finite = isfinite(amax), positive = amax > 0.f;
  descale = finite ? (positive ? ldexpf(1.f, e) : 1.f) : __int_as_float(0x7fffffff);
  inverse = finite ? (positive ? ldexpf(1.f, -e) : 1.f) : __int_as_float(0x7fffffff);
}

// x * inverse as spec.fp8.quantize takes it (bf16 inputs: the product rounded to bf16, as PyTorch's bf16
// multiply rounds its float32 product; exact but for values that fall under bf16's normal range), then
// clamped to +-448 with NaN kept (clamp_ keeps it; fminf/fmaxf would not).
template <int kSrc>
__device__ __forceinline__ float scaled_for_e4m3(float x, float inverse) {
  float y = x * inverse;
  if constexpr (kSrc == kCastBF16) y = __uint_as_float(pack2<true>(y, 0.f) << 16);
  return y > kE4m3Max ? kE4m3Max : (y < -kE4m3Max ? -kE4m3Max : y);
}

// The converting pass: each element x * inverse, clamped to +-448 and rounded to e4m3 (to nearest even;
// in range after the clamp, so satfinite changes nothing but keeps NaN a NaN); the descale written once per
// kv head, by the first block of its first query head.
template <int kSrc>
__device__ __forceinline__ void fp8_quantize_body(const Fp8CastParams& p) {
  const CastBlock blk(p);
  float descale, inverse;
  fp8_descales(__uint_as_float(p.amax[blk.batch * p.heads_kv + blk.kv_head]), descale, inverse);
  if (threadIdx.x == 0 && blockIdx.x == 0 && blk.head % (p.heads / p.heads_kv) == 0)
    p.descale[blk.batch * p.heads_kv + blk.kv_head] = descale;
  const char* src = static_cast<const char*>(p.src);
  unsigned char* dst = static_cast<unsigned char*>(p.dst);
  for (int i = threadIdx.x; i < blk.items; i += blockDim.x) {
    const int row = i / blk.per_row, col = i - row * blk.per_row;
    float x[8];
    load8_as_float<kSrc>(src + blk.src_offset(p, row, col) * cast_source_bytes<kSrc>(), x);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = scaled_for_e4m3<kSrc>(x[j], inverse);
    const uint2 out{pack4_e4m3(x[0], x[1], x[2], x[3]), pack4_e4m3(x[4], x[5], x[6], x[7])};
    *reinterpret_cast<uint2*>(dst + blk.dst_offset(p, row, col)) = out;
  }
}

// Two e4m3 (the lower byte first) to two floats, exactly, through f16x2 (cvt.rn.f16x2.e4m3x2, PTX ISA
// 9.7.9.21: every e4m3 value, NaN included, is an f16 value).
__device__ __forceinline__ void e4m3x2_to_float(unsigned short v, float& lo, float& hi) {
  u32 h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(v));
  unpack2<false>(h2, lo, hi);
}

// Dequantizing: each element float(x) * descale rounded to bf16, as spec.fp8.dequantize computes it with
// either of its forms (the float32 product of a general descale rounded to bf16; with a power of two that
// product is exact, as its bf16 form's is).
__device__ __forceinline__ void fp8_dequantize_body(const Fp8CastParams& p) {
  const CastBlock blk(p);
  const float descale = p.descale == nullptr
                            ? 1.f
                            : p.descale[p.descale_per_head ? blk.batch * p.heads_kv + blk.kv_head : 0];
  const unsigned char* src = static_cast<const unsigned char*>(p.src);
  unsigned short* dst = static_cast<unsigned short*>(p.dst);
  for (int i = threadIdx.x; i < blk.items; i += blockDim.x) {
    const int row = i / blk.per_row, col = i - row * blk.per_row;
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(src + blk.src_offset(p, row, col)));
    float x[8];
    e4m3x2_to_float(w.x & 0xffffu, x[0], x[1]);
    e4m3x2_to_float(w.x >> 16, x[2], x[3]);
    e4m3x2_to_float(w.y & 0xffffu, x[4], x[5]);
    e4m3x2_to_float(w.y >> 16, x[6], x[7]);
    uint4 out;
    out.x = pack2<true>(x[0] * descale, x[1] * descale);
    out.y = pack2<true>(x[2] * descale, x[3] * descale);
    out.z = pack2<true>(x[4] * descale, x[5] * descale);
    out.w = pack2<true>(x[6] * descale, x[7] * descale);
    *reinterpret_cast<uint4*>(dst + blk.dst_offset(p, row, col)) = out;
  }
}

}  // namespace fa
