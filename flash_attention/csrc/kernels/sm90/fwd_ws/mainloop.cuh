// The consumers' mainloop of the warp-specialized forward: per K/V block of a tile, S = Q K^T on wgmma, the
// variant's score function and mask, the online softmax step (and dropout), then O += P V. The matrix
// products, masks and online softmax are those of the sm90 wgmma kernel (csrc/kernels/sm90/fwd), whose
// comments on the wgmma operand layouts apply here.
//
// Contract: the mainloop updates each consumer warpgroup's 64 x D output accumulator and its rows' running
// max and sums (o, row_max, row_sum, row_sum_p: arrays the consumer holds, which it refers to): reset()
// starts a tile, the schedules of consumer.cuh run its K/V blocks with the steps below, and the
// accumulators then hold the finished tile for the epilogue (epilogue.cuh) until the next reset(). The
// steps wait on no mbarrier themselves; the schedules wait on k_full / v_full (and, non-persistent,
// q_full). The mainloop completes k_empty and v_empty, one arrival per warp, as soon as its products have
// read a slot (release, s_done), and q_empty (persistent) after the tile's last S = Q K^T, one arrival per
// thread (pipeline.cuh). It counts the ring as the producer does: the tile loop hands it the blocks and Q
// buffers consumed before the tile (Tile::ring, Tile::q_loads). It owns the ping-pong turns (take_turn,
// pass_turn: named barriers 2 and 3).
//
// Debug build (FA_TRACE, fa/trace.cuh): one consumer warp of the traced tile records what it reads and
// computes. Q and K_j are read back from shared memory as soon as S_j has landed, before the warp releases
// K_j's slot (and, after the tile's last S, the Q buffer); M, alpha, L and P in the softmax step; V_j and O
// once P_j V_j has completed (in the overlapped schedule, inside step j + 1 or after the loop), before V_j's
// slot is released and O is rescaled again. Nothing of it is in the normal build.
#pragma once

#include "fa/dropout.cuh"
#include "fa/frag.cuh"
#include "fa/fwd_wgmma.cuh"
#include "fa/mask.cuh"
#include "fa/params.h"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/softmax.cuh"
#include "fa/trace.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"
#include "sm90/fwd_ws/pipeline.cuh"

namespace fa {
namespace sm90 {

template <class Cfg, class V, bool kDropout>
struct FwdWsMainloop {
  using Mask = typename V::Mask;  // the variant's policies (fa/variant.cuh)
  using ScoreMod = typename V::ScoreMod;
  using Smem = FwdWsSmem<Cfg>;
  static constexpr bool kFold = kFoldsScale<V, true>;
  static constexpr bool kTileOverlap = FwdWsBuild<Cfg, kDropout>::kTileOverlap;
  static constexpr bool BF = Cfg::kIsBF16;
  static constexpr int D = Cfg::kHeadDim;    // q and k: S = Q K^T's k dimension
  static constexpr int DV = Cfg::kHeadDimV;  // v and o: O += P V's n
  static constexpr int BR = Cfg::kBlockQ;
  static constexpr int BC = Cfg::kBlockKV;
  static constexpr int NST = Cfg::kStages;
  static constexpr int NS = BC / 8;  // 8-column n-tiles of S
  // FP8 (e4m3, Smem::kE4M3; docs/fp8-study.md): S and P V by 8-bit wgmmas of k = 32 (fa/fwd_wgmma.cuh),
  // V^T's tile read K-major; the softmax and the output (bf16) as in the 16-bit builds. The first form takes
  // plain attention with the causal mask only (no score function, dropout or trace build).
  static constexpr bool kE4M3 = Smem::kE4M3;
  static_assert(!kE4M3 || (ScoreMod::kIdentity && !kDropout && !FA_TRACE),
                "the e4m3 forward takes no score function, dropout or trace build yet");
  static constexpr int KS = kE4M3 ? BC / 32 : BC / 16;  // k-steps of O += P V
  static constexpr int NO = DV / 8;   // 8-column n-tiles of O
  static constexpr int NQ = Smem::NQ;
  static constexpr u32 kQBytes = Smem::kQBytes;
  static constexpr u32 kKTile = Smem::kKTile;
  static constexpr u32 kVTile = Smem::kVTile;
  // A Q or K tile's descriptor (K-major, 8-row groups): the 128-byte swizzle, or the 64-byte one of e4m3's
  // 64-byte rows at head_dim 64 (Smem::kQKPanelBytes, fa/wgmma.cuh smem_desc_sw64).
  static constexpr int PB = Smem::kQKPanelBytes;
  __device__ __forceinline__ static u64 qk_desc(u32 addr) {
    return PB == 64 ? smem_desc_sw64(addr, 16, 8 * 64) : smem_desc_sw128(addr, 16, 8 * 128);
  }
  // e4m3's V^T tile (K-major: its rows are keys): 128-byte panels, or the 64-byte swizzle's one panel at
  // 64-key tiles (Smem::kVtPanelBytes, whose static_assert allows 64 and 128 only).
  __device__ __forceinline__ static u64 vt_desc(u32 addr) {
    return Smem::kVtPanelBytes == 64 ? smem_desc_sw64(addr, 16, 8 * 64) : smem_desc_sw128(addr, 16, 8 * 128);
  }

  // Bounded scores (soft-capping in bf16, cap <= kFixedMaxCap): the softmax without a running max
  // (fa/softmax.cuh bounded_softmax_row), its origin cap / 2 kept as row_max for the LSE; a uniform
  // branch on the cap, so larger caps take the online softmax in the same build. Every head_dim without
  // ping-pong (the 176-key ping-pong build spilled 44 -> 120 bytes with it). The second path spills in
  // some builds (NVRTC 13.0): d64's 192-row causal and window builds (0 -> 108 and 0 -> 136 bytes, their
  // 128-register consumers), d256's 80-key window and packed builds (12 -> 48, 16 -> 32), d192's packed
  // build (0 -> 16); d256's 80-key dense build went 12 -> 0. Measured all the same (kernel log 105, H200,
  // cap 50): d256 12-18% faster dense, windowed and packed, d64 4-6% faster dense and packed, its causal
  // window unchanged against plain attention; d128 took it first (kernel log 99).
  static constexpr bool kBoundable = BF && !Cfg::kPingpong && ScoreModBounded<ScoreMod>::value;
  // O is divided by the sum of P as P V takes it, rounded to bf16 (L_r, row_sum_p below), and the LSE keeps
  // the fp32 sum (fa/softmax.cuh says why). L_r comes from the tensor cores at head_dim 64 and 128 (256:
  // below): each P V group also multiplies the packed P by a tile of ones (m64n8k16 per k-step, 1/16 of
  // P V's work at head_dim 128), whose result is every row's sum in every column; the CUDA cores keep only
  // the fp32 sum they had. With dropout P changes before it is packed, so the softmax rounds and sums it
  // itself. Rejected: summing the packed P on the CUDA cores under P V at head_dim 128 (+11%, kernel log
  // 116); packing S_j's P into a second register set before the wait, which made ptxas serialize every
  // wgmma (C7513): +21% d128, +46% d256.
  static constexpr bool kSumPackedP = kBoundable && !kDropout;
  // Head_dim 256 sums the packed P on the CUDA cores instead (add_p_row_sums, under P V): the ones product
  // was 2.2% slower causal and 0.5% non-causal there, against 7-9% faster at head_dim 64 (H200, kernel
  // log 120).
  static constexpr bool kSumOnCudaCores = kSumPackedP && DV > 128;
  // The builds whose L_r comes from the tensor cores: the kernel sets up the ones tile for them, with the
  // barriers (fwd_kernel.cuh, s_ones), before this mainloop exists.
  static constexpr bool kSumPackedPOnes =
      BF && !Cfg::kPingpong && ScoreModBounded<ScoreMod>::value && !kDropout && DV <= 128;
  static_assert(kSumPackedPOnes == (kSumPackedP && !kSumOnCudaCores),
                "the ones tile is set up for exactly the tensor cores' packed-sum builds");
  // The online softmax's reference max moves only by more than kLazyMargin (fa/softmax.cuh), and O's
  // rescale (D / 2 multiplies per thread) is skipped where no row of a warp moved it. At head_dim 256 only
  // (kernel log 106, H200: -4% by the fastest rounds). Below it the speed is there but not the accuracy
  // (kernel log 174): in one process on an H200 it was 1.5-3.3% faster at d128, 1.4-1.8% at d192 and
  // 1.3-2.5% at d64 non-causal, but the GPU suite then failed the forward's accuracy rule (2x SDPA's error)
  // in 65 cases, d64 and d192 / v128 with sinks: with a stale reference the block's largest P is no longer
  // exactly 1 but rounds to bf16 like the rest (the tile simulator on the failing shape: mean error +2.5%,
  // the largest up to +49%). The trace build too (the tile simulator, flash_attention/tools/sim.py
  // lazy_reference, models the lazy reference).
  static constexpr bool kLazyMax = DV >= 256;
  // Ping-pong (Cfg::kPingpong, two consumer warpgroups): the warpgroups take turns at every point where
  // they issue matrix products. Warpgroup c waits at named barrier kTurn + c for the other to have passed
  // it the turn (bar.arrive at the same barrier, 256 threads in all), issues, and passes the turn back. The
  // tensor cores then run one warpgroup's products while the other runs its softmax, instead of both
  // softmaxes falling in the same window. Per tile, warpgroup 1 passes first, so warpgroup 0 starts; both
  // issue the same number of times (same K/V blocks), and warpgroup 0 takes the one turn left over at the
  // end, so no arrival is pending when the tile ends.
  static constexpr int kTurn = 2;  // named barriers 2 and 3 (0: __syncthreads, 1, 4 and 5: the epilogue's)

  // One tile's work, as the consumers' tile loop (consumer.cuh) hands it to the steps: references to the
  // loop's own values, as the steps had them when they were lambdas of one function (with copies, the
  // compiler numbered the loop's registers in another order, and ptxas scheduled differently).
  struct Tile {
    const Mask& mask;
    const ScoreMod& score_mod;
    const int& batch;
    const int& head;
    const int& q_start;   // the tile's first query row
    const int& kv_first;  // the first key of the tile's first block (the origin folded in)
    const int& n_iter;    // its K/V blocks (at least one)
    const int& ring;      // K/V blocks consumed before it, as the producer counts them
    const int& q_loads;   // q_full completions consumed before it: its Q is in buffer q_loads % NQ
    const float& sl2;     // e4m3: the tile's softmax factor, sl2 times its q and k descales (descales.cuh)
#if FA_TRACE
    trace::Tracer<Cfg>& tr;
    const int& j_lo;  // the tile's first K/V block
#endif
  };

  const FwdParams& p;
  const Smem& sm;
  const ConsumerThread& th;
  // Descriptors as in the sm90 kernel: Q and K K-major, V MN-major, 64-column panels of 128-byte rows (e4m3:
  // V^T K-major; Q and K at head_dim 64 one 64-byte panel of the 64-byte swizzle, qk_desc).
  // From head_dim 128 Q's is made from warpgroup_index() (fa/wgmma.cuh), so it lives in uniform registers:
  // made from threadIdx.x, ptxas kept it in ordinary ones and moved both words over (R2UR) and added each
  // k-step's offset with a carried IADD3 / IMAD.X before every S product. Measured in one process on an
  // H200 (kernel log 170): 1-1.6% faster at d128 4k and 16k causal, level at 16k non-causal; at d64 (the
  // 192-row builds) 0.7-1.4% slower, as backward step 124 found there, so d64 keeps threadIdx.x's form, as
  // do the dropout builds (at their register limit: the uniform form spilled 4-80 bytes at d128 and d192).
  const u64 q_desc;
  const u64 k_desc;
  const u64 v_desc;
  const float sl2;
  // No swizzle (layout 0), both strides 0: every core matrix of B is the ones tile (ones_tile, below).
  const u64 ones_desc;
  const bool bounded;
  const float bounded_max;  // the origin in row_max's (unscaled) units
  const float cap_log2;

  // A warpgroup's 64 x D output accumulator and the running max and sum of its rows, for the tile in hand;
  // with kTileOverlap held past the tile's end until its epilogue has run (consumer.cuh, the tile loop).
  // Arrays of the consumer's (locals of fwd_ws_consumer, one each: consumer.cuh says why), which the
  // mainloop refers to.
  float (&o)[NO * 4];
  float (&row_max)[2];
  float (&row_sum)[2];
  // The bounded softmax's L_r (kSumPackedP builds; dead code elsewhere): the m64n8 accumulator of P times
  // the ones tile, whose every column is a row's sum; this thread holds rows g (0, 1) and g + 8 (2, 3)
  // (add_p_row_sums, the CUDA cores' form, keeps its partial sums in 0 and 2).
  float (&row_sum_p)[4];

  // The bounded softmax's L_r on the tensor cores (kSumPackedPOnes builds): P V's P fragments against a 16 x
  // 8 tile of bf16 ones (0x3F80). With both of its descriptor's strides 0 every core matrix of the B operand
  // is these 128 bytes, so the tile needs no more room than one core matrix. The kernel writes it with the
  // barriers' initialisation (fwd_kernel.cuh); a static of this function, so that both see the variable
  // itself rather than a pointer to it.
  __device__ __forceinline__ static unsigned* ones_tile() {
    __shared__ __align__(128) unsigned s_ones[kSumPackedPOnes ? 32 : 1];
    return s_ones;
  }

  __device__ __forceinline__ FwdWsMainloop(const FwdParams& p, const Smem& sm, const ConsumerThread& th,
                                           float (&o)[NO * 4], float (&row_max)[2], float (&row_sum)[2],
                                           float (&row_sum_p)[4])
      : p(p),
        sm(sm),
        th(th),
        q_desc(qk_desc(sm.sQ + (D >= 128 && !kDropout ? warpgroup_index() - 1 : th.cwg) * 64 * PB)),
#if FA_TRACE
        // (The planted fault kWrongSwizzle starts K's descriptor one row late: fa/trace.cuh.)
        k_desc(qk_desc(sm.sK + trace::wrong_swizzle_bytes(p.trace_fault))),
#else
        k_desc(qk_desc(sm.sK)),
#endif
        // (e4m3: V^T's tile, K-major as Q's and K's)
        v_desc(kE4M3 ? vt_desc(sm.sV) : smem_desc_sw128(sm.sV, BC * 128, 1024)),
        sl2(p.scale_log2),
        ones_desc((u64)((smem_addr(ones_tile()) & 0x3FFFFu) >> 4)),
        bounded(kBoundable && score_bound<ScoreMod>(p) <= kFixedMaxCap),
        bounded_max(0.5f * score_bound<ScoreMod>(p) / p.scale),
        cap_log2(score_bound<ScoreMod>(p) * 1.4426950408889634f),
        o(o),
        row_max(row_max),
        row_sum(row_sum),
        row_sum_p(row_sum_p) {
  }

  __device__ __forceinline__ void take_turn() const {
    if constexpr (Cfg::kPingpong) named_barrier_sync(kTurn + th.cwg, 256);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (Cfg::kPingpong) named_barrier_arrive(kTurn + (1 - th.cwg), 256);
  }
  // This warp's matrix products have read the slot's K (or V): one arrival per warp frees it once all
  // 4 NC consumer warps are past this point.
  __device__ __forceinline__ void release(u32 bar) const {
    __syncwarp();
    if (th.lane == 0) mbar_arrive(bar);
  }

  // A tile's start: O zero, the row statistics at their origin (tile_overlap: after the previous tile's
  // epilogue has read them).
  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int i = 0; i < NO * 4; ++i) o[i] = 0.f;
    row_max[0] = row_max[1] = bounded ? bounded_max : neg_inf();
    row_sum[0] = row_sum[1] = 0.f;
    row_sum_p[0] = row_sum_p[1] = row_sum_p[2] = row_sum_p[3] = 0.f;
  }

  // The pieces of one K/V block, shared by both schedules (consumer.cuh).
  __device__ __forceinline__ static int slot(const Tile& x, int it) { return (x.ring + it) % NST; }
  __device__ __forceinline__ static u32 phase(const Tile& x, int it) {  // the slot's use, mod 2
    return (u32)(((x.ring + it) / NST) & 1);
  }
  // S = Q K^T of block it.
  __device__ __forceinline__ void issue_s_at(float (&sacc)[NS * 4], const Tile& x, int it) const {
    wgmma_fence();
    const u64 q_buffer = q_desc + ((x.q_loads % NQ * kQBytes) >> 4);
    if constexpr (kE4M3)
      issue_qk_e4m3<BR, BC, D, PB>(sacc, q_buffer, k_desc + ((slot(x, it) * kKTile) >> 4));
    else
      issue_qk<BR, BC, D, BF>(sacc, q_buffer, k_desc + ((slot(x, it) * kKTile) >> 4));
    wgmma_commit();
  }
  // O += P V of block it.
  __device__ __forceinline__ void issue_pv_at(const u32 (&pf)[KS][4], const Tile& x, int it) {
    wgmma_fence();
    if constexpr (kE4M3) {
      issue_pv_e4m3<BC, DV, Smem::kVtPanelBytes>(o, pf, v_desc + ((slot(x, it) * kVTile) >> 4));
    } else {
      issue_pv<BC, DV, BF>(o, pf, v_desc + ((slot(x, it) * kVTile) >> 4));
      // L_r += P 1, in the same group (fa/softmax.cuh). At head_dim 128 issued whatever `bounded` is (a cap
      // past kFixedMaxCap then pays an unused product): behind the run-time condition ptxas injected a
      // warpgroup.arrive (C7519) eight times per build, on which the causal build's warps stalled three times
      // as often as main's (22% of stall samples; that build 7% slower than main, kernel log 119).
      // Unconditional, the head_dim-128 builds have none (the persistent one keeps the two injected
      // warpgroup.waits, C7517, that main's has too), but the head_dim-64 build spilled, so the condition
      // stays there.
      constexpr bool kOnesAlways = DV == 128 || (DV == 64 && Cfg::kHeadDim == 128);
      if constexpr (kSumPackedPOnes) {
        if (kOnesAlways || bounded) {
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) Wgmma<8, true>::rs_bt(row_sum_p, pf[ks], ones_desc, 1);
        }
      }
    }
    wgmma_commit();
  }
  // The variant's score function and mask (fa/variant.cuh), the online softmax step and dropout of S in
  // place (fa/softmax.cuh, fa/dropout.cuh); alpha gets the factors O's two rows must be rescaled by.
  __device__ __forceinline__ void softmax_step(float (&sacc)[NS * 4], const Tile& x, int it,
                                               float (&alpha)[2]) {
    const int kv_start = x.kv_first + it * BC;
    static_assert(kFold, "the wgmma kernels' softmax is the folded one");
    constexpr bool kOffsets = ScoreModRowOffsets<ScoreMod>::value;
    float offset[1][2];
    if constexpr (kBoundable) {
      if (bounded) {
        // tanh(s scale / cap) in place (cap log2 e goes into the exponent's FFMA), the mask, then P.
#pragma unroll
        for (int i = 0; i < NS * 4; ++i) sacc[i] = x.score_mod.unit(sacc[i]);
        x.mask.mask_query_rows(acc_tile(sacc), x.q_start + th.warp_row0, kv_start, th.g, th.t);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          row_sum[r] += bounded_softmax_row<!kSumPackedP>(acc_tile(sacc), 0, r, cap_log2, row_sum_p[2 * r]);
          alpha[r] = 1.f;
        }
        if constexpr (kDropout)
          dropout_query_rows<kDropoutKeyPairs<V>>(acc_tile(sacc), 0, p, x.batch, x.head,
                                                  x.q_start + th.warp_row0, kv_start, th.g, th.t);
        return;
      }
    }
    score_mod_query_rows_wgmma(acc_tile(sacc), x.score_mod, x.q_start + th.warp_row0, kv_start, th.g, th.t,
                               offset);
    x.mask.mask_query_rows(acc_tile(sacc), x.q_start + th.warp_row0, kv_start, th.g, th.t);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      alpha[r] = online_softmax_row<kFold, kOffsets, kLazyMax, kFold ? Cfg::kExpPoly : 0, BF>(
          acc_tile(sacc), 0, r, row_max[r], row_sum[r], kE4M3 ? x.sl2 : sl2, offset[0][r]);
    if constexpr (kDropout)
      dropout_query_rows<kDropoutKeyPairs<V>>(acc_tile(sacc), 0, p, x.batch, x.head, x.q_start + th.warp_row0,
                                              kv_start, th.g, th.t);
  }
  // S's accumulator, after the softmax step, as P V's A fragments (P rounded to the input type).
  __device__ __forceinline__ static void to_p(u32 (&pf)[KS][4], float (&sacc)[NS * 4]) {
    if constexpr (kE4M3)
      s_to_p_e4m3<BC>(pf, sacc);
    else
      s_to_p<BC, BF>(pf, sacc);
  }
  __device__ __forceinline__ void rescale_o(const float (&alpha)[2]) {
    if (bounded) return;  // (alpha is 1)
    // A warp whose rows all kept their reference (kLazyMax) skips the D / 2 multiplies (a vote, and
    // a uniform branch).
    if (kLazyMax && __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) rescale_row(acc_tile(o), 0, r, alpha[r]);
  }

  // S_j = Q K_j^T has completed in this warp: K_j's slot may be refilled, and after the tile's last one
  // (persistent) the Q buffer too, so the next tile's Q lands under this tile's last P V and epilogue.
  // Every consumer thread arrives on q_empty itself (NCT arrivals), not one lane per warp: each thread
  // read s_tile, and a per-thread release orders that read before the producer's next write without
  // relying on __syncwarp (compute-sanitizer's racecheck does not follow that chain and reported it).
  __device__ __forceinline__ void s_done(const Tile& x, int it) const {
    release(sm.k_empty(slot(x, it)));
    if constexpr (Cfg::kPersistent)
      if (it == x.n_iter - 1) mbar_arrive(sm.q_empty(x.q_loads % NQ));
  }

#if FA_TRACE
  // Tiles are read back through generic pointers, element (row, col) where the TMA unit wrote it: 64-column
  // panels of 128-byte rows, 128-byte swizzle.
  using TL = trace::Layout<Cfg>;
  __device__ __forceinline__ static const u16* trace_tile(u32 tile) {
    extern __shared__ __align__(16) unsigned char smem[];  // (the kernel's dynamic window)
    return reinterpret_cast<const u16*>(smem + (tile - smem_addr(smem)));
  }
  __device__ __forceinline__ static int trace_q_elem(int row, int chunk) {
    return (int)(PanelTile<BR>::bytes(row, chunk) / 2);
  }
  __device__ __forceinline__ static int trace_kv_elem(int row, int chunk) {
    return (int)(PanelTile<BC>::bytes(row, chunk) / 2);
  }
  // S_j has landed and neither K_j's slot nor Q has been released (trace before s_done).
  __device__ __forceinline__ void trace_s(float (&sacc)[NS * 4], const Tile& x, int it) const {
    x.tr.begin_step(it, x.j_lo + it);
    x.tr.smem_tile(TL::kQ, trace_tile(sm.sQ + x.q_loads % NQ * kQBytes), th.warp_row0, 16, trace_q_elem);
    x.tr.smem_tile(TL::kK, trace_tile(sm.sK + slot(x, it) * kKTile), 0, BC, trace_kv_elem);
    x.tr.acc_view(TL::kS, acc_tile(sacc));
  }
  // After the softmax step, before s_to_p rounds P; then the planted fault that leaves O unrescaled (for
  // every block, as a real bug would be).
  __device__ __forceinline__ void trace_softmax(float (&sacc)[NS * 4], const Tile& x,
                                                float (&alpha)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      x.tr.row_value(TL::kM, 0, r, row_max[r]);
      x.tr.row_value(TL::kAlpha, 0, r, alpha[r]);
      x.tr.row_sum(TL::kL, 0, r, row_sum[r]);
    }
    x.tr.acc_view(TL::kP, acc_tile(sacc));
    if (x.tr.skip_rescale()) alpha[0] = alpha[1] = 1.f;
  }
  // P_j V_j has completed, and neither has V_j's slot been released nor O rescaled for step j + 1.
  __device__ __forceinline__ void trace_pv(const Tile& x, int it) {
    x.tr.resume_step(it);
    x.tr.smem_tile(TL::kV, trace_tile(sm.sV + slot(x, it) * kVTile), 0, BC, trace_kv_elem);
    x.tr.acc_view(TL::kO, acc_tile(o));
  }
#endif
};

}  // namespace sm90
}  // namespace fa
