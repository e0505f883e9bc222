// Timeline build of the warp-specialized Hopper kernels (the forward, csrc/kernels/sm90/fwd_ws, and the
// backward's dK/dV kernel, csrc/kernels/sm90/bwd_ws): lane 0 of every warp of the first kBlocks blocks
// stamps its schedule's events with the multiprocessor's cycle counter, so tools/ws_timeline.py and
// tools/bwd_timeline.py can show what each consumer warpgroup waited for, step by step (in the forward:
// when its products ran beside the other warpgroup's softmax, how long an epilogue or a tile's first step
// took; in the backward: each phase of a query step between its waits and barriers; in both, when the
// producer stalled on a slot). Profiler counters give totals; this gives the order.
//
// Compiled only when the source defines FA_TIMELINE=1 (the tools prepend it; no library path does); the
// normal build sees only the empty FA_TIMELINE_EVENT below, so its code is unchanged. The records go to the
// params' trace pointer (FwdParams: the debug build's buffer, unused otherwise; BwdParams: its own, null in
// every library call): warp w of block b writes records (b * kWarps + w) * kRecords onwards, 16 bytes each:
// (kind << 32 | argument, clock64).
// Reading the clock and one 16-byte store per event shift the schedule by a few cycles per event; the
// tool reports what a step costs, not the last percent.
#pragma once

#ifndef FA_TIMELINE
#define FA_TIMELINE 0
#endif

#if FA_TIMELINE

#include "fa/bwd_params.h"
#include "fa/params.h"
#include "fa/ptx.cuh"

namespace fa {
namespace timeline {

// Event kinds; tools/ws_timeline.py mirrors them (EVENTS).
enum Kind : unsigned {
  kTileBegin = 1,      // consumer: a tile's index is known (argument: the tile)
  kSIssued = 2,        // consumer: S_j = Q K_j^T issued (argument: j, counted in the tile)
  kSDone = 3,          // consumer: S_j has landed
  kSoftmaxDone = 4,    // consumer: S_j's softmax step done
  kPVDone = 5,         // consumer: P_j V_j has completed
  kEpilogueBegin = 6,  // consumer: the tile's last product has completed
  kEpilogueEnd = 7,    // consumer: its output rows are written
  kQIssued = 8,        // producer: a tile's Q load issued (argument: the tile)
  kKIssued = 9,        // producer: K_j's load issued after its slot came free (argument: the ring count)
  kVIssued = 10,       // producer: V_j's load issued
  // The backward's dK/dV kernel (bwd_ws), per query step (argument: the step's index in the block's walk):
  kBwdFull = 11,        // consumer: the slot's Q, dO and statistics have arrived (full barrier passed)
  kBwdSLanded = 12,     // consumer: S^T has landed (dP^T may still run)
  kBwdExpDone = 13,     // consumer: P^T computed, before the wait for dP^T
  kBwdDPLanded = 14,    // consumer: dP^T has landed
  kBwdDSStored = 15,    // consumer: dS^T stored and fenced, dV issued
  kBwdMet = 16,         // consumer: both warpgroups' dS^T written (named barrier 1 passed)
  kBwdDQLanded = 17,    // consumer: dV and dQ have landed (dK may still run)
  kBwdDQOut = 18,       // consumer: dQ staged and its reduction issued
  kBwdStepEnd = 19,     // consumer: dK has landed, the slot released
  kBwdSlotFree = 20,    // producer: a slot came free (empty barrier passed; argument: the ring count)
  kBwdSlotIssued = 21,  // producer: the slot's copies issued and its arrival made
  kBwdBlockBegin = 22,  // consumer: the block's work begins (after the grid dependency; argument 0)
  kBwdBlockEnd = 23,    // consumer: dK's and dV's stores issued (argument: the block's query steps)
};

constexpr int kBlocks = 4;
constexpr int kWarps = 16;
constexpr int kRecords = 4096;

struct Recorder {
  unsigned long long* out = nullptr;
  int n = 0;
  template <class Params>  // (FwdParams or BwdParams: any params with a `trace` pointer)
  __device__ __forceinline__ Recorder(const Params& p, int warp) {
    // (the block's linear index: with a grid of (blocks, heads, batch), blockIdx.x alone would have every
    // head's first blocks write the same records)
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (p.trace && block < (unsigned)kBlocks && warp < kWarps && threadIdx.x % 32 == 0)
      out = reinterpret_cast<unsigned long long*>(p.trace) + 2ull * (block * kWarps + warp) * kRecords;
  }
  __device__ __forceinline__ void operator()(unsigned kind, unsigned argument) {
    if (out && n < kRecords) {
      out[2 * n] = (unsigned long long)kind << 32 | argument;
      out[2 * n + 1] = clock64();
    }
    ++n;
  }
};

}  // namespace timeline
}  // namespace fa

#define FA_TIMELINE_EVENT(recorder, kind, argument) (recorder)(::fa::timeline::kind, (unsigned)(argument))

#else

// Nothing, but the argument still counts as used (unevaluated): a variable kept only for the timeline, as
// the tile-overlap epilogue's `finished`, otherwise drew a front-end warning in every such build.
#define FA_TIMELINE_EVENT(recorder, kind, argument) ((void)sizeof(argument))

#endif

// Block spans (FA_BLOCK_SPANS=1, a build of its own: tools/bwd_timeline.py --spans): every block of the grid,
// not the first kBlocks, records where and when it ran, kSpanWords 64-bit words at the params' trace
// pointer + kSpanWords * (its linear index): [0] its multiprocessor, [1] its query steps, then pairs of the
// multiprocessor's cycle counter and %globaltimer (ns, one clock for the whole GPU): [2, 3] at its start,
// [4, 5] once consumer warpgroup 0 is past the grid dependency (a programmatic launch's first blocks start
// while the previous kernel still runs and wait there), [6, 7] at warpgroup 0's end and [8, 9] at warpgroup
// 1's. The cycle counter orders the blocks one multiprocessor ran and measures the gaps between them; the
// global timer places every block on one axis (the grid's tail, idle multiprocessors). Four stamps a block,
// none in the step loop: unlike the timeline build, the step's schedule stays the normal build's.
#ifndef FA_BLOCK_SPANS
#define FA_BLOCK_SPANS 0
#endif

#if FA_BLOCK_SPANS

namespace fa {
namespace timeline {

constexpr int kSpanWords = 10;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

template <class Params>
__device__ __forceinline__ unsigned long long* block_span(const Params& p) {
  const unsigned long long block =
      blockIdx.x + gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
  return p.trace ? reinterpret_cast<unsigned long long*>(p.trace) + kSpanWords * block : nullptr;
}

}  // namespace timeline
}  // namespace fa

// The block's start, by one thread before anything else the block does.
#define FA_BLOCK_SPAN_BEGIN(p)                                 \
  do {                                                         \
    unsigned long long* span_ = ::fa::timeline::block_span(p); \
    if (span_) {                                               \
      span_[0] = ::fa::timeline::sm_id();                      \
      span_[2] = clock64();                                    \
      span_[3] = ::fa::timeline::global_ns();                  \
    }                                                          \
  } while (0)
// Past the grid dependency, by one consumer thread.
#define FA_BLOCK_SPAN_READY(p)                                 \
  do {                                                         \
    unsigned long long* span_ = ::fa::timeline::block_span(p); \
    if (span_) {                                               \
      span_[4] = clock64();                                    \
      span_[5] = ::fa::timeline::global_ns();                  \
    }                                                          \
  } while (0)
// A consumer warpgroup's end (`wg` 0 or 1), by one of its threads, with the block's query steps.
#define FA_BLOCK_SPAN_END(p, wg, steps)                        \
  do {                                                         \
    unsigned long long* span_ = ::fa::timeline::block_span(p); \
    if (span_) {                                               \
      span_[6 + 2 * (wg)] = clock64();                         \
      span_[7 + 2 * (wg)] = ::fa::timeline::global_ns();       \
      span_[1] = (unsigned)(steps);                            \
    }                                                          \
  } while (0)

#else

#define FA_BLOCK_SPAN_BEGIN(p) ((void)0)
#define FA_BLOCK_SPAN_READY(p) ((void)0)
#define FA_BLOCK_SPAN_END(p, wg, steps) ((void)sizeof(steps))

#endif
