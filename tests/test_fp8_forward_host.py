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


def _e4m3(*shape):
    return torch.randn(*shape).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_only_plain_hopper_calls_at_head_dims_64_128_256_take_the_kernel(monkeypatch):
    from flash_attention.ops import dispatch, fp8_forward

    q, k, v = _e4m3(1, 8, 4, 128), _e4m3(1, 8, 2, 128), _e4m3(1, 8, 2, 128)
    assert not fp8_forward.kernel_takes(q, k, v)  # (CPU tensors)
    # As on a Hopper GPU where kernels can be built: the device facts alone are faked (the dtype check of
    # dispatch.usable_backend, which refuses e4m3, must not be on this path).
    monkeypatch.setattr(dispatch, "wants_kernel", lambda t: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(fp8_forward, "device_unavailable_reason", lambda index: None)
    monkeypatch.setattr(fp8_forward, "device_arch", lambda index: "sm_90")
    assert fp8_forward.kernel_takes(q, k, v, None, None, 0.0, None, 0.0, None, None, None)
    for given in ((torch.zeros(1, 2),), (None, 0.1), (None, None, (16, 0)), (None, None, None, 30.0)):
        assert not fp8_forward.kernel_takes(q, k, v, *given)
    assert fp8_forward.kernel_takes(_e4m3(1, 8, 4, 64), _e4m3(1, 8, 2, 64), _e4m3(1, 8, 2, 64))
    assert fp8_forward.kernel_takes(_e4m3(1, 8, 4, 256), _e4m3(1, 8, 2, 256), _e4m3(1, 8, 2, 256))
    for d in (96, 192):  # (no build at these)
        assert not fp8_forward.kernel_takes(_e4m3(1, 8, 4, d), _e4m3(1, 8, 2, d), _e4m3(1, 8, 2, d))
    assert not fp8_forward.kernel_takes(q, _e4m3(1, 8, 2, 64), _e4m3(1, 8, 2, 64))  # (head dims differ)
    assert not fp8_forward.kernel_takes(q, k, v, scale=-0.1)  # (the folded softmax needs a positive scale)
    assert not fp8_forward.kernel_takes(q, k.to("meta"), v)  # (k on another device)
    monkeypatch.setattr(fp8_forward, "device_unavailable_reason", lambda index: "no compiler")
    assert not fp8_forward.kernel_takes(q, k, v)
    monkeypatch.setattr(fp8_forward, "device_unavailable_reason", lambda index: None)
    monkeypatch.setattr(fp8_forward, "device_arch", lambda index: "sm_80")
    assert not fp8_forward.kernel_takes(q, k, v)


def test_attention_sends_a_call_the_kernel_takes_to_it_after_the_shape_checks(monkeypatch):
    import flash_attention as fa
    from flash_attention.ops import fp8_forward

    calls = []

    def fake(q, k, v, **kw):
        calls.append(kw)
        out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
        return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1]) if kw["return_lse"] else None

    monkeypatch.setattr(fp8_forward, "kernel_takes", lambda *a, **kw: True)
    monkeypatch.setattr(fp8_forward, "cuda_forward_e4m3", fake)
    q, k, v = _e4m3(2, 8, 4, 128), _e4m3(2, 12, 2, 128), _e4m3(2, 12, 2, 128)
    qd = torch.rand(2, 2)
    out, lse = fa.attention(q, k, v, causal=True, q_descale=qd, return_lse=True)
    assert torch.equal(out, torch.full(q.shape, 7.0, dtype=torch.bfloat16)) and lse.shape == (2, 4, 8)
    assert calls[0]["causal"] is True and calls[0]["softmax_scale"] == pytest.approx(128**-0.5, rel=1e-12)
    assert calls[0]["q_descale"] is qd and calls[0]["k_descale"] is None
    with pytest.raises(ValueError, match="k must have the batch size of q"):
        fa.attention(q, _e4m3(1, 12, 2, 128), _e4m3(1, 12, 2, 128))
    # An empty problem keeps the dequantizing path: zeros, no launch.
    assert not fa.attention(_e4m3(2, 0, 4, 128), k, v).numel()
    assert len(calls) == 1
