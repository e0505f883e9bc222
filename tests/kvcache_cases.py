"""Random KV-cache problems and the accuracy check shared by the CPU and GPU tests of
attention_with_kvcache."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flash_attention
from flash_attention.fallback.reference import attention_kvcache_reference, causal_allowed, window_allowed


@dataclass
class Case:
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_new: int
    page_size: int  # 0: contiguous
    capacity: int  # keys per row
    causal: bool
    lengths: list[int]  # cache_seqlens, before the append
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: int = 0  # ALiBi slopes: 0 none, 1 (heads_q,), 2 (batch, heads_q)

    def __str__(self) -> str:
        layout = f"paged{self.page_size}" if self.page_size else "contiguous"
        variants = (
            (f" window={self.window}" if self.window else "")
            + (f" softcap={self.softcap}" if self.softcap else "")
            + (f" alibi={self.alibi}" if self.alibi else "")
        )
        return (
            f"b{self.batch} sq{self.seqlen_q} h{self.heads_q}/{self.heads_kv} d{self.head_dim} "
            f"new{self.seqlen_new} {layout} cap{self.capacity} causal={self.causal} lens={self.lengths}"
            + variants
        )


def random_case(
    rng: random.Random,
    *,
    page_size: int,
    head_dim: int,
    group: int,
    seqlen_q: int,
    seqlen_new: int,
    causal: bool,
    batch: int = 3,
    heads_kv: int = 2,
    max_pages: int = 6,
) -> Case:
    """A case whose rows cover the edges: an empty cache, a full one (after the append), and random lengths
    that put the append inside a page, at a page's end and across pages."""
    capacity = max_pages * page_size if page_size else rng.randint(seqlen_new + 1, 160)
    limit = capacity - seqlen_new
    lengths = [0, limit] + [rng.randint(0, limit) for _ in range(max(0, batch - 2))]
    if page_size and batch > 2:
        # The append ends exactly at a page boundary (when there is room for it).
        end = (rng.randint(1, max_pages) * page_size) - seqlen_new
        lengths[2] = min(max(end, 0), limit)
    rng.shuffle(lengths)
    lengths = lengths[:batch]
    return Case(
        batch,
        seqlen_q,
        heads_kv * group,
        heads_kv,
        head_dim,
        seqlen_new,
        page_size,
        capacity,
        causal,
        lengths,
    )


def make_inputs(case: Case, dtype: torch.dtype, device: str):
    """(q, k_cache, v_cache, k, v, cache_seqlens, block_table): random values everywhere, the caches' unused
    positions included (a kernel reading them would show), and a shuffled page table with spare pages."""
    kv_shape = (case.heads_kv, case.head_dim)
    q = torch.randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim, device=device).to(dtype)
    k = torch.randn(case.batch, case.seqlen_new, *kv_shape, device=device).to(dtype)
    v = torch.randn(case.batch, case.seqlen_new, *kv_shape, device=device).to(dtype)
    block_table = None
    if case.page_size:
        pages_per_row = case.capacity // case.page_size
        num_pages = case.batch * pages_per_row + 3
        order = torch.randperm(num_pages)[: case.batch * pages_per_row]
        block_table = order.reshape(case.batch, pages_per_row).to(torch.int32).to(device)
        cache_shape = (num_pages, case.page_size, *kv_shape)
    else:
        cache_shape = (case.batch, case.capacity, *kv_shape)
    k_cache = torch.randn(cache_shape, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, device=device).to(dtype)
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    return (
        q,
        k_cache,
        v_cache,
        (k if case.seqlen_new else None),
        (v if case.seqlen_new else None),
        lengths,
        block_table,
    )


def _row(cache: torch.Tensor, block_table, b: int, n: int) -> torch.Tensor:
    """Row b's first n positions of a cache (after the append), gathered independently of the library."""
    positions = torch.arange(n)
    if block_table is None:
        return cache[b, positions]
    table = block_table.cpu().long()
    page_size = cache.shape[1]
    return cache[table[b][positions // page_size].to(cache.device), (positions % page_size).to(cache.device)]


def alibi_slopes(case: Case, device) -> torch.Tensor | None:
    """Random positive float32 ALiBi slopes of the case's shape (None without ALiBi): steep enough that the
    bias moves the softmax over caches of hundreds of keys."""
    if not case.alibi:
        return None
    shape = (case.heads_q,) if case.alibi == 1 else (case.batch, case.heads_q)
    return (torch.rand(shape) * 0.2 + 0.005).to(device)


def pytorch_error(
    case: Case, q, k_cache_after, v_cache_after, block_table, ref_out, slopes=None
) -> torch.Tensor:
    """(batch,) the max error PyTorch's own attention makes in q's dtype on each row, against the
    reference: its fused kernel, or with a window or soft-capping (which it does not take) the same math in
    q's dtype op by op (scores rounded to q's dtype, as a fused kernel's never are: a looser bound)."""
    errors = []
    for b in range(case.batch):
        n = case.lengths[b] + case.seqlen_new
        if n == 0:
            errors.append(torch.tensor(0.0))
            continue
        kb = _row(k_cache_after, block_table, b, n).repeat_interleave(case.heads_q // case.heads_kv, dim=1)
        vb = _row(v_cache_after, block_table, b, n).repeat_interleave(case.heads_q // case.heads_kv, dim=1)
        mask = causal_allowed(case.seqlen_q, n, device=q.device) if case.causal else None
        if case.window is not None:
            band = window_allowed(case.seqlen_q, n, case.window, device=q.device)
            mask = band if mask is None else mask & band
        qt, kt, vt = q[b].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1)
        if case.window is None and not case.softcap and slopes is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(0, 1)
        else:
            s = (qt @ kt.transpose(1, 2)) * case.head_dim**-0.5
            if case.softcap:
                s = case.softcap * torch.tanh(s / case.softcap)
            if slopes is not None:
                head_slopes = slopes if slopes.dim() == 1 else slopes[b]
                diag = torch.arange(case.seqlen_q, device=q.device)[:, None] + (n - case.seqlen_q)
                dist = (diag - torch.arange(n, device=q.device)[None, :]).abs()
                s = s - (head_slopes.to(q.device)[:, None, None] * dist).to(s.dtype)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
            o = (p @ vt).transpose(0, 1)
        rows = (
            mask.any(1) if mask is not None else torch.ones(case.seqlen_q, dtype=torch.bool, device=q.device)
        )
        err = (o.double() - ref_out[b].to(q.device))[rows].abs()
        errors.append(err.max().cpu() if err.numel() else torch.tensor(0.0))
    return torch.stack([e.double() for e in errors])


def check_case(
    case: Case, dtype: torch.dtype, device: str, *, use_int_seqlens: bool = False, num_splits: int = 0
) -> None:
    """attention_with_kvcache against the float64 reference: output within the accuracy rule, LSE close,
    every output element written (poisoned buffer), the caches exactly the reference's after the append."""
    q, k_cache, v_cache, k, v, lengths, block_table = make_inputs(case, dtype, device)
    slopes = alibi_slopes(case, device)
    ref_out, ref_lse, ref_kc, ref_vc = attention_kvcache_reference(
        q.double().cpu(),
        k_cache.double().cpu(),
        v_cache.double().cpu(),
        None if k is None else k.double().cpu(),
        None if v is None else v.double().cpu(),
        cache_seqlens=lengths.cpu(),
        block_table=None if block_table is None else block_table.cpu(),
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=None if slopes is None else slopes.cpu(),
    )
    out = torch.full_like(q, float("nan"))
    seqlens = case.lengths[0] if use_int_seqlens else lengths
    o, lse = flash_attention.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=seqlens,
        block_table=block_table,
        causal=case.causal,
        return_lse=True,
        out=out,
        num_splits=num_splits,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=slopes,
    )
    assert o.data_ptr() == out.data_ptr()
    assert not o.isnan().any(), f"{case}: output element not written or NaN"
    assert torch.equal(k_cache.double().cpu(), ref_kc) and torch.equal(v_cache.double().cpu(), ref_vc), (
        f"{case}: the caches after the append differ from the reference's"
    )
    errors = (o.double().cpu() - ref_out).abs().amax(dim=(1, 2, 3))
    if dtype == torch.float64:
        bound = torch.full_like(errors, 1e-10)
    else:
        own = pytorch_error(case, q, k_cache, v_cache, block_table, ref_out, slopes)
        bound = 2 * own + 1e-5
    assert (errors <= bound).all(), f"{case}: max error per row {errors.tolist()} > {bound.tolist()}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), f"{case}: rows without keys differ"
    assert torch.allclose(
        lse.double().cpu()[~empty], ref_lse[~empty], atol=2e-2 if dtype != torch.float64 else 1e-6, rtol=0
    ), f"{case}: LSE"
    assert (o.cpu()[empty.transpose(1, 2)] == 0).all(), f"{case}: rows without keys must be 0"
