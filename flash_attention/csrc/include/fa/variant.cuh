// How an attention variant plugs into the kernels: every kernel body takes one template parameter
// `class V`, a Variant<Mask, ScoreMod>, and asks V's two policies everything that differs between variants.
// docs/design.md ("Adding an attention variant") walks through adding one.
//
// A Mask policy says which keys a query sees. It is built per (batch row, head) inside the kernel from the
// params (the dK/dV kernels, which walk every query head of a K/V head, pass the K/V head: a mask that
// differs between the query heads of a group needs building per head there) and answers, each in the form
// the kernels need it:
//  * which K/V blocks a query tile visits, kv_blocks<BC>(q_start, q_rows) -> KVBlocks<kLowerBound> (forward,
//    dQ), and which query blocks a key tile visits, q_blocks<BR, BC>(p, kv_start) -> QBlocks<kRowDependent>
//    (dK/dV): blocks holding no visible key are never loaded or computed;
//  * which elements of a visited block are masked: mask_query_rows(acc, q_row0, kv_start, g, t) on a warp's
//    accumulator with queries as rows (S), mask_key_rows(acc, kv_start, warp_row0, q_start, g, t) with keys
//    as rows (the backward's S^T); masked scores become -inf. Each first tests the whole tile with a
//    warp-uniform comparison, so tiles wholly visible cost a branch.
//  * key_end(): no row sees a key at or past it, and the kernels read none (zero-filled instead: padding
//    past a batch row's keys may hold anything, NaN included, and 0 * NaN would reach O through P V);
//  * two compile-time facts the kernels' shapes depend on: kLowerBound (a tile's first visible block may be
//    past block 0, so KVBlocks::begin is a run-time value; otherwise it is the constant 0 and folds away) and
//    kRowDependent (later query rows see more blocks: the forwards schedule the last query blocks first, and
//    a key tile's first query block is a run-time value).
//
// A ScoreMod policy changes the scores before the softmax: s' = mod(scale * s, q, k) for query q and key k.
// It is applied to a block's scores before the mask (so a masked score stays -inf whatever the function does
// with -inf) and, when it is not the identity, the forwards take the unfolded softmax (the scores scaled
// before the exponential, fa/softmax.cuh), since a function of the scaled score cannot be folded into exp2's
// multiplier (kRowOffsets, optional, marks a linear bias whose per-row part the wgmma forwards hand to the
// online softmax: score_mod_query_rows_offsets; such a policy also states kAffineDiagonal and unbiased(v),
// its score before the bias, the identity for a bias alone). A policy that measures a distance says from
// where with diagonal(q), the key aligned with query q (others return q). kIdentity = true compiles to
// nothing. The backward kernels accept only the identity until they carry the function's derivative (a
// static_assert says so).
//
// The library's own variants today: the masks CausalRangeMask (causal and/or per-batch key ranges, the rule
// of fa/visible_keys.cuh), WindowMask (a sliding window, and key ranges) and SegmentMask (a packed batch's
// runs), each with NoScoreMod, Softcap, Alibi (AlibiRuns or AlibiTable on a packed batch, and the "Rows"
// forms of each with a slope per query row) or SoftcapAlibi. The host picks the variant of a call and names it in the generated translation unit
// (flash_attention/jit/sources.py), so each variant is compiled only when a call needs it.
#pragma once

#include "fa/block_range.cuh"
#include "fa/mask.cuh"
#include "fa/visible_keys.cuh"

namespace fa {

template <class MaskPolicy, class ScoreModPolicy>
struct Variant {
  using Mask = MaskPolicy;
  using ScoreMod = ScoreModPolicy;
};

// A mask policy from a rule of fa/visible_keys.cuh (`Keys`, built per batch row from the params), whose
// block ranges (fa/block_range.cuh) and element masks (fa/mask.cuh) are free functions overloaded on it.
template <class Keys, bool kLowerBoundRule, bool kRowDependentRule>
struct RuleMask {
  static constexpr bool kLowerBound = kLowerBoundRule;
  static constexpr bool kRowDependent = kRowDependentRule;
  Keys keys;

  template <class Params>
  __device__ __forceinline__ RuleMask(const Params& p, int batch, int /*head*/) : keys(p, batch) {}

  __device__ __forceinline__ int key_end() const { return keys.kv_hi; }
  template <int BC>
  __device__ __forceinline__ auto kv_blocks(int q_start, int q_rows) const {
    return fa::kv_blocks<BC>(keys, q_start, q_rows);
  }
  template <int BR, int BC, class Params>
  __device__ __forceinline__ auto q_blocks(const Params& p, int kv_start) const {
    return fa::q_blocks<BR, BC>(keys, p, kv_start);
  }
  template <class Acc>
  __device__ __forceinline__ void mask_query_rows(const Acc& s, int q_row0, int kv_start, int g, int t) const {
    fa::mask_query_rows(s, keys, q_row0, kv_start, g, t);
  }
  // kKeepBounds: a rule whose tile test loads its bounds (the segments) keeps them in registers across the
  // blocks of a key tile, for a kernel that has the registers (fa/mask.cuh).
  template <bool kKeepBounds = false, class Acc>
  __device__ __forceinline__ void mask_key_rows(const Acc& s, int kv_start, int warp_row0, int q_start, int g,
                                                int t) const {
    if constexpr (kKeepBounds)
      fa::mask_key_rows_keeping_bounds(s, keys, kv_start, warp_row0, q_start, g, t);
    else
      fa::mask_key_rows(s, keys, kv_start, warp_row0, q_start, g, t);
  }
};

// Causal (bottom-right aligned) and/or per-batch key ranges (VisibleKeys). A key range makes a query
// tile's first K/V block a run-time value; causal makes a key tile's first query block one.
template <bool kCausal, bool kRanged>
using CausalRangeMask = RuleMask<VisibleKeys<kCausal, kRanged>, kRanged, kCausal>;

// A sliding window around the bottom-right diagonal (causal is the window (left, 0)), and/or per-batch key
// ranges (WindowKeys). Both ends of a row's keys move with the row, so both facts hold, and a key tile's
// query blocks are a band.
template <bool kRanged>
using WindowMask = RuleMask<WindowKeys<kRanged>, true, true>;

// The identity: the scores go to the softmax as the matrix product left them.
struct NoScoreMod {
  static constexpr bool kIdentity = true;
  static constexpr bool kUnitGradient = true;
  template <class Params>
  __device__ __forceinline__ NoScoreMod(const Params&, int /*batch*/, int /*head*/) {}
  __device__ __forceinline__ float operator()(float s, int /*q*/, int /*k*/) const { return s; }
  __device__ __forceinline__ float folded(float s, float /*rel*/) const { return s; }
  __device__ __forceinline__ int diagonal(int q) const { return q; }
  __device__ __forceinline__ float gradient(float /*s_mod*/, int /*q*/, int /*k*/) const { return 1.f; }
};

// The forward's folded form of a score function (the softmax's folded form, fa/softmax.cuh, keeps exp2 at one
// FFMA per score by leaving the scale out of the scores): `folded(s, rel)` takes the unscaled score s and
// returns v with mod(scale * s) = scale * v, so that the online softmax and the LSE run unchanged on v. `rel`
// is diagonal(q) - k as a float (diagonal(q): the key aligned with query q, q + seqlen_k - seqlen_q in a
// dense batch; a function that needs no distance returns q), formed by score_mod_query_rows_folded with one
// FADD per score from a per-row base (an I2F per score, which issues at the MUFU's rate, cost ALiBi's forward
// a fifth of its time: kernel log step 80). Used only where the scale is positive (select.forward_config
// moves a negative scale to the unfolded softmax).

// A score function's backward side: the backward kernels recompute P from mod(scale * s) and multiply dS
// by the function's derivative, which each policy gives from the modified score itself (`gradient(s', q,
// k)`; the query and key only for a function that must undo a bias to find its argument, SoftcapAlibi), so
// that a kernel that has already turned the score into P can recover it as log(P) + LSE without keeping
// another register per element; kUnitGradient says the derivative is 1 everywhere (additive biases), and
// the multiplication is compiled out.

// Logit soft-capping (Gemma 2, Grok): s' = cap tanh(s / cap), derivative 1 - (s' / cap)^2.
struct Softcap {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGradient = false;
  // The scaled score it returns lies in [-cap, cap], and unit(s) = its value / cap, from the unscaled score
  // (a forward may then drop the online softmax's running max: fa/softmax.cuh bounded_softmax_row).
  static constexpr bool kBounded = true;
  float cap, inv_cap;
  float pre, post;  // the folded form's factors: scale / cap before the tanh, cap / scale after it
  template <class Params>
  __device__ __forceinline__ Softcap(const Params& p, int /*batch*/, int /*head*/)
      : cap(p.score_values[0]),
        inv_cap(1.f / p.score_values[0]),
        pre(p.scale / p.score_values[0]),
        post(p.score_values[0] / p.scale) {}
  __device__ __forceinline__ float operator()(float s, int /*q*/, int /*k*/) const {
    return cap * tanh_approx(s * inv_cap);
  }
  __device__ __forceinline__ float folded(float s, float /*rel*/) const { return post * tanh_approx(s * pre); }
  __device__ __forceinline__ float unit(float s) const { return tanh_approx(s * pre); }
  // The bound itself, from the parameters (the backward's exp2 multiplier, backward_exp2_multiplier).
  template <class Params>
  __device__ __forceinline__ static float bound(const Params& p) {
    return p.score_values[0];
  }
  __device__ __forceinline__ int diagonal(int q) const { return q; }
  __device__ __forceinline__ float gradient(float s_mod, int /*q*/, int /*k*/) const {
    const float t = s_mod * inv_cap;
    return fmaf(-t, t, 1.f);
  }
};

// Where ALiBi's distance is measured from, diagonal(q): the key aligned with query q.
// In a dense batch, q + shift with shift = seqlen_k - seqlen_q (aligned like causal).
struct ShiftDiagonal {
  static constexpr bool kAffine = true;  // diagonal(q + 1) = diagonal(q) + 1 everywhere
  int shift;
  template <class Params>
  __device__ __forceinline__ explicit ShiftDiagonal(const Params& p) : shift(p.seqlen_k - p.seqlen_q) {}
  __device__ __forceinline__ static ShiftDiagonal of_shift(int s) { return ShiftDiagonal(s, 0); }
  __device__ __forceinline__ int operator()(int q) const { return q + shift; }
  __device__ __forceinline__ ShiftDiagonal for_key(int /*k*/) const { return *this; }

 private:
  __device__ __forceinline__ ShiftDiagonal(int s, int /*tag*/) : shift(s) {}
};

// A packed batch's diagonals are affine within a sequence: diagonal(q) = q + shift of q's sequence. With keys
// as rows (the backward's S^T) every query a key sees is of the key's sequence, so one shift per key row
// serves all its columns: the diagonal of the first query row that sees key k (key_rows, the segments' other
// runs) minus that row, a ShiftDiagonal (for_key). A key no row sees is masked whole: its shift is moot.
// That is two loads per key row, loop-invariant in the dK/dV kernels (their keys are the CTA's), where the
// queries' own diagonals were one load per column and block (2 kN per thread, loaded ahead of the wait for
// S^T since kernel log 110): packed ALiBi's forward+backward 6-7% faster at d128 and 10-11% at d64 (H200,
// kernel log 114), and the d64 ws dK/dV kernel's spills 80 -> 36 bytes.
template <class Diagonal>
__device__ __forceinline__ ShiftDiagonal key_shift_diagonal(const Diagonal& d, const int* key_rows, int k,
                                                            int last_key, int last_row) {
  // (clamped to the rows both ways: the runs' values are the caller's offsets', which may be anything)
  const int q0 = max(min(__ldg(key_rows + 2 * min(k, last_key)), last_row), 0);
  return ShiftDiagonal::of_shift(d(q0) - q0);
}
// In a packed batch of causal sequences (flash_attention.varlen, the segments build), each query row's run
// of keys ends just past its diagonal key (the run carries the bottom-right causal bound of the row's own
// sequence, with its seqused_k), so the diagonal is the run's end - 1: any query and key counts per
// sequence, with no table beyond the runs. A row whose run is empty sees no key, so its value is moot.
// Affine only within a sequence (the offsets form tests the warp's rows).
struct RunEndDiagonal {
  static constexpr bool kAffine = false;
  const int* row_keys;
  const int* key_rows;
  int last_row, last_key;
  template <class Params>
  __device__ __forceinline__ explicit RunEndDiagonal(const Params& p)
      : row_keys(p.row_keys), key_rows(p.key_rows), last_row(p.seqlen_q - 1), last_key(p.seqlen_k - 1) {}
  __device__ __forceinline__ int operator()(int q) const {
    return __ldg(row_keys + 2 * min(q, last_row) + 1) - 1;
  }
  __device__ __forceinline__ ShiftDiagonal for_key(int k) const {
    return key_shift_diagonal(*this, key_rows, k, last_key, last_row);
  }
};

// In a packed batch of sequences without causal whose query and key counts differ (or with seqused_k), no
// run bound is the diagonal: flash_attention.varlen computes each row's diagonal key (packed coordinates)
// into p.alibi_diagonal. Affine only within a sequence, as RunEndDiagonal.
struct TableDiagonal {
  static constexpr bool kAffine = false;
  const int* table;
  const int* key_rows;
  int last_row, last_key;
  template <class Params>
  __device__ __forceinline__ explicit TableDiagonal(const Params& p)
      : table(p.alibi_diagonal), key_rows(p.key_rows), last_row(p.seqlen_q - 1), last_key(p.seqlen_k - 1) {}
  __device__ __forceinline__ int operator()(int q) const { return __ldg(table + min(q, last_row)); }
  __device__ __forceinline__ ShiftDiagonal for_key(int k) const {
    return key_shift_diagonal(*this, key_rows, k, last_key, last_row);
  }
};

// Where ALiBi's slope comes from.
// One per (batch row, query head), p.alibi_slopes[batch * p.alibi_batch_stride + head] (a (heads,) table:
// batch stride 0), the same for every row of a CTA: AlibiFrom loads it once into `slope` (this tag holds
// nothing, so that the policy is what it was before per-row slopes existed: its SASS is unchanged).
struct HeadSlope {
  static constexpr bool kPerRow = false;
  __device__ __forceinline__ HeadSlope() {}
  template <class Params>
  __device__ __forceinline__ HeadSlope(const Params&, int /*batch*/, int /*head*/) {}
};
// One per query row and head: a packed batch whose sequences have slopes of their own
// (flash_attention.varlen expands (batch, heads) slopes into a (total_q, heads) table, each row its
// sequence's), row q's at p.alibi_slopes[q * p.alibi_batch_stride + head]. A load per row (L1: the rows of
// a tile share lines), as TableDiagonal's; the forms below load it once per row of a thread
// (score_mod_for_row), never per score.
// With keys as rows (the backward's S^T) a key's slope is its sequence's: that of the first query row that
// sees it (p.key_rows, the segments' other runs; a key no row sees is masked whole, its slope moot), one
// per key row of a thread (score_mod_for_key) where the queries' would be one per column, 2 kN of them
// (32 more registers spilled the d64 ws dK/dV kernel from 80 to 316 bytes, NVRTC 13.0).
struct RowSlope {
  static constexpr bool kPerRow = true;
  const float* slopes;  // (this head's column of the table)
  const int* key_rows;
  int stride, last_row, last_key;
  template <class Params>
  __device__ __forceinline__ RowSlope(const Params& p, int /*batch*/, int head)
      : slopes(p.alibi_slopes + head),
        key_rows(p.key_rows),
        stride(p.alibi_batch_stride),
        last_row(p.seqlen_q - 1),
        last_key(p.seqlen_k - 1) {}
  __device__ __forceinline__ float operator()(int q) const {
    return __ldg(slopes + max(min(q, last_row), 0) * stride);  // (q from key_rows may be anything)
  }
  __device__ __forceinline__ float of_key(int k) const {
    return (*this)(__ldg(key_rows + 2 * min(k, last_key)));
  }
};

// ALiBi: s' = s - slope(q) |diagonal(q) - k| (Diagonal: ShiftDiagonal, as in the FlashAttention library, or
// a packed batch's RunEndDiagonal or TableDiagonal; Slope: HeadSlope, or a packed batch's RowSlope).
// Derivative 1. With RowSlope, `slope` and `slope_over_scale` are a row's, set by for_row (the forward's
// folded and offsets forms take a copy per row), and operator() loads the row's own.
template <class Diagonal, class Slope = HeadSlope>
struct AlibiFrom {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGradient = true;
  // The wgmma forwards' form (score_mod_query_rows_offsets): one FFMA per score, each row's part of the bias
  // left to the online softmax.
  static constexpr bool kRowOffsets = true;
  static constexpr bool kAffineDiagonal = Diagonal::kAffine;
  static constexpr bool kRowSlopes = Slope::kPerRow;
  float slope, slope_over_scale;  // (a kernel keeps the one its form reads; the other is dead code)
  Diagonal diagonal;
  Slope slopes;
  float inv_scale;  // (RowSlope's for_row; 0 with HeadSlope)
  template <class Params>
  __device__ __forceinline__ AlibiFrom(const Params& p, int batch, int head)
      : slope(kRowSlopes ? 0.f : p.alibi_slopes[batch * p.alibi_batch_stride + head]),
        slope_over_scale(slope / p.scale),
        diagonal(p),
        slopes(p, batch, head),
        inv_scale(kRowSlopes ? 1.f / p.scale : 0.f) {}
  // One slope for every row (for_key's result).
  __device__ __forceinline__ AlibiFrom(float row_slope, float row_slope_over_scale, const Diagonal& d)
      : slope(row_slope), slope_over_scale(row_slope_over_scale), diagonal(d), slopes(), inv_scale(0.f) {}
  __device__ __forceinline__ float slope_at(int q) const {
    if constexpr (kRowSlopes)
      return slopes(q);
    else
      return slope;
  }
  // This policy with row q's slope in `slope` and `slope_over_scale` (itself with HeadSlope).
  __device__ __forceinline__ AlibiFrom for_row(int q) const {
    AlibiFrom r = *this;
    if constexpr (kRowSlopes) {
      r.slope = slopes(q);
      r.slope_over_scale = r.slope * inv_scale;
    }
    return r;
  }
  // With keys as rows: this policy as key k's columns see it, one slope and one shift (its sequence's:
  // RowSlope::of_key, the diagonal's for_key; with HeadSlope, the CTA's slope).
  __device__ __forceinline__ AlibiFrom<ShiftDiagonal, HeadSlope> for_key(int k) const {
    if constexpr (kRowSlopes) {
      const float key_slope = slopes.of_key(k);
      return AlibiFrom<ShiftDiagonal, HeadSlope>(key_slope, key_slope * inv_scale, diagonal.for_key(k));
    } else {
      return AlibiFrom<ShiftDiagonal, HeadSlope>(slope, slope_over_scale, diagonal.for_key(k));
    }
  }
  __device__ __forceinline__ float operator()(float s, int q, int k) const {
    return fmaf(-slope_at(q), fabsf((float)(diagonal(q) - k)), s);
  }
  __device__ __forceinline__ float folded(float s, float rel) const {
    return fmaf(-slope_over_scale, fabsf(rel), s);
  }
  __device__ __forceinline__ float gradient(float /*s_mod*/, int /*q*/, int /*k*/) const { return 1.f; }
  __device__ __forceinline__ float unbiased(float v) const { return v; }  // (the offsets form's input)
};
using Alibi = AlibiFrom<ShiftDiagonal>;
using AlibiRuns = AlibiFrom<RunEndDiagonal>;
using AlibiTable = AlibiFrom<TableDiagonal>;
// Per-row slopes, from each diagonal source a packed batch has (the packed row's own index: ShiftDiagonal
// with shift 0 in packed self-attention; the runs' ends with causal; the table otherwise).
using AlibiRows = AlibiFrom<ShiftDiagonal, RowSlope>;
using AlibiRunsRows = AlibiFrom<RunEndDiagonal, RowSlope>;
using AlibiTableRows = AlibiFrom<TableDiagonal, RowSlope>;

// Soft-capping, then ALiBi's bias (the FlashAttention library's order): s' = cap tanh(s / cap) - slope(q)
// |diagonal(q) - k|. The two policies above, composed. Its derivative is soft-capping's at the capped score,
// which the backward recovers from s' by adding the bias back (so it needs q and k). In the wgmma forwards'
// offsets form the column part of the bias is added to the capped score (`unbiased`).
template <class Diagonal, class Slope = HeadSlope>
struct SoftcapAlibiFrom {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGradient = false;
  static constexpr bool kRowOffsets = true;
  static constexpr bool kAffineDiagonal = Diagonal::kAffine;
  static constexpr bool kRowSlopes = Slope::kPerRow;
  Softcap cap;
  AlibiFrom<Diagonal, Slope> bias;
  float slope_over_scale;  // (score_mod_query_rows_offsets reads it)
  template <class Params>
  __device__ __forceinline__ SoftcapAlibiFrom(const Params& p, int batch, int head)
      : cap(p, batch, head), bias(p, batch, head), slope_over_scale(bias.slope_over_scale) {}
  __device__ __forceinline__ SoftcapAlibiFrom(const Softcap& c, const AlibiFrom<Diagonal, Slope>& b)
      : cap(c), bias(b), slope_over_scale(b.slope_over_scale) {}
  __device__ __forceinline__ SoftcapAlibiFrom<ShiftDiagonal, HeadSlope> for_key(int k) const {
    return SoftcapAlibiFrom<ShiftDiagonal, HeadSlope>(cap, bias.for_key(k));
  }
  __device__ __forceinline__ SoftcapAlibiFrom for_row(int q) const {
    SoftcapAlibiFrom r = *this;
    if constexpr (kRowSlopes) {
      r.bias = bias.for_row(q);
      r.slope_over_scale = r.bias.slope_over_scale;
    }
    return r;
  }
  __device__ __forceinline__ float operator()(float s, int q, int k) const { return bias(cap(s, q, k), q, k); }
  __device__ __forceinline__ float folded(float s, float rel) const {
    return bias.folded(cap.folded(s, rel), rel);
  }
  __device__ __forceinline__ float unbiased(float v) const { return cap.folded(v, 0.f); }
  __device__ __forceinline__ int diagonal(int q) const { return bias.diagonal(q); }
  __device__ __forceinline__ float gradient(float s_mod, int q, int k) const {
    return cap.gradient(fmaf(bias.slope_at(q), fabsf((float)(bias.diagonal(q) - k)), s_mod), q, k);
  }
};
using SoftcapAlibi = SoftcapAlibiFrom<ShiftDiagonal>;
using SoftcapAlibiRuns = SoftcapAlibiFrom<RunEndDiagonal>;
using SoftcapAlibiTable = SoftcapAlibiFrom<TableDiagonal>;
using SoftcapAlibiRows = SoftcapAlibiFrom<ShiftDiagonal, RowSlope>;
using SoftcapAlibiRunsRows = SoftcapAlibiFrom<RunEndDiagonal, RowSlope>;
using SoftcapAlibiTableRows = SoftcapAlibiFrom<TableDiagonal, RowSlope>;

// Whether a score function's slope differs between query rows (kRowSlopes: a packed batch's RowSlope);
// optional: a policy without the member has one per CTA, or none.
template <class M, class = void>
struct ScoreModRowSlopes {
  static constexpr bool value = false;
};
template <class M>
struct ScoreModRowSlopes<M, decltype(void(M::kRowSlopes))> {
  static constexpr bool value = M::kRowSlopes;
};

// The score function as query row q's forms need it: with per-row slopes, a copy holding the row's slope
// (loaded once per row of a thread, not per score); otherwise the policy itself.
template <class M>
__device__ __forceinline__ M score_mod_for_row(const M& mod, int q) {
  if constexpr (ScoreModRowSlopes<M>::value)
    return mod.for_row(q);
  else
    return mod;
}

// Whether a score function loads each row's diagonal (kAffineDiagonal false: a packed batch's ALiBi,
// RunEndDiagonal or TableDiagonal); optional, as kAffineDiagonal is: a policy without it loads none.
template <class M, class = void>
struct ScoreModLoadsDiagonal {
  static constexpr bool value = false;
};
template <class M>
struct ScoreModLoadsDiagonal<M, decltype(void(M::kAffineDiagonal))> {
  static constexpr bool value = !M::kAffineDiagonal;
};

// Whether a score function takes a form per key row in S^T (for_key): one whose slope or diagonal is per
// query row (a packed batch's ALiBi).
template <class M>
inline constexpr bool kScoreModKeyForm = ScoreModRowSlopes<M>::value || ScoreModLoadsDiagonal<M>::value;

// The score function as key k's row of S^T needs it: with per-row slopes or diagonals, a policy of one slope
// and one shift, the key's sequence's (for_key); otherwise the policy itself.
template <class M>
__device__ __forceinline__ auto score_mod_for_key(const M& mod, int k) {
  if constexpr (kScoreModKeyForm<M>)
    return mod.for_key(k);
  else
    return mod;
}

// The variants the host builds today: causal or not, key ranges or not; a sliding window, key ranges or not.
template <bool kCausal, bool kRanged>
using DefaultVariant = Variant<CausalRangeMask<kCausal, kRanged>, NoScoreMod>;
template <bool kRanged>
using WindowVariant = Variant<WindowMask<kRanged>, NoScoreMod>;
// Segments (SegmentKeys): per-row key runs from the host, a packed batch of sequences (varlen).
using SegmentMask = RuleMask<SegmentKeys, true, true>;

// Whether a mask policy is a packed batch's runs: the one policy whose tiles may follow a tile table and
// whose blocks may be anchored at a tile's first key (the warp-specialized forward, fa/block_range.cuh
// kv_blocks_anchored). False for every other policy, a new one included, which need not say anything.
template <class Mask>
struct MaskIsSegments {
  static constexpr bool value = false;
};
template <>
struct MaskIsSegments<SegmentMask> {
  static constexpr bool value = true;
};

// Whether attention dropout draws one hash finaliser per pair of keys j, j + 8 (fa/dropout.cuh): where a
// kernel's key tiles start at multiples of 16 keys, under every mask but a packed batch's, whose blocks may
// be anchored at a sequence's first key (that one draws the pair's finaliser for each of its elements, the
// same decisions at the old cost).
template <class V>
constexpr bool kDropoutKeyPairs = !MaskIsSegments<typename V::Mask>::value;

// Whether a mask is the plain causal one (with or without key ranges): a key tile's work then falls with
// its index, which the causal backward's block order uses (fa/kv_block_order.cuh).
template <class Mask>
struct MaskIsCausal {
  static constexpr bool value = false;
};
template <bool kRanged>
struct MaskIsCausal<CausalRangeMask<true, kRanged>> {
  static constexpr bool value = true;
};

// Whether a forward keeps the scale folded into exp2's multiplier (fa/softmax.cuh): where the kernel's
// config asks for it; a score function then runs in its folded form (score_mod_query_rows_folded).
template <class V, bool kConfigFolds>
inline constexpr bool kFoldsScale = kConfigFolds;

// s = mod(scale * s, q, k) on a warp's accumulator with queries as rows (fa/frag.cuh layout: element
// (mt, n, e) is query q_row0 + 16 mt + g + 8 (e / 2) against key kv_start + 8 n + 2 t + e % 2). Nothing
// for the identity. Call before the mask.
// kBackward: x = backward_score(s) instead (a backward kernel's form, below).
template <bool kBackward = false, class ScoreMod, class Acc>
__device__ __forceinline__ void score_mod_query_rows(const Acc& s, const ScoreMod& mod, float scale, int q_row0,
                                                     int kv_start, int g, int t) {
  if constexpr (!ScoreMod::kIdentity) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int q = q_row0 + 16 * mt + g + 8 * (e >> 1), k = kv_start + 8 * n + 2 * t + (e & 1);
          if constexpr (kBackward)
            s(mt, n, e) = backward_score(mod, s(mt, n, e), scale, q, k);
          else
            s(mt, n, e) = mod(scale * s(mt, n, e), q, k);
        }
  }
}

// The folded form of the same (the scores stay unscaled: v = mod.folded(s, q - k + offset), mod(scale s) =
// scale v). The distance is a float from the row's base minus the column's constant (8 n + e % 2, folded
// into the FADD's immediate), so the loop converts once per row, not once per score.
template <class ScoreMod, class Acc>
__device__ __forceinline__ void score_mod_query_rows_folded(const Acc& s, const ScoreMod& mod, int q_row0,
                                                            int kv_start, int g, int t) {
  if constexpr (!ScoreMod::kIdentity) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + 16 * mt + g + 8 * h;
        const ScoreMod row_mod = score_mod_for_row(mod, row);
        const float rel0 = (float)(mod.diagonal(row) - kv_start - 2 * t);
#pragma unroll
        for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            s(mt, n, 2 * h + c) = row_mod.folded(s(mt, n, 2 * h + c), rel0 - (float)(8 * n + c));
      }
  }
}

// Whether a score function is a linear bias whose rows' parts the wgmma forwards hand to the online softmax
// (kRowOffsets, score_mod_query_rows_offsets); optional: a policy without the member takes the folded form.
template <class M, class = void>
struct ScoreModRowOffsets {
  static constexpr bool value = false;
};
template <class M>
struct ScoreModRowOffsets<M, decltype(void(M::kRowOffsets))> {
  static constexpr bool value = M::kRowOffsets;
};

// Whether a score function's scaled scores are bounded by its `cap` (kBounded, with unit(s) = score / cap);
// optional: a policy without the member is unbounded (ALiBi, and soft-capping with ALiBi's bias after it).
template <class M, class = void>
struct ScoreModBounded {
  static constexpr bool value = false;
};
template <class M>
struct ScoreModBounded<M, decltype(void(M::kBounded))> {
  static constexpr bool value = M::kBounded;
};

// A bounded policy's bound on its scaled scores, |s'| <= score_bound (its `bound(p)`), 0 for the others: what
// a forward's bounded softmax reads, without naming the function whose number it is.
template <class M, class Params>
__device__ __forceinline__ float score_bound(const Params& p) {
  if constexpr (ScoreModBounded<M>::value)
    return M::bound(p);
  else
    return 0.f;
}

// The folded form with each row's part of an additive bias left to the online softmax (kRowOffsets: ALiBi;
// the wgmma forwards). On a block whose keys all lie on one side of every row's diagonal in this warp,
// -slope |q - k| is linear: -slope (q - k) below the diagonal, +slope (q - k) above. Its column part
// (8 n + e % 2, a compile-time constant) is one FFMA per score, v = fmaf(+-slope, c, s); the rest,
// -+slope (rel0) per row and thread, goes to online_softmax_row as `offset`, which adds it to the thread's
// row max before the quad's reduction and folds it into the exponent's subtrahend (one FFMA per row). The
// FADD per score of the plain folded form (rel0 - c) is gone. Blocks the diagonal crosses (the test is on
// the warp's first and last rows, so it is uniform) take the plain folded form with offset 0.
template <class ScoreMod, class Acc>
__device__ __forceinline__ void score_mod_query_rows_offsets(const Acc& s, const ScoreMod& mod, int q_row0,
                                                             int kv_start, int g, int t,
                                                             float (&offset)[Acc::kMT][2]) {
  static_assert(ScoreMod::kRowOffsets, "score_mod_query_rows_offsets is the form of a linear bias");
  constexpr int kCols = 8 * Acc::kN;
  const int d0 = mod.diagonal(q_row0);
  // The warp's first row's slope: the warp's with one per CTA; with per-row slopes, checked below.
  const ScoreMod mod0 = score_mod_for_row(mod, q_row0);
  // The test below and the per-row bases take the warp's diagonals as d0 + (row - q_row0); a diagonal that
  // is not affine everywhere (a packed batch's: each sequence has its own) is checked on every row of the
  // warp (its loads hit L1: the mask reads the same runs), and the folded form taken where it does not hold.
  // Per-row slopes likewise: the warp's rows must share the first row's (they may not even where the
  // diagonals run on, across two sequences).
  bool affine = true;
  if constexpr (!ScoreMod::kAffineDiagonal || ScoreModRowSlopes<ScoreMod>::value) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + 16 * mt + g + 8 * h;
        affine &= mod.diagonal(row) == d0 + (row - q_row0);
        if constexpr (ScoreModRowSlopes<ScoreMod>::value)
          affine &= score_mod_for_row(mod, row).slope_over_scale == mod0.slope_over_scale;
      }
    affine = __all_sync(0xffffffffu, affine);
  }
  const int near = d0 - kv_start;                    // the warp's first row against the block's first key
  const bool below = near - (kCols - 1) >= 0;        // every key at or before every row's diagonal
  const bool above = near + 16 * Acc::kMT - 1 <= 0;  // every key at or after it
  if (!affine || (!below && !above)) {
    score_mod_query_rows_folded(s, mod, q_row0, kv_start, g, t);
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt) offset[mt][0] = offset[mt][1] = 0.f;
    return;
  }
  // below: v = s - k (rel0 - c) = fmaf(k, c, s) - k rel0; above: v = s - k (c - rel0) = fmaf(-k, c, s) + k rel0.
  const float k = below ? mod0.slope_over_scale : -mod0.slope_over_scale;
#pragma unroll
  for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float rel0 = (float)(d0 + 16 * mt + g + 8 * h - kv_start - 2 * t);
      offset[mt][h] = -k * rel0;
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          s(mt, n, 2 * h + c) = fmaf(k, (float)(8 * n + c), mod0.unbiased(s(mt, n, 2 * h + c)));
    }
}

// The wgmma forwards' score step: the offsets form for a linear bias (`offset` then holds each row's part,
// which online_softmax_row<kFolded, ScoreModRowOffsets<ScoreMod>::value> takes), else the folded form
// (offset 0).
template <class ScoreMod, class Acc>
__device__ __forceinline__ void score_mod_query_rows_wgmma(const Acc& s, const ScoreMod& mod, int q_row0,
                                                           int kv_start, int g, int t,
                                                           float (&offset)[Acc::kMT][2]) {
  if constexpr (ScoreModRowOffsets<ScoreMod>::value) {
    score_mod_query_rows_offsets(s, mod, q_row0, kv_start, g, t, offset);
  } else {
    score_mod_query_rows_folded(s, mod, q_row0, kv_start, g, t);
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt) offset[mt][0] = offset[mt][1] = 0.f;
  }
}

// Whether a score function states its derivative (kUnitGradient, gradient(s', q, k)), which the backward needs.
template <class M, class = void>
struct ScoreModHasGradient {
  static constexpr bool value = false;
};
template <class M>
struct ScoreModHasGradient<M, decltype(void(M::kUnitGradient))> {
  static constexpr bool value = true;
};

// The backward's form of a score function, shared by every backward family. Each recomputes P from the raw
// product s as exp2(x m - LSE2), where x = backward_score(s) is left in the accumulator (and masked: -inf),
// m = backward_exp2_multiplier, and multiplies dS by backward_gradient(x):
//   the identity:        x = s,                   m = scale log2 e, derivative 1;
//   a bounded function:  x = unit(s) = s' / cap,  m = cap log2 e,   derivative 1 - x^2 (soft-capping);
//   any other function:  x = s' = mod(scale s),   m = log2 e,       derivative gradient(s', q, k).
// The bounded form takes one FMUL and the tanh per score where the general one took three FMULs around it,
// and a fourth for the derivative's s' / cap, with a select to keep 0 * -inf out of masked elements (the
// SASS of the warp-specialized dK/dV kernel, kernel log 100).
template <class ScoreMod>
__device__ __forceinline__ float backward_score(const ScoreMod& mod, float s, float scale, int q, int k) {
  if constexpr (ScoreModBounded<ScoreMod>::value)
    return mod.unit(s);
  else
    return mod(scale * s, q, k);
}

// Key-row orientation (the backward's S^T, fa/mask.cuh's mask_key_rows layout: element (mt, n, e) is key
// kv_start + warp_row0 + 16 mt + g + 8 (e / 2) against query q_start + 8 n + 2 t + e % 2): s =
// backward_score(s). Nothing for the identity. Call before the mask.
template <class ScoreMod, class Acc>
__device__ __forceinline__ void score_mod_key_rows(const Acc& s, const ScoreMod& mod, float scale, int kv_start,
                                                   int warp_row0, int q_start, int g, int t) {
  if constexpr (kScoreModKeyForm<ScoreMod>) {
    // Per-row slopes or diagonals: each key row's policy of one slope and shift (score_mod_for_key), made
    // once per key row. (The other functions keep the loop below: ordered like this one, it moved the SASS
    // of the sm80 dK/dV kernels, +88 instructions and more spills in the d64 ALiBi build, NVRTC 13.0.)
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = kv_start + warp_row0 + 16 * mt + g + 8 * h;
        const auto key_mod = score_mod_for_key(mod, key);
#pragma unroll
        for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            s(mt, n, 2 * h + c) =
                backward_score(key_mod, s(mt, n, 2 * h + c), scale, q_start + 8 * n + 2 * t + c, key);
      }
  } else if constexpr (!ScoreMod::kIdentity) {
#pragma unroll
    for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
      for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s(mt, n, e) = backward_score(mod, s(mt, n, e), scale, q_start + 8 * n + 2 * t + (e & 1),
                                       kv_start + warp_row0 + 16 * mt + g + 8 * (e >> 1));
  }
}

// The multiplier m of the backward's exp2(x m - LSE2) (backward_score's table above).
template <class ScoreMod, class Params>
__device__ __forceinline__ float backward_exp2_multiplier(const Params& p) {
  if constexpr (ScoreMod::kIdentity)
    return p.scale_log2;
  else if constexpr (ScoreModBounded<ScoreMod>::value)
    return ScoreMod::bound(p) * 1.4426950408889634f;
  else
    return 1.4426950408889634f;
}

// The score function's derivative at an element whose backward score is x and whose P is p. A masked
// element (x = -inf, p = 0) contributes nothing to dS: its derivative is made 0, not -inf (0 * -inf is
// NaN). The bounded form's 1 - x^2 is saturated to [0, 1], which does that in the FFMA itself (.sat maps
// -inf to 0; a tanh never leaves [-1, 1], so no other value changes); the general form selects on p.
template <class ScoreMod>
__device__ __forceinline__ float backward_gradient(const ScoreMod& mod, float x, float p, int q, int k) {
  if constexpr (ScoreMod::kUnitGradient)
    return 1.f;
  else if constexpr (ScoreModBounded<ScoreMod>::value)
    return __saturatef(fmaf(-x, x, 1.f));
  else
    return p > 0.f ? mod.gradient(x, q, k) : 0.f;
}

// The score function's derivative at an element whose P is p and row LSE (base 2) lse2: the modified
// score is (log2 p + lse2) ln 2. p below the least normal float (masked, or underflowed) contributes nothing
// to dS: 0 there, which also keeps log2 = -inf out. The test is against FLT_MIN, not 0: log2_approx is the
// ftz form, so a subnormal p has log2 -inf too, and exp2_poly (bwd_ws's exp_poly) gives subnormals where
// the SFU gives 0. With p > 0 the soft-cap's derivative of -inf, 1 - inf, made dS infinite (soft-cap, ALiBi
// and dropout at exp_poly 2-8: ALiBi's distances put P's argument near -127, dropout takes this path).
template <class ScoreMod>
__device__ __forceinline__ float score_mod_gradient_from_p(const ScoreMod& mod, float p, float lse2, int q, int k) {
  if constexpr (ScoreMod::kUnitGradient) {
    return 1.f;
  } else {
    constexpr float kLeastNormal = 1.17549435e-38f;  // FLT_MIN, 2^-126
    return p >= kLeastNormal ? mod.gradient((log2_approx(p) + lse2) * 0.6931471805599453f, q, k) : 0.f;
  }
}

}  // namespace fa
