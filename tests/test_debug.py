"""The debug tooling on the CPU: trace buffer decoding, the comparison, the debug build's source, the
``debug`` and ``sanity`` commands without a GPU. The GPU side is tests/test_gpu_sim.py."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from flash_attention import ops
from flash_attention.configs import default_config, parse_config, portable_config, wgmma_config
from flash_attention.jit import cache, compiler, driver, sources
from flash_attention.jit.params import TRACE_MAGIC, TRACE_STEP_FIELDS, FwdParams, FwdTmaParams, TraceLayout
from flash_attention.ops import forward as ops_forward
from flash_attention.ops import tma
from flash_attention.ops import trace as ops_trace
from flash_attention.tools import debug, sanity
from flash_attention.tools.sim import TraceSpec, simulate

CFG = parse_config("(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse")
# Hopper's defaults of the warp-specialized kernel: three consumer warpgroups (head_dim 64), the persistent
# grid and one block per tile (128), the schedule without overlap (256, short) and with it (256).
WS_DEFAULTS = [
    default_config("bf16", 64, False, 8192, 8192, "sm_90"),
    default_config("bf16", 128, True, 512, 512, "sm_90"),
    default_config("fp16", 128, False, 4096, 4096, "sm_90"),
    default_config("fp16", 256, False, 512, 512, "sm_90"),
    default_config("bf16", 256, True, 4096, 4096, "sm_90"),
]
WS_CFG = WS_DEFAULTS[0]


def _sim_trace(causal=True, seed=0, cfg=CFG):
    # The last row block: rows past seqlen_q (150 of 256 rows at block_q 128, 192 at 192).
    spec = TraceSpec(0, 1, -1, 2 if not cfg.warp_specialized else cfg.compute_warps - 1)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 150, 2, 120, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 220, 1, 120, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 220, 1, 120, generator=gen).to(torch.bfloat16)
    *_, tr = simulate(q, k, v, cfg, causal=causal, trace=spec)
    return tr


def _encode(tr) -> dict:
    """A trace buffer as the kernel's debug build would write it (offsets from TraceLayout), for decoding."""
    lay = TraceLayout.of(tr.config)
    buf = torch.full((lay.size(max(1, math.ceil(tr.seqlen_k / tr.config.block_kv))),), float("nan"))
    buf[lay.magic], buf[lay.num_blocks], buf[lay.steps_done] = TRACE_MAGIC, tr.n_blocks, len(tr.steps)
    offsets = lay.step_offsets
    for i, step in enumerate(tr.steps):
        base = lay.first_step + i * lay.step_size
        buf[base] = tr.kv_blocks[i]
        for name, _ in TRACE_STEP_FIELDS:
            flat = step[name].flatten()
            buf[base + offsets[name] : base + offsets[name] + flat.numel()] = flat
    buf[lay.final_o : lay.final_o + lay.wm * lay.d] = tr.final["O"].flatten()
    buf[lay.final_lse : lay.final_lse + lay.wm] = tr.final["LSE"]
    s = tr.spec
    return {
        "buffer": buf,
        "config": tr.config,
        "target": ops.TraceTarget(s.batch, s.head, s.row_block, s.warp),
        "fault": "none",
        "causal": tr.causal,
        "shape": (1, tr.seqlen_q, tr.seqlen_k, 2, 1, tr.head_dim),
        "scale": tr.scale,
    }


def test_kernel_trace_decodes_the_buffer_layout():
    tr = _sim_trace()
    dec = debug.kernel_trace(_encode(tr))
    assert dec.kv_blocks == tr.kv_blocks == [3, 2, 1, 0]  # reverse order, causal: every block
    assert dec.n_blocks == tr.n_blocks and dec.spec == tr.spec and dec.first_row == tr.first_row
    for a, b in zip(dec.steps, tr.steps, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert torch.equal(dec.final["O"], tr.final["O"]) and torch.equal(dec.final["LSE"], tr.final["LSE"])
    assert debug.compare(tr, dec) is None
    assert dec.dump().splitlines()[1:] == tr.dump().splitlines()[1:]  # same format, only the source differs


def test_kernel_trace_decodes_a_warp_specialized_configs_buffer():
    """The same buffer layout with the warp-specialized kernel's 16 rows per consumer warp."""
    cfg = default_config("bf16", 128, False, 512, 512, "sm_90")
    assert cfg.warp_specialized and cfg.head_dim == 128 and cfg.block_q == 128
    tr = _sim_trace(causal=False, cfg=cfg)
    assert tr.spec.warp == 7 and tr.first_row == 128 + 7 * 16 and tr.steps[0]["Q"].shape == (16, 128)
    assert TraceLayout.of(cfg) == TraceLayout(16, cfg.block_kv, 128)
    dec = debug.kernel_trace(_encode(tr))
    assert dec.kv_blocks == tr.kv_blocks == [0, 1]
    for a, b in zip(dec.steps, tr.steps, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert debug.compare(tr, dec) is None


def test_kernel_trace_rejects_an_unwritten_buffer():
    raw = _encode(_sim_trace())
    raw["buffer"][0] = float("nan")
    with pytest.raises(RuntimeError, match="not written by a trace build"):
        debug.kernel_trace(raw)


def _perturbed(tr, step, name, index, value):
    raw = _encode(tr)
    dec = debug.kernel_trace(raw)
    t = dec.steps[step][name] if step is not None else dec.final[name]
    t[index] = value
    return dec


def test_compare_names_the_first_entry_outside_the_bound():
    tr = _sim_trace()
    # A relative change of 1e-3 in P is far outside its bound (a few fp32 ulps); earlier steps are clean.
    idx = (3, 5)
    p = tr.steps[2]["P"][idx].item()
    m = debug.compare(tr, _perturbed(tr, 2, "P", idx, p * (1 + 1e-3)))
    assert (m.step, m.kv_block, m.name, m.index) == (2, 1, "P", idx)
    text = m.describe()
    assert "step 2 (K/V block 1, keys 64..127), P[row 3, col 5]" in text
    assert f"query row {tr.first_row + 3}" in text
    # Within the bound: no mismatch.
    bound = tr.bounds[2]["P"][idx].item()
    assert bound > 0
    assert debug.compare(tr, _perturbed(tr, 2, "P", idx, p + 0.5 * bound)) is None
    # An unwritten (NaN) entry is a mismatch; so is any change at all in a loaded tile.
    m = debug.compare(tr, _perturbed(tr, 0, "O", (0, 7), float("nan")))
    assert (m.step, m.name, m.index) == (0, "O", (0, 7))
    k = tr.steps[1]["K"][9, 2].item()
    m = debug.compare(tr, _perturbed(tr, 1, "K", (9, 2), k + 2.0**-8 * max(1.0, abs(k))))
    assert (m.step, m.name, m.index) == (1, "K", (9, 2)) and "key row 9, col 2" in m.describe()
    # Step structure, then the final rows.
    dec = debug.kernel_trace(_encode(tr))
    dec.kv_blocks[1] = 7
    assert debug.compare(tr, dec).name == "K/V block"
    dec = debug.kernel_trace(_encode(tr))
    dec.steps.pop()
    assert debug.compare(tr, dec).name == "number of K/V steps"
    m = debug.compare(tr, _perturbed(tr, None, "LSE", (4,), tr.final["LSE"][4].item() + 1e-3))
    assert (m.step, m.name, m.index) == (None, "LSE", (4,)) and m.describe().startswith("final, LSE[row 4]")


def test_ranges_inputs_name_their_position():
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = debug.ranges_inputs(2, 40, 37, 4, 2, 72, dtype)
        assert q.shape == (2, 40, 4, 72) and k.shape == v.shape == (2, 37, 2, 72) and q.dtype == dtype
        j, c = 35, 61
        assert k[1, j, 1, c].item() == (j % 16) + (c % 16) / 16 == 3.8125
        assert torch.equal(k, v) and torch.equal(q[:, :37, :2], k)
        assert len(torch.unique(k[0, :16, 0, :16])) == 256  # every position in a 16x16 tile is distinct


def test_debug_build_source_and_cache_key(tmp_path):
    normal, traced = sources.kernel_source(CFG), sources.kernel_source(CFG, trace=True)
    assert "FA_TRACE" not in normal
    assert "#define FA_TRACE 1" in traced and "fa::trace::Layout<Cfg>::kStep ==" in traced
    assert sources.kernel_symbol(CFG, True, trace=True) == CFG.symbol(True) + "__trace"
    assert sources.kernel_symbol(CFG, False) in normal
    assert cache.cache_key(CFG, "sm_90", "x") != cache.cache_key(CFG, "sm_90", "x", trace=True)


def test_debug_build_of_the_ws_kernel_source():
    src = sources.kernel_source(WS_CFG, trace=True)
    assert "#define FA_TRACE 1" in src and '#include "sm90/fwd_ws/fwd_kernel.cuh"' in src
    assert f"fa::trace::Layout<Cfg>::kFinalLse == {TraceLayout.of(WS_CFG).final_lse}" in src
    with pytest.raises(ValueError, match="warp-specialized Hopper kernel only"):
        sources.kernel_source(wgmma_config("bf16", 128, 64, 128), trace=True)


@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("cfg", WS_DEFAULTS, ids=str)
def test_debug_build_of_the_ws_kernel_compiles(cfg):
    """The trace build of each kind of Hopper default compiles for sm_90a, its layout static_asserts (against
    jit/params.py, with 16 rows per consumer warp) hold; spills are allowed in a debug build."""
    result = compiler.compile_source(
        sources.kernel_source(cfg, trace=True), "sm_90a", "trace test", compiler.choose_compiler()
    )
    names = {r.kernel for r in result.resources}
    assert names == {cfg.symbol(False) + "__trace", cfg.symbol(True) + "__trace"}


@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
def test_debug_build_layout_asserts_catch_a_mismatch():
    """The static_asserts are live in the warp-specialized unit: an offset off by one fails the compile."""
    src = sources.kernel_source(WS_CFG, trace=True)
    step = TraceLayout.of(WS_CFG).step_size
    wrong = src.replace(f"Layout<Cfg>::kStep == {step}", f"Layout<Cfg>::kStep == {step + 1}")
    assert wrong != src
    with pytest.raises(compiler.CompileError, match="trace layout kStep differs"):
        compiler.compile_source(wrong, "sm_90a", "trace test", compiler.choose_compiler())


@pytest.mark.skipif(compiler.choose_compiler() is None, reason="needs NVRTC or nvcc")
def test_debug_build_compiles_and_its_layout_matches_python(tmp_path, monkeypatch):
    """The generated static_asserts pin fa::trace::Layout to jit/params.py: a compile is the check."""
    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    built = cache.build(CFG, "sm_90", trace=True)
    names = {r["kernel"] for r in built.meta["resources"]}
    assert names == {CFG.symbol(False) + "__trace", CFG.symbol(True) + "__trace"}
    assert built.meta["trace"] is True


def test_trace_target_from_the_environment(monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_TRACE", raising=False)
    assert ops.trace_from_env() is None
    monkeypatch.setenv("FLASH_ATTENTION_TRACE", "1,3,2,0")
    monkeypatch.setenv("FLASH_ATTENTION_TRACE_FAULT", "skip_rescale")
    assert ops.trace_from_env() == (ops.TraceTarget(1, 3, 2, 0), "skip_rescale")
    monkeypatch.setenv("FLASH_ATTENTION_TRACE", "1,3")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_TRACE must be 'batch,head,row_block,warp'"):
        ops.trace_from_env()


def test_trace_buffer_checks_the_target():
    shape = (2, 8, 150, 220)  # batch, heads_q, seqlen_q, seqlen_k
    buf, code = ops_trace.trace_buffer(CFG, ops.TraceTarget(1, 7, 2, 3), "wrong_swizzle", shape, "cpu")
    assert code == 2 and buf.numel() == TraceLayout.of(CFG).size(4) and torch.isnan(buf).all()
    for target, what in [((2, 0, 0, 0), "batch"), ((0, 8, 0, 0), "head"), ((0, 0, 3, 0), "row_block")]:
        with pytest.raises(ValueError, match=f"trace {what} must be in"):
            ops_trace.trace_buffer(CFG, ops.TraceTarget(*target), "none", shape, "cpu")
    with pytest.raises(ValueError, match="trace warp must be in \\[0, 4\\)"):
        ops_trace.trace_buffer(CFG, ops.TraceTarget(0, 0, 0, 4), "none", shape, "cpu")
    with pytest.raises(ValueError, match="trace fault must be one of"):
        ops_trace.trace_buffer(CFG, ops.TraceTarget(0, 0, 0, 0), "typo", shape, "cpu")


def test_trace_buffer_counts_the_consumer_warps_of_a_ws_config():
    shape = (1, 2, 300, 300)
    buf, _ = ops_trace.trace_buffer(WS_CFG, ops.TraceTarget(0, 1, 1, 11), "skip_rescale", shape, "cpu")
    assert buf.numel() == TraceLayout(16, 128, 64).size(3)
    with pytest.raises(ValueError, match="trace warp must be in \\[0, 12\\)"):
        ops_trace.trace_buffer(WS_CFG, ops.TraceTarget(0, 0, 0, 12), "none", shape, "cpu")


class _FakeKernel:
    def __init__(self, cfg, causal, arch, trace):
        self.cfg, self.causal, self.arch, self.trace = cfg, causal, arch, trace

    def ensure_dynamic_smem(self, smem, index):
        self.smem = smem


@pytest.fixture
def traced_launches(monkeypatch):
    """The forward's traced launch on the CPU, as on an H100 of 4 multiprocessors: the kernel, the tensor
    map encodes and the launch itself are stand-ins; the launches are returned for inspection."""
    launches = []
    facts = dict(arch="sm_90", gpu="", smem_limit=232448)
    monkeypatch.setattr(ops_forward, "device_facts", lambda index: facts)
    monkeypatch.setattr(ops_forward, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(ops_forward, "sm_count", lambda index: 4)
    monkeypatch.setattr(
        ops_forward,
        "get_kernel",
        lambda cfg, causal, arch, trace=False, **kw: _FakeKernel(cfg, causal, arch, trace),
    )
    monkeypatch.setattr(tma, "encode_into", lambda field, layout, ptr: 0)
    monkeypatch.setattr(driver, "make_primary_current", lambda index: None)  # (the encodes' context)

    def launch(kernel, grid, threads, smem, index, args):
        launches.append(dict(kernel=kernel, grid=grid, threads=threads, smem=smem, args=args))

    monkeypatch.setattr(ops_forward, "launch", launch)
    return launches


def test_traced_launch_of_a_ws_config_is_the_normal_launch_with_the_trace_fields(traced_launches):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 300, 4, 120, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 333, 2, 120, generator=gen).to(torch.bfloat16)
    target = ops.TraceTarget(0, 3, 2, 7)
    ops_forward.cuda_forward(
        q,
        k,
        k,
        causal=True,
        softmax_scale=0.1,
        return_lse=True,
        out=None,
        trace=target,
        trace_fault="skip_rescale",
    )
    (run,) = traced_launches
    cfg = default_config("bf16", 128, True, 300, 333, "sm_90")
    assert cfg.warp_specialized and cfg.persistent
    assert run["kernel"].cfg == cfg and run["kernel"].trace and run["kernel"].causal
    # The persistent grid of the normal launch: one block per multiprocessor, tiles from a counter (3 row
    # blocks x 4 heads > 4 blocks); the trace fields in the inner FwdParams.
    assert run["grid"] == (4, 1, 1) and run["threads"] == cfg.threads and run["smem"] == cfg.smem_bytes
    args = run["args"]
    assert isinstance(args, FwdTmaParams) and args.tile_counter
    raw = ops.last_trace()
    assert raw["config"] == cfg and raw["target"] == target
    p = args.p
    assert p.trace == raw["buffer"].data_ptr() and p.trace_fault == 1
    assert (p.trace_batch, p.trace_head, p.trace_m_block, p.trace_warp) == (0, 3, 2, 7)
    assert p.num_m_blocks == 3 and p.group == 2 and p.q == q.data_ptr()
    assert raw["buffer"].numel() == TraceLayout(16, cfg.block_kv, 128).size(3)


def test_traced_launch_falls_back_to_the_sm80_kernel_where_tma_cannot_read(traced_launches):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 300, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 200, 1, 64, generator=gen).to(torch.bfloat16).expand(-1, -1, 2, -1)
    assert tma.untileable(q, k, k)
    target = ops.TraceTarget(0, 1, 1, 3)
    ops_forward.cuda_forward(
        q, k, k, causal=False, softmax_scale=0.1, return_lse=False, out=None, trace=target
    )
    (run,) = traced_launches
    cfg = run["kernel"].cfg
    assert not cfg.wgmma and run["kernel"].trace and ops.last_trace()["config"] == cfg
    args = run["args"]
    assert isinstance(args, FwdParams) and run["grid"] == (args.num_m_blocks, 4, 1)
    assert (args.trace_head, args.trace_m_block, args.trace_warp) == (1, 1, 3) and args.trace
    # A named ws config cannot take such inputs: the call says so instead of running another kernel.
    with pytest.raises(ValueError, match="has no build for untileable"):
        ops_forward.cuda_forward(
            q, k, k, causal=False, softmax_scale=0.1, return_lse=False, out=None, trace=target, config=WS_CFG
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the command")
def test_debug_command_without_gpu_simulates_a_ws_config(tmp_path, capsys):
    rc = debug.main(
        [
            "--config",
            WS_CFG.name(),
            "--seqlen",
            "300",
            "--causal",
            "--trace",
            "0,1,1,11",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 2 and "kernel:    not run" in out
    assert "warp 11 (query rows 368..383)" in out  # row block 1 of 192 rows, consumer warp 11 of 16 rows
    text = (tmp_path / "sim.txt").read_text()
    assert "\nQ [16 x 64]\n" in text and "\nK [128 x 64]\n" in text and "## step 2: K/V block 2" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the command")
def test_debug_command_without_gpu_runs_the_simulator_side(tmp_path, capsys):
    rc = debug.main(
        ["--config", CFG.name(), "--seqlen", "150", "--seqlen-k", "220", "--causal", "--ranges"]
        + ["--head-dim", "120", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 2
    assert "kernel:    not run: no CUDA GPU is visible to PyTorch" in out
    text = (tmp_path / "sim.txt").read_text()
    assert text.startswith("# flash_attention trace (simulator)") and "## step 3: K/V block 0" in text
    assert not (tmp_path / "kernel.txt").exists()
    # --ranges: the first row of K of block 0 reads 0, 1/16, 2/16, ...
    k_block = text.split("## step 3: K/V block 0")[1].split("\nK [64 x 128]\n")[1].splitlines()[0]
    assert [float(x) for x in k_block.split(":")[1].split()[:4]] == [0.0, 0.0625, 0.125, 0.1875]


def test_debug_command_default_config_is_what_a_traced_call_runs(monkeypatch):
    argv = ["--config", "default", "--seqlen", "300", "--head-dim", "64", "--causal", "--heads", "4"]
    monkeypatch.setattr(debug, "_kernel_unavailable", lambda: "no CUDA GPU is visible to PyTorch")
    assert debug._config(debug._parse_args(argv)) == portable_config("bf16", 64, True, 300, 300)
    # On an H100: the warp-specialized default, which has the debug build.
    monkeypatch.setattr(debug, "_kernel_unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    facts = {"arch": "sm_90", "gpu": "", "smem_limit": 232448}
    monkeypatch.setattr(debug, "device_facts", lambda index: facts)
    cfg = debug._config(debug._parse_args(argv))
    assert cfg == default_config("bf16", 64, True, 300, 300, "sm_90") and cfg.warp_specialized
    # A negative scale needs the unfolded softmax: the sm80 kernel.
    assert not debug._config(debug._parse_args(argv + ["--scale", "-0.1"])).wgmma


def test_debug_command_rejects_bad_arguments(capsys):
    assert debug.main(["--config", "nonsense", "--seqlen", "10"]) == 2
    assert "cannot parse kernel config" in capsys.readouterr().err
    assert debug.main(["--config", CFG.name(), "--seqlen", "10", "--trace", "0,0,0,9"]) == 2
    assert "trace warp must be in [0, 4)" in capsys.readouterr().err


def test_sanity_without_gpu_says_what_is_missing_and_that_the_cpu_path_works(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert sanity.main([]) == 0
    out = capsys.readouterr().out
    assert "GPU:       none usable: this PyTorch" in out and "is a CPU-only build" in out
    assert "next: install a CUDA build of PyTorch" in out
    assert "CPU path:  PASS" in out and "simulator: PASS" in out
    assert "NO GPU: the CPU path works" in out and "FAIL" not in out
    assert "cache:" in out and "versions:" in out
    assert sanity.main(["--require-gpu"]) == 1


def test_sanity_names_the_missing_piece(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    what, todo = sanity.missing_gpu_reason()
    assert "CUDA_VISIBLE_DEVICES=''" in what and "unset CUDA_VISIBLE_DEVICES" in todo
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    what, todo = sanity.missing_gpu_reason()
    assert "libcuda.so.1" in what and "CUDA 12.8" in what and "nvidia-smi" in todo
