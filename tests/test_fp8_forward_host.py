"""The e4m3 forward's host path (ops.fp8_forward) on the CPU: how the descales reach the kernel."""

from __future__ import annotations

import pytest
import torch


def test_the_e4m3_calls_descales_reach_the_kernel_as_device_tensors():
    # (ops.fp8_forward: a Python number becomes a one-element tensor; one per (batch, kv head) makes every
    # descale (batch, heads_kv) contiguous, one-element ones broadcast; a wrong shape is named)
    from flash_attention.ops.fp8_forward import _device_descales

    cpu = torch.device("cpu")
    out, sb, sh = _device_descales((0.5, None, torch.tensor([2.0])), 3, 2, cpu)
    assert (sb, sh) == (0, 0) and out[1] is None and out[0].item() == 0.5 and out[2].item() == 2.0
    per_head = torch.rand(3, 2)
    out, sb, sh = _device_descales((0.5, per_head, None), 3, 2, cpu)
    assert (sb, sh) == (2, 1) and out[2] is None
    assert torch.equal(out[0], torch.full((3, 2), 0.5)) and torch.equal(out[1], per_head)
    with pytest.raises(ValueError, match=r"k_descale must hold one number or one per \(batch, kv head\)"):
        _device_descales((None, torch.rand(2, 3), None), 3, 2, cpu)
    with pytest.raises(ValueError, match="v_descale must be float32"):
        _device_descales((None, None, torch.ones(1, dtype=torch.float64)), 3, 2, cpu)
