// The consumers of the warp-specialized forward: warpgroups 1..NC, each owning 64 query rows of the block.
// Their tile loop composes the other parts: the tile the producer published (scheduler.cuh), the mainloop's
// steps over its K/V blocks (mainloop.cuh) in one of two schedules, and the epilogue (epilogue.cuh).
//
// Contract: the consumers count the ring and the Q buffers as the producer does (`ring`, `q_loads`), so
// that block j of a tile is in the slot the producer loaded it into; persistent, they wait on q_full for
// each tile's index (and its Q) and arrive on q_empty once past its last S = Q K^T (mainloop.cuh, s_done)
// or, for a tile without keys, after its empty output. Both schedules below live in this function, as they
// lived in the kernel's one function before the split, and the mainloop's accumulators are arrays local to
// this function, apart from the mainloop object that refers to them: inside that object, beside its
// references and constants, the same code compiled to other machine code, and as one struct of four
// arrays the compiler numbered their registers in another order (the PTX the same but for those numbers,
// from which ptxas scheduled differently).
#pragma once

#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/timeline.cuh"
#include "fa/tma_params.h"
#include "fa/trace.cuh"
#include "fa/wgmma.cuh"
#include "sm90/fwd_ws/descales.cuh"
#include "sm90/fwd_ws/epilogue.cuh"
#include "sm90/fwd_ws/mainloop.cuh"
#include "sm90/fwd_ws/pipeline.cuh"
#include "sm90/fwd_ws/scheduler.cuh"

namespace fa {
namespace sm90 {

// (sm and sched by value: their fields are this function's own values, not loads through a pointer that
// every asm statement of the loops below might have changed; passed by reference, the producer's loop
// compiled to other machine code.)
template <class Cfg, class V, bool kDropout>
__device__ __forceinline__ void fwd_ws_consumer(const FwdTmaParams& tp, const FwdWsSmem<Cfg> sm,
                                                const FwdWsScheduler<Cfg, typename V::Mask> sched) {
  using Mask = typename V::Mask;
  using Mainloop = FwdWsMainloop<Cfg, V, kDropout>;
  using Epilogue = FwdWsEpilogue<Cfg, V, kDropout>;
  using Tile = typename FwdWsScheduler<Cfg, Mask>::Tile;
  using Rows = typename FwdWsScheduler<Cfg, Mask>::Rows;
  using Work = typename Mainloop::Tile;
  constexpr bool kTileOverlap = FwdWsBuild<Cfg, kDropout>::kTileOverlap;
  constexpr bool kKFirst = FwdWsBuild<Cfg, kDropout>::kKFirst;
  constexpr int BC = Cfg::kBlockKV;
  constexpr int KS = Mainloop::KS;  // k-steps of O += P V
  constexpr int NS = BC / 8;   // 8-column n-tiles of S
  constexpr int NQ = FwdWsSmem<Cfg>::NQ;
  constexpr bool kSumOnCudaCores = Mainloop::kSumOnCudaCores;
  constexpr bool kSumPackedPOnes = Mainloop::kSumPackedPOnes;
  constexpr bool kBoundable = Mainloop::kBoundable;
  const FwdParams& p = tp.p;
  const int tid = threadIdx.x;
  if constexpr (Cfg::kConsumerRegs > 0) setmaxnreg_inc<Cfg::kConsumerRegs>();
  const ConsumerThread th(tid);
#if FA_TIMELINE
  timeline::Recorder tl(p, tid / 32);
#endif

  // The mainloop's accumulators (mainloop.cuh says what they hold), apart from the mainloop object and from
  // each other: the header says why.
  float o[Mainloop::NO * 4];
  float row_max[2], row_sum[2];
  float row_sum_p[4];
  Mainloop ml(p, sm, th, o, row_max, row_sum, row_sum_p);
  Epilogue epi(tp, sm, th);

  int ring = 0;     // K/V blocks consumed so far, as the producer counts them
  int q_loads = 0;  // q_full completions consumed so far
  for (int tile = 0;; ++q_loads) {
    if constexpr (Cfg::kPersistent) {
      // The producer's index of this tile, and its Q if it has keys (buffer q_loads % NQ, its
      // (q_loads / NQ)-th use).
      mbar_wait(sm.q_full(q_loads % NQ), (q_loads / NQ) & 1);
      tile = (int)ld_shared_32(sm.s_tile(q_loads % NQ));
      if (tile >= sched.num_tiles) break;
    } else if (q_loads > 0) {
      break;  // the block's one tile is done
    }
    FA_TIMELINE_EVENT(tl, kTileBegin, tile);
    const Tile x = sched.tile_at(p, tile);
    const int batch = x.batch, head = x.head;
    const Rows rows = sched.rows_of(p, x);
    const int q_start = rows.start;
    const int q_valid = rows.count;
    u16* gO = static_cast<u16*>(p.o) + o_offset(p, batch, head, q_start);
    float* gL = p.lse ? p.lse + lse_offset(p, batch, head, q_start) : nullptr;
    const Mask mask(p, batch, head);
    const typename V::ScoreMod score_mod(p, batch, head);
    int origin;
    const auto blocks = sched.blocks_of(mask, rows, origin);
    const int j_lo = blocks.begin;
    const int n_iter = blocks.end - j_lo;
    // The first key of the tile's first block (the origin folded in, so one value lives through the loop).
    const int kv_first = origin + j_lo * BC;
#if FA_TRACE
    // Per tile: the persistent grid's block runs several, of which at most one is the traced one.
    trace::Tracer<Cfg> tr(p, batch, head, sched.m_block_of(p, x), th.ctid / 32, th.lane);
    tr.begin(blocks.end);
#endif
    if (n_iter <= 0) {  // no key visible to any row: out = 0, lse = -inf
      if (kTileOverlap && epi.pending >= 0) {
        epi.run_pending(sched, ml);
      }
#if FA_TRACE
      tr.empty_block();
#endif
      epi.empty_tile(gO, gL, q_valid, head);
      if constexpr (Cfg::kPersistent) mbar_arrive(sm.q_empty(q_loads % NQ));  // this thread has read s_tile
      continue;
    }

    if constexpr (!kTileOverlap) ml.reset();  // (tile_overlap: after the previous tile's epilogue)
    // (e4m3: the tile's q and k descales in its softmax factor; the other builds use the mainloop's own)
    const float tile_sl2 = FwdWsSmem<Cfg>::kE4M3 ? p.scale_log2 * fwd_qk_descale(tp, batch, head) : 0.f;
#if FA_TRACE
    const Work w{mask, score_mod, batch, head, q_start, kv_first, n_iter, ring, q_loads, tile_sl2, tr, j_lo};
#else
    const Work w{mask, score_mod, batch, head, q_start, kv_first, n_iter, ring, q_loads, tile_sl2};
#endif

    // ---- the mainloop: the tile's K/V blocks, from its first S to its last P V -------------------------

    if (th.cwg == 1) ml.pass_turn();
    if constexpr (!Cfg::kPersistent) mbar_wait(sm.q_full(0), 0);  // (persistent: waited for with the index)
    if constexpr (!Cfg::kOverlap) {
      // In order: S_j, its softmax, then P_j V_j; the tensor cores idle while the softmax runs.
      for (int it = 0; it < n_iter; ++it) {
        mbar_wait(sm.k_full(ml.slot(w, it)), ml.phase(w, it));
        float sacc[NS * 4];
        ml.take_turn();  // (ping-pong: this warpgroup's softmax below runs under the other's P V)
        ml.issue_s_at(sacc, w, it);
        FA_TIMELINE_EVENT(tl, kSIssued, it);
        wgmma_wait<0>();
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, it);
#if FA_TRACE
        ml.trace_s(sacc, w, it);
#endif
        ml.s_done(w, it);
        float alpha[2];
        ml.softmax_step(sacc, w, it, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, it);
#if FA_TRACE
        ml.trace_softmax(sacc, w, alpha);
#endif
        ml.rescale_o(alpha);
        u32 pf[KS][4];
        Mainloop::to_p(pf, sacc);
        if constexpr (kSumOnCudaCores)
          if (ml.bounded) add_p_row_sums<BC>(ml.row_sum_p, pf);
        mbar_wait(sm.v_full(ml.slot(w, it)), ml.phase(w, it));
        ml.issue_pv_at(pf, w, it);
        ml.pass_turn();
        wgmma_wait<0>();
        wgmma_hold(ml.o);
        if constexpr (kSumPackedPOnes) wgmma_hold(ml.row_sum_p);
        FA_TIMELINE_EVENT(tl, kPVDone, it);
#if FA_TRACE
        ml.trace_pv(w, it);
#endif
        ml.release(sm.v_empty(ml.slot(w, it)));
      }
    } else {
      // Intra-warpgroup overlap: iteration j issues S_j and then P_{j-1} V_{j-1}, waits for S_j only
      // (wgmma groups complete in order) and runs S_j's softmax while P_{j-1} V_{j-1} occupies the tensor
      // cores. O may be rescaled by S_j's factors, and P_j written over P_{j-1}, only once that product
      // has completed. Costs the registers of P_{j-1} beside S_j (32 more at 128 keys).
      u32 pf[KS][4];
      {
        mbar_wait(sm.k_full(ml.slot(w, 0)), ml.phase(w, 0));
        float sacc[NS * 4];
        ml.take_turn();
        ml.issue_s_at(sacc, w, 0);
        FA_TIMELINE_EVENT(tl, kSIssued, 0);
        ml.pass_turn();
        if constexpr (kTileOverlap) {
          if (epi.pending >= 0) {  // the previous tile's epilogue, under this first S
            FA_TIMELINE_EVENT(tl, kEpilogueBegin, epi.pending);
            const int finished = epi.pending;
            epi.run_pending(sched, ml);
            FA_TIMELINE_EVENT(tl, kEpilogueEnd, finished);
          }
          ml.reset();
        }
        wgmma_wait<0>();
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, 0);
#if FA_TRACE
        ml.trace_s(sacc, w, 0);
#endif
        ml.s_done(w, 0);
        float alpha[2];  // O is still zero: nothing to rescale
        ml.softmax_step(sacc, w, 0, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, 0);
#if FA_TRACE
        ml.trace_softmax(sacc, w, alpha);
#endif
        Mainloop::to_p(pf, sacc);
      }
      for (int it = 1; it < n_iter; ++it) {
        mbar_wait(sm.k_full(ml.slot(w, it)), ml.phase(w, it));
        float sacc[NS * 4];
        // kKFirst: the producer loads K_j before V_{j-1} (producer.cuh), so S_j is issued before the wait
        // for V_{j-1}; a late V then delays only its own product, not S_j's.
        if constexpr (!kKFirst) mbar_wait(sm.v_full(ml.slot(w, it - 1)), ml.phase(w, it - 1));
        ml.take_turn();
        ml.issue_s_at(sacc, w, it);
        if constexpr (kKFirst) mbar_wait(sm.v_full(ml.slot(w, it - 1)), ml.phase(w, it - 1));
        ml.issue_pv_at(pf, w, it - 1);
        if constexpr (kSumOnCudaCores)
          if (ml.bounded) add_p_row_sums<BC>(ml.row_sum_p, pf);  // P_{j-1}'s, under its product
        FA_TIMELINE_EVENT(tl, kSIssued, it);
        ml.pass_turn();
        wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
        wgmma_hold(sacc);
        FA_TIMELINE_EVENT(tl, kSDone, it);
#if FA_TRACE
        ml.trace_s(sacc, w, it);
#endif
        ml.s_done(w, it);
        float alpha[2];
        ml.softmax_step(sacc, w, it, alpha);
        FA_TIMELINE_EVENT(tl, kSoftmaxDone, it);
#if FA_TRACE
        ml.trace_softmax(sacc, w, alpha);
#endif
        // (FA_NO_SOFTMAX_ORDER: defined only by tools/ws_timeline.py --old-order and A/B scripts, the old
        // schedule.)
#if !FA_NO_SOFTMAX_ORDER
        // The softmax step runs under P_{j-1} V_{j-1}, not after it: its sums (which need every exponential
        // and the max) must be done before the wait (fa/wgmma.cuh says why ptxas would hoist the wait).
        // Measured on the H100 against ptxas's own order (kernel-log step 58): +1-5% at head_dim 128 and
        // 256, -1-3% at 64 in the 128-row builds. On the H200, in one process, the 192-row head_dim 64
        // builds run 0.5-2% faster with it (kernel log 170), so it holds from 64 on (below, untried) but
        // in the dropout builds, which keep 128 (at d64 they spilled 4-16 bytes with it).
        // (sm.sQ only names a shared address for the store, which never executes: head_dim > 0.)
        if constexpr (Cfg::kHeadDimV >= (kDropout ? 128 : 64))
          order_before_wgmma_wait(ml.row_sum[0] + ml.row_sum[1], sm.sQ, p.head_dim);
#endif
        wgmma_wait<0>();
        wgmma_hold(ml.o);
        if constexpr (kSumPackedPOnes) wgmma_hold(ml.row_sum_p);
        FA_TIMELINE_EVENT(tl, kPVDone, it - 1);
#if FA_TRACE
        ml.trace_pv(w, it - 1);  // the previous step's O, before this step's rescale
#endif
        ml.release(sm.v_empty(ml.slot(w, it - 1)));
        ml.rescale_o(alpha);
        Mainloop::to_p(pf, sacc);
      }
      mbar_wait(sm.v_full(ml.slot(w, n_iter - 1)), ml.phase(w, n_iter - 1));
      ml.take_turn();
      ml.issue_pv_at(pf, w, n_iter - 1);
      if constexpr (kSumOnCudaCores)
        if (ml.bounded) add_p_row_sums<BC>(ml.row_sum_p, pf);
      ml.pass_turn();
      wgmma_wait<0>();
      wgmma_hold(ml.o);
      if constexpr (kSumPackedPOnes) wgmma_hold(ml.row_sum_p);
      FA_TIMELINE_EVENT(tl, kPVDone, n_iter - 1);
#if FA_TRACE
      ml.trace_pv(w, n_iter - 1);
#endif
      ml.release(sm.v_empty(ml.slot(w, n_iter - 1)));
    }
    if constexpr (kBoundable) {
      if (ml.bounded) {  // O / L_r with the LSE of L (fa/softmax.cuh bounded_lse_from_fp32_sum)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          bounded_lse_from_fp32_sum(ml.row_max[r], ml.row_sum[r], ml.row_sum_p[2 * r], p.scale,
                                    !kSumPackedPOnes);
      }
    }
    if (th.cwg == 0) ml.take_turn();  // the turn warpgroup 1 passed after its last issue
    ring += n_iter;
    if constexpr (!kTileOverlap) FA_TIMELINE_EVENT(tl, kEpilogueBegin, tile);  // (else: where it runs)

    // ---- epilogue: O / L and the LSE --------------------------------------------------------------------
    if constexpr (!Cfg::kPersistent && !Cfg::kPingpong) {
#if FA_TRACE
      epi.block_tile(ml, gO, gL, q_start, q_valid, head, batch, tr);
#else
      epi.block_tile(ml, gO, gL, q_start, q_valid, head, batch);
#endif
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, tile);
    } else if constexpr (kTileOverlap) {
      epi.pending = tile;  // its epilogue runs under the next tile's first S, or after the loop
    } else {
      if constexpr (kEpilogueDerivedLate<Cfg>) {
        // The tile's rows and LSE pointer derived again from its index: held from the tile's start they
        // would take registers from the step loop, which has none to spare (derived_late_if_tight).
        epi.pending = derived_late_if_tight<Cfg>(tile);
        epi.run_pending(sched, ml);
      } else {
        epi.warpgroup(ml, x, q_start, q_valid, gL);
      }
#if FA_TRACE
      // (read back after the copy-out, which only reads them)
      epi.trace_final(tr, ml, epi.sOw, th.warp_row0 - 64 * th.cwg);
#endif
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, tile);
    }
  }
  if constexpr (kTileOverlap) {
    if (epi.pending >= 0) {
      FA_TIMELINE_EVENT(tl, kEpilogueBegin, epi.pending);
      const int finished = epi.pending;
      epi.run_pending(sched, ml);
      FA_TIMELINE_EVENT(tl, kEpilogueEnd, finished);
    }
  }
  // The block's shared memory must outlive the last TMA stores that read it, and their writes must be done
  // before the grid is (a later kernel on the stream reads O).
  epi.finish();
}

}  // namespace sm90
}  // namespace fa
