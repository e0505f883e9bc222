"""GPU tests of the transformers integration's sliding-window route (flash_attention.integrations.
transformers): Mistral- and Gemma 3-style models with random weights in bfloat16 run their sliding layers on
the kernels with the window (never on SDPA), and their prefill logits stay within twice SDPA's distance from
"eager"; greedy generation runs, the decoding steps on our kernels too. Gemma 2 (soft-capping, a sliding and
a full layer) runs every call of generate() on the kernels, on a dynamic and a static cache."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_gpu_nn import _first_divergence_is_a_tie  # noqa: E402
from test_transformers import NAME, VOCAB, _family_models  # noqa: E402
from transformers_spies import count_calls, count_routes, count_sdpa  # noqa: E402

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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [False, True])
def test_gemma2_generate_runs_every_call_on_the_kernels(cache, padding, monkeypatch):
    """Gemma 2 in bfloat16 (soft-capping on a sliding layer of 64 keys and on a full layer) generating 24
    tokens after a prompt of 300, left-padded or not: every attention call of generate() on a kernel route
    with the soft-cap, counted per route, none on SDPA or the eager function (a static cache's steps run
    uncompiled, so that each call is counted). The prefill's logits within twice bf16 eager's distance from
    float32 eager; greedy tokens, and a static cache's compiled steps' (generate()'s default), as eager's
    where eager's margin allows."""
    seen = count_routes(monkeypatch)
    integration.register()
    overrides = dict(sliding_window=64, max_position_embeddings=512, head_dim=64, query_pre_attn_scalar=64)
    ours, eager = (m.to("cuda", torch.bfloat16) for m in _family_models("gemma2", NAME, "eager", **overrides))
    exact = copy.deepcopy(eager).float()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (3, 300), generator=gen).cuda()
    mask = torch.ones_like(ids)
    if padding:
        mask[1, :40] = 0
    new = 24
    kwargs = dict(
        attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    cached = dict(cache_implementation="static", disable_compile=True) if cache == "static" else {}
    with torch.no_grad():
        out = ours.generate(ids, **kwargs, **cached)
    counts = dict(seen)
    assert counts.get("eager", 0) == 0 and counts.get("sdpa", 0) == 0, counts
    assert sum(counts.values()) == 2 * new, counts  # two layers, the prefill and 23 decoding steps
    assert all(key.endswith("softcap=2.0") for key in counts), counts
    if not padding:  # (a padded batch's steps run attention() with key ranges)
        decoded = sum(n for key, n in counts.items() if key.startswith("attention_with_kvcache"))
        assert decoded >= new - 1, counts  # at least the full layer's decoding steps
    monkeypatch.undo()  # the spies off: a compiled step would retrace on their counts
    with torch.no_grad():
        e = eager(ids, attention_mask=mask).logits[:, -1].double()
        x = exact(ids, attention_mask=mask).logits[:, -1].double()
        reference = eager.generate(ids, **kwargs).sequences[:, ids.shape[1] :]
    err = (out.logits[0].double() - x).abs().max().item()
    bound = 2 * (e - x).abs().max().item() + 1e-2
    assert err <= bound, f"prefill logits {err:.3g} from float32 eager > {bound:.3g}"
    runs = [out.sequences]
    if cache == "static":
        with torch.no_grad():
            runs.append(ours.generate(ids, **kwargs, cache_implementation="static").sequences)
    for sequences in runs:
        got = sequences[:, ids.shape[1] :]
        assert got.shape == reference.shape == (3, new)
        assert _first_divergence_is_a_tie(got, reference, ids, mask, eager, exact)
