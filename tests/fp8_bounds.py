"""The e4m3 forward's error bound, derived from where it rounds (docs/fp8-study.md, "Accuracy").

The kernel computes S = Q K^T of the e4m3 inputs in the tensor cores' accumulator, the running max and row
sums in fp32, and rounds only P, relative to the running max, to e4m3 for P V; O is then divided by the fp32
row sum and multiplied by v's descale in fp32, and written in bf16. Against attention of the exactly
dequantized inputs in float64, per output element (row i, column c), with w_ij the exact softmax weights,
l_i the exact row sum relative to the row's max and the sums over the keys row i sees:

    |O - ref|_ic <= 2^-4 sum_j w_ij |v_jc|         P's relative rounding, 3 significand bits (normal P)
                  + 2^-10 sum_j |v_jc| / l_i        P's absolute rounding below e4m3's normal range (2^-6)
                  + 2^-8 |ref_ic|                   the bf16 output (2^-9), twice over for margin

(A running max below the row's final one only shrinks the second term's share: the row sum grows with it.)
The S accumulation's own rounding moves P by far less than these, so the bound carries a factor 5/4 for it.
"""

from __future__ import annotations

import torch


def e4m3_output_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """The bound above for (batch, seqlen, heads, d) float64 q, k, v (k and v already repeated to q's heads),
    with the reference output it bounds the distance to: (bound, ref), both (batch, seqlen_q, heads, d)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:  # (bottom-right aligned, as the kernel's causal mask)
        visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)
    ref = torch.einsum("bhqk,bkhd->bqhd", p / row_sum, v)
    relative = torch.einsum("bhqk,bkhd->bqhd", p / row_sum, v.abs())
    seen = torch.einsum("bhqk,bkhd->bqhd", (p > 0).double() / row_sum, v.abs())
    bound = 1.25 * (2.0**-4 * relative + 2.0**-10 * seen) + 2.0**-8 * ref.abs()
    return bound, ref


def p_rounded_to(p_dtype: torch.dtype, q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """A float64 model of the kernel's rounding: P relative to the row's max rounded to p_dtype, divided by
    the unrounded row sum (the kernel's running max may lag the final one; this model takes the final)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", p.float().to(p_dtype).double() / row_sum, v)


def e4m3_backward_terms(q, k, v, do, out, lse_given, causal: bool, scale: float):
    """The FP8 backward's own error terms and the exact gradients (api.fp8_training's first form: the bf16
    backward on the dequantized tensors, with the e4m3 forward's output and LSE). q, k, v: the exactly
    dequantized float64 (batch, seqlen, heads, d) tensors (k and v with their own kv heads); do float64;
    ``out`` and ``lse_given``: the forward's output and LSE the backward was given (the e4m3 kernel's; its
    output is checked against its own bound by the forward's tests, its LSE by lse_bound here), float64.
    Returns ({"q": term, "k": term, "v": term}, {"q": dq, "k": dk, "v": dv}), each of its tensor's shape.

    Two roundings the bf16 backward of PyTorch's practice does not have, per element, over the keys j a query
    row i sees (P the exact softmax weights, dS = P (dP - delta) the exact one):
    * delta = rowsum(dO O) from the e4m3 forward's O, off by d_i = |rowsum(dO (O - O_exact))|, which moves
      dS_ij by P_ij d_i: dQ_ic by at most scale sum_j P_ij d_i |K_jc|, dK_jc by scale sum_i P_ij d_i |Q_ic|;
    * P recomputed from the bf16-rounded inputs against the LSE the forward took from its FP8 products
      (lse_given, off the exact one by the accumulator's rounding, which lse_bound holds): the recomputed P
      is the rounded inputs' softmax times exp(lse~_i - lse_given_i), a row factor off 1 by e_i, which
      moves dV_jc by sum_i e_i P_ij |dO_ic| and dS_ij by e_i |dS_ij| (dQ and dK as above).
    A query head's terms add into its kv head's (GQA); both carry a factor 5/4 for what they leave out
    (second-order products, the rounded inputs' own softmax against the exact one)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    _, out_exact = e4m3_output_bound(q, kr, vr, causal, scale)

    def logits(q_, k_):
        s = torch.einsum("bqhd,bkhd->bhqk", q_, k_) * scale
        if causal:
            visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
            s = s.masked_fill(~visible, float("-inf"))
        return s

    s = logits(q, kr)
    lse = torch.logsumexp(s, -1)  # (b, h, sq)
    p = torch.exp(s - lse[..., None])
    rounded = [t.to(torch.bfloat16).double() for t in (q, kr)]
    lse_rounded = torch.logsumexp(logits(*rounded), -1)
    e = (torch.exp(lse_rounded - lse_given) - 1).abs()  # (b, h, sq)
    dot = lambda a, b_: torch.einsum("bqhc,bqhc->bhq", a, b_)  # noqa: E731
    delta = dot(do, out_exact)
    dp = torch.einsum("bqhc,bkhc->bhqk", do, vr)
    ds = p * (dp - delta[..., None])
    grads = {
        "q": torch.einsum("bhqk,bkhc->bqhc", ds, kr) * scale,
        "k": torch.einsum("bhqk,bqhc->bkhc", ds, q) * scale,
        "v": torch.einsum("bhqk,bqhc->bkhc", p, do),
    }
    d = dot(do, out - out_exact).abs()  # (b, h, sq)
    moved = p * d[..., None] + e[..., None] * ds.abs()  # dS's moves, (b, h, sq, sk)
    terms = {
        "q": torch.einsum("bhqk,bkhc->bqhc", moved, kr.abs()) * scale,
        "k": torch.einsum("bhqk,bqhc->bkhc", moved, q.abs()) * scale,
        "v": torch.einsum("bhqk,bqhc->bkhc", p * e[..., None], do.abs()),
    }
    b, sk, hkv = k.shape[0], k.shape[1], k.shape[2]
    for name in ("k", "v"):  # (a kv head's gradient sums its query heads')
        grads[name] = grads[name].reshape(b, sk, hkv, group, -1).sum(3)
        terms[name] = terms[name].reshape(b, sk, hkv, group, -1).sum(3)
    return {n: 1.25 * t for n, t in terms.items()}, grads


def practice_grads(q, k, v, do, causal, scale):
    """PyTorch's own FP8-input training: the dequantized bf16 tensors through SDPA and its backward."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (
        x.transpose(1, 2) for x in (leaves[0], *(t.repeat_interleave(group, 2) for t in leaves[1:]))
    )
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(
        1, 2
    )
    return torch.autograd.grad(o, leaves, do)


def lse_bound(q, k, causal: bool, scale: float):
    """How far the e4m3 forward's LSE may be from the exact one, per row: its S is accumulated by the FP8
    tensor-core products with fewer bits than fp32 (DeepSeek-V3's report measured about 14 on Hopper; a
    truncating accumulator over d / 32 chunks can lose more), so each score is off by at most scale
    sum_c |q_ic k_jc| 2^-10, and the LSE, a softmax-weighted mean of the scores' moves, by at most the row's
    largest such bound, plus fp32's own rounding of the row sum, its exp2 and log: 2^-20 of the row's
    largest score and 2^-16 absolute. q, k: float64 (batch, seqlen, heads, d), k repeated to q's heads.
    Returns (b, h, sq)."""
    s_abs = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k.abs()) * scale
    if causal:
        visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
        s_abs = s_abs.masked_fill(~visible, 0.0)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return s_abs.amax(-1) * 2.0**-10 + s.abs().amax(-1) * 2.0**-20 + 2.0**-16


def assert_within_backward_bound(got, e4m3, descales, do, out, lse, causal, scale):
    """Each element of the gradients ``got`` (dq, dk, dv of e4m3 inputs with ``descales``, against ``do``,
    the forward's output ``out`` and ``lse`` given to the backward) against float64 on the exactly
    dequantized tensors: within twice the largest error of PyTorch's practice on the same tensors plus this
    backward's own terms (e4m3_backward_terms); the LSE first within lse_bound of the exact one."""
    from flash_attention.spec import fp8

    hkv = e4m3[1].shape[2]

    def per_element(d, heads):  # (a descale as a factor of a (batch, seqlen, heads, d) float64 tensor)
        if d is None or d.numel() == 1:
            return 1.0 if d is None else d.double().cpu().reshape(())
        return d.double().cpu().repeat_interleave(heads // hkv, 1)[:, None, :, None]

    exact = [
        fp8.dequantize(t, None, hkv).double().cpu() * per_element(d, t.shape[2])
        for t, d in zip(e4m3, descales, strict=True)
    ]
    lse64 = lse.double().cpu()
    group = exact[0].shape[2] // hkv
    s = torch.einsum("bqhd,bkhd->bhqk", exact[0], exact[1].repeat_interleave(group, 2)) * scale
    if causal:
        s = s.masked_fill(
            ~torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2]), -torch.inf
        )
    lse_off = (lse64 - torch.logsumexp(s, -1)).abs() - lse_bound(
        exact[0], exact[1].repeat_interleave(group, 2), causal, scale
    )
    assert lse_off.max().item() <= 0, f"the forward's LSE {lse_off.max().item():.3g} beyond its bound"
    terms, want = e4m3_backward_terms(*exact, do.double().cpu(), out.double().cpu(), lse64, causal, scale)
    practice = practice_grads(
        *(fp8.dequantize(t, d, hkv) for t, d in zip(e4m3, descales, strict=True)), do, causal, scale
    )
    for name, g, p in zip("qkv", got, practice, strict=True):
        err_torch = (p.double().cpu() - want[name]).abs().max().item()
        excess = (g.double().cpu() - want[name]).abs() - terms[name]
        worst = excess.max().item()
        assert worst <= 2 * err_torch + 1e-6, (
            f"d{name}: {worst:.3g} beyond its own terms, against PyTorch's practice {err_torch:.3g}"
        )
