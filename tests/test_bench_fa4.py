"""bench's FlashAttention-4 baseline (``fa4``, flash_attention/tools/bench/fa4.py) on the CPU: with a stand-in
``flash_attn.cute`` that computes the float64 reference from the arguments it is given, each bench variant's
call must reach it with FlashAttention-4's arguments (causal, window_size, softcap, learnable_sink, grouped
K/V heads as they are, packed offsets) and give the reference's answer; without the package the rows are
skipped with the reason, and ALiBi, which it lacks, is skipped too."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from flash_attention.fallback.reference import attention_reference
from flash_attention.tools.bench import runners, varlen
from flash_attention.tools.bench.results import DEFAULT_IMPLS


def _stand_in(calls: list) -> types.ModuleType:
    """A flash_attn.cute whose calls record their keyword arguments and return (out, lse) of the reference."""

    def window_of(kwargs):
        left, right = kwargs.get("window_size", (None, None))
        return None if left is None and right is None else (left, right)

    def flash_attn_func(q, k, v, *, causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None):
        kwargs = dict(causal=causal, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        calls.append(("dense", kwargs))
        return attention_reference(
            q, k, v, causal=causal, window=window_of(kwargs), softcap=softcap, sinks=learnable_sink,
            compute_dtype=q.dtype,
        )  # fmt: skip

    def flash_attn_varlen_func(
        q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False
    ):
        calls.append(("varlen", dict(causal=causal, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)))
        assert torch.equal(cu_seqlens_q, cu_seqlens_k)
        outs = []
        for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
            o, _ = attention_reference(
                q[None, a:b], k[None, a:b], v[None, a:b], causal=causal, compute_dtype=q.dtype
            )
            outs.append(o[0])
        return torch.cat(outs), None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return cute


@pytest.fixture
def fa4_calls(monkeypatch):
    calls: list = []
    package = types.ModuleType("flash_attn")
    package.cute = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package.cute)
    return calls


def test_fa4_is_a_default_baseline():
    assert "fa4" in DEFAULT_IMPLS


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize(
    "variant",
    [
        *(
            dict(),
            dict(causal=True, kv_heads=2),
            dict(causal=True, window=5),
            dict(score=(("softcap", 3.0),)),
        ),
        *(dict(sinks=True), dict(causal=True, head_dim_v=8)),
    ],
    ids=["plain", "gqa-causal", "window", "softcap", "sinks", "value-dim"],
)
def test_fa4_runner_calls_flash_attn_func_with_the_variant(fa4_calls, mode, variant):
    shape = runners.Shape(
        dtype="bf16", batch=2, heads=4, seqlen=33, head_dim=16, **{"causal": False, **variant}
    )
    inputs = [tuple(t.double() for t in s) for s in runners.make_inputs(shape, 2, "cpu")]
    runner = runners.make_runner("fa4", shape, inputs, mode)
    got = runner.output(1)
    q, k, v = inputs[1]
    sinks = runners._variant_args(shape, "cpu").get("sinks")
    window = (shape.window, 0) if shape.window else None
    expected, _ = attention_reference(
        q, k, v, causal=shape.causal, window=window, sinks=sinks, **dict(shape.score)
    )
    torch.testing.assert_close(got, expected)
    kind, kwargs = fa4_calls[-1]
    assert kind == "dense" and kwargs["causal"] == shape.causal
    assert kwargs["window_size"] == ((shape.window, 0) if shape.window else (None, None))
    assert kwargs["softcap"] == dict(shape.score).get("softcap", 0.0)
    assert (kwargs["learnable_sink"] is not None) == shape.sinks
    result = runner.call(0)
    if mode == "fwd_bwd":  # the gradients of q, k, v (and the sinks are learnable, as ours are timed)
        assert len(result) == 3 and all(torch.isfinite(g).all() for g in result)


def test_fa4_varlen_runner_calls_flash_attn_varlen_func(fa4_calls):
    s = varlen.VarlenSettings(impls=("fa4",), head_dim=16, heads=2, tokens=200, min_len=5, max_len=60)
    lengths = varlen.document_lengths(s)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 16, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        _, output = varlen._runner("fa4", s, causal, lengths, q, k, v)
        got = output()
        start = 0
        for n in lengths:
            ref, _ = attention_reference(q[None, start : start + n], k[None, start : start + n],
                                         v[None, start : start + n], causal=causal)  # fmt: skip
            torch.testing.assert_close(got[start : start + n], ref[0])
            start += n
        assert fa4_calls[-1] == (
            "varlen",
            dict(causal=causal, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths)),
        )


def test_fa4_rows_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn fails
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    shape = runners.Shape(dtype="bf16", batch=1, heads=2, seqlen=8, head_dim=16, causal=False)
    inputs = runners.make_inputs(shape, 1, "cpu")
    with pytest.raises(runners.Skip, match="FlashAttention-4 is not importable"):
        runners.make_runner("fa4", shape, inputs, "fwd")


def test_fa4_has_no_alibi(fa4_calls):
    shape = runners.Shape(dtype="bf16", batch=1, heads=2, seqlen=8, head_dim=16, causal=False, alibi=True)
    with pytest.raises(runners.Skip, match="no ALiBi"):
        runners.make_runner("fa4", shape, runners.make_inputs(shape, 1, "cpu"), "fwd")


def test_fa4_skips_a_score_function_its_call_does_not_take(fa4_calls, monkeypatch):
    # A release whose flash_attn_func has no keyword of a score function's name lacks that variant, and one
    # it would take only through **kwargs is not known to be there.
    def flash_attn_func(q, k, v, *, causal=False, window_size=(None, None), learnable_sink=None):
        raise AssertionError("a variant FlashAttention-4 lacks must not be called")

    def through_kwargs(q, k, v, causal=False, **kwargs):
        raise AssertionError("a variant FlashAttention-4 lacks must not be called")

    shape = runners.Shape(
        dtype="bf16", batch=1, heads=2, seqlen=8, head_dim=16, causal=False, score=(("softcap", 3.0),)
    )
    for func in (flash_attn_func, through_kwargs):
        monkeypatch.setattr(sys.modules["flash_attn.cute"], "flash_attn_func", func)
        with pytest.raises(runners.Skip, match="FlashAttention-4 has no softcap"):
            runners.make_runner("fa4", shape, runners.make_inputs(shape, 1, "cpu"), "fwd")
    plain = runners.Shape(dtype="bf16", batch=1, heads=2, seqlen=8, head_dim=16, causal=False)
    runners.make_runner("fa4", plain, runners.make_inputs(plain, 1, "cpu"), "fwd")  # builds; not called here
