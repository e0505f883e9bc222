"""The sliding window's host side (no GPU): the argument's checks and its bounds for the kernels
(ops.plans.window_bounds), and the window build's translation units (one entry point per kernel, the
WindowMask variant, its own cache key)."""

from __future__ import annotations

import pytest

from flash_attention.configs import default_bwd_config, hopper_bwd_config, portable_config
from flash_attention.jit import cache, sources
from flash_attention.ops.plans import window_bounds


def test_window_bounds_fold_causal_and_unbounded_sides():
    far = 300 + 500
    assert window_bounds(None, False, 300, 500) is None
    assert window_bounds((10, 20), False, 300, 500) == (10, 20)
    assert window_bounds((10, -1), False, 300, 500) == (10, far)
    assert window_bounds((-1, 7), False, 300, 500) == (far, 7)
    assert window_bounds([3, 4], False, 300, 500) == (3, 4)
    # Causal is the window's right bound 0.
    assert window_bounds((10, 20), True, 300, 500) == (10, 0)
    assert window_bounds((10, -1), True, 300, 500) == (10, 0)
    # Sides past every row are clamped, so the kernels' sums stay in int range.
    assert window_bounds((2**40, 3), False, 300, 500) == (far, 3)
    # A window that bounds nothing beyond causal runs the plain or causal build.
    assert window_bounds((-1, -1), False, 300, 500) is None
    assert window_bounds((-1, 0), True, 300, 500) is None
    assert window_bounds((-1, 9), True, 300, 500) is None
    assert window_bounds((far, far), False, 300, 500) is None


def test_an_unbounded_window_is_no_window_in_the_spec():
    # (-1, -1) bounds nothing: the checked argument is None, so the call's spec (and its plans) is the one
    # of a call without a window, and the result is the same bits.
    import torch

    import flash_attention as fa
    from flash_attention.spec.validate import check_window

    assert check_window((-1, -1)) is None and check_window([-1, -1]) is None
    assert check_window((-1, 0)) == (-1, 0) and check_window((5, -1)) == (5, -1)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 37, 4, 32, generator=gen) for _ in range(3))
    for causal in (False, True):
        want = fa.attention(q, k, v, causal=causal)
        assert torch.equal(fa.attention(q, k, v, causal=causal, window=(-1, -1)), want)


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), "ab", 5, (1.0, 2), (True, 2)])
def test_window_must_be_a_pair_of_ints(bad):
    with pytest.raises(TypeError, match="window must be a"):
        window_bounds(bad, False, 10, 10)


def test_window_sides_below_minus_one_are_refused():
    with pytest.raises(ValueError, match="window sides must be >= 0, or -1"):
        window_bounds((-2, 3), False, 10, 10)


@pytest.mark.parametrize(
    "cfg",
    [
        portable_config("bf16", 128, True, 4096, 4096),
        default_bwd_config("bf16", 128, "sm_80", portable=True),
        hopper_bwd_config("bf16", 128),
        hopper_bwd_config("bf16", 256),
    ],
    ids=lambda c: c.name(),
)
def test_window_build_has_one_entry_per_kernel_on_the_window_mask(cfg):
    src = sources.kernel_source(cfg, window=True)
    assert "fa::WindowVariant<false>" in src and "DefaultVariant" not in src
    assert "__causal" not in src and "__window" in src
    ranged = sources.kernel_source(cfg, window=True, ranged=True)
    assert "fa::WindowVariant<true>" in ranged and "__window__ranged" in ranged
    # Its own cache entry.
    keys = {cache.cache_key(cfg, "sm_90", "x", window=w) for w in (False, True)}
    assert len(keys) == 2


def test_the_debug_build_has_no_window():
    with pytest.raises(ValueError, match="no key-range, dropout, window or score-function variant"):
        sources.variant_name(True, False, False, True)


@pytest.mark.parametrize(
    "causal,window,ranged",
    [(False, (5, 3), False), (True, (7, -1), False), (False, (-1, 2), True), (True, (0, 0), True)],
)
def test_attention_window_on_the_fallback_matches_the_reference(causal, window, ranged):
    """attention(window=) off the kernels (CPU, float64): output, LSE and gradients as the float64
    reference computes them under the same mask."""
    import torch

    import flash_attention as fa
    from flash_attention.fallback.reference import attention_reference

    gen = torch.Generator().manual_seed(hash((causal, window, ranged)) % 2**31)
    q = torch.randn(2, 37, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 45, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 45, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    kr = torch.tensor([[3, 40], [0, 0]]) if ranged else None
    out, lse = fa.attention(q, k, v, causal=causal, window=window, key_range=kr, return_lse=True)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window=window, key_range=kr)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse.float().double())
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    # Inference calls take the same path.
    with torch.no_grad():
        torch.testing.assert_close(fa.attention(q, k, v, causal=causal, window=window, key_range=kr), ref)


@pytest.mark.parametrize(
    "bad,err,match",
    [((1,), TypeError, "window must be a"), ((-3, 2), ValueError, "window sides must be >= 0, or -1")],
)
def test_attention_names_a_bad_window(bad, err, match):
    import torch

    import flash_attention as fa

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(err, match=match):
        fa.attention(q, q, q, window=bad)


def test_flash_attention_layer_takes_a_window():
    """nn.FlashAttention(window=): the same output as the weights route under the same mask (CPU), padded
    batches included; a bad window is named."""
    import torch

    from flash_attention.nn import FlashAttention

    torch.manual_seed(0)
    layer = FlashAttention(32, 4, num_kv_heads=2, causal=True, window=(5, 0), dtype=torch.float64)
    assert "window=(5, 0)" in repr(layer)
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    pad = torch.zeros(2, 19, dtype=torch.bool)
    pad[1, :4] = True
    for mask in (None, pad):
        out, _ = layer(x, x, x, key_padding_mask=mask)
        ref, weights = layer(x, x, x, key_padding_mask=mask, need_weights=True)
        torch.testing.assert_close(out, ref)
        # Each query attends at most itself and the 5 keys before it.
        assert (weights > 0).sum(-1).max() <= 6 and weights[..., 0, 1:].abs().max() == 0
    with pytest.raises(ValueError, match="window sides"):
        FlashAttention(32, 4, window=(-4, 0))
