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
