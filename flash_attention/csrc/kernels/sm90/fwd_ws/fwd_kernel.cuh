// FlashAttention forward for Hopper (sm_90a), warp-specialized: one warpgroup only loads, the others only
// compute. The matrix products, masks and online softmax are those of the sm90 wgmma kernel
// (csrc/kernels/sm90/fwd/fwd_kernel.cuh), whose comments on the wgmma operand layouts apply here.
//
// Roles (Cfg::kNumWarps = 4 + 4 * NC, NC = kBlockQ / 64 consumer warpgroups):
// * warpgroup 0, the producer: one thread issues every TMA load (Q once, then K_j and V_j into a ring of
//   kStages buffers) and waits only for buffers to come free. It gives its registers back (setmaxnreg.dec)
//   and its other 127 threads leave at once.
// * warpgroups 1..NC, the consumers: warpgroup c owns query rows [64 (c - 1), 64 c) of the block. Each
//   waits for a tile to land, computes S = Q K_j^T, the mask and the softmax step, then O += P V_j, and
//   releases the ring slot when its matrix products have read it. They take the producer's registers
//   (setmaxnreg.inc): the 64 x kHeadDim O and 64 x kBlockKV S accumulators of a thread are 128 of its
//   registers at head_dim 128.
// Loads no longer come from the computing warps (the sm90 kernel's cp.async needed every thread to
// issue, fence and meet at a block barrier per tile): a TMA load is one instruction per 64-column panel,
// its completion a transaction count on an mbarrier, and the only block-wide barrier is the one after
// the barriers' initialisation.
//
// Tiles (Cfg::kPersistent): one query tile per block as the grid says, or a persistent grid of one block
// per multiprocessor taking tiles dynamically (scheduler.cuh). The K/V ring runs on across tiles, so the
// producer loads the next tile's Q and first K/V blocks while the consumers finish the current one, whose
// output goes through its own staging buffer.
//
// Parts, each in its own header beside this one; this file composes them (fwd_ws_body: the shared memory,
// the barriers' initialisation, the two roles):
// * pipeline.cuh: the shared memory layout, the mbarriers and who completes and waits on each, the build's
//   choices several parts follow (TMA stores, tile_overlap), a consumer thread's coordinates;
// * scheduler.cuh: the tile schedule (which tile, its rows and K/V blocks; the persistent grid's draws);
// * producer.cuh: warpgroup 0's TMA loads of Q, K and V into the ring;
// * mainloop.cuh: a consumer warpgroup's steps per K/V block (S = Q K^T, score function, mask, online
//   softmax and dropout, O += P V, the slots' release, the ping-pong turns) and its accumulators;
// * epilogue.cuh: O / L and the LSE out, by TMA stores or the consumers' copies, per block or per
//   warpgroup, at a tile's end or deferred under the next tile's first S (tile_overlap);
// * consumer.cuh: the consumers' tile loop, and in it the mainloop's two schedules (in order, overlapped).
// They are structs and functions inlined into one kernel (__forceinline__), written so that the compiler
// sees what it saw when they were one function: splitting it left the machine code of every build as it
// was (tools/sass_diff.py). What that took: small parts passed by value, the accumulators a local of the
// function whose loops update them, those loops where they were (consumer.cuh says more).
//
// Debug build (FA_TRACE, fa/trace.cuh): one consumer warp of the traced tile records what it reads and
// computes (mainloop.cuh says when; the epilogue reads back the output rows as staged). Nothing of it is in
// the normal build.
#pragma once

#include "fa/config_check.h"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/tma_params.h"
#include "fa/variant.cuh"
#include "sm90/fwd_ws/consumer.cuh"
#include "sm90/fwd_ws/mainloop.cuh"
#include "sm90/fwd_ws/pipeline.cuh"
#include "sm90/fwd_ws/producer.cuh"
#include "sm90/fwd_ws/scheduler.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class V, bool kDropout = false>
__device__ __forceinline__ void fwd_ws_body(const FwdTmaParams& tp) {
  static_assert(check_config<Cfg>::ok, "");
  static_assert(Cfg::kWgmma && Cfg::kWarpSpecialized, "the warp-specialized kernel runs ws configs only");
  using Mask = typename V::Mask;  // the variant's policies (fa/variant.cuh)
  using Smem = FwdWsSmem<Cfg>;
  using Scheduler = FwdWsScheduler<Cfg, Mask>;
  using Mainloop = FwdWsMainloop<Cfg, V, kDropout>;
  const FwdParams& p = tp.p;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int NC = BR / 64;  // consumer warpgroups
  constexpr int NT = Cfg::kNumWarps * 32;
  static_assert(NT == 128 * (NC + 1), "a producer warpgroup and one consumer warpgroup per 64 query rows");
  // setmaxnreg moves registers within the block's launch allocation (NT x the launch bound's per-thread
  // count): a split asking for more than that makes the consumers wait forever (configs.register_split).
  static_assert(128 * Cfg::kProducerRegs + (NT - 128) * Cfg::kConsumerRegs <= NT * (65536 / NT / 8 * 8),
                "the register split exceeds the block's allocation");

  // The dynamic window, laid out by pipeline.cuh.
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem sm(smem);
  const int tid = threadIdx.x;
  if (tid == 0) sm.init_barriers();
  // The ones tile of the bounded softmax's L_r on the tensor cores (mainloop.cuh, ones_tile). Written by the
  // generic proxy and read by wgmma (the async proxy): fenced before the barrier below.
  unsigned* s_ones = Mainloop::ones_tile();
  if constexpr (Mainloop::kSumPackedPOnes) {
    if (threadIdx.x < 32) s_ones[threadIdx.x] = 0x3F803F80u;
    fence_proxy_async();
  }
  // The only block-wide barrier: the mbarriers are initialised before anyone waits on or completes them.
  __syncthreads();

  // The roles. sm and sched go by value: each part then sees their fields as its own values, not as loads
  // through a pointer that any asm statement of its loops might change, and compiles as the one function
  // this kernel was before it was split into parts.
  const Scheduler sched(p);
  const int wg = tid / 128;
  if (wg == 0) {
    fwd_ws_producer<Cfg, Mask, kDropout>(tp, sm, sched);  // (producer.cuh)
    return;
  }
  fwd_ws_consumer<Cfg, V, kDropout>(tp, sm, sched);  // (consumer.cuh)
}

}  // namespace sm90
}  // namespace fa
