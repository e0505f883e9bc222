// FlashAttention-2 backward's dK/dV kernel (dQ added into an fp32 workspace) for Hopper (sm_90a) at head_dim
// 256 (and 192, below), warp-specialized, with the products oriented so that neither computing warpgroup
// waits for the other inside a step's chain.
//
// Why not the wide kernel (csrc/kernels/sm90/bwd_wide): there the two warpgroups split the work by product
// on one 64-key block (warpgroup 0 S^T, P^T and dV; warpgroup 1 dP^T, dS^T and dK), so warpgroup 1 waits
// for warpgroup 0's P^T in every step, all 256 threads copy the next Q and dO and meet at a __syncthreads,
// and each step ends with both waiting for dQ's staging: ncu put 39% of its stall samples on barriers with
// the tensor pipe 26% busy (kernel log 118/124). Here, per query step of 64 rows:
//   S = Q K_c^T and dP = dO V_c^T with queries as rows: warpgroup c takes keys [32 c, 32 c + 32) of the
//     block's 64 (m64n32k16, K = head_dim), so each warpgroup has P and dS of its own keys without an
//     exchange, computed as soon as its own products land;
//   P and dS go to shared memory (bf16, 64 x 64 each, one 128-byte-swizzled panel; 64 x 96 in two panels
//     with 96-key blocks), and one named barrier makes both halves visible;
//   dV^T += dO^T P and dK^T += Q^T dS with head_dim as rows: at 256, warpgroup c keeps head_dim rows
//     [128 c, 128 c + 128) of both, for all 64 keys (two m64n64k16 row blocks each, K = the 64 queries):
//     2 x 2 x 32 = 128 accumulator registers, where keys as rows would need 2 x 256 per warpgroup of 64 keys;
//   dQ = dS K for head_dim columns [128 c, 128 c + 128) at 256 (m64n128k16, K = 64 keys), staged and added
//     with bulk reduce-adds as in the other Hopper backwards.
// A producer warpgroup copies K and V once and each step's Q, dO and statistics into a ring of two slots,
// as the warp-specialized kernel does (csrc/kernels/sm90/bwd_ws, whose comments on the copies, PDL and the
// full/empty barriers apply here).
//
// dQ's staging: a dedicated 64 KB tile does not fit beside K, V and two slots (213 KB), so warpgroup 0
// stages its two 64 x 64 fp32 tiles where the step's Q was and warpgroup 1 where its dO was, once both
// warpgroups' products of the step have completed (barrier 2). The slot is released to the producer once the
// copy engine has read the staged tiles: the issuing thread waits for that read in the next step, once that
// step's products after barrier 1 are on the tensor cores (release_previous_slot; kernel log 143), and
// arrives on the slot's empty barrier. (Writer warps in the producer warpgroup, which take the wait off the
// computing warpgroups altogether as bwd_ws's dq_writer does, spilled 44-72 bytes in the producer's 24
// registers in every arrangement tried, and 580 in the computing warpgroups at bwd_ws's 40 / 232 split.)
//
// Barriers, each for one hazard:
//   full[s]   (mbarrier, 128 producer arrivals): slot s holds this use's Q, dO and statistics (and, with the
//             first step, K and V).
//   empty[s]  (mbarrier, 256 computing-thread arrivals): the copy engine has read the dQ tiles staged in
//             slot s (after every product and statistics read of the slot, barrier 2). Each thread arrives
//             once its own staging stores are done, the two issuing threads once the copy engine has read
//             the tiles (in the next step). One arrival per warpgroup from the issuing thread alone would do
//             (its barrier 3 + c orders the others' stores before it), but compute-sanitizer's racecheck
//             does not follow that chain and reported the producer's next copies into the slot as racing
//             the staging stores.
//   named 1   (256 computing threads): both warpgroups' halves of P and dS are written and fenced.
//   named 2   (256): both warpgroups' products of the step have completed, so the slot may take dQ's staging
//             and the next step may rewrite P and dS (single-buffered: their last readers are these).
//   named 3 + c (128, warpgroup c): its dQ tiles are staged and fenced; one thread then issues them.
//
// Shared memory (bytes from a 1024-aligned base, BwdWideWsSmem): K and V (64 x 256 each), two slots of Q
// and dO (64 x 256 each), P and dS (64 x 64 each), two slots of statistics, the barriers: 210 KB (202 KB at
// head_dim 192 with 96-key blocks, 162 KB with 64).
//
// Head_dim 192 (the default there too since kernel log 136): three 64-row blocks of head_dim do not halve,
// so warpgroup 0 keeps dV^T and warpgroup 1 dK^T (96 registers each), dQ's columns split 128 / 64 by K's
// panels, and dQ is staged in 8 KB halves of 64 x 64 tiles where the slot's Q (24 KB) and dO were.
// With 96-key blocks (BwdConfig block_kv 96, head_dim 192 only; kernel log 140), as FlashAttention-4's
// Hopper backward tiles 192: S and dP are m64n48 per warpgroup, whose shared-memory operands (2 KB of Q or
// dO and 1.5 KB of K or V per k-step of 24 tensor cycles: about 149 bytes a clock) ask less of shared
// memory's 128 bytes a clock than m64n32's (3 KB per 16 cycles, 192), so the tensor pipe waits less; a
// query step's Q, dO, statistics and dQ reduction serve 1.5x the keys; dV^T's or dK^T's accumulators take
// 144 of the computing warpgroups' 240 registers (nothing spills); shared memory is 202 KB (K and V 72 KB,
// P and dS 32 KB).
//
// What it does not have (configs/families.py routes those calls to the wide kernel): dropout, the
// deterministic mode.
#pragma once

#include "fa/block_range.cuh"
#include "fa/bwd_params.h"
#include "fa/bwd_preprocess.cuh"
#include "fa/bwd_wgmma.cuh"
#include "fa/copy.cuh"
#include "fa/dq_accum.cuh"
#include "fa/frag.cuh"
#include "fa/grid_dependency.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/smem_layout.cuh"
#include "fa/tile_ptrs.cuh"
#include "fa/tma.cuh"
#include "fa/variant.cuh"
#include "fa/wgmma.cuh"

namespace fa {
namespace sm90 {

// Shared memory of the warp-specialized wide backward, in bytes (mirrored by
// configs.backward.BwdConfig.smem_bytes).
template <int BR, int BC, int D, int NST, int DV = D>
struct BwdWideWsSmem {
  static constexpr int kKV = BC * D * 2;    // K (and V where v has q's head_dim)
  static constexpr int kV = BC * DV * 2;    // V at v's head_dim
  static constexpr int kQ = BR * D * 2;     // one Q or dO slot
  static constexpr int kPS = BR * 64 * ((BC + 63) / 64) * 2;  // P, and dS: whole 64-key panels
  static constexpr int kStats = 2 * BR * 4; // one slot: LSE2, delta
  static constexpr int kBars = 8 * 2 * NST; // full and empty per slot
  // (the dO slots keep q's head_dim where v's is narrower: dQ's staging takes the step's Q and dO slots)
  static constexpr int kBytes = 1024 + kKV + kV + 2 * NST * kQ + 2 * kPS + NST * kStats + kBars;
};

// acc (64 queries x NK keys) = A B^T over head_dim D: A this step's Q or dO (K-major, a_desc plus the slot's
// a_off), B NK rows of K or V (K-major, b_desc at the warpgroup's first key). D / 16 k-steps of 16 columns,
// 32 bytes along a row, every fourth starting the next 64-column panel (BR * 128 bytes on in Q's and dO's
// tiles, BC * 128 in K's and V's).
template <int BR, int BC, int NK, int D, bool BF>
__device__ __forceinline__ void issue_query_rows_product(float (&acc)[NK / 2], u64 a_desc, u32 a_off,
                                                         u64 b_desc) {
  const u64 a_step = desc_advance(a_desc, a_off);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    Wgmma<NK, BF>::ss(acc, desc_advance(a_step, (kk / 4) * BR * 128 + (kk % 4) * 32),
                      desc_advance(b_desc, (kk / 4) * BC * 128 + (kk % 4) * 32), kk > 0);
}

// acc (64 head_dim rows x BC keys) += A^T B over the step's BR queries: A one 64-column panel of Q or dO read
// MN-major (at_desc plus a_off: the slot and the panel), B = dS or P (BR x BC, 64-key panels BR * 128 bytes
// apart, the descriptor's leading byte offset) read MN-major. 16 queries per k-step, 16 rows of 128 bytes.
// (At 96 keys B spans one swizzle atom of 64 keys and half of the next, a width the PTX ISA's canonical
// layouts do not spell out: kernel log 140's GPU tests check it; the fallback is a 64-byte swizzle.)
template <int BR, int BC, bool BF>
__device__ __forceinline__ void issue_head_rows_acc(float (&acc)[BC / 2], u64 at_desc, u32 a_off, u64 bt_desc) {
  const u64 a_step = desc_advance(at_desc, a_off);
#pragma unroll
  for (int ks = 0; ks < BR / 16; ++ks)
    Wgmma<BC, BF>::ss_tt(acc, desc_advance(a_step, ks * 16 * 128), desc_advance(bt_desc, ks * 16 * 128), 1);
}

// dq (64 queries x N head_dim columns) = dS K over the block's BC keys: A = dS (K-major: 64-key panels BR *
// 128 bytes apart, 32 bytes per k-step, every fourth starting the next panel), B = K's N columns read
// MN-major (kt_desc), 16 key rows per k-step.
template <int BR, int BC, int N, bool BF>
__device__ __forceinline__ void issue_dq_from_ds(float (&dq)[N / 2], u64 ds_desc, u64 kt_desc) {
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk)
    Wgmma<N, BF>::ss_bt(dq, desc_advance(ds_desc, (kk / 4) * BR * 128 + (kk % 4) * 32),
                        desc_advance(kt_desc, kk * 16 * 128), kk > 0);
}

// One warpgroup's dK^T or dV^T rows (64 head_dim rows of row block `hb`, all BC keys; register 4 n + e is
// head_dim row 64 hb + 16 w + g + 8 (e / 2) of the warpgroup's part, key 8 n + 2 t + e % 2) into a keys x D
// bf16 tile at s_out, transposed by stmatrix: rows of 2 D bytes, 16-byte chunk c of key row k at c ^ (k % 8)
// (the eight key rows one matrix writes then fall in eight bank groups). Lane 8 i + j addresses key row
// 8 (n + i / 2) + j, chunk (d0 + 8 (i % 2)) / 8 of matrix i.
template <int BC, int D, bool BF>
__device__ __forceinline__ void store_head_rows_transposed(u32 s_out, const float (&acc)[BC / 2], int d0,
                                                           int lane) {
  static_assert(BC % 16 == 0, "pairs of 8-key n-tiles");
  const int i = lane / 8, j = lane % 8;
  const int chunk = (d0 + 8 * (i % 2)) / 8;
#pragma unroll
  for (int n = 0; n < BC / 8; n += 2) {
    const int key = 8 * (n + i / 2) + j;
    const u32 r[4] = {pack2<BF>(acc[4 * n], acc[4 * n + 1]), pack2<BF>(acc[4 * n + 2], acc[4 * n + 3]),
                      pack2<BF>(acc[4 * n + 4], acc[4 * n + 5]), pack2<BF>(acc[4 * n + 6], acc[4 * n + 7])};
    stmatrix_x4_trans(s_out + (u32)key * (2 * D) + ((chunk ^ j) << 4), r);
  }
}

// The previous step's slot back to the producer (`prev_empty`, 0 at the first step): the issuing thread waits
// for the copy engine to have read the dQ it staged there, then arrives (the others arrived after staging).
// Called once this step's products after barrier 1 are on the tensor cores: by then that read has long
// completed. (Before kernel log 143 it came right after S and dP were issued, when the reduce-adds issued a
// moment earlier were still being read: ncu put 11k stall samples on that wait, all on warp 0 of each
// warpgroup, and the 38k on barrier 1 were mostly the other warps waiting for it.)
__device__ __forceinline__ void release_previous_slot(u32 prev_empty, int ctid) {
  if (prev_empty != 0 && ctid % 128 == 0) {
    bulk_wait_read<0>();
    mbar_arrive(prev_empty);
  }
}

// Head_dim 192's step after barrier 1, for one computing warpgroup (warpgroup 0: dV^T += dO^T P and dQ's
// columns [0, 128), N = 128; warpgroup 1: dK^T += Q^T dS and columns [128, 192), N = 64): the head-row
// product into `hacc` (A: the 64-column panels of dO or Q at at_off, B: P or dS), dQ = dS K over its N
// columns, every product retired; barrier 2 (both warpgroups' products of the step done: the slot may take
// dQ); dQ staged in 8 KB halves where the slot's Q and dO were (their 24 KB each hold warpgroup 0's two tiles
// in their first 16 KB and warpgroup 1's tile split over their last 8 KB), barrier 3 + wg, then one bulk
// reduce-add per half by the warpgroup's first thread, the others releasing the slot (`empty`) as at 256.
// HB: the head-row product's 64-row blocks (3; warpgroup 0's dV^T DV / 64 where v has its own head_dim).
template <int N, int BR, int BC, int D, bool BF, int HB = 3>
__device__ __forceinline__ void wide192_products_and_dq(float (&hacc)[3][BC / 2], u64 qt_desc, u32 at_off,
                                                        u64 b_desc, u64 ds_desc, u64 kt_desc, u32 slot_q,
                                                        u32 slot_do, float* dq_accum, i64 ws_row, u32 empty,
                                                        u32 prev_empty, int ctid) {
  static_assert(D == 192 && (N == 128 || N == 64) && HB >= 1 && HB <= 3, "head_dim 192's two warpgroups");
  float dq[N / 2];
  wgmma_fence();
#pragma unroll
  for (int hb = 0; hb < HB; ++hb)
    issue_head_rows_acc<BR, BC, BF>(hacc[hb], qt_desc, at_off + hb * BR * 128, b_desc);
  issue_dq_from_ds<BR, BC, N, BF>(dq, ds_desc, kt_desc);  // (kt_desc: K's panel 2 wg, as at 256)
  wgmma_commit();
  release_previous_slot(prev_empty, ctid);
  wgmma_wait<0>();
  wgmma_hold(dq);
#pragma unroll
  for (int hb = 0; hb < HB; ++hb) wgmma_hold(hacc[hb]);
  // (the other warpgroup meets barrier 2 in its own instantiation of this function: the non-aligned form)
  named_barrier_sync_unaligned(2, 256);
  u32 stage[N / 32];
  if constexpr (N == 128) {
    stage[0] = slot_q;
    stage[1] = slot_q + 8192;
    stage[2] = slot_do;
    stage[3] = slot_do + 8192;
  } else {
    stage[0] = slot_q + 16384;
    stage[1] = slot_do + 16384;
  }
  stage_dq_halves<N>(stage, dq, ctid % 128);
  fence_proxy_async();
  // (barrier ids fixed at compile time: a run-time id makes ptxas reserve all sixteen)
  if constexpr (N == 128) {
    named_barrier_sync(3, 128);
  } else {
    named_barrier_sync(4, 128);
  }
  if (ctid % 128 != 0) {
    mbar_arrive(empty);
  } else {
    constexpr int kCol0 = N == 128 ? 0 : 128;
#pragma unroll
    for (int h = 0; h < N / 32; ++h)
      bulk_reduce_add_f32(dq_accum + dq_accum_offset<D, true>(ws_row, kCol0 + 32 * h), stage[h], 64 * 32 * 4);
    bulk_commit();
  }
}

// kTma (BwdConfig.tma_loads): Q and dO by TMA from q_map and do_map, as in csrc/kernels/sm90/bwd_ws.
template <class Cfg, class V, bool kDropout = false, bool kDeterministic = false, bool kTma = false>
__device__ __forceinline__ void bwd_wide_ws_dkdv_body(const BwdParams& p, const TensorMap* q_map = nullptr,
                                                      const TensorMap* do_map = nullptr) {
  using Mask = typename V::Mask;  // the variant (fa/variant.cuh)
  static_assert(ScoreModHasGradient<typename V::ScoreMod>::value,
                "the backward does not differentiate a score function without its derivative "
                "(kUnitGradient, gradient)");
  static_assert(!kDropout && !kDeterministic,
                "the warp-specialized wide backward has no dropout or deterministic build (the wide one does)");
  constexpr bool BF = Cfg::kIsBF16;
  constexpr int D = Cfg::kHeadDim;
  constexpr int BR = Cfg::kBlockQ;   // query rows per step
  constexpr int BC = Cfg::kBlockKV;  // key rows of the block
  constexpr int NK = BC / 2;         // keys of S and dP per computing warpgroup
  constexpr int NST = Cfg::kStages;
  static_assert(Cfg::kNumWarps == 12 && BR == 64 && (D == 256 || D == 192),
                "a producer and two computing warpgroups, 64 queries per step, head_dim 256 or 192");
  // 64 keys per block, or 96 at head_dim 192 (BwdConfig block_kv; kernel log 140): dV^T's or dK^T's three
  // 64-row blocks of head_dim then take 3 x 48 accumulator registers, S and dP are m64n48 per warpgroup, and
  // P and dS span one and a half 64-key panels.
  static_assert(BC == 64 || (BC == 96 && D == 192), "64 keys per block, or 96 at head_dim 192");
  // v's own head_dim (BwdConfig head_dim_v; docs/value-head-dim-study.md section 7): V, dO and dV at DV
  // columns, dP = dO V^T over DV, warpgroup 0's dV^T in DV / 64 row blocks. Head_dim 192 only.
  constexpr int DV = ValueDimOf<Cfg>::value;
  static_assert(DV == D || (D == 192 && (DV == 64 || DV == 128)), "v's own head_dim: 64 or 128 at 192");
  using Smem = BwdWideWsSmem<BR, BC, D, NST, DV>;
  static_assert(Smem::kBytes <= Cfg::kSmemBytes, "the shared-memory layout exceeds the config's smem_bytes");
  static_assert(128 * Cfg::kProducerRegs + 256 * Cfg::kConsumerRegs <= 384 * 168,
                "the register split exceeds the block's allocation");

  extern __shared__ __align__(16) unsigned char smem[];
  const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
  const u32 sK = base;
  const u32 sV = sK + Smem::kKV;
  const u32 sQ = sV + Smem::kV;           // NST slots
  const u32 sdO = sQ + NST * Smem::kQ;    // NST slots
  const u32 sP = sdO + NST * Smem::kQ;    // BR query rows of BC keys: one 64-key panel, or two at 96 keys
  const u32 sdS = sP + Smem::kPS;
  const u32 sStats = sdS + Smem::kPS;     // [slot][LSE2 (BR floats), delta (BR floats)]
  const u32 bars = sStats + NST * Smem::kStats;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (NST + s); };
  const float* const stats = reinterpret_cast<const float*>(smem + (sStats - smem_addr(smem)));
  constexpr int kLoaders = 128;

  const int tid = threadIdx.x;
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_start = n_block * BC;

  // The query blocks [m_begin, m_begin + m_count) that see some key of this block (the variant's mask),
  // walked for every query head of the GQA group (dK and dV summed over it), head by head.
  const Mask mask(p, batch, kv_head);
  const auto blocks = mask.template q_blocks<BR, BC>(p, kv_start);
  const int m_begin = blocks.begin;
  const int m_count = blocks.count;
  const int n_iter = p.group * m_count;
  auto head_of = [&](int it) { return kv_head * p.group + it / m_count; };
  auto q_start_of = [&](int it) { return (m_begin + it % m_count) * BR; };

  if (tid == 0) {
    for (int s = 0; s < NST; ++s) {
      mbar_init(full(s), kLoaders);
      mbar_init(empty(s), 256);
    }
    mbar_init_fence();
  }
  // The only block-wide barrier: the mbarriers are initialised before anyone waits on or arrives at them.
  __syncthreads();

  // v's head_dim as the call has it (p.head_dim where the config compiles q's: the same code as before)
  const int hdv = DV == D ? p.head_dim : p.head_dim_v;

  if (tid < 128) {
    // ---- producer (as csrc/kernels/sm90/bwd_ws's) ------------------------------------------------------
    setmaxnreg_dec<Cfg::kProducerRegs>();
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % NST;
      // The slot's previous use (step it - NST): its staged dQ has been read by the copy engine.
      if (it >= NST) mbar_wait(empty(s), (u32)((it / NST - 1) & 1));
      if (it == 0) {
        const u16* gK = static_cast<const u16*>(p.k) + k_offset(p, batch, kv_head, kv_start);
        const u16* gV = static_cast<const u16*>(p.v) + v_offset(p, batch, kv_head, kv_start);
        // (at head_dim 192, rows of 24 chunks, panel by panel: fa/copy.cuh)
        load_panel_tile_rolled<BC, D, kLoaders>(sK, gK, p.k_row_stride, p.seqlen_k - kv_start, p.head_dim,
                                                tid);
        load_panel_tile_rolled<BC, DV, kLoaders>(sV, gV, p.v_row_stride, p.seqlen_k - kv_start, hdv, tid);
      }
      const int head = head_of(it);
      const int q_start = q_start_of(it);
      if constexpr (kTma) {
        // (as the bwd_ws kernel's: the slot's bytes expected before its first thread's own arrival below; a
        // box per 64-column panel, four each at head_dim 256. The slot was released after the copy engine
        // had read the dQ tiles staged in it, so these writes follow that read.)
        if (tid == 0) {
          mbar_expect_tx(full(s), Smem::kQ + BR * DV * 2);
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            tma_load_4d(sQ + s * Smem::kQ + c * BR * 128, q_map, full(s), 64 * c, q_start, head, batch);
            if (c < DV / 64)  // (dO's rows may be narrower: fewer boxes)
              tma_load_4d(sdO + s * Smem::kQ + c * BR * 128, do_map, full(s), 64 * c, q_start, head, batch);
          }
        }
      } else {
        const u16* gQ = static_cast<const u16*>(p.q) + q_offset(p, batch, head, q_start);
        const u16* gdO = static_cast<const u16*>(p.dout) + do_offset(p, batch, head, q_start);
        load_panel_tile_rolled<BR, D, kLoaders>(sQ + s * Smem::kQ, gQ, p.q_row_stride, p.seqlen_q - q_start,
                                                p.head_dim, tid);
        load_panel_tile_rolled<BR, DV, kLoaders>(sdO + s * Smem::kQ, gdO, p.do_row_stride,
                                                 p.seqlen_q - q_start, hdv, tid);
      }
      // The statistics are the preprocessing kernel's output (programmatic launch: fa/grid_dependency.cuh).
      if (it == 0) grid_dependency_wait();
      // The workspaces are padded to whole 128-row blocks: no bounds check.
      const i64 r0 = workspace_row(p, batch, head, q_start);
      if (tid < BR / 4) {
        cp_async_16(sStats + s * Smem::kStats + 16 * tid, p.lse_log2 + r0 + 4 * tid, 16);
      } else if (tid < BR / 2) {
        const int c = tid - BR / 4;
        cp_async_16(sStats + s * Smem::kStats + 4 * BR + 16 * c, p.delta + r0 + 4 * c, 16);
      }
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(full(s));
    }
    return;
  }

  // ---- the computing warpgroups ---------------------------------------------------------------------------
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  grid_dependency_wait();  // (the statistics and the dQ workspace: the preprocessing kernel's output)
  const int ctid = tid - 128;
  // keys [NK wg, NK wg + NK) of S and dP; at 256 head_dim rows [128 wg, +128), at 192 dV^T's (0) or
  // dK^T's (1)
  const int wg = warpgroup_index() - 1;
  const int wq = (ctid / 32) % 4;        // the warp's 16 rows of a 64-row product
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  // Head_dim 256: dV^T and dK^T, head_dim rows [128 wg + 64 hb, +64) for hb = 0, 1, all BC keys.
  float dvt[D == 256 ? 2 : 1][BC / 2], dkt[D == 256 ? 2 : 1][BC / 2];
#pragma unroll
  for (int hb = 0; hb < (D == 256 ? 2 : 1); ++hb)
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) dvt[hb][i] = dkt[hb][i] = 0.f;
  // Head_dim 192, whose three 64-row blocks do not halve: warpgroup 0 keeps all of dV^T, warpgroup 1 all of
  // dK^T (96 registers each, the wide kernel's split by product), and dQ's columns split 128 / 64 (whole
  // 64-column panels of K): of a step's nine units of 64 x 64 outputs over its 64 queries after S and dP
  // (which split evenly) warpgroup 0 does five and warpgroup 1 four; the tensor cores are shared, so the
  // imbalance costs only warpgroup 1's wait at barrier 2.
  float hacc[D == 192 ? 3 : 1][BC / 2];
#pragma unroll
  for (int hb = 0; hb < (D == 192 ? 3 : 1); ++hb)
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) hacc[hb][i] = 0.f;

  // Descriptors (fa/wgmma.cuh). K-major tiles: 8-row groups 1024 bytes apart. MN-major tiles: 64-column
  // panels R * 128 bytes apart (the leading byte offset).
  const u64 q_desc = smem_desc_sw128(sQ, 16, 1024);                  // A of S and dP
  const u64 k_desc = smem_desc_sw128(sK + wg * NK * 128, 16, 1024);  // B of S: this warpgroup's keys
  const u64 v_desc = smem_desc_sw128(sV + wg * NK * 128, 16, 1024);  // B of dP
  const u64 qt_desc = smem_desc_sw128(sQ, BR * 128, 1024);           // A of dV^T and dK^T (dO, Q)
  const u64 pt_desc = smem_desc_sw128(sP, BR * 128, 1024);           // B of dV^T
  const u64 dst_desc = smem_desc_sw128(sdS, BR * 128, 1024);         // B of dK^T
  const u64 ds_desc = smem_desc_sw128(sdS, 16, 1024);                // A of dQ
  const u64 kt_desc = smem_desc_sw128(sK + wg * 2 * BC * 128, BC * 128, 1024);  // B of dQ: columns 128 wg..
  constexpr u32 kDOOff = NST * Smem::kQ;  // dO's slots after Q's
  // P's and dS's stores (stmatrix_x4 of k-step ks: n-tiles 2 ks, 2 ks + 1 of the warp's 16 query rows):
  // lane 8 i + j addresses row 16 wq + 8 (i % 2) + j, key chunk c = NK / 8 wg + 2 ks + i / 2, which is chunk
  // c % 8 of 64-key panel c / 8 (BR rows of 128 bytes each, fa/smem_layout.cuh panel_offset), swizzled by j.
  const int si = lane / 8, sj = lane % 8;
  u32 ps_addr[NK / 16];
#pragma unroll
  for (int ks = 0; ks < NK / 16; ++ks) {
    // (one panel at 64 keys: written without the panel's terms, which ptxas does not fold, wg being a
    // run-time value: +8 instructions per kernel)
    if constexpr (BC <= 64) {
      ps_addr[ks] = (u32)(16 * wq + 8 * (si % 2) + sj) * 128 + (((NK / 8 * wg + 2 * ks + si / 2) ^ sj) << 4);
    } else {
      ps_addr[ks] = panel_offset<BR>(16 * wq + 8 * (si % 2) + sj, NK / 8 * wg + 2 * ks + si / 2);
    }
  }
  // exp2's multiplier (fa/variant.cuh backward_score: the scale folded in for the identity).
  const float sl2 = backward_exp2_multiplier<typename V::ScoreMod>(p);
  const float scale = p.scale;
  const int key0 = kv_start + NK * wg;  // this warpgroup's first key of S and dP

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    const int s = it % NST;
    const u32 qoff = s * Smem::kQ;
    mbar_wait(full(s), (u32)((it / NST) & 1));
    const int head = head_of(it);
    const int q_start = q_start_of(it);
    const int q_row0 = q_start + 16 * wq;  // the warp's first query row

    // ---- S = Q K_wg^T, dP = dO V_wg^T, as two groups: P is computed while dP runs -----------------------
    // (Kernel log 137 issued them a step early instead, under dQ's staging, in a rotated loop: 1.02-1.05x the
    // time at 256, the exponentials losing dP beside them; not kept, in the history at 6f58970.)
    float sc[NK / 2], dp[NK / 2];
    wgmma_fence();
    issue_query_rows_product<BR, BC, NK, D, BF>(sc, q_desc, qoff, k_desc);
    wgmma_commit();
    issue_query_rows_product<BR, BC, NK, DV, BF>(dp, q_desc, kDOOff + qoff, v_desc);
    wgmma_commit();
    // (The previous step's slot goes back to the producer after barrier 1: release_previous_slot.)
    const u32 prev_empty = it > 0 ? empty((it - 1) % NST) : 0u;

    // ---- P = exp2(S' m - LSE2): register 4 n + e is query q_row0 + g + 8 (e / 2), key key0 + 8 n + 2 t +
    // e % 2. A score function first, then the mask (keys past seqlen_k, the causal diagonal, ranges,
    // windows); queries past seqlen_q need none: their base-2 LSE is +inf, so their P is 0.
    const typename V::ScoreMod score_mod(p, batch, head);
    const float* lse_s = stats + s * 2 * BR;
    const float* del_s = lse_s + BR;
    wgmma_wait<1>();
    wgmma_hold(sc);
    score_mod_query_rows<true>(acc_tile(sc), score_mod, scale, q_row0, key0, g, t);
    mask.mask_query_rows(acc_tile(sc), q_row0, key0, g, t);
    const float lse2[2] = {lse_s[16 * wq + g], lse_s[16 * wq + g + 8]};
#pragma unroll
    for (int i = 0; i < NK / 2; ++i) sc[i] = exp2_approx(fmaf(sc[i], sl2, -lse2[(i / 2) % 2]));

    // ---- dS = P (dP - delta) scale (times the score function's derivative) ---------------------------------
    wgmma_wait<0>();
    wgmma_hold(dp);
    const float delta[2] = {del_s[16 * wq + g], del_s[16 * wq + g + 8]};
#pragma unroll
    for (int i = 0; i < NK / 2; ++i) {
      dp[i] = sc[i] * (dp[i] - delta[(i / 2) % 2]) * scale;
      if constexpr (!V::ScoreMod::kUnitGradient) {
        const int q = q_row0 + g + 8 * ((i / 2) % 2), key = key0 + 8 * (i / 4) + 2 * t + i % 2;
        dp[i] *= score_mod_gradient_from_p(score_mod, sc[i], lse2[(i / 2) % 2], q, key);
      }
    }

    // ---- P and dS into shared memory (bf16; this warpgroup's keys of each), for both warpgroups ----------
#pragma unroll
    for (int ks = 0; ks < NK / 16; ++ks) {
      u32 pf[4], sf[4];
      acc_to_a_frag<BF>(pf, acc_tile(sc), 0, ks);
      acc_to_a_frag<BF>(sf, acc_tile(dp), 0, ks);
      stmatrix_x4(sP + ps_addr[ks], pf);
      stmatrix_x4(sdS + ps_addr[ks], sf);
    }
    fence_proxy_async();
    // Barrier 1: both halves of P and dS are written and fenced for the tensor cores.
    named_barrier_sync(1, 256);

    if constexpr (D == 256) {
      // ---- dV^T += dO^T P, dK^T += Q^T dS (head_dim rows of this warpgroup), then dQ = dS K (its columns) ----
      float dq[D / 4];
      wgmma_fence();
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
        issue_head_rows_acc<BR, BC, BF>(dvt[hb], qt_desc, kDOOff + qoff + (2 * wg + hb) * BR * 128, pt_desc);
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
        issue_head_rows_acc<BR, BC, BF>(dkt[hb], qt_desc, qoff + (2 * wg + hb) * BR * 128, dst_desc);
      issue_dq_from_ds<BR, BC, D / 2, BF>(dq, ds_desc, kt_desc);
      wgmma_commit();
      release_previous_slot(prev_empty, ctid);
      wgmma_wait<0>();
      wgmma_hold(dq);
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        wgmma_hold(dvt[hb]);
        wgmma_hold(dkt[hb]);
      }
      // Barrier 2: every product of the step has completed in both warpgroups: the slot's Q and dO may take
      // dQ's staging, and the next step may rewrite P and dS.
      named_barrier_sync(2, 256);

      // ---- dQ out: staged in the slot (warpgroup 0 where Q was, 1 where dO was), two bulk reduce-adds -----
      const u32 buffer = sQ + wg * kDOOff + qoff;
      const u32 stage[2] = {buffer, buffer + 64 * 64 * 4};
      static_assert(Smem::kQ == 2 * 64 * 64 * 4, "a slot holds a warpgroup's two staged dQ tiles");
      stage_dq_tiles<D / 2>(stage, dq, ctid % 128);
      fence_proxy_async();
      // The warpgroup's tiles are staged and fenced for the copy engine (ids fixed at compile time: a
      // run-time id makes ptxas reserve all sixteen barriers).
      if (wg == 0) {
        named_barrier_sync(3, 128);
      } else {
        named_barrier_sync(4, 128);
      }
      if (ctid % 128 != 0) {
        mbar_arrive(empty(s));
      } else {
        const i64 ws_row = workspace_row(p, batch, head, q_start);
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
          bulk_reduce_add_f32(p.dq_accum + dq_accum_offset<D, true>(ws_row, D / 2 * wg + 64 * tile), stage[tile],
                              64 * 64 * 4);
        bulk_commit();
      }
    } else {
      // ---- head_dim 192: warpgroup 0 dV^T += dO^T P and dQ[:, 0:128) = dS K; warpgroup 1 dK^T += Q^T dS and
      // dQ[:, 128:192). The two arms differ only in dQ's width (the instruction's N); each retires its
      // products before the branch joins.
      const u32 slot_q = sQ + qoff, slot_do = sQ + kDOOff + qoff;
      const u32 at_off = (wg == 0 ? kDOOff : 0u) + qoff;  // dO^T's panels for dV^T, Q^T's for dK^T
      const u64 b_desc = wg == 0 ? pt_desc : dst_desc;    // P for dV^T, dS for dK^T
      const i64 ws_row = workspace_row(p, batch, head, q_start);
      if (wg == 0) {
        wide192_products_and_dq<128, BR, BC, D, BF, DV / 64>(hacc, qt_desc, at_off, b_desc, ds_desc, kt_desc, slot_q,
                                                     slot_do, p.dq_accum, ws_row, empty(s), prev_empty, ctid);
      } else {
        wide192_products_and_dq<64, BR, BC, D, BF>(hacc, qt_desc, at_off, b_desc, ds_desc, kt_desc, slot_q,
                                                    slot_do, p.dq_accum, ws_row, empty(s), prev_empty, ctid);
      }
    }
  }
  // No reduction may outlive the shared memory it reads.
  if (ctid % 128 == 0) bulk_wait<0>();

  // ---- epilogue: dK and dV through shared memory (K's and V's tiles: no product reads them any more) -------
  // The softmax scale is already in dS, so dK needs none.
  if constexpr (D == 256) {
#pragma unroll
    for (int hb = 0; hb < 2; ++hb) {
      const int d0 = 128 * wg + 64 * hb + 16 * wq;
      store_head_rows_transposed<BC, D, BF>(sK, dkt[hb], d0, lane);
      store_head_rows_transposed<BC, D, BF>(sV, dvt[hb], d0, lane);
    }
  } else if constexpr (DV == D) {  // (head_dim 192: warpgroup 0's rows are dV's, warpgroup 1's dK's)
#pragma unroll
    for (int hb = 0; hb < 3; ++hb)
      store_head_rows_transposed<BC, D, BF>(wg == 0 ? sV : sK, hacc[hb], 64 * hb + 16 * wq, lane);
  } else if (wg == 0) {  // (v's own head_dim: dV's DV / 64 row blocks into V's narrower tile)
#pragma unroll
    for (int hb = 0; hb < DV / 64; ++hb)
      store_head_rows_transposed<BC, DV, BF>(sV, hacc[hb], 64 * hb + 16 * wq, lane);
  } else {
#pragma unroll
    for (int hb = 0; hb < 3; ++hb) store_head_rows_transposed<BC, D, BF>(sK, hacc[hb], 64 * hb + 16 * wq, lane);
  }
  named_barrier_sync(1, 256);
  // (fa/bwd_wgmma.cuh: the 256 computing threads copy the block's BC key rows)
  copy_out_key_rows<BC, D, 256>(static_cast<u16*>(p.dk) + dk_offset(p, batch, kv_head, kv_start),
                                p.dk_row_stride, p.seqlen_k - kv_start, p.head_dim, sK, 0, ctid);
  copy_out_key_rows<BC, DV, 256>(static_cast<u16*>(p.dv) + dv_offset(p, batch, kv_head, kv_start),
                                 p.dv_row_stride, p.seqlen_k - kv_start, hdv, sV, 0, ctid);
}

}  // namespace sm90
}  // namespace fa
