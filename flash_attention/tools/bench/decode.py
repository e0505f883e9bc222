"""``bench --mode decode``: one (or a few) new query tokens per row against a long KV cache, the shape of
serving, where attention is bound by reading the cache.

Ours is :func:`flash_attention.attention_with_kvcache` on a contiguous cache and on paged ones (page sizes 16
and 256 by default, pages in a random order as an engine's allocator leaves them); the baselines are
PyTorch's SDPA backends (``sdpa_cudnn`` first) on the contiguous cache, read in place through a transposed
view with ``enable_gqa`` (they have no paged form). Every point reports the time per call (CUDA events,
median; small calls include their launch path, which a user pays) and the K/V bytes read per second, next to
a device-to-device copy measured in the same run (``copy_tb_s``), the ceiling a memory-bound kernel aims at.

Host-bound points drift within a run, so each point's implementations are timed in alternating rounds
(three by default, ``--rounds``) and a row records the median of the rounds' medians.

Ours attends without appending (``k``/``v`` None), the same work as the baselines';
``flash_attention.attention`` is our plain :func:`flash_attention.attention` on the same contiguous cache
(a user's own decoding loop). Calls with more than one query token (speculative decoding) are causal,
aligned to the cache's end; SDPA's causal mask is aligned to the top-left corner when there are fewer
queries than keys, so those points run ours only.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flash_attention

from ..common import input_sets_needed, l2_bytes, time_cuda
from .results import OURS, OURS_PLAIN_CALL

__all__ = [
    "DECODE_BATCHES",
    "DECODE_IMPLS",
    "PLAIN_CALL",
    "DECODE_PAGE_SIZES",
    "DECODE_SEQLENS",
    "DecodeSettings",
    "decode_markdown",
    "decode_text",
    "impls_at",
    "measure_copy_tb_s",
    "run_decode",
]

#: The issue's grid: batch x cache length, one query token, 32 query / 8 K/V heads, head_dim 128, bf16.
DECODE_BATCHES = (1, 8, 64)
DECODE_SEQLENS = (1024, 8192, 32768, 131072)
DECODE_PAGE_SIZES = (0, 16, 256)
PLAIN_CALL = OURS_PLAIN_CALL
DECODE_IMPLS = (OURS, "sdpa_cudnn", "sdpa_flash", PLAIN_CALL)
_SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}
#: A point whose caches (K and V) would exceed this many bytes is skipped (batch 64 x 128k keys is 34 GB).
_MAX_CACHE_BYTES = 20 * 2**30


@dataclass(frozen=True)
class DecodeSettings:
    impls: tuple[str, ...] = DECODE_IMPLS
    batches: tuple[int, ...] = DECODE_BATCHES
    seqlens: tuple[int, ...] = DECODE_SEQLENS
    page_sizes: tuple[int, ...] = DECODE_PAGE_SIZES
    seqlens_q: tuple[int, ...] = (1,)
    num_splits: int = 0  # ours: 0 = the heuristic's count, else this count (recorded in the rows)
    heads: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    warmup: int = 3
    min_reps: int = 25
    min_time_s: float = 0.2
    #: Each point's implementations are timed this many times in turn and a row records the median of the
    #: rounds' medians (the rounds in ``ms_rounds``): a call shorter than its launch path measures the host,
    #: whose speed drifts by tens of percent within a run, so only times taken side by side compare.
    rounds: int = 3


def measure_copy_tb_s(**timing) -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy: the memory-bound ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda i: dst.copy_(src), 1, **timing)
    return 2 * src.numel() / (t.ms * 1e-3) / 1e12


def _cache(
    batch: int, seqlen: int, page_size: int, s: DecodeSettings, dtype: torch.dtype, gen: random.Random
):
    """K and V caches holding ``seqlen`` positions per row, and the page table (None when contiguous)."""
    shape_tail = (s.heads_kv, s.head_dim)
    if not page_size:
        k = torch.randn(batch, seqlen, *shape_tail, device="cuda", dtype=dtype)
        return k, torch.randn_like(k), None
    per_row = -(-seqlen // page_size)
    order = list(range(batch * per_row))
    gen.shuffle(order)
    k = torch.randn(batch * per_row, page_size, *shape_tail, device="cuda", dtype=dtype)
    table = torch.tensor(order, dtype=torch.int32, device="cuda").reshape(batch, per_row)
    return k, torch.randn_like(k), table


def _point_rows(batch, seqlen, seqlen_q, s: DecodeSettings, timing: dict, gen: random.Random) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[s.dtype]
    kv_bytes = 2 * batch * seqlen * s.heads_kv * s.head_dim * torch.finfo(dtype).bits // 8
    n_sets = input_sets_needed(kv_bytes, l2_bytes())
    base = dict(
        mode="decode",
        dtype=s.dtype,
        head_dim=s.head_dim,
        causal=seqlen_q > 1,
        seqlen=seqlen,
        seqlen_k=seqlen,
        seqlen_q=seqlen_q,
        batch=batch,
        heads=s.heads,
        heads_kv=s.heads_kv,
        tflops=4.0 * batch * s.heads * seqlen_q * seqlen * s.head_dim,  # FLOPs per call, divided below
    )
    rows = []
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    for page_size in s.page_sizes:
        sets = [_cache(batch, seqlen, page_size, s, dtype, gen) for _ in range(n_sets)]
        qs = [
            torch.randn(batch, seqlen_q, s.heads, s.head_dim, device="cuda", dtype=dtype)
            for _ in range(n_sets)
        ]
        # SDPA runs unmasked where seqlen_q > 1: its causal mask is top-left aligned, which for a query block
        # at the end of a cache would hide nearly every key; ours masks each row's last seqlen_q - 1 keys
        # (bottom-right), at most 15 keys in 1k or more, so the times compare the same work.
        impls = impls_at(s.impls, page_size)
        samples: dict[str, list] = {impl: [] for impl in impls}
        errors: dict[str, str] = {}
        for _ in range(s.rounds):
            for impl in impls:
                if impl in errors:
                    continue
                try:
                    fn, context = _call(impl, qs, sets, lengths, s.num_splits)
                    with context:
                        samples[impl].append(time_cuda(fn, n_sets, **timing))
                except Exception as exc:  # a backend that refuses the shape: recorded, not fatal
                    errors[impl] = f"{type(exc).__name__}: {exc}"[:300]
        for impl in impls:
            row = dict(base, impl=impl, page_size=page_size)
            if impl == OURS and s.num_splits:
                row["num_splits"] = s.num_splits
            if impl in errors:
                row.update(ms=None, tb_s=None, tflops=None, error=errors[impl])
            else:
                ms = statistics.median(t.ms for t in samples[impl])
                row.update(
                    ms=ms,
                    ms_min=min(t.ms_min for t in samples[impl]),
                    reps=sum(t.reps for t in samples[impl]),
                    tb_s=kv_bytes / (ms * 1e-3) / 1e12,
                    tflops=base["tflops"] / (ms * 1e-3) / 1e12,
                )
                if len(samples[impl]) > 1:
                    row["ms_rounds"] = [t.ms for t in samples[impl]]
            rows.append(row)
            print(_row_line(row), flush=True)
        del sets
    return rows


def impls_at(impls: tuple[str, ...], page_size: int) -> list[str]:
    """Those of ``impls`` that read a cache of ``page_size`` (0: contiguous): every one a contiguous cache,
    ours alone a paged one (plain attention() and SDPA have no paged form)."""
    return [i for i in impls if i == OURS or page_size == 0]


def _call(impl: str, qs, sets, lengths, num_splits: int = 0):
    """``(fn(i), context)``: one timed call on input set ``i`` and the context to time it in."""
    import contextlib

    if impl == OURS:

        def fn(i):
            k, v, table = sets[i]
            return flash_attention.attention_with_kvcache(
                qs[i], k, v, cache_seqlens=lengths, block_table=table, num_splits=num_splits
            )

        return fn, contextlib.nullcontext()
    if impl == PLAIN_CALL:
        # The cache is full (every row's length is its capacity), so its tensors are the keys: the same
        # call, causal aligned to the last key as the cache's is.
        def fn(i):
            k, v, _ = sets[i]
            return flash_attention.attention(qs[i], k, v, causal=qs[i].shape[1] > 1)

        return fn, contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # (batch, heads, seqlen, head_dim) views of the (batch, seqlen, heads, head_dim) tensors: no copy.
    views = [
        (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        for q, (k, v, _) in zip(qs, sets, strict=True)
    ]

    def fn(i):
        q, k, v = views[i]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return fn, sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[impl]))


def run_decode(settings: DecodeSettings) -> list[dict]:
    """Every point of ``settings``: rows in the DESIGN.md decode shape, printed as they come."""
    timing = dict(warmup=settings.warmup, min_reps=settings.min_reps, min_time_s=settings.min_time_s)
    gen = random.Random(0)
    dtype_bytes = 2
    rows = []
    for seqlen_q in settings.seqlens_q:
        for batch in settings.batches:
            for seqlen in settings.seqlens:
                cache_bytes = 2 * batch * seqlen * settings.heads_kv * settings.head_dim * dtype_bytes
                if cache_bytes > _MAX_CACHE_BYTES:
                    print(f"skipped batch {batch}, {seqlen} keys: {cache_bytes / 2**30:.0f} GiB of cache")
                    continue
                rows += _point_rows(batch, seqlen, seqlen_q, settings, timing, gen)
                torch.cuda.empty_cache()
    return rows


def _row_line(r: dict) -> str:
    what = f"{r['impl']:<16} q{r['seqlen_q']:<3} batch {r['batch']:<3} {r['seqlen_k']:>6} keys"
    what += f" page {r['page_size']:<3}"
    if r.get("ms") is None:
        return f"{what} failed: {r.get('error')}"
    return f"{what} {r['ms'] * 1e3:9.1f} us {r['tb_s']:5.2f} TB/s"


def _table(result: dict) -> tuple[list[str], list[list[str]]]:
    """Our time per point with the achieved bandwidth, and its ratio to each baseline (below 1: faster)."""
    rows = [r for r in result.get("rows", []) if r.get("mode") == "decode"]
    copy = result.get("copy_tb_s")
    baselines = [i for i in DECODE_IMPLS if i != OURS and any(r["impl"] == i for r in rows)]
    index = {(r["impl"], r["seqlen_q"], r["batch"], r["seqlen_k"], r["page_size"]): r for r in rows}
    head = ["seqlen_q", "batch", "keys", "page", "ours µs", "TB/s", "of copy"]
    head += [f"{b} µs" for b in baselines] + [f"ours / {b}" for b in baselines]
    lines = []
    for r in rows:
        if r["impl"] != OURS:
            continue
        cells = [str(r["seqlen_q"]), str(r["batch"]), f"{r['seqlen_k'] // 1024}k", str(r["page_size"] or "–")]
        if r.get("ms") is None:
            cells += ["failed", "", ""]
        else:
            cells += [f"{r['ms'] * 1e3:.1f}", f"{r['tb_s']:.2f}", f"{r['tb_s'] / copy:.0%}" if copy else "–"]
        base = [index.get((b, r["seqlen_q"], r["batch"], r["seqlen_k"], 0)) for b in baselines]
        cells += [f"{b['ms'] * 1e3:.1f}" if b and b.get("ms") else "–" for b in base]
        cells += [f"{r['ms'] / b['ms']:.2f}×" if b and b.get("ms") and r.get("ms") else "–" for b in base]
        lines.append(cells)
    return head, lines


def decode_text(result: dict) -> str:
    head, lines = _table(result)
    widths = [max(len(c) for c in col) for col in zip(head, *lines, strict=False)]
    out = [f"decode, {result.get('gpu', '?')}: device copy {result.get('copy_tb_s', 0):.2f} TB/s"]
    for cells in [head, ["-" * w for w in widths], *lines]:
        out.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(out)


def decode_markdown(result: dict) -> str:
    """The README table of a decode result (paged rows compared with the baselines' contiguous time)."""
    head, lines = _table(result)
    rows = [r for r in result.get("rows", []) if r.get("mode") == "decode"]
    if not rows:
        return ""
    first = rows[0]
    title = (
        f"### Decode ({first['dtype']}, {first['heads']}/{first['heads_kv']} heads, "
        f"head_dim {first['head_dim']}, {result.get('gpu', '?')}; "
        f"device copy {result.get('copy_tb_s', 0):.2f} TB/s)"
    )
    out = [title, "", "| " + " | ".join(head) + " |", "| " + " | ".join("---:" for _ in head) + " |"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out) + "\n"
