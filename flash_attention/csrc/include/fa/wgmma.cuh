// Hopper (sm_90a) primitives for the wgmma kernels: shared-memory matrix descriptors, the warpgroup
// fences, commit and wait, and the proxy fence between ordinary shared-memory writes and the tensor cores'
// reads. The instruction wrappers themselves are generated (fa/wgmma_mma.cuh).
#pragma once

#include "fa/ptx.cuh"
#include "fa/wgmma_mma.cuh"

namespace fa {

// Shared-memory matrix descriptor (PTX ISA 9.7.15.5.1.2.2, "Matrix Descriptor Format"): bits 0-13 the start
// address, 16-29 the leading dimension byte offset, 32-45 the stride dimension byte offset (each >> 4),
// 62-63 the swizzle mode (1 = 128-byte swizzle). The base-offset field stays 0: every tile starts on a
// 1024-byte boundary, where the 128-byte swizzle pattern repeats.
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr, u32 lead_bytes, u32 stride_bytes) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lead_bytes >> 4) << 16) | ((u64)(stride_bytes >> 4) << 32) |
         (1ull << 62);
}

// The same for the 64-byte swizzle (swizzle mode 2): rows of 64 bytes, its pattern repeating every 8 rows
// (512 bytes), which the tiles' 1024-byte alignment keeps at base offset 0. e4m3 Q and K tiles at head_dim 64
// (sm90/fwd_ws/pipeline.cuh kQKPanelBytes), loaded by TMA with the matching 64-byte swizzle.
__device__ __forceinline__ u64 smem_desc_sw64(u32 addr, u32 lead_bytes, u32 stride_bytes) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lead_bytes >> 4) << 16) | ((u64)(stride_bytes >> 4) << 32) |
         (2ull << 62);
}

// `desc` with its start address advanced by `bytes` (a multiple of 16: a k-step, a pipeline slot, a panel).
// Two forms of the same value: every address inside shared memory (under 256 KB) keeps the 14-bit start
// field from carrying, so the high word never changes.
// - The joined form (default): a 32-bit add into the low word, joined to the unchanged high word. Step 124
//   wrote it for descriptors then held in ordinary registers, where a 64-bit add compiled to a carried
//   IADD3 / IMAD.X (or ULEA + UMOV + UIADD3.64) before every wgmma. In uniform registers it makes a new
//   register pair per wgmma instead, whose high word ptxas fills with a UMOV.
// - kPlainAdd: the 64-bit add, one UIADD3.64 where the descriptor is uniform (warpgroup_index). In bwd_ws's
//   builds without a row-dependent mask (kernel log 173, H200, one process: 2.1-2.4% off forward+backward at
//   d64 and d128 non-causal, the d128 step loop 481 -> 453 instructions, UMOV 68 -> 16). Not causal, where
//   the same change measured 0.2-3.2% slower though its loops also shrank, nor the wide kernel (d256,
//   1-1.7% slower).
// The forward and decode kernels keep their own 64-bit adds (`desc + (off >> 4)`): there the joined form
// (with warpgroup_index) measured 5.8% slower at head_dim 64 causal.
template <bool kPlainAdd = false>
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) {
  if constexpr (kPlainAdd) {
    return desc + (u64)(bytes >> 4);
  } else {
    u64 out;
    asm("mov.b64 %0, {%1, %2};\n" : "=l"(out) : "r"((u32)desc + (bytes >> 4)), "r"((u32)(desc >> 32)));
    return out;
  }
}

// This thread's warpgroup in the block (threadIdx.x / 128), broadcast from lane 0 so that the compiler knows
// it is the same across the warp: values made from it (a warpgroup's descriptors, its tile offsets) then
// live in uniform registers, which wgmma reads its descriptors from. Made from threadIdx.x directly, they
// sat in ordinary registers and were moved over (R2UR) before every wgmma (kernel log 124).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0); }

// wgmma.fence.sync.aligned (PTX ISA 9.7.15.5.3): orders this warpgroup's earlier register writes (the
// rescaled O, the packed P) before the asynchronous matrix instructions that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// wgmma.commit_group / wgmma.wait_group (PTX ISA 9.7.15.5.4-5): close the group of instructions issued so
// far; wait until at most N groups are pending.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// After wgmma_wait, tie every accumulator register to an empty volatile asm: the compiler may not move a
// read of them above the wait (to it, the wgmma asm already produced them).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keep `value`'s computation ahead of the next wgmma_wait. ptxas schedules a wgmma.wait_group as early as
// its basic block allows, above arithmetic that does not depend on it: in the overlapped loop of the
// warp-specialized forward it put the wait for P_{j-1} V_{j-1} above S_j's whole softmax step, so the
// warpgroup idled until that product completed and only then ran its softmax with nothing of its own on
// the tensor cores (every overlap config, nvcc and NVRTC 13.0; docs/kernel-log.md, step 58). A shared store
// of `value` placed before the wait keeps the order: ptxas did not hoist the wait above a memory
// operation here and the store needs `value`. The store is predicated on `nonnegative < 0`, where the
// caller passes a runtime value it knows is not negative (ptxas cannot), so it executes nowhere: no
// traffic and no race. Costs one instruction. (A branch around the wait instead made ptxas serialize
// every wgmma of the loop.)
__device__ __forceinline__ void order_before_wgmma_wait(float value, u32 smem_word, int nonnegative) {
  asm volatile(
      "{\n"
      ".reg .pred q;\n"
      "setp.lt.s32 q, %2, 0;\n"
      "@q st.shared.b32 [%0], %1;\n"
      "}\n" ::"r"(smem_word),
      "f"(value), "r"(nonnegative)
      : "memory");
}

// fence.proxy.async.shared::cta (PTX ISA 9.7.13.4.18): shared memory written through the generic proxy
// (cp.async, st.shared) becomes visible to the async proxy, through which wgmma reads its operands. Each
// writing thread runs it after its copies land and before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace fa
