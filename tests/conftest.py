import json
import os
import subprocess
import sys

import pytest
import torch


def pytest_configure(config):
    # Under pytest-xdist (-n N) every worker's torch would use all cores for its CPU work (the simulator,
    # the float64 references), N times oversubscribing the machine: with 16 workers on 16 cores the
    # simulator tests ran ten times slower than alone. Each worker takes its share.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability 8.0 or newer")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key_range_calls(monkeypatch):
    """Spy on the attention() calls of the modules' padded route: each call given a ``key_range``.

    Records a CPU copy of every ``key_range`` tensor passed to ``flash_attention.attention`` by
    flash_attention.nn.functional (the one place the modules and the transformers integration call it with
    key ranges), with the shapes of q and k: ``calls["key_range"]`` is the list of (q shape, k shape,
    causal, key_range) tuples, ``calls["plain"]`` counts the calls without key_range.
    """
    from flash_attention.nn import functional as fn

    calls = {"key_range": [], "plain": 0}
    real = fn.attention

    def spy(q, k, v, **kwargs):
        kr = kwargs.get("key_range")
        if kr is None:
            calls["plain"] += 1
        else:
            calls["key_range"].append((tuple(q.shape), tuple(k.shape), kwargs.get("causal", False), kr.cpu()))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fn, "attention", spy)
    return calls


@pytest.fixture
def force_key_range(monkeypatch, key_range_calls):
    """Make the CPU take the key-range route for padded calls (as CUDA does), and spy on its calls.

    The seam is ``kernel_expected``: with it True, padded calls whose valid keys are one run per row go to
    attention(..., key_range=), whose PyTorch fallback computes the key ranges exactly as the kernel does.
    """
    from flash_attention.nn import functional as fn

    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    return key_range_calls


@pytest.fixture(scope="session")
def catalog_builds(tmp_path_factory):
    """``python -m flash_attention build --strict`` for sm_80 and sm_90, once per session: every kernel a
    model can need, compiled by NVRTC (what users compile with) or, without it, nvcc. Returns the process
    and the cache's metadata files."""
    from flash_attention.jit import compiler

    kind = "nvrtc" if compiler.load_nvrtc() is not None else "nvcc" if compiler.find_nvcc() else None
    if kind is None:
        pytest.skip("needs NVRTC (pip: nvidia-cuda-nvrtc) or nvcc")
    root = tmp_path_factory.mktemp("catalog")
    env = dict(os.environ, FLASH_ATTENTION_CACHE_DIR=str(root), FLASH_ATTENTION_QUIET="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flash_attention",
            "build",
            "--arch",
            "sm_80,sm_90",
            "--compiler",
            kind,
            "--strict",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    metas = [json.loads(p.read_text()) for p in root.glob("*.json")]
    return proc, metas
