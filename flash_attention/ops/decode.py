"""The decode launch: a KV-cache call -> DecodeParams -> the append, decode and combine kernels.

Nothing here reads a device value on the host: the cache lengths and the page table stay on the GPU and
the kernels check them (csrc/include/fa/kv_cache.cuh), so a decode step can be captured in a CUDA graph.
The split count therefore depends on the cache's capacity, not on the rows' actual lengths (which only the
GPU knows): splits past a row's keys cost a block that writes an empty partial.
"""

from __future__ import annotations

import torch

from .._validate_kvcache import CacheProblem
from ..configs.decode import DecodeConfig, default_decode_config, num_splits_heuristic
from ..jit.loader import get_decode_kernels
from ..jit.params import DecodeParams
from ..jit.sources import DECODE_AUX_THREADS
from .device import KERNEL_DTYPES, cuda_unavailable_reason, device_arch, dtype_name, sm_count
from .plans import fill_strides, launch
from .tensors import MAX_GRID_YZ, kernel_ready, usable_in_place

__all__ = ["cuda_decode", "decode_config", "decode_unavailable_reason", "splits_for"]


def decode_unavailable_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when the decode kernels can take this call; otherwise why not, in words."""
    reason = cuda_unavailable_reason(q)
    if reason is not None:
        return reason
    if q.shape[3] % 8:
        # The cache is written in place, so it cannot be padded to whole 16-byte chunks as q can.
        return (
            f"the decode kernels need head_dim a multiple of 8 (the cache is read in place); got {q.shape[3]}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not usable_in_place(t):
            return f"{name} is not 16-byte aligned with strides in multiples of 8 elements ({t.stride()})"
    if k_cache.shape[2] > MAX_GRID_YZ or q.shape[0] > MAX_GRID_YZ:
        return f"batch and heads_kv must be at most {MAX_GRID_YZ}"
    return None


def decode_config(q: torch.Tensor, problem: CacheProblem) -> DecodeConfig:
    """The decode config of a call on q's GPU."""
    return default_decode_config(
        dtype_name(q), problem.head_dim, problem.seqlen_q * problem.group, device_arch(q.get_device())
    )


def splits_for(
    cfg: DecodeConfig, problem: CacheProblem, num_splits: int, sms: int, blocks_per_sm: int = 1
) -> tuple[int, int]:
    """``(num_splits, keys_per_split)``: the caller's count (0: the heuristic's), each split a whole number
    of K/V tiles, and no split starting past the capacity."""
    rows = problem.seqlen_q * problem.group
    m_blocks = -(-rows // cfg.block_m)
    tiles = max(1, -(-problem.capacity // cfg.block_kv))
    if num_splits == 0:
        num_splits = num_splits_heuristic(
            problem.batch * problem.heads_kv * m_blocks, problem.capacity, cfg.block_kv, sms, blocks_per_sm
        )
    num_splits = max(1, min(num_splits, tiles))
    per_split = -(-tiles // num_splits) * cfg.block_kv
    return -(-problem.capacity // per_split) if problem.capacity else 1, per_split


def cuda_decode(
    problem: CacheProblem,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    num_splits: int,
    out: torch.Tensor | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append ``k``/``v`` to the cache and attend ``q`` against it on the decode kernels (the call validated
    by :func:`flash_attention._validate_kvcache.validate_kvcache`, the kernels able to take it:
    :func:`decode_unavailable_reason`)."""
    assert q.dtype in KERNEL_DTYPES
    index = q.get_device()
    arch = device_arch(index)
    cfg = decode_config(q, problem)
    kernels = get_decode_kernels(cfg, arch)
    paged = block_table is not None

    q_ = kernel_ready(q)
    o = (
        out
        if out is not None and usable_in_place(out)
        else torch.empty_like(q, memory_format=torch.contiguous_format)
    )
    lse = (
        q.new_empty((problem.batch, problem.heads_q, problem.seqlen_q), dtype=torch.float32)
        if return_lse
        else None
    )
    lengths = cache_seqlens.contiguous()
    table = block_table.contiguous() if paged else None

    p = DecodeParams()
    p.q, p.k, p.v, p.o = q_.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr()
    p.cache_seqlens = lengths.data_ptr()
    for prefix, t in (("q", q_), ("k", k_cache), ("v", v_cache), ("o", o)):
        fill_strides(p, prefix, t)
    if lse is not None:
        p.lse = lse.data_ptr()
        p.lse_batch_stride, p.lse_head_stride = problem.heads_q * problem.seqlen_q, problem.seqlen_q
    if paged:
        p.block_table, p.block_table_stride = table.data_ptr(), table.stride(0)
        p.num_pages = k_cache.shape[0]
    p.batch, p.heads_q, p.heads_kv, p.seqlen_q = (
        problem.batch,
        problem.heads_q,
        problem.heads_kv,
        problem.seqlen_q,
    )
    p.head_dim, p.group, p.seqlen_new = problem.head_dim, problem.group, problem.seqlen_new
    p.capacity, p.page_size = problem.capacity, problem.page_size
    p.rows = problem.seqlen_q * problem.group
    p.num_m_blocks = -(-p.rows // cfg.block_m)
    p.scale = problem.scale

    keep = [q_, o, lse, lengths, table]  # alive until every launch is queued
    if problem.seqlen_new:
        k_, v_ = kernel_ready(k), kernel_ready(v)
        keep += [k_, v_]
        p.k_new, p.v_new = k_.data_ptr(), v_.data_ptr()
        fill_strides(p, "kn", k_)
        fill_strides(p, "vn", v_)
        append = kernels[cfg.symbol("append", paged=paged)]
        launch(append, (problem.seqlen_new, problem.batch, 1), DECODE_AUX_THREADS, 0, index, p)

    decode = kernels[cfg.symbol("decode", problem.causal, paged)]
    p.num_splits, p.keys_per_split = splits_for(
        cfg, problem, num_splits, sm_count(index), decode.blocks_per_sm(cfg.threads, cfg.smem_bytes, index)
    )
    if p.num_splits > 1:
        o_partial = torch.empty(
            (p.num_splits, problem.batch, problem.heads_q, problem.seqlen_q, cfg.head_dim),
            dtype=torch.float32,
            device=q.device,
        )
        lse_partial = torch.empty(o_partial.shape[:-1], dtype=torch.float32, device=q.device)
        keep += [o_partial, lse_partial]
        p.o_partial, p.lse_partial = o_partial.data_ptr(), lse_partial.data_ptr()
    decode.ensure_dynamic_smem(cfg.smem_bytes, index)
    grid = (p.num_m_blocks * p.num_splits, problem.heads_kv, problem.batch)
    launch(decode, grid, cfg.threads, cfg.smem_bytes, index, p)
    if p.num_splits > 1:
        rows = problem.batch * problem.heads_q * problem.seqlen_q
        per_block = DECODE_AUX_THREADS // (cfg.head_dim // 4)
        launch(kernels[cfg.symbol("combine")], (-(-rows // per_block), 1, 1), DECODE_AUX_THREADS, 0, index, p)
    del keep
    if out is not None and o is not out:
        out.copy_(o)
        o = out
    return o, lse
