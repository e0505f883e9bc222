// The epilogue of the warp-specialized forward: a finished tile's O / L and LSE, from the mainloop's
// accumulators (mainloop.cuh) to global memory, by TMA stores or the consumers' own copies.
//
// Contract: the epilogue reads the mainloop's o, row_max and row_sum (the `Acc` of its methods: the
// FwdWsMainloop of mainloop.cuh; it never writes them) and owns the staging of the output rows:
// persistent, the buffer sO (each consumer warpgroup its 64 rows); otherwise the rows of the Q tile that
// the warpgroup's last wgmma has read. It waits on no mbarrier; it meets only consumer threads at named
// barriers (1: every consumer, 4 + c: warpgroup c's own), and the thread that issues a warpgroup's TMA
// stores waits for their reads before its next staging (bulk_wait_read) and for the whole copy before the
// block exits (finish). With tile_overlap it also keeps the tile whose epilogue is deferred (`pending`),
// which the tile loop (consumer.cuh) runs under the next tile's first S.
#pragma once

#include "fa/epilogue.cuh"
#include "fa/fwd_wgmma.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/softmax.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/tma.cuh"
#include "fa/tma_params.h"
#include "fa/trace.cuh"
#include "fa/variant.cuh"
#include "sm90/fwd_ws/descales.cuh"
#include "sm90/fwd_ws/pipeline.cuh"
#include "sm90/fwd_ws/scheduler.cuh"

namespace fa {
namespace sm90 {

// `v` where ptxas cannot see through it (an empty asm), at the consumers' tightest register budget only.
// Inside the persistent tile loop ptxas hoists what the epilogue derives from the thread index alone out of
// the loop and holds it through every tile's mainloop. At the three-warpgroup tile's 160 registers a thread
// that held 20 such registers, and ptxas bought them back from the softmax's overlap: each tile ran 10%
// slower than the one-block build's. At two warpgroups' 232 there is room to hold them, and the barrier
// there cost the d128 persistent 1k causal forward 2.7% (kernel log 181), so it stays off.
template <class Cfg>
constexpr bool kEpilogueDerivedLate = Cfg::kConsumerRegs > 0 && Cfg::kConsumerRegs <= 160;

template <class Cfg>
__device__ __forceinline__ int derived_late_if_tight(int v) {
  if constexpr (kEpilogueDerivedLate<Cfg>) asm volatile("" : "+r"(v));
  return v;
}

template <class Cfg, class V, bool kDropout>
struct FwdWsEpilogue {
  using Mask = typename V::Mask;
  using Smem = FwdWsSmem<Cfg>;
  using Scheduler = FwdWsScheduler<Cfg, Mask>;
  using Tile = typename Scheduler::Tile;
  using Rows = typename Scheduler::Rows;
  static constexpr bool kFold = kFoldsScale<V, true>;
  static constexpr bool kTmaStore = FwdWsBuild<Cfg, kDropout>::kTmaStore;
  static constexpr bool kSegments = Scheduler::kSegments;
  static constexpr bool BF = Cfg::kIsBF16;
  static constexpr int D = Cfg::kHeadDimV;  // the output's columns (v's head_dim)
  static constexpr int BR = Cfg::kBlockQ;
  static constexpr int NC = BR / 64;    // consumer warpgroups
  static constexpr int NCT = NC * 128;  // consumer threads
  static constexpr int NO = D / 8;      // 8-column n-tiles of O
  static constexpr int NP = D / 64;     // 64-column panels of the output tile

  const FwdTmaParams& tp;
  const FwdParams& p;
  const Smem& sm;
  const ConsumerThread& th;
  // Where this warpgroup stages its output rows in the per-warpgroup epilogue below: persistent, its part of
  // the output tile sO (PanelTile<64>); otherwise its own rows of the Q tile (PanelTile<BR>).
  u32 sOw;
  // kTileOverlap: a tile's epilogue does not run at its end but in the next tile, once that tile's first
  // S = Q K^T is issued, so the tensor cores run that product through the epilogue instead of idling
  // between the tiles (the epilogue, then the first S and its wait, took about 2,500 of a 25,000-cycle
  // tile at head_dim 128 and 1k keys: kernel-log step 58). o and the row statistics stay as the finished
  // tile left them until then, `pending` names it, and the next tile resets them after its epilogue; the
  // block's last tile (or one before an empty tile) has its epilogue where the loop finds no product to
  // hide it under.
  int pending;

  __device__ __forceinline__ FwdWsEpilogue(const FwdTmaParams& tp, const Smem& sm, const ConsumerThread& th)
      : tp(tp), p(tp.p), sm(sm), th(th) {
    if constexpr (kTmaStore) {
      if (th.ctid % 128 == 0) tma_prefetch_map(&tp.o_map);  // each warpgroup's store issuer (the epilogue)
    }
    // (In the body, after the prefetch: as the statements stood in the one function this was taken from,
    // which is the order the machine code was measured in.)
    sOw = Cfg::kPersistent ? sm.sO + th.cwg * 64 * D * 2 : sm.sQ + th.cwg * 64 * 128;
    pending = -1;
  }

  // A tile without a visible key: out = 0, lse = -inf, every consumer thread a part.
  __device__ __forceinline__ void empty_tile(u16* gO, float* gL, int q_valid, int head) const {
    // The copy's per-thread rows and chunks are loop invariants of the persistent tile loop: at d64's
    // 192-row tile they took 10 registers from the step loop (derived_late_if_tight).
    store_empty_block<BR, D, NCT>(p, gO, gL, q_valid, head, derived_late_if_tight<Cfg>(th.ctid));
  }

  // The block's one tile (neither persistent nor ping-pong): O staged in this warpgroup's own rows of the Q
  // tile: each consumer warpgroup's wgmma read only its own 64 rows of Q, and its last one has completed.
  template <class Acc>
  __device__ __forceinline__ void block_tile(const Acc& ml, u16* gO, float* gL, int q_start, int q_valid,
                                             int head, int batch
#if FA_TRACE
                                             ,
                                             trace::Tracer<Cfg>& tr
#endif
  ) const {
    static_assert(!Smem::kE4M3, "the e4m3 build is persistent: its descales are applied in warpgroup()");
    const int cwg = th.cwg;
    stage_o_and_lse<D, PanelTile<BR>, BF, kFold>(p, ml.o, ml.row_max, ml.row_sum, sm.sQ, gL, th.warp_row0,
                                                 th.g, th.t, q_valid, head_sink(p, head));
#if FA_TRACE
    trace_final(tr, ml, sm.sQ, th.warp_row0);
#endif
    const int wg_rows = q_valid - 64 * cwg;
    if (kTmaStore && kSegments && wg_rows < 64) {
      // A packed batch's tile ending inside the tensor: this warpgroup copies its own rows out (a TMA
      // store would write all 64, over the next sequence's; warpgroup() says the same).
      named_barrier_sync(4 + cwg, 128);
      if (wg_rows > 0)
        store_o_tile_serial<64, D, 128, PanelTile<BR>>(p, gO + 64 * cwg * p.o_row_stride,
                                                       sm.sQ + cwg * 64 * 128, wg_rows, th.ctid % 128);
    } else if constexpr (kTmaStore) {
      // One thread per warpgroup stores the warpgroup's own rows (one TMA store per 64-column panel) once
      // its four warps have staged them (fence: visible to the TMA unit; named barrier 4 + cwg: only this
      // warpgroup's threads). The block's one tile: nothing stages over the rows again, and the block
      // waits for the stores at its exit. (The warpgroup-per-warpgroup path below costs this schedule the
      // extra barrier and, compiled by NVRTC, 92-96 spilled bytes in head_dim 256's dropout tiles.)
      fence_proxy_async();
      named_barrier_sync(4 + cwg, 128);
      if (th.ctid % 128 == 0) {
#pragma unroll
        for (int pn = 0; pn < NP; ++pn)
          tma_store_4d(&tp.o_map, sm.sQ + pn * BR * 128 + cwg * 64 * 128, 64 * pn, q_start + 64 * cwg, head,
                       batch);
        bulk_commit();
      }
    } else {
      // Every consumer's rows of O are staged before any of them copies whole rows out (named barrier 1:
      // the producer warpgroup does not take part).
      named_barrier_sync(1, NCT);
      store_o_tile<BR, D, NCT, PanelTile<BR>>(p, gO, sm.sQ, q_valid, th.ctid);
    }
  }

  // The output (and LSE) rows of this warpgroup for tile `x`, from o and the row statistics: the epilogue
  // of the persistent and ping-pong configs (in consumer.cuh's tile loop; with kTileOverlap, under the next
  // tile's first S). The staged rows stay in sOw until the warpgroup's next epilogue.
  template <class Acc>
  __device__ __forceinline__ void warpgroup(const Acc& ml, const Tile& x, int q_start, int q_valid,
                                            float* gL) const {
    // Each warpgroup stages and copies out its own 64 rows, meeting only its own warps (named barrier
    // 4 + cwg, 128 threads): the warpgroups drift apart (ping-pong makes them) and need not wait for each
    // other. Persistent, the rows go to the warpgroup's part of sO (PanelTile<64>), so the next tile's Q
    // can land meanwhile; otherwise to its own rows of the Q tile (its wgmma read no others). The first
    // barrier orders every warp's copy-out of the previous tile (persistent), or its last wgmma read of
    // those rows of Q, before any warp stages over them; the second orders the staging before the copy,
    // which reads other warps' rows.
    // Ping-pong takes this path even without the persistent grid: with the 256-thread barrier of the
    // path above, racecheck reported hazards between the staging and the copy (it does not follow the
    // bar.arrive turns), though the outputs were right. Other configs keep that path: this one costs the
    // non-persistent kernels 16 instructions and, compiled by NVRTC, spills in the 176-key dropout tiles
    // (docs/kernel-log.md, step 36).
    // With tma_store, one thread of the warpgroup hands the staged rows to the TMA unit,
    // one store per 64-column panel, and the warpgroup goes on: the copy-out's shared loads and global
    // stores (2 D / 16 of each per thread) leave the path between this tile's last P V and the next
    // tile's first S. The store reads the staging buffer after the warpgroup has moved on, so before the
    // next staging over it the issuing thread waits for its reads (bulk_wait_read, ahead of the first
    // barrier, which then holds the other warps back), and before the block exits for the whole copy.
    using OTile = PanelTile<Cfg::kPersistent ? 64 : BR>;
    constexpr int kOTileRows = Cfg::kPersistent ? 64 : BR;  // rows of one panel of the staging tile
    // This thread's coordinates derived again: what the staging derives from them alone (16 shared
    // addresses a thread at d64) would otherwise be held through every mainloop (derived_late_if_tight).
    const ConsumerThread me(derived_late_if_tight<Cfg>(th.ctid + 128));
    const int cwg = me.cwg;
    const int rows = q_valid - 64 * cwg;
    const bool store_issuer = me.ctid % 128 == 0;
    if constexpr (kTmaStore) {
      if (store_issuer) bulk_wait_read<0>();  // the previous tile's stores have read sOw
    }
    named_barrier_sync(4 + cwg, 128);
    // (e4m3: O times the tile's v descale before its bf16 rounding, the LSE of scores scaled by q's and k's)
    const float o_factor = Smem::kE4M3 ? fwd_descale(tp, tp.v_descale, x.batch, x.head) : 1.f;
    const float lse_factor = Smem::kE4M3 ? fwd_qk_descale(tp, x.batch, x.head) : 1.f;
    stage_o_and_lse<D, OTile, BF, kFold>(p, ml.o, ml.row_max, ml.row_sum, sOw, gL ? gL + 64 * cwg : nullptr,
                                         me.warp_row0 - 64 * cwg, me.g, me.t, rows, head_sink(p, x.head),
                                         o_factor, lse_factor);
    // A TMA store writes the panel's 64 rows, clipped only at the tensor's end: a packed batch's tile that
    // ends inside the tensor (its sequence's last rows) copies its rows out itself, or it would write
    // over the next sequence's (another tile's) output. (Warpgroup-uniform.) That copy goes one chunk at a
    // time: unrolled, its loads in flight spilled the main loop of the tile_overlap builds (64-84 bytes,
    // 168-196 with soft-capping), and so did a second epilogue call site that ran cut tiles at their end
    // instead of deferring them (60-72 bytes with soft-capping).
    if (kTmaStore && (!kSegments || rows >= 64)) {
      // Each thread's staging stores (generic proxy) are made visible to the TMA unit (async proxy)
      // before the barrier lets the issuing thread start the copy.
      fence_proxy_async();
      named_barrier_sync(4 + cwg, 128);
      if (store_issuer) {
#pragma unroll
        for (int pn = 0; pn < NP; ++pn)
          tma_store_4d(&tp.o_map, sOw + pn * kOTileRows * 128, 64 * pn, q_start + 64 * cwg, x.head, x.batch);
        bulk_commit();
      }
    } else {
      named_barrier_sync(4 + cwg, 128);
      u16* gO = static_cast<u16*>(p.o) + o_offset(p, x.batch, x.head, q_start + 64 * cwg);
      if constexpr (kTmaStore)  // (only a cut tile comes here: the serial copy, which spills nothing)
        store_o_tile_serial<64, D, 128, OTile>(p, gO, sOw, rows, me.ctid % 128);
      else
        store_o_tile<64, D, 128, OTile>(p, gO, sOw, rows, me.ctid % 128);
    }
  }

  // kTileOverlap: the deferred tile's epilogue (pending >= 0).
  template <class Acc>
  __device__ __forceinline__ void run_pending(const Scheduler& sched, const Acc& ml) {
    const Tile x = sched.tile_at(p, pending);
    const Rows rows = sched.rows_of(p, x);
    float* gL = p.lse ? p.lse + lse_offset(p, x.batch, x.head, rows.start) : nullptr;
    warpgroup(ml, x, rows.start, rows.count, gL);
    pending = -1;
  }

  // The block's shared memory must outlive the last TMA stores that read it, and their writes must be done
  // before the grid is (a later kernel on the stream reads O).
  __device__ __forceinline__ void finish() const {
    if constexpr (kTmaStore) {
      if (th.ctid % 128 == 0) bulk_wait<0>();
    }
  }

#if FA_TRACE
  // The output rows as staged for the copy-out at `staged`, this warp's first at row0 (read back: what is
  // stored), and their LSE as computed for gL. Both epilogues stage in 64-row panels per warpgroup when
  // persistent, else in the BR-row panels of the Q tile.
  template <class Acc>
  __device__ __forceinline__ void trace_final(trace::Tracer<Cfg>& tr, const Acc& ml, u32 staged,
                                              int row0) const {
    using OTile = PanelTile<Cfg::kPersistent ? 64 : BR>;
    if (!tr.on()) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int n = 0; n < NO; ++n)
        tr.final_pair(th.g + 8 * r, 8 * n + 2 * th.t,
                      ld_shared_32(staged + OTile::bytes(row0 + th.g + 8 * r, n) + 4 * th.t));
      const float l = quad_sum(ml.row_sum[r]);
      if (th.t == 0) tr.final_lse(th.g + 8 * r, row_lse<kFold>(p, ml.row_max[r], l));
    }
  }
#endif
};

}  // namespace sm90
}  // namespace fa
