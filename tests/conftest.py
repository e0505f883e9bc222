import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run these through the device tool)")
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
