"""tools/bwd_timeline.py's reading of a timeline buffer (the GPU side is the dK/dV kernel's FA_TIMELINE build,
csrc/kernels/sm90/bwd_ws): a synthetic buffer with known phases gives back those phases, the step's length,
the share of a step both warpgroups spent with nothing queued, and the producer's issue and wait times."""

from __future__ import annotations

import pytest
from repo_tools import load_tool, timeline_buffer

# One step's events after its start t (cycles): each phase a distinct length, so a phase read against the
# wrong pair of events shows.
_OFFSETS = (
    ("full", 0),
    ("s_landed", 300),
    ("exp_done", 700),
    ("dp_landed", 900),
    ("ds_stored", 1150),
    ("met", 1210),
    ("dq_landed", 1600),
    ("dq_out", 1750),
    ("step_end", 2100),
)
_STEP = 2170  # so the slot wait (previous step's end to the next full) is 70


def _tool():
    return load_tool("bwd_timeline")


def _consumer(steps, offset=0):
    return [(name, it, offset + it * _STEP + at) for it in range(steps) for name, at in _OFFSETS]


def test_phases_idle_share_and_producer_are_read_back():
    tool = _tool()
    # Warpgroup 1 runs 100 cycles behind: of warpgroup 0's 250-cycle dS phase, 150 overlap its own.
    producer = [
        (k, it, it * _STEP + at) for it in range(4) for k, at in (("slot_free", 40), ("slot_issued", 90))
    ]
    raw = timeline_buffer(tool, {(0, 0): producer, (0, 4): _consumer(4), (0, 8): _consumer(4, offset=100)})
    ev = tool.events(raw)
    assert set(ev) == {(0, 0), (0, 4), (0, 8)}
    text = tool.summarize(type("Cfg", (), {"name": lambda self: "cfg"})(), ev)
    rows = {line[:44].strip(): line[44:].split() for line in text.splitlines()[2:] if line[:44].strip()}
    expected = {
        "slot wait (previous step's end to full)": 70,
        "S^T wait": 300,
        "exponentials (P^T)": 400,
        "dP^T wait": 200,
        "dS^T, its store, dV issued": 250,
        "meeting (barrier 1)": 60,
        "dV and dQ wait": 390,
        "dQ staged and reduced": 150,
        "dK wait": 350,
        "step (full to next full)": _STEP,
    }
    for name, cycles in expected.items():
        assert rows[name] == [str(cycles), str(cycles)], (name, rows.get(name))
    assert f"{150 / _STEP:.0%} of a step" in text
    # The producer: refilled 50 after the slot came free; waited 2170 - 50 = 2120 for the next one.
    assert "(issue + own copies) 50, waited 2120" in text
    assert "records" not in text


def test_steps_are_keyed_by_the_recorded_step_index():
    tool = _tool()
    raw = timeline_buffer(tool, {(1, 4): _consumer(3), (1, 8): _consumer(3)})
    steps = tool._steps(tool.events(raw)[(1, 4)])
    assert sorted(steps) == [0, 1, 2] and steps[2]["full"] == 2 * _STEP


def test_the_timeline_build_compiles_with_its_stamps_and_without_spills():
    """FA_TIMELINE reaches the dK/dV kernel (its cubin differs from the library's build of the same unit,
    whose machine code tools/sass_diff.py checks unchanged) and, with the TMA producer without dQ's writer
    warps, neither build spills; the default (with them: 40 / 232 registers) spills at d128 with the stamps
    only (24-28 bytes, which tools/bwd_timeline.py reports), not in the library's build of it."""
    import pytest

    from flash_attention.configs import default_bwd_config
    from flash_attention.jit import compiler
    from flash_attention.jit.sources import kernel_source

    kind = "nvrtc" if compiler.load_nvrtc() is not None else "nvcc" if compiler.find_nvcc() else None
    if kind is None:
        pytest.skip("needs NVRTC or nvcc")
    writer = default_bwd_config("bf16", 128, "sm_90a", causal=True)
    assert writer.warp_specialized and not writer.wide_ws and writer.dq_writer
    for cfg in (writer.replace(dq_writer=False), writer):
        cubins = {}
        for defines in ("", "#define FA_TIMELINE 1\n"):
            result = compiler.compile_source(defines + kernel_source(cfg), "sm_90a", cfg.name(), kind)
            dkdv = [r for r in result.resources if "__dkdv" in r.kernel]
            bound = 32 if defines and cfg.dq_writer else 0
            assert dkdv and all(r.spill_stores <= bound for r in dkdv), (cfg.name(), defines, dkdv)
            cubins[bool(defines)] = result.cubin
        assert cubins[True] != cubins[False]


@pytest.mark.parametrize("spans", [False, True])
def test_run_swaps_in_the_timeline_kernel_with_the_trace_pointer(monkeypatch, spans):
    """tools/bwd_timeline.run on the stand-in Hopper GPU: the call's dK/dV launches are the timeline build's
    kernel (here a recording stand-in for it; with spans, the FA_BLOCK_SPANS build's), with BwdParams.trace
    pointing at the record buffer (spans: one row per block of the launched grid), and the library's plans
    and params functions are put back afterwards."""
    import stand_in_gpu

    from flash_attention import ops
    from flash_attention.jit.params import BwdParams
    from flash_attention.ops import backward

    tool = _tool()
    gpu = stand_in_gpu.install(monkeypatch, "sm_90")
    seen = []

    class TimelineKernel:
        """The plan's own stand-in dK/dV kernel, recording the trace pointer of each launch."""

        def __init__(self, inner):
            self.inner, self.name = inner, inner.name

        def ensure_dynamic_smem(self, nbytes, index):
            pass

        def launch(self, grid, block, smem, stream, params, programmatic=False):
            seen.append(getattr(params, "p", params).trace)
            grids.append(grid)
            self.inner.launch(grid, block, smem, stream, params, programmatic)

    built, grids = [], []

    def build_kernel(cfg, name, arch, defines=("FA_TIMELINE",)):
        built.append((cfg.name(), name, arch, defines))
        return TimelineKernel(backward.plan_for_real_dkdv)

    real_plan_for = backward.plan_for

    def remember(*args, **kwargs):
        plan = real_plan_for(*args, **kwargs)
        backward.plan_for_real_dkdv = plan.dkdv
        return plan

    monkeypatch.setattr(backward, "plan_for", remember)
    monkeypatch.setattr(tool, "build_kernel", build_kernel)
    try:
        cfg, raw = tool.run(None, 64, 128, True, batch=1, heads=2, device="cpu", spans=spans)
    finally:
        ops.clear_plans()
    defines = ("FA_BLOCK_SPANS",) if spans else ("FA_TIMELINE",)
    assert cfg.warp_specialized and built == [(cfg.name(), built[0][1], "sm_90", defines)], (
        built
    )  # (device's)
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0], seen  # (one buffer, every timed run)
    assert backward.plan_for is remember and backward.plan_params.__name__ == "plan_params"
    if spans:
        assert raw.shape == (grids[0][0] * grids[0][1] * grids[0][2], tool.SPAN_WORDS)
    else:
        assert raw.shape == (tool.BLOCKS, tool.WARPS, tool.RECORDS, 2)
    assert not gpu.errors, gpu.errors
    assert BwdParams.trace.offset == 456


def test_a_warp_that_filled_its_records_is_named():
    tool = _tool()
    steps = tool.RECORDS // len(_OFFSETS) + 1  # (more steps than a warp's records hold)
    raw = timeline_buffer(tool, {(2, 4): _consumer(steps)[: tool.RECORDS], (2, 8): _consumer(3)})
    text = tool.summarize(type("Cfg", (), {"name": lambda self: "cfg"})(), tool.events(raw))
    assert "blocks [2] filled a warp's 4096 records" in text


def test_a_blocks_fixed_part_is_read_back():
    # The block begins 500 cycles before its first step's data and issues dK's and dV's stores 300 after its
    # last step.
    tool = _tool()
    steps = 4
    last_end = 500 + (steps - 1) * _STEP + 2100
    seq = [("block_begin", 0, 0), *_consumer(steps, offset=500), ("block_end", steps, last_end + 300)]
    ev = tool.events(timeline_buffer(tool, {(0, 4): seq, (0, 8): seq}))
    text = tool.summarize(type("Cfg", (), {"name": lambda self: "cfg"})(), ev)
    share = 800 / (last_end + 300)
    expected = f"data 500, last step to dK's and dV's stores issued 300: {share:.0%} of the block"
    assert expected in text


def test_block_spans_give_the_fixed_part_the_step_and_the_idle_share():
    import torch

    tool = _tool()
    # (multiprocessor, start, wait before past the grid dependency, query steps): a block's cycles after the
    # dependency are 1000 + 100 per step, and the clock and the global timer agree. Multiprocessor 0's first
    # block waits 30 for the previous kernel, and it runs a second block 50 after; multiprocessor 1 one
    # block, then idles to the kernel's end (its tail).
    layout = [(0, 0, 30, 10), (0, 2080, 0, 4), (1, 0, 0, 20)]
    rows = torch.zeros(5, tool.SPAN_WORDS, dtype=torch.int64)  # (two blocks never ran: all-zero rows)
    for i, (sm, start, wait, steps) in enumerate(layout):
        ready = start + wait
        end = ready + 1000 + 100 * steps
        # warpgroup 0 ends 10 before warpgroup 1: the block ends with the later one
        rows[2 * i] = torch.tensor([sm, steps, start, start, ready, ready, end - 10, end - 10, end, end])
    text = tool.summarize_spans(rows)
    assert "3 blocks on 2 multiprocessors, 3.5 us" in text  # 0 to 3480 ns
    total = 2 * 3480
    assert f"idle: {560 / total:.1%} of that" in text  # 30 waited, 50 between, 480 after
    waited, between, after = f"{30 / total:.1%}", f"{50 / total:.1%}", f"{480 / total:.1%}"
    assert (
        f"until past the grid dependency {waited}, between blocks {between}, after their last {after}" in text
    )
    assert f"before their first block {0:.1%}" in text
    assert "median 50 cycles" in text
    assert "a block's cycles = 1000 + 100 per query step" in text
    assert "r^2 1.000; steps 4-20" in text
    assert (
        tool.summarize_spans(torch.zeros(3, tool.SPAN_WORDS, dtype=torch.int64)) == "no block recorded a span"
    )
