"""The Hopper (wgmma) kernel on the CPU: its generated instruction wrappers, its compile, and what the
compiler made of it (tensor-core instructions present, no spills, no serialised wgmma)."""

from __future__ import annotations

import pytest
from repo_tools import load_tool

from flash_attention.configs import default_config, parse_config, supports, wgmma_config, ws_config
from flash_attention.configs.decode import parse_decode_config
from flash_attention.jit import cache, sources
from flash_attention.jit.params import TraceLayout
from flash_attention.ops import select


def test_generated_wrappers_are_current():
    gen = load_tool("gen_wgmma")
    assert gen.HEADER.read_text() == gen.render(), "rerun: python tools/gen_wgmma.py"


def test_wrappers_cover_every_n_the_kernel_uses():
    ns = set(load_tool("gen_wgmma").NS)
    for d in (64, 128, 192, 256):
        for causal in (False, True):
            for n in (512, 16384):
                cfg = default_config("bf16", d, causal, n, n, "sm_90")
                assert {cfg.block_kv, cfg.head_dim} <= ns


def test_wgmma_config_refuses_other_architectures():
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        cache.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_80")
    assert cache.target_arch(wgmma_config("bf16", 128, 64, 128), "sm_90") == "sm_90a"
    assert cache.target_arch(default_config("bf16", 128, False, 1, 1), "sm_80") == "sm_80"


def test_trace_build_is_the_ws_kernels_and_not_the_sm90_kernels():
    with pytest.raises(ValueError, match="debug \\(trace\\) build"):
        sources.kernel_source(wgmma_config("bf16", 64, 64, 64), trace=True)
    cfg = ws_config("bf16", 64, 192, 128, 2, overlap=True)
    normal, traced = sources.kernel_source(cfg), sources.kernel_source(cfg, trace=True)
    assert "FA_TRACE" not in normal
    assert "#define FA_TRACE 1" in traced and '#include "sm90/fwd_ws/fwd_kernel.cuh"' in traced
    assert "fa::trace::Layout<Cfg>::kStep ==" in traced and "fa::FwdTmaParams p" in traced
    assert sources.kernel_symbol(cfg, True, trace=True) in traced
    assert TraceLayout.of(cfg).wm == 16 == cfg.rows_per_warp and cfg.compute_warps == 12


def test_traced_calls_keep_the_ws_kernel_unless_it_lacks_a_feature():
    """A traced call on Hopper runs the warp-specialized default (it has the debug build); one it cannot take
    (a layout TMA cannot address, a negative scale) runs the sm80 kernel's, not the sm90 kernel's (which
    has none)."""
    facts = dict(arch="sm_90", gpu="", smem_limit=232448)
    for d, n, causal in ((64, 8192, False), (128, 512, True), (128, 4096, False), (256, 4096, True)):
        plain = select.forward_config("bf16", d, causal, n, n, 1, **facts)
        assert plain.warp_specialized and supports(plain, "trace")
        assert select.forward_config("bf16", d, causal, n, n, 1, **facts, features=["trace"]) == plain
        for extra in ("untileable", "negative_scale"):
            cfg = select.forward_config("bf16", d, causal, n, n, 1, **facts, features=["trace", extra])
            assert not cfg.wgmma, (d, n, causal, extra)
    sm90 = wgmma_config("bf16", 64, 64, 64)
    assert not supports(sm90, "trace")
    with pytest.raises(ValueError, match="no build for trace"):
        select.forward_config("bf16", 64, False, 512, 512, 1, **facts, features=["trace"], config=sm90)


def test_dropout_calls_take_warp_specialized_blocks_the_hash_fits():
    """The paired dropout hash (fa/dropout.cuh, kernel log 142) spills in a warp-specialized forward whose S
    and O fill its consumers' registers (176 keys at head_dim 128, 80 at 256): its dropout calls take at most
    128 and 64 keys (and 128 query rows, select.dropout_config), and otherwise the plain call's config."""
    import dataclasses

    def rest(cfg):
        fields = dataclasses.asdict(cfg)
        return {k: v for k, v in fields.items() if k not in ("block_q", "num_warps", "block_kv")}

    facts = dict(arch="sm_90", gpu="", smem_limit=232448)
    wider = 0
    for d, keys in ((64, 256), (128, 128), (192, 256), (256, 64)):
        for n in (512, 1024, 4096, 16384):
            for causal in (False, True):
                plain = select.forward_config("bf16", d, causal, n, n, 1, **facts)
                cfg = select.forward_config("bf16", d, causal, n, n, 1, **facts, features=["dropout"])
                assert cfg.warp_specialized and cfg.block_kv <= keys, (d, n, causal, cfg.name())
                assert rest(cfg) == rest(plain) and cfg.block_q <= 128, (d, n, causal, cfg.name())
                wider += plain.block_kv > keys
    assert wider  # (a plain pick the rule narrows: else this checks nothing)


@pytest.mark.full_build
def test_hopper_forward_units_compile_to_wgmma_without_spills(catalog_builds):
    _, metas = catalog_builds
    sm90a = [m for m in metas if m["arch"] == "sm_90a" and not m["config"].startswith("bwd_")]
    hopper = [m for m in sm90a if not m["config"].startswith("decode_")]
    assert {parse_config(m["config"]).head_dim for m in hopper} == {64, 128, 192, 256}
    assert any(m["ranged"] for m in hopper) and any(m["dropout"] for m in hopper)
    for m in hopper:
        assert parse_config(m["config"]).wgmma
    # The wgmma decode kernel (64 packed rows) is built for sm_90a too, for head_dim 64 and 128.
    decode = [m for m in sm90a if m["config"].startswith("decode_")]
    assert {parse_decode_config(m["config"]).head_dim for m in decode} == {64, 128}
    assert all(parse_decode_config(m["config"]).wgmma for m in decode)
    for m in sm90a:
        for r in m["resources"]:
            assert r["spill_stores"] == 0 and r["stack_frame"] == 0, r
        # ptxas says so when it has to serialise wgmma (e.g. an accumulator touched while in flight).
        assert "serializ" not in m["log"].lower(), m["log"]


def test_e4m3_wrappers_and_packing_compile_to_8_bit_wgmma():
    """The FP8 (e4m3) wgmma wrappers (both forms, three widths) and pack4_e4m3 are valid PTX that ptxas takes
    without serialising the wgmma: a wrong operand count or form fails this compile."""
    from flash_attention.jit import compiler

    if compiler.load_nvrtc() is None:
        pytest.skip("NVRTC is not installed")
    body = []
    for n in (64, 128, 256):
        body.append(
            f"  {{ float d[{n // 2}];\n"
            f"    fa::WgmmaE4m3<{n}>::ss(d, a, b, 0);\n"
            f"    fa::WgmmaE4m3<{n}>::rs(d, frag, b, 1);\n"
            "    fa::wgmma_commit(); fa::wgmma_wait<0>();\n"
            f"    for (int i = 0; i < {n // 2}; ++i) out[threadIdx.x + 128 * i] = d[i]; }}\n"
        )
    source = (
        '#include "fa/frag.cuh"\n#include "fa/wgmma.cuh"\n'
        'extern "C" __global__ void e4m3_probe(float* out, const float* x, unsigned long long a,\n'
        "                                        unsigned long long b) {\n"
        "  const float* v = x + 16 * threadIdx.x;\n"
        "  const fa::u32 frag[4] = {fa::pack4_e4m3(v[0], v[1], v[2], v[3]),\n"
        "                           fa::pack4_e4m3(v[4], v[5], v[6], v[7]),\n"
        "                           fa::pack4_e4m3(v[8], v[9], v[10], v[11]),\n"
        "                           fa::pack4_e4m3(v[12], v[13], v[14], v[15])};\n"
        "  fa::wgmma_fence();\n" + "".join(body) + "  float s[64];\n"
        "  for (int i = 0; i < 64; ++i) s[i] = x[i * 128 + threadIdx.x];\n"
        "  fa::u32 p[4];\n  fa::acc_to_a_frag_e4m3(p, fa::acc_tile(s), 0, 1);\n"
        "  for (int r = 0; r < 4; ++r) out[r * 128 + threadIdx.x] = __uint_as_float(p[r]);\n}\n"
    )
    result = compiler.compile_nvrtc(source, "sm_90a", "e4m3_probe")
    assert "serializ" not in result.log.lower(), result.log
    (probe,) = result.resources
    assert probe.spill_stores == 0 and probe.registers > 128  # (the d256 accumulator alone is 128 registers)
