"""Tensor maps for the TMA (warp-specialized) kernels: what a plan fixes, what a call fills in.

A tensor map describes one operand to the TMA unit: its base address, its four dimensions (head_dim,
seqlen, heads, batch, innermost first), the byte strides of the outer three, and the box one load copies
(64 columns, i.e. one 128-byte swizzle panel, by a tile's rows). Everything but the address is fixed by the
call's signature, so a plan keeps it as ready ctypes arrays and a call only encodes (one driver call per
operand, on the host: nothing touches the GPU).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from ..jit import driver
from ..jit.params import TENSOR_MAP_BYTES

__all__ = ["MapLayout", "encode_into", "map_layout", "untileable"]

#: Columns of one box: a 64-element row of 2-byte elements is the 128 bytes the swizzle permutes.
BOX_COLUMNS = 64
#: The TMA unit's bounds (CUDA driver API, cuTensorMapEncodeTiled): strides multiples of 16 bytes and
#: below 2**40, dimensions at most 2**32, box dimensions at most 256.
_STRIDE_ALIGN = 16
_STRIDE_LIMIT = 1 << 40
_DIM_LIMIT = 1 << 32


@dataclass(frozen=True)
class MapLayout:
    """The signature-fixed part of one operand's tensor map."""

    dims: ctypes.Array
    strides: ctypes.Array
    box: ctypes.Array


def map_layout(t: torch.Tensor, box_rows: int) -> MapLayout | str:
    """The tensor map layout of a (batch, seqlen, heads, head_dim) tensor with 2-byte elements, loaded in
    boxes of ``box_rows`` rows; or a sentence saying why the TMA unit cannot address it."""
    strides = _byte_strides(t)
    problem = _problem(t, strides)
    if problem is not None:
        return problem
    batch, seqlen, heads, head_dim = t.shape
    return MapLayout(
        (ctypes.c_uint64 * 4)(head_dim, seqlen, heads, batch),
        (ctypes.c_uint64 * 3)(*strides),
        (ctypes.c_uint32 * 4)(BOX_COLUMNS, box_rows, 1, 1),
    )


def _byte_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The row, head and batch strides of ``t`` in bytes, as the tensor map gives them."""
    batch, seqlen, heads, head_dim = t.shape
    sb, sr, sh = (2 * s for s in t.stride()[:3])
    # A dimension of extent 1 is never stepped along: any valid stride describes it.
    if seqlen == 1:
        sr = 2 * head_dim + (-2 * head_dim) % _STRIDE_ALIGN
    if heads == 1:
        sh = sr * seqlen
    if batch == 1:
        sb = sh * heads
    return sr, sh, sb


def _problem(t: torch.Tensor, strides: tuple[int, int, int]) -> str | None:
    """Why the TMA unit cannot address ``t`` with these byte strides, or None."""
    for name, stride in zip(("row", "head", "batch"), strides, strict=True):
        if stride % _STRIDE_ALIGN or not 0 < stride < _STRIDE_LIMIT:
            return f"its {name} stride ({stride} bytes) is not a positive multiple of 16 below 2**40"
    if max(t.shape) > _DIM_LIMIT:
        return "a dimension exceeds 2**32"
    return None


def untileable(*tensors: torch.Tensor) -> bool:
    """Whether any of ``tensors`` has a layout no tensor map can describe (the call then runs a kernel
    that loads with cp.async)."""
    return any(_problem(t, _byte_strides(t)) is not None for t in tensors)


_scratch = threading.local()


def _aligned_scratch() -> int:
    """This thread's 64-byte-aligned 128-byte buffer for the driver to encode into (the params struct's map
    fields are not 64-byte aligned on the host)."""
    address = getattr(_scratch, "address", None)
    if address is None:
        _scratch.buffer = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
        address = _scratch.address = ctypes.addressof(_scratch.buffer) + (
            -ctypes.addressof(_scratch.buffer) % 64
        )
    return address


def encode_into(
    field: ctypes.Array, layout: MapLayout, data_ptr: int, *, one_byte: bool = False, swizzle64: bool = False
) -> int:
    """Encode the tensor map of ``layout`` at ``data_ptr`` into ``field`` (a params struct's 128 bytes);
    return the driver's status (0: success). Elements of 2 bytes, or of 1 (e4m3) with ``one_byte``, then
    with the 64-byte swizzle for ``swizzle64`` (rows of 64 bytes: e4m3's Q and K at head_dim 64)."""
    scratch = _aligned_scratch()
    if one_byte:
        swizzle = driver.CU_TENSOR_MAP_SWIZZLE_64B if swizzle64 else driver.CU_TENSOR_MAP_SWIZZLE_128B
        dims, strides, box = layout.dims, layout.strides, layout.box
        status = driver.encode_tiled_1byte(scratch, data_ptr, dims, strides, box, swizzle)
    else:
        assert not swizzle64, "the 64-byte swizzle is e4m3's (one_byte)"
        status = driver.encode_tiled_2byte(scratch, data_ptr, layout.dims, layout.strides, layout.box)
    if status == 0:
        ctypes.memmove(field, scratch, TENSOR_MAP_BYTES)
    return status


def encode_operand(config: str, what: str, t, rows: int, field: ctypes.Array) -> MapLayout:
    """The map layout of operand ``t`` (boxes of ``rows`` rows) for config ``config``, encoded once on its
    own address into ``field`` (a params struct's map), so a layout the TMA unit refuses is known at plan
    time; ValueError naming the config and ``what`` it does ("loads q") where it cannot be."""
    layout = map_layout(t, rows)
    if isinstance(layout, str):
        raise ValueError(f"config {config} {what} with TMA, but {layout}; name another config")
    status = encode_into(field, layout, t.data_ptr())
    if status != 0:
        raise ValueError(
            f"config {config} {what} with TMA, but the driver refuses a tensor map of its layout (shape "
            f"{tuple(t.shape)}, strides {t.stride()}; status {status}); name another config"
        )
    return layout
