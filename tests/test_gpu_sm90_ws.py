"""GPU tests of the warp-specialized Hopper forward kernel (TMA loads, a producer warpgroup, consumer
warpgroups): the axes the TMA path changes (tails past the sequence, GQA through the K/V tensor maps,
strided layouts, one-row problems, key ranges and dropout) against the float64 reference, NaN-poisoned
outputs and fresh inputs (tests/test_gpu_forward.py's check_case). Every ws config of the sm_90 tuning space
also runs test_gpu_sm90.py's candidate test."""

from __future__ import annotations

import pytest
import torch
from test_gpu_forward import check_case
from test_gpu_sm90 import needs_hopper

from flash_attention import ops
from flash_attention.configs import ws_config
from flash_attention.fallback.reference import attention_reference

pytestmark = pytest.mark.gpu

_CONFIGS = [
    ws_config("bf16", 128, 128, 128, 2),
    ws_config("bf16", 128, 128, 64, 3),
    ws_config("bf16", 64, 128, 128, 2),
    ws_config("bf16", 256, 128, 64, 2),
    ws_config("bf16", 192, 64, 64, 2),
    ws_config("fp16", 128, 64, 128, 2),
    ws_config("bf16", 128, 128, 128, 2, overlap=True),
    ws_config("bf16", 64, 128, 128, 3, overlap=True),
    ws_config("bf16", 256, 128, 64, 2, overlap=True),
    ws_config("fp16", 192, 64, 64, 2, overlap=True),
    ws_config("bf16", 128, 128, 128, 3, overlap=True, pingpong=True),
    ws_config("bf16", 64, 128, 128, 2, pingpong=True),
    ws_config("fp16", 256, 128, 64, 2, pingpong=True),
    ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True),
    ws_config("bf16", 64, 128, 128, 3, overlap=True, pingpong=True, persistent=True),
    ws_config("bf16", 256, 64, 64, 2, persistent=True),
    ws_config("bf16", 128, 128, 112, 2, overlap=True, pingpong=True, persistent=True),
    ws_config("fp16", 128, 64, 128, 2, persistent=True),
    # Three consumer warpgroups, and key tiles that are not a power of two (wgmma N of 80, 96, 112, 176).
    ws_config("bf16", 64, 192, 128, 2, overlap=True),
    ws_config("fp16", 64, 192, 64, 3, persistent=True),
    ws_config("bf16", 256, 128, 80, 2, overlap=True),
    ws_config("bf16", 192, 128, 112, 2, overlap=True),
    ws_config("bf16", 128, 128, 176, 2, overlap=True, pingpong=True),
    ws_config("fp16", 128, 128, 96, 2),
    # The output through TMA stores from each warpgroup's staged rows: persistent (its own staging tile,
    # one or two warpgroups), in the Q tile (two and three warpgroups), with ping-pong, and fp16.
    ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True, tma_store=True),
    ws_config("bf16", 256, 64, 64, 2, persistent=True, tma_store=True),
    ws_config("bf16", 64, 192, 128, 2, overlap=True, tma_store=True),
    ws_config("bf16", 256, 128, 80, 2, overlap=True, tma_store=True),
    ws_config("bf16", 128, 128, 112, 2, overlap=True, pingpong=True, tma_store=True),
    ws_config("fp16", 64, 128, 176, 3, overlap=True, persistent=True, tma_store=True),
    # A tile's epilogue under the next tile's first S (persistent with overlap), with and without TMA stores.
    ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True, tma_store=True, tile_overlap=True),
    ws_config("bf16", 64, 128, 176, 3, overlap=True, persistent=True, tile_overlap=True),
    ws_config("fp16", 256, 64, 64, 2, overlap=True, persistent=True, tma_store=True, tile_overlap=True),
    # Part of P's exponentials as a polynomial on the FMA pipe (exp_poly, kernel log 139): bf16's degree 3
    # and fp16's degree 4, the lazy reference (256), key tiles of 176, three warpgroups.
    ws_config("bf16", 64, 192, 128, 2, overlap=True, tma_store=True).replace(exp_poly=4),
    ws_config("fp16", 64, 128, 176, 3, overlap=True, persistent=True, tile_overlap=True).replace(exp_poly=2),
    ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True, tma_store=True).replace(exp_poly=6),
    ws_config("bf16", 256, 128, 64, 2, overlap=True).replace(exp_poly=8),
]
_SHAPES = [
    # b, sq, sk, hq, hkv, causal, layout
    (2, 333, 517, 8, 2, True, "bshd"),
    (1, 517, 333, 4, 4, True, "bhsd"),
    (3, 129, 4097, 4, 1, False, "padded"),
    (1, 1, 700, 2, 2, True, "bshd"),
    (2, 700, 1, 2, 1, False, "bshd"),
    (1, 64, 64, 1, 1, False, "bshd"),
]


@pytest.fixture
def few_multiprocessors(monkeypatch):
    """Persistent grids of three blocks: each block then runs several tiles of these small problems (the
    K/V ring and the output staging carried from one tile to the next, an epilogue deferred under the next
    tile's first S, an empty tile between two), as the benchmark shapes do on the real 132."""
    from flash_attention.ops import forward as ops_forward

    ops.clear_plans()
    monkeypatch.setattr(ops_forward, "sm_count", lambda index: 3)
    yield
    ops.clear_plans()


@needs_hopper
@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_ws_against_float64(cfg, shape, few_multiprocessors):
    b, sq, sk, hq, hkv, causal, layout = shape
    for d in sorted({cfg.head_dim, cfg.head_dim - 40}):
        check_case(b, sq, sk, hq, hkv, d, cfg.dtype, causal, layout, cfg, seed=sq + d)


@needs_hopper
@pytest.mark.parametrize(
    "overlap, pingpong, persistent, tile_overlap",
    [
        (False, False, False, False),
        (True, False, False, False),
        (True, True, True, False),
        (True, False, True, True),
    ],
)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_ws_key_range_and_dropout(d, overlap, pingpong, persistent, tile_overlap, few_multiprocessors):
    from test_gpu_dropout import _explicit

    from flash_attention.dropout import draw_seed, keep_mask

    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(3, 300, 2, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    knobs = dict(overlap=overlap, pingpong=pingpong, persistent=persistent)
    if tile_overlap:  # (an empty tile, batch row 1, between tiles whose epilogues wait for the next one)
        cfg = ws_config(
            "bf16", d, 64 if d == 256 else 128, 64 if d == 256 else 128, 2, **knobs, tile_overlap=True
        )
    elif persistent and d == 256:  # two consumer warpgroups and an output tile of their own exceed smem
        cfg = ws_config("bf16", d, 64, 64, 2, overlap=True, persistent=True)
    elif overlap and not pingpong:  # the three-consumer block at 64, tiles of 176 and 80 keys at 128 and 256
        cfg = ws_config("bf16", d, 192 if d == 64 else 128, {64: 128, 128: 176, 256: 80}[d], 2, **knobs)
    else:
        cfg = ws_config("bf16", d, 128, 64 if d == 256 else 128, 2, **knobs)
    kr = torch.tensor([[5, 250], [0, 0], [100, 300]], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    o, lse = ops.cuda_forward(
        q, k, v, causal=True, softmax_scale=d**-0.5, return_lse=True, out=out, config=cfg, key_range=kr
    )
    ref, ref_lse = attention_reference(q, k, v, causal=True, key_range=kr)
    assert o is out and not torch.isnan(o).any()
    assert (o.double() - ref).abs().max().item() < 0.02
    seen = torch.isfinite(ref_lse)
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 2e-3
    assert torch.isneginf(lse[~seen]).all() and (o[1] == 0).all()

    p, seed = 0.3, 4321
    o, _ = ops.cuda_forward(
        q, k, v, causal=True, softmax_scale=d**-0.5, return_lse=True, out=None, config=cfg, dropout_p=p,
        dropout_seed=draw_seed(seed),
    )  # fmt: skip
    keep = keep_mask(seed, 0, p, 3, 2, 300, 300, device="cuda")
    want = _explicit(q.double(), k.double(), v.double(), True, keep, p)
    assert (o.double() - want).abs().max().item() < 0.03


@needs_hopper
def test_a_layout_tma_cannot_address_runs_the_sm90_kernel():
    # K/V heads broadcast with a zero stride: the kernels read that in place, a tensor map cannot.
    q = torch.randn(1, 100, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 100, 1, 128, device="cuda", dtype=torch.bfloat16).expand(1, 100, 4, 128)
    with pytest.raises(ValueError, match="has no build for untileable"):
        ops.cuda_forward(
            q, k, k, causal=False, softmax_scale=0.1, return_lse=False, out=None,
            config=ws_config("bf16", 128, 128, 128, 2),
        )  # fmt: skip
    # Without a named config the same call runs the sm90 kernel, which reads the broadcast in place, and
    # chosen_config (what the tools report) names that kernel.
    assert ops.chosen_config(q, q, causal=False, softmax_scale=0.1).warp_specialized
    picked = ops.chosen_config(q, k, k, causal=False, softmax_scale=0.1)
    assert picked.wgmma and not picked.warp_specialized
    o = ops.cuda_forward(q, k, k, causal=False, softmax_scale=0.1, return_lse=False, out=None)[0]
    ref, _ = attention_reference(q, k, k, softmax_scale=0.1)
    assert (o.double() - ref).abs().max().item() < 0.02


@needs_hopper
def test_persistent_tile_counter_is_left_zero_for_the_next_launch():
    # More query tiles than multiprocessors, so the persistent grid draws tiles from its stream's counter;
    # each launch must leave it zero (the next launch on the stream starts from it), on the default stream
    # and on a side stream alike, call after call.
    from flash_attention.ops import forward as fwd

    cfg = ws_config("bf16", 128, 128, 128, 2, overlap=True, persistent=True)
    q, k, v = (torch.randn(2, 1000, 96, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref, _ = attention_reference(q, k, v, causal=True, softmax_scale=0.1)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for _ in range(3):
                o = torch.full_like(q, float("nan"))
                ops.cuda_forward(
                    q, k, v, causal=True, softmax_scale=0.1, return_lse=False, out=o, config=cfg
                )  # fmt: skip
                counter = fwd._TILE_COUNTERS[(q.device.index, stream.cuda_stream)]
                assert counter.tolist() == [0, 0]
                assert (o.double() - ref).abs().max().item() < 0.02
