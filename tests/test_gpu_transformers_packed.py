"""GPU tests of the transformers integration's packed-sequence route: Llama- and Mistral-style bf16 models
with random weights on one row of packed documents (position_ids restarting, no cache) run one
attention_varlen call per layer and no SDPA; logits within twice SDPA's distance from eager (SDPA computes
the same 4-D mask exactly), and a training step's loss and gradients against float64 within twice SDPA's
distance."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_transformers import NAME, VOCAB, _config, _family_models  # noqa: E402
from transformers_spies import count_calls, count_sdpa  # noqa: E402

from flash_attention.integrations import transformers as integration  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = (300, 517, 129, 60)


@pytest.fixture
def packed_calls(monkeypatch):
    seen = {"varlen": 0, "sdpa": 0}
    count_calls(monkeypatch, integration, "attention_varlen", seen, "varlen")
    count_sdpa(monkeypatch, seen)
    return seen


def _models(family):
    if family == "llama":
        cfg = _config("llama")  # (positions restart per document: at most 517 here)
        make = transformers.AutoModelForCausalLM.from_config
        models = [make(copy.deepcopy(cfg), attn_implementation=i) for i in (NAME, "eager", "sdpa")]
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
    else:
        sizes = dict(sliding_window=64, max_position_embeddings=1024)
        models = _family_models(family, NAME, "eager", "sdpa", **sizes)
    return [m.to("cuda", torch.bfloat16) for m in models]


def _packed():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=gen).cuda()
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0).cuda()
    return ids, positions


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_documents_run_on_varlen_and_match_eager(family, packed_calls):
    ours, eager, sdpa = _models(family)
    ids, positions = _packed()
    with torch.no_grad():
        o = ours(ids, position_ids=positions, use_cache=False).logits.double()
        assert packed_calls == {"varlen": len(ours.model.layers), "sdpa": 0}
        e = eager(ids, position_ids=positions, use_cache=False).logits.double()
        s = sdpa(ids, position_ids=positions, use_cache=False).logits.double()
    err, bound = (o - e).abs().max().item(), 2 * (s - e).abs().max().item() + 1e-2
    assert err <= bound, f"{family}: {err:.3g} against eager > {bound:.3g}"


def test_packed_training_step_runs_on_varlen(packed_calls):
    # A training step's loss and gradients against the same step in float64 (eager attention), within twice
    # the distance of SDPA's bf16 step from it plus a floor (the accuracy rule: SDPA, handed the 4-D mask
    # of the packed documents, is PyTorch's own error here).
    ours, eager, sdpa = _models("llama")
    truth = copy.deepcopy(eager).double()
    ids, positions = _packed()
    losses = []
    for i, model in enumerate((ours, sdpa, truth)):
        model.train()
        loss = model(ids, position_ids=positions, labels=ids, use_cache=False).loss
        if i == 0:
            assert packed_calls["varlen"] == len(ours.model.layers) and packed_calls["sdpa"] == 0
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[2]) <= 2 * abs(losses[1] - losses[2]) + 1e-3 * abs(losses[2])
    for (name, p), s, t in zip(ours.named_parameters(), sdpa.parameters(), truth.parameters(), strict=True):
        if t.grad is None:
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        scale = t.grad.abs().max().item()
        err = (p.grad.double() - t.grad).abs().max().item()
        bound = 2 * (s.grad.double() - t.grad).abs().max().item() + 1e-2 * scale + 1e-6
        assert err <= bound, f"{name}: {err:.3g} against float64 > {bound:.3g}"
