"""The order in which a causal backward's dK/dV blocks start (fa/kv_block_order.cuh), as the launch layer
chooses it: groups of (K/V head, batch row) pairs whose Q and dO fit the L2 budget, heaviest blocks first
within a group, only for the warp-specialized kernel's causal atomic builds. The kernels' side is the GPU
tests' (tests/test_gpu_sm90_bwd_ws.py: every block computed once under groups of two)."""

from __future__ import annotations

import pytest
import torch
from stand_in_gpu import install

import flash_attention as fa
from flash_attention import ops
from flash_attention.jit.params import BwdParams
from flash_attention.ops import backward


@pytest.mark.parametrize(
    ("pairs", "seqlen_q", "head_dim", "group"),
    [(128, 1024, 128, 1), (64, 4096, 128, 1), (16, 16384, 128, 1), (8, 32768, 256, 4), (3, 128, 64, 2)],
)
def test_a_group_holds_the_pairs_whose_queries_fit_the_l2_budget(pairs, seqlen_q, head_dim, group):
    g = backward.kv_block_group(pairs, seqlen_q, head_dim, group)
    per_pair = 4 * seqlen_q * head_dim * group
    assert 1 <= g <= pairs
    if g < pairs:  # as many as fit, and one more would not (unless even one does not fit)
        assert g == 1 or g * per_pair <= backward.KV_BLOCK_GROUP_L2_BYTES
        assert (g + 1) * per_pair > backward.KV_BLOCK_GROUP_L2_BYTES
    else:
        assert pairs == 1 or (pairs - 1) * per_pair <= backward.KV_BLOCK_GROUP_L2_BYTES


@pytest.fixture
def hopper(monkeypatch):
    gpu = install(monkeypatch, "sm_90")
    yield gpu
    ops.clear_plans()


def _group_of_the_last_plan() -> int:
    plan = list(backward._plans._plans.values())[-1]
    return BwdParams.from_buffer_copy(plan.template).kv_block_group


@pytest.mark.parametrize(
    ("kwargs", "grouped"),
    [
        (dict(causal=True), True),
        (dict(causal=False), False),  # every block has the same work: the grid's own order
        (dict(causal=True, deterministic=True), False),  # its dQ turns need their own order
        (dict(causal=True, window=(40, 0)), False),  # the window build (its blocks' work is even)
    ],
)
def test_only_causal_atomic_backwards_start_heaviest_first(hopper, kwargs, grouped, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_CAUSAL_ORDER", "1")
    b, s, hq, hkv, d = 2, 300, 4, 2, 64
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    out = fa.attention(q, k, v, **kwargs)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not hopper.errors, hopper.errors
    want = backward.kv_block_group(b * hkv, s, d, hq // hkv) if grouped else 0
    assert _group_of_the_last_plan() == want


def test_the_grid_keeps_its_own_order_unless_switched_on(hopper, monkeypatch):
    # Measured slower (kernel log 123): the order is FLASH_ATTENTION_CAUSAL_ORDER=1's alone.
    monkeypatch.delenv("FLASH_ATTENTION_CAUSAL_ORDER", raising=False)
    q, k, v = (torch.randn(2, 300, h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    out = fa.attention(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not hopper.errors, hopper.errors
    assert _group_of_the_last_plan() == 0
