"""The tensor map layouts the TMA kernels are launched with (CPU: layouts are worked out from shapes and
strides; the driver encodes them on the GPU machine, tests/test_gpu_sm90_ws.py)."""

from __future__ import annotations

import torch

from flash_attention.ops.tma import map_layout


def _as_lists(layout):
    return list(layout.dims), list(layout.strides), list(layout.box)


def test_contiguous_gqa_key_layout():
    k = torch.randn(3, 517, 2, 96, dtype=torch.bfloat16)
    dims, strides, box = _as_lists(map_layout(k, 128))
    assert dims == [96, 517, 2, 3]  # innermost first: head_dim, seqlen, heads, batch
    assert strides == [2 * 2 * 96, 2 * 96, 2 * 517 * 2 * 96]  # bytes: row, head, batch
    assert box == [64, 128, 1, 1]


def test_transposed_bhsd_view_keeps_its_strides():
    q = torch.randn(2, 4, 300, 128, dtype=torch.float16).transpose(1, 2)  # (b, s, h, d) view of (b, h, s, d)
    _, strides, _ = _as_lists(map_layout(q, 64))
    assert strides == [2 * 128, 2 * 300 * 128, 2 * 4 * 300 * 128]


def test_extent_one_dimensions_get_valid_strides():
    # A single row, head and batch: their strides are never stepped along, whatever the tensor says.
    q = torch.randn(1, 1, 1, 64, dtype=torch.bfloat16)
    dims, strides, _ = _as_lists(map_layout(q, 64))
    assert dims == [64, 1, 1, 1]
    assert all(s > 0 and s % 16 == 0 for s in strides)


def test_broadcast_heads_are_refused_with_the_reason():
    k = torch.randn(1, 100, 1, 128, dtype=torch.bfloat16).expand(1, 100, 4, 128)
    reason = map_layout(k, 128)
    assert isinstance(reason, str) and "head stride (0 bytes)" in reason


def test_misaligned_strides_are_refused():
    # 64 of 68 columns: heads 136 bytes apart and rows 408, neither a multiple of 16.
    base = torch.randn(2, 50, 3, 68, dtype=torch.bfloat16)
    reason = map_layout(base[..., :64], 64)
    assert isinstance(reason, str) and "row stride (408 bytes)" in reason
