"""tools/ws_timeline.py's reading of a timeline buffer (the GPU side is the kernel's FA_TIMELINE build): a
synthetic buffer with known phases gives back those phases, and the overlap of the two warpgroups' softmax
steps is measured, not assumed."""

from __future__ import annotations

from repo_tools import load_tool, timeline_buffer


def _tool():
    return load_tool("ws_timeline")


def _consumer(start, softmax, offset=0):
    """One tile of two steps: S lands 100 after its issue, the softmax takes ``softmax``, P V 50 after it."""
    t, out = start + offset, [("tile_begin", 7, start + offset)]
    for j in range(2):
        out += [("s_issued", j, t + 10), ("s_done", j, t + 110), ("softmax_done", j, t + 110 + softmax)]
        if j:
            out.append(("pv_done", j - 1, t + 160 + softmax))
        t += 1000
    out += [("pv_done", 1, t), ("epilogue_begin", 7, t + 5), ("epilogue_end", 7, t + 305)]
    return out


def test_phases_and_softmax_overlap_are_read_back():
    tool = _tool()
    producer = [("q_issued", 7, 0), ("k_issued", 0, 10), ("v_issued", 0, 20), ("k_issued", 1, 420)]
    # Warpgroup 1 starts 300 cycles later: its 400-cycle softmax steps overlap warpgroup 0's by 100.
    raw = timeline_buffer(
        tool, {(0, 0): producer, (0, 4): _consumer(0, 400), (0, 8): _consumer(0, 400, offset=300)}
    )
    ev = tool.events(raw)
    assert set(ev) == {(0, 0), (0, 4), (0, 8)} and ev[(0, 4)][0] == ("tile_begin", 7, 0)
    text = tool.summarize(type("Cfg", (), {"name": lambda self: "cfg"})(), ev)
    rows = {line[:34].strip(): line[34:].split() for line in text.splitlines()[2:] if line[:34].strip()}
    assert rows["S_j wait (issue to landed)"] == ["100", "100"]
    assert rows["softmax step"] == ["400", "400"]
    assert rows["epilogue"] == ["300", "300"]
    assert rows["tile start to first S issued"] == ["10", "10"]
    assert "softmax time with warpgroup 1 in its own: 25%" in text
    assert "median 400" in text  # the producer's V_0 -> K_1
