"""attention_with_kvcache on CPU: semantics against the float64 reference, the in-place append, argument
and value checks, and the torch.compile custom op."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch
from kvcache_cases import Case, check_case, make_inputs, random_case

import flash_attention
from flash_attention.fallback.reference import attention_kvcache_reference, attention_reference
from flash_attention.spec import pack_options


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _rng(request) -> random.Random:
    return random.Random(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("page_size", [0, 1, 3, 16])
@pytest.mark.parametrize("seqlen_new", [0, 1, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_float32(request, page_size, seqlen_new, causal):
    rng = _rng(request)
    for seqlen_q, group in ((1, 1), (4, 4), (16, 8)):
        case = random_case(
            rng,
            page_size=page_size,
            head_dim=rng.choice([32, 40, 64]),
            group=group,
            seqlen_q=seqlen_q,
            seqlen_new=seqlen_new,
            causal=causal,
            max_pages=max(2, 48 // max(page_size, 1)),
        )
        check_case(case, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("page_size", [0, 16])
def test_matches_reference_dtypes(request, dtype, page_size):
    rng = _rng(request)
    case = random_case(
        rng, page_size=page_size, head_dim=64, group=4, seqlen_q=4, seqlen_new=3, causal=True, max_pages=5
    )
    check_case(case, dtype, "cpu")


@pytest.mark.parametrize("page_size", [0, 3])
@pytest.mark.parametrize(
    ("causal", "window", "softcap", "alibi"),
    [
        (True, (5, -1), 0.0, 0),
        (True, (0, 0), 0.0, 0),
        (False, (7, 2), 0.0, 0),
        (False, (-1, 3), 0.0, 0),
        (True, None, 3.0, 0),
        (True, (9, 0), 2.0, 0),
        (True, None, 0.0, 1),
        (False, (6, 4), 0.0, 2),
        (True, (8, 0), 2.5, 1),  # both: the capped score plus the bias
    ],
)
def test_windows_softcap_and_alibi_match_reference(request, page_size, causal, window, softcap, alibi):
    # The composed path (this machine's) against the float64 reference with attention()'s window,
    # soft-capping and ALiBi (per head, per row and head): speculative-decoding queries, GQA, appends, rows
    # whose window starts inside the cache.
    rng = _rng(request)
    for seqlen_q, group in ((1, 1), (6, 2)):
        case = random_case(
            rng, page_size=page_size, head_dim=32, group=group, seqlen_q=seqlen_q, seqlen_new=2,
            causal=causal, max_pages=max(2, 40 // max(page_size, 1)),
        )  # fmt: skip
        case = dataclasses.replace(case, window=window, softcap=softcap, alibi=alibi)
        check_case(case, torch.float32, "cpu")


def test_one_length_for_all_rows_as_int(request):
    case = Case(
        batch=2,
        seqlen_q=3,
        heads_q=4,
        heads_kv=2,
        head_dim=32,
        seqlen_new=2,
        page_size=0,
        capacity=50,
        causal=True,
        lengths=[20, 20],
    )
    check_case(case, torch.float32, "cpu", use_int_seqlens=True)


def test_more_queries_than_keys_leaves_the_first_rows_empty():
    # 6 queries against 1 cached + 2 new keys, causal: the first 3 rows see nothing (0 and LSE -inf), as in
    # attention()'s bottom-right rule.
    case = Case(
        batch=2,
        seqlen_q=6,
        heads_q=2,
        heads_kv=1,
        head_dim=16,
        seqlen_new=2,
        page_size=4,
        capacity=8,
        causal=True,
        lengths=[1, 6],
    )
    check_case(case, torch.float32, "cpu")


def test_no_new_tokens_is_plain_attention_on_the_cache():
    q = torch.randn(2, 5, 4, 32)
    k_cache, v_cache = torch.randn(2, 30, 2, 32), torch.randn(2, 30, 2, 32)
    before = k_cache.clone()
    out = flash_attention.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=17, causal=True)
    ref, _ = attention_reference(q.double(), k_cache[:, :17].double(), v_cache[:, :17].double(), causal=True)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.equal(k_cache, before)


def test_append_writes_only_the_new_positions():
    # The cache positions outside [len, len + new) of each row, and the pages no row uses, keep their bytes.
    case = Case(
        batch=3,
        seqlen_q=1,
        heads_q=4,
        heads_kv=4,
        head_dim=8,
        seqlen_new=3,
        page_size=2,
        capacity=12,
        causal=True,
        lengths=[0, 4, 9],
    )
    q, k_cache, v_cache, k, v, lengths, table = make_inputs(case, torch.float32, "cpu")
    before = k_cache.clone()
    flash_attention.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table
    )
    changed = (k_cache != before).flatten(1).any(1)  # per page
    written = set()
    for b, n in enumerate(case.lengths):
        for t in range(case.seqlen_new):
            p = n + t
            written.add(int(table[b, p // 2]))
            assert torch.equal(k_cache[table[b, p // 2], p % 2], k[b, t])
    assert set(changed.nonzero().flatten().tolist()) == written


def test_cache_lengths_are_not_advanced():
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8)
    flash_attention.attention_with_kvcache(
        torch.randn(2, 1, 2, 8),
        k_cache,
        v_cache,
        torch.randn(2, 2, 1, 8),
        torch.randn(2, 2, 1, 8),
        cache_seqlens=lengths,
    )
    assert lengths.tolist() == [3, 5]


def test_decode_loop_equals_attention_on_the_whole_sequence():
    # Prefill 7 tokens through the cache, then decode 5 one at a time: every step's output equals causal
    # attention over the tokens so far (the last row of a full causal attention).
    batch, heads, dim, total = 2, 4, 16, 12
    k_all, v_all = torch.randn(batch, total, 2, dim), torch.randn(batch, total, 2, dim)
    q_all = torch.randn(batch, total, heads, dim)
    k_cache, v_cache = torch.zeros(8, 4, 2, dim), torch.zeros(8, 4, 2, dim)
    table = torch.tensor([[5, 0, 2, 7], [1, 3, 6, 4]], dtype=torch.int32)
    full, _ = attention_reference(q_all.double(), k_all.double(), v_all.double(), causal=True)
    out = flash_attention.attention_with_kvcache(
        q_all[:, :7], k_cache, v_cache, k_all[:, :7], v_all[:, :7], cache_seqlens=0, block_table=table
    )
    assert torch.allclose(out.double(), full[:, :7], atol=1e-5)
    for step in range(7, total):
        lengths = torch.full((batch,), step, dtype=torch.int32)
        out = flash_attention.attention_with_kvcache(
            q_all[:, step : step + 1],
            k_cache,
            v_cache,
            k_all[:, step : step + 1],
            v_all[:, step : step + 1],
            cache_seqlens=lengths,
            block_table=table,
        )
        assert torch.allclose(out.double(), full[:, step : step + 1], atol=1e-5)


def test_torch_compile_fullgraph_is_one_op_and_writes_the_cache(request):
    case = random_case(
        _rng(request), page_size=4, head_dim=32, group=2, seqlen_q=2, seqlen_new=2, causal=True
    )
    q, k_cache, v_cache, k, v, lengths, table = make_inputs(case, torch.float32, "cpu")
    ref_out, _, ref_kc, ref_vc = attention_kvcache_reference(
        q.double(),
        k_cache.double(),
        v_cache.double(),
        k.double(),
        v.double(),
        cache_seqlens=lengths,
        block_table=table,
    )
    torch._dynamo.reset()
    compiled = torch.compile(flash_attention.attention_with_kvcache, fullgraph=True)
    out = compiled(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.equal(k_cache.double(), ref_kc) and torch.equal(v_cache.double(), ref_vc)


def test_custom_op_schema_fake_and_mutation_agree():
    q, k_cache, v_cache = torch.randn(2, 3, 4, 16), torch.randn(5, 4, 2, 16), torch.randn(5, 4, 2, 16)
    k, v = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    table = torch.tensor([[0, 3, 1], [4, 2, 0]], dtype=torch.int32)
    lengths = torch.tensor([1, 6], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.flash_attention.fwd_kvcache.default,
        (
            q,
            k_cache,
            v_cache,
            k,
            v,
            lengths,
            table,
            0,
            *pack_options(True, 0.25, window=(2, -1), softcap=5.0),
        ),
    )
    # Without new tokens, the op that declares no write (opcheck fails an op that writes an argument it does
    # not declare).
    torch.library.opcheck(
        torch.ops.flash_attention.fwd_kvcache_read.default,
        (q, k_cache, v_cache, lengths + 2, table, 0, *pack_options(True, 0.25)),
    )


def test_compiled_calls_without_new_tokens_declare_no_write(monkeypatch):
    q, k_cache, v_cache = torch.randn(2, 1, 4, 16), torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    ref = flash_attention.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    seen = []
    real = torch.ops.flash_attention.fwd_kvcache_read

    def spy(*args):
        seen.append(len(args))
        return real(*args)

    monkeypatch.setattr(torch.ops.flash_attention, "fwd_kvcache_read", spy)
    torch._dynamo.reset()
    compiled = torch.compile(flash_attention.attention_with_kvcache, fullgraph=True, backend="eager")
    kc, vc = k_cache.clone(), v_cache.clone()
    out = compiled(q, kc, vc, cache_seqlens=lengths)
    assert seen and torch.allclose(out, ref, atol=1e-6)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


def _valid_call(**override):
    args = dict(
        q=torch.randn(2, 1, 4, 16),
        k_cache=torch.randn(2, 10, 2, 16),
        v_cache=torch.randn(2, 10, 2, 16),
        k=torch.randn(2, 1, 2, 16),
        v=torch.randn(2, 1, 2, 16),
        cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
    )
    args.update(override)
    q, kc, vc, k, v = (args.pop(n) for n in ("q", "k_cache", "v_cache", "k", "v"))
    return flash_attention.attention_with_kvcache(q, kc, vc, k, v, **args)


@pytest.mark.parametrize(
    "override, error, words",
    [
        (dict(q=torch.randn(2, 1, 4)), ValueError, "q must have shape"),
        (dict(q=torch.randn(2, 1, 4, 16).to_sparse()), TypeError, "q must be a dense"),
        (
            dict(k_cache=torch.randn(3, 10, 2, 16), v_cache=torch.randn(3, 10, 2, 16)),
            ValueError,
            "batch size",
        ),
        (dict(v_cache=torch.randn(2, 9, 2, 16)), ValueError, "v_cache must have the pages (or batch), rows"),
        (dict(v_cache=torch.randn(2, 10, 2, 257)), ValueError, "v_cache's head_dim"),
        (dict(k_cache=torch.randn(2, 10, 3, 16), v_cache=torch.randn(2, 10, 3, 16)), ValueError, "multiple"),
        (dict(k_cache=torch.randn(2, 10, 2, 8), v_cache=torch.randn(2, 10, 2, 8)), ValueError, "head_dim"),
        (dict(k_cache=torch.randn(2, 10, 2, 16).half()), TypeError, "k_cache must have the dtype of q"),
        (dict(k=None), ValueError, "k and v must be given together"),
        (dict(k=torch.randn(2, 1, 1, 16), v=torch.randn(2, 1, 1, 16)), ValueError, "k must have shape"),
        (dict(v=torch.randn(2, 2, 2, 16)), ValueError, "v must have shape"),
        (dict(v=torch.randn(2, 1, 2, 8)), ValueError, "v must have shape"),
        (dict(k=torch.randn(2, 11, 2, 16), v=torch.randn(2, 11, 2, 16)), ValueError, "new tokens"),
        (dict(k_cache=torch.randn(2, 16, 10, 2).transpose(1, 3)), ValueError, "contiguous last dimension"),
        (dict(cache_seqlens=torch.tensor([3, 4])), TypeError, "cache_seqlens must be int32"),
        (
            dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)),
            ValueError,
            "cache_seqlens must have shape",
        ),
        (dict(cache_seqlens=10), ValueError, "cache_seqlens (10) must be in [0, 9]"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens (-1)"),
        (dict(cache_seqlens=True), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([3, 10], dtype=torch.int32)), ValueError, "cache_seqlens[1] = 10"),
        (dict(cache_seqlens=torch.tensor([-2, 1], dtype=torch.int32)), ValueError, "cache_seqlens[0] = -2"),
        (dict(block_table=torch.zeros(2, 3)), TypeError, "block_table must be int32"),
        (dict(block_table=torch.zeros(3, dtype=torch.int32)), ValueError, "block_table must have shape"),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "block_table must have shape"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(num_splits=1.5), TypeError, "num_splits"),
        (dict(causal=1), TypeError, "causal"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
        (dict(out=torch.empty(2, 1, 4, 8)), ValueError, "out must have the shape"),
        (dict(window=(3,)), TypeError, "window"),
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    ],
)
def test_bad_arguments_name_the_argument(override, error, words):
    # A valid call of the same shapes first: its validated signature is kept (kvcache._validated), and the
    # bad call, whose signature differs, must still be checked.
    _valid_call()
    with pytest.raises(error) as info:
        _valid_call(**override)
    assert words in str(info.value)


def test_validation_runs_once_per_signature(monkeypatch):
    from flash_attention.api import kvcache

    calls = []
    real = kvcache.validate_kvcache
    monkeypatch.setattr(kvcache, "validate_kvcache", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(kvcache, "_validated", type(kvcache._validated)())
    q, cache = (
        torch.randn(2, 1, 4, 16),
        dict(k_cache=torch.randn(2, 10, 2, 16), v_cache=torch.randn(2, 10, 2, 16)),
    )
    for _ in range(3):
        _valid_call(q=torch.randn(2, 1, 4, 16), **cache)
    assert len(calls) == 1
    _valid_call(q=q.double(), k_cache=cache["k_cache"].double(), v_cache=cache["v_cache"].double(),
                k=torch.randn(2, 1, 2, 16).double(), v=torch.randn(2, 1, 2, 16).double())  # fmt: skip
    assert len(calls) == 2
    # An int length: its signature kept, its value checked per call.
    _valid_call(q=q, cache_seqlens=2, **cache)
    _valid_call(q=q, cache_seqlens=5, **cache)
    assert len(calls) == 3
    with pytest.raises(ValueError, match=r"cache_seqlens \(10\) must be in \[0, 9\]"):
        _valid_call(q=q, cache_seqlens=10, **cache)
    # Contiguous caches of 17 and 18 positions share a bucket (configs.decode.cache_length_bucket) and so a
    # signature; what validation reads of the capacity is checked per call.
    grown = [dict(k_cache=torch.randn(2, n, 2, 16), v_cache=torch.randn(2, n, 2, 16)) for n in (17, 18)]
    _valid_call(q=q, cache_seqlens=16, **grown[0])
    _valid_call(q=q, cache_seqlens=17, **grown[1])
    assert len(calls) == 5  # the failed check above validated afresh (and raised), the 17-position cache once
    with pytest.raises(ValueError, match="v_cache must have the pages"):
        _valid_call(q=q, k_cache=grown[1]["k_cache"], v_cache=grown[0]["v_cache"])
    with pytest.raises(ValueError, match=r"cache_seqlens \(17\) must be in \[0, 16\]"):
        _valid_call(q=q, cache_seqlens=17, **grown[0])


def test_a_growing_contiguous_cache_keeps_its_signature_within_a_bucket():
    from flash_attention.api import kvcache

    def key(capacity, heads_first=False):
        shape = (2, 2, capacity, 16) if heads_first else (2, capacity, 2, 16)
        cache = torch.randn(shape)
        if heads_first:  # transformers' (batch, heads, seqlen, head_dim), seen as (batch, seqlen, heads, ...)
            cache = cache.transpose(1, 2)
        q = torch.randn(2, 1, 4, 16)
        return kvcache._signature(q, cache, cache, None, None, 7, None, True, None, 0, None, False)

    assert key(1025) == key(1100) == key(1152) == key(1152, heads_first=True) != key(1153)
    assert key(1024) != key(1025)
    # A cache whose strides the kernels cannot read keeps its exact shape and strides in the signature.
    odd = torch.randn(2, 1025, 2, 17)[..., :16]
    q = torch.randn(2, 1, 4, 16)
    odd_key = kvcache._signature(q, odd, odd, None, None, 7, None, True, None, 0, None, False)
    assert odd.stride() in odd_key


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(2, 9, 3, 16),
        torch.randn(2, 3, 9, 16).transpose(1, 2),
        torch.randn(2, 9, 3, 17)[..., :16],
        torch.randn(2, 9, 3, 16)[:, :, :, ::2],
        torch.randn(1, 9, 3, 16).expand(2, 9, 3, 16),
        torch.randn(2, 1, 3, 16).expand(2, 9, 3, 16),
        torch.randn(1, 9, 3, 16).expand(1, 9, 3, 16),
        torch.randn(2, 9, 3, 24)[..., 8:],
    ],
)
def test_the_signatures_cache_layout_rule_is_the_kernels(tensor):
    from flash_attention.api import kvcache
    from flash_attention.ops.decode import layout_ok

    assert kvcache._readable_cache(tensor.shape, tensor.stride()) == layout_ok(tensor)


def test_bad_page_index_raises_before_writing():
    # Row 1 ends at position 7 after its append: pages 0 and 1 of its table are read, the third is not.
    k_cache, v_cache = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
    before = k_cache.clone()
    table = torch.tensor([[0, 1, -1], [2, 9, 3]], dtype=torch.int32)
    lengths = torch.tensor([1, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9 is not a page"):
        _valid_call(k_cache=k_cache, v_cache=v_cache, block_table=table, cache_seqlens=lengths)
    assert torch.equal(k_cache, before)
    # The unused -1 entry of row 0 and a stale entry past row 1's pages are never read.
    table[1, 1] = 3
    table[1, 2] = 99
    _valid_call(k_cache=k_cache, v_cache=v_cache, block_table=table, cache_seqlens=lengths)


def test_paged_capacity_is_max_pages_times_page_size():
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cache = dict(k_cache=torch.randn(4, 4, 2, 16), v_cache=torch.randn(4, 4, 2, 16), block_table=table)
    _valid_call(cache_seqlens=7, **cache)  # 7 + 1 new = 8 = 2 pages of 4
    with pytest.raises(ValueError, match=r"must be in \[0, 7\]"):
        _valid_call(cache_seqlens=8, **cache)


def test_requires_grad_raises():
    q = torch.randn(2, 1, 4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        _valid_call(q=q)
    with torch.no_grad():
        _valid_call(q=q)


def test_empty_batch_and_empty_queries():
    out = _valid_call(
        q=torch.randn(0, 1, 4, 16),
        k_cache=torch.randn(0, 10, 2, 16),
        v_cache=torch.randn(0, 10, 2, 16),
        k=torch.randn(0, 1, 2, 16),
        v=torch.randn(0, 1, 2, 16),
        cache_seqlens=torch.zeros(0, dtype=torch.int32),
    )
    assert out.shape == (0, 1, 4, 16)
    # No queries: the append still happens (a prefill that only fills the cache).
    k_cache = torch.randn(2, 10, 2, 16)
    k = torch.randn(2, 1, 2, 16)
    out = _valid_call(q=torch.randn(2, 0, 4, 16), k_cache=k_cache, k=k)
    assert out.shape == (2, 0, 4, 16)
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(k_cache[1, 4], k[1, 0])
