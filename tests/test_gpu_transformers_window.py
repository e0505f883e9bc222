"""GPU tests of the transformers integration's sliding-window route (flash_attention.integrations.
transformers): Mistral- and Gemma 3-style models with random weights in bfloat16 run their sliding layers on
the kernels with the window (never on SDPA), and their prefill logits stay within twice SDPA's distance from
"eager"; greedy generation runs, the decoding steps on our kernels too."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_transformers import NAME, VOCAB, _family_models  # noqa: E402
from transformers_spies import count_calls, count_sdpa  # noqa: E402

from flash_attention.integrations import transformers as integration  # noqa: E402
from flash_attention.nn import functional as fn  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def window_calls(monkeypatch):
    seen = {"window": 0, "plain": 0, "sdpa": 0}
    windowed = lambda kwargs: "plain" if kwargs.get("window") is None else "window"  # noqa: E731
    count_calls(monkeypatch, fn, "attention", seen, windowed)
    count_sdpa(monkeypatch, seen)
    integration.register()
    return seen


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("padding", [False, True])
def test_sliding_layers_run_on_the_kernel_and_match_eager(family, padding, window_calls):
    models = [
        m.to("cuda", torch.bfloat16)
        for m in _family_models(family, NAME, "eager", "sdpa", sliding_window=16, max_position_embeddings=256)
    ]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 70), generator=gen).cuda()
    mask = torch.ones_like(ids)
    if padding:
        mask[1, :9] = 0
    keep = mask.bool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with torch.no_grad():
            ours = models[0](ids, attention_mask=mask).logits.double()
            sliding = 2 if family == "mistral" else 1  # of the two layers
            assert window_calls["window"] == sliding and window_calls["sdpa"] == 0
            eager, sdpa = (m(ids, attention_mask=mask).logits.double() for m in models[1:])
    err = (ours - eager)[keep].abs().max().item()
    bound = 2 * (sdpa - eager)[keep].abs().max().item() + 1e-2
    assert err <= bound, f"{family}: {err:.3g} against eager > {bound:.3g}"
    # Generation: the prompt's sliding layers on the window kernel, the steps on ours (no SDPA at all).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = models[0].generate(
            ids, attention_mask=mask, max_new_tokens=24, do_sample=False, min_new_tokens=24
        )
    assert out.shape == (3, 94) and window_calls["sdpa"] == 0


def test_mistral_training_step_runs_the_window_kernels(window_calls):
    """A training step of a Mistral-style model: its sliding layers record the window kernels' backward
    (no SDPA); loss and gradients close to eager's in bfloat16."""
    ours, eager = (
        m.to("cuda", torch.bfloat16) for m in _family_models("mistral", NAME, "eager", sliding_window=16)
    )
    ours.train(), eager.train()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 64), generator=gen).cuda()
    loss_o = ours(ids, labels=ids).loss
    assert window_calls["window"] == 2 and window_calls["sdpa"] == 0
    loss_e = eager(ids, labels=ids).loss
    loss_o.backward()
    loss_e.backward()
    assert abs(loss_o.item() - loss_e.item()) <= 2e-2 * abs(loss_e.item())
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        if q.grad is None:
            continue
        assert torch.isfinite(p.grad).all(), name
        scale = q.grad.float().abs().max().item()
        assert (p.grad.float() - q.grad.float()).abs().max().item() <= 0.1 * scale + 1e-3, name
