"""``bench --varlen``: a packed batch of ragged documents, ours against the padded dense batch and PyTorch.

The documents' lengths are drawn uniformly from [min_len, max_len] (seeded, so every run times the same
batch) until they fill ``tokens``. Rows (FLOPs of the useful work only: each document's own attention):

* ``flash_attention``: :func:`flash_attention.attention_varlen` on the packed tensors;
* ``flash_attention_padded``: :func:`flash_attention.attention` on the same documents padded to the longest
  into a dense batch (the padding random, as pad tokens' activations are); its ``useful_ms`` is its time
  times the useful share of its work (the issue's yardstick: a packed batch should cost about what the
  padded batch spends on real tokens);
* ``flex``: FlexAttention with a document mask (a block mask from the documents' ids);
* ``sdpa_efficient`` / ``sdpa_cudnn``: SDPA with the block-diagonal boolean mask, materialised
  (total x total), as a model without a varlen kernel passes it;
* ``fa4``: FlashAttention-4's ``flash_attn_varlen_func`` on the packed tensors (skipped where it is not
  installed, and with ALiBi, which it lacks).

With ``alibi`` every row gets ALiBi with the geometric slopes (each document's own positions: a packed
row's distance to a key of its document is the same as in the document alone): ours through
``alibi_slopes=``, the padded batch likewise, FlexAttention through a score_mod; SDPA is skipped, as its
additive mask would be (heads, total, total) floats (128 GiB in bf16 at 64k tokens and 16 heads). One more
row, ``flash_attention_per_sequence_slopes``, gives ours the same slopes as a (documents, heads) table (the
kernels' per-row builds: what slopes of each document's own cost over one table for all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import flash_attention

from ..common import time_cuda
from .fa4 import FA4, fa4_varlen
from .runners import Skip, _flex, _sdpa_backend, alibi_slopes, one_line

VARLEN_IMPLS = ("flash_attention", "flash_attention_padded", "flex", "sdpa_efficient", "sdpa_cudnn", FA4)
#: With ALiBi, after ours: the same slopes per document (see the module's docstring).
PER_SEQUENCE = "flash_attention_per_sequence_slopes"


@dataclass
class VarlenSettings:
    impls: tuple[str, ...]
    head_dim: int = 128
    heads: int = 16
    kv_heads: int = 0
    tokens: int = 65536
    min_len: int = 128
    max_len: int = 8192
    causal: tuple[bool, ...] = (True, False)
    mode: str = "fwd"
    dtype: str = "bf16"
    #: ALiBi with the geometric slopes on every implementation that has it (see the module's docstring).
    alibi: bool = False
    seed: int = 0
    warmup: int = 3
    min_reps: int = 10
    min_time_s: float = 0.3


def document_lengths(s: VarlenSettings) -> list[int]:
    """Lengths uniform in [min_len, max_len] until ``tokens`` are filled (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(s.seed)
    lengths: list[int] = []
    while sum(lengths) < s.tokens:
        n = int(torch.randint(s.min_len, s.max_len + 1, (1,), generator=gen))
        lengths.append(min(n, s.tokens - sum(lengths)))
    return lengths


def useful_flops(lengths: list[int], heads: int, head_dim: int, causal: bool, mode: str) -> float:
    """Each document's own attention: 4 n^2 d per head forward (half of it causal), x3.5 with backward."""
    per = sum(4.0 * n * n * head_dim * heads * (0.5 if causal else 1.0) for n in lengths)
    return per * (3.5 if mode == "fwd_bwd" else 1.0)


def _timed(call, n_sets: int, s: VarlenSettings) -> float:
    return time_cuda(call, n_sets, warmup=s.warmup, min_reps=s.min_reps, min_time_s=s.min_time_s).ms


def _grad_call(f, tensors):
    leaves = [t.detach().requires_grad_(True) for t in tensors]

    def call(i: int) -> Any:
        out = f(*leaves)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    return call


def _runner(impl: str, s: VarlenSettings, causal: bool, lengths: list[int], q, k, v) -> tuple[Any, Any]:
    """``(call, output)`` of ``impl``: call(i) runs it once (in the settings' mode), output() is its forward
    output in the packed (total, heads, head_dim) layout, or None; raises Skip."""
    device = q.device
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = q.shape[0]
    fwd_only = s.mode == "fwd"
    slopes = alibi_slopes(q.shape[1], device) if s.alibi else None
    if impl in ("flash_attention", PER_SEQUENCE):
        if impl == PER_SEQUENCE:
            slopes = slopes.expand(len(lengths), -1).contiguous()

        def f(q, k, v):
            return flash_attention.attention_varlen(q, k, v, cu, cu, causal=causal, alibi_slopes=slopes)

        return (lambda i: f(q, k, v)) if fwd_only else _grad_call(f, (q, k, v)), lambda: f(q, k, v)
    if impl == "flash_attention_padded":
        longest, batch = max(lengths), len(lengths)

        # The padding holds random values as the documents do, not zeros: a real padded batch's pad tokens
        # have nonzero activations, and zero operands draw less power, so a GPU at its power limit clocks
        # higher on a zero-padded batch (an H200 ran the bench's zero-padded causal batch 1.14x faster than
        # the same batch padded with random values, kernel log step 90), which would flatter the yardstick.
        gen = torch.Generator(device=device).manual_seed(s.seed + 1)

        def padded(t):
            out = torch.randn(batch, longest, *t.shape[1:], generator=gen, device=device).to(t.dtype)
            for b, n in enumerate(lengths):
                out[b, :n] = t[int(cu[b]) : int(cu[b]) + n]
            return out

        qp, kp, vp = padded(q), padded(k), padded(v)

        def f(q, k, v):
            return flash_attention.attention(q, k, v, causal=causal, alibi_slopes=slopes)

        return (lambda i: f(qp, kp, vp)) if fwd_only else _grad_call(f, (qp, kp, vp)), lambda: None
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), cu.diff().long())
    gqa = q.shape[1] != k.shape[1]
    native = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]  # (1, heads, total, d)
    if impl == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as exc:
            raise Skip(f"FlexAttention is not in torch {torch.__version__}") from exc

        def document(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        block_mask = create_block_mask(document, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
        flex = _flex()

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        score_mod = alibi if s.alibi else None

        def f(q, k, v):
            return flex(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=gqa)

        call = (lambda i: f(*native)) if fwd_only else _grad_call(f, native)
        return call, lambda: f(*native)[0].transpose(0, 1)
    if impl == FA4:
        f = fa4_varlen(cu, max(lengths), causal=causal, alibi=s.alibi)
        return (lambda i: f(q, k, v)) if fwd_only else _grad_call(f, (q, k, v)), lambda: f(q, k, v)
    if impl in ("sdpa_efficient", "sdpa_cudnn"):
        if s.alibi:
            raise Skip("ALiBi needs SDPA's additive mask per head: (heads, total, total) does not fit")
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        mask = doc[:, None] == doc[None, :]
        if causal:
            mask &= torch.ones(total, total, dtype=torch.bool, device=device).tril()
        backend = _sdpa_backend(impl)

        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

        call = (lambda i: f(*native)) if fwd_only else _grad_call(f, native)
        return call, lambda: f(*native)[0].transpose(0, 1)
    raise Skip(f"unknown implementation {impl!r}; known: {', '.join(VARLEN_IMPLS)}")


def run_varlen(s: VarlenSettings) -> list[dict]:
    """Time every implementation on the same packed batch, for each causal flag; rows as the sweep's."""
    lengths = document_lengths(s)
    total = sum(lengths)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[s.dtype]
    kv = s.kv_heads or s.heads
    torch.manual_seed(s.seed)
    q = torch.randn(total, s.heads, s.head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, kv, s.head_dim, device="cuda", dtype=dtype) for _ in range(2))
    print(
        f"{len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens ({total} in all), heads {s.heads}"
        f" (kv {kv}), head_dim {s.head_dim}, {s.dtype}, {s.mode}{', ALiBi' if s.alibi else ''}",
        flush=True,
    )
    rows = []
    impls = list(s.impls)
    if s.alibi and "flash_attention" in impls:
        impls.insert(impls.index("flash_attention") + 1, PER_SEQUENCE)
    for causal in s.causal:
        flops = useful_flops(lengths, s.heads, s.head_dim, causal, s.mode)
        anchor = None
        padded_ms = None
        for impl in impls:
            base = dict(impl=impl, mode=s.mode, dtype=s.dtype, head_dim=s.head_dim, causal=causal,
                        seqlen=total, batch=len(lengths), heads=s.heads, kv_heads=kv,
                        varlen=True, alibi=s.alibi)  # fmt: skip
            try:
                call, output = _runner(impl, s, causal, lengths, q, k, v)
                out = output()
                ms = _timed(call, 1, s)
            except Exception as exc:
                reason = one_line(exc)
                print(f"    {impl:<24} skipped: {reason[:200]}", flush=True)
                rows.append({**base, "ms": None, "tflops": None, "skipped": reason})
                torch.cuda.empty_cache()
                continue
            row = {**base, "ms": round(ms, 5), "tflops": round(flops / (ms * 1e-3) / 1e12, 2)}
            if impl == "flash_attention_padded":
                longest = max(lengths)
                share = sum(n * n for n in lengths) / (len(lengths) * longest * longest)
                row["useful_ms"] = round(ms * share, 5)
                row["tflops"] = round(flops / (ms * share * 1e-3) / 1e12, 2)  # the padded run's own rate
                padded_ms = row["useful_ms"]
            if out is not None:
                if anchor is None:
                    anchor = out
                else:
                    row["max_diff_vs_" + impls[0]] = float((out.float() - anchor.float()).abs().max())
            rows.append(row)
            extra = f"  useful {row['useful_ms']:.3f} ms" if "useful_ms" in row else ""
            print(
                f"  {'causal    ' if causal else 'non-causal'} {impl:<24} {ms:9.3f} ms"
                f" {row['tflops']:7.1f} TFLOP/s{extra}",
                flush=True,
            )
            torch.cuda.empty_cache()
        ours = next((r for r in rows if r["impl"] == "flash_attention" and r["causal"] == causal), None)
        if ours and ours["ms"] and padded_ms:
            print(f"  varlen / padded useful work: {ours['ms'] / padded_ms:.3f}x", flush=True)
    return rows
