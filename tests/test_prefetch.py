"""A training call starts compiling its backward's kernels before its forward runs (ops.training
prefetch_backward -> ops.backward.prefetch -> jit.cache.prefetch), so that a first training step waits for
the longer of its two compiles rather than their sum. On the stand-in GPU (tests/stand_in_gpu.py) the
request must name exactly the build the backward then loads, for every kind of call; and the JIT cache
must compile a key once when a prefetch and a caller ask for it together."""

from __future__ import annotations

import threading

import pytest
import torch
from stand_in_gpu import install

import flash_attention as fa
from flash_attention import ops
from flash_attention.ops import repeat, training

# (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, options)
CALLS = [
    (128, 128, 4, 4, 64, dict(causal=True)),
    (100, 300, 4, 2, 128, dict()),
    (128, 128, 4, 4, 72, dict(causal=True)),  # head_dim padded to 8s: 72 stays, the kernels' 128
    (96, 96, 4, 4, 60, dict()),  # zero-padded copies to 64
    (128, 128, 2, 2, 128, dict(causal=True, window=(32, 0))),
    (128, 128, 2, 2, 64, dict(softcap=5.0)),
    (128, 128, 2, 2, 64, dict(causal=True, alibi=True)),
    (128, 128, 2, 2, 64, dict(key_range=True)),
    (128, 128, 2, 2, 128, dict(deterministic=True)),
]


@pytest.fixture(params=["sm_90", "sm_80"])
def gpu(request, monkeypatch):
    monkeypatch.setattr(repeat, "MODE", "python")
    monkeypatch.setattr(training, "_prefetched", set())
    stand_in = install(monkeypatch, request.param)
    yield stand_in
    ops.clear_plans()


@pytest.mark.parametrize("call", CALLS, ids=[str(i) for i in range(len(CALLS))])
def test_a_training_call_prefetches_the_backward_it_then_runs(gpu, call):
    sq, sk, hq, hkv, d, options = call
    options = dict(options)
    q = torch.randn(2, sq, hq, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, sk, hkv, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.linspace(0.1, 0.5, hq)
    if options.pop("key_range", False):
        options["key_range"] = torch.tensor([[3, sk - 5], [0, sk]], dtype=torch.int32)
    out = fa.attention(q, k, v, **options)
    assert len(gpu.prefetched) == 1, gpu.prefetched  # before the forward ran, once
    out.backward(torch.randn_like(out))
    assert gpu.backward_builds and set(gpu.backward_builds) == set(gpu.prefetched)
    # The same call again asks nothing more.
    fa.attention(q, k, v, **options)
    assert len(gpu.prefetched) == 1


def test_a_packed_training_call_prefetches_its_segments_build(gpu):
    lens = [37, 0, 90, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = fa.attention_varlen(q, k, v, cu, cu, causal=True)
    out.backward(torch.randn_like(out))
    assert len(gpu.prefetched) == 1 and set(gpu.backward_builds) == set(gpu.prefetched)
    assert gpu.prefetched[0][2] == "segments", gpu.prefetched


def test_inference_prefetches_nothing(gpu):
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    fa.attention(q, k, v, causal=True)
    with torch.no_grad():
        fa.attention(q.requires_grad_(), k, v)
    assert gpu.prefetched == []


def _stand_in_compiler(monkeypatch, tmp_path, on_compile=lambda: None) -> list:
    """A kernel cache in tmp_path whose compiler records each compile (the returned list), calls
    ``on_compile`` and returns a fixed cubin."""
    from flash_attention.jit import compiler

    monkeypatch.setenv("FLASH_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASH_ATTENTION_QUIET", "1")
    compiles: list = []

    def compile_source(source, arch, what, kind):
        compiles.append(what)
        on_compile()
        return compiler.CompileResult(b"\x7fELF cubin", "ptxas info", kind, [])

    monkeypatch.setattr(compiler, "choose_compiler", lambda: "nvrtc")
    monkeypatch.setattr(compiler, "compiler_id", lambda kind: "nvrtc test")
    monkeypatch.setattr(compiler, "compile_source", compile_source)
    return compiles


def test_the_cache_compiles_a_key_once_when_a_prefetch_and_a_caller_race(monkeypatch, tmp_path):
    from flash_attention.configs import hopper_bwd_config
    from flash_attention.jit import cache

    started, release = threading.Event(), threading.Event()

    def held():
        started.set()
        assert release.wait(30)

    compiles = _stand_in_compiler(monkeypatch, tmp_path, held)
    cfg = hopper_bwd_config("bf16", 128)
    ahead = cache.prefetch(cfg, "sm_90")
    assert ahead is not None and started.wait(30)
    got: list = []
    caller = threading.Thread(target=lambda: got.append(cache.build(cfg, "sm_90")))
    caller.start()
    release.set()
    caller.join(30)
    assert ahead.result(30).cubin == got[0].cubin == b"\x7fELF cubin"
    assert len(compiles) == 1  # the caller waited for the prefetch's compile
    assert cache.prefetch(cfg, "sm_90") is None  # in the disk cache now: nothing to do
    assert cache.build(cfg, "sm_90").from_cache and len(compiles) == 1


def test_a_compile_that_ends_between_the_disk_check_and_the_lock_is_not_repeated(monkeypatch, tmp_path):
    # jit.cache.build looks at the disk, then takes the lock: a compile of the same key (a prefetch) that
    # writes its entry and leaves in between is found by a second look under the lock, not compiled again.
    # (The race test above once compiled twice on a loaded machine: this is that interleaving, made certain by
    # a first look that misses.)
    from flash_attention.configs import hopper_bwd_config
    from flash_attention.jit import cache

    compiles = _stand_in_compiler(monkeypatch, tmp_path)
    cfg = hopper_bwd_config("bf16", 128)
    assert not cache.build(cfg, "sm_90").from_cache and len(compiles) == 1  # (the entry the race leaves)
    looks = []
    real = cache._cached

    def first_look_misses(*args):
        looks.append(args)
        return None if len(looks) == 1 else real(*args)

    monkeypatch.setattr(cache, "_cached", first_look_misses)
    again = cache.build(cfg, "sm_90")
    assert again.from_cache and again.cubin == b"\x7fELF cubin"
    assert len(looks) == 2 and len(compiles) == 1
    assert not cache._in_flight  # (the key's in-flight entry is gone: a later compile is not blocked)
