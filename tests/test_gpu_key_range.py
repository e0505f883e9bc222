"""GPU tests of per-batch key ranges (key padding inside the kernel) against the float64 reference.

The accuracy rule of DESIGN.md with the mask applied to both sides: PyTorch's attention gets the same mask
as an explicit boolean ``attn_mask``. Outputs are NaN-poisoned; rows with no visible key must be exactly 0
with an LSE of -inf.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import flash_attention as fa
from flash_attention.configs import default_config
from flash_attention.fallback.reference import attention_reference, causal_allowed, key_range_allowed

pytestmark = pytest.mark.gpu


def _ranges(batch, seqlen_k, kind, rng):
    rows = []
    for _ in range(batch):
        if kind == "right":
            rows.append((0, rng.randint(0, seqlen_k)))
        elif kind == "left":
            rows.append((rng.randint(0, seqlen_k), seqlen_k))
        elif kind == "both":
            a, b = sorted(rng.randint(0, seqlen_k) for _ in range(2))
            rows.append((a, b))
        else:  # out of range: clamped by the kernel and the reference alike
            rows.append((rng.randint(-50, seqlen_k + 50), rng.randint(-50, seqlen_k + 50)))
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def check(b, sq, sk, hq, hkv, d, dtype, causal, kind, seed, config=None):
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen, device="cuda").to(dtype)
    kr = _ranges(b, sk, kind, rng)
    out = torch.full_like(q, float("nan"))
    if config is None:
        o, lse = fa.attention(q, k, v, causal=causal, key_range=kr, return_lse=True, out=out)
    else:
        o, lse = fa.forward(config, q, k, v, causal=causal, key_range=kr, return_lse=True, out=out)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, key_range=kr)
    allowed = key_range_allowed(kr, sk)[:, None, None, :]  # (b, 1, 1, sk)
    if causal:
        allowed = allowed & causal_allowed(sq, sk, device="cuda")
    has_key = allowed.any(-1).expand(b, hq, sq).transpose(1, 2)  # (b, sq, hq)
    case = f"b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} {dtype} causal={causal} {kind} seed={seed}"
    assert not torch.isnan(o).any(), f"NaN in output: {case}"
    assert (o[~has_key] == 0).all(), f"rows without keys must be 0: {case}"
    assert torch.isneginf(lse.transpose(1, 2)[~has_key]).all(), case
    group = hq // hkv
    kt, vt = (x.transpose(1, 2).repeat_interleave(group, 1) for x in (k, v))
    so = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=allowed).transpose(1, 2)
    sdpa_err = (so.double() - ref_o).abs()[has_key].max().item() if has_key.any() else 0.0
    err = (o.double() - ref_o).abs()[has_key].max().item() if has_key.any() else 0.0
    bound = 2 * sdpa_err + 1e-5
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}: {case}"
    hk = has_key.transpose(1, 2)
    if hk.any():
        lse_err = (lse[hk].double() - ref_lse[hk]).abs().max().item()
        assert lse_err < 1e-3, f"lse error {lse_err:.3g}: {case}"


_rng = random.Random(1234)
_CASES = []
for i in range(48):
    d = _rng.choice([64, 64, 128, 128, 96, 192, 256, 40])
    hkv = _rng.choice([1, 2, 3])
    sq, sk = _rng.randint(1, 700), _rng.randint(1, 700)
    if i % 3 == 0:
        sk = sq
    kind = ["right", "left", "both", "wild"][i % 4]
    _CASES.append((_rng.randint(1, 5), sq, sk, hkv * _rng.choice([1, 2, 4]), hkv, d, i % 2 == 1, kind, i))


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_key_range_random(case, dtype):
    check(*case[:6], dtype, *case[6:])


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_key_range_shipped_configs_long(d, causal):
    # Long enough that whole K/V blocks before the range and after it are skipped.
    cfg = default_config("bf16", d, causal, 2048, 2048)
    check(3, 1500, 2048, 4, 2, d, torch.bfloat16, causal, "both", 7 + d, config=cfg)


def test_full_range_equals_unmasked_bitwise():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 333, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    kr = torch.tensor([[0, 333], [0, 333]], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        a = fa.attention(q, k, v, causal=causal)
        b = fa.attention(q, k, v, causal=causal, key_range=kr)
        assert torch.equal(a, b)


def test_key_range_int64_and_empty_rows():
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(3, 65, 2, 64, generator=gen, device="cuda").to(torch.float16) for _ in range(3))
    kr = torch.tensor([[0, 0], [10, 10], [5, 40]], dtype=torch.int64, device="cuda")
    o = fa.attention(q, k, v, key_range=kr)
    assert (o[:2] == 0).all()
    ref, _ = attention_reference(q, k, v, key_range=kr)
    assert (o[2].double() - ref[2]).abs().max().item() < 1e-2 * math.sqrt(1)
