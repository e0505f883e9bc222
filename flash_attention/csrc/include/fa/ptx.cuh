// PTX wrappers for the sm_80 instruction set (they also run on sm_90).
//
// Header-free on purpose: the same source compiles under nvcc and NVRTC, and NVRTC has no standard
// library headers. Every wrapper cites the PTX ISA section that defines its instruction.
#pragma once

namespace fa {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// floor(log2(n)) of a positive compile-time n (0 for n <= 1).
__host__ __device__ constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

// Shared-memory address of a generic pointer (cvta.to.shared, PTX ISA 9.7.9.18), as the 32-bit operand that
// ldmatrix / cp.async / st.shared expect.
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// cp.async.cg.shared.global with an explicit source size (PTX ISA 9.7.9.25.3.1). 16 bytes land in shared
// memory; the last 16 - src_bytes of them are zero-filled. src_bytes = 0 fills a tile row that lies past the
// end of the sequence (or past head_dim) with zeros without touching global memory, so the tail needs no
// separate code path. .cg bypasses L1: K/V are reused across blocks through L2 only.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// cp.async.ca.shared.global of 4 bytes (only .ca takes 4- and 8-byte copies): a paged cache's page-table
// entry into shared memory, so no register waits on it (fa/kv_cache.cuh: TilePageRing). src_bytes = 0
// writes a zero without reading.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// cp.async.commit_group / cp.async.wait_group (PTX ISA 9.7.9.25.3.2-3).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16-byte global load / shared store for the synchronous copy path (PTX ISA 9.7.9.8 ld, 9.7.9.10 st).
__device__ __forceinline__ uint4 ld_global_16(const void* src) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(src));
  return r;
}

__device__ __forceinline__ void st_shared_16(u32 dst, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}

__device__ __forceinline__ void st_shared_32(u32 dst, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst), "r"(v));
}

// Two adjacent words (8-byte aligned) into shared memory. (The memory clobber keeps plain C++ accesses
// around it in order too, as for a value another thread reads after a barrier the caller arrives on.)
__device__ __forceinline__ void st_shared_u32x2(u32 dst, u32 a, u32 b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(dst), "r"(a), "r"(b) : "memory");
}

// Two adjacent floats (8-byte aligned) into shared memory: an accumulator pair staged for a bulk copy.
__device__ __forceinline__ void st_shared_f32x2(u32 dst, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dst), "f"(a), "f"(b));
}

__device__ __forceinline__ u32 ld_shared_32(u32 src) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(src) : "memory");
  return r;
}

__device__ __forceinline__ uint4 ld_shared_16(u32 src) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(src));
  return r;
}

__device__ __forceinline__ void st_global_16(void* dst, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA 9.7.14.5.15): four 8x8 b16 matrices; lanes 8i..8i+7
// supply the row addresses of matrix i, and every lane receives one 32-bit register per matrix.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The .trans form delivers each 8x8 matrix transposed: used for V, which is stored key-major but is the
// k-major B operand of O += P V.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// stmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA 9.7.14.5.16; sm_90): ldmatrix_x4's inverse. Lanes 8i..8i+7
// supply the row addresses of matrix i, and every lane gives one 32-bit register per matrix, in the layout
// of an mma/wgmma accumulator's 8x8 piece (lane 4 r + c: row r, columns 2 c, 2 c + 1): a warp stores four
// packed accumulator pieces with one instruction, where st.shared.b32 takes four.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3]));
}

// stmatrix's transposing form (.trans): matrix i's row j (the address of lane 8 i + j) receives column j of
// the lanes' pieces, so an accumulator whose rows are head_dim and columns keys lands with keys as rows (the
// warp-specialized wide backward's dK / dV epilogue).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3]));
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (PTX ISA 9.7.14.5.14): D = A B + C with
// fp32 accumulation. A: 4 registers (16x16), B: 2 registers (16x8), C/D: 4 fp32 (16x8).
template <bool kIsBF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (kIsBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 -> one packed pair of bf16/fp16, round to nearest even (cvt.rn.{bf16x2,f16x2}.f32, PTX ISA
// 9.7.9.21). The first operand of the instruction goes to the upper half, so `hi` is the element at the
// higher column.
template <bool kIsBF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (kIsBF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// Four fp32 -> four e4m3 (FP8) in one register, x0 in the lowest byte: the 8-bit A fragment's order (four
// consecutive k of a row per register, docs/fp8-study.md A.3.2). cvt.rn.satfinite.e4m3x2.f32 (PTX ISA
// 9.7.9.21) writes its first operand to the upper byte of a .b16, as cvt.rn.bf16x2.f32 does to the upper
// half in pack2, and saturates to +-448 (e4m3's largest finite value) rather than make a NaN.
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return (u32)lo | ((u32)hi << 16);
}

// One packed pair of bf16/fp16 -> two fp32 (`lo` from the lower half, the element at the lower column):
// exact. bf16 is the high half of an fp32; fp16 converts with cvt.f32.f16 (PTX ISA 9.7.9.21).
template <bool kIsBF16>
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
  if constexpr (kIsBF16) {
    lo = __uint_as_float(x << 16);
    hi = __uint_as_float(x & 0xffff0000u);
  } else {
    const unsigned short l = x & 0xffffu, h = x >> 16;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(lo) : "h"(l));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(hi) : "h"(h));
  }
}

// 2^x with the SFU (ex2.approx.ftz.f32, PTX ISA 9.7.4.9): one MUFU.EX2. ex2(-inf) = +0, which the masked
// softmax relies on.
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// 2^x without the SFU: a polynomial on the FMA pipe, for kernels whose exponentials the SFU's throughput
// bounds (16 MUFU.EX2 per clock per multiprocessor against 128 FFMA: a d128 backward step's 8,192
// exponentials are 512 cycles of SFU; kernel log 138). x = j + f with j = round(x) (the 1.5 * 2^23 shifter:
// the sum's low mantissa bits hold j) and f in [-1/2, 1/2]; 2^f by a polynomial whose constant term is 1
// (fitted for the least maximum relative error: 1.0e-4 at degree 3, a twentieth of bf16's rounding, 2.9e-6
// at degree 4 for fp16's, whose rounding is 8x finer); 2^j added into the exponent field as an integer
// (j << 23, unsigned: the shifter's bits above the ninth fall out of the shift). x is clamped at -127
// first, where f = 0 and 2^f = 1 exactly, so -inf (a masked score, a row past the sequence's end) gives +0
// as the SFU's ftz form does; x in (-127, -126) gives a subnormal at most 2^-126 (below -126.5 one that
// falls to 0 towards -127), where ex2.approx.ftz gives 0: either is far below any P that reaches the
// products, but a log2 of P must treat the subnormal as 0 (fa/variant.cuh score_mod_gradient_from_p). x
// must be below 128, as P's argument (a score minus its row's log-sum-exp) is; a NaN x gives +0 (fmaxf
// returns the other operand), where the SFU would give NaN. Costs FMNMX, 3 FADD, 3-4 FFMA and one
// IMAD (the shift and the add).
template <int kDegree>
__device__ __forceinline__ float exp2_poly(float x) {
  static_assert(kDegree == 3 || kDegree == 4, "degree 3 (bf16's P) or 4 (fp16's)");
  constexpr float kShifter = 12582912.f;  // 1.5 * 2^23
  x = fmaxf(x, -127.f);
  // (the _rn intrinsics: the shifter's add and subtract must round as written, never fold or contract)
  const float shifted = __fadd_rn(x, kShifter);
  const float f = __fsub_rn(x, __fsub_rn(shifted, kShifter));
  float p;
  if constexpr (kDegree == 3) {
    p = fmaf(fmaf(fmaf(0.0550086163f, f, 0.2422102094f), f, 0.6932829022f), f, 1.f);
  }
  if constexpr (kDegree == 4) {
    p = fmaf(fmaf(fmaf(fmaf(0.0095828203f, f, 0.0559063368f), f, 0.2402409911f), f, 0.6931241751f), f, 1.f);
  }
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(shifted) << 23));
}

// P's exponential of an element of 8-column group n: by exp2_poly where n % 8 is below kExpPoly (0-8: that
// many eighths of the groups; KernelConfig / BwdConfig.exp_poly, kernel logs 138-139), else by the SFU. n is
// a constant of the caller's unrolled loop, so no branch. The degree follows P's 16-bit type.
template <int kExpPoly, bool kIsBF16>
__device__ __forceinline__ float exp2_share(int n, float x) {
  static_assert(kExpPoly >= 0 && kExpPoly <= 8, "eighths of the exponentials: 0 to 8");
  if constexpr (kExpPoly == 0) {
    return exp2_approx(x);
  } else {
    return n % 8 < kExpPoly ? exp2_poly<kIsBF16 ? 3 : 4>(x) : exp2_approx(x);
  }
}

// tanh with the SFU (tanh.approx.f32, PTX ISA 9.7.4.x, sm_75+): one MUFU.TANH, maximum relative error
// about 2^-11 -- below the 16-bit inputs' own rounding. The softcap score function's.
__device__ __forceinline__ float tanh_approx(float x) {
  float r;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// log2(x) with the SFU (lg2.approx.ftz.f32): one MUFU.LG2; lg2(+0) = -inf.
__device__ __forceinline__ float log2_approx(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }

// Atomic fp32 add without a return value (red.global.add.f32, PTX ISA 9.7.13.6): the backward's dQ
// accumulation. The sm_90 form adds two adjacent floats in one instruction (red.global.v2.f32.add, PTX ISA
// 8.1+), halving the atomics of a tile; the address must be 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr + 1), "f"(b) : "memory");
#endif
}

// 32-bit global store (a packed pair of bf16/fp16).
__device__ __forceinline__ void st_global_32(void* dst, u32 v) {
  asm volatile("st.global.u32 [%0], %1;\n" ::"l"(dst), "r"(v));
}

}  // namespace fa
