// What the parts of the warp-specialized forward (fwd_kernel.cuh composes them) share: the build's choices
// that more than one part follows (FwdWsBuild), the block's shared memory and the mbarriers through which
// the producer and the consumers hand buffers to each other (FwdWsSmem), and a consumer thread's place in
// the block (ConsumerThread).
//
// Shared memory: Q (kBlockQ rows), kStages K tiles, kStages V tiles, each in panels of 128-byte rows with the
// 128-byte swizzle (64 columns; e4m3's Q and K at head_dim 64: 64-byte rows, the 64-byte swizzle,
// kQKPanelBytes) (the TMA unit writes that layout itself), persistent an output staging tile, then the
// mbarriers. Per ring slot s: k_full[s] and v_full[s] complete when the producer's expected bytes landed
// (one arrival, its own), and k_empty[s] / v_empty[s] when every consumer warp has finished reading the
// slot's K / V (4 NC arrivals). K and V are freed apart: a slot's K is read by S = Q K^T, which completes
// a softmax before the P V that reads its V, so the producer can refill K early. With the overlapped
// schedule (one slot's V is read while the next slot's S is computed) this lets a two-deep ring keep the
// next K in flight; one barrier for both made the producer wait for the later of the two reads
// (docs/kernel-log.md, step 34). q_full completes when a query tile landed; q_empty (persistent) when
// every consumer thread is past the tile's last S = Q K^T, so the next Q may land over it.
//
// The barriers' contract, part by part (the n-th completion of a barrier is its phase n mod 2):
// * q_full[b]: the producer (producer.cuh) arrives once per tile it hands out through Q buffer b, with the
//   Q tile's bytes expected, or with none for a tile without keys and for the stop sign; the completion
//   publishes the tile's index in s_tile[b] (persistent) and its Q. The consumers' tile loop waits on it.
// * q_empty[b] (persistent): NCT arrivals, each consumer thread's once it is past the tile's last
//   S = Q K^T (mainloop.cuh, s_done) or has written an empty tile; the producer waits on it before it
//   writes buffer b's index or Q again.
// * k_full[s], v_full[s]: the producer's one arrival with a K or V tile's bytes expected, completed when
//   they land; the consumers' schedules (consumer.cuh) wait on them before S_j (K) and P_j V_j (V).
// * k_empty[s], v_empty[s]: one arrival per consumer warp (4 NC) once its products have read the slot's K
//   (after S_j) or V (after P_j V_j) (mainloop.cuh, release); the producer waits on them before it
//   refills the slot.
// Named barriers, consumers only: 1 (the block's whole-tile epilogue), 2 and 3 (the ping-pong turns,
// mainloop.cuh), 4 + c (consumer warpgroup c's own epilogue, epilogue.cuh); 0 is __syncthreads.
#pragma once

#include "fa/config_check.h"  // (CfgIsE4M3)
#include "fa/ptx.cuh"
#include "fa/trace.cuh"  // (FA_TRACE)

namespace fa {
namespace sm90 {

// The build's choices that the mainloop, the epilogue and the tile loop all follow.
template <class Cfg, bool kDropout>
struct FwdWsBuild {
  // The output through TMA stores (the epilogue says how), except in the dropout builds: there NVRTC's
  // register allocation of the largest tiles (head_dim 128 x 176 keys, 256 x 80) spilled 52-96 bytes with
  // it and none without, whichever of the two epilogue schedules (epilogue.cuh) the store took.
  static constexpr bool kTmaStore = Cfg::kTmaStore && !kDropout;
  // A tile's epilogue deferred to run under the next tile's first S = Q K^T (epilogue.cuh says how). Not
  // in the trace build, whose tracer is the tile's own (there the epilogue runs at the tile's end, and the
  // traced values are the same), nor in the dropout builds (NVRTC spilled 28-68 bytes with it).
  static constexpr bool kTileOverlap = Cfg::kTileOverlap && !FA_TRACE && !kDropout;
  // K of the next block loaded before V of this one, and the consumers' wait for V_{j-1} after they issue
  // S_j (producer.cuh and consumer.cuh say why). Only the overlapped builds: the in-order ones need V_j
  // before K_{j+1}. Not the dropout builds: with this order NVRTC spilled 180-188 bytes in their head_dim
  // 128 consumers (4-24 with the consumer's loop rewritten alone). Not below head_dim 128: measured in one
  // process on an H200 (kernel log 170), 1.3% faster at d128 causal (4k and 16k) and level non-causal,
  // but 0.8% faster to 0.9% slower at d64, whose K and V tiles are half as long to wait for.
  static constexpr bool kKFirst = Cfg::kOverlap && !kDropout && Cfg::kHeadDim >= 128;
};

// The block's shared memory: the buffers' addresses and the mbarriers'. Built by every thread from the
// dynamic window's address; one thread initialises the barriers (init_barriers) before the block's one
// __syncthreads.
template <class Cfg>
struct FwdWsSmem {
  static constexpr int BR = Cfg::kBlockQ;
  static constexpr int BC = Cfg::kBlockKV;
  static constexpr int D = Cfg::kHeadDim;    // q and k
  static constexpr int DV = Cfg::kHeadDimV;  // v and o
  static constexpr int NST = Cfg::kStages;
  static constexpr int NC = BR / 64;    // consumer warpgroups
  static constexpr int NCT = NC * 128;  // consumer threads
  // Q buffers: with tile_overlap two, the tiles taking turns, so that the next tile's Q is loaded as soon
  // as the producer reaches that tile (a ring depth ahead of the consumers) rather than when every consumer
  // is past this tile's last S: the deferred epilogue runs under the next tile's first S, which needs that
  // Q, and with one buffer the Q arrived after the epilogue would have run (kernel-log step 63).
  static constexpr int NQ = Cfg::kTileOverlap ? 2 : 1;
  // e4m3 (FP8, CfgIsE4M3): 1-byte Q, K and V^T (V transposed: DV rows of BC keys, ops/fp8_values.py) tiles;
  // its bf16 output in the persistent grid's own tile (configs: e4m3 is persistent; Q's would hold half).
  static constexpr bool kE4M3 = CfgIsE4M3<Cfg>::value;
  static constexpr int E = kE4M3 ? 1 : 2;     // bytes of an input element
  // Bytes of one swizzle panel of a Q or K row: 128 (64 columns of 2 bytes, or 128 of e4m3's 1), except
  // e4m3 at head_dim 64, whose 64-byte rows are one panel of the 64-byte swizzle (a 128-byte panel would be
  // half padding). TMA's map and the wgmma descriptors use the same swizzle (ops/fp8_forward.py, mainloop).
  static constexpr int kQKPanelBytes = E * D < 128 ? E * D : 128;
  static_assert(kQKPanelBytes == 64 || kQKPanelBytes == 128, "Q and K rows: 64- or 128-byte swizzle panels");
  static_assert(D % (kQKPanelBytes / E) == 0, "head_dim must be whole panels");
  // e4m3's V^T rows (BC keys of one byte): 128-byte panels, or one 64-byte panel of the 64-byte swizzle for
  // 64-key tiles.
  static constexpr int kVtPanelBytes = BC < 128 ? BC : 128;
  static_assert(!kE4M3 || ((kVtPanelBytes == 64 || kVtPanelBytes == 128) && BC % kVtPanelBytes == 0),
                "e4m3's V^T rows: whole 64- or 128-byte swizzle panels");
  static constexpr u32 kQBytes = E * BR * D;  // bytes of one Q buffer
  static constexpr u32 kKTile = E * BC * D;   // bytes of one K tile
  static constexpr u32 kVTile = E * BC * DV;  // bytes of one V (e4m3: V^T) tile
  static constexpr u32 kOBytes = Cfg::kPersistent ? 2 * BR * DV : 0;

  // Tiles start on 1024-byte boundaries (the 128-byte swizzle's period, assumed by TMA and the wgmma
  // descriptors alike); the dynamic window is only 16-byte aligned, so the block asks for 1 KB more.
  const u32 sQ;
  const u32 sK;
  const u32 sV;
  // Persistent: the output is staged in a buffer of its own (each consumer warpgroup its 64 rows as a
  // PanelTile<64>), so the next tile's Q can land while this one's output is written out.
  const u32 sO;
  // 8 bytes each: q_full[NQ], q_empty[NQ], k_full[NST], v_full[NST], k_empty[NST], v_empty[NST] (at most
  // 20: 160 of the 256 bytes configs.forward.smem_bytes reserves), then (persistent) the index of the tile
  // in each Q buffer (4 bytes each).
  const u32 bars;

  __device__ __forceinline__ explicit FwdWsSmem(unsigned char* smem)
      : sQ((smem_addr(smem) + 1023u) & ~1023u),
        sK(sQ + NQ * kQBytes),
        sV(sK + NST * kKTile),
        sO(sV + NST * kVTile),
        bars(sO + kOBytes) {}

  __device__ __forceinline__ u32 q_full(int b) const { return bars + 8 * b; }
  __device__ __forceinline__ u32 q_empty(int b) const { return bars + 8 * (NQ + b); }
  __device__ __forceinline__ u32 k_full(int s) const { return bars + 8 * (2 * NQ + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return bars + 8 * (2 * NQ + NST + s); }
  __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8 * (2 * NQ + 2 * NST + s); }
  __device__ __forceinline__ u32 v_empty(int s) const { return bars + 8 * (2 * NQ + 3 * NST + s); }
  __device__ __forceinline__ u32 s_tile(int b) const { return bars + 8 * (2 * NQ + 4 * NST) + 4 * b; }

  // By one thread, before the block's __syncthreads: the arrival counts above.
  __device__ __forceinline__ void init_barriers() const {
    for (int b = 0; b < NQ; ++b) {
      mbar_init(q_full(b), 1);
      mbar_init(q_empty(b), NCT);
    }
    for (int s = 0; s < NST; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), 4 * NC);
      mbar_init(v_empty(s), 4 * NC);
    }
    mbar_init_fence();
  }
};

// A consumer thread's place in the block: its index among the consumers, its warpgroup (the block's query
// rows [64 cwg, 64 cwg + 64)), and its lane's place in the wgmma accumulators' m64 layout.
struct ConsumerThread {
  const int ctid;  // thread index among the consumers
  const int cwg;   // this warpgroup's 64 rows of the block
  const int lane;
  const int g;
  const int t;
  const int warp_row0;  // the block row of this warp's first row
  __device__ __forceinline__ explicit ConsumerThread(int tid)
      : ctid(tid - 128),
        cwg(ctid / 128),
        lane(tid % 32),
        g(lane / 4),
        t(lane % 4),
        warp_row0(16 * (ctid / 32)) {}
};

}  // namespace sm90
}  // namespace fa
