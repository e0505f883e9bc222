"""GPU tests of the Hopper (wgmma) forward kernel: every candidate the autotuner may pick on sm_90, and the
defaults through the public API with key ranges and dropout, against the float64 reference under the
accuracy rule (tests/test_gpu_forward.py's check_case: fresh inputs, NaN-poisoned output)."""

from __future__ import annotations

import pytest
import torch
from test_gpu_forward import check_case

import flash_attention as fa
from flash_attention import ops
from flash_attention.configs import default_config, wgmma_config
from flash_attention.fallback.reference import attention_reference
from flash_attention.tools.autotune.space import search_space

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the wgmma kernel needs an sm_90 GPU")

# Every wgmma config in the sm_90 tuning space at head_dim 64/128/256 (bf16; fp16 for a sample).
_SPACE = sorted(
    {c.name() for d in (64, 128, 192, 256) for c in search_space("bf16", d, False, "sm_90") if c.wgmma}
)
_SHAPES = [
    (2, 200, 200, 4, 2, False),
    (1, 333, 517, 4, 1, True),
    (2, 517, 129, 2, 2, True),
    (1, 1, 300, 2, 2, True),
]


@needs_hopper
@pytest.mark.parametrize("name", _SPACE)
def test_every_wgmma_candidate(name):
    from flash_attention.configs import parse_config

    cfg = parse_config(name)
    for i, (b, sq, sk, hq, hkv, causal) in enumerate(_SHAPES):
        for d in sorted({cfg.head_dim, cfg.head_dim - 24}):
            check_case(
                b, sq, sk, hq, hkv, d, cfg.dtype, causal, "bhsd" if i == 1 else "bshd", cfg, seed=i + d
            )


@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("n", [100, 4097])
def test_fp16_defaults(d, n):
    cfg = default_config("fp16", d, True, n, n, "sm_90")
    assert cfg.wgmma
    check_case(1, n, n, 4, 2, d, "fp16", True, "padded", cfg, seed=n + d)
    check_case(1, n, n + 33, 2, 2, d - 8, "fp16", False, "bshd", cfg, seed=n + d + 1)


@needs_hopper
def test_attention_picks_wgmma_on_hopper():
    q = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    cfg = ops.chosen_config(q, q, causal=True, softmax_scale=128**-0.5)
    assert cfg.wgmma
    # A negative scale needs the unfolded softmax, which only the sm80 kernel has.
    assert not ops.chosen_config(q, q, causal=True, softmax_scale=-0.1).wgmma


@needs_hopper
def test_wgmma_negative_scale_and_key_range():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(3, 260, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    o = fa.attention(q, k, v, causal=True, softmax_scale=-0.1)
    ref, _ = attention_reference(q, k, v, causal=True, softmax_scale=-0.1)
    assert (o.double() - ref).abs().max().item() < 0.02
    kr = torch.tensor([[5, 250], [0, 0], [100, 260]], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    o, lse = fa.attention(q, k, v, causal=True, key_range=kr, return_lse=True, out=out)
    ref, ref_lse = attention_reference(q, k, v, causal=True, key_range=kr)
    assert not torch.isnan(o).any()
    assert (o.double() - ref).abs().max().item() < 0.02
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 2e-3
    assert torch.isneginf(lse[~fin]).all()


@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 256])
def test_wgmma_dropout_matches_reference_mask(d):
    from test_gpu_dropout import _explicit

    from flash_attention.dropout import draw_seed, keep_mask

    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(2, 200, 2, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    p, seed = 0.3, 4321
    cfg = wgmma_config("bf16", d, 64, 64 if d == 256 else 128)
    o, _ = ops.cuda_forward(
        q,
        k,
        v,
        causal=True,
        softmax_scale=d**-0.5,
        return_lse=True,
        out=None,
        config=cfg,
        dropout_p=p,
        dropout_seed=draw_seed(seed),
    )
    keep = keep_mask(seed, 0, p, 2, 2, 200, 200, device="cuda")
    ref = _explicit(q.double(), k.double(), v.double(), True, keep, p)
    assert (o.double() - ref).abs().max().item() < 0.03


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_backward_against_float64_and_sm80(d, causal):
    from flash_attention.configs import default_bwd_config

    assert default_bwd_config("bf16", d, "sm_90").wgmma
    gen = torch.Generator(device="cuda").manual_seed(d + causal)
    q = torch.randn(2, 333, 6, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 517, 2, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=None)
    got = ops.cuda_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5)
    portable = ops.cuda_backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5, config=default_bwd_config("bf16", d)
    )
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_o, _ = attention_reference(*leaves, causal=causal)
    ref = torch.autograd.grad(ref_o, leaves, do.double())
    for name, a, b, r in zip(("dq", "dk", "dv"), got, portable, ref, strict=True):
        assert not torch.isnan(a).any(), name
        err, err_sm80 = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 1.5 * err_sm80 + 1e-4, f"{name}: {err:.3g} vs the sm80 kernel's {err_sm80:.3g}"


@needs_hopper
def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = ops.cuda_forward(q, k, v, causal=True, softmax_scale=128**-0.5, return_lse=True, out=None)
    runs = [
        ops.cuda_backward(do, q, k, v, o, lse, causal=True, softmax_scale=128**-0.5, deterministic=True)
        for _ in range(3)
    ]
    for r in runs[1:]:
        for a, b in zip(runs[0], r, strict=True):
            assert torch.equal(a, b)
