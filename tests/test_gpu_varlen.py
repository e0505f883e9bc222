"""GPU tests of variable-length batches (attention_varlen; the kernels' segments build, fa/visible_keys.cuh
SegmentKeys): output, LSE and gradients against float64 run on each sequence alone, within a few times the
error of the same computation in float32 rounded to the inputs' precision; every forward family and every
backward family (the deterministic one bitwise between runs); ragged lengths with 0 and 1, GQA, causal,
a window, soft-capping, sinks, seqused_k, fp16/bf16, head dims 64/128/256 and 72; no host
synchronisation in a call; and the opt-in check of the offsets (FLASH_ATTENTION_CHECK_OFFSETS) on the
device."""

from __future__ import annotations

import contextlib
import re
import zlib

import pytest
import torch

import flash_attention
from flash_attention import ops
from flash_attention.api.varlen import _with_tiles, alibi_diagonals, row_slopes, segments
from flash_attention.configs import (
    default_bwd_config,
    hopper_bwd_config,
    padded_head_dim,
    portable_config,
    ws_config,
)
from flash_attention.configs.heuristics import classic_hopper_config
from flash_attention.fallback.reference import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


# (lengths_q, lengths_k, heads_q, heads_kv, head_dim, causal, extra, dtype)
CASES = [
    ([300, 0, 517, 1, 130, 64], [300, 0, 517, 1, 130, 64], 8, 2, 128, True, {}, "bf16"),
    ([300, 7, 517, 1, 130], [411, 3, 517, 20, 130], 4, 4, 64, False, {}, "fp16"),
    ([1000, 33, 600], [1000, 33, 600], 4, 1, 256, True, {}, "bf16"),
    ([250, 380, 129], [250, 380, 129], 4, 2, 72, True, {"window": (100, 0)}, "fp16"),
    ([250, 380, 129], [260, 380, 200], 4, 2, 128, True, {"softcap": 1.5}, "bf16"),
    ([250, 380, 129], [250, 380, 129], 8, 2, 128, True, {"sinks": True}, "bf16"),
    ([250, 380, 129], [300, 400, 129], 4, 2, 64, True, {"seqused_k": [260, 0, 100]}, "bf16"),
    ([250, 380, 129, 1], [250, 380, 129, 1], 4, 2, 128, True, {"deterministic": True}, "bf16"),
    ([250, 380, 0, 129], [250, 380, 0, 129], 8, 2, 128, True, {"alibi": True}, "bf16"),
    ([250, 380, 129], [250, 380, 129], 4, 4, 64, False, {"alibi": True}, "fp16"),
    # ALiBi with causal over any query and key counts (measured from each row's diagonal key)
    (
        [250, 380, 129, 40],
        [300, 380, 200, 7],
        8,
        2,
        128,
        True,
        {"alibi_any": True, "seqused_k": [260, 0, 150, 7]},
        "bf16",
    ),
    ([250, 1, 129], [100, 64, 500], 4, 4, 64, True, {"alibi_any": True}, "fp16"),
    ([250, 1, 129], [300, 64, 130], 4, 2, 128, True, {"alibi_any": True, "softcap": 1.5}, "bf16"),
    # ALiBi without causal over other query and key counts (each row's diagonal from a table)
    ([250, 1, 129, 40], [300, 64, 130, 7], 8, 2, 128, False, {"alibi_any": True}, "bf16"),
    (
        [250, 380, 129],
        [300, 400, 129],
        4,
        2,
        64,
        False,
        {"alibi_any": True, "seqused_k": [260, 0, 100]},
        "fp16",
    ),
    ([250, 380, 129], [300, 380, 200], 4, 4, 256, False, {"alibi_any": True, "window": (90, 40)}, "bf16"),
    ([250, 1, 129], [300, 64, 130], 4, 2, 128, False, {"alibi_any": True, "softcap": 1.5}, "bf16"),
    # Per-sequence (batch, heads) slopes (a slope per query row in the kernels, the "..._rows" builds)
    ([250, 380, 0, 129, 1], [250, 380, 0, 129, 1], 8, 2, 128, True, {"alibi_seq": True}, "bf16"),
    ([250, 380, 129], [250, 380, 129], 4, 4, 64, False, {"alibi": True, "alibi_seq": True}, "fp16"),
    ([250, 1, 129, 40], [300, 64, 130, 7], 8, 2, 128, False, {"alibi_seq": True}, "bf16"),
    ([250, 1, 129], [100, 64, 500], 4, 1, 256, True, {"alibi_seq": True, "softcap": 1.5}, "bf16"),
    ([250, 380, 129], [300, 380, 200], 4, 2, 72, False, {"alibi_seq": True, "window": (90, 40)}, "fp16"),
    (
        [250, 380, 129],
        [300, 400, 129],
        4,
        2,
        128,
        True,
        {"alibi_seq": True, "seqused_k": [260, 0, 100], "softcap": 1.5},
        "bf16",
    ),
]


@contextlib.contextmanager
def _no_host_sync():
    """Raise on any device-to-host synchronisation inside (the queued work is finished first)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _make(case):
    lens_q, lens_k, hq, hkv, d, causal, extra, dt = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    # Rows past the last sequence (output 0), except for ALiBi, which needs packed self-attention.
    total_q = sum(lens_q) + (0 if extra.get("alibi") else 5)
    q = torch.randn(total_q, hq, d, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    do = torch.randn(total_q, hq, d, generator=gen, device="cuda").to(dtype)
    kw = dict(extra)
    used = list(lens_k)
    if "seqused_k" in kw:
        used = kw["seqused_k"]
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=gen, device="cuda") + 4.0
    if kw.pop("alibi", False) or kw.pop("alibi_any", False):
        kw["alibi_slopes"] = torch.linspace(0.05, 0.6, hq, device="cuda")
    if kw.pop("alibi_seq", False):  # each sequence's own, none equal to another's
        kw["alibi_slopes"] = torch.rand(len(lens_q), hq, generator=gen, device="cuda") * 0.6 + 0.02
    return (q, k, v, do), kw, used


def _reference(case, tensors, kw, used, dtype):
    """Per sequence in ``dtype``: out, lse and the gradients of q, k, v (and the sinks)."""
    lens_q, lens_k, hq, _, _, causal, _, _ = case
    q, k, v, do = tensors
    cu_q, cu_k = _offsets(lens_q).tolist(), _offsets(lens_k).tolist()
    out = torch.zeros(q.shape, dtype=dtype, device="cuda")
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=dtype, device="cuda")
    grads = [torch.zeros(t.shape, dtype=dtype, device="cuda") for t in (q, k, v)]
    sinks = kw.get("sinks")
    if sinks is not None:  # a row that sees no key (past the last sequence): its LSE is the sink's
        lse[:] = sinks.to(dtype)[:, None]
    dsinks = torch.zeros(hq, dtype=dtype, device="cuda")
    ref_kw = {n: kw[n] for n in ("window", "softcap") if n in kw}
    slopes = kw.get("alibi_slopes")
    for b, m in enumerate(lens_q):
        if slopes is not None:  # (heads,), or each sequence's (batch, heads)
            ref_kw["alibi_slopes"] = (slopes if slopes.dim() == 1 else slopes[b]).to(dtype)
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b] + used[b])
        if m == 0:
            continue
        leaves = [t[s].to(dtype).unsqueeze(0).requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks))]
        s_leaf = None if sinks is None else sinks.to(dtype).requires_grad_()
        o, lb = attention_reference(*leaves, causal=causal, sinks=s_leaf, compute_dtype=dtype, **ref_kw)
        out[qs], lse[:, qs] = o[0].detach(), lb[0].detach()
        wrt = leaves + ([s_leaf] if s_leaf is not None else [])
        g = torch.autograd.grad(o, wrt, do[qs].to(dtype).unsqueeze(0))
        grads[0][qs] += g[0][0]
        grads[1][ks] += g[1][0]
        grads[2][ks] += g[2][0]
        if s_leaf is not None:
            dsinks += g[3]
    return out, lse, grads + ([dsinks] if sinks is not None else [])


def _close(got, exact, f32, name):
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(got)), f"{name}: non-finite entries differ"
    err = (got.double() - exact).abs()[finite].max().item() if finite.any() else 0.0
    err32 = (f32.to(got.dtype).double() - exact).abs()[finite].max().item() if finite.any() else 0.0
    bound = 4 * err32 + 2e-3
    if name == "dsinks":
        # A sum over every row of D = dO . O', with O' the half-precision output any implementation in that
        # precision forms D from: about its unit roundoff of the sum's size, which rounding only the
        # float32 result (err32) does not see.
        bound += 1e-2 * exact.abs().max().item()
    assert err <= bound, f"{name}: {err:.3g} against float64 (float32 rounded: {err32:.3g})"


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c)[:80])
def test_attention_varlen_against_float64(case):
    lens_q, lens_k, hq, _, _, causal, extra, _ = case
    tensors, kw, used = _make(case)
    q, k, v, do = tensors
    exact = _reference(case, tensors, kw, used, torch.float64)
    f32 = _reference(case, tensors, kw, used, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
        leaves.append(kw["sinks"])
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    if extra.get("alibi"):
        cu_k = cu_q  # (packed self-attention: one offsets tensor)
    o, lse = flash_attention.attention_varlen(*leaves[:3], cu_q, cu_k, causal=causal, return_lse=True, **kw)
    _close(o, exact[0], f32[0], "out")
    _close(lse, exact[1], f32[1], "lse")
    grads = torch.autograd.grad(o, leaves, do)
    for name, g, e, f in zip("dq dk dv dsinks".split(), grads, exact[2], f32[2], strict=False):
        _close(g, e, f, name)
    if kw.get("deterministic"):
        again = torch.autograd.grad(
            flash_attention.attention_varlen(*leaves[:3], cu_q, cu_k, causal=causal, **kw), leaves, do
        )
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


@pytest.mark.parametrize("alibi", ["plain", "runs", "table", "runs_rows", "table_rows"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_every_family_takes_segments(head_dim, alibi):
    """The segments build of each forward family and each backward family at the launch layer; with ALiBi,
    over sequences of different query and key counts: causal (the AlibiRuns build: each row's diagonal from
    its run), or not (the AlibiTable build: each row's diagonal from the segments' table); and each
    sequence with slopes of its own (AlibiRunsRows, AlibiTableRows: a slope per query row)."""
    causal = not alibi.startswith("table")
    case = ([300, 0, 517, 1, 130], [300, 0, 517, 1, 130], 4, 2, head_dim, True, {}, "bf16")
    if alibi != "plain":
        case = (
            [300, 0, 517, 1, 130],
            [350, 4, 517, 1, 90],
            4,
            2,
            head_dim,
            causal,
            {"alibi_seq": True} if alibi.endswith("rows") else {"alibi_any": True},
            "bf16",
        )
    tensors, kw, used = _make(case)
    q, k, v, do = tensors
    exact = _reference(case, tensors, kw, used, torch.float64)
    f32 = _reference(case, tensors, kw, used, torch.float32)
    cu, cu_k = _offsets(case[0]), _offsets(case[1])
    runs = segments(cu, cu_k, q.shape[0], k.shape[0], causal=causal)
    if alibi.startswith("table"):
        runs = (*runs, alibi_diagonals(cu, cu_k, q.shape[0]))
    if alibi.endswith("rows"):
        kw["alibi_slopes"] = row_slopes(kw["alibi_slopes"], cu, q.shape[0])
    d = padded_head_dim(head_dim)
    n = q.shape[0]
    fwd = {"default": None, "portable": portable_config("bf16", head_dim, False, n, n)}
    bwd = {"default": None, "portable": default_bwd_config("bf16", d, "sm_80", portable=True)}
    if _hopper():
        fwd["sm90"] = classic_hopper_config("bf16", d, n, False)
        if head_dim <= 128:
            bwd["hopper"] = hopper_bwd_config("bf16", d)
        if head_dim == 192:  # the warp-specialized wide backward on both its key blocks (kernel log 140)
            bwd.update({f"hopper_kv{n}": hopper_bwd_config("bf16", d).replace(block_kv=n) for n in (64, 96)})
    args = [t.unsqueeze(0) for t in (q, k, v)]
    # (The runs carry causal; the flag picks configurations, and with ALiBi the build measuring from them.)
    kw = dict(causal=causal, softmax_scale=head_dim**-0.5, segments=runs, alibi_slopes=kw.get("alibi_slopes"))
    for name, cfg in fwd.items():
        o, lse = ops.cuda_forward(*args, return_lse=True, out=None, config=cfg, **kw)
        _close(o[0], exact[0], f32[0], f"{name} forward out")
        _close(lse[0], exact[1], f32[1], f"{name} forward lse")
    o, lse = ops.cuda_forward(*args, return_lse=True, out=None, **kw)
    for name, cfg in bwd.items():
        # (The Hopper backward's deterministic form takes no segments: configs.families says why.)
        for det in (False,) if name.startswith("hopper") else (False, True):
            grads = ops.cuda_backward(do.unsqueeze(0), *args, o, lse, deterministic=det, config=cfg, **kw)
            for gname, g, e, f in zip("dq dk dv".split(), grads, exact[2], f32[2], strict=True):
                _close(g[0], e, f, f"{name} backward (deterministic={det}) {gname}")


def test_a_varlen_call_never_synchronises_with_the_host():
    case = ([300, 0, 517, 1, 130], [300, 0, 517, 1, 130], 4, 2, 128, True, {}, "bf16")
    (q, k, v, _), _, _ = _make(case)
    cu = _offsets(case[0])
    flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)  # compiles, and caches the runs
    cu2 = cu.clone()  # new offsets: the runs are built again, on the device
    with _no_host_sync():
        out = flash_attention.attention_varlen(q, k, v, cu2, cu2, causal=True)
    assert torch.isfinite(out).all()


def test_a_captured_call_reads_the_offsets_it_is_replayed_with():
    # The CUDA-graph pattern: offsets in a static buffer, new values copied in before each replay. The runs
    # must be built inside the graph from that buffer, not taken from the cache of an earlier call on it.
    gen = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(700, 4, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 300, 700], dtype=torch.int32, device="cuda")
    flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)  # compiles, and caches these runs
    _assert_replays_match_eager_calls(q, k, v, cu, (123, 555, 300))


def _assert_replays_match_eager_calls(q, k, v, cu, splits):
    """Capture attention_varlen on the offsets buffer ``cu`` (two sequences of q's 700 rows), then for each
    split copy new offsets into it, replay, and compare with an eager call on a fresh copy of them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (a warm-up on the capture's stream, as torch.cuda.graphs asks)
        flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    for split in splits:
        cu.copy_(torch.tensor([0, split, 700], dtype=torch.int32))
        graph.replay()
        fresh = cu.clone()
        expected = flash_attention.attention_varlen(q, k, v, fresh, fresh, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), split


def _offsets_case():
    """bf16 CUDA q, k, v of 700 rows and keys (4 heads, head_dim 64), as test_a_captured_call's."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    return [torch.randn(700, 4, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]


def _cuda(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def test_the_opt_in_offsets_check_raises_on_the_device(monkeypatch):
    # FLASH_ATTENTION_CHECK_OFFSETS=1: the CPU's check (flash_attention.spec.validate_varlen), run with ops on
    # the device; valid offsets give the unchecked call's answer.
    q, k, v = _offsets_case()
    monkeypatch.setenv("FLASH_ATTENTION_CHECK_OFFSETS", "1")
    good = _cuda([0, 300, 700])
    bad = {
        "cu_seqlens_q must be non-decreasing; cu_seqlens_q[2] = 200 < cu_seqlens_q[1] = 300": (
            _cuda([0, 300, 200, 700]),
            _cuda([0, 300, 600, 700]),
            None,
        ),
        "cu_seqlens_k[2] = 701 is past the end of k (k.shape[0] = 700 keys)": (
            good,
            _cuda([0, 300, 701]),
            None,
        ),
        "seqused_k[1] = 401 exceeds sequence 1's 400 keys": (good, good, _cuda([300, 401])),
    }
    for error, (cu_q, cu_k, used) in bad.items():
        with pytest.raises(ValueError, match=re.escape(error)):
            flash_attention.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, causal=True)
    checked = flash_attention.attention_varlen(q, k, v, good, good, causal=True)
    monkeypatch.delenv("FLASH_ATTENTION_CHECK_OFFSETS")
    fresh = good.clone()
    assert torch.equal(checked, flash_attention.attention_varlen(q, k, v, fresh, fresh, causal=True))


def test_without_the_opt_in_bad_offsets_are_not_read(monkeypatch):
    # The default: no host read of the offsets, even bad ones (wrong rows, never an out-of-bounds access).
    q, k, v = _offsets_case()
    monkeypatch.delenv("FLASH_ATTENTION_CHECK_OFFSETS", raising=False)
    flash_attention.attention_varlen(q, k, v, _cuda([0, 300, 700]), _cuda([0, 300, 700]), causal=True)
    bad_q, bad_k = _cuda([0, 300, 200, 700]), _cuda([5, 300, 900, 800])
    with _no_host_sync():
        out = flash_attention.attention_varlen(q, k, v, bad_q, bad_k, causal=True)
    torch.cuda.synchronize()  # (a fault would surface here)
    assert out.shape == q.shape


def test_the_opt_in_offsets_check_lets_a_cuda_graph_be_captured(monkeypatch):
    # With the check asked for, a captured call skips it (the read would fail the capture), and a replay
    # with new offsets copied in agrees with a checked eager call on them.
    q, k, v = _offsets_case()
    monkeypatch.setenv("FLASH_ATTENTION_CHECK_OFFSETS", "1")
    _assert_replays_match_eager_calls(q, k, v, _cuda([0, 300, 700]), (123, 555))


def _tile_table_case(lens_q, lens_k, head_dim, causal):
    """A packed batch for the tile-table tests: its tensors (q, k, v, dO), the float64 and float32
    references, the offsets, the runs with their tables (built at the first launch that needs them), and
    q, k, v as a batch of one."""
    case = (lens_q, lens_k, 4, 2, head_dim, causal, {}, "bf16")
    tensors, kw, used = _make(case)
    q, k = tensors[0], tensors[1]
    exact = _reference(case, tensors, kw, used, torch.float64)
    f32 = _reference(case, tensors, kw, used, torch.float32)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    runs = _with_tiles(segments(cu_q, cu_k, q.shape[0], k.shape[0], causal=causal), cu_q, cu_k)
    batched = [t.unsqueeze(0) for t in tensors[:3]]
    return tensors, exact, f32, (cu_q, cu_k), runs, batched


# Each epilogue path of the warp-specialized forward under a query-tile table: non-persistent with TMA stores,
# persistent with and without them, the epilogue under the next tile (tile_overlap), ping-pong; 176-key
# blocks (anchored at each tile's first key, so the last block of a sequence is cut anywhere), dropout (no
# TMA store there).
WS_TILE_CONFIGS = [
    ws_config("bf16", 128, 128, 128, 2, overlap=True, tma_store=True),
    ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True, tma_store=True, tile_overlap=True),
    ws_config("bf16", 128, 128, 176, 2, overlap=True, pingpong=True, tma_store=True),
    ws_config("bf16", 64, 192, 64, 3, persistent=True),
    ws_config("bf16", 256, 64, 64, 2, persistent=True, tma_store=True),
]


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cfg", WS_TILE_CONFIGS, ids=lambda c: c.name())
@pytest.mark.parametrize("causal", [True, False])
def test_ws_forward_with_query_tiles(cfg, causal):
    """The warp-specialized forward with a packed batch's query-tile table (each sequence's own tiles,
    blocks anchored at its first key): every row written once (the output poisoned first), within the
    error bound of float64, and the same result as the packed row's tiles within rounding."""
    d = cfg.head_dim
    # Sequences ending anywhere in a tile (so the last tile of most is cut), an empty one, a one-token one,
    # and rows past the last sequence.
    lens = [300, 0, 517, 1, 130, 64, 1000]
    (q, k, _, _), exact, f32, (cu, _), runs, args = _tile_table_case(lens, lens, d, causal)
    kw = dict(causal=causal, softmax_scale=d**-0.5, segments=runs)
    out = torch.full_like(args[0], float("nan"))
    o, lse = ops.cuda_forward(*args, return_lse=True, out=out, config=cfg, **kw)
    assert cfg.block_q in runs[0]._query_tiles  # the launch built and bound the table for its tile height
    _close(o[0], exact[0], f32[0], "out")
    _close(lse[0], exact[1], f32[1], "lse")
    plain = segments(cu, cu, q.shape[0], k.shape[0], causal=causal)  # no table: the packed row's tiles
    o2, _ = ops.cuda_forward(*args, return_lse=True, out=None, config=cfg, **{**kw, "segments": plain})
    assert (o2.float() - o.float()).abs().max().item() < 2e-2
    # With dropout (its build stores O without TMA): the same keep mask whichever tiles ran.
    drop = dict(dropout_p=0.25, dropout_seed=torch.tensor([7, 0]))
    od, _ = ops.cuda_forward(*args, return_lse=True, out=None, config=cfg, **kw, **drop)
    kw2 = {**kw, "segments": plain}
    od2, _ = ops.cuda_forward(*args, return_lse=True, out=None, config=cfg, **kw2, **drop)
    assert torch.isfinite(od).all() and (od.float() - od2.float()).abs().max().item() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_ws_backward_with_key_tiles(head_dim, causal):
    """The warp-specialized dK/dV kernel with a packed batch's key-tile table (each sequence's keys in tiles
    of their own, their query blocks anchored at the sequence's first row, over a workspace laid out by
    sequence): against float64, every key's dK and dV and every row's dQ written (memory poisoned with NaN
    first), and the packed row's tiles' result within rounding."""
    lens_q = [300, 0, 517, 1, 130, 64, 1000]
    lens_k = [310, 4, 517, 1, 200, 64, 990]
    (q, k, _, do), exact, f32, (cu_q, cu_k), runs, args = _tile_table_case(lens_q, lens_k, head_dim, causal)
    kw = dict(causal=causal, softmax_scale=head_dim**-0.5, segments=runs)
    o, lse = ops.cuda_forward(*args, return_lse=True, out=None, **kw)
    cfg = hopper_bwd_config("bf16", head_dim)
    poison = torch.full((64 << 20,), float("nan"), device="cuda")  # freed: the gradients' memory next
    del poison
    grads = ops.cuda_backward(do.unsqueeze(0), *args, o, lse, deterministic=False, config=cfg, **kw)
    # The launch built (and bound) both tables.
    assert cfg.block_kv in runs[1]._key_tiles and "units" in runs[0]._query_tiles
    for gname, g, e, f in zip("dq dk dv".split(), grads, exact[2], f32[2], strict=True):
        _close(g[0], e, f, f"{gname}")
    plain = segments(cu_q, cu_k, q.shape[0], k.shape[0], causal=causal)
    again = ops.cuda_backward(
        do.unsqueeze(0), *args, o, lse, deterministic=False, config=cfg, **{**kw, "segments": plain}
    )
    for a, b in zip(grads, again, strict=True):
        assert (a.float() - b.float()).abs().max().item() < 3e-2


@pytest.mark.parametrize("head_dim,heads", [(64, 4), (128, 16)])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_repeat_calls_equal_the_whole_path(head_dim, heads, causal, monkeypatch):
    """Inference calls of one signature with other sequence boundaries each (flash_attention.ops.repeat binds
    each call's runs, query-tile table and, for the persistent grid of 16 heads at head_dim 128 on Hopper,
    the stream's tile counter): bit for bit what the whole path computes for the same calls."""
    from flash_attention.ops import repeat

    gen = torch.Generator(device="cuda").manual_seed(head_dim + heads + causal)
    q, k, v = (
        torch.randn(1024, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in "qkv"
    )
    batches = ([300, 512, 212], [512, 512, 0], [100, 400, 524], [1, 1022, 1])

    def run():
        made = []
        for lens in batches:
            cu = _offsets(lens)
            made.append(
                flash_attention.attention_varlen(
                    q, k, v, cu, cu, max_seqlen_q=512, max_seqlen_k=512, causal=causal, return_lse=True
                )
            )
        return made

    repeat.clear()
    got = run()
    monkeypatch.setattr(repeat, "MODE", "off")
    want = run()
    for (o, lse), (o2, lse2) in zip(got, want, strict=True):
        assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,heads", [(64, 4), (128, 16)])
def test_packed_training_repeats_equal_the_whole_path(head_dim, heads, causal, monkeypatch):
    """Training steps of one signature with other sequence boundaries each (the node binds each call's runs,
    the backward's key tiles and workspace units): outputs, dK and dV bit for bit what the whole path computes
    for the same calls (dQ to its rounding: atomics), and gradients against float64 per sequence."""
    from flash_attention.ops import repeat

    gen = torch.Generator(device="cuda").manual_seed(2 * head_dim + heads + causal)
    q, k, v, do = (
        torch.randn(1024, heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in "qkvo"
    )
    batches = ([300, 512, 212], [512, 512, 0], [100, 400, 524], [1, 1022, 1])

    def run():
        made = []
        for lens in batches:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            cu = _offsets(lens)
            out = flash_attention.attention_varlen(
                *leaves, cu, cu, max_seqlen_q=512, max_seqlen_k=512, causal=causal
            )
            made.append((out.detach(), *torch.autograd.grad(out, leaves, do)))
        return made

    from flash_attention.api import attention as interface

    validated = []
    real = interface.validate
    monkeypatch.setattr(interface, "validate", lambda *a, **kw: validated.append(1) or real(*a, **kw))
    repeat.clear()
    got = run()
    assert len(validated) == 1, "the later steps should repeat the first one's launch"
    monkeypatch.setattr(repeat, "MODE", "off")
    want = run()
    for lens, a, b in zip(batches, got, want, strict=True):
        for name, x, y in zip(("out", "dk", "dv"), a[:1] + a[2:], b[:1] + b[2:], strict=True):
            assert torch.equal(x, y), f"{lens} {name}"
        # dQ is added atomically into the workspace, in whatever order the key tiles get there: equal to
        # the bf16 rounding of its largest values, not bit for bit.
        assert (a[1].float() - b[1].float()).abs().max() <= 2**-7 * b[1].float().abs().max(), f"{lens} dq"
    for lens, (_, dq, dk, dv) in zip(batches, got, strict=True):
        cu = _offsets(lens).tolist()
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            if e == s:
                continue
            leaves = [t[s:e].double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
            ref, _ = attention_reference(*leaves, causal=causal)
            exact = torch.autograd.grad(ref, leaves, do[s:e].double().unsqueeze(0))
            for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, strict=True):
                err = (x[s:e].double() - r[0]).abs().max().item()
                assert err < 3e-2, f"{lens} [{s}, {e}) {name}: {err:.3g}"


@pytest.mark.parametrize(
    "alibi", [False, True, "seq"], ids=["causal", "alibi_without_causal", "per_sequence_alibi_causal"]
)
def test_attention_varlen_compiled_whole_against_float64(alibi):
    """torch.compile(fullgraph=True) of attention_varlen: the runs (and ALiBi's table of diagonals, and
    per-sequence slopes' table of each row's) are ops of the graph, and the kernels tile the packed row. One
    graph, two sets of offsets of the same totals, each against float64 per sequence."""
    causal = alibi is not True
    extra = {"alibi_seq": True} if alibi == "seq" else {"alibi_any": True} if alibi else {}

    def forward(q, k, v, cu_q, cu_k, slopes):
        return flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, alibi_slopes=slopes)

    compiled = torch.compile(forward, fullgraph=True, dynamic=False)
    batches = (
        ([300, 7, 517, 1, 130], [411, 3, 517, 20, 130]),
        ([517, 1, 300, 130, 7], [3, 517, 411, 130, 20]),
    )
    for lens_q, lens_k in batches:
        case = (lens_q, lens_k, 4, 2, 128, causal, extra, "bf16")
        tensors, kw, used = _make(case)
        q, k, v, do = tensors
        exact = _reference(case, tensors, kw, used, torch.float64)
        f32 = _reference(case, tensors, kw, used, torch.float32)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = compiled(*leaves, _offsets(lens_q), _offsets(lens_k), kw.get("alibi_slopes"))
        _close(o, exact[0], f32[0], "out")
        grads = torch.autograd.grad(o, leaves, do)
        for name, g, e, f in zip("dq dk dv".split(), grads, exact[2], f32[2], strict=False):
            _close(g, e, f, name)
