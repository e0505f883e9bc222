"""GPU tests of the forward kernels against the float64 reference (marked gpu; need sm_80+).

Accuracy rule (DESIGN.md): the kernel's max error against float64 must be at most 2x the error PyTorch's own
attention makes on the same low-precision inputs, plus 1e-5; never NaN; every output element written (the
output buffer is NaN-poisoned first). Inputs are fresh random draws for every case.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import flash_attention as fa
from flash_attention.configs import parse_config
from flash_attention.fallback.reference import attention_reference, causal_allowed

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(b, sq, sk, hq, hkv, d, dtype, layout, gen):
    def make(s, h):
        if layout == "bhsd":
            # (batch, heads, seqlen, dim) storage viewed as (batch, seqlen, heads, dim): no copy.
            return torch.randn(b, h, s, d, generator=gen, device="cuda").to(dtype).transpose(1, 2)
        if layout == "padded":
            # Rows further apart than heads * dim (as a slice of a fused QKV projection would be).
            return torch.randn(b, s, h, d + 8, generator=gen, device="cuda").to(dtype)[..., :d]
        return torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype)

    return make(sq, hq), make(sk, hkv), make(sk, hkv)


def _sdpa_error(q, k, v, causal, scale, ref_o, has_key):
    """Max error of PyTorch's own attention in the same precision, over rows that have a key."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    mask = causal_allowed(q.shape[1], k.shape[1], device=q.device) if causal else None
    if causal and q.shape[1] == k.shape[1]:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    diff = (o.transpose(1, 2).double() - ref_o).abs()
    return diff[:, has_key].max().item() if has_key.any() else 0.0


def check_case(b, sq, sk, hq, hkv, d, dtype, causal, layout="bshd", config=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, DTYPES[dtype], layout, gen)
    scale = 1.0 / math.sqrt(d)
    # NaN-poisoned output: an element the kernel fails to write stays NaN and fails the check below.
    out = torch.full_like(q, float("nan"))
    if config is None:
        o, lse = fa.attention(q, k, v, causal=causal, return_lse=True, out=out)
    else:
        o, lse = fa.forward(config, q, k, v, causal=causal, return_lse=True, out=out)
    assert o is out
    torch.cuda.synchronize()
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert not torch.isnan(o).any(), "NaN in output (unwritten element or bad masking)"
    rows = torch.arange(sq, device="cuda")
    has_key = (rows + (sk - sq) >= 0) if causal else torch.full((sq,), sk > 0, device="cuda")
    err = (o.double() - ref_o).abs().max().item()
    bound = 2 * _sdpa_error(q, k, v, causal, scale, ref_o, has_key) + 1e-5
    case = f"b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} {dtype} causal={causal} {layout} cfg={config}"
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} for {case}"
    # Rows with no key: output exactly 0 and LSE -inf.
    if not has_key.all():
        assert (o[:, ~has_key] == 0).all(), case
        assert torch.isneginf(lse[:, :, ~has_key]).all(), case
    # LSE in fp32 of exactly-computed scores: tight against float64.
    lse_err = (
        (lse[:, :, has_key].double() - ref_lse[:, :, has_key]).abs().max().item() if has_key.any() else 0
    )
    assert lse_err < 2e-3, f"lse error {lse_err:.3g} for {case}"


# A few hundred random cases over the axes, drawn once with a fixed seed so failures reproduce.
_rng = random.Random(1234)
_LENS = [1, 7, 63, 65, 127, 1000, 4097]
_CASES = []
for _i in range(240):
    dtype = _rng.choice(["bf16", "fp16"])
    d = _rng.choice([32, 64, 96, 128, 160, 256, 8, 40, 200])
    sq = _rng.choice(_LENS)
    sk = sq if _rng.random() < 0.4 else _rng.choice(_LENS)
    if sq * sk > 1000 * 4097:
        sk = _rng.choice([1, 7, 63, 65, 127])
    hkv = _rng.choice([1, 2, 3])
    ratio = _rng.choice([1, 2, 4])
    b = _rng.choice([1, 2])
    causal = _rng.random() < 0.5
    layout = _rng.choice(["bshd", "bshd", "bhsd", "padded"])
    _CASES.append((b, sq, sk, hkv * ratio, hkv, d, dtype, causal, layout, _i))


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c)))
def test_random_cases_default_config(case):
    b, sq, sk, hq, hkv, d, dtype, causal, layout, seed = case
    check_case(b, sq, sk, hq, hkv, d, dtype, causal, layout, seed=seed)


@pytest.mark.parametrize("d", [1, 2, 3, 5, 12, 36, 100, 129, 200, 250, 255])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_head_dims_that_are_not_a_multiple_of_8(d, dtype):
    # Zero-padded to the next multiple of 8 inside the op; the NaN-poisoned out= must come back whole.
    check_case(2, 133, 97, 4, 2, d, dtype, True, "bshd", seed=d)
    check_case(1, 65, 300, 3, 3, d, dtype, False, "bhsd", seed=d + 1)


# Every knob of the kernel family, each switched away from the default at least once.
_VARIANTS = [
    "(BF16, 128, 64, 64, 4): sync+load_0_0_0_tiles",
    "(BF16, 128, 64, 64, 4): sync+swizzled+load_0_0_0_tiles",
    "(BF16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles",
    "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_0_0_tiles",
    "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer",
    "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax",
    "(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse",
    "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_1_tiles+buffer+opt_softmax",
    "(BF16, 128, 128, 32, 4): async+eager+swizzled+load_1_1_1_tiles+buffer+opt_softmax",
    "(FP16, 64, 128, 64, 4): async+eager+swizzled+load_0_0_1_tiles+buffer+opt_softmax",
    "(BF16, 64, 64, 128, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax+reverse",
    "(BF16, 256, 128, 64, 8): async+eager+swizzled+load_2_2_1_tiles+buffer+opt_softmax",
    "(FP16, 256, 64, 32, 4): async+eager+load_1_1_1_tiles+buffer",
    "(BF16, 192, 64, 64, 4): async+eager+swizzled+load_2_2_1_tiles+buffer+opt_softmax",
    "(BF16, 128, 32, 16, 2): async+eager+swizzled+load_1_1_1_tiles",
    "(BF16, 64, 16, 256, 1): async+eager+swizzled+load_0_1_2_tiles+buffer+opt_softmax",
]


@pytest.mark.parametrize("name", _VARIANTS)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 200, 200, 4, 2, False),
        (1, 333, 517, 4, 1, True),
        (2, 517, 129, 2, 2, True),
        (1, 65, 65, 2, 1, True),
    ],
)
def test_config_variants(name, shape):
    cfg = parse_config(name)
    b, sq, sk, hq, hkv, causal = shape
    for d in sorted({cfg.head_dim, cfg.head_dim - 24}):
        check_case(b, sq, sk, hq, hkv, d, cfg.dtype, causal, config=cfg, seed=sq + sk + d)


def test_every_output_element_written_large():
    check_case(1, 4097, 4097, 16, 4, 128, "bf16", True, seed=7)
    check_case(2, 1000, 3000, 8, 8, 64, "fp16", False, seed=8)


def test_softmax_scale_and_negative_scale():
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = _inputs(2, 300, 300, 4, 4, 64, torch.bfloat16, "bshd", gen)
    for scale in (0.05, 1.0, -0.2):
        o = fa.attention(q, k, v, causal=True, softmax_scale=scale)
        ref, _ = attention_reference(q, k, v, causal=True, softmax_scale=scale)
        assert (o.double() - ref).abs().max().item() < 0.02


def test_matches_sdpa_flash_on_benchmark_shape():
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _inputs(2, 2048, 2048, 16, 16, 128, torch.bfloat16, "bshd", gen)
    for causal in (False, True):
        o = fa.attention(q, k, v, causal=causal)
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
        assert (o - ref.transpose(1, 2)).abs().max().item() < 2e-2


def test_cuda_path_is_taken_and_cached_kernel_loads_fast():
    import time

    from flash_attention import ops
    from flash_attention.jit import loader

    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert ops.cuda_unavailable_reason(q) is None
    loader._loaded.clear()
    fa.attention(q, q, q)
    # The forward loaded one module (this GPU's default config, both mask entry points); forget it and
    # load its non-causal entry point again: the cubin comes from the disk cache, with no compile.
    loaded = [(cfg, arch) for cfg, causal, arch, variant in loader._loaded if not causal and variant == ""]
    assert len(loaded) == 1, loader._loaded.keys()
    cfg, arch = loaded[0]
    loader._loaded.clear()
    t0 = time.perf_counter()
    loader.get_kernel(cfg, False, arch)
    assert time.perf_counter() - t0 < 1.0


def test_fp32_on_cuda_falls_back_with_warning(monkeypatch):
    from flash_attention.ops import dispatch

    # The warning is once per reason per process: another test in this worker may have given it already.
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    q = torch.randn(1, 32, 2, 64, device="cuda")
    with pytest.warns(RuntimeWarning):
        o = fa.attention(q, q, q)
    ref, _ = attention_reference(q, q, q)
    assert (o.double() - ref).abs().max().item() < 1e-4


def test_config_too_large_for_this_gpu_is_a_clear_error(monkeypatch):
    from flash_attention.ops import forward as launch
    from flash_attention.ops import plans

    q = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    cfg = fa.default_config("bf16", 128, False, 64, 64)
    monkeypatch.setattr(plans, "smem_limit", lambda index: cfg.smem_bytes - 1)
    launch.clear_plans()
    with pytest.raises(ValueError, match="shared memory"):
        fa.forward(cfg, q, q, q)
    launch.clear_plans()


def test_a_gpu_too_small_for_every_kernel_falls_back_with_a_warning(monkeypatch):
    # What a GPU whose shared memory fits none of our configs sees (head_dim 256 training on sm_86/sm_89 is
    # the real case, backward): the PyTorch fallback computes the call, after a once-per-reason warning.
    from flash_attention.ops import dispatch, plans
    from flash_attention.ops import forward as launch

    # Both launches read the device's shared memory through plans.device_facts.
    monkeypatch.setattr(plans, "smem_limit", lambda index: 1024)
    monkeypatch.setattr(dispatch, "_warned_reasons", set())
    launch.clear_plans()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 77, 4, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="PyTorch fallback.*shared memory"):
        out = fa.attention(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (out.double() - ref).abs().max().item() < 0.02
    launch.clear_plans()


def test_config_for_another_dtype_or_smaller_head_dim_is_rejected():
    q = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="is for bf16"):
        fa.forward(fa.default_config("bf16", 128, False, 64, 64), q, q, q)
    with pytest.raises(ValueError, match="head_dim <= 64"):
        fa.forward(fa.default_config("fp16", 64, False, 64, 64), q, q, q)


def test_forward_timed_returns_the_output_and_a_time():
    q, k, v = _inputs(
        2, 1024, 1024, 8, 8, 128, torch.bfloat16, "bshd", torch.Generator(device="cuda").manual_seed(5)
    )
    cfg = fa.default_config("bf16", 128, True, 1024, 1024)
    o, ms = fa.forward_timed(cfg, q, k, v, causal=True)
    assert 0 < ms < 1000
    ref, _ = attention_reference(q, k, v, causal=True)
    assert (o.double() - ref).abs().max().item() < 2e-2
