"""The backward kernel family without a GPU: config names, validity rules, and the resource report of every
backward translation unit a model can need (compiled once per session by the catalog build)."""

from __future__ import annotations

import itertools

import pytest

from flash_attention.configs import (
    HEAD_DIMS,
    BwdConfig,
    bwd_validity_errors,
    default_bwd_config,
    hopper_bwd_config,
    parse_bwd_config,
)
from flash_attention.jit import cache, compiler, sources
from flash_attention.jit.params import BwdParams
from flash_attention.tools.build import spill_bound


def test_names_parse_back_over_the_space():
    n = 0
    for dt, d, bq, bkv, w, s, buf in itertools.product(
        ("fp16", "bf16"), HEAD_DIMS, (64, 128), (32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (False, True)
    ):
        try:
            cfg = BwdConfig(dt, d, bq, bkv, w, s, buf)
        except ValueError:
            continue
        n += 1
        assert parse_bwd_config(cfg.name()) == cfg
        assert cfg.symbol("dkdv", True, True).endswith("__dkdv__causal__ranged")
    assert n > 50


def test_validity_rules_name_the_problem():
    assert bwd_validity_errors(default_bwd_config("fp16", 256)) == []
    with pytest.raises(ValueError, match="block_q must be 64 or 128"):
        BwdConfig("bf16", 128, 32, 64, 4)
    with pytest.raises(ValueError, match="head_dim / split"):
        BwdConfig("bf16", 192, 64, 64, 4, split=2)
    with pytest.raises(ValueError, match="block_kv must be a multiple of 16"):
        BwdConfig("bf16", 64, 64, 32, 4)
    with pytest.raises(ValueError, match="dQ columns"):
        BwdConfig("bf16", 64, 64, 128, 8)  # 4 row groups x 2 column groups of 32: not whole swizzle groups
    with pytest.raises(ValueError, match="not a backward config name"):
        parse_bwd_config("bwd_bf16_d64")


@pytest.mark.parametrize("d", [40, 64, 96, 128, 160, 192, 256])
def test_default_config_covers_every_head_dim(d):
    cfg = default_bwd_config("bf16", d)
    assert cfg.head_dim >= d and cfg.smem_bytes <= 163 * 1024 and cfg.dq_smem_bytes <= 163 * 1024


def test_translation_unit_pins_the_params_layout_and_every_entry():
    cfg = default_bwd_config("fp16", 128)
    src = sources.kernel_source(cfg)
    assert (
        "fa::BwdParams" in src and f"sizeof(fa::BwdParams) == {__import__('ctypes').sizeof(BwdParams)}" in src
    )
    for kind, causal in itertools.product(("dkdv", "dkdv_det", "dq"), (False, True)):
        assert cfg.symbol(kind, causal) + "(" in src
    ranged = sources.kernel_source(cfg, ranged=True)
    assert cfg.symbol("dq", True, True) + "(" in ranged and cfg.symbol("dq", True) + "(" not in ranged
    assert cache.cache_key(cfg, "sm_90", "x") != cache.cache_key(cfg, "sm_90", "x", ranged=True)


def _bwd_metas(metas):
    return [(parse_bwd_config(m["config"]), m) for m in metas if m["config"].startswith("bwd_")]


@pytest.mark.full_build
def test_every_backward_unit_of_the_catalog_compiles_with_its_entries(catalog_builds):
    _, metas = catalog_builds
    found = _bwd_metas(metas)
    assert {cfg.head_dim for cfg, _ in found} == set(HEAD_DIMS)
    for cfg, m in found:
        ranged, dropout = m["ranged"], m["dropout"]
        res = {r["kernel"]: r for r in m["resources"]}
        expected = {cfg.symbol(kind) for kind in cfg.MASK_FREE_KINDS} | {
            cfg.symbol(k, c, ranged, dropout) for k, c in itertools.product(cfg.entry_kinds(), (False, True))
        }
        assert set(res) == expected, m["config"]
        for name, r in res.items():
            assert 0 < r["registers"] <= 255
            bound = spill_bound(cfg, name)
            assert r["spill_stores"] <= bound, f"{name} spills {r['spill_stores']} bytes"


def test_exp_poly_is_bwd_ws_eighths_off_by_default():
    """BwdConfig.exp_poly (kernel log 138): eighths of P's exponentials on the FMA pipe, bwd_ws only, off in
    every default; its name round-trips and the kernel reads it as Cfg::kExpPoly."""
    for d in (64, 128, 192, 256):
        assert default_bwd_config("bf16", d, "sm_90").exp_poly == 0
    cfg = hopper_bwd_config("fp16", 128).replace(exp_poly=4)
    assert cfg.name().endswith("_dqw_ep4") and parse_bwd_config(cfg.name()) == cfg
    assert "kExpPoly = 4;" in sources.kernel_source(cfg)
    assert "kExpPoly = 0;" in sources.kernel_source(hopper_bwd_config("fp16", 128))
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="eighths"):
            hopper_bwd_config("bf16", 64).replace(exp_poly=bad)
    for other in (hopper_bwd_config("bf16", 256), hopper_bwd_config("bf16", 128, warp_specialized=False)):
        with pytest.raises(ValueError, match="exp_poly is bwd_ws's"):
            other.replace(exp_poly=2)
    for d, ws in ((192, None), (256, True), (128, False)):  # asked of hopper_bwd_config: refused, not dropped
        with pytest.raises(ValueError, match="exp_poly is bwd_ws's"):
            hopper_bwd_config("bf16", d, warp_specialized=ws, exp_poly=4)
    with pytest.raises(ValueError, match="not a backward config name"):
        parse_bwd_config(hopper_bwd_config("bf16", 64).name() + "_ep9")


def _header_exp2_poly(degree: int):
    """fa/ptx.cuh's exp2_poly of the given degree, op for op in float32 (each fmaf's exact product summed in
    float64, then rounded to float32: a double rounding at worst, far inside the bound; the shifter's adds
    round to nearest), with the constants, the clamp's operand order and the shift read from the header."""
    import re
    from pathlib import Path

    import numpy as np

    text = (Path(sources.__file__).parents[1] / "csrc/include/fa/ptx.cuh").read_text()
    body = text[text.index("__device__ __forceinline__ float exp2_poly(") :]
    line = re.search(rf"kDegree == {degree}\) {{\s*p = (.*?);", body, re.S).group(1)
    coeffs = [float(c[:-1]) for c in re.findall(r"\d\.\d+f", line)]  # highest degree first
    assert len(coeffs) == degree, line
    shifter = float(re.search(r"kShifter = ([\d.]+)f", body).group(1))
    shift = int(re.search(r"__float_as_uint\(shifted\) << (\d+)\)", body).group(1))
    f32 = np.float32

    def poly(x):
        x = np.fmax(np.asarray(x, f32), f32(-127))  # (fmaxf: a NaN gives the other operand)
        shifted = (x + f32(shifter)).astype(f32)
        f = (x - (shifted - f32(shifter)).astype(f32)).astype(f32)
        p = f32(coeffs[0])
        for c in [*coeffs[1:], 1.0]:  # fmaf: the float32 operands' product exact in float64, one rounding
            p = (p.astype(np.float64) * f + np.float64(f32(c))).astype(f32)
        bits = p.view(np.int32).astype(np.int64) + (shifted.view(np.int32).astype(np.int64) << shift)
        return bits.astype(np.uint32).astype(np.int64).astype(np.uint32).view(np.float32)

    return poly


@pytest.mark.parametrize("degree, bound", [(3, 1.1e-4), (4, 3.2e-6)])
def test_exp2_poly_matches_2_to_the_x_within_its_stated_error(degree, bound):
    """The header's polynomial 2^x (bf16's degree 3, fp16's 4) against float64 over P's range, and -inf
    (masked scores, rows past the sequence) giving exactly +0: a wrong constant or shift fails here, on the
    CPU, before any GPU run."""
    import numpy as np

    poly = _header_exp2_poly(degree)
    rng = np.random.default_rng(138)
    # (up to 8.5: the forward's lazy reference lets P reach 2^8, kernel log 139)
    x = np.concatenate([rng.uniform(-126, 8.5, 400_000), np.linspace(-30, 0.5, 200_001)]).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(poly(x).astype(np.float64) - exact) / exact
    assert rel.max() <= bound, rel.max()
    assert rel.max() > bound / 3  # (the bound is the polynomial's own, not a loose one)
    assert np.all(poly(np.float32([-np.inf, -127.0, -1e30, np.nan])) == 0.0)
    assert poly(np.float32([0.0]))[0] == 1.0


def test_hopper_backward_configs():
    for d in (64, 128):
        cfg = default_bwd_config("bf16", d, "sm_90")
        # The warp-specialized kernel is the default (Q and dO by TMA, dQ's reductions from writer warps:
        # test_arch_defaults); its cp.async producer and the sm90 kernel it replaced stay selectable.
        assert cfg == hopper_bwd_config("bf16", d) and cfg.name().endswith("_wgmma_ws_tma_dqw")
        copying = hopper_bwd_config("bf16", d, tma_loads=False)
        assert copying.name().endswith("_wgmma_ws") and not copying.dq_writer
        src = sources.kernel_source(cfg)  # (every entry point asks for TMA and the writers; the kernel
        assert src.count(", true, true>(") == src.count("bwd_ws_dkdv_body<") == 4  # keeps them off in det)
        assert cfg.threads == 384
        old = hopper_bwd_config("bf16", d, warp_specialized=False)
        assert old.name().endswith("_wgmma") and old.threads == 256
        for c in (cfg, old):
            assert parse_bwd_config(c.name()) == c
            assert c.smem_bytes <= 227 * 1024
    # Head_dim 256: the warp-specialized wide kernel (a producer and two computing warpgroups on 64 keys),
    # its producer loading Q and dO by TMA; the cp.async producer stays selectable and takes the same memory.
    wide_ws = default_bwd_config("bf16", 256, "sm_90")
    assert wide_ws == hopper_bwd_config("bf16", 256) and wide_ws.wide_ws and wide_ws.threads == 384
    assert parse_bwd_config(wide_ws.name()) == wide_ws
    assert wide_ws.name().endswith("_w12_s1_buffer_wgmma_ws_tma")
    copying = hopper_bwd_config("bf16", 256, tma_loads=False)
    assert copying.name().endswith("_wgmma_ws") and copying.smem_bytes == wide_ws.smem_bytes
    # fa::sm90::BwdWideWsSmem: K, V, two Q and two dO slots, P and dS, statistics, barriers, alignment.
    assert (
        wide_ws.smem_bytes == 2 * 64 * 256 * 2 + 4 * 64 * 256 * 2 + 2 * 64 * 64 * 2 + 2 * 64 * 8 + 32 + 1024
    )
    assert wide_ws.entry_kinds() == ("dkdv",)
    src = sources.kernel_source(wide_ws)
    assert '#include "sm90/bwd_wide_ws/bwd_kernel.cuh"' in src and "__launch_bounds__(384, 1)" in src
    with pytest.raises(ValueError, match="warp-specialized wide backward"):
        BwdConfig("bf16", 160, 64, 64, 12, 1, True, wgmma=True, warp_specialized=True)
    # At head_dim 192 the same kernel (warpgroup 0 dV^T, warpgroup 1 dK^T, dQ's columns 128 / 64: kernel log
    # 136), the default there since it measured 0.73-0.81x the wide kernel's time; on 64-key blocks,
    ws192 = hopper_bwd_config("bf16", 192, warp_specialized=True, tma_loads=True).replace(block_kv=64)
    assert ws192.wide_ws and ws192.threads == 384 and parse_bwd_config(ws192.name()) == ws192
    assert ws192.smem_bytes == 2 * 64 * 192 * 2 + 4 * 64 * 192 * 2 + 2 * 64 * 64 * 2 + 2 * 64 * 8 + 32 + 1024
    # or 96 (the default since kernel log 140 measured 0.80-0.86x the 64-key blocks' time): P and dS in
    # whole 64-key panels.
    kv96 = ws192.replace(block_kv=96)
    assert default_bwd_config("bf16", 192, "sm_90") == kv96
    assert kv96.wide_ws and parse_bwd_config(kv96.name()) == kv96 and "_kv96_" in kv96.name()
    assert kv96.smem_bytes == 2 * 96 * 192 * 2 + 4 * 64 * 192 * 2 + 2 * 64 * 128 * 2 + 2 * 64 * 8 + 32 + 1024
    with pytest.raises(ValueError, match="or 96 at head_dim 192"):
        hopper_bwd_config("bf16", 256).replace(block_kv=96)
    with pytest.raises(ValueError, match="or 96 at head_dim 192"):
        ws192.replace(block_kv=128)
    # v's own head_dim (docs/value-head-dim-study.md section 7): V at 128 columns, the dO slots kept at 192.
    v128 = ws192.replace(head_dim_v=128)
    assert v128.value_dim == 128 and ws192.value_dim == 192 and v128.name().endswith("_tma_v128")
    assert parse_bwd_config(v128.name()) == v128
    assert (
        v128.smem_bytes
        == 64 * 192 * 2 + 64 * 128 * 2 + 4 * 64 * 192 * 2 + 2 * 64 * 64 * 2 + 2 * 64 * 8 + 32 + 1024
    )
    assert "kHeadDimV = 128" in sources.kernel_source(v128)
    assert "kHeadDimV" not in sources.kernel_source(ws192)  # (the others' Cfg structs as before)
    for bad in (
        lambda: ws192.replace(head_dim_v=96),
        lambda: hopper_bwd_config("bf16", 256).replace(head_dim_v=128),
        lambda: hopper_bwd_config("bf16", 192, warp_specialized=False).replace(head_dim_v=128),
        lambda: hopper_bwd_config("bf16", 128).replace(head_dim_v=64),
    ):
        with pytest.raises(
            ValueError, match="head_dim_v is the warp-specialized wide backward's at head_dim 192"
        ):
            bad()
    # The wide kernel (head_dim 192's and 256's dropout and deterministic calls, or warp_specialized=False):
    # both warpgroups on 64 keys, one keeping dV and the other dK.
    wide = hopper_bwd_config("bf16", 256, warp_specialized=False)
    assert wide.wide and not wide.warp_specialized and not wide.wide_ws
    assert (wide.block_q, wide.block_kv, wide.threads) == (64, 64, 256)
    assert parse_bwd_config(wide.name()) == wide and wide.smem_bytes <= 227 * 1024
    # fa::sm90::BwdWideSmem: K, V, two Q and two dO buffers, fp32 P^T, dS^T, statistics, alignment.
    assert wide.smem_bytes == 2 * 64 * 256 * 2 + 4 * 64 * 256 * 2 + 64 * 64 * 6 + 2 * 64 * 8 + 1024
    wide192 = hopper_bwd_config("bf16", 192, warp_specialized=False)
    assert wide192.wide and not wide192.wide_ws
    assert wide192.smem_bytes == 2 * 64 * 192 * 2 + 4 * 64 * 192 * 2 + 64 * 64 * 6 + 2 * 64 * 8 + 1024
    assert not default_bwd_config("bf16", 256, "sm_90", portable=True).wgmma
    src = sources.kernel_source(wide)
    assert '#include "sm90/bwd_wide/bwd_kernel.cuh"' in src and "fa::sm90::bwd_wide_dkdv_body" in src
    assert "__launch_bounds__(256, 1)" in src and "kWarpSpecialized = false" in src
    with pytest.raises(ValueError, match="wide wgmma backward configs"):
        BwdConfig("bf16", 256, 64, 128, 8, 1, True, wgmma=True)
    with pytest.raises(ValueError, match="wide wgmma backward configs"):
        BwdConfig("bf16", 192, 128, 64, 8, 1, True, wgmma=True)
    assert wide.symbol("dkdv", True, True) in sources.kernel_source(wide, ranged=True)  # it has key ranges
    with pytest.raises(ValueError, match="wgmma backward configs are two warpgroups"):
        BwdConfig("bf16", 64, 64, 128, 8, 1, True, wgmma=True)
    with pytest.raises(ValueError, match="a producer and two consumer"):
        BwdConfig("bf16", 64, 128, 128, 8, 1, True, wgmma=True, warp_specialized=True)
    with pytest.raises(ValueError, match="a producer and two consumer"):
        BwdConfig("bf16", 64, 128, 128, 12, 1, True, warp_specialized=True)
    with pytest.raises(ValueError, match="dQ's split"):
        BwdConfig("bf16", 128, 128, 128, 12, 1, True, wgmma=True, warp_specialized=True)
    src = sources.kernel_source(default_bwd_config("bf16", 128, "sm_90"))
    assert '#include "sm90/bwd_ws/bwd_kernel.cuh"' in src and "fa::sm90::bwd_ws_dkdv_body" in src
    # The atomic kernel (384 threads) and the deterministic one, whose dQ writers are a fourth warpgroup.
    assert "__launch_bounds__(384, 1)" in src and "__launch_bounds__(512, 1)" in src and "__dkdv_det" in src
    # Its dQ workspace is tiled (fa/dq_accum.cuh): the convert kernel of the same unit reads it so.
    assert "kWarpSpecialized = true" in src
    src = sources.kernel_source(hopper_bwd_config("bf16", 128, warp_specialized=False))
    assert '#include "sm90/bwd/bwd_kernel.cuh"' in src and "kWarpSpecialized = false" in src
    # The key-range and dropout builds exist for the warp-specialized kernel only.
    ws128 = default_bwd_config("bf16", 128, "sm_90")
    src = sources.kernel_source(ws128, ranged=True)
    assert (
        ws128.symbol("dkdv", True, True) in src
        and "fa::DefaultVariant<true, true>, false, false, true, true>" in src
    )
    src = sources.kernel_source(ws128, dropout=True)
    assert ws128.symbol("dkdv", True, False, True) in src
    assert "fa::DefaultVariant<true, false>, true, false, true, true>" in src
    for ranged, dropout in ((True, False), (False, True)):
        with pytest.raises(ValueError, match="no key-range, dropout or window build"):
            sources.kernel_source(
                hopper_bwd_config("bf16", 128, warp_specialized=False), ranged=ranged, dropout=dropout
            )
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        cache.build(default_bwd_config("bf16", 64, "sm_90"), "sm_80")


@pytest.mark.full_build
def test_hopper_backward_compiles_to_wgmma_without_serialising(catalog_builds):
    _, metas = catalog_builds
    hopper = [(cfg, m) for cfg, m in _bwd_metas(metas) if cfg.wgmma]
    assert {cfg.head_dim for cfg, _ in hopper} == {64, 128, 192, 256}
    for _, m in hopper:
        assert m["arch"] == "sm_90a"
        # ptxas says so when it has to serialise wgmma (e.g. an accumulator touched while in flight).
        assert "serializ" not in m["log"].lower(), m["config"]


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.parametrize("d, warp_specialized", [(128, True), (128, False), (192, False), (256, False)])
def test_hopper_backward_layout_must_fit_the_launch_allocation(d, warp_specialized):
    """Each Hopper backward kernel asserts that its shared-memory layout fits the config's smem_bytes (what
    the launch allocates): a unit claiming one byte less does not compile. (The warp-specialized d128
    layout is largest in its dropout build, whose slots carry the row hashes.)"""
    cfg = hopper_bwd_config("bf16", d, warp_specialized=warp_specialized)
    largest = {"dropout": True} if warp_specialized and d == 128 else {}
    src = sources.bwd_kernel_source(cfg, **largest)
    claim = f"kSmemBytes = {cfg.smem_bytes};"
    assert claim in src
    with pytest.raises(compiler.CompileError, match="exceeds the config's smem_bytes"):
        compiler.compile_nvcc(src.replace(claim, f"kSmemBytes = {cfg.smem_bytes - 1};"), "sm_90a", "x")


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape", [(64, 0), (64, 128), (96, 128), (64, 64)], ids=["kv64", "v128", "kv96-v128", "v64"]
)
def test_wide_ws_192_forms_compile_within_their_layout_without_serialising(dtype, shape):
    """head_dim 192's 64-key blocks (the default's 96 before kernel log 140) and v's own head_dim (value-head-
    dim-study section 7), which the shipped catalog does not build: ptxas keeps the products asynchronous
    (no serialized wgmma), nothing spills, and a unit claiming one byte less shared memory than its layout
    needs (P's and dS's whole panels, V at v's width, the dO slots at q's) does not compile."""
    cfg = hopper_bwd_config(dtype, 192).replace(block_kv=shape[0], head_dim_v=shape[1])
    src = sources.kernel_source(cfg)
    resources = compiler.compile_nvcc(src, "sm_90a", cfg.name()).resources
    dkdv = [r for r in resources if "dkdv" in r.kernel]
    assert len(dkdv) == 2  # the non-causal and causal entry points
    for r in dkdv:
        assert not r.wgmma_serialized and r.spill_stores == r.spill_loads == 0, r
    claim = f"kSmemBytes = {cfg.smem_bytes};"
    with pytest.raises(compiler.CompileError, match="exceeds the config's smem_bytes"):
        compiler.compile_nvcc(src.replace(claim, f"kSmemBytes = {cfg.smem_bytes - 1};"), "sm_90a", "x")


@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("feature", ["key_range", "dropout"])
def test_key_padded_and_dropout_training_keeps_the_hopper_backward(feature, d):
    from flash_attention.ops.select import backward_config

    def choose(features):
        return backward_config(
            "bf16", d, True, 1000, 1000, 1, arch="sm_90", gpu="", smem_limit=227 * 1024, features=features
        )

    cfg = choose([feature])
    wide = hopper_bwd_config("bf16", d, warp_specialized=False)
    # At head_dim 192 and 256 the warp-specialized wide kernel has key ranges; dropout runs the wide one.
    causal_default = default_bwd_config("bf16", d, "sm_90", causal=True)
    assert cfg == (wide if d > 128 and feature == "dropout" else causal_default)
    assert cfg.wgmma and (cfg.warp_specialized if d == 128 else cfg.wide)
    # Deterministic mode: the turn-taking forms of the ws kernel at head_dim 64/128, the wide one at 192/256.
    det = choose(["deterministic", feature])
    assert det == (cfg if d == 128 else wide)


def test_wide_backward_sources_have_the_key_range_and_dropout_builds():
    wide = hopper_bwd_config("bf16", 256, warp_specialized=False)
    src = sources.kernel_source(wide, ranged=True)
    assert wide.symbol("dkdv", True, True) in src and "fa::DefaultVariant<true, true>, false, false>" in src
    src = sources.kernel_source(wide, dropout=True)
    assert (
        wide.symbol("dkdv", True, False, True) in src
        and "fa::DefaultVariant<true, false>, true, false>" in src
    )
    # The deterministic kernel, whose dQ writer is a third warpgroup, beside the 256-thread atomic one.
    assert (
        wide.symbol("dkdv_det", True, False, True) in src
        and "fa::DefaultVariant<true, false>, true, true>" in src
    )
    assert "__launch_bounds__(256, 1)" in src and "__launch_bounds__(384, 1)" in src
    assert wide.entry_kinds() == ("dkdv", "dkdv_det") and wide.kernel_threads("dkdv_det") == 384
    # report says what its 168 registers per thread become per role.
    from flash_attention.configs.backward import bwd_register_roles

    assert "dQ writer's warpgroup 24, the others up to 240" in bwd_register_roles(wide)


def test_deterministic_training_takes_the_ws_backward():
    # The deterministic mode keeps the warp-specialized kernel at head_dim 64 (its turn-taking form).
    from flash_attention.ops.select import backward_config

    cfg = backward_config(
        "bf16", 64, True, 1000, 1000, 1, arch="sm_90", gpu="", smem_limit=232448, features=("deterministic",)
    )
    assert cfg == default_bwd_config("bf16", 64, "sm_90", causal=True) and cfg.warp_specialized
