"""On a GPU: after flash_attention.precompile (and the transformers integration's precompile_model) the calls
they were asked about compile nothing. Each case runs in a fresh process with an empty kernel cache, so no
kernel loaded earlier in the test session can stand in for a missing one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The child: precompile, then count the compiles the calls start (jit.cache._compile_into_cache is where a
# cache miss compiles), and print what was precompiled and what the calls compiled.
_CHILD = r"""
import json, sys
import torch
import flash_attention as fa
from flash_attention.jit import cache as jit_cache

case = json.loads(sys.argv[1])
names = fa.precompile(**case["precompile"])
compiled = []
real = jit_cache._compile_into_cache
def counting(cfg, arch, *args):
    compiled.append(cfg.name())
    return real(cfg, arch, *args)
jit_cache._compile_into_cache = counting
gen = torch.Generator(device="cuda").manual_seed(0)
for call in case["calls"]:
    b, sq, sk, hq, hkv, d = call["shape"]
    train = bool(call.get("backward"))  # (a call that records starts its backward's compile: training only)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_(train)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    k, v = k.requires_grad_(train), v.requires_grad_(train)
    kw = {key: (tuple(val) if key == "window" else val) for key, val in call["kwargs"].items()}
    if call.get("key_range"):
        kw["key_range"] = torch.tensor([[0, sk // 2], [sk // 4, sk]][:b], device="cuda", dtype=torch.int32)
    out = fa.attention(q, k, v, **kw)
    if train:
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
print(json.dumps({"precompiled": names, "compiled_by_calls": compiled}))
"""

CASES = {
    "training, GQA, causal, lengths of two buckets": {
        "precompile": dict(
            head_dim=128, heads_q=16, heads_kv=4, causal=True, training=True, seqlens=[1024, 4096]
        ),
        "calls": [
            {"shape": [2, 1024, 16, 4, 128], "kwargs": {"causal": True}, "backward": True},
            {"shape": [1, 4096, 16, 4, 128], "kwargs": {"causal": True}, "backward": True},
        ],
    },
    "Gemma 2's sliding and soft-capped prefill, padded": {
        "precompile": dict(
            head_dim=256,
            heads_q=8,
            heads_kv=4,
            causal=True,
            window=(4095, 0),
            softcap=50.0,
            key_range=True,
            seqlens=[2048],
        ),
        "calls": [
            {
                "shape": [2, 2048, 2048, 8, 4, 256],
                "kwargs": {"causal": True, "window": [4095, 0], "softcap": 50.0},
                "key_range": True,
            }
        ],
    },
}


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_precompiled_calls_compile_nothing(name, tmp_path):
    case = json.loads(json.dumps(CASES[name]))
    for call in case["calls"]:
        shape = call["shape"]
        if len(shape) == 5:  # (batch, seqlen, heads_q, heads_kv, head_dim): queries as long as keys
            call["shape"] = [shape[0], shape[1], shape[1], *shape[2:]]
    env = dict(os.environ, FLASH_ATTENTION_CACHE_DIR=str(tmp_path), FLASH_ATTENTION_HOST_LIBRARY="0")
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(case)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["precompiled"], "nothing was precompiled"
    assert result["compiled_by_calls"] == [], (
        f"the calls compiled {result['compiled_by_calls']} after precompiling {result['precompiled']}"
    )
