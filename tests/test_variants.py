"""The variant interface (csrc/include/fa/variant.cuh) holds for every kernel family.

Each kernel body takes its mask and score function as one template parameter. These tests instantiate every
family with sample policies written only against that interface, a sliding-window mask (a lower bound and a
row-dependent range, unlike the library's own policy) and a softcapping score function, and compile them: a
kernel that still reaches past the interface (a mask field, a causal flag of its own) fails to compile here.
The numbers of the library's own variant are the GPU tests' business; this is about the seam the next
variants plug into. Needs NVRTC or nvcc, as the catalog tests.
"""

from __future__ import annotations

import re

import pytest

from flash_attention.configs import BwdConfig, KernelConfig, wgmma_config
from flash_attention.jit import compiler, sources
from flash_attention.ops.select import catalog

# Written only against the interface: the window's rule spelled out per element, no fa/mask.cuh helper.
SAMPLE_POLICIES = r"""
namespace sample {

// Query row i sees keys [i + shift - kWindow + 1, i + shift] within [0, seqlen_k): a causal sliding window.
struct Window {
  static constexpr bool kLowerBound = true;
  static constexpr bool kRowDependent = true;
  static constexpr int kWindow = 256;
  int seqlen_k, shift;

  template <class Params>
  __device__ __forceinline__ Window(const Params& p, int, int)
      : seqlen_k(p.seqlen_k), shift(p.seqlen_k - p.seqlen_q) {}
  __device__ __forceinline__ int lo(int q) const { return max(0, q + shift - kWindow + 1); }
  __device__ __forceinline__ int hi(int q) const { return min(seqlen_k, max(0, q + shift + 1)); }
  __device__ __forceinline__ int key_end() const { return seqlen_k; }

  template <int BC>
  __device__ __forceinline__ fa::KVBlocks<true> kv_blocks(int q_start, int q_rows) const {
    fa::KVBlocks<true> b;
    b.begin = lo(q_start) / BC;
    b.end = (hi(q_start + q_rows - 1) + BC - 1) / BC;
    return b;
  }
  template <int BR, int BC, class Params>
  __device__ __forceinline__ fa::QBlocks<true> q_blocks(const Params& p, int kv_start) const {
    const int first = max(0, kv_start - shift);
    const int last = min(p.seqlen_q - 1, kv_start + BC - 1 - shift + kWindow - 1);
    fa::QBlocks<true> b;
    b.begin = first / BR;
    b.count = last < first ? 0 : last / BR + 1 - b.begin;
    return b;
  }
  template <class Acc>
  __device__ __forceinline__ void mask_query_rows(const Acc& s, int q_row0, int kv_start, int g,
                                                  int t) const {
    for (int mt = 0; mt < Acc::kMT; ++mt)
      for (int n = 0; n < Acc::kN; ++n)
        for (int e = 0; e < 4; ++e) {
          const int q = q_row0 + 16 * mt + g + 8 * (e >> 1), k = kv_start + 8 * n + 2 * t + (e & 1);
          if (k < lo(q) || k >= hi(q)) s(mt, n, e) = fa::neg_inf();
        }
  }
  template <class Acc>
  __device__ __forceinline__ void mask_key_rows(const Acc& s, int kv_start, int warp_row0, int q_start, int g,
                                                int t) const {
    for (int mt = 0; mt < Acc::kMT; ++mt)
      for (int n = 0; n < Acc::kN; ++n)
        for (int e = 0; e < 4; ++e) {
          const int k = kv_start + warp_row0 + 16 * mt + g + 8 * (e >> 1);
          const int q = q_start + 8 * n + 2 * t + (e & 1);
          if (k < lo(q) || k >= hi(q)) s(mt, n, e) = fa::neg_inf();
        }
  }
};

// Gemma-style softcapping of the scaled scores, and its folded form for the forwards whose softmax keeps the
// scale out of the scores (mod(scale s) = scale folded(s); no distance needed).
struct Softcap {
  static constexpr bool kIdentity = false;
  float cap, scale;
  template <class Params>
  __device__ __forceinline__ Softcap(const Params& p, int, int) : cap(30.f), scale(p.scale) {}
  __device__ __forceinline__ float operator()(float s, int, int) const { return cap * tanhf(s / cap); }
  __device__ __forceinline__ float folded(float s, float) const {
    return cap * tanhf(s * scale / cap) / scale;
  }
  __device__ __forceinline__ int diagonal(int q) const { return q; }
};

}  // namespace sample
"""

FWD_VARIANT = "fa::Variant<sample::Window, sample::Softcap>"
BWD_VARIANT = "fa::Variant<sample::Window, fa::NoScoreMod>"


def _kind() -> str:
    kind = "nvrtc" if compiler.load_nvrtc() is not None else "nvcc" if compiler.find_nvcc() else None
    if kind is None:
        pytest.skip("needs NVRTC (pip: nvidia-cuda-nvrtc) or nvcc")
    return kind


def _with_variant(source: str, variant: str) -> str:
    """The generated unit with every instantiation's variant replaced by `variant` and the sample policies
    defined after the kernel header."""
    defaults = [sources.variant_type(c, r) for c in (False, True) for r in (False, True)]
    assert any(d in source for d in defaults), "the generated unit names no variant"
    for d in defaults:
        source = source.replace(d, variant)
    header = re.search(r'#include "[^"]+kernel\.cuh"\n', source)
    return source[: header.end()] + SAMPLE_POLICIES + source[header.end() :]


def _first(arch: str, kind: type, **attrs):
    for job in catalog(arch, dtypes=("bf16",), head_dims=(128,)):
        if isinstance(job.cfg, kind) and all(getattr(job.cfg, k) == v for k, v in attrs.items()):
            return job.cfg
    raise AssertionError(f"no {kind.__name__} {attrs} in the {arch} catalog")


FAMILIES = {
    "sm80 forward": lambda: (_first("sm_80", KernelConfig), "sm_80"),
    "sm80 backward": lambda: (_first("sm_80", BwdConfig), "sm_80"),
    "sm90 forward": lambda: (wgmma_config("bf16", 128, 128, 128, 2), "sm_90"),
    "sm90 warp-specialized forward": lambda: (_first("sm_90", KernelConfig, warp_specialized=True), "sm_90"),
    "sm90 backward": lambda: (_first("sm_90", BwdConfig, wgmma=True), "sm_90"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_kernel_family_takes_a_new_variant(family):
    kind = _kind()
    cfg, arch = FAMILIES[family]()
    backward = isinstance(cfg, BwdConfig)
    source = _with_variant(sources.kernel_source(cfg), BWD_VARIANT if backward else FWD_VARIANT)
    result = compiler.compile_source(source, arch + ("a" if arch == "sm_90" else ""), "variant_sample", kind)
    names = {r.kernel for r in result.resources}
    expected = {sources.kernel_symbol(cfg, c) for c in (False, True)} if not backward else set()
    assert expected <= names, (expected, names)
    assert result.cubin


def test_backward_refuses_a_score_function_it_cannot_differentiate():
    kind = _kind()
    cfg = _first("sm_80", BwdConfig)
    source = _with_variant(sources.kernel_source(cfg), FWD_VARIANT)
    with pytest.raises(compiler.CompileError, match="does not differentiate a score function"):
        compiler.compile_source(source, "sm_80", "variant_sample_bwd", kind)
