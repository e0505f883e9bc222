"""report (occupancy, SASS histogram), plot and progression: the parts that need no GPU."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from flash_attention.configs import parse_config
from flash_attention.configs.architectures import architecture
from flash_attention.jit import compiler
from flash_attention.tools import report
from flash_attention.tools.bench.progression import progression_configs


def test_occupancy_rules():
    # 128 threads at 255 registers: 8 KB of registers per warp, 4 warps -> 2 blocks by registers on sm_90.
    o = report.occupancy("sm_90", 128, 255, 65536)
    assert (o.blocks, o.warps, o.limiter) == (2, 8, "registers")
    # 168 registers -> 176 per thread allocated -> 3 blocks; 40 KB of shared memory would allow 5.
    o = report.occupancy("sm_90", 128, 168, 40960)
    assert (o.blocks, o.limiter) == (3, "registers")
    # Shared memory bound: 100 KB tiles, two fit in 228 KB with the 1 KB reservation, three don't.
    assert report.occupancy("sm_90", 128, 64, 100 * 1024).blocks == 2
    assert report.occupancy("sm_90", 128, 64, 100 * 1024).limiter == "shared memory"
    assert report.occupancy("sm_86", 128, 64, 60 * 1024).blocks == 1


def test_progression_steps_change_one_thing_each():
    tuned = parse_config("(BF16, 128, 128, 64, 4): async+eager+swizzled+load_4_4_1_tiles+buffer+opt_softmax")
    steps = progression_configs("bf16", 128, False, 4096, tuned)
    assert steps[0][1].async_copy is False and steps[0][1].swizzle is False and not steps[0][1].opt_softmax
    for (_, a), (_, b) in zip(steps[:-2], steps[1:-1], strict=True):
        changed = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
        assert 1 <= len(changed) <= 2, changed  # fragment interleaving moves K and V together
    assert steps[-1][1].name().startswith("(BF16, 128, 128, 64, 4)")


needs_cuobjdump = pytest.mark.skipif(report.find_cuobjdump() is None, reason="needs cuobjdump")
needs_compiler = pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")


@needs_compiler
@needs_cuobjdump
def test_sass_histogram_counts_the_mma_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    cfg = parse_config("(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax")
    from flash_attention.jit.cache import build

    hists = report.sass_histograms(build(cfg, "sm_90").cubin)
    h = hists[cfg.symbol(False)]
    # Main loop per warp: S = Q K^T is (16/16) * (64/8) * (64/16) = 32 HMMA, P V another 32.
    assert h["HMMA"] == 64
    assert h["MUFU.EX2"] >= 32 and h["LDSM"] > 0 and h["LDGSTS"] > 0 and h["BAR"] > 0
    assert h["STL"] == 0 and h["LDL"] == 0


@needs_compiler
@needs_cuobjdump
def test_report_compare_command(tmp_path):
    env = {"FLASH_ATTENTION_CACHE_DIR": str(tmp_path), "FLASH_ATTENTION_QUIET": "1"}
    import os

    a = "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax"
    b = "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer"
    proc = subprocess.run(
        [sys.executable, "-m", "flash_attention", "report", "--compare", a, b],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "B - A" in proc.stdout and "HMMA" in proc.stdout and "occupancy" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("HMMA"))
    assert line.split()[-1] == "+0"  # the softmax variant changes no mma instruction


def test_plot_from_results_file(tmp_path):
    pytest.importorskip("matplotlib")
    from flash_attention.tools.bench.plot import plot_results

    rows = [
        {
            "impl": impl,
            "mode": "fwd",
            "dtype": "bf16",
            "head_dim": d,
            "causal": c,
            "seqlen": n,
            "batch": 1,
            "heads": 1,
            "ms": 1.0,
            "tflops": tf * n / 512,
        }
        for impl, tf in (("flash_attention", 300.0), ("sdpa_flash", 280.0))
        for d in (64, 128)
        for c in (False, True)
        for n in (512, 1024, 2048)
    ]
    result = {
        "gpu": "G",
        "driver": "d",
        "cuda": "c",
        "torch": "t",
        "commit": "x",
        "matmul_tflops": 700.0,
        "rows": rows,
    }
    path = tmp_path / "g-2026-01-01.json"
    path.write_text(json.dumps(result))
    written = plot_results(result, path)
    assert [p.name for p in written] == ["g-2026-01-01-d64.png", "g-2026-01-01-d128.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_progression_ends_with_the_wgmma_kernel_on_hopper():
    from flash_attention.configs import wgmma_config

    steps = progression_configs("bf16", 128, False, 4096, wgmma_config("bf16", 128, 64, 128))
    assert [label for label, _ in steps[-3:]] == [
        "tuned sm80 kernel",
        "wgmma, cp.async, tuned (sm90 kernel)",
        "tuned (what attention() runs)",
    ]
    assert not steps[-3][1].wgmma and steps[-2][1].wgmma and not steps[-2][1].warp_specialized


@pytest.mark.parametrize(
    "d,causal,n", [(64, False, 1024), (128, False, 4096), (128, True, 16384), (256, True, 2048)]
)
def test_progression_adds_one_warp_specialized_technique_per_step(d, causal, n):
    from flash_attention.configs.heuristics import _hopper_default

    tuned = _hopper_default("bf16", d, n, causal)
    steps = progression_configs("bf16", d, causal, n, tuned)
    labels = [label for label, _ in steps]
    ws = labels.index("TMA loads, producer + 2 consumer warpgroups")
    assert (
        labels[ws - 1] == "wgmma, cp.async, tuned (sm90 kernel)"
        and labels[-1] == "tuned (what attention() runs)"
    )
    assert steps[-1][1] == tuned
    chain = [cfg for _, cfg in steps[ws:-1]]
    assert chain[0].warp_specialized and not (chain[0].pingpong or chain[0].overlap or chain[0].persistent)
    added = []
    for a, b in zip(chain, chain[1:], strict=False):
        changed = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
        added.append(changed)
    # The last step drops ping-pong (tile_overlap runs without it); at head_dim 256 its second Q buffer does
    # not fit in shared memory, so the step is not there.
    expected = [{"pingpong"}, {"overlap"}, {"persistent"}, {"tma_store"}]
    if d != 256:
        expected.append({"pingpong", "tile_overlap"})
    assert added == expected


@pytest.fixture(scope="module")
def report_cache(tmp_path_factory):
    """One kernel cache for the report tests of this module: a config two of them report compiles once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path_factory.mktemp("report-cache")))
        mp.setenv("FLASH_ATTENTION_QUIET", "1")
        yield


@needs_compiler
def test_report_covers_backward_configs(report_cache, capsys):
    from flash_attention.configs import default_bwd_config

    cfg = default_bwd_config("bf16", 128, "sm_90")
    assert report.parse_any(cfg.name()) == cfg
    assert report.main(["--configs", cfg.name(), "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    for kind in ("pre", "dkdv"):
        assert cfg.symbol(kind) in out
    # Each entry point is reported at its own launch shape: the preprocessing kernel has no dynamic smem.
    lines = {line.split()[-1]: line.split() for line in out.splitlines() if line.startswith("sm_90")}
    assert int(lines[cfg.symbol("pre")][2]) == 0
    assert int(lines[cfg.symbol("dkdv")][2]) == cfg.smem_bytes
    # The warp-specialized default: the launch allocation is 168 per thread, what setmaxnreg makes of it
    # per role is stated beside it (with dQ's writer warps in the producer warpgroup, 40 / 232).
    assert cfg.warp_specialized and cfg.dq_writer
    assert "registers by role: setmaxnreg: producer warpgroup 40, consumer warpgroups up to 232" in out


# One shipped config of each kernel family per architecture (the Hopper backward has two kernels of its own:
# the warp-specialized one at head_dim 64/128 and the wide one at 192/256), and whether its kernels move
# registers between warpgroups with setmaxnreg (then report states the split beside the launch count).
FAMILIES = [
    ("sm_80", "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+opt_softmax", False),
    ("sm_80", "bwd_bf16_d64_q128_kv128_w8_s1", False),
    ("sm_80", "decode_bf16_d64_m16_kv64_w1x4_s3", False),
    ("sm_90", "(BF16, 64, 128, 128, 12): wgmma+ws+overlap+tma_store+stages_2", True),
    ("sm_90", "bwd_bf16_d128_q64_kv128_w12_s1_buffer_wgmma_ws_tma_dqw", True),
    ("sm_90", "bwd_bf16_d192_q64_kv64_w8_s1_buffer_wgmma", True),
    ("sm_90", "decode_bf16_d64_m16_kv64_w1x4_s3", False),
    ("sm_90", "decode_bf16_d64_m64_kv64_w4x1_s2_wgmma_rf", False),
]


def _entry_points(cfg) -> list[str]:
    """Kernels every build of ``cfg``'s family holds, named by the config classes."""
    from flash_attention.configs import BwdConfig
    from flash_attention.configs.decode import DecodeConfig

    if isinstance(cfg, BwdConfig):
        return [cfg.symbol("pre"), cfg.symbol("dkdv"), cfg.symbol("dkdv", True), cfg.symbol("dkdv_det")]
    if isinstance(cfg, DecodeConfig):
        return [cfg.symbol("decode"), cfg.symbol("decode", True), cfg.symbol("combine"), cfg.symbol("append")]
    return [cfg.symbol(False), cfg.symbol(True)]


@needs_compiler
@pytest.mark.parametrize("arch,name,reallocates", FAMILIES, ids=[f"{a}-{n[:20]}" for a, n, _ in FAMILIES])
def test_report_covers_every_kernel_family(arch, name, reallocates, report_cache, capsys):
    from flash_attention.tools.build import spill_bound

    cfg = report.parse_any(name)
    assert cfg in report.shipped_configs(arch)
    assert report.main(["--configs", name, "--arch", arch]) == 0
    out = capsys.readouterr().out.splitlines()
    kernel_lines = [line.split() for line in out if line.startswith(arch)]
    rows = {cells[-1]: cells for cells in kernel_lines}
    assert len(rows) == len(kernel_lines), "a kernel is listed twice"
    assert set(_entry_points(cfg)) <= set(rows)
    for kernel, (_, regs, smem, spills, stack, blocks, *_) in rows.items():
        stores, loads = (int(x) for x in spills.split("/"))
        assert 16 <= int(regs) <= 255 and int(stack) >= 0, (kernel, regs, stack)
        assert 0 <= int(smem) <= architecture(arch).smem_per_sm, (kernel, smem)
        assert max(stores, loads) <= spill_bound(cfg, kernel), f"{kernel} spills {stores}/{loads} bytes"
        assert int(blocks) >= 1, f"{kernel}: no block fits on a multiprocessor"
    roles = [line for line in out if "registers by role" in line]
    assert len(roles) == (1 if reallocates else 0), roles
    assert all("setmaxnreg" in line for line in roles)


def test_register_roles_of_names_what_it_was_given():
    with pytest.raises(TypeError, match="cfg must be a KernelConfig, BwdConfig or DecodeConfig; got str"):
        report.register_roles_of("decode_bf16_d64_m16_kv64_w1x4_s3")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_progression_goes_portable_then_hopper_then_deterministic(d):
    from flash_attention.configs import default_bwd_config
    from flash_attention.tools.bench.progression import backward_progression_configs

    tuned = default_bwd_config("bf16", d, "sm_90")
    steps = backward_progression_configs("bf16", d, "sm_90", tuned)
    cfgs = [cfg for _, cfg, _ in steps]
    dets = [det for _, _, det in steps]
    # The portable kernel first, each Hopper kernel once, ending with what training runs; then the
    # deterministic mode on the portable pair and on the Hopper kernel.
    assert not cfgs[0].wgmma and all(c.wgmma for c in cfgs[1:-2])
    assert cfgs[-3] == tuned and cfgs[-1] == tuned and cfgs[-2] == cfgs[0]
    assert dets == [False] * (len(steps) - 2) + [True, True]
    if d <= 128:
        assert not cfgs[1].warp_specialized and cfgs[2].warp_specialized and len(steps) == 5
    else:
        assert cfgs[1].wide and len(steps) == 4
    # Elsewhere: the portable kernel is what training runs, in both modes.
    tuned80 = default_bwd_config("bf16", d, "sm_80")
    steps80 = backward_progression_configs("bf16", d, "sm_80", tuned80)
    assert [(c, det) for _, c, det in steps80] == [(tuned80, False), (tuned80, True)]


@needs_compiler
@needs_cuobjdump
def test_a_variants_histogram_beside_the_plain_builds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    name = "(BF16, 64, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax"
    assert report.main(["--configs", name, "--arch", "sm_80", "--score", "softcap", "--against-plain"]) == 0
    out = capsys.readouterr().out
    # The resource lines are the variant build's entry points, and the table holds both builds.
    assert "__softcap" in out and "A = plain, B = softcap (non-causal entry point, sm_80)" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("MUFU.TANH"))
    assert row[1] == "0" and int(row[2]) >= 32 and row[3] == f"+{row[2]}"  # 64 x 64 scores / 128 threads
    # A window build has one entry point (the window carries causal): --causal still names it.
    assert report.main(["--configs", name, "--arch", "sm_80", "--window", "--sass", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "window build, non-causal" in out and "__window" in out
    # --against-plain without a variant is refused.
    assert report.main(["--configs", name, "--against-plain"]) == 2


# A kernel in cuobjdump's layout: a step loop (0x0020-0x0060) with matrix instructions, a wait whose retry
# ptxas put after it (a two-instruction loop of its own, then a jump back into the step loop from outside),
# and registers named only before and after the loop (R1-R4, R20).
_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R20, R3, R4, RZ ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   FMNMX R5, R24, R25, !PT ;
        /*0040*/              @!P0 BRA 0x80 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR16].tnspB, R88 ;
        /*0060*/               @P1 BRA 0x20 ;
        /*0070*/                   STG.E desc[UR6][R2.64], R20 ;
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R7 ;
        /*0090*/              @!P0 BRA 0x80 ;
        /*00a0*/                   BRA 0x50 ;
        /*00b0*/                   EXIT ;
"""


def test_step_loop_is_the_innermost_loop_with_matrix_instructions():
    ins = report.instructions(_SASS)
    a, b = report.step_loop(ins)
    assert (ins[a][0], ins[b][0]) == (0x20, 0x60)
    # The retry (0x80-0x90) has no matrix instruction; the jump back in (0x50-0xa0) runs the wgmma at 0x50
    # but crosses the step loop's end: neither is the step loop.
    lines = report.loop_lines(_SASS)
    assert lines[0].startswith("step loop: 5 instructions (0x0020-0x0060)")
    # A wgmma names only its fragments' first registers: the m64n128 fp32 accumulator is R24-R87, the
    # m64n64 one R88-R119, the A fragment R120-R123 (R5 too: 101 in the loop).
    assert "names 101 of the kernel's 107 registers" in lines[0]
    assert set(range(24, 124)) <= report.registers_of(ins[a : b + 1])
    assert lines[1] == "not named in it (6): R1 R2 R3 R4 R7 R20"
    # Without a matrix instruction there is no step loop.
    plain = re.sub(r"HGMMA\.64x\d+x16\.F32\.BF16", "FMUL", _SASS)
    assert report.step_loop(report.instructions(plain)) is None
    assert report.loop_lines(plain) == ["no loop with matrix instructions"]


# A retry placed out of line whose jump back lands near the step loop's end (0x70, after the forward branch
# at 0x60 into the retry block at 0xa0): the jump back's range (0x70-0xc0) is shorter than the loop's
# (0x20-0x80), so telling them apart by length alone discarded the loop and took the jump back (a d64
# backward build had no loop under `report --loop`).
_SASS_LATE_RETRY = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R20, R3, R4, RZ ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   FMNMX R5, R24, R25, !PT ;
        /*0040*/                   FMUL R6, R5, R5 ;
        /*0050*/                   FMUL R7, R6, R6 ;
        /*0060*/              @!P0 BRA 0xa0 ;
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR16].tnspB, R88 ;
        /*0080*/               @P1 BRA 0x20 ;
        /*0090*/                   STG.E desc[UR6][R2.64], R20 ;
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R7 ;
        /*00b0*/              @!P0 BRA 0xa0 ;
        /*00c0*/                   BRA 0x70 ;
        /*00d0*/                   EXIT ;
"""


def test_step_loop_survives_a_retry_that_jumps_back_near_its_end():
    ins = report.instructions(_SASS_LATE_RETRY)
    a, b = report.step_loop(ins)
    assert (ins[a][0], ins[b][0]) == (0x20, 0x80)
    assert report.loop_lines(_SASS_LATE_RETRY)[0].startswith("step loop: 7 instructions (0x0020-0x0080)")
    # Without the forward branch into the retry block, nothing says which crossing range is the loop: the
    # length rule then keeps the shorter one, as before.
    no_entry = _SASS_LATE_RETRY.replace(
        "@!P0 BRA 0xa0 ;\n        /*0070*/", "@!P0 BRA 0xd0 ;\n        /*0070*/"
    )
    a, b = report.step_loop(report.instructions(no_entry))
    assert (ins[a][0], ins[b][0]) == (0x70, 0xC0)
