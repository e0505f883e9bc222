"""``attention()`` with a few queries per row against many keys runs on the decode kernels
(flash_attention.api.few_queries), checked on the CPU through the stand-in GPU of tests/stand_in_gpu.py: the
decode plan is made and launched with this call's tensors (the stand-in kernels compute from the params'
addresses and strides), the results match the float64 reference, later calls of the signature go straight
to the plan, and the calls the route must leave alone keep their usual kernels. The stand-in decode kernels
model plain and causal attention only; that windows, soft-capping and ALiBi reach the plan is checked on the
plan's problem here, and their numbers by tests/test_gpu_few_queries.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from stand_in_gpu import repeat_mode_gpu  # noqa: F401 (the gpu fixture)

import flash_attention as fa
from flash_attention import ops
from flash_attention.api import few_queries as _few_queries
from flash_attention.fallback.reference import attention_reference
from flash_attention.ops import decode, repeat


def _inputs(seed, b, sq, sk, hq, hkv, d=64):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, n, h, d, generator=gen).to(torch.bfloat16) for n, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )


def _check(out, lse, q, k, v, **kw):
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), **kw)
    assert (out.double() - ref).abs().max().item() < 2e-2
    if lse is not None:
        assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("b", "sq", "sk", "hq", "hkv", "causal"),
    [(2, 1, 300, 8, 2, True), (1, 4, 700, 8, 2, True), (3, 16, 260, 16, 4, False), (1, 64, 512, 4, 4, True)],
)
@pytest.mark.parametrize("layout", ["contiguous", "heads first"])
def test_few_queries_run_on_the_decode_kernels_as_the_reference(gpu, b, sq, sk, hq, hkv, causal, layout):
    q, k, v = _inputs(sq * 1000 + sk, b, sq, sk, hq, hkv)
    if layout == "heads first":  # (batch, heads, seqlen, head_dim) storage, as transformers passes k and v
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    for _ in range(3):  # the first call plans; the later ones repeat the plan
        gpu.launches.clear()
        out, lse = fa.attention(q, k, v, causal=causal, return_lse=True)
        assert "decode_decode" in gpu.launches and "forward" not in gpu.launches, gpu.launches
        _check(out, lse, q, k, v, causal=causal)
    assert not gpu.errors, gpu.errors
    assert isinstance(repeat.lookup(repeat.signature(q, k, v, causal, None, True, None, False, 0.0, None)),
                      _few_queries.RoutedCall)  # fmt: skip


def test_sinks_join_after_the_decode_kernels(gpu):
    q, k, v = _inputs(7, 2, 2, 400, 8, 2)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        gpu.launches.clear()
        out, lse = fa.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
        assert "decode_decode" in gpu.launches and "forward" not in gpu.launches
        _check(out, lse, q, k, v, causal=True, sinks=sinks)
    # out=: the caller's buffer, written in place
    buf = torch.full_like(q, float("nan"))
    got = fa.attention(q, k, v, causal=True, sinks=sinks, out=buf)
    assert got is buf
    _check(buf, None, q, k, v, causal=True, sinks=sinks)


@pytest.mark.parametrize(
    "kw",
    [
        dict(window=(100, 0), causal=True),
        dict(softcap=30.0, causal=True),
        dict(alibi_slopes="heads", causal=False),
        dict(window=(50, 20), softcap=10.0, causal=False),
    ],
)
def test_variants_reach_the_decode_plan(gpu, monkeypatch, kw):
    q, k, v = _inputs(11, 2, 1, 512, 8, 2)
    if kw.get("alibi_slopes") == "heads":
        kw = kw | {"alibi_slopes": torch.linspace(0.1, 0.8, 8)}
    problems = []
    made = decode.decode_plan

    def recording(problem, *args):
        problems.append(problem)
        return made(problem, *args)

    monkeypatch.setattr(decode, "decode_plan", recording)
    monkeypatch.setattr(ops, "decode_plan", recording)
    fa.attention(q, k, v, **kw)
    assert len(problems) == 1
    problem = problems[0]
    assert problem.score_values.get("softcap", 0.0) == kw.get("softcap", 0.0)
    assert problem.alibi == (1 if "alibi_slopes" in kw else 0)
    if "window" in kw:
        assert problem.window is not None
    assert problem.capacity == 512 and problem.seqlen_new == 0 and problem.seqlen_q == 1


@pytest.mark.parametrize(
    "what",
    ["many rows", "few keys", "key_range", "dropout", "recorded"],
)
def test_calls_the_route_leaves_alone_keep_the_forward_kernel(gpu, what):
    b, sq, sk, hq, hkv = 2, 1, 400, 8, 2
    if what == "many rows":
        sq = 17  # 17 x 4 = 68 packed rows
    if what == "few keys":
        sk = _few_queries.MIN_KEYS - 1
    q, k, v = _inputs(5, b, sq, sk, hq, hkv)
    kw = {}
    if what == "key_range":
        kw["key_range"] = torch.tensor([[0, sk], [10, sk - 5]], dtype=torch.int32)
    if what == "dropout":
        kw |= dict(dropout_p=0.1, dropout_seed=1)
    if what == "recorded":
        q.requires_grad_()
    gpu.launches.clear()
    if what == "dropout":  # (the stand-in forward has no dropout: it refuses, after being launched)
        with pytest.raises(AssertionError, match="no dropout"):
            fa.attention(q, k, v, causal=True, **kw)
        assert gpu.launches == ["forward"]
        return
    out = fa.attention(q, k, v, causal=True, **kw)
    assert "decode_decode" not in gpu.launches and "forward" in gpu.launches, (what, gpu.launches)
    if what == "recorded":
        out.sum().backward()  # the usual training path, its backward included
        assert q.grad is not None


def test_a_window_past_every_key_is_clipped_not_wrapped(gpu, monkeypatch):
    # A side of 2**32 + 3 keys bounds nothing (plain causal attention); passed through unclipped it wrapped
    # to 3 in the decode params' 32-bit field.
    q, k, v = _inputs(13, 1, 1, 512, 4, 4)
    problems = []
    made = ops.decode_plan
    monkeypatch.setattr(ops, "decode_plan", lambda problem, *a: problems.append(problem) or made(problem, *a))
    out = fa.attention(q, k, v, causal=True, window=(2**32 + 3, 0))
    assert "decode_decode" in gpu.launches
    (problem,) = problems
    assert problem.window is None or problem.window[0] >= 512, problem.window
    _check(out, None, q, k, v, causal=True)


def test_calls_without_a_repeat_signature_keep_their_plan(gpu, monkeypatch):
    # out= gives no repeat signature: the decode plan is still made once, not per call.
    q, k, v = _inputs(17, 2, 1, 400, 8, 2)
    made = []
    plan_class = decode.DecodePlan

    def counting(*a, **kw):
        made.append(1)
        return plan_class(*a, **kw)

    monkeypatch.setattr(decode, "DecodePlan", counting)
    buf = torch.empty_like(q)
    for _ in range(3):
        fa.attention(q, k, v, causal=True, out=buf)
        _check(buf, None, q, k, v, causal=True)
    assert len(made) == 1


# attention_varlen with about one query per sequence: each packed query row is a row of a contiguous cache
# whose rows share the packed keys at their sequence's offset (cache_starts), its key count the keys it sees.


def _varlen_inputs(seed, lens_q, lens_k, hq, hkv, d=64, extra_rows=0):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lens_q) + extra_rows, sum(lens_k)
    q = torch.randn(total_q, hq, d, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(total_k, hkv, d, generator=gen).to(torch.bfloat16) for _ in "kv")
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k)
    )
    return q, k, v, cu_q, cu_k


def _check_varlen(out, lse, q, k, v, cu_q, cu_k, used=None, causal=False, sinks=None):
    """Each sequence against its own float64 attention; rows past the last sequence 0."""
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(cu_q.numel() - 1):
        a, e = cu_q[b].item(), cu_q[b + 1].item()
        ka = cu_k[b].item()
        ke = ka + (used[b] if used is not None else cu_k[b + 1].item() - ka)
        if e == a:
            continue
        ref, ref_lse = attention_reference(
            *(t[None].double() for t in (q[a:e], k[ka:ke], v[ka:ke])), causal=causal, sinks=sinks
        )
        assert (out[a:e].double() - ref[0]).abs().max().item() < 2e-2, f"sequence {b}"
        if lse is not None:
            finite = ref_lse[0].isfinite()
            assert (lse[:, a:e][finite].double() - ref_lse[0][finite]).abs().max().item() < 1e-3
    assert (out[cu_q[-1].item() :] == 0).all()


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "hq", "hkv", "causal", "used"),
    [
        ([1, 1, 1], [300, 700, 256], 8, 2, True, None),  # one query each: a decoding step
        ([1, 1, 1, 1], [900, 260, 515, 400], 16, 4, False, None),
        ([2, 0, 1], [400, 300, 500], 8, 2, True, None),  # any spread is exact: two queries, then none
        ([1, 1], [600, 500], 4, 4, True, [333, 500]),  # seqused_k: a cache with room to spare
    ],
)
def test_varlen_decoding_steps_run_on_the_decode_kernels_as_the_reference(
    gpu, lens_q, lens_k, hq, hkv, causal, used
):
    q, k, v, cu_q, cu_k = _varlen_inputs(sum(lens_k), lens_q, lens_k, hq, hkv, extra_rows=0)
    kw = {} if used is None else {"seqused_k": torch.tensor(used, dtype=torch.int32)}
    for _ in range(2):  # the second call finds its plan and its row tables made
        gpu.launches.clear()
        out, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **kw)
        assert "decode_decode" in gpu.launches and "forward" not in gpu.launches, gpu.launches
        assert lse.shape == (hq, q.shape[0])
        _check_varlen(out, lse, q, k, v, cu_q, cu_k, used, causal)
    assert not gpu.errors, gpu.errors


def test_varlen_decoding_with_sinks_and_a_row_past_the_last_sequence(gpu):
    q, k, v, cu_q, cu_k = _varlen_inputs(5, [1, 1], [500, 400], 8, 2)
    cu_q = torch.tensor([0, 1, 1], dtype=torch.int32)  # the second query row belongs to no sequence
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(9))
    gpu.launches.clear()
    out = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
    assert "decode_decode" in gpu.launches and "forward" not in gpu.launches, gpu.launches
    _check_varlen(out, None, q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
    assert not gpu.errors, gpu.errors


def test_varlen_calls_the_route_leaves_alone(gpu):
    # Many queries per sequence, few keys, training, and a window without causal keep the usual kernels.
    q, k, v, cu_q, cu_k = _varlen_inputs(3, [40, 30], [300, 300], 8, 2)
    q1, k1, v1, cu_q1, cu_k1 = _varlen_inputs(4, [1, 1], [300, 400], 8, 2)
    for call in (
        lambda: fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True),
        lambda: fa.attention_varlen(q1, k1, v1, cu_q1, cu_k1, causal=False, window=(64, 64)),
        lambda: fa.attention_varlen(q1.clone().requires_grad_(), k1, v1, cu_q1, cu_k1, causal=True),
    ):
        gpu.launches.clear()
        call()
        assert "decode_decode" not in gpu.launches and "forward" in gpu.launches, gpu.launches


def test_varlen_rows_longer_than_the_splits_were_sized_for_are_covered_by_the_last_split(gpu):
    # The splits follow a typical sequence's keys (the max_seqlen_k hint, here far too small): a longer
    # sequence's last split runs to its end (fa/decode_block.cuh), so a wrong hint costs speed only.
    q, k, v, cu_q, cu_k = _varlen_inputs(21, [1], [6000], 8, 2)
    gpu.launches.clear()
    out = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, max_seqlen_k=1024)
    assert "decode_decode" in gpu.launches and "decode_combine" in gpu.launches, gpu.launches  # (split)
    _check_varlen(out, None, q, k, v, cu_q, cu_k, causal=True)
    assert not gpu.errors, gpu.errors


def test_varlen_route_gates_on_the_query_hint_and_clips_huge_windows(gpu):
    q, k, v, cu_q, cu_k = _varlen_inputs(22, [1, 1], [500, 700], 8, 2)
    gpu.launches.clear()  # a hint of many queries per sequence keeps the usual kernels
    fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=60)
    assert "forward" in gpu.launches and "decode_decode" not in gpu.launches, gpu.launches
    gpu.launches.clear()  # a window side past every key bounds nothing (and must not wrap the params' int32)
    out = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=(2**32 + 5, 0), max_seqlen_q=1)
    assert "decode_decode" in gpu.launches, gpu.launches
    _check_varlen(out, None, q, k, v, cu_q, cu_k, causal=True)


def test_varlen_route_keeps_the_checks_its_signature_cache_skips(gpu):
    # The route keeps each signature's checked problem (not the packed key count, which grows every step):
    # what that signature cannot tell apart must still reach the usual path's checks, which name it.
    q, k, v, cu_q, cu_k = _varlen_inputs(23, [1, 1], [500, 700], 8, 2)
    hints = dict(causal=True, max_seqlen_q=1, max_seqlen_k=700)
    for _ in range(2):  # (the second call finds the signature's entry)
        out = fa.attention_varlen(q, k, v, cu_q, cu_k, **hints)
        _check_varlen(out, None, q, k, v, cu_q, cu_k, causal=True)
    with pytest.raises(ValueError):  # v shorter than k: the decode kernels would read past v's end
        fa.attention_varlen(q, k, v[:-100], cu_q, cu_k, **hints)
    with pytest.raises(TypeError, match="softcap"):  # False hashes as 0.0, the cached signature's cap
        fa.attention_varlen(q, k, v, cu_q, cu_k, softcap=False, **hints)
    with pytest.raises(TypeError, match="softmax_scale"):
        fa.attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=True, **hints)
    # A huge window side is clipped to a bound that moves with the keys' bucket only: the steps of a
    # growing loop keep one entry.
    _few_queries._VARLEN_CALLS.clear()
    for extra in (0, 1, 2):
        keys = [500, 700 + extra]
        q2, k2, v2, cq2, ck2 = _varlen_inputs(24 + extra, [1, 1], keys, 8, 2)
        out = fa.attention_varlen(q2, k2, v2, cq2, ck2, window=(2**40, 0), **hints)
        _check_varlen(out, None, q2, k2, v2, cq2, ck2, causal=True)
    assert len(_few_queries._VARLEN_CALLS) == 1, list(_few_queries._VARLEN_CALLS)


def test_routed_varlen_plans_run_as_the_host_librarys_decode_call(gpu):
    # With repeat calls native (the default on a GPU), a routed plan's calls take decode_call with the row
    # starts bound (a result, not the empty answer that sends a call back to Python).
    if repeat.MODE != "native":
        pytest.skip("the Python form of the plans")
    answers = []
    real = decode.DecodePlan.repeat

    def spy(self, *args, **kwargs):
        answers.append(real(self, *args, **kwargs))
        return answers[-1]

    q, k, v, cu_q, cu_k = _varlen_inputs(25, [1, 1, 1], [300, 700, 256], 8, 2)
    try:
        decode.DecodePlan.repeat = spy
        for _ in range(2):
            out = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=1)
            _check_varlen(out, None, q, k, v, cu_q, cu_k, causal=True)
    finally:
        decode.DecodePlan.repeat = real
    assert len(answers) == 2 and all(a is not None for a in answers), answers


def test_the_decode_slots_are_the_params_fields_in_decode_calls_order():
    # csrc/host/decode_call.cpp writes the fields at the offsets Python lists, in its DecodeSlot order.
    import re
    from pathlib import Path

    from flash_attention.jit.params import DecodeParams

    source = (Path(decode.__file__).parents[1] / "csrc" / "host" / "decode_call.cpp").read_text()
    enum = re.search(r"enum DecodeSlot : int \{(.*?)\};", source, re.S).group(1)
    slots = [s.strip() for s in enum.replace("\n", " ").split(",") if s.strip()]
    camel = lambda name: "kDec" + "".join(part.capitalize() for part in name.split("_"))  # noqa: E731
    names = [*decode._NATIVE_SLOTS, "cache_starts", *decode._NATIVE_GEOMETRY_SLOTS, "cache_seqlen"]
    assert slots == [*map(camel, names), "kNumDecodeSlots"]
    assert all(hasattr(DecodeParams, n) for n in names)
