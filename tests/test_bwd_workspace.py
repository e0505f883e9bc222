"""The backward's memory beyond the gradients (issue 48, item 4): one fp32 workspace per call, linear in the
sequence, whose size the plan states; docs/usage.md's example is this formula's value. Stand-in Hopper GPU:
the plans are the real ones, the kernels stand-ins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from stand_in_gpu import install

import flash_attention as fa
from flash_attention import ops
from flash_attention.ops import backward

ROOT = Path(__file__).resolve().parents[1]


def workspace_floats(batch: int, heads_q: int, seqlen_q: int, head_dim: int) -> int:
    """The atomic mode's workspace, from its definition: per (batch row, query head, query row, the rows
    rounded up to 128): the base-2 LSE and delta, and a dQ accumulator row of the compiled head_dim."""
    rows = batch * heads_q * (-(-seqlen_q // 128) * 128)
    return 2 * rows + rows * head_dim


@pytest.fixture
def hopper(monkeypatch):
    gpu = install(monkeypatch, "sm_90")
    yield gpu
    ops.clear_plans()


def _last_plan():
    return list(backward._plans._plans.values())[-1]


@pytest.mark.parametrize(
    ("b", "s", "hq", "hkv", "d"), [(2, 300, 4, 2, 64), (1, 777, 6, 3, 128), (3, 128, 2, 2, 128)]
)
def test_the_workspace_is_the_stated_formula(hopper, b, s, hq, hkv, d):
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    out = fa.attention(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not hopper.errors, hopper.errors
    plan = _last_plan()
    assert 2 * plan.stats + plan.accum == workspace_floats(b, hq, s, plan.cfg.head_dim)


def test_the_workspace_grows_linearly_with_the_sequence(hopper):
    sizes = []
    for s in (256, 512, 1024):
        q, k, v = (torch.randn(1, s, h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 4, 4))
        out = fa.attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        plan = _last_plan()
        sizes.append(2 * plan.stats + plan.accum)
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 2 * sizes[1]


def test_the_usage_guide_states_the_formula_at_128k_tokens():
    text = (ROOT / "docs" / "usage.md").read_text()
    m = re.search(r"at 128k tokens with 32 query heads and head_dim 128 that is\s+([\d.]+) GB", text)
    assert m, "docs/usage.md no longer states the backward's workspace at 128k tokens"
    assert float(m.group(1)) == round(workspace_floats(1, 32, 131072, 128) * 4 / 1e9, 2)
