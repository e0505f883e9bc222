"""Variable-length batches (flash_attention.api.varlen) on the CPU: the segments' runs against the
per-sequence rule (both orientations, bounds nondecreasing, as the kernels' block ranges need), and
attention_varlen's output, LSE and gradients against the float64 reference run on each sequence alone."""

from __future__ import annotations

import zlib

import pytest
import torch

import flash_attention
from flash_attention.api.varlen import segments
from flash_attention.fallback.reference import attention_reference, window_allowed


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rule(lens_q, lens_k, used, causal, window, total_q, total_k):
    """The (total_q, total_k) boolean relation, sequence by sequence, from the reference's own masks."""
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool)
    q0 = k0 = 0
    for m, n_all, n in zip(lens_q, lens_k, used, strict=True):
        if m and n:
            rel = torch.ones(m, n, dtype=torch.bool)
            if causal:
                rel &= window_allowed(m, n, (-1, 0))
            if window is not None:
                rel &= window_allowed(m, n, window)
            allowed[q0 : q0 + m, k0 : k0 + n] = rel
        q0 += m
        k0 += n_all
    return allowed


CASES = [
    ([5, 0, 17, 1, 30], [7, 3, 17, 4, 30], None, False, None),
    ([5, 0, 17, 1, 30], [7, 3, 17, 4, 30], None, True, None),
    ([9, 12, 0, 40], [9, 12, 0, 40], None, True, (5, 0)),
    ([9, 12, 3, 40], [14, 12, 8, 40], [10, 0, 8, 33], True, None),
    ([20, 31], [25, 31], None, False, (4, 2)),
    ([], [], None, True, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c)[:60])
def test_segments_are_the_per_sequence_rule_in_both_orientations(case):
    lens_q, lens_k, used, causal, window = case
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    total_q, total_k = sum(lens_q) + 3, sum(lens_k) + 2  # rows and keys past the last sequence too
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    row_keys, key_rows = segments(
        cu_q, cu_k, total_q, total_k, causal=causal, window=window, seqused_k=seqused
    )
    assert row_keys.dtype == key_rows.dtype == torch.int32
    assert row_keys.shape == (total_q, 2) and key_rows.shape == (total_k, 2)
    want = _rule(lens_q, lens_k, used or lens_k, causal, window, total_q, total_k)
    cols, rows = torch.arange(total_k), torch.arange(total_q)
    by_rows = (cols[None, :] >= row_keys[:, :1]) & (cols[None, :] < row_keys[:, 1:])
    by_keys = (rows[:, None] >= key_rows[None, :, 0]) & (rows[:, None] < key_rows[None, :, 1])
    assert torch.equal(by_rows, want) and torch.equal(by_keys, want)
    for runs in (row_keys, key_rows):  # the kernels' block ranges assume both bounds nondecreasing
        assert (runs[1:] >= runs[:-1]).all() and (runs[:, 1] >= runs[:, 0]).all()


VARLEN = [
    # (lengths_q, lengths_k, heads_q, heads_kv, head_dim, causal, extra)
    ([5, 0, 17, 1, 30], [7, 3, 17, 4, 30], 4, 2, 16, False, {}),
    ([5, 0, 17, 1, 30], [5, 0, 17, 1, 30], 4, 1, 24, True, {}),
    ([9, 12, 40], [9, 12, 40], 2, 2, 16, True, {"window": (5, 0)}),
    ([9, 12, 40], [9, 20, 40], 4, 2, 16, True, {"softcap": 1.5}),
    ([9, 12, 40], [9, 12, 40], 4, 2, 16, True, {"sinks": True}),
    ([9, 12, 40], [14, 12, 45], 4, 2, 16, True, {"seqused_k": [10, 0, 41]}),
    ([9, 12, 40], [9, 12, 40], 4, 2, 16, True, {"alibi": True}),
    ([9, 12, 40], [9, 12, 40], 4, 2, 16, False, {"alibi": True}),
    # ALiBi with causal: any query and key counts (a sequence with more queries than keys, one with none
    # used), measured from each row's diagonal key
    ([9, 12, 40, 3], [14, 12, 45, 1], 4, 2, 16, True, {"alibi_any": True, "seqused_k": [10, 0, 41, 1]}),
    # ALiBi without causal: any query and key counts, seqused_k and windows (each row's diagonal from a
    # table: flash_attention.api.varlen.alibi_diagonals)
    ([9, 12, 40, 3], [14, 12, 45, 1], 4, 2, 16, False, {"alibi_any": True, "seqused_k": [10, 0, 41, 1]}),
    ([9, 12, 40], [14, 5, 45], 4, 4, 16, False, {"alibi_any": True, "window": (6, 3)}),
    ([9, 12, 40], [14, 5, 45], 4, 2, 16, False, {"alibi_any": True, "softcap": 1.5}),
    # Each sequence with slopes of its own, (batch, heads): a slope per query row in the kernels
    ([9, 12, 0, 40, 1], [9, 12, 0, 40, 1], 4, 2, 16, True, {"alibi_seq": True}),
    ([9, 12, 0, 40, 1], [9, 12, 0, 40, 1], 4, 2, 16, False, {"alibi": True, "alibi_seq": True}),
    ([9, 12, 40, 3], [14, 12, 45, 1], 4, 2, 16, False, {"alibi_seq": True, "seqused_k": [10, 0, 41, 1]}),
    ([9, 12, 40], [14, 5, 45], 4, 4, 16, True, {"alibi_seq": True, "window": (6, 3), "softcap": 1.5}),
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: repr(c)[:70])
def test_attention_varlen_matches_each_sequence_alone(case):
    lens_q, lens_k, hq, hkv, d, causal, extra = case
    torch.manual_seed(zlib.crc32(repr(case).encode()))
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    total_q = sum(lens_q) + 2  # two rows no sequence owns: output 0
    if extra.get("alibi"):  # packed self-attention: one offsets tensor, equal token counts
        cu_k, total_q = cu_q, sum(lens_q)
    q = torch.randn(total_q, hq, d, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, requires_grad=True)
    kw = dict(extra)
    used = lens_k
    if "seqused_k" in kw:
        used = kw["seqused_k"]
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    if kw.pop("alibi", False) or kw.pop("alibi_any", False):
        kw["alibi_slopes"] = torch.linspace(0.1, 0.7, hq)
    if kw.pop("alibi_seq", False):
        kw["alibi_slopes"] = torch.rand(len(lens_q), hq) * 0.7 + 0.05
    sinks = None
    if kw.pop("sinks", False):
        sinks = kw["sinks"] = torch.randn(hq, requires_grad=True)
    out, lse = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (hq, total_q)
    dout = torch.randn_like(out)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, leaves, dout)
    ref_kw = {n: kw[n] for n in ("window", "softcap") if n in kw}
    slopes = kw.get("alibi_slopes")
    dk_ref, dv_ref = torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)
    dsinks_ref = torch.zeros(hq, dtype=torch.float64)
    for b, m in enumerate(lens_q):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ks = slice(int(cu_k[b]), int(cu_k[b]) + used[b])
        if m == 0:
            continue
        if slopes is not None:  # (heads,), or this sequence's own
            ref_kw["alibi_slopes"] = (slopes if slopes.dim() == 1 else slopes[b]).double()
        sl = [q[qs], k[ks], v[ks]] + ([sinks] if sinks is not None else [])
        ref_leaves = [t.detach().double().requires_grad_() for t in sl]
        bq, bk, bv = (t.unsqueeze(0) for t in ref_leaves[:3])
        ro, rl = attention_reference(
            bq, bk, bv, causal=causal, sinks=ref_leaves[3] if sinks is not None else None, **ref_kw
        )
        torch.testing.assert_close(out[qs].double(), ro[0], atol=2e-6, rtol=2e-6)
        finite = torch.isfinite(rl[0])
        assert torch.equal(finite, torch.isfinite(lse[:, qs]))
        torch.testing.assert_close(lse[:, qs].double()[finite], rl[0][finite], atol=2e-6, rtol=2e-6)
        rg = torch.autograd.grad(ro, ref_leaves, dout[qs].double().unsqueeze(0))
        torch.testing.assert_close(grads[0][qs].double(), rg[0], atol=5e-6, rtol=5e-6)
        dk_ref[ks] += rg[1]
        dv_ref[ks] += rg[2]
        if sinks is not None:
            dsinks_ref += rg[3]
    torch.testing.assert_close(grads[1].double(), dk_ref, atol=5e-6, rtol=5e-6)  # unused keys: 0
    torch.testing.assert_close(grads[2].double(), dv_ref, atol=5e-6, rtol=5e-6)
    if sinks is not None:
        torch.testing.assert_close(grads[3].double(), dsinks_ref, atol=5e-6, rtol=5e-6)
    assert not out[sum(lens_q) :].any()  # rows no sequence owns
    if slopes is not None and slopes.dim() == 1 and cu_k is cu_q and not causal:
        # Packed self-attention measures from the packed row; the same offsets in another tensor take the
        # table of diagonals: the same answer.
        again = flash_attention.attention_varlen(q, k, v, cu_q, cu_q.clone(), **kw)
        torch.testing.assert_close(again, out, atol=1e-6, rtol=1e-6)
    if slopes is not None and slopes.dim() == 1:
        # The same slopes given per sequence: the per-row path, the same answer.
        again = flash_attention.attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, **{**kw, "alibi_slopes": slopes.expand(len(lens_q), hq)}
        )
        torch.testing.assert_close(again, out, atol=1e-6, rtol=1e-6)
    if slopes is not None:  # a table of another batch size, or rank, or dtype: refused, naming the argument
        for bad in (torch.rand(len(lens_q) + 1, hq), torch.rand(len(lens_q), hq + 1), torch.rand(1, 2, hq)):
            with pytest.raises(ValueError, match="alibi_slopes"):
                flash_attention.attention_varlen(q, k, v, cu_q, cu_k, **{**kw, "alibi_slopes": bad})
        with pytest.raises(TypeError, match="alibi_slopes"):
            bad = torch.rand(len(lens_q), hq, dtype=torch.float64)
            flash_attention.attention_varlen(q, k, v, cu_q, cu_k, **{**kw, "alibi_slopes": bad})


def test_row_slopes_give_each_row_its_sequences_slopes():
    from flash_attention.api.varlen import row_slopes

    slopes = torch.rand(4, 3)
    cu = _offsets([2, 0, 3, 1])
    rows = row_slopes(slopes, cu, 8)  # two rows past the last sequence: the last sequence's
    assert rows.shape == (8, 3) and rows.is_contiguous() and rows.dtype == torch.float32
    assert torch.equal(rows, slopes[torch.tensor([0, 0, 2, 2, 2, 3, 3, 3])])
    assert torch.equal(row_slopes(torch.rand(0, 3), _offsets([]), 2), torch.zeros(2, 3))
    for bad in (torch.rand(5, 3), torch.rand(3, 3), torch.rand(3)):  # (not one row per sequence)
        with pytest.raises(ValueError, match="alibi_slopes"):
            row_slopes(bad, cu, 8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 2)])
def test_every_visible_pair_shares_its_keys_first_row_sequence_and_shift(causal, window):
    # What the backward's key-row form (fa/variant.cuh score_mod_for_key) rests on: for every (query, key)
    # pair the runs let through, the first query row that sees the key (key_rows[k, 0]) is of the query's
    # sequence, with the same slope row and the same diagonal shift (diagonal(q) - q), whether the diagonal
    # is the runs' end (causal) or the table's; over empty and one-token sequences, seqused_k and tail rows.
    from flash_attention.api.varlen import alibi_diagonals, row_slopes

    gen = torch.Generator().manual_seed(23 + causal)
    for _ in range(60):
        batch = int(torch.randint(1, 6, (1,), generator=gen))
        lens_q = torch.randint(0, 9, (batch,), generator=gen).tolist()
        lens_k = torch.randint(0, 9, (batch,), generator=gen).tolist()
        used = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens_k]
        cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
        total_q, total_k = sum(lens_q) + 2, sum(lens_k) + 1
        seqused = torch.tensor(used, dtype=torch.int32)
        row_keys, key_rows = segments(
            cu_q, cu_k, total_q, total_k, causal=causal, window=window, seqused_k=seqused
        )
        diagonal = (
            (row_keys[:, 1] - 1)
            if causal and window is None
            else alibi_diagonals(cu_q, cu_k, total_q, seqused)
        )
        slopes = row_slopes(torch.rand(batch, 2, generator=gen), cu_q, total_q)
        for qi in range(total_q):
            for kj in range(int(row_keys[qi, 0]), int(row_keys[qi, 1])):
                q0 = int(key_rows[kj, 0])
                assert int(key_rows[kj, 0]) <= qi < int(key_rows[kj, 1])
                assert torch.equal(slopes[q0], slopes[qi])
                assert int(diagonal[q0]) - q0 == int(diagonal[qi]) - qi


def test_the_packed_gradient_flows_through_views_without_a_batched_copy():
    # attention_varlen runs the batched attention on q.unsqueeze(0); taking the batch row back with [0]
    # made autograd's select backward allocate a zeroed (1, total, heads, head_dim) gradient and copy into
    # it on every backward (a fill and a copy of q's size: 0.2 ms at 64k tokens on an H200). A squeeze's
    # backward is a view. The output must leave through one, with the LSE or without.
    cu = _offsets([3, 5])
    q, k, v = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(3))
    out, _ = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    for t in (out, flash_attention.attention_varlen(q, k, v, cu, cu)):
        name = type(t.grad_fn).__name__
        assert "Select" not in name and "Squeeze" in name, name


def test_attention_varlen_refuses_bad_arguments_naming_them():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be"):
        flash_attention.attention_varlen(q[None], q, q, cu, cu)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_attention.attention_varlen(q, q, q, cu.float(), cu)
    with pytest.raises(ValueError, match="same length"):
        flash_attention.attention_varlen(q, q, q, cu, cu[:2])
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\)"):
        flash_attention.attention_varlen(q, q, q, cu, cu, seqused_k=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attention.attention_varlen(q, q, q, cu, cu, max_seqlen_q=-1)


def test_new_offsets_at_a_recycled_address_are_not_taken_for_the_old_ones():
    # The runs' cache is keyed by the offsets' address and version: a fresh offsets tensor of other values,
    # allocated where a freed one was (version 0 both), must not hit the freed one's runs. Every call is
    # checked against each sequence alone; the split moves each time.
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(96, 2, 16, generator=gen) for _ in range(3))
    for split in range(20, 60, 3):
        cu = torch.tensor([0, split, 96], dtype=torch.int32)
        out = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
        for s in (slice(0, split), slice(split, 96)):
            ref, _ = attention_reference(*(t[s].double().unsqueeze(0) for t in (q, k, v)), causal=True)
            torch.testing.assert_close(out[s].double(), ref[0], atol=2e-6, rtol=2e-6)
        del cu, out


def test_offsets_changed_in_place_are_seen():
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(64, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 10, 64], dtype=torch.int32)
    first = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    cu[1] = 40  # (bumps the version)
    second = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    ref, _ = attention_reference(*(t[40:].double().unsqueeze(0) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(second[40:].double(), ref[0], atol=2e-6, rtol=2e-6)
    assert not torch.equal(first, second)


def test_alibi_diagonals_follow_offsets_changed_in_place():
    # The table of diagonals is held by the runs it was made with: offsets refilled in place make new runs,
    # and so a new table (a stale one would measure the first call's distances).
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(64, 2, 16, generator=gen)
    k, v = (torch.randn(80, 2, 16, generator=gen) for _ in range(2))
    slopes = torch.tensor([0.3, 0.7])
    cu_q, cu_k = torch.tensor([0, 10, 64], dtype=torch.int32), torch.tensor([0, 30, 80], dtype=torch.int32)
    first = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    cu_k[1] = 5  # (bumps the version)
    second = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    for qs, ks in ((slice(0, 10), slice(0, 5)), (slice(10, 64), slice(5, 80))):
        pieces = (t[s].double().unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks)))
        ref, _ = attention_reference(*pieces, alibi_slopes=slopes.double())
        torch.testing.assert_close(second[qs].double(), ref[0], atol=2e-6, rtol=2e-6)
    assert not torch.equal(first, second)


def test_per_sequence_slopes_follow_offsets_changed_in_place():
    # Each row's sequence (which row takes which sequence's slopes) is held by the runs it was made with:
    # offsets refilled in place make new runs, so the rows take their new sequences' slopes.
    gen = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(64, 2, 16, generator=gen) for _ in range(3))
    slopes = torch.tensor([[0.05, 0.1], [0.9, 1.3]])
    cu = torch.tensor([0, 10, 64], dtype=torch.int32)
    first = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes)
    cu[1] = 40  # (bumps the version)
    second = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes)
    for b, rows in enumerate((slice(0, 40), slice(40, 64))):
        pieces = (t[rows].double().unsqueeze(0) for t in (q, k, v))
        ref, _ = attention_reference(*pieces, causal=True, alibi_slopes=slopes[b].double())
        torch.testing.assert_close(second[rows].double(), ref[0], atol=2e-6, rtol=2e-6)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "alibi", [False, True, "seq"], ids=["causal", "alibi_without_causal", "per_sequence_alibi_causal"]
)
def test_attention_varlen_compiles_whole_and_follows_new_offsets(alibi):
    # torch.compile(fullgraph=True): the runs (and ALiBi's table of diagonals, and each row's sequence for
    # per-sequence slopes) are ops of the graph, built from the offsets at every call, so one graph serves
    # other sequence boundaries of the same shapes.
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(64, 2, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(70, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    kw = dict(alibi_slopes=torch.tensor([0.3, 0.7])) if alibi else dict(causal=True)
    if alibi == "seq":
        kw = dict(causal=True, alibi_slopes=torch.tensor([[0.3, 0.7], [0.05, 1.1], [0.5, 0.2]]))

    def forward(cu_q, cu_k):
        return flash_attention.attention_varlen(q, k, v, cu_q, cu_k, **kw)

    def step(fn, cu_q, cu_k):
        out = fn(cu_q, cu_k)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    results = []
    for bounds_q, bounds_k in (([0, 10, 40, 64], [0, 12, 30, 70]), ([0, 30, 31, 64], [0, 5, 50, 70])):
        cu_q, cu_k = (torch.tensor(b, dtype=torch.int32) for b in (bounds_q, bounds_k))
        got, want = step(compiled, cu_q, cu_k), step(forward, cu_q, cu_k)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        results.append(got[0])
    assert not torch.equal(*results)  # (the second offsets were not the first's)


def _tiles_of(cu_q, total_q, block_q, cu_k=None, causal=False, total_k=None):
    from flash_attention.api.varlen import _with_tiles
    from flash_attention.ops.query_tiles import key_tiles, query_tiles, tile_count

    cu_k = cu_q if cu_k is None else cu_k
    total_k = int(cu_k[-1]) if total_k is None else total_k
    runs = _with_tiles(segments(cu_q, cu_k, total_q, total_k, causal=causal), cu_q, cu_k)
    table = query_tiles(runs, block_q)
    keys = key_tiles(runs, block_q)
    assert table.dtype == torch.int32 and table.shape == (tile_count(total_q, cu_q.numel() - 1, block_q), 2)
    assert keys.dtype == torch.int32 and keys.shape == (tile_count(total_k, cu_k.numel() - 1, block_q), 8)
    assert query_tiles(runs, block_q) is table and key_tiles(runs, block_q) is keys  # built once
    return runs, table, keys


def _check_tiles(table, total, cu, lengths, extra, block, runs):
    """Every row (key) in exactly one tile, each tile at most ``block`` of one piece (a sequence, or the
    rows after the last one), the unused tail [total, total); ordered by what each tile visits, most
    first (its first row's first key to its last row's last key, or the same for keys)."""
    start, end = table[:, 0].long(), table[:, 1].long()
    used = end > start
    covered = torch.zeros(total, dtype=torch.int64)
    for a, b in zip(start[used].tolist(), end[used].tolist(), strict=True):
        assert b - a <= block
        covered[a:b] += 1
        piece = int(torch.searchsorted(cu[1:].long(), torch.tensor(a), right=True))
        if piece < len(lengths):
            assert int(cu[piece]) <= a and b <= int(cu[piece + 1]), (a, b)
        else:
            assert a >= int(cu[-1])
    assert torch.equal(covered, torch.ones(total, dtype=torch.int64))
    assert ((start == total) & (end == total))[~used].all()
    assert int(used.sum()) == sum(-(-n // block) for n in [*lengths, extra])
    r = runs.long()
    cost = torch.where(
        used, r[(end - 1).clamp(0, max(total - 1, 0)), 1] - r[start.clamp_max(total - 1), 0], -1
    )
    assert (cost[:-1] >= cost[1:]).all()


@pytest.mark.parametrize(
    "lengths, extra, block_q",
    [
        ([130, 0, 257, 1, 64], 0, 64),
        ([300, 5, 0, 0, 900, 128], 77, 128),  # rows past the last sequence
        ([1] * 9, 3, 128),
        ([], 10, 128),  # no sequence: every row is the trailing piece's
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_partition_each_sequence_longest_first(lengths, extra, block_q, causal):
    # Queries and keys of other lengths (each sequence 3 keys more, and 5 keys past the last).
    lengths_k = [n + 3 for n in lengths]
    cu_q, cu_k = _offsets(lengths), _offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]) + extra, int(cu_k[-1]) + 5
    runs, table, keys = _tiles_of(cu_q, total_q, block_q, cu_k=cu_k, causal=causal, total_k=total_k)
    _check_tiles(table, total_q, cu_q, lengths, extra, block_q, runs[0])
    _check_tiles(keys[:, :2], total_k, cu_k, lengths_k, 5, block_q, runs[1])
    _check_anchored_walk(runs, keys, cu_q, cu_k, total_q, total_k)


def _check_anchored_walk(runs, keys, cu_q, cu_k, total_q, total_k, promised=True):
    """The backward's walk over a packed batch as the ws dK/dV kernel takes it from the key tiles (fa/
    block_range.cuh q_blocks_anchored, 64- and 128-row query blocks from the sequence's first row), over the
    workspace laid out by query_units: every visible (row, key) pair is met exactly once, and every
    workspace row a block touches (its statistics, its dQ) lies in its own sequence's units, each of which
    starts a 128-row block (whole 64-row dQ tiles, 16-byte aligned statistics). Offsets that break the
    caller's promise (``promised`` False) may give wrong pairs, but no block leaves its own units."""
    from flash_attention.ops.query_tiles import query_units, unit_count, workspace_rows

    units = query_units(runs)
    assert units.dtype == torch.int32 and units.shape == (unit_count(total_q, cu_q.numel() - 1), 2)
    ws = workspace_rows(runs)
    # The units partition the packed rows, in order; a unit's rows are one piece's.
    covered = torch.zeros(total_q, dtype=torch.int64)
    owner = torch.full((units.shape[0] * 64,), -1, dtype=torch.int64)  # workspace row -> packed row
    for u, (start, count) in enumerate(units.tolist()):
        assert 0 <= count <= 64
        covered[start : start + count] += 1
        owner[u * 64 : u * 64 + count] = torch.arange(start, start + count)
    assert torch.equal(covered, torch.ones(total_q, dtype=torch.int64))
    assert torch.equal(owner[ws], torch.arange(total_q))
    bounds = [0, *[min(max(int(c), 0), total_q) for c in cu_q], total_q]
    for i in range(len(bounds) - 1):
        if bounds[i + 1] > bounds[i]:
            assert int(ws[bounds[i]]) % 128 == 0  # each piece starts a 128-row block
    row_keys, key_rows = (t.long() for t in runs)
    kb = [0, *[int(c) for c in cu_k], total_k]
    for block_q in (64, 128):
        met = torch.zeros(total_q, total_k, dtype=torch.int64)
        for k0, k1, q0, w0, q1, *spare in keys.tolist():
            assert spare == [0, 0, 0]
            if k1 <= k0:
                continue
            piece = next(i for i in range(len(kb) - 1) if kb[i] <= k0 < kb[i + 1] and k1 <= kb[i + 1])
            assert q0 == bounds[piece] and q1 == bounds[piece + 1]  # the matching piece of rows
            # (fa/block_range.cuh q_blocks_anchored: no row past the piece's end)
            lo, hi = int(key_rows[k0, 0]), min(int(key_rows[k1 - 1, 1]), q1)
            if hi <= lo:
                continue
            begin = max(lo - q0, 0) // block_q
            end = -(-(hi - q0) // block_q)
            assert not promised or (q0 + begin * block_q <= lo and hi <= q0 + end * block_q)
            for m in range(begin, end):
                r0 = q0 + m * block_q
                # The block's workspace rows [w0 + m block_q, + block_q) hold its own rows or padding.
                wrows = torch.arange(w0 + m * block_q, w0 + (m + 1) * block_q)
                assert int(wrows[-1]) < owner.numel()
                seen = owner[wrows]
                rows = torch.arange(r0, r0 + block_q)
                assert ((seen == rows) | (seen == -1)).all(), (k0, m)
                # (a padding row's packed row is another sequence's: the runs mask it)
                for r in range(max(r0, 0), min(r0 + block_q, total_q)):
                    a, b = int(row_keys[r, 0]), int(row_keys[r, 1])
                    lo_k, hi_k = max(a, k0), min(b, k1)
                    if hi_k > lo_k and promised:
                        assert int(owner[w0 + r - q0]) == r
                        met[r, lo_k:hi_k] += 1
        if promised:
            visible = torch.zeros(total_q, total_k, dtype=torch.int64)
            for r in range(total_q):
                visible[r, int(row_keys[r, 0]) : int(row_keys[r, 1])] = 1
            assert torch.equal(met, visible)


def test_query_tiles_of_bad_offsets_stay_a_partition_of_the_rows():
    # Offsets that break the caller's promise (decreasing, past the rows): wrong tiles, but every row is in
    # one tile and no tile leaves [0, total_q), so the kernel writes no row twice and none outside q.
    cu_q = torch.tensor([5, 90, 40, 400, 30], dtype=torch.int32)
    _, table, _ = _tiles_of(cu_q, 100, 32, cu_k=torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32))
    start, end = table[:, 0].long(), table[:, 1].long()
    assert (start >= 0).all() and (end <= 100).all() and (end >= start).all()
    covered = torch.zeros(100, dtype=torch.int64)
    for a, b in table.tolist():
        covered[a:b] += 1
    assert torch.equal(covered, torch.ones(100, dtype=torch.int64))


@pytest.mark.parametrize("causal", [False, True])
def test_key_tiles_of_offsets_past_the_tensors_stay_in_their_workspace_rows(causal):
    # The runs are built from the offsets as given, so offsets past the rows give runs past them; a key
    # tile's walk must still end at its piece's last row, or its blocks' statistics and dQ would lie past
    # the workspace (62k floats written past its end at d128 on an H200, before the clamp).
    from flash_attention.api.varlen import _with_tiles

    for cu_q, cu_k in (([0, 1000], [0, 100]), ([0, 5000], [0, 100]), ([0, 40, 900], [0, 30, 100])):
        cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
        runs = _with_tiles(segments(cq, ck, 100, 100, causal=causal), cq, ck)
        from flash_attention.ops.query_tiles import key_tiles

        _check_anchored_walk(runs, key_tiles(runs, 128), cq, ck, 100, 100, promised=False)


def test_tables_describe_the_offsets_the_runs_were_made_from():
    # attention_varlen's runs are made at the forward; the backward's tables later, from offsets noted on
    # the runs. A caller refilling its offsets tensor in place in between (pipelined micro-batches) must not
    # change what those tables say.
    from flash_attention.api.varlen import _cached_segments
    from flash_attention.ops.query_tiles import key_tiles, query_units

    cu = torch.tensor([0, 10, 1000], dtype=torch.int32)
    runs = _cached_segments(cu, cu, 1000, 1000, True, None, None, (500, 500))
    cu.copy_(torch.tensor([0, 990, 1000], dtype=torch.int32))
    fresh = _cached_segments(cu.clone(), cu.clone(), 1000, 1000, True, None, None, (500, 500))
    assert not torch.equal(key_tiles(runs, 128), key_tiles(fresh, 128))
    again = torch.tensor([0, 10, 1000], dtype=torch.int32)
    first = _cached_segments(again, again, 1000, 1000, True, None, None, (500, 500))
    assert torch.equal(key_tiles(runs, 128), key_tiles(first, 128))
    assert torch.equal(query_units(runs), query_units(first))


def test_plans_are_made_per_power_of_two_of_sequences():
    from flash_attention.api.varlen import _with_tiles
    from flash_attention.ops.plans import segment_count
    from flash_attention.ops.query_tiles import query_units, sequence_bucket, tile_count, unit_count

    assert [sequence_bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 64)] == [0, 1, 2, 4, 4, 8, 32, 64]
    counts = set()
    for n in range(5, 9):  # 5..8 documents of one packed length: one plan's grid
        cu = _offsets([40] * (n - 1) + [320 - 40 * (n - 1)])
        runs = _with_tiles(segments(cu, cu, 320, 320, causal=True), cu, cu)
        counts.add(segment_count(runs))
        _, table, keys = _tiles_of(cu, 320, 64)
        assert table.shape[0] == keys.shape[0] == tile_count(320, segment_count(runs), 64)
        assert query_units(runs).shape[0] == unit_count(320, segment_count(runs))
    assert counts == {8}


def test_no_rows_no_tiles():
    _, table, keys = _tiles_of(torch.tensor([0, 0], dtype=torch.int32), 0, 128)
    assert (table == 0).all() and (keys == 0).all()


def test_offsets_rewritten_behind_pytorchs_back_need_clear_cache():
    # The runs are cached by the offsets' address and version; a write through .data keeps the version,
    # so the next call finds the old offsets' runs (wrong sequences) until clear_cache().
    from flash_attention.api.varlen import clear_cache

    torch.manual_seed(5)
    q, k, v = (torch.randn(30, 2, 16) for _ in range(3))
    cu = _offsets([10, 20])
    flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    version = cu._version
    cu.data.copy_(_offsets([25, 5]))
    assert cu._version == version  # (what makes the cache blind to it)
    expected = torch.cat(
        [
            attention_reference(*(t[a:b].unsqueeze(0).double() for t in (q, k, v)), causal=True)[0][0]
            for a, b in ((0, 25), (25, 30))
        ]
    )
    stale = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    assert not torch.allclose(stale.double(), expected, atol=1e-5)
    clear_cache()
    fresh = flash_attention.attention_varlen(q, k, v, cu, cu, causal=True)
    torch.testing.assert_close(fresh.double(), expected, atol=1e-5, rtol=1e-5)
