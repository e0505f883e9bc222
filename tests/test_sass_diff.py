"""tools/sass_diff.py's parts that need no compiler: which builds a dump compiles."""

from __future__ import annotations

from repo_tools import load_tool

from flash_attention.configs import BwdConfig, KernelConfig, parse_bwd_config, parse_config
from flash_attention.configs.families import supports
from flash_attention.jit.sources import SCORE_MODS, SEGMENTS, kernel_source
from flash_attention.ops.select import catalog

sass_diff = load_tool("sass_diff")

WS = "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+tma_store+tile_overlap+stages_2"


def test_variant_builds_of_the_warp_specialized_forward_are_every_build_a_call_can_ask_for():
    cfg = parse_config(WS)
    builds = sass_diff.variant_builds(cfg)
    keys = [tuple(sorted(b.items())) for b in builds]
    assert len(keys) == len(set(keys))
    # Four dense masks (plain, key ranges, window, window with key ranges) with no score function or one of
    # three, and segments with none or any of SCORE_MODS; each with and without dropout; and the debug build.
    assert len(builds) == (4 * 4 + 1 + len(SCORE_MODS)) * 2 + 1
    assert dict(trace=True, ranged=False, dropout=False, window=False, score=None) in builds
    assert not any(b["window"] == SEGMENTS and b["ranged"] for b in builds)  # (the runs carry key ranges)
    assert {b["score"] for b in builds if b["window"] != SEGMENTS} == {
        None,
        "softcap",
        "alibi",
        "softcap_alibi",
    }
    for b in builds:
        kernel_source(cfg, **b)  # each is a translation unit the JIT writes


def test_variant_builds_follow_the_family_table():
    sm90_bwd = next(j.cfg for j in catalog("sm_90") if isinstance(j.cfg, BwdConfig) and j.cfg.wgmma)
    if not supports(sm90_bwd, "window"):  # the plain sm90 backward: its one build
        assert sass_diff.variant_builds(sm90_bwd) == [
            dict(trace=False, ranged=False, dropout=False, window=False, score=None)
        ]
    portable = next(j.cfg for j in catalog("sm_80") if isinstance(j.cfg, KernelConfig))
    assert any(b["trace"] for b in sass_diff.variant_builds(portable))


def test_the_fwd_ws_family_keeps_the_warp_specialized_forward_and_the_named_configs():
    extra = "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+pingpong+tma_store+stages_2"
    jobs = sass_diff._jobs(["sm_90"], "fwd_ws", False, True, (extra,))
    cfgs = {cfg for cfg, _, _ in jobs}
    assert cfgs and all(isinstance(c, KernelConfig) and c.warp_specialized for c in cfgs)
    assert parse_config(extra) in cfgs
    assert len(jobs) == len(set(jobs))
    per_config = len(sass_diff.variant_builds(parse_config(extra)))
    assert sum(1 for cfg, _, _ in jobs if cfg == parse_config(extra)) == per_config


def test_the_bwd_ws_family_keeps_the_warp_specialized_backwards_and_named_backward_configs():
    """--family bwd_ws: the catalog's bwd_ws and bwd_wide_ws configs in every build, and a backward config
    named on the command line (one no default call picks: the cp.async producer at head_dim 128)."""
    extra = "bwd_bf16_d128_q64_kv128_w12_s1_buffer_wgmma_ws"
    jobs = sass_diff._jobs(["sm_90"], "bwd_ws", False, True, (extra,))
    cfgs = {cfg for cfg, _, _ in jobs}
    assert all(isinstance(c, BwdConfig) and c.warp_specialized for c in cfgs)
    assert parse_bwd_config(extra) in cfgs
    assert any(c.wide_ws and c.head_dim == 192 for c in cfgs) and any(c.head_dim == 64 for c in cfgs)
    assert len(jobs) == len(set(jobs))
