"""The LSE merge (flash_attention.ops.merge) on the CPU, where it runs its PyTorch form: merging the
attentions of the same rows over two disjoint sets of keys gives the attention over all of them (float64
reference), rows without keys on one side or both included, on views of a larger running result; bad
arguments named. The kernel is checked against this form on the GPU (tests/test_gpu_lse_merge.py)."""

from __future__ import annotations

import pytest
import torch

from flash_attention.fallback.reference import attention_reference
from flash_attention.ops.merge import lse_merge_


def _parts(batch=2, rows=9, heads=3, d=8, keys=11, split=5):
    """q, k, v and the float64 attention of q over keys [0, split) and [split, keys) and over all keys; a
    key range hides every key of one part from batch row 1 (so those rows' part LSE is -inf)."""
    q, k, v = (torch.randn(batch, n, heads, d, dtype=torch.float64) for n in (rows, keys, keys))
    first = attention_reference(q, k[:, :split], v[:, :split])
    hidden = torch.tensor([[0, keys - split], [0, 0]])  # batch row 1 sees none of the second part
    second = attention_reference(q, k[:, split:], v[:, split:], key_range=hidden)
    whole = attention_reference(q, k, v, key_range=torch.tensor([[0, keys], [0, split]]))
    return first, second, whole


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
def test_merging_two_key_sets_is_attention_over_both(part_dtype):
    torch.manual_seed(0)
    (o1, l1), (o2, l2), (ow, lw) = _parts()
    # The running result is a view of rows 3..12 of a larger accumulator, as a ring step's rows are.
    big_out = torch.randn(2, 15, 3, 8)
    big_lse = torch.randn(2, 3, 15)
    out, lse = big_out[:, 3:12], big_lse[:, :, 3:12]
    out.copy_(o1)
    lse.copy_(l1)
    before = big_out.clone()
    lse_merge_(out, lse, o2.to(part_dtype), l2.float())
    tol = 1e-5 if part_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ow, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lw, atol=1e-5, rtol=1e-5)
    # Rows outside the view are untouched.
    torch.testing.assert_close(big_out[:, :3], before[:, :3], atol=0, rtol=0)
    torch.testing.assert_close(big_out[:, 12:], before[:, 12:], atol=0, rtol=0)


def test_rows_without_keys_on_either_side_stay_empty():
    out = torch.zeros(1, 4, 2, 8)
    lse = torch.full((1, 2, 4), float("-inf"))
    part = torch.randn(1, 4, 2, 8)
    part_lse = torch.full((1, 2, 4), float("-inf"))
    part_lse[0, 0, 1] = 0.5  # one row of one head sees a key in the part
    lse_merge_(out, lse, part, part_lse)
    assert torch.equal(out[0, 1, 0], part[0, 1, 0])
    assert lse[0, 0, 1].item() == 0.5
    mask = torch.ones(4, 2, dtype=torch.bool)
    mask[1, 0] = False
    assert torch.equal(out[0][mask], torch.zeros_like(out[0][mask]))
    assert torch.isneginf(lse[0].transpose(0, 1)[mask]).all()


def test_bad_arguments_are_named():
    out, lse = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(TypeError, match="float32"):
        lse_merge_(out.half(), lse, out, lse)
    with pytest.raises(ValueError, match="part_out"):
        lse_merge_(out, lse, torch.zeros(1, 3, 2, 8), lse)
    with pytest.raises(ValueError, match="part_lse"):
        lse_merge_(out, lse, out.clone(), torch.zeros(1, 4, 2))
