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
def ranged_calls(monkeypatch):
    """Count the modules' calls of the ranged (padded-batch) kernel route."""
    from flash_attention.nn import functional as fn

    calls = {"ranged": 0}
    real = fn.ranged_attention

    def spy(*args, **kwargs):
        calls["ranged"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "ranged_attention", spy)
    return calls


@pytest.fixture
def force_ranged(monkeypatch, ranged_calls):
    """Make the CPU take the ranged route for padded calls (as a GPU would), and count its calls."""
    from flash_attention.nn import functional as fn

    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    monkeypatch.setattr(fn, "ranged_is_faster", lambda *a, **k: True)
    return ranged_calls
