"""The LSE merge kernel (csrc/include/fa/lse_merge.cuh) against its PyTorch form on the same random inputs:
every part dtype, head_dims of one and two warps per row and one that is not a multiple of 32, running
results that are row views of a larger accumulator, rows with no key on either side, and a poisoned (NaN)
LSE that must poison its row, never vanish."""

from __future__ import annotations

import pytest
import torch

from flash_attention.ops.merge import lse_merge_, lse_merge_reference

pytestmark = pytest.mark.gpu


def _case(d, part_dtype, rows=333, heads=5, batch=2):
    big_out = torch.randn(batch, rows + 7, heads, d, device="cuda")
    big_lse = torch.randn(batch, heads, rows + 7, device="cuda") * 3
    part = torch.randn(batch, rows, heads, d, device="cuda").to(part_dtype)
    part_lse = torch.randn(batch, heads, rows, device="cuda") * 3
    # Rows whose keys were all masked on one side, and rows with none on either.
    big_lse[0, 1, 10:20] = float("-inf")
    part_lse[0, 1, 15:25] = float("-inf")
    part_lse[1, 2, :5] = float("-inf")
    return big_out, big_lse, part, part_lse


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 72, 128, 256])
def test_kernel_matches_the_pytorch_merge(d, part_dtype):
    torch.manual_seed(d)
    big_out, big_lse, part, part_lse = _case(d, part_dtype)
    want_out, want_lse = big_out.clone(), big_lse.clone()
    lse_merge_reference(want_out[:, 3:-4], want_lse[:, :, 3:-4], part, part_lse)
    lse_merge_(big_out[:, 3:-4], big_lse[:, :, 3:-4], part, part_lse)
    torch.testing.assert_close(big_out, want_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(big_lse, want_lse, atol=2e-6, rtol=2e-6)
    # The rows with no key on either side (running rows 10..19, the part's 15.. of the view at 3) stay -inf.
    assert torch.isneginf(big_lse[0, 1, 18:20]).all()


def test_a_nan_lse_poisons_its_row_only():
    torch.manual_seed(1)
    big_out, big_lse, part, part_lse = _case(128, torch.bfloat16)
    part_lse[1, 3, 100] = float("nan")
    big_lse[0, 0, 50] = float("nan")
    out, lse = big_out[:, :333], big_lse[:, :, :333]
    lse_merge_(out, lse, part, part_lse)
    assert out[1, 100, 3].isnan().all() and lse[1, 3, 100].isnan()
    assert out[0, 50, 0].isnan().all() and lse[0, 0, 50].isnan()
    assert out.isnan().sum() == 2 * 128
