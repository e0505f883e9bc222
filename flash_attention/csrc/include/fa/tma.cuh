// Hopper (sm_90a) primitives of the warp-specialized kernels: tensor-memory-accelerator (TMA) tile loads,
// the shared-memory mbarriers that say when they landed and when a buffer may be refilled, named barriers
// for a subset of the block's warps, and the register reallocation between warpgroups.
//
// Header-free like fa/ptx.cuh (NVRTC has no CUDA headers): the tensor map is an opaque 128-byte,
// 64-byte-aligned blob encoded on the host (cuTensorMapEncodeTiled, flash_attention/jit/driver.py) and
// passed inside a __grid_constant__ kernel parameter, whose generic address the TMA instruction takes.
#pragma once

#include "fa/ptx.cuh"
#include "fa/tma_params.h"

namespace fa {

// ---- mbarrier (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier") --------------
// A 64-bit shared-memory object with an arrival count and a transaction (byte) count per phase. A phase
// completes when the expected arrivals have arrived and the expected bytes have landed; waiting names the
// parity (0/1) of the phase waited for, so a ring slot used for the n-th time waits on parity n & 1.

__device__ __forceinline__ void mbar_init(u32 bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Make the initialised barriers visible to the async proxy (the TMA unit completes transactions on them)
// and to the other threads (fence.mbarrier_init); a block-wide barrier follows it.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also raises the phase's expected byte count by `bytes` (the producer, before it issues
// the TMA loads that will complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Raise the phase's expected byte count by `bytes` without arriving (a producer whose own arrival comes
// later, with its other copies: the phase cannot complete before that arrival, so the bytes are counted in).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One plain arrival (a consumer releasing a buffer it has finished reading).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Block until the phase of parity `parity` has completed. try_wait suspends the thread for a
// hardware-chosen time before it returns false, so the loop does not spin hot.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The same wait for a thread off the critical path (a writer or a producer that waits for its consumers):
// try_wait with a suspend-time hint of 10 ms (0x989680 ns) lets the thread sleep until the phase completes
// or the hint runs out, instead of returning after the hardware's short default and looping. The retry
// compiles to NANOSLEEP.SYNCS; a plain mbar_wait's loop to YIELD, try_wait and a branch each round, which
// in bwd_ws's dQ writers was 7% of the d128 kernel's instructions (kernel log 168). Not for the consumers'
// waits: those are on the step's path, where the wake-up's latency would be paid every step.
__device__ __forceinline__ void mbar_wait_parked(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity), "r"(0x989680)
      : "memory");
}

// ---- TMA (PTX ISA cp.async.bulk.tensor) -------------------------------------------------------------------
// One box of a 4-dimensional tensor (innermost first: column, row, head, batch) into shared memory, laid
// out and swizzled as the tensor map says; completion adds the box's bytes to `bar`'s transaction count.
// Rows past the tensor's extent land as zeros (and still count), so tails need no code of their own.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
      "%4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The reverse: one box from shared memory (laid out and swizzled as the map says) to a 4-dimensional
// tensor in global memory. Rows and columns past the tensor's extent are not written, so a tile's tail rows
// and a head_dim below the padded one need no code of their own. The copy is tracked as a bulk group of
// the issuing thread (bulk_commit, bulk_wait_read / bulk_wait below); the shared memory must have been
// written before it through the async proxy's view (fence_proxy_async in every writing thread, then a
// barrier with the issuing thread).
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<u64>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}

// Fetch the tensor map into the TMA unit's descriptor cache ahead of the first load (prefetch.tensormap).
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- bulk reductions (PTX ISA cp.reduce.async.bulk) -------------------------------------------------------
// Add `bytes` (a multiple of 16) of fp32 from shared memory into global memory, element by element and
// atomically with respect to other reductions (the backward's dQ accumulator, which every key block of a
// query block adds into). The copy engine does the work; the issuing thread only tracks it as a bulk group:
// commit closes the group, wait_read<N> returns once at most N of this thread's groups still read shared
// memory (the source may then be rewritten), wait<N> once at most N are still in flight at all (before the
// block exits, so no copy outlives the shared memory it reads). Both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- global semaphores between blocks (the deterministic backward's turn-taking) ---------------------------
// Acquire load / release add at GPU scope (PTX ISA ld.acquire, red.release): what one block's dQ reduction
// wrote is visible to the next block that sees the incremented count. The proxy fence orders the async
// proxy (the bulk reductions) with these generic accesses to global memory, both ways.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---- named barriers (PTX ISA bar.sync) --------------------------------------------------------------------
// bar.sync with an explicit thread count: only the `threads` threads that name barrier `id` meet there
// (the consumers of a warp-specialized block, without the producer that has left its loop). Barrier 0 is
// __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The same, for a barrier that its threads meet at different instructions (warpgroups in different template
// instantiations of one step: bwd_wide_ws at head_dim 192). bar.sync is barrier.sync.aligned, which requires
// every thread meeting the barrier to execute the same instruction; the hardware counted the arrivals anyway
// and the results were right, but compute-sanitizer's synccheck reported it ("Divergent thread(s) in block")
// and the PTX ISA leaves it undefined. The non-aligned form allows it.
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive at named barrier `id` without waiting (bar.arrive): the other party of a producer/consumer
// hand-off waits there with named_barrier_sync and the same thread count.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation (PTX ISA setmaxnreg) -----------------------------------------------------------
// A warpgroup gives registers back (dec) or claims freed ones (inc); every warp of the warpgroup executes
// it. The block is compiled for an even split (launch bounds); the producer, which holds only addresses
// and loop counters, drops to a few dozen so the consumers' accumulators fit without spilling.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace fa
