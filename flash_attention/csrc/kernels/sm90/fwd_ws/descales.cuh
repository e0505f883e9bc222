// The e4m3 build's descales (FwdTmaParams' q_descale, k_descale, v_descale; ops/fp8_forward.py), read on
// the device so that a call with descales in GPU tensors needs no host synchronisation: the tile's q and k
// factors scale its softmax (the mainloop's exponent and the epilogue's LSE), its v factor the output
// before the one bf16 rounding. Per tile, because a factor may be one per (batch, kv head).
#pragma once

#include "fa/tma_params.h"

namespace fa {
namespace sm90 {

// The factor of (batch, query head)'s kv head in d, or 1 where d is null.
__device__ __forceinline__ float fwd_descale(const FwdTmaParams& tp, const float* d, int batch, int head) {
  return d ? d[batch * tp.descale_batch_stride + head / tp.p.group * tp.descale_head_stride] : 1.f;
}

// q's factor times k's: what the tile's scores are scaled by beyond the softmax scale.
__device__ __forceinline__ float fwd_qk_descale(const FwdTmaParams& tp, int batch, int head) {
  return fwd_descale(tp, tp.q_descale, batch, head) * fwd_descale(tp, tp.k_descale, batch, head);
}

}  // namespace sm90
}  // namespace fa
