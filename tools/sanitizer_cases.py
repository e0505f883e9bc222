"""Odd-shaped calls of every kernel family, forward and backward, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python tools/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tools/sanitizer_cases.py --small
    compute-sanitizer --tool synccheck python tools/sanitizer_cases.py --small

Each case draws fresh random inputs, runs ``attention()`` forward and backward on the default path of this
GPU (on Hopper the wgmma kernels, and the portable ones for key ranges, dropout and deterministic mode), and
checks the output against the float64 reference, so a run that the sanitizer passes also computed the right
thing. Lengths are not multiples of any tile, heads are grouped, head dims include ones that are not
multiples of 8. ``--small`` keeps racecheck (which instruments every shared-memory access) within minutes.
The decode cases (``--decode-only`` for just them) run ``attention_with_kvcache`` on the decode kernels:
appends, paged caches of odd page sizes, split merges, an int length, caches of one capacity bucket that
grow between calls (a plan kept across them), and a row whose length is out of range (its output NaN,
nothing outside the cache touched). ``--fp8-only`` runs the e4m3 forward (ops.fp8_forward), its V^T
kernel (ops.fp8_values) and the cast kernels (ops.fp8_cast) on odd lengths, causal and not, grouped heads
and per-head descales.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flash_attention as fa
from flash_attention.fallback.reference import attention_kvcache_reference, attention_reference

#: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, key_range, dropout, deterministic)
CASES = [
    (2, 77, 91, 4, 2, 64, True, False, 0.0, False),
    (1, 130, 257, 4, 1, 128, False, True, 0.0, False),
    (2, 200, 129, 2, 2, 128, True, False, 0.1, False),
    (1, 65, 300, 6, 3, 256, True, False, 0.0, False),
    (1, 150, 150, 4, 4, 96, True, False, 0.0, True),
    (2, 33, 47, 2, 1, 36, False, True, 0.0, False),
    (1, 100, 100, 2, 2, 3, True, False, 0.0, False),
    (1, 64, 1, 2, 2, 192, False, False, 0.0, False),
]
#: deterministic=True: on Hopper the turn-taking forms (fa/dq_turns.cuh) of the warp-specialized backward
#: (head_dim 64, 128) and the wide one (192, 256): causal walks, wrapped ones (two lanes), grouped queries,
#: key ranges and dropout.
DET_CASES = [
    (2, 150, 300, 4, 2, 128, True, False, 0.0, True),
    (1, 300, 200, 4, 4, 128, False, False, 0.0, True),
    (2, 200, 260, 6, 3, 64, False, True, 0.0, True),
    (1, 260, 300, 2, 1, 64, True, True, 0.1, True),
    # the wide kernel's (head_dim 192/256): its third warpgroup's writer
    (2, 150, 300, 4, 2, 256, True, False, 0.0, True),
    (1, 300, 200, 4, 4, 192, False, True, 0.1, True),
]
#: the default (atomic) backward at head_dim 64 and 128: on Hopper the warp-specialized kernel that casts dQ
#: itself (the last block to add into a tile casts it; tiles no block adds into are zeroed): query blocks
#: above every key (causal, more queries than keys), grouped queries, key ranges and dropout.
BWD_ATOMIC_CASES = [
    (2, 300, 140, 4, 2, 64, True, False, 0.0, False),
    (1, 260, 300, 2, 1, 128, True, True, 0.1, False),
    (2, 200, 129, 2, 2, 128, True, False, 0.1, False),
    (1, 130, 257, 4, 1, 128, False, True, 0.0, False),
    # non-causal dropout without key ranges: the builds whose descriptors advance by plain adds (step 179)
    (2, 200, 129, 2, 2, 64, False, False, 0.1, False),
]
#: sliding windows (case, window): every family's window build, forward and backward, atomic and
#: deterministic, with causal, key ranges and dropout.
WINDOW_CASES = [
    ((2, 150, 300, 4, 2, 128, False, False, 0.0, False), (40, 10)),
    ((1, 300, 200, 4, 4, 64, True, True, 0.0, True), (50, -1)),
    ((2, 200, 260, 6, 3, 256, True, False, 0.1, False), (70, 0)),
    ((1, 260, 300, 2, 1, 192, False, True, 0.0, True), (-1, 30)),
    ((1, 100, 100, 2, 2, 40, False, False, 0.0, False), (0, 0)),
    # head_dim 64's narrow windows on 64 x 64 tiles (select.narrow_window_config): causal with grouped heads
    # and lengths off the tiles, and a two-sided window with dropout
    ((2, 333, 333, 4, 2, 64, True, False, 0.0, False), (127, 0)),
    ((1, 190, 260, 4, 1, 64, False, False, 0.1, False), (100, 60)),
]
#: soft-capping through the public call (case, window, softcap): on Hopper the forward without a running max
#: (fa/softmax.cuh bounded_softmax_row, O / L_r), which sums the packed P; rows that see one key (a query
#: length of one, windows of one key, causal with more queries than keys), lengths off every tile, grouped
#: and multi-query heads, each head_dim's build, causal and not, atomic and deterministic backward.
SOFTCAP_CASES = [
    ((1, 1, 1, 4, 1, 128, False, False, 0.0, False), None, 15.0),
    ((2, 77, 91, 4, 2, 64, True, False, 0.0, False), (0, 0), 20.0),
    ((1, 130, 257, 4, 1, 128, False, True, 0.0, False), (0, 0), 15.0),
    ((1, 65, 300, 6, 3, 256, True, False, 0.0, False), (0, 0), 50.0),
    ((2, 200, 129, 2, 2, 128, True, False, 0.0, False), None, 30.0),
    ((1, 150, 150, 4, 4, 96, True, False, 0.0, True), (37, 0), 10.0),
    ((2, 191, 333, 8, 1, 64, False, False, 0.0, False), None, 20.0),
    ((1, 260, 300, 2, 1, 256, False, True, 0.0, True), (64, 3), 50.0),
]
#: score functions (case, softcap, ALiBi): the launch layer's forward and backward on every family's
#: score-function build, atomic and deterministic.
SCORE_CASES = [
    ((2, 150, 300, 4, 2, 128, True, False, 0.0, False), 1.5, False),
    ((1, 300, 200, 4, 4, 64, False, True, 0.0, True), 0.0, True),
    ((2, 200, 260, 6, 3, 256, True, False, 0.0, True), 1.5, False),
    ((1, 260, 300, 2, 1, 192, False, False, 0.0, False), 0.0, True),
    ((2, 150, 300, 4, 2, 128, True, False, 0.0, False), 1.5, True),  # both (SoftcapAlibi)
    # with dropout: the keep mask's hash beside the score function's registers
    ((2, 150, 300, 4, 2, 64, True, False, 0.2, False), 1.5, False),
    ((1, 260, 300, 2, 1, 128, False, True, 0.3, True), 1.5, True),
]
#: Attention sinks (flash_attention.sinks: the forward kernels' epilogue) in every forward family.
SINKS_CASES = [
    (2, 150, 300, 4, 2, 128, True, False, 0.0, False),
    (1, 300, 200, 4, 4, 64, False, True, 0.0, True),
    (2, 200, 260, 6, 3, 256, True, False, 0.0, False),
    (1, 90, 70, 2, 1, 72, True, False, 0.0, False),  # rows with no key (seqlen_q > seqlen_k, causal)
]
#: Packed batches (attention_varlen, the segments builds): (lengths, heads_q, heads_kv, head_dim, causal,
#: deterministic[, key lengths with ALiBi (None: the queries', one offsets tensor)[, slopes per sequence]]),
#: with empty and one-token sequences and rows past the last one. With ALiBi over other key counts, the
#: AlibiRuns build reads each row's run (causal), the AlibiTable build each row's diagonal from its table;
#: with slopes per sequence the "Rows" builds read each row's slope too (AlibiRows: packed self-attention).
VARLEN_CASES = [
    ([130, 0, 257, 1, 64], 4, 2, 128, True, False),
    ([77, 300, 0, 5], 4, 4, 64, False, True),
    ([200, 33, 190], 6, 3, 256, True, False),
    ([90, 1, 141], 2, 1, 72, True, False),
    ([130, 0, 257, 9, 64], 4, 2, 128, True, False, [150, 3, 257, 1, 80]),
    ([130, 0, 257, 9, 64], 4, 2, 128, False, False, [150, 3, 257, 1, 80]),
    ([130, 0, 257, 9, 64], 4, 2, 128, True, False, [150, 3, 257, 1, 80], True),
    ([130, 0, 257, 9, 64], 4, 2, 64, False, False, [150, 3, 257, 1, 80], True),
    ([130, 0, 257, 9, 64], 4, 2, 128, False, False, None, True),  # (None: packed self-attention)
]
#: Offsets that decrease or pass the tensors' ends (the caller's promise broken): the results are wrong by
#: contract, but no access may leave the tensors (attention_varlen's docstring). (cu_q, cu_k, causal,
#: ALiBi slopes: None, "head" or "sequence"), forward and backward at head_dim 128 (the ws kernels) and 64.
BAD_OFFSETS_CASES = [
    ([0, -300, 100, 90], [0, 40, -7, 120], True, "sequence"),
    ([0, -300, 100, 90], [0, 40, -7, 120], False, "head"),
    ([0, 500, 20, 100], [0, 200, 900, 120], True, None),
    ([0, 500, 20, 100], [0, 200, 900, 120], False, "sequence"),
]
SMALL = {1: 40, 2: 60}  # --small: shorter sequences (index into the case tuple -> cap)

#: Hopper only: the warp-specialized kernel's knobs the defaults may not use (the persistent grid's tile
#: hand-off and output staging, three consumer warpgroups, key tiles that are not a power of two,
#: ping-pong, the output's TMA stores, epilogues under the next tile's first S), each on a causal
#: grouped-query call with more query tiles than the GPU has multiprocessors at full size, forward only:
#: (config, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim).
WS_CASES = [
    ("(BF16, 128, 128, 112, 12): wgmma+ws+overlap+pingpong+persistent+stages_2", 3, 1100, 1300, 8, 2, 120),
    ("(BF16, 64, 192, 64, 16): wgmma+ws+persistent+stages_3", 2, 1500, 900, 6, 3, 64),
    ("(BF16, 256, 128, 80, 12): wgmma+ws+overlap+pingpong+stages_2", 1, 333, 517, 4, 2, 256),
    ("(BF16, 64, 192, 128, 16): wgmma+ws+overlap+stages_2", 2, 517, 333, 4, 1, 64),
    # the d64 1k-2k pick: three consumer warpgroups on the persistent grid, whose epilogue derives its
    # per-thread values late (kernel log 181)
    ("(BF16, 64, 192, 128, 16): wgmma+ws+overlap+persistent+tma_store+stages_2", 2, 1100, 1300, 6, 3, 64),
    ("(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+tma_store+stages_2", 3, 1100, 1300, 8, 2, 120),
    ("(BF16, 256, 128, 80, 12): wgmma+ws+overlap+tma_store+stages_2", 1, 333, 517, 4, 2, 256),
    (
        "(BF16, 128, 128, 128, 12): wgmma+ws+overlap+persistent+tma_store+tile_overlap+stages_2",
        3,
        1100,
        1300,
        8,
        2,
        128,
    ),
]


def _inputs(seed: int, b: int, sq: int, sk: int, hq: int, hkv: int, d: int):
    """Fresh random bf16 q, k, v of a case."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(
        torch.randn(b, n, h, d, generator=gen, device="cuda").to(torch.bfloat16)
        for n, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )


def _lengths(sq: int, sk: int, small: bool) -> tuple[int, int]:
    """A case's query and key lengths, cut to SMALL's with ``--small``."""
    return (min(sq, SMALL[1]), min(sk, SMALL[2])) if small else (sq, sk)


def _key_range(ranged: bool, b: int, sk: int) -> torch.Tensor | None:
    """A ranged case's per-row key ranges (row 0 its last three quarters of the keys, row 1 the first
    half), None otherwise."""
    if not ranged:
        return None
    return torch.tensor([[sk // 4, sk], [0, max(1, sk // 2)]][:b], dtype=torch.int32, device="cuda")


def run_case(case, seed: int, small: bool, window=None, softcap: float = 0.0) -> float:
    b, sq, sk, hq, hkv, d, causal, ranged, p, det = case
    sq, sk = _lengths(sq, sk, small)
    q, k, v = (t.requires_grad_() for t in _inputs(seed, b, sq, sk, hq, hkv, d))
    kr = _key_range(ranged, b, sk)
    out = fa.attention(
        q, k, v, causal=causal, key_range=kr, dropout_p=p, dropout_seed=seed, deterministic=det,
        window=window, softcap=softcap,
    )  # fmt: skip
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    assert all(g.isfinite().all() for g in grads)
    if p:
        return 0.0  # dropout's output is checked against the same mask by tests/test_gpu_dropout.py
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, causal=causal, key_range=kr, window=window, softcap=softcap)
    # The gradients too (relative to their largest entry, or absolute below 1: a window of one key per row
    # has dQ = dK = 0 exactly, where only rounding is left): dQ's accumulation and cast are what the
    # backward's modes differ in.
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    grad_err = max(
        ((g.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
        for g, r in zip(grads, ref_grads, strict=True)
    )
    return max((out.double() - ref).abs().max().item(), grad_err)


def run_score_case(case, softcap: float, alibi: bool, seed: int, small: bool) -> float:
    """A score function through ops.cuda_forward / cuda_backward (the public API does not take them yet):
    the output's and gradients' error against float64."""
    from flash_attention import ops
    from flash_attention.dropout import draw_seed, keep_mask

    b, sq, sk, hq, hkv, d, causal, ranged, p, det = case
    sq, sk = _lengths(sq, sk, small)
    q, k, v = _inputs(seed, b, sq, sk, hq, hkv, d)
    kr = _key_range(ranged, b, sk)
    slopes = torch.linspace(0.1, 0.5, hq, device="cuda") if alibi else None
    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=kr, softcap=softcap, alibi_slopes=slopes)
    drop = dict(dropout_p=p, dropout_seed=draw_seed(seed)) if p else {}
    keep = dict(dropout_keep=keep_mask(seed, 0, p, b, hq, sq, sk, device="cuda"), dropout_p=p) if p else {}
    kw |= drop
    o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, **kw)
    do = torch.randn_like(q)
    grads = ops.cuda_backward(do, q, k, v, o, lse, deterministic=det, **kw)
    torch.cuda.synchronize()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(
        *leaves,
        causal=causal,
        key_range=kr,
        softcap=softcap,
        alibi_slopes=None if slopes is None else slopes.double(),
        **keep,
    )
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    grad_err = max(
        ((g.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
        for g, r in zip(grads, ref_grads, strict=True)
    )
    return max((o.double() - ref).abs().max().item(), grad_err)


def run_sinks_case(case, seed: int, small: bool) -> float:
    """Sinks in each forward family (the default, the portable and, on Hopper, the classic sm90 kernel),
    with the backward and the sinks' gradient: the worst error against float64."""
    from flash_attention import ops
    from flash_attention.configs import padded_head_dim, portable_config
    from flash_attention.configs.heuristics import classic_hopper_config
    from flash_attention.sinks import sinks_gradient

    b, sq, sk, hq, hkv, d, causal, ranged, _, det = case
    sq, sk = _lengths(sq, sk, small)
    q, k, v = _inputs(seed, b, sq, sk, hq, hkv, d)
    kr = _key_range(ranged, b, sk)
    sinks = torch.linspace(-1.0, 4.0, hq, device="cuda")
    kw = dict(causal=causal, softmax_scale=d**-0.5, key_range=kr)
    configs = [None, portable_config("bf16", d, causal, sq, sk)]
    if torch.cuda.get_device_capability() == (9, 0):
        configs.append(classic_hopper_config("bf16", padded_head_dim(d), max(sq, sk), causal))
    leaves = [t.double().requires_grad_() for t in (q, k, v)] + [sinks.double().requires_grad_()]
    ref, ref_lse = attention_reference(*leaves[:3], causal=causal, key_range=kr, sinks=leaves[3])
    do = torch.randn_like(q)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    worst = 0.0
    for cfg in configs:
        o, lse = ops.cuda_forward(q, k, v, return_lse=True, out=None, config=cfg, sinks=sinks, **kw)
        grads = (*ops.cuda_backward(do, q, k, v, o, lse, deterministic=det, **kw),
                 sinks_gradient(do, o, lse, sinks))  # fmt: skip
        torch.cuda.synchronize()
        grad_err = max(
            ((g.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
            for g, r in zip(grads, ref_grads, strict=True)
        )
        lse_err = (lse.double() - ref_lse).abs().max().item()
        worst = max(worst, (o.double() - ref).abs().max().item(), lse_err, grad_err)
    return worst


def run_varlen_case(case, seed: int, small: bool) -> float:
    """A packed batch through attention_varlen, forward and backward: the worst error against float64 run
    on each sequence alone (gradients relative to their size)."""
    import flash_attention

    lengths, hq, hkv, d, causal, det = case[:6]
    self_attention = len(case) > 6 and case[6] is None  # (one offsets tensor: AlibiRows)
    key_lengths = case[6] if len(case) > 6 and not self_attention else lengths
    slopes = torch.linspace(0.05, 0.6, hq, device="cuda") if len(case) > 6 else None
    if len(case) > 7 and case[7]:  # each sequence's own slopes
        slopes = torch.rand(len(lengths), hq, device="cuda") * 0.6 + 0.02
    if small:
        lengths = [min(n, SMALL[1]) for n in lengths]
        key_lengths = [min(n, SMALL[1]) for n in key_lengths]
    total = sum(lengths) + 3  # rows past the last sequence
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (
        torch.randn(sum(key_lengths), hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv"
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    if self_attention:
        cu_k = cu
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention.attention_varlen(
        *leaves, cu, cu_k, causal=causal, deterministic=det, alibi_slopes=slopes
    )
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    torch.cuda.synchronize()
    worst = out[sum(lengths) :].abs().max().item()  # rows no sequence owns: 0
    starts, key_starts = cu.tolist(), cu_k.tolist()
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        sl = slice(starts[b], starts[b] + n)
        kl = slice(key_starts[b], key_starts[b + 1])
        ref_leaves = [t[s].double().unsqueeze(0).requires_grad_() for t, s in ((q, sl), (k, kl), (v, kl))]
        own = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b]).double()
        ref, _ = attention_reference(*ref_leaves, causal=causal, alibi_slopes=own)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do[sl].double().unsqueeze(0))
        worst = max(worst, (out[sl].double() - ref[0]).abs().max().item())
        for g, r, s in zip(grads, ref_grads, (sl, kl, kl), strict=True):
            worst = max(worst, ((g[s].double() - r[0]).abs().max() / r.abs().max().clamp_min(1.0)).item())
    return worst


def run_bad_offsets_case(case, seed: int) -> None:
    """attention_varlen forward and backward on offsets that break its contract (BAD_OFFSETS_CASES): run
    to the end and synchronised, for the sanitizers to see every access."""
    import flash_attention

    bounds_q, bounds_k, causal, alibi = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor(bounds_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(bounds_k, dtype=torch.int32, device="cuda")
    for d in (128, 64):
        q = torch.randn(100, 4, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
        k, v = (
            torch.randn(120, 2, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
            for _ in "kv"
        )
        slopes = None
        if alibi is not None:
            slopes = torch.rand(len(bounds_q) - 1 if alibi == "sequence" else 4, device="cuda")
            slopes = slopes[:, None].expand(-1, 4).contiguous() if alibi == "sequence" else slopes
        out = flash_attention.attention_varlen(q, k, v, cu, cu_k, causal=causal, alibi_slopes=slopes)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()


def run_ws_case(case, seed: int, small: bool) -> float:
    from flash_attention import ops
    from flash_attention.configs import parse_config

    name, b, sq, sk, hq, hkv, d = case
    if small:
        sq, sk = min(sq, 3 * SMALL[1]), min(sk, 3 * SMALL[2])
    q, k, v = _inputs(seed, b, sq, sk, hq, hkv, d)
    out = torch.full_like(q, float("nan"))
    o, lse = ops.cuda_forward(
        q, k, v, causal=True, softmax_scale=d**-0.5, return_lse=True, out=out, config=parse_config(name)
    )
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, causal=True)
    return (o.double() - ref).abs().max().item()


#: Hopper only: the head_dim-192/256 wgmma backwards (csrc/kernels/sm90/bwd_wide, bwd_wide_ws) named
#: explicitly, gradients against float64: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
#: key_range, dropout_p).
WIDE_BWD_CASES = [
    (1, 65, 300, 6, 3, 256, True, False, 0.0),
    (2, 130, 77, 4, 1, 200, False, False, 0.0),
    (1, 1, 129, 2, 2, 256, True, False, 0.0),
    (2, 77, 130, 4, 2, 192, True, False, 0.0),
    (2, 100, 190, 4, 2, 256, True, True, 0.0),
    (2, 90, 140, 2, 1, 192, False, True, 0.0),
    (1, 80, 150, 4, 2, 256, True, False, 0.2),
    (2, 70, 110, 2, 2, 192, False, False, 0.2),
]


def run_wide_bwd_case(case, seed: int, small: bool) -> float:
    from flash_attention import ops
    from flash_attention.configs import hopper_bwd_config
    from flash_attention.dropout import draw_seed

    b, sq, sk, hq, hkv, d, causal, ranged, p = case
    sq, sk = _lengths(sq, sk, small)
    q, k, v = _inputs(seed, b, sq, sk, hq, hkv, d)
    do = torch.randn_like(q)
    kr = _key_range(ranged, b, sk)
    extra = {"key_range": kr, "dropout_p": p, "dropout_seed": draw_seed(seed) if p else None}
    o, lse = ops.cuda_forward(
        q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=None, **extra
    )
    # Without dropout the warp-specialized wide kernel (bwd_wide_ws, the default at 192 and 256) and, at
    # 192, that one on its other key block (64 beside the default's 96, kernel log 140) and the wide one too
    # (selectable there, and the dropout and deterministic calls' kernel); with dropout the wide one.
    padded = 192 if d <= 192 else 256
    forms = [hopper_bwd_config("bf16", padded, warp_specialized=not p)]
    if d <= 192 and not p:
        other = 64 if forms[0].block_kv == 96 else 96
        forms += [forms[0].replace(block_kv=other), hopper_bwd_config("bf16", padded, warp_specialized=False)]

    def errors_of(configs, q, k, v, do, o, lse) -> list[float]:
        """Each config's backward against float64 autograd, the largest error relative to the gradient's
        scale (256-wide rows of bf16 products)."""
        ref = None
        errors = []
        for cfg in configs:
            grads = ops.cuda_backward(
                do, q, k, v, o, lse, causal=causal, softmax_scale=d**-0.5, config=cfg, **extra
            )  # fmt: skip
            torch.cuda.synchronize()
            assert all(g.isfinite().all() for g in grads)
            if p:
                errors.append(0.0)  # against the same mask: tests/test_gpu_sm90_bwd_wide.py
                continue
            if ref is None:
                leaves = [x.double().requires_grad_() for x in (q, k, v)]
                ref_o, _ = attention_reference(*leaves, causal=causal, key_range=kr)
                ref = torch.autograd.grad(ref_o, leaves, do.double())
            errors.append(
                max(
                    (g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                    for g, r in zip(grads, ref, strict=True)
                )
            )
        return errors

    errors = errors_of(forms, q, k, v, do, o, lse)
    if d == 192 and not p:
        # v's own head_dim, 128 (kernel log 141): the kernel reading V, dO and dV at their width, on 64- and
        # 96-key blocks.
        v, do = v[..., :128].contiguous(), do[..., :128].contiguous()
        o, lse = ops.cuda_forward(
            q, k, v, causal=causal, softmax_scale=d**-0.5, return_lse=True, out=None, **extra
        )
        own = [hopper_bwd_config("bf16", 192).replace(head_dim_v=128, block_kv=kv) for kv in (64, 96)]
        errors += errors_of(own, q, k, v, do, o, lse)
    return max(errors)


#: (batch, seqlen_q, heads_q, heads_kv, head_dim, seqlen_new, page_size, capacity, lengths, num_splits):
#: lengths an int (every row's, passed by value) or one per row; a length past the capacity poisons its row.
DECODE_CASES = [
    (3, 1, 8, 2, 128, 1, 0, 300, [0, 150, 299], 0),
    (2, 4, 8, 8, 64, 4, 16, 320, [1, 250], 3),
    (2, 16, 16, 2, 128, 0, 1, 90, [37, 90], 2),
    (2, 1, 32, 8, 128, 0, 0, 2049, 2049, 0),
    (2, 1, 32, 8, 128, 0, 0, 2300, 2300, 0),  # the bucket of the case above: its plan, a longer cache
    (2, 3, 12, 4, 256, 2, 64, 200, [30, 500], 0),  # row 1 out of range: NaN, nothing written
    (2, 8, 16, 2, 64, 8, 16, 300, [5, 280], 0),  # 64 packed rows: on Hopper the wgmma kernel, paged
    (1, 16, 32, 8, 128, 0, 0, 1500, [1400], 3),  # 64 rows, contiguous, split
    # 64 rows on a grid of 320 row blocks: on Hopper the wgmma kernel, answers direct and as split partials
    (40, 16, 32, 8, 128, 2, 16, 200, [4 * i for i in range(40)], 0),
    (40, 16, 32, 8, 64, 0, 0, 200, [5 * i for i in range(40)], 3),
]


#: A decode case with (window, softcap, ALiBi slopes' dims): Gemma 2's sliding layers decode with a window
#: and soft-capping, Mistral's with a window; the window starts inside the caches (paged and contiguous), so
#: the splits cover it alone. ALiBi per head and per (row, head).
DECODE_VARIANT_CASES = [
    ((2, 1, 32, 8, 128, 1, 16, 2048, [2000, 700], 3), (255, -1), 30.0, 0),
    ((3, 16, 16, 4, 64, 0, 0, 600, [590, 100, 16], 0), (40, 0), 0.0, 0),
    ((2, 4, 8, 2, 256, 2, 64, 512, [500, 300], 2), None, 20.0, 0),
    ((2, 1, 32, 8, 128, 1, 16, 1024, [1000, 77], 0), None, 0.0, 1),
    ((2, 16, 16, 4, 128, 0, 0, 700, [650, 200], 0), (100, -1), 0.0, 2),
]


def run_decode_case(case, seed: int, window=None, softcap: float = 0.0, alibi: int = 0) -> float:
    """Max error of one decode call (and of the caches after its append) against the float64 reference, over
    the rows whose length is in range; a row out of range must come back NaN."""
    b, sq, hq, hkv, d, s_new, page, cap, lengths, splits = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    table = None
    if page:
        per_row = -(-cap // page)
        table = torch.randperm(b * per_row, device="cuda").int().reshape(b, per_row)
        k_cache, v_cache = rand(b * per_row, page, hkv, d), rand(b * per_row, page, hkv, d)
    else:
        k_cache, v_cache = (rand(b, hkv, cap, d).transpose(1, 2) for _ in range(2))  # transformers' layout
    q = rand(b, sq, hq, d)
    k, v = (rand(b, s_new, hkv, d), rand(b, s_new, hkv, d)) if s_new else (None, None)
    slopes = None
    if alibi:
        shape = (hq,) if alibi == 1 else (b, hq)
        slopes = torch.rand(shape, device="cuda", generator=gen) * 0.2 + 0.005
    per_row = lengths if isinstance(lengths, list) else [lengths] * b
    good = [n + s_new <= cap for n in per_row]
    lens = lengths if isinstance(lengths, int) else torch.tensor(lengths, device="cuda", dtype=torch.int32)
    ref_lens = torch.tensor([min(n, cap - s_new) for n in per_row], device="cuda", dtype=torch.int32)
    refs = attention_kvcache_reference(
        q.double(), k_cache.double(), v_cache.double(), None if k is None else k.double(),
        None if v is None else v.double(), cache_seqlens=ref_lens, block_table=table, causal=True,
        window=window, softcap=softcap, alibi_slopes=slopes,
    )  # fmt: skip
    out = fa.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, num_splits=splits, window=window,
        softcap=softcap, alibi_slopes=slopes,
    )  # fmt: skip
    torch.cuda.synchronize()
    err = 0.0
    for row, ok in enumerate(good):
        if ok:
            err = max(err, (out[row].double() - refs[0][row]).abs().max().item())
        elif not out[row].isnan().all():
            return float("inf")
    if all(good):  # the caches after the append
        err = max(
            err,
            (k_cache.double() - refs[2]).abs().max().item(),
            (v_cache.double() - refs[3]).abs().max().item(),
        )
    return err


#: (batch, rows, heads, head_dim, part dtype): the LSE merge kernel (ring attention's per-step merge) on a row
#: view of a larger running result; head_dim 256 puts a row's threads in two warps (the kernel's barrier).
MERGE_CASES = [
    (2, 333, 5, 128, torch.bfloat16),
    (1, 100, 3, 256, torch.float16),
    (3, 77, 4, 72, torch.float32),
]


def run_merge_case(case, seed: int) -> float:
    """Max difference of the merge kernel from its PyTorch form, rows without keys on either side included;
    the rows around the view must stay as they were."""
    from flash_attention.ops.merge import lse_merge_, lse_merge_reference

    b, n, h, d, part_dtype = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(b, n + 9, h, d, device="cuda", generator=gen)
    lse = torch.randn(b, h, n + 9, device="cuda", generator=gen)
    part = torch.randn(b, n, h, d, device="cuda", generator=gen).to(part_dtype)
    part_lse = torch.randn(b, h, n, device="cuda", generator=gen)
    lse[:, 0, 4:20] = float("-inf")
    part_lse[:, 0, :10] = float("-inf")
    want_out, want_lse = out.clone(), lse.clone()
    lse_merge_reference(want_out[:, 4:-5], want_lse[:, :, 4:-5], part, part_lse)
    lse_merge_(out[:, 4:-5], lse[:, :, 4:-5], part, part_lse)
    torch.cuda.synchronize()
    finite = torch.isfinite(want_lse)
    if not torch.equal(finite, torch.isfinite(lse)):
        return float("inf")
    return max((out - want_out).abs().max().item(), (lse[finite] - want_lse[finite]).abs().max().item())


#: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, head_dim): the e4m3 forward and its V^T kernel;
#: lengths off every tile (the kernel's 128-query and 128-key tiles, V^T's 16-key groups); head_dim 64 reads
#: Q and K through the 64-byte swizzle and V^T through its row-pair layout.
FP8_CASES = [
    (1, 333, 1024, 4, 2, True, 128),
    (2, 333, 1024, 2, 1, False, 128),
    (1, 77, 129, 2, 2, True, 128),
    (1, 333, 1024, 4, 2, True, 64),
    (2, 77, 129, 2, 1, False, 64),
    (1, 333, 1024, 4, 2, True, 256),
    (2, 77, 129, 2, 1, False, 256),
]


def run_fp8_case(case, seed: int) -> float:
    """Largest error of the e4m3 forward against the float64 reference on its exactly dequantized inputs,
    relative to the output's largest entry (P rounds to e4m3: tests/test_gpu_fp8_forward.py holds the
    element-wise bound), and 1.0 if the V^T kernel's or the cast kernels' bytes differ from their PyTorch
    forms. The lengths stay
    as they are under ``--small``: a forward of a few blocks is quick under racecheck, and a cut would leave
    one tile."""
    from flash_attention.ops import fp8_cast
    from flash_attention.ops.fp8_forward import cuda_forward_e4m3
    from flash_attention.ops.fp8_values import transposed_values, transposed_values_reference
    from flash_attention.spec import fp8 as spec_fp8

    b, sq, sk, hq, hkv, causal, d = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        (torch.randn(b, n, h, d, generator=gen, device="cuda") * c).clamp(-448, 448).to(torch.float8_e4m3fn)
        for n, h, c in ((sq, hq, 30.0), (sk, hkv, 60.0), (sk, hkv, 2.0))
    )
    descales = [torch.rand(b, hkv, generator=gen, device="cuda") * f + f for f in (0.01, 0.005, 0.4)]
    out, _ = cuda_forward_e4m3(
        q, k, v, causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2]
    )
    vt = transposed_values(v)
    torch.cuda.synchronize()
    if not torch.equal(vt.view(torch.uint8), transposed_values_reference(v).view(torch.uint8)):
        return 1.0
    # The cast kernels (ops.fp8_cast): attention(fp8=True)'s quantizing of a bf16 tensor and the backward's
    # dequantizing, checked on the CPU (racecheck reports PyTorch's own bf16 amax reduction on the GPU, so
    # spec.fp8's GPU form is not run here; tests/test_gpu_fp8_cast.py compares the two byte for byte): each
    # descale a power of two within a factor of two above amax / 448, the bytes x * (1 / descale) clamped
    # and rounded to e4m3, the dequantized tensor spec.fp8's.
    x = (torch.randn(b, sq, hq, d, generator=gen, device="cuda") * 5).to(torch.bfloat16)
    x8, x_descale = fp8_cast.quantize(x, hkv)
    dequantized = fp8_cast.dequantize(q, descales[0], hkv)
    xc, dc = x.cpu().view(b, sq, hkv, hq // hkv, d), x_descale.cpu()
    amax = xc.float().abs().amax(dim=(1, 3, 4))
    power_of_two = torch.frexp(dc)[0] == 0.5
    fits = (amax <= 448 * dc * (1 + 2**-20)) & (amax > 224 * dc * (1 - 2**-20))
    inverse = (1 / dc).to(torch.bfloat16)[:, None, :, None, None]
    want8 = (xc * inverse).clamp(-448, 448).to(torch.float8_e4m3fn).view(b, sq, hq, d)
    if not (
        power_of_two.all()
        and fits.all()
        and torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8))
        and torch.equal(dequantized.cpu(), spec_fp8.dequantize(q.cpu(), descales[0].cpu(), hkv))
    ):
        return 1.0
    group = hq // hkv
    exact = [
        t.double() * d.double().repeat_interleave(t.shape[2] // hkv, 1).view(b, 1, t.shape[2], 1)
        for t, d in zip((q, k, v), descales, strict=True)
    ]
    exact[1], exact[2] = (t.repeat_interleave(group, 2) for t in exact[1:])
    ref, _ = attention_reference(*exact, causal=causal)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="shorter sequences (for racecheck)")
    ap.add_argument("--ws-only", action="store_true", help="only the warp-specialized kernel's cases")
    ap.add_argument("--decode-only", action="store_true", help="only the decode kernels' cases")
    ap.add_argument(
        "--bwd-det-only", action="store_true", help="only the deterministic backward's cases (Hopper)"
    )
    ap.add_argument("--window-only", action="store_true", help="only the sliding-window cases")
    ap.add_argument("--score-only", action="store_true", help="only the score-function cases")
    ap.add_argument("--softcap-only", action="store_true", help="only the public call's soft-capped cases")
    ap.add_argument("--sinks-only", action="store_true", help="only the attention-sink cases")
    ap.add_argument("--varlen-only", action="store_true", help="only the packed-batch (varlen) cases")
    ap.add_argument("--merge-only", action="store_true", help="only the LSE merge kernel's cases")
    ap.add_argument(
        "--fp8-only", action="store_true", help="only the e4m3 forward's and V^T kernel's cases (Hopper)"
    )
    ap.add_argument(
        "--bwd-atomic-only",
        action="store_true",
        help="only the default (atomic) backward's cases at head_dim 64 and 128",
    )
    ap.add_argument(
        "--bwd-wide-only",
        action="store_true",
        help="only the head_dim-192/256 wgmma backward's cases (Hopper)",
    )
    ap.add_argument(
        "--persistent-blocks",
        type=int,
        default=0,
        help="persistent grids of this many blocks (default: one per multiprocessor); with --small, a few "
        "make each block run several tiles, as the full-size cases do",
    )
    args = ap.parse_args(argv)
    if args.persistent_blocks > 0:
        from flash_attention.ops import forward as ops_forward

        ops_forward.sm_count = lambda index: args.persistent_blocks
    worst = 0.0
    only = (
        args.ws_only
        or args.decode_only
        or args.bwd_wide_only
        or args.bwd_det_only
        or args.bwd_atomic_only
        or args.window_only
        or args.score_only
        or args.softcap_only
        or args.sinks_only
        or args.varlen_only
        or args.merge_only
        or args.fp8_only
    )
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for i, case in enumerate(DET_CASES if hopper and (args.bwd_det_only or not only) else []):
        err = run_case(case, seed=400 + i, small=args.small)
        worst = max(worst, err)
        print(f"deterministic backward case {i}: {case} max error {err:.3g}", flush=True)
    for i, (case, cap, alibi) in enumerate(SCORE_CASES if args.score_only or not only else []):
        err = run_score_case(case, cap, alibi, seed=700 + i, small=args.small)
        worst = max(worst, err)
        print(f"score case {i}: {case} softcap {cap} alibi {alibi} max error {err:.3g}", flush=True)
    for i, (case, window, cap) in enumerate(SOFTCAP_CASES if args.softcap_only or not only else []):
        err = run_case(case, seed=750 + i, small=args.small, window=window, softcap=cap)
        worst = max(worst, err)
        print(f"softcap case {i}: {case} window {window} softcap {cap} max error {err:.3g}", flush=True)
    for i, case in enumerate(VARLEN_CASES if args.varlen_only or not only else []):
        err = run_varlen_case(case, seed=900 + i, small=args.small)
        worst = max(worst, err)
        print(f"varlen case {i}: {case} max error {err:.3g}", flush=True)
    for i, case in enumerate(BAD_OFFSETS_CASES if args.varlen_only or not only else []):
        run_bad_offsets_case(case, seed=950 + i)
        print(f"bad offsets case {i}: {case} ran (its values are not checked)", flush=True)
    for i, case in enumerate(MERGE_CASES if args.merge_only or not only else []):
        err = run_merge_case(case, seed=1000 + i)
        worst = max(worst, err)
        print(f"merge case {i}: {case} max difference {err:.3g}", flush=True)
    for i, case in enumerate(FP8_CASES if hopper and (args.fp8_only or not only) else []):
        err = run_fp8_case(case, seed=1100 + i)
        worst = max(worst, err)
        print(f"fp8 case {i}: {case} max error (relative to the output's largest) {err:.3g}", flush=True)
    for i, case in enumerate(SINKS_CASES if args.sinks_only or not only else []):
        err = run_sinks_case(case, seed=800 + i, small=args.small)
        worst = max(worst, err)
        print(f"sinks case {i}: {case} max error {err:.3g}", flush=True)
    for i, (case, window) in enumerate(WINDOW_CASES if args.window_only or not only else []):
        err = run_case(case, seed=600 + i, small=args.small, window=window)
        worst = max(worst, err)
        print(f"window case {i}: {case} window {window} max error {err:.3g}", flush=True)
    for i, case in enumerate(BWD_ATOMIC_CASES if args.bwd_atomic_only or not only else []):
        err = run_case(case, seed=500 + i, small=args.small)
        worst = max(worst, err)
        print(f"atomic backward case {i}: {case} max error {err:.3g}", flush=True)
    for i, case in enumerate(WIDE_BWD_CASES if hopper and (args.bwd_wide_only or not only) else []):
        err = run_wide_bwd_case(case, seed=300 + i, small=args.small)
        worst = max(worst, err)
        print(f"wide backward case {i}: {case} max error {err:.3g}", flush=True)
    for i, case in enumerate(DECODE_CASES if args.decode_only or not only else []):
        err = run_decode_case(case, seed=200 + i)
        worst = max(worst, err)
        print(f"decode case {i}: {case} max error {err:.3g}", flush=True)
    variant_cases = DECODE_VARIANT_CASES if args.decode_only or not only else []
    for i, (case, window, cap, alibi) in enumerate(variant_cases):
        err = run_decode_case(case, seed=250 + i, window=window, softcap=cap, alibi=alibi)
        worst = max(worst, err)
        what = f"window {window} softcap {cap} alibi {alibi}"
        print(f"decode case with {what}: {case} max error {err:.3g}", flush=True)
    for i, case in enumerate([] if only else CASES):
        err = run_case(case, seed=i, small=args.small)
        worst = max(worst, err)
        print(f"case {i}: {case} max error {err:.3g}", flush=True)
    if hopper and (args.ws_only or not only):
        for i, case in enumerate(WS_CASES):
            err = run_ws_case(case, seed=100 + i, small=args.small)
            worst = max(worst, err)
            print(f"ws case {i}: {case} max error {err:.3g}", flush=True)
    ok = worst < 0.05
    print("PASS" if ok else f"FAIL: max error {worst:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
