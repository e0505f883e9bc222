"""The debug tooling on the CPU: trace buffer decoding, the comparison, the debug build's source, the
``debug`` and ``sanity`` commands without a GPU. The GPU side is tests/test_gpu_sim.py."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from flash_attention import ops
from flash_attention.configs import parse_config
from flash_attention.jit import cache, compiler, sources
from flash_attention.jit.params import TRACE_MAGIC, TRACE_STEP_FIELDS, TraceLayout
from flash_attention.ops import trace as ops_trace
from flash_attention.tools import debug, sanity
from flash_attention.tools.sim import TraceSpec, simulate

CFG = parse_config("(BF16, 128, 64, 64, 4): async+eager+swizzled+load_0_1_1_tiles+buffer+opt_softmax+reverse")


def _sim_trace(causal=True, seed=0):
    spec = TraceSpec(0, 1, -1, 2)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 150, 2, 120, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 220, 1, 120, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 220, 1, 120, generator=gen).to(torch.bfloat16)
    *_, tr = simulate(q, k, v, CFG, causal=causal, trace=spec)
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
