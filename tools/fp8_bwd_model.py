"""How accurate could an FP8 backward be? A float64 model of the backward's five products with their
operands rounded to e4m3 where an FP8 kernel would round them, against PyTorch's practice (the dequantized
tensors in bf16 through SDPA's backward), on the CPU.

    python tools/fp8_bwd_model.py [--seqlens 512,1024] [--head-dims 64,128] [--seeds 3]

docs/fp8-study.md 4.2 lists which products could take e4m3 operands and what each needs (dO quantized,
transposed e4m3 tiles of dO, Q and K, P and dS rounded to e4m3 with scales). Before any kernel, this asks
which of those roundings keep the gradients within the test suite's rule (at most twice the error of
PyTorch's own practice): for each form below, the largest error of dQ, dK and dV against float64 on the
exactly dequantized inputs, divided by practice's largest error on the same call.

The forms, each adding one rounding to the one before:
  bf16   today's backward (api.fp8_training): the bf16 backward on the dequantized tensors, modelled as
         float64 products of bf16-rounded P and dS (what the bf16 kernel's register operands are);
  dO8    dO quantized per (batch, head) (spec.fp8.quantize), dP^T = V dO^T with e4m3 operands;
  P8     and dV = P^T dO with P rounded to e4m3 (scaled by 256 into e4m3's top binades, as a kernel would);
  dS8t   and dK = dS^T Q, dQ = dS K with dS rounded to e4m3 by a power-of-two scale per 64 x 128 tile
         (each tile's amax; the accumulators rescaled between tiles, exact for powers of two);
  dS8    the same with one scale for the whole (batch, head) (a per-tensor amax, as cuDNN tracks it);
  dS8t_only, dS8_only   dS rounded as dS8t / dS8 with dO and P as in bf16: FP8 in dK and dQ alone
         (whose other operands, Q and K, are e4m3 already), dV and dP^T in bf16.

The products are exact in float64 and their sums are not rounded (the tensor cores' accumulators round
less than these operands do), so the model isolates the operand roundings. The LSE and delta are exact.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

E4M3 = torch.float8_e4m3fn
FORMS = ("bf16", "dO8", "P8", "dS8t", "dS8", "dS8t_only", "dS8_only")


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (nearest even, clamped to +-448), as float64."""
    return x.clamp(-448, 448).float().to(E4M3).double()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The least power of two at or above amax / 448 (1 where amax is 0): spec.fp8.quantize's rule."""
    amax = amax.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.exp2(torch.ceil(torch.log2(amax / 448)))


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one power-of-two scale for the whole tensor, dequantized."""
    s = power_of_two_scale(x.abs().amax())
    return e4m3_round(x / s) * s


def tile_quantized(ds: torch.Tensor, rows: int = 64, cols: int = 128) -> torch.Tensor:
    """dS (queries x keys) rounded to e4m3 with a power-of-two scale per rows x cols tile, dequantized."""
    out = torch.empty_like(ds)
    for i in range(0, ds.shape[0], rows):
        for j in range(0, ds.shape[1], cols):
            out[i : i + rows, j : j + cols] = quantized(ds[i : i + rows, j : j + cols])
    return out


def model_grads(q, k, v, do, causal: bool, scale: float, form: str):
    """dq, dk, dv of one head (seqlen, d float64 tensors) with the form's roundings."""
    s = q @ k.T * scale
    if causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(k.shape[0] - q.shape[0]), -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse)
    out = p @ v
    only = form.endswith("_only")
    stage = 0 if only else FORMS.index(form)
    do_ = quantized(do) if stage >= 1 else do
    dp = do_ @ v.T
    delta = (do * out).sum(-1, keepdim=True)  # (exact: from the forward's output)
    if stage >= 2:  # P into e4m3's top binades: scaled by 256 (P <= 1)
        dv = (e4m3_round(p * 256) / 256).T @ do_
    else:
        dv = bf16_round(p).T @ do_
    ds = p * (dp - delta) * scale
    if stage == 3 or form == "dS8t_only":
        ds_ = tile_quantized(ds)
    elif stage == 4 or form == "dS8_only":
        ds_ = quantized(ds)
    else:
        ds_ = bf16_round(ds)
    return ds_ @ k, ds_.T @ q, dv


def exact_grads(q, k, v, do, causal: bool, scale: float):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].T * scale
    if causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(k.shape[0] - q.shape[0]), -math.inf)
    o = torch.softmax(s, -1) @ leaves[2]
    return torch.autograd.grad(o, leaves, do)


def practice_grads(q, k, v, do, causal: bool, scale: float):
    """PyTorch's practice: the (exactly dequantized) tensors in bf16 through SDPA and its backward."""
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    mask = (
        torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0]) if causal else None
    )
    o = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale)
    return [g.double() for g in torch.autograd.grad(o, leaves, do.to(torch.bfloat16))]


def case_ratios(n: int, d: int, causal: bool, seed: int) -> dict[str, list[float]]:
    """Per form, the error of (dq, dk, dv) over practice's, for one head of random inputs quantized as
    attention(fp8=True) quantizes them (q and k at scale 2, v and dO at 1)."""
    gen = torch.Generator().manual_seed(seed)
    scale = d**-0.5
    raw = [torch.randn(n, d, generator=gen) * c for c in (2.0, 2.0, 1.0)]
    q, k, v = (quantized(t.double()) for t in raw)  # (fp8=True's inputs, exactly dequantized)
    do = bf16_round(torch.randn(n, d, generator=gen).double())
    want = exact_grads(q, k, v, do, causal, scale)
    practice = practice_grads(q, k, v, do, causal, scale)
    base = [(p - w).abs().max().item() for p, w in zip(practice, want, strict=True)]
    ratios = {}
    for form in FORMS:
        got = model_grads(q, k, v, do, causal, scale, form)
        ratios[form] = [(g - w).abs().max().item() / b for g, w, b in zip(got, want, base, strict=True)]
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="512,1024")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every case's worst ratios here")
    args = ap.parse_args(argv)
    rows = []
    print("error / practice's error, worst over seeds: dq dk dv")
    print(f"{'case':22}" + "".join(f"{f:>16}" for f in FORMS))
    for n in (int(x) for x in args.seqlens.split(",")):
        for d in (int(x) for x in args.head_dims.split(",")):
            for causal in (False, True):
                worst = {f: [0.0, 0.0, 0.0] for f in FORMS}
                for seed in range(args.seeds):
                    for f, r in case_ratios(n, d, causal, seed).items():
                        worst[f] = [max(a, b) for a, b in zip(worst[f], r, strict=True)]
                cells = "".join(f"{' '.join(f'{x:4.1f}' for x in worst[f]):>16}" for f in FORMS)
                print(f"{f'n {n} d {d}' + (' causal' if causal else ''):22}{cells}", flush=True)
                rows.append(
                    {"seqlen": n, "head_dim": d, "causal": causal, "seeds": args.seeds, "worst": worst}
                )
    if args.json:
        import json

        meta = {"tool": "tools/fp8_bwd_model.py", "torch": torch.__version__, "device": "cpu"}
        meta["what"] = "max |grad - float64| / PyTorch practice's, per form: [dq, dk, dv], worst over seeds"
        with open(args.json, "w") as f:
            json.dump({**meta, "forms": list(FORMS), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
