// The producer of the warp-specialized forward: warpgroup 0, of which one thread issues every TMA load.
//
// Contract: it owns the load side of the pipeline (pipeline.cuh): its own count of K/V blocks loaded
// (`ring`: block n goes to slot n % NST, that slot's (n / NST)-th use) and of Q buffers handed out
// (`q_loads`), which the consumers count alike. Per tile, in the scheduler's order (scheduler.cuh): wait
// for q_empty of the Q buffer (persistent, from its second use on), publish the tile's index in s_tile,
// arrive on q_full with Q's bytes (none for a tile without keys, or for the stop sign that ends the loop),
// then per K/V block wait for the slot's k_empty (v_empty) from its second use on and arrive on k_full
// (v_full) with the tile's bytes ahead of its loads. It never waits for a load to land: the consumers do.
//
// The order of a tile's loads (FwdWsBuild::kKFirst, the overlapped builds but dropout's): K_0, then per
// block j K_{j+1} and V_j. With two stages K_{j+1}'s slot frees once every consumer has read K_{j-1} (early
// in their step j - 1), V_j's only once P_{j-2} V_{j-2} has completed (late in that step); K_{j+1} queued
// behind V_j would wait for the later of the two, and S_{j+1} is the product the consumers issue first.
// The in-order builds load K_j, V_j: their step j needs V_j before S_{j+1}.
#pragma once

#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/timeline.cuh"
#include "fa/tma.cuh"
#include "fa/tma_params.h"
#include "sm90/fwd_ws/pipeline.cuh"
#include "sm90/fwd_ws/scheduler.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class Mask, bool kDropout>
__device__ __forceinline__ void fwd_ws_producer(const FwdTmaParams& tp, const FwdWsSmem<Cfg> sm,
                                                const FwdWsScheduler<Cfg, Mask> sched) {
  using Smem = FwdWsSmem<Cfg>;
  using Tile = typename FwdWsScheduler<Cfg, Mask>::Tile;
  using Rows = typename FwdWsScheduler<Cfg, Mask>::Rows;
  constexpr int BR = Cfg::kBlockQ;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int NST = Cfg::kStages;
  // Swizzle panels of a Q or K tile (128 bytes: 64 columns of 2 bytes, 128 of e4m3's 1; e4m3 at head_dim
  // 64: one 64-byte panel, Smem::kQKPanelBytes) and 128-byte panels of a V tile; e4m3's V^T tile is DV rows
  // of BC keys, BC / VPB panels of VPB keys (128, or one of 64 with the 64-byte swizzle at 64-key tiles,
  // Smem::kVtPanelBytes), its map over (keys, head_dim, head, batch) of ops/fp8_values.py's layout.
  constexpr int E = Smem::E;
  constexpr int PB = Smem::kQKPanelBytes;
  constexpr int PW = PB / E;  // columns of a panel
  constexpr int NP = Cfg::kHeadDim / PW;
  constexpr int VPB = Smem::kVtPanelBytes;
  constexpr int NPV = Smem::kE4M3 ? BC / VPB : Cfg::kHeadDimV / 64;
  constexpr int NQ = Smem::NQ;
  constexpr u32 kQBytes = Smem::kQBytes;
  constexpr u32 kKTile = Smem::kKTile;
  constexpr u32 kVTile = Smem::kVTile;
  const FwdParams& p = tp.p;
  const int tid = threadIdx.x;
  // The producer keeps a few dozen registers and the consumers take the rest (Cfg::kProducerRegs /
  // kConsumerRegs: configs.forward.register_split says why these numbers).
  if constexpr (Cfg::kProducerRegs > 0) setmaxnreg_dec<Cfg::kProducerRegs>();
  if (tid != 0) return;
#if FA_TIMELINE
  timeline::Recorder tl(p, 0);  // (fa/timeline.cuh: the timeline build's event stamps)
#endif
  tma_prefetch_map(&tp.k_map);
  tma_prefetch_map(&tp.v_map);
  int ring = 0;     // K/V blocks loaded so far (slot ring % NST, its use ring / NST)
  int q_loads = 0;  // q_full completions so far (persistent: one per tile, empty tiles included)
  int tile = sched.first_tile();
  for (;;) {
    if constexpr (Cfg::kPersistent) {
      // A Q buffer (and its s_tile) is free once every consumer thread is past the last S = Q K^T of the
      // tile that used it before (which also means it has read that tile's index): the (q_loads / NQ)-th
      // use of buffer q_loads % NQ waits for the previous use's q_empty completion.
      if (q_loads >= NQ) mbar_wait(sm.q_empty(q_loads % NQ), ((q_loads - NQ) / NQ) & 1);
      st_shared_32(sm.s_tile(q_loads % NQ), (u32)tile);
      if (tile >= sched.num_tiles) {
        mbar_arrive(sm.q_full(q_loads % NQ));  // no bytes: the consumers read the stop sign and leave
        sched.retire(tp);
        break;
      }
    }
    const int next = sched.draw(tp);
    const Tile x = sched.tile_at(p, tile);
    const Rows rows = sched.rows_of(p, x);
    const int q_start = rows.start;
    const Mask mask(p, x.batch, x.head);
    int origin;
    const auto blocks = sched.blocks_of(mask, rows, origin);
    const int n_iter = blocks.end - blocks.begin;
    const int qb = q_loads % NQ;  // this tile's Q buffer
    if (n_iter <= 0) {
      // The consumers write its empty output without any load; persistent, they still need the index.
      if constexpr (Cfg::kPersistent) mbar_arrive(sm.q_full(qb));
      ++q_loads;
    } else {
      mbar_arrive_expect_tx(sm.q_full(qb), kQBytes);
#pragma unroll
      for (int pn = 0; pn < NP; ++pn)
        tma_load_4d(sm.sQ + qb * kQBytes + pn * BR * PB, &tp.q_map, sm.q_full(qb), PW * pn, q_start, x.head,
                    x.batch);
      FA_TIMELINE_EVENT(tl, kQIssued, tile);
      ++q_loads;
      const int kv_head = x.head / p.group;
      // Block n of the producer's count (this tile's block n - first + blocks.begin) to slot n % NST. The
      // slot's previous K (load n - NST) must have been read by every consumer warp: that was the
      // (n / NST - 1)-th completion of k_empty[slot]; the same for V.
      const int first = ring;
      auto row_of = [&](int n) { return origin + (blocks.begin + n - first) * BC; };
      auto load_k = [&](int n) {
        const int s = n % NST;
        if (n >= NST) mbar_wait(sm.k_empty(s), (u32)((n / NST - 1) & 1));
        mbar_arrive_expect_tx(sm.k_full(s), kKTile);
#pragma unroll
        for (int pn = 0; pn < NP; ++pn)
          tma_load_4d(sm.sK + s * kKTile + pn * BC * PB, &tp.k_map, sm.k_full(s), PW * pn, row_of(n), kv_head,
                      x.batch);
        FA_TIMELINE_EVENT(tl, kKIssued, n);
      };
      auto load_v = [&](int n) {
        const int s = n % NST;
        if (n >= NST) mbar_wait(sm.v_empty(s), (u32)((n / NST - 1) & 1));
        mbar_arrive_expect_tx(sm.v_full(s), kVTile);
#pragma unroll
        for (int pn = 0; pn < NPV; ++pn) {
          if constexpr (Smem::kE4M3)  // (keys row + VPB pn on, all DV rows)
            tma_load_4d(sm.sV + s * kVTile + pn * Cfg::kHeadDimV * VPB, &tp.v_map, sm.v_full(s),
                        row_of(n) + VPB * pn, 0, kv_head, x.batch);
          else
            tma_load_4d(sm.sV + s * kVTile + pn * BC * 128, &tp.v_map, sm.v_full(s), 64 * pn, row_of(n),
                        kv_head, x.batch);
        }
        FA_TIMELINE_EVENT(tl, kVIssued, n);
      };
      if constexpr (FwdWsBuild<Cfg, kDropout>::kKFirst) {
        load_k(ring);
        for (int it = 0; it < n_iter; ++it, ++ring) {
          if (it + 1 < n_iter) load_k(ring + 1);
          load_v(ring);
        }
      } else {
        // (main's loop as it was, not load_k and load_v in turn: in the dropout builds, whose consumers are
        // at their register limit, that form alone cost 4 bytes of spills in three d128 kernels)
        for (int it = 0; it < n_iter; ++it, ++ring) {
          const int s = ring % NST;
          const u32 reuse = (ring / NST - 1) & 1;
          if (ring >= NST) mbar_wait(sm.k_empty(s), reuse);
          const int row = origin + (blocks.begin + it) * BC;
          mbar_arrive_expect_tx(sm.k_full(s), kKTile);
#pragma unroll
          for (int pn = 0; pn < NP; ++pn)
            tma_load_4d(sm.sK + s * kKTile + pn * BC * PB, &tp.k_map, sm.k_full(s), PW * pn, row, kv_head,
                        x.batch);
          FA_TIMELINE_EVENT(tl, kKIssued, ring);
          if (ring >= NST) mbar_wait(sm.v_empty(s), reuse);
          mbar_arrive_expect_tx(sm.v_full(s), kVTile);
#pragma unroll
          for (int pn = 0; pn < NPV; ++pn) {
            if constexpr (Smem::kE4M3)  // (keys row + VPB pn on, all DV rows)
              tma_load_4d(sm.sV + s * kVTile + pn * Cfg::kHeadDimV * VPB, &tp.v_map, sm.v_full(s),
                          row + VPB * pn, 0, kv_head, x.batch);
            else
              tma_load_4d(sm.sV + s * kVTile + pn * BC * 128, &tp.v_map, sm.v_full(s), 64 * pn, row, kv_head,
                          x.batch);
          }
          FA_TIMELINE_EVENT(tl, kVIssued, ring);
        }
      }
    }
    if constexpr (!Cfg::kPersistent) break;
    tile = next;
  }
}

}  // namespace sm90
}  // namespace fa
