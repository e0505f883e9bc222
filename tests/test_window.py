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
    with pytest.raises(ValueError, match="no key-range, dropout or window variant"):
        sources.variant_name(True, False, False, True)
