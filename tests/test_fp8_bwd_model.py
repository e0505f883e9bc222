"""tools/fp8_bwd_model.py: the float64 model of an FP8 backward's roundings against PyTorch's practice
(docs/fp8-study.md 4.2). Its rounding helpers, and the finding the study records: the bf16 form sits at
practice's error, and every e4m3 rounding of dO or dS puts the gradients far beyond the suite's 2x rule."""

from __future__ import annotations

import torch
from repo_tools import load_tool

model = load_tool("fp8_bwd_model")


def test_roundings():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1, 500.0, -1000.0, 2.0**-10], dtype=torch.float64)
    assert model.e4m3_round(x).tolist() == [
        0.0,
        1.0,
        1.0,
        1.125,
        448.0,
        -448.0,
        0.0,
    ]  # (2^-10: half of the least)
    assert model.power_of_two_scale(torch.tensor(448.0, dtype=torch.float64)).item() == 1.0
    assert model.power_of_two_scale(torch.tensor(449.0, dtype=torch.float64)).item() == 2.0
    ds = torch.randn(130, 260, dtype=torch.float64)
    ds[:64, :128] *= 1e-6  # a tile of small values: under the whole tensor's scale it rounds to zero
    tiles, whole = model.tile_quantized(ds), model.quantized(ds)
    small = ds[:64, :128]
    assert (tiles[:64, :128] - small).abs().max() < (whole[:64, :128] - small).abs().max()


def test_the_bf16_form_is_practice_and_fp8_gradients_are_not():
    ratios = model.case_ratios(128, 64, causal=True, seed=0)
    assert max(ratios["bf16"]) < 2
    assert min(ratios["dO8"][:2]) > 4 and min(ratios["dS8t_only"][:2]) > 4
    assert ratios["dS8t_only"][2] < 2  # (dV does not see dS)
