"""GPU tests of attention_with_kvcache against the float64 reference: every page size serving engines use,
ragged cache lengths (0 and full included), appends inside a page, at a page's end and across pages, GQA
groups 1/4/8, head_dim 64/128/256, fp16/bf16. The check (tests/kvcache_cases.py) poisons the output, holds
the accuracy rule row by row and compares the caches after the append with the reference's exactly."""

from __future__ import annotations

import random

import pytest
import torch
from kvcache_cases import Case, check_case, random_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [0, 1, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pages_dtypes_head_dims(page_size, dtype, head_dim):
    rng = random.Random(f"{page_size}-{dtype}-{head_dim}")
    for group, seqlen_q, seqlen_new in ((1, 1, 1), (4, 4, 4), (8, 16, 0), (8, 1, 17)):
        case = random_case(
            rng,
            page_size=page_size,
            head_dim=head_dim,
            group=group,
            seqlen_q=seqlen_q,
            seqlen_new=seqlen_new,
            causal=rng.random() < 0.8,
            batch=4,
            max_pages=max(2, 1024 // max(page_size, 1)) if page_size else 6,
        )
        check_case(case, dtype, "cuda")


def test_long_cache_one_token():
    # 1 query token against 32k cached keys, 32/8 heads: the decode shape of the issue, on a paged cache.
    case = Case(
        batch=2,
        seqlen_q=1,
        heads_q=32,
        heads_kv=8,
        head_dim=128,
        seqlen_new=1,
        page_size=256,
        capacity=32768,
        causal=True,
        lengths=[32767, 20000],
    )
    check_case(case, torch.bfloat16, "cuda")
