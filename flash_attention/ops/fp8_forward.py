"""The FP8 (e4m3) forward on Hopper: q, k and v in e4m3, the output bf16 (docs/fp8-study.md, step 2).

The first form, for the GPU tests and the benchmark to call directly while it is measured (attention() keeps
its dequantizing path until then): head_dim 64, 128 or 256, causal or not, no other option. The descales (one
number, or one per (batch, kv head)) reach the kernel as device pointers (FwdTmaParams,
sm90/fwd_ws/descales.cuh): each tile scales its softmax by q's and k's and its output by v's before the bf16
rounding, so a call with descales in GPU tensors needs no host synchronisation (a Python number becomes a
one-element tensor by a fill kernel). V is laid out for the kernel per call (ops.fp8_values: V^T in P's key
order, one pass over its bytes).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from ..configs import KernelConfig, ws_config
from ..jit import driver
from ..jit.loader import get_kernel
from ..jit.params import FwdParams, FwdTmaParams
from . import tma
from .device import device_arch, device_unavailable_reason, sm_count
from .forward import stream_tile_counter
from .fp8_values import KEY_GROUP, transposed_values
from .plans import fill_common, fill_strides, launch

__all__ = ["e4m3_config", "cuda_forward_e4m3", "kernel_takes"]

#: V^T's box: one 128-byte panel of keys.
_KEYS_PER_PANEL = 128


#: The head dims the e4m3 forward is built for (64: Q's and K's 64-byte rows with the 64-byte swizzle).
E4M3_HEAD_DIMS = (64, 128, 256)


@functools.cache  # (a frozen config, built and validated once per head_dim: the call's host time)
def e4m3_config(head_dim: int) -> KernelConfig:
    """The e4m3 forward's config: persistent, the ring three deep (1-byte tiles leave the room); 128-key
    tiles with two tiles' S overlapped at head_dim 64 and 128, 64-key tiles at 256."""
    if head_dim not in E4M3_HEAD_DIMS:
        raise ValueError(f"the e4m3 forward takes head_dim {E4M3_HEAD_DIMS} for now; got {head_dim}")
    if head_dim == 256:
        # 64-key tiles (V^T's rows one 64-byte swizzle panel) and no overlap of two tiles' S: at 128 keys
        # every build spilled 352-516 bytes; here 128-140, all of them epilogue addresses kept from the
        # start (docs/fp8-study.md).
        return ws_config("e4m3", 256, 128, 64, 3, persistent=True)
    return ws_config("e4m3", head_dim, 128, 128, 3, overlap=True, persistent=True)


def kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options, scale: float = 1.0) -> bool:
    """Whether attention() runs an e4m3 call on this kernel: q, k and v 4-D with head_dim 64, 128 or 256 (all
    three the same) on one Hopper GPU (sm_90) where kernels can be built and launched, a positive softmax
    scale (the folded softmax subtracts the unscaled max: a negative scale would turn it into the min), not
    inside a torch.compile trace (the kernel's host path is not traceable), and none of ``options`` given
    (attention()'s out, key_range, dropout_p, window, softcap, alibi_slopes, sinks and packed segments, each
    None, 0 or 0.0 when absent). Every other e4m3 call keeps the dequantizing path (spec.fp8), which gives the
    same attention of the dequantized inputs up to rounding (docs/fp8-study.md, "Accuracy"). (Not
    dispatch.usable_backend: its check of the dtype takes float16 and bfloat16 only.) The descales' product
    must be positive too, which the host cannot check without a synchronisation: docs/usage.md says so."""
    from . import dispatch

    if any(o is not None and not (isinstance(o, (bool, int, float)) and o == 0) for o in options):
        return False
    if q.dim() != 4 or q.shape[-1] not in E4M3_HEAD_DIMS or any(t.shape[-1] != q.shape[-1] for t in (k, v)):
        return False
    if not scale > 0:
        return False
    if not dispatch.wants_kernel(q) or not q.is_cuda or k.device != q.device or v.device != q.device:
        return False
    if torch.compiler.is_compiling() or device_unavailable_reason(q.get_device()) is not None:
        return False
    return device_arch(q.get_device()) == "sm_90"


def _device_descales(descales, batch: int, heads_kv: int, device) -> tuple[list, int, int]:
    """The three descales as float32 device tensors (None: none) and their (batch, kv head) strides: (0, 0)
    when each is one number, else each laid out (batch, heads_kv) contiguous, one-number ones broadcast."""
    out = []
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales, strict=True):
        if d is None:
            out.append(None)
            continue
        if not isinstance(d, torch.Tensor):
            d = torch.full((1,), float(d), dtype=torch.float32, device=device)  # (a fill kernel: no sync)
        if d.dtype != torch.float32 or d.device != device:
            raise ValueError(f"{name} must be float32 on q's device {device}; got {d.dtype} on {d.device}")
        if d.numel() != 1 and tuple(d.shape) != (batch, heads_kv):
            raise ValueError(
                f"{name} must hold one number or one per (batch, kv head), shape ({batch}, {heads_kv}); "
                f"got shape {tuple(d.shape)}"
            )
        out.append(d)
    if all(d is None or d.numel() == 1 for d in out):
        return out, 0, 0
    out = [
        None
        if d is None
        else d.reshape(-1, 1).expand(batch, heads_kv).contiguous()
        if d.numel() == 1
        else d.contiguous()
        for d in out
    ]
    return out, heads_kv, 1


def _rows_layout(t: torch.Tensor, box_rows: int) -> tma.MapLayout:
    """The map of a (batch, seqlen, heads, head_dim) e4m3 tensor, boxes of one swizzle panel (128 columns;
    head_dim 64: the row's 64, encoded with the 64-byte swizzle by the caller) by ``box_rows`` rows (its
    strides in bytes are its element strides)."""
    return _rows_map_layout(tuple(t.shape), t.stride(), box_rows)


@functools.lru_cache(maxsize=256)  # (per shape and strides: the ctypes arrays are read, never written)
def _rows_map_layout(shape: tuple, stride: tuple, box_rows: int) -> tma.MapLayout:
    batch, seqlen, heads, head_dim = shape
    sb, sr, sh = stride[:3]
    if stride[3] != 1 or any(s % 16 for s in (sr, sh, sb)):
        raise ValueError("the e4m3 forward reads rows of 16-byte aligned strides with head_dim contiguous")
    return tma.MapLayout(
        (ctypes.c_uint64 * 4)(head_dim, seqlen, heads, batch),
        (ctypes.c_uint64 * 3)(sr, sh, sb),
        (ctypes.c_uint32 * 4)(min(head_dim, _KEYS_PER_PANEL), box_rows, 1, 1),
    )


def _values_layout(vt: torch.Tensor, box_keys: int = _KEYS_PER_PANEL) -> tma.MapLayout:
    """The map of transposed_values' (batch, heads_kv, head_dim, keys) tensor: boxes of 128 keys (64 for
    64-key tiles, with the 64-byte swizzle) by every head_dim row (the kernel's producer loads block_kv /
    box_keys of them per tile)."""
    return _values_map_layout(tuple(vt.shape), box_keys)


@functools.lru_cache(maxsize=256)
def _values_map_layout(shape: tuple, box_keys: int) -> tma.MapLayout:
    batch, heads, head_dim, keys = shape
    return tma.MapLayout(
        (ctypes.c_uint64 * 4)(keys, head_dim, heads, batch),
        (ctypes.c_uint64 * 3)(keys, head_dim * keys, heads * head_dim * keys),
        (ctypes.c_uint32 * 4)(box_keys, head_dim, 1, 1),
    )


def _encode(field, layout: tma.MapLayout, ptr: int, what: str, swizzle64: bool = False) -> None:
    status = tma.encode_into(field, layout, ptr, one_byte=True, swizzle64=swizzle64)
    if status != 0:
        raise RuntimeError(f"the e4m3 forward's tensor map of {what} was refused by the driver ({status})")


def cuda_forward_e4m3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of the dequantized ``q * q_descale``, ``k * k_descale``, ``v * v_descale`` (e4m3 (batch,
    seqlen, heads, head_dim) tensors, head_dim one of E4M3_HEAD_DIMS, on a Hopper GPU, GQA allowed) as a bf16
    output, and its LSE (float32 (batch, heads_q, seqlen_q)) when asked."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype is not torch.float8_e4m3fn or not t.is_cuda or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-D float8_e4m3fn CUDA tensor")
    batch, seqlen_q, heads_q, head_dim = q.shape
    cfg = e4m3_config(head_dim)
    if k.shape[3] != head_dim or v.shape[3] != head_dim or heads_q % k.shape[2]:
        raise ValueError("q, k and v must share head_dim, and heads_q be a multiple of heads_kv")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    descales, descale_batch_stride, descale_head_stride = _device_descales(
        (q_descale, k_descale, v_descale), batch, k.shape[2], q.device
    )
    index = q.get_device()
    q_, k_ = q.contiguous(), k.contiguous()
    vt = transposed_values(v)
    assert vt.shape[3] % KEY_GROUP == 0
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = (
        torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    )
    kernel = get_kernel(cfg, causal, device_arch(index))
    kernel.ensure_dynamic_smem(cfg.smem_bytes, index)
    p = FwdParams()
    for prefix, t in (("q", q_), ("k", k_), ("v", v), ("o", o)):
        fill_strides(p, prefix, t)  # (v's: only the cp.async families read them)
    p.lse_batch_stride, p.lse_head_stride = heads_q * seqlen_q, seqlen_q
    fill_common(p, q_, k_, cfg.block_q, scale, 0.0)
    p.head_dim_v = head_dim
    p.q, p.k, p.v, p.o = q_.data_ptr(), k_.data_ptr(), vt.data_ptr(), o.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    tp = FwdTmaParams()
    tp.p = p
    tp.q_descale, tp.k_descale, tp.v_descale = (0 if d is None else d.data_ptr() for d in descales)
    tp.descale_batch_stride, tp.descale_head_stride = descale_batch_stride, descale_head_stride
    tiles = p.num_m_blocks * heads_q * batch
    grid = (min(tiles, sm_count(index)), 1, 1)
    counter = None
    if grid[0] < tiles:
        counter = stream_tile_counter(q.device)  # (held until the launch is queued)
        tp.tile_counter = counter.data_ptr()
    with driver.primary_current(index):
        # (Q's and K's rows at head_dim 64 are 64 bytes: the 64-byte swizzle, as the kernel's descriptors
        # read them; sm90/fwd_ws/pipeline.cuh kQKPanelBytes)
        narrow = head_dim < _KEYS_PER_PANEL
        _encode(tp.q_map, _rows_layout(q_, cfg.block_q), q_.data_ptr(), "q", narrow)
        _encode(tp.k_map, _rows_layout(k_, cfg.block_kv), k_.data_ptr(), "k", narrow)
        box_keys = min(cfg.block_kv, _KEYS_PER_PANEL)  # (sm90/fwd_ws/pipeline.cuh kVtPanelBytes)
        _encode(tp.v_map, _values_layout(vt, box_keys), vt.data_ptr(), "v", box_keys < _KEYS_PER_PANEL)
    launch(kernel, grid, cfg.threads, cfg.smem_bytes, index, tp)
    return o, lse
