// The online softmax of the forward kernels, on one warp's accumulator tile (fa/frag.cuh layout): the
// running row max M and sum L, the rescale of O whenever M grows, and the final 1 / L and log-sum-exp.
//
// Two forms. Folded (kFolded, the sm80 opt_softmax knob; the only form of the wgmma kernel): the scores
// stay unscaled and exp(scale (s - m)) = 2^(s * scale log2e - m * scale log2e) is one FFMA and one MUFU.EX2
// per score; M is then a max of unscaled scores, which is right for a positive scale only. Unfolded: the
// scores are scaled first (scale_scores, before masking: a negative scale would turn a masked -inf into
// +inf) and exponentiated with __expf; ops picks it for negative scales.
#pragma once

#include "fa/ptx.cuh"

namespace fa {

// s *= scale, the unfolded form's first step.
template <class Acc>
__device__ __forceinline__ void scale_scores(const Acc& s, float scale) {
#pragma unroll
  for (int mt = 0; mt < Acc::kMT; ++mt)
#pragma unroll
    for (int n = 0; n < Acc::kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s(mt, n, e) *= scale;
}

// One row's step: row r (0: g, 1: g + 8) of 16-row tile mt. The row's scores become its unnormalised
// probabilities, M and L (this thread's partial: its quad's four partials are added once, at the end)
// are updated, and the factor O's row must be multiplied by (rescale_row) is returned.
// kOffset (folded only): the row's true scores are this thread's s plus `offset` (a score function's
// per-row part, fa/variant.cuh score_mod_query_rows_offsets): added to the thread's max before the quad's
// reduction, and folded into the exponent's subtrahend; M stays a max of true scores.
// kLazy (folded only): M is the exponents' reference, not necessarily the max. It moves only when the
// block's max exceeds it by more than kLazyMargin in base 2, so P <= 2^kLazyMargin (finite in fp32, bf16
// and fp16 alike), and the returned factor is then exactly 1: a kernel skips O's rescale for a warp whose
// rows all kept theirs. The LSE, M + log L, is exact with any reference M.
// kExpPoly (folded only, 0-8): the exponentials of the column groups n with n % 8 below it are computed by
// exp2_poly on the FMA pipe instead of the SFU (fa/ptx.cuh exp2_share; KernelConfig.exp_poly, kernel log
// 139): kExpPoly eighths of them where the tile's groups are a multiple of 8, a little more otherwise.
constexpr float kLazyMargin = 8.f;
template <bool kFolded, bool kOffset = false, bool kLazy = false, int kExpPoly = 0, bool kIsBF16 = true,
          class Acc>
__device__ __forceinline__ float online_softmax_row(const Acc& s, int mt, int r, float& row_max,
                                                    float& row_sum, float scale_log2, float offset = 0.f) {
  static_assert(kFolded || !kOffset, "row offsets are the folded softmax's");
  static_assert(kFolded || !kLazy, "the lazy reference is the folded softmax's");
  static_assert(kFolded || kExpPoly == 0, "the polynomial exponentials are the folded softmax's");
  float mx = kOffset ? neg_inf() : row_max;
#pragma unroll
  for (int n = 0; n < Acc::kN; ++n) mx = fmaxf(mx, fmaxf(s(mt, n, 2 * r), s(mt, n, 2 * r + 1)));
  if constexpr (kOffset) mx = fmaxf(row_max, mx + offset);
  // The four lanes of a quad hold the same two rows.
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // The reference kept (same in the quad's four lanes: both operands are). A row whose reference is
  // still -inf compares NaN or +inf and moves; the scale is positive in the folded form.
  const bool keep = kLazy && (mx - row_max) * scale_log2 <= kLazyMargin;
  if (keep) mx = row_max;
  // A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps exp(-inf) = 0 rather
  // than exp(-inf - -inf) = NaN.
  float alpha, sum = 0.f;
  if constexpr (kFolded) {
    const float m_scaled = mx == neg_inf() ? 0.f : mx * scale_log2;
    alpha = keep ? 1.f : exp2_approx(row_max * scale_log2 - m_scaled);
    // (s + offset - M) scale log2e: the offset's part of the subtrahend once per row.
    const float sub = kOffset ? fmaf(-offset, scale_log2, m_scaled) : m_scaled;
#pragma unroll
    for (int n = 0; n < Acc::kN; ++n) {
      s(mt, n, 2 * r) = exp2_share<kExpPoly, kIsBF16>(n, fmaf(s(mt, n, 2 * r), scale_log2, -sub));
      s(mt, n, 2 * r + 1) = exp2_share<kExpPoly, kIsBF16>(n, fmaf(s(mt, n, 2 * r + 1), scale_log2, -sub));
      sum += s(mt, n, 2 * r) + s(mt, n, 2 * r + 1);
    }
  } else {
    const float m_use = mx == neg_inf() ? 0.f : mx;
    alpha = __expf(row_max - m_use);
#pragma unroll
    for (int n = 0; n < Acc::kN; ++n) {
      s(mt, n, 2 * r) = __expf(s(mt, n, 2 * r) - m_use);
      s(mt, n, 2 * r + 1) = __expf(s(mt, n, 2 * r + 1) - m_use);
      sum += s(mt, n, 2 * r) + s(mt, n, 2 * r + 1);
    }
  }
  row_max = mx;
  row_sum = row_sum * alpha + sum;
  return alpha;
}

// Scores bounded to [-cap, cap] (soft-capping, fa/variant.cuh kBounded) need no running max: with the
// exponent's origin fixed at cap / 2, every probability lies in [e^(-1.5 cap), e^(0.5 cap)], normal in fp32
// and bf16 for cap <= kFixedMaxCap (e^-84 > 2^-126), and a row's sum of 2^31 of them cannot overflow. The
// step is then one FFMA and one MUFU.EX2 per score with nothing between a block's scores and its
// exponentials (no row max, no shuffles, no rescale of O): on soft-capped attention the running max was a
// dependent chain after the tanh (kernel log 88), and this form cut soft-capping's forward from 1.27x to
// 1.13x plain attention (kernel log 99). fp16 cannot take it: P, rounded to fp16 for P V, would overflow
// past e^11. `s` holds tanh(scaled score / cap) (the policy's `unit`), masked -inf; `cap_log2` is cap log2 e.
//
// O must be divided by P as P V takes it, rounded to bf16: then O = sum(P V) / L_r is a convex combination
// of V's rows. Dividing by the sum of the fp32 values instead made O a combination whose weights add to
// 1 +- 2^-9: with the running max a row's largest P is exp(0) = 1, exact in bf16, but here P is an
// arbitrary float, so a row with one visible key got O = (bf16(P) / P) V instead of V, and the backward's
// D = rowsum(dO O) no longer cancelled dP = dO V: dQ and dK of such rows came out nonzero (up to 0.09)
// where they are exactly 0. The LSE keeps the fp32 sum L (the true one): from L_r, the backward's
// recomputed P of a one-key row was P / bf16(P), which can round to 1 - 2^-8, and its dV was then one
// bf16 unit off dO. So the kernel keeps both sums and, at the tile's end, folds log(L / L_r) into the
// row's reference max (bounded_lse_from_fp32_sum), so that the epilogue's O / L_r and max + log L_r give
// both. The returned value is L's part (the fp32 sum); `rounded_sum` gets L_r's when kRoundHere: each pair
// is rounded here (cvt.rn.bf16x2, then exact unpacking) for a caller whose P changes before it is packed
// (dropout). Otherwise the caller sums the packed P on the tensor cores (P times a tile of ones, in the
// P V group; fwd_ws): rounding here too doubled the conversions, which share the SFU's quarter-rate pipe
// with the tanh and the exp2 (kernel log 116: +5% at head_dim 128), and summing the unpacked pairs on the
// CUDA cores cost the forward 11% there.
constexpr float kFixedMaxCap = 56.f;
template <bool kRoundHere, class Acc>
__device__ __forceinline__ float bounded_softmax_row(const Acc& s, int mt, int r, float cap_log2,
                                                     float& rounded_sum) {
  const float origin = 0.5f * cap_log2;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < Acc::kN; ++n) {
    s(mt, n, 2 * r) = exp2_approx(fmaf(s(mt, n, 2 * r), cap_log2, -origin));
    s(mt, n, 2 * r + 1) = exp2_approx(fmaf(s(mt, n, 2 * r + 1), cap_log2, -origin));
    sum += s(mt, n, 2 * r) + s(mt, n, 2 * r + 1);
    if constexpr (kRoundHere) {
      float lo, hi;
      unpack2<true>(pack2<true>(s(mt, n, 2 * r), s(mt, n, 2 * r + 1)), lo, hi);
      rounded_sum += lo + hi;
    }
  }
  return sum;
}

// O's row r of 16-row tile mt *= alpha.
template <class Acc>
__device__ __forceinline__ void rescale_row(const Acc& o, int mt, int r, float alpha) {
#pragma unroll
  for (int n = 0; n < Acc::kN; ++n) {
    o(mt, n, 2 * r) *= alpha;
    o(mt, n, 2 * r + 1) *= alpha;
  }
}

// A row's L from this thread's partial sum: the quad's four lanes hold the row's columns.
__device__ __forceinline__ float quad_sum(float partial) {
  float l = partial;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  return l;
}

// At a tile's end, for the bounded softmax: `row_max` (its origin) += log(L / L_r) / scale and `row_sum`
// (this thread's partial of L) becomes its partial of L_r, so that the epilogue's O / L_r and LSE
// = max scale + log L_r = origin + log L are the two sums' (above). Every lane of the quad computes the same
// adjustment from the quad's sums. A row with no visible key keeps its state (both sums 0).
// `rounded_sum` is this thread's partial (the quad adds them) when `partial`, else the row's whole sum (the
// tensor cores' L_r), which the epilogue's quad sum then takes as four quarters (exact: a power of 2).
__device__ __forceinline__ void bounded_lse_from_fp32_sum(float& row_max, float& row_sum, float rounded_sum,
                                                          float scale, bool partial = true) {
  const float l = quad_sum(row_sum), l_rounded = partial ? quad_sum(rounded_sum) : rounded_sum;
  if (l_rounded > 0.f) row_max += __logf(l / l_rounded) / scale;
  row_sum = partial ? rounded_sum : 0.25f * rounded_sum;
}

// The factor that normalises O's row: 1 / L, or 0 for a row that saw no key (its O is 0 too).
__device__ __forceinline__ float inv_row_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }

// The row's natural-log LSE of the scaled scores (-inf for a row that saw no key); the folded form's max
// is of the unscaled scores. (The scale is read from the params here: an argument is loaded at the call,
// which moved the load in the sm80 forward's code.)
template <bool kFolded, class Params>
__device__ __forceinline__ float row_lse(const Params& p, float row_max, float l) {
  const float m = kFolded ? row_max * p.scale : row_max;
  return l > 0.f ? m + logf(l) : neg_inf();
}

// Attention sinks (flash_attention/sinks.py): a logit `sink` on the scale of the scaled scores joins the row's
// softmax denominator without a value. From the row's max (the softmax's form) and L, sets `lse` to the
// LSE with the sink and returns the factor O's unnormalised row is multiplied by: exp(m - top) / L' with
// L' = L exp(m - top) + exp(sink - top), top = max(m, sink), so that neither exponential overflows
// whatever the sink. A row that saw no key gets factor 0 and LSE = sink. Called only where a sink exists
// (the caller's branch on the params' pointer; -inf, no sink, takes the plain path there).
template <bool kFolded, class Params>
__device__ __forceinline__ float sink_row(const Params& p, float row_max, float l, float sink, float& lse) {
  const float m = l > 0.f ? (kFolded ? row_max * p.scale : row_max) : neg_inf();
  const float top = fmaxf(m, sink);
  const float keys = l > 0.f ? __expf(m - top) : 0.f;
  const float total = fmaf(l, keys, __expf(sink - top));
  lse = top + logf(total);
  return keys / total;
}

// The sink logit of query head `head` (-inf: none).
template <class Params>
__device__ __forceinline__ float head_sink(const Params& p, int head) {
  return p.sinks ? p.sinks[head] : neg_inf();
}

}  // namespace fa
