"""Every GPU from sm_80 to sm_90 gets default forward and backward configs that fit it.

Checked against a per-architecture table of the opt-in shared memory per block (A100 and Jetson Orin 163 KB,
RTX 30xx/40xx-class 99 KB, Hopper 227 KB) and by compiling each default for its own architecture: registers,
spills and stack frame from ptxas. Where no backward config can fit (head_dim 256 on 99 KB), the call falls
back to PyTorch with a warning: the selection raises NoKernel, which the dispatch turns into the fallback
(test_fallback.py and test_autograd.py check that half with stand-in kernels).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from flash_attention.configs import (
    DTYPES,
    HEAD_DIMS,
    SMEM_OPTIN,
    BwdConfig,
    default_bwd_config,
    default_config,
    parse_bwd_config,
)
from flash_attention.jit import compiler
from flash_attention.jit.cache import build
from flash_attention.ops.select import NoKernel, backward_config, forward_config
from flash_attention.ops.winners import SEQLEN_BUCKETS
from flash_attention.tools.build import spill_bound

#: The architectures the issue names, with the limits their vendor documents (bytes per block, opt-in).
LIMITS = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_87": 163 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
}


def _defaults(arch: str) -> list:
    """Every default config of ``arch``: forward for each dtype, compiled head_dim, mask and length; backward
    for each dtype, head_dim and mask (None where nothing fits)."""
    out: list = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for causal in (False, True):
                for n in SEQLEN_BUCKETS:
                    out.append(default_config(dtype, d, causal, n, n, arch))
                out.append(default_bwd_config(dtype, d, arch, causal=causal))
    return list(dict.fromkeys(out))


def test_the_table_agrees_with_the_vendors_limits():
    for arch, limit in LIMITS.items():
        assert SMEM_OPTIN[arch] == limit


@pytest.mark.parametrize("arch", sorted(LIMITS))
def test_every_default_fits_the_shared_memory_of_its_architecture(arch):
    for cfg in _defaults(arch):
        if cfg is None:
            continue
        smem = max(cfg.smem_bytes, getattr(cfg, "dq_smem_bytes", 0))
        assert smem <= LIMITS[arch], f"{cfg.name()} needs {smem} bytes; {arch} allows {LIMITS[arch]}"


def test_only_head_dim_256_training_on_99_kb_has_no_backward_kernel():
    for arch in LIMITS:
        for dtype in DTYPES:
            for d in HEAD_DIMS:
                cfg = default_bwd_config(dtype, d, arch)
                assert (cfg is None) == (d == 256 and LIMITS[arch] < 100 * 1024), (arch, d, cfg)
                if cfg is None:
                    with pytest.raises(NoKernel, match="no backward kernel for head_dim 256 fits"):
                        backward_config(
                            dtype, d, True, 512, 512, 1, arch=arch, gpu="", smem_limit=LIMITS[arch]
                        )
    # The smaller tiles the 99 KB GPUs get, by name: the forward choice is the portable one everywhere.
    assert default_bwd_config("bf16", 128, "sm_86").name() == "bwd_bf16_d128_q64_kv64_w4_s1"
    assert default_bwd_config("bf16", 192, "sm_89").name() == "bwd_bf16_d192_q64_kv32_w2_s3"
    assert default_config("bf16", 256, True, 4096, 4096, "sm_86") == default_config(
        "bf16", 256, True, 4096, 4096
    )


def test_a_forward_that_does_not_fit_the_gpu_is_no_kernel_not_an_error():
    with pytest.raises(NoKernel, match="shared memory"):
        forward_config("bf16", 128, False, 4096, 4096, 1, arch="sm_86", gpu="", smem_limit=32 * 1024)
    # A named config that does not fit is the caller's mistake: a ValueError naming the config.
    cfg = default_config("bf16", 128, False, 4096, 4096)
    with pytest.raises(ValueError, match="shared memory per block"):
        forward_config("bf16", 128, False, 4096, 4096, 1, arch="sm_86", gpu="", smem_limit=1024, config=cfg)


@pytest.mark.full_build
@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("arch", ["sm_86", "sm_89"])
def test_defaults_of_the_99_kb_architectures_compile_without_spills(arch, tmp_path, monkeypatch):
    # sm_80 and sm_90 are compiled by the catalog build (test_build.py); these two only here. Each is a
    # compile of most defaults again (about a minute on 2 CPU cores), so in the full tier with the catalog.
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    cfgs = [c for c in _defaults(arch) if c is not None]
    with ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as ex:
        built = list(ex.map(lambda c: build(c, arch), cfgs))
    for cfg, b in zip(cfgs, built, strict=True):
        assert b.arch == arch
        for r in b.meta["resources"]:
            assert 0 < r["registers"] <= 255, r
            spill = max(r["spill_stores"], r["spill_loads"])
            assert spill <= spill_bound(cfg, r["kernel"]), f"{r['kernel']} on {arch} spills {spill} bytes"
            if not isinstance(cfg, BwdConfig):
                assert r["stack_frame"] == 0, r


def test_soft_capping_takes_its_own_d128_config_only_where_measured():
    # score_function_config: bf16, head_dim 128, non-causal, from 3k keys, soft-capping alone (its registry
    # entry's forward_config_d128); every other call keeps the plain pick (a rule that leaked into plain
    # attention would cost it 5%).
    from flash_attention.spec.score_functions import SCORE_FUNCTIONS

    SOFTCAP_D128_CONFIG = SCORE_FUNCTIONS["softcap"].forward_config_d128
    assert SOFTCAP_D128_CONFIG == "(BF16, 128, 192, 64, 16): wgmma+ws+overlap+tma_store+stages_3"

    limit = LIMITS["sm_90"]

    def pick(dtype="bf16", d=128, causal=False, n=4096, features=("softcap",), arch="sm_90a"):
        return forward_config(
            dtype, d, causal, 300, n, 1, arch=arch, gpu="", smem_limit=limit, features=list(features)
        ).name()

    assert pick() == SOFTCAP_D128_CONFIG
    assert pick(n=16384) == SOFTCAP_D128_CONFIG
    plain = forward_config("bf16", 128, False, 300, 4096, 1, arch="sm_90a", gpu="", smem_limit=limit)
    for other in (
        pick(features=()),
        pick(causal=True),
        pick(n=2048),
        pick(dtype="fp16"),
        pick(d=64),
        pick(features=("softcap", "alibi")),
        pick(features=("softcap", "window")),
        pick(features=("softcap", "segments")),
        pick(features=("softcap", "dropout")),
    ):
        assert other != SOFTCAP_D128_CONFIG
    assert pick(features=()) == plain.name()
    assert "192" not in pick(arch="sm_80") and "wgmma" not in pick(arch="sm_80")


def test_a_narrow_window_takes_small_tiles_where_measured(monkeypatch):
    # select.narrow_window_config (kernel log 163, 164): a window at most NARROW_WINDOW_MAX_KEYS wide
    # (left + right keys, 512) on a warp-specialized pick takes its head_dim's small config in the call's
    # dtype (64 x 64 at 64, 128 x 128 at 128); a wider one, none, head_dim 256 and the portable family keep
    # the plain pick; 0 turns it off.
    from flash_attention.ops import select

    limit = LIMITS["sm_90"]

    def pick(d=64, window=(128, 0), dtype="bf16", arch="sm_90a", features=("window",)):
        return forward_config(
            dtype, d, True, 4096, 4096, 8, arch=arch, gpu="", smem_limit=limit, features=list(features),
            window=window,
        ).name()  # fmt: skip

    plain = {d: pick(d, None, features=()) for d in (64, 128, 256)}
    small = "(BF16, 64, 64, 64, 8): wgmma+ws+overlap+tma_store+stages_2"
    assert plain[64] != small
    assert pick() == small and pick(window=(256, 256)) == small
    assert pick(dtype="fp16").startswith("(FP16, 64, 64, 64, 8)")
    assert pick(window=(512, 1)) == plain[64] and pick(window=None, features=()) == plain[64]
    # head_dim 128 takes the 128 x 128 config (kernel log 164), also at 16k where the plain pick is 128 x 176
    d128 = "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+tma_store+stages_2"

    def pick_16k(window):
        return forward_config(
            "bf16", 128, True, 16384, 16384, 8, arch="sm_90a", gpu="", smem_limit=limit,
            features=["window"] if window else [], window=window,
        ).name()  # fmt: skip

    assert ", 176, " in pick_16k(None) and pick_16k((1024, 0)) == pick_16k(None)
    assert pick_16k((128, 0)) == d128 and pick(128, (100, 100)) == d128 and pick(256) == plain[256]
    assert "64, 64, 8" not in pick(arch="sm_80")
    monkeypatch.setattr(select, "NARROW_WINDOW_MAX_KEYS", 0)
    assert pick() == plain[64]


def test_hopper_backward_loads_by_tma_with_writer_warps_where_measured_faster():
    # configs.backward.HOPPER_BWD_TMA_DEFAULT: the TMA producer at every head_dim of the warp-specialized
    # kernels, with dQ's writer warps (dq_writer) at 64 and 128, which bwd_ws alone has (kernel log 133); the
    # deterministic and dropout calls at 256 take the wide kernel, which has no producer warpgroup; other
    # architectures never take TMA.
    def pick(d, causal, features=(), arch="sm_90a"):
        return backward_config(
            "bf16", d, causal, 4096, 4096, 1, arch=arch, gpu="", smem_limit=LIMITS["sm_90"], features=features
        )

    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = pick(d, causal)
            assert cfg.tma_loads and cfg.dq_writer == (d <= 128), (d, causal)
            assert cfg.name().endswith("_ws_tma_dqw" if d <= 128 else "_ws_tma")
    for features in (("deterministic",), ("dropout",)):
        assert not pick(256, True, features).tma_loads and not pick(256, True, features).warp_specialized
    assert not any(pick(d, c, arch="sm_80").tma_loads for d in (64, 128) for c in (False, True))
    # Every producer stays selectable by name, whatever the default.
    assert parse_bwd_config(pick(128, False).name()) == pick(128, False)
    copying = pick(128, False).replace(tma_loads=False, dq_writer=False)
    assert copying.name().endswith("_ws") and parse_bwd_config(copying.name()) == copying
    with pytest.raises(ValueError, match="dq_writer"):
        pick(128, False).replace(tma_loads=False)  # (the writer warps need the one-thread TMA producer)
