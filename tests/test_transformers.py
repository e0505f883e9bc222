"""The transformers integration on the CPU: small random Llama-style (GQA) and GPT-2-style models, and
Gemma 2, Gemma 3, Mistral and gpt-oss ones (sliding windows, logit soft-capping, attention sinks).

On the CPU our attention function computes through flash_attention's PyTorch path (float32), so these tests
check the integration's semantics -- masks, padding, caches, GQA, dropout, the routes, the mask function's
decisions -- against ``attn_implementation="sdpa"`` with the accuracy rule (float64 ``"sdpa"`` as the exact
answer) or, for the other families, against ``attn_implementation="eager"`` (the rule is stated above
those tests), and that ``generate()`` picks the same greedy tokens. The key-range route (padding whose
valid keys are one run per row, run as one attention() call with ``key_range``), which only CUDA chooses,
is forced through the seam ``kernel_expected`` of flash_attention.nn.functional (the ``force_key_range``
fixture of conftest.py).

Skipped when transformers is not installed (it is an optional dependency).
"""

from __future__ import annotations

import copy
import warnings
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers_spies import count_calls, count_routes, count_sdpa  # noqa: E402

from flash_attention.integrations import transformers as integration  # noqa: E402
from flash_attention.nn import functional as fn  # noqa: E402

NAME = integration.register()
VOCAB = 256


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(fn, "_warned", set())


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Which path our attention function took: kernel route (attention(), with the dropout_p of each call)
    or transformers' SDPA."""
    seen = {"kernel": 0, "sdpa": 0, "masks": [], "dropout_p": []}
    real_attention, real_forward = integration.attention, integration.attention_forward

    def attention_spy(*args, **kwargs):
        seen["kernel"] += 1
        seen["dropout_p"].append(kwargs.get("dropout_p", 0.0))
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(integration, "attention", attention_spy)
    from transformers.integrations import sdpa_attention

    real_sdpa = sdpa_attention.sdpa_attention_forward

    def sdpa_spy(*args, **kwargs):
        seen["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", sdpa_spy)

    def forward_spy(module, query, key, value, attention_mask, **kwargs):
        seen["masks"].append(None if attention_mask is None else tuple(attention_mask.shape))
        return real_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(NAME, forward_spy)
    yield seen
    transformers.AttentionInterface.register(NAME, real_forward)


def _config(kind: str, **overrides):
    # initializer_range 0.2 (not the default 0.02): with tiny weights attention barely moves the logits,
    # and a comparison of logits could not tell a wrong mask from a right one.
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **overrides,
        )
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=128,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )


def _models(kind: str, **overrides):
    """(ours, sdpa, float64 sdpa) with the same random weights. Each gets its own config: from_config
    writes the implementation into the config object it is given."""
    cfg = _config(kind, **overrides)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    # float64 "sdpa" as the exact answer ("eager" in float64 turns padded rows into NaN: its mask adds the
    # dtype's minimum to the scores, which overflows to -inf).
    exact = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ours.load_state_dict(ref.state_dict())
    exact.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == "sdpa"
    return ours, ref, exact.double().eval()


def _padding_mask(batch: int, seqlen: int, side: str) -> torch.Tensor:
    """A 2-D attention mask (1 = token, 0 = padding) with a different length per row, one row unpadded."""
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for b in range(1, batch):
        pad = int(torch.randint(1, seqlen - 2, ()))
        if side == "left":
            mask[b, :pad] = 0
        else:
            mask[b, seqlen - pad :] = 0
    return mask


def _check_logits(ours, ref, exact, ids, mask=None):
    with torch.no_grad():
        o = ours(ids, attention_mask=mask).logits
        s = ref(ids, attention_mask=mask).logits
        e = exact(ids, attention_mask=mask).logits
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    assert not o[keep].isnan().any()
    err = (o[keep].double() - e[keep]).abs().max().item()
    bound = 2 * (s[keep].double() - e[keep]).abs().max().item() + 1e-5
    assert err <= bound, f"max logit error {err:.3g} > bound {bound:.3g}"
    return o


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_logits_match_sdpa(kind, padding, calls):
    ours, ref, exact = _models(kind)
    ids = torch.randint(3, VOCAB, (3, 21))
    mask = None if padding is None else _padding_mask(3, 21, padding)
    _check_logits(ours, ref, exact, ids, mask)
    n_layers = 2
    if padding is None:
        # No padding: the mask function returns None and every layer takes the kernel route.
        assert calls["masks"] == [None] * n_layers and calls["kernel"] == n_layers and calls["sdpa"] == 0
    else:
        # Padding: a 2-D key mask; off CUDA there is no kernel to run it, so transformers' SDPA runs.
        assert calls["masks"] == [(3, 21)] * n_layers and calls["kernel"] == 0 and calls["sdpa"] == n_layers


def _key_range_of(mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """[start, end) of each row's real tokens among the first kv_length positions, found token by token."""
    rows = []
    for row in mask[:, :kv_length].tolist():
        real = [j for j, m in enumerate(row) if m]
        assert real == list(range(real[0], real[-1] + 1)), "not one run"
        rows.append((real[0], real[-1] + 1))
    return torch.tensor(rows, dtype=torch.int32)


@pytest.fixture
def mask_reads(monkeypatch: pytest.MonkeyPatch) -> list:
    """Each host read of a 2-D mask (flash_attention.nn.functional._key_ranges)."""
    reads: list = []
    real = fn._key_ranges
    monkeypatch.setattr(fn, "_key_ranges", lambda m: reads.append(tuple(m.shape)) or real(m))
    return reads


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_logits_match_sdpa_on_the_key_range_route(kind, padding, force_key_range, mask_reads):
    ours, ref, exact = _models(kind)
    ids = torch.randint(3, VOCAB, (4, 19))
    mask = _padding_mask(4, 19, padding)
    _check_logits(ours, ref, exact, ids, mask)
    # Every layer: one attention() call with the padding as key ranges (causal on the full key axis).
    assert len(force_key_range["key_range"]) == 2 and force_key_range["plain"] == 0
    for q_shape, k_shape, causal, kr in force_key_range["key_range"]:
        assert causal and q_shape[:2] == k_shape[:2] == (4, 19)
        assert torch.equal(kr, _key_range_of(mask, 19))
    # One host read of the mask for the forward pass (the mask function's), shared by the layers.
    assert mask_reads == [(4, 19)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_mask_with_holes_goes_to_sdpa(kind, calls, force_key_range):
    # Valid keys that are not one run per row (a padding token inside the sequence): no key range fits,
    # transformers' SDPA function runs with the equivalent mask.
    ours, ref, exact = _models(kind)
    ids = torch.randint(3, VOCAB, (3, 15))
    mask = _padding_mask(3, 15, "left")
    mask[0, 7] = 0
    with pytest.warns(RuntimeWarning, match="key padding with holes"):  # (once: it says why)
        _check_logits(ours, ref, exact, ids, mask)
    assert force_key_range["key_range"] == [] and calls["sdpa"] == 2 and calls["masks"] == [(3, 15)] * 2


def test_wrong_attention_is_detected():
    # The comparisons above can fail: attention without its causal mask gives clearly different logits.
    ours, ref, exact = _models("llama")
    ids = torch.randint(3, VOCAB, (2, 16))
    for layer in ours.model.layers:
        layer.self_attn.is_causal = False
    with torch.no_grad():
        o, s = ours(ids).logits, ref(ids).logits
    assert (o - s).abs().max() > 100 * (s.double() - exact(ids).logits).abs().max()


def _greedy(model, ids, mask, n=12):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, min_new_tokens=n
        )[:, ids.shape[1] :]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_generate_same_greedy_tokens(kind, padding, calls):
    ours, ref, _ = _models(kind)
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = _padding_mask(3, 10, "left") if padding else torch.ones_like(ids)
    a, b = _greedy(ours, ids, mask), _greedy(ref, ids, mask)
    assert a.shape == (3, 12)
    assert torch.equal(a, b)
    if padding is None:
        # Prefill and every decoding step with the DynamicCache: no mask needed, the kernel route throughout.
        assert calls["sdpa"] == 0 and calls["kernel"] == 2 * 12


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_same_greedy_tokens_key_range(kind, force_key_range, mask_reads):
    # Batched generation with left padding: the prefill and every decoding step run as one attention()
    # call per layer with key ranges (from each row's first real token to the current position).
    ours, ref, _ = _models(kind)
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = _padding_mask(3, 10, "left")
    assert torch.equal(_greedy(ours, ids, mask), _greedy(ref, ids, mask))
    got = force_key_range["key_range"]
    assert len(got) == 2 * 12 and force_key_range["plain"] == 0
    full = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype)], dim=1)
    for step, (q_shape, k_shape, causal, kr) in enumerate(got):
        kv_length = 10 + step // 2
        assert causal and q_shape[1] == (10 if step < 2 else 1) and k_shape[1] == kv_length
        assert torch.equal(kr, _key_range_of(full, kv_length))
    assert len(mask_reads) == 12  # one per forward pass, not one per layer


@pytest.fixture
def kvcache_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """The static-cache route's calls of attention_with_kvcache: (q shape, k_cache shape, cache_seqlens)."""
    seen: list = []
    real = integration.attention_with_kvcache

    def spy(q, k_cache, v_cache, **kwargs):
        lengths = kwargs["cache_seqlens"]
        seen.append(
            (tuple(q.shape), tuple(k_cache.shape), lengths if isinstance(lengths, int) else lengths.tolist())
        )
        return real(q, k_cache, v_cache, **kwargs)

    monkeypatch.setattr(integration, "attention_with_kvcache", spy)
    return seen


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_with_static_cache_runs_the_decode_path(kind, calls, kvcache_calls):
    # A static cache (key slots past the current position, a tensor offset): the mask function hands over
    # each row's filled length, and every call -- the short prefill and each decoding step -- is one
    # attention_with_kvcache call on the whole cache with those lengths, no SDPA.
    ours, ref, _ = _models(kind)
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        a = ours.generate(ids, attention_mask=mask, **kwargs)
        b = ref.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(a, b)
    assert calls["sdpa"] == 0 and calls["masks"] and all(m == (2,) for m in calls["masks"])
    assert len(kvcache_calls) == 2 * 6  # two layers: the prefill and five decoding steps
    capacity = kvcache_calls[0][1][1]
    for step, (q_shape, k_shape, lengths) in enumerate(kvcache_calls):
        filled = 8 if step < 2 else 8 + step // 2
        assert q_shape[1] == (8 if step < 2 else 1) and k_shape[1] == capacity >= 8 + 5
        assert lengths == [filled, filled]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_with_a_dynamic_cache_decodes_on_the_decode_path(kind, calls, kvcache_calls):
    # A DynamicCache longer than the decode route's query limit: the prefill is one attention() call per
    # layer, and each decoding step one attention_with_kvcache call on the cache as it stands (no append:
    # transformers has already added the step's keys), the same greedy tokens as sdpa.
    ours, ref, _ = _models(kind)
    prompt = integration.STATIC_CACHE_MAX_QUERIES + 6
    ids = torch.randint(3, VOCAB, (2, prompt))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        b = ref.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(a, b)
    assert calls["sdpa"] == 0
    assert len(kvcache_calls) == 2 * 4  # two layers, four decoding steps after the prefill
    for step, (q_shape, k_shape, lengths) in enumerate(kvcache_calls):
        assert q_shape[1] == 1 and k_shape[1] == lengths == prompt + 1 + step // 2


def test_static_cache_logits_match_and_what_it_does_not_take(calls, kvcache_calls):
    ours, ref, exact = _models("llama")
    ids = torch.randint(3, VOCAB, (2, 9))
    # One forward pass on a static cache against sdpa's on its own (the accuracy rule on the logits).
    cache = transformers.StaticCache(config=ours.config, max_cache_len=32)
    with torch.no_grad():
        o = ours(ids, past_key_values=cache).logits
        s = ref(ids).logits
        e = exact(ids).logits
    err = (o.double() - e).abs().max().item()
    assert err <= 2 * (s.double() - e).abs().max().item() + 1e-5
    assert len(kvcache_calls) == 2 and calls["sdpa"] == 0
    # A prefill longer than the route's query limit, padding and training: the 2-D key mask of the filled
    # slots (the empty ones left out), which CUDA runs on the kernel and the CPU through SDPA.
    kvcache_calls.clear()
    calls["masks"].clear()
    long = torch.randint(3, VOCAB, (1, integration.STATIC_CACHE_MAX_QUERIES + 1))
    padded = _padding_mask(2, 9, "left")
    with torch.no_grad():
        ours(long, past_key_values=transformers.StaticCache(config=ours.config, max_cache_len=80))
        ours(
            ids,
            attention_mask=padded,
            past_key_values=transformers.StaticCache(config=ours.config, max_cache_len=32),
        )
    ours.train()
    ours(
        ids, past_key_values=transformers.StaticCache(config=ours.config, max_cache_len=32)
    ).logits.sum().backward()
    assert kvcache_calls == [] and calls["sdpa"] == 2 * 3
    assert calls["masks"] == [(1, long.shape[1])] * 2 + [(2, 9)] * 4


def test_a_static_cache_length_mask_is_checked():
    q = torch.randn(2, 4, 1, 16)
    k = torch.randn(2, 2, 10, 16)
    module = torch.nn.Module()
    for bad in (torch.tensor([3, 4]), torch.tensor([3, 4, 5], dtype=torch.int32)):
        with pytest.raises(ValueError, match="static-cache lengths"):
            integration.attention_forward(module, q, k, k, bad)


def test_training_uses_our_attention_with_the_same_gradients(calls, monkeypatch):
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    ours, ref, _ = _models("llama")
    ours.train(), ref.train()
    ids = torch.randint(3, VOCAB, (2, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "runs through SDPA" warning
        loss_o = ours(ids, labels=ids).loss
    loss_s = ref(ids, labels=ids).loss
    loss_o.backward()
    loss_s.backward()
    assert calls["kernel"] > 0
    assert torch.allclose(loss_o, loss_s)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_training_without_kernel_backward_goes_through_sdpa(calls, monkeypatch):
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)
    monkeypatch.setattr(fn, "KERNEL_HAS_BACKWARD", False)
    ours, ref, _ = _models("llama")
    ours.train(), ref.train()
    ids = torch.randint(3, VOCAB, (2, 12))
    with pytest.warns(RuntimeWarning, match="backward pass is switched off"):
        loss_o = ours(ids, labels=ids).loss
    loss_s = ref(ids, labels=ids).loss
    loss_o.backward()
    loss_s.backward()
    assert calls["kernel"] == 0
    assert torch.allclose(loss_o, loss_s)


# ------------------------------------------------------------------------------------------------------
# Attention dropout (training mode) on the kernel routes


class _Attention(torch.nn.Module):
    """The attributes transformers' attention functions read from the calling attention module."""

    def __init__(self, heads: int, kv_heads: int, causal: bool = True):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = causal


@pytest.mark.parametrize("route", ["plain", "key_range"])
def test_dropout_drops_probabilities_at_rate_p(route, monkeypatch, calls, key_range_calls):
    # With V the identity (head_dim == kv_length), the output row of query i is its row of dropped
    # probabilities: every element is 0 (dropped) or P/(1-p) (kept), where P is the softmax computed here
    # independently in float64, and about a fraction p of the attended elements is dropped.
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)  # key ranges as on CUDA
    batch, heads, kv_heads, n, p = 2, 4, 2, 16, 0.5
    q = torch.randn(batch, heads, n, n)
    k = torch.randn(batch, kv_heads, n, n)
    v = torch.eye(n).expand(batch, kv_heads, n, n)
    allowed = torch.ones(batch, 1, n, n, dtype=torch.bool).tril()
    mask = None
    if route == "key_range":
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[1, :5] = False  # left padding
        allowed = allowed & mask[:, None, None, :]
    module = _Attention(heads, kv_heads).train()
    out, _ = integration.attention_forward(module, q, k, v, mask, dropout=p, scaling=0.3)
    got = out.transpose(1, 2).double()  # (batch, heads, n, n)

    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    probs = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    seen = allowed.expand_as(probs) & (probs > 0)
    kept = (got - probs / (1 - p)).abs() <= 1e-5 * probs / (1 - p)
    dropped = got == 0
    assert (kept | dropped)[seen].all()
    assert (got[~seen] == 0).all()
    rate = dropped[seen].double().mean().item()
    assert abs(rate - p) < 4 * (p * (1 - p) / seen.sum().item()) ** 0.5, rate
    # The route: one attention() call, with key ranges for the padded batch.
    assert calls["kernel"] == (route == "plain") and calls["sdpa"] == 0
    assert len(key_range_calls["key_range"]) == (route == "key_range")


def test_training_dropout_runs_on_our_attention(calls):
    # attention_dropout in training mode: each pass draws a new mask (seeded from PyTorch's CPU generator,
    # so torch.manual_seed repeats it), on the kernel route, with the model's dropout probability.
    ours, ref, exact = _models("llama", attention_dropout=0.5)
    ours.train()
    ids = torch.randint(3, VOCAB, (2, 12))
    torch.manual_seed(1)
    a = ours(ids, labels=ids)
    b = ours(ids, labels=ids)
    torch.manual_seed(1)
    c = ours(ids, labels=ids)
    assert (a.logits - b.logits).abs().max() > 0.1
    assert torch.equal(a.logits, c.logits)
    assert calls["sdpa"] == 0 and calls["dropout_p"] == [0.5] * 6
    # The gradients of a seeded pass repeat too (the backward regenerates the forward's mask).
    a.loss.backward()
    grads = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    c.loss.backward()
    for g, p in zip(grads, ours.parameters(), strict=True):
        assert torch.equal(g, p.grad)
    # Evaluation mode: transformers passes dropout=0.0, deterministic and equal to "sdpa" by the rule.
    ours.eval()
    first = _check_logits(ours, ref, exact, ids)
    assert torch.equal(first, _check_logits(ours, ref, exact, ids))
    assert calls["dropout_p"][6:] == [0.0] * 4


def test_training_dropout_on_the_key_range_route(force_key_range):
    ours, _, _ = _models("llama", attention_dropout=0.5)
    ours.train()
    ids = torch.randint(3, VOCAB, (3, 14))
    mask = _padding_mask(3, 14, "left")
    torch.manual_seed(2)
    a = ours(ids, attention_mask=mask).logits
    b = ours(ids, attention_mask=mask).logits
    torch.manual_seed(2)
    c = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (a[keep] - b[keep]).abs().max() > 0.1 and torch.equal(a, c)
    assert len(force_key_range["key_range"]) == 6 and force_key_range["plain"] == 0


def test_dropout_argument_is_checked():
    q = torch.randn(1, 2, 8, 16)
    module = _Attention(2, 2)
    with pytest.raises(ValueError, match="dropout must be"):
        integration.attention_forward(module, q, q, q, None, dropout=1.5)
    with pytest.raises(TypeError, match="dropout must be"):
        integration.attention_forward(module, q, q, q, None, dropout="0.1")


# ------------------------------------------------------------------------------------------------------
# Model families with sliding windows, logit soft-capping and attention sinks, against "eager"
#
# Which route each layer takes (the module docstring of the integration says why):
#   Mistral      every layer sliding: the kernel with the window (attention(window=))
#   Gemma 3      sliding layers: the kernel with the window; full-attention layers: the kernel routes
#   Gemma 2      softcap on every layer: the kernel with softcap= (its sliding layers with the window too)
#   gpt-oss      attention sinks (s_aux) on every layer: the kernel with sinks= (its sliding layers with the
#                window too)
# The reference is attn_implementation="eager" of the same model with the same weights. Accuracy (CPU
# float32): where SDPA computes the model exactly (Mistral, Gemma 3), the rule -- max |ours - eager| <= 2 *
# max |sdpa - eager| + 1e-5 on the same inputs; where it cannot (Gemma 2's softcap, gpt-oss's sinks: no
# "sdpa" yardstick exists), 1e-5 relative to the largest logit: float32 rounding only (both compute every
# score in float32; a dropped soft-cap or sink moves the logits by far more: the test after these shows it).

FAMILIES = ["gemma2", "gemma3", "mistral", "gpt_oss"]
SLIDING_ROUTE = {"gemma2": "kernel", "gemma3": "kernel", "mistral": "kernel", "gpt_oss": "kernel"}
FULL_ROUTE = {"gemma2": "kernel", "gemma3": "kernel", "gpt_oss": "kernel"}  # Mistral has no full layer
EXACT_IN_SDPA = {"gemma3", "mistral"}


def _family_config(family: str, **overrides):
    config_class = {
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "mistral": "MistralConfig",
        "gpt_oss": "GptOssConfig",
    }[family]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    # Sliding window 4 < the sequences' lengths (12 and more), so the window changes the result.
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.2,
        sliding_window=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family != "mistral":
        kwargs["layer_types"] = ["sliding_attention", "full_attention"]
    if family.startswith("gemma"):
        kwargs["query_pre_attn_scalar"] = 16
    if family == "gemma2":
        kwargs.update(attn_logit_softcapping=2.0, final_logit_softcapping=None)  # 2.0: the cap bites
    if family == "gpt_oss":
        kwargs.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    kwargs.update(overrides)
    return getattr(transformers, config_class)(**kwargs)


def _family_models(family: str, *implementations: str, **overrides):
    """One model per implementation (the first one's random weights in all of them)."""
    cfg = _family_config(family, **overrides)
    make = transformers.AutoModelForCausalLM.from_config
    models = [make(copy.deepcopy(cfg), attn_implementation=impl).eval() for impl in implementations]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    if family == "gpt_oss":
        # The sinks are initialised to 0 (hardly there); larger ones make the comparison see them.
        with torch.no_grad():
            for m in models:
                for layer in m.model.layers:
                    layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    return models


def _assert_matches_eager(family, ours, eager, sdpa, keep):
    o, e = ours[keep].double(), eager[keep].double()
    assert not o.isnan().any()
    err = (o - e).abs().max().item()
    if sdpa is not None:
        bound = 2 * (sdpa[keep].double() - e).abs().max().item() + 1e-5
    else:
        bound = 1e-5 * e.abs().max().item()
    assert err <= bound, f"{family}: max logit error against eager {err:.3g} > bound {bound:.3g}"


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch, calls: dict, force_key_range: dict) -> dict:
    """Per route, how many calls took it: kernel (plain attention() or with key ranges, padded batches
    taking the key-range route as on CUDA), transformers' SDPA function, or an eager function."""
    seen = {"eager": 0}
    real = integration._eager_attention

    def spy(*args, **kwargs):
        seen["eager"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "_eager_attention", spy)

    def counts():
        # (The sliding-window calls reach attention() through nn.functional, with or without key ranges.)
        kernel = calls["kernel"] + len(force_key_range["key_range"]) + force_key_range["plain"]
        return {"kernel": kernel, "sdpa": calls["sdpa"], "eager": seen["eager"]}

    return counts


def _expected_routes(family: str, passes: int = 1) -> dict:
    cfg = _family_config(family)
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    want = {"kernel": 0, "sdpa": 0, "eager": 0}
    for kind in kinds:
        want[SLIDING_ROUTE[family] if kind == "sliding_attention" else FULL_ROUTE[family]] += passes
    return want


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding", [False, True])
def test_family_prefill_matches_eager(family, padding, routes):
    impls = (NAME, "eager", "sdpa") if family in EXACT_IN_SDPA else (NAME, "eager")
    models = _family_models(family, *impls)
    ids = torch.randint(3, VOCAB, (3, 13))
    mask = _padding_mask(3, 13, "left") if padding else None
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the eager route's one-time notice
        with torch.no_grad():
            ours = models[0](ids, attention_mask=mask).logits
        assert routes() == _expected_routes(family)
        with torch.no_grad():
            logits = [m(ids, attention_mask=mask).logits for m in models[1:]]
    _assert_matches_eager(family, ours, logits[0], logits[1] if len(logits) > 1 else None, keep)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_generate_same_greedy_tokens_as_eager(family):
    ours, eager = _family_models(family, NAME, "eager")
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as batched generation uses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = _greedy(ours, ids, mask, n=6)
    assert a.shape == (2, 6) and torch.equal(a, _greedy(eager, ids, mask, n=6))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_training_step_matches_eager(family):
    # Loss and gradients of one training step on a left-padded batch. The loss ignores the padding and the
    # first real token of the padded row: its predictor is the last padding position, a query that sees no
    # key, which every implementation fills differently (eager: the mean of all values; SDPA and ours: 0).
    ours, eager = _family_models(family, NAME, "eager")
    ours.train(), eager.train()
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loss_o = ours(ids, attention_mask=mask, labels=labels).loss
    loss_e = eager(ids, attention_mask=mask, labels=labels).loss
    loss_o.backward()
    loss_e.backward()
    assert torch.allclose(loss_o, loss_e, rtol=1e-5, atol=0)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        if q.grad is None:  # e.g. an expert no token was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", [8, 2])
def test_family_static_cache_generate_runs_on_the_kernels(family, prompt, routes, monkeypatch):
    # generate() on a static cache: its full layers decode on attention_with_kvcache with each row's length
    # (soft-capping and sinks in the call); its sliding layers, whose window-sized cache is still filling
    # (a prompt shorter than the window), on attention_with_kvcache with the window, then, full, with their
    # queries last among the window's keys, a plain call. Nothing on SDPA or an eager function, and the
    # greedy tokens of "eager".
    seen = []
    real = integration.attention_with_kvcache

    def spy(q, k_cache, v_cache, **kwargs):
        seen.append((kwargs.get("window"), kwargs.get("softcap", 0.0)))
        return real(q, k_cache, v_cache, **kwargs)

    monkeypatch.setattr(integration, "attention_with_kvcache", spy)
    ours, eager = _family_models(family, NAME, "eager")
    ids = torch.randint(3, VOCAB, (2, prompt))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        a = ours.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        b = eager.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(a, b)
    counts = routes()
    assert counts["sdpa"] == 0 and counts["eager"] == 0, counts
    # (Mistral has only sliding layers: past its prompt's filling steps they decode as plain calls.)
    assert seen or (family == "mistral" and prompt >= 4), "no call reached the decode kernels"
    cap = 2.0 if family == "gemma2" else 0.0
    assert all(softcap == cap for _, softcap in seen)
    if prompt < 4:  # the sliding layers' filling steps carry the window (sliding_window 4: (3, 0))
        assert (3, 0) in [w for w, _ in seen]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("window, padded", [(8, False), (96, False), (8, True)])
def test_gemma2_generate_runs_every_call_on_the_kernels(cache, window, padded, monkeypatch):
    # Gemma 2 (soft-capping on its sliding and its full layer) generating 16 tokens after a prompt of 88,
    # more than the decode routes' query limit: every call of generate() runs on a kernel route with the
    # soft-cap -- the prefill on attention() (the sliding layer with its window where the window hides keys;
    # a static cache's empty slots left out), the decoding steps on attention_with_kvcache, or on attention()
    # over a full window of 8 keys, or with left padding on attention() with key ranges -- none on SDPA or
    # the eager function. With window 96 the sliding layer's cache fills up while decoding. Greedy tokens
    # and each step's logits as "eager"'s.
    monkeypatch.setattr(fn, "kernel_expected", lambda t: True)  # the CPU routes calls as CUDA does
    seen = count_routes(monkeypatch)
    ours, eager = _family_models("gemma2", NAME, "eager", sliding_window=window, max_position_embeddings=256)
    prompt, new = 88, 16
    ids = torch.randint(3, VOCAB, (2, prompt))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0  # left padding, as batched generation uses
    kwargs = dict(
        attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        a = ours.generate(ids, **kwargs)
        counts = dict(seen)
        b = eager.generate(ids, **kwargs)
    assert counts.get("eager", 0) == 0 and counts.get("sdpa", 0) == 0, counts
    assert sum(counts.values()) == 2 * new, counts  # two layers, one prefill and 15 decoding steps
    assert all(key.endswith("softcap=2.0") for key in counts), counts
    if not padded:  # (a padded batch's decoding steps run attention() with key ranges)
        decoded = sum(n for key, n in counts.items() if key.startswith("attention_with_kvcache"))
        assert decoded >= new - 1, counts  # at least the full layer's decoding steps
    if window == 8:
        assert counts.get("attention window=(7, 0) softcap=2.0", 0) >= 1, counts  # the sliding prefill
    assert torch.equal(a.sequences, b.sequences)
    logits_o, logits_e = torch.stack(a.logits), torch.stack(b.logits)  # (steps, batch, vocab)
    every = torch.ones(logits_e.shape[:2], dtype=torch.bool)
    _assert_matches_eager("gemma2", logits_o, logits_e, None, every)


@pytest.mark.parametrize(
    "family, change",
    [("gemma2", "softcap"), ("gpt_oss", "sinks"), ("mistral", "window")],
)
def test_family_comparisons_see_the_feature(family, change):
    # The comparisons above can fail: dropping the soft-capping, the sinks or the window moves eager's
    # own logits by far more than their tolerance.
    (base,) = _family_models(family, "eager")
    overrides = {"window": {"sliding_window": 64}, "softcap": {"attn_logit_softcapping": None}}
    (changed,) = _family_models(family, "eager", **overrides.get(change, {}))
    changed.load_state_dict(base.state_dict())
    if change == "sinks":
        with torch.no_grad():
            for layer in changed.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
    ids = torch.randint(3, VOCAB, (2, 13))
    with torch.no_grad():
        a, b = base(ids).logits, changed(ids).logits
    assert (a - b).abs().max() > 1e3 * 1e-5 * a.abs().max()


@pytest.mark.parametrize("padding", [False, True])
def test_gpt_oss_attention_matches_eager_layer_by_layer(padding, force_key_range, monkeypatch):
    # Each layer's attention alone, on the q, k and v that gpt-oss's own eager function received: our
    # function with the mask our mask function made for that layer, on the kernel routes (sinks=, the
    # sliding layers' window=, key ranges when padded; the fallback computes them here), against eager's
    # output. Both compute the same function in float32, so they agree to float32 rounding, layer by layer;
    # a difference in the sinks, the window's bounds, the scaling or the mask moves a layer's output by
    # orders of magnitude more. (gpt-oss's bf16 logits part from eager's more than other models' because
    # the model amplifies rounding, its top-k routing most: tools/gptoss_layers.py, docs/design.md.)
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers_spies import count_calls, count_sdpa

    layer_types = ["sliding_attention", "full_attention"] * 2
    ours, eager = _family_models("gpt_oss", NAME, "eager", num_hidden_layers=4, layer_types=layer_types)
    for model in (ours, eager):
        for layer in model.model.layers:
            layer.self_attn.scaling = 0.4  # not head_dim ** -0.5, which a dropped scale would fall back to
    ids = torch.randint(3, VOCAB, (3, 13))
    mask = _padding_mask(3, 13, "left") if padding else None
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()

    seen, routes = [], {"kernel": 0, "other": 0}  # seen: the keyword arguments of each attention() call

    def kernel(kwargs):
        seen.append(kwargs)
        return "kernel"

    for owner in (integration, fn):  # (the window and key-range calls reach attention() through fn)
        count_calls(monkeypatch, owner, "attention", routes, kernel)
    count_calls(monkeypatch, integration, "_eager_attention", routes, "other")
    count_sdpa(monkeypatch, routes, "other")

    received = {}
    real_eager = modeling_gpt_oss.eager_attention_forward

    def eager_spy(module, query, key, value, attention_mask, **kwargs):
        out, weights = real_eager(module, query, key, value, attention_mask, **kwargs)
        received[module.layer_idx] = (query, key, value, kwargs, out)
        return out, weights

    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", eager_spy)
    our_masks = {}

    def mask_spy(module, query, key, value, attention_mask, **kwargs):
        our_masks[module.layer_idx] = attention_mask
        return integration.attention_forward(module, query, key, value, attention_mask, **kwargs)

    with torch.no_grad():
        eager(ids, attention_mask=mask)
        transformers.AttentionInterface.register(NAME, mask_spy)
        try:
            ours(ids, attention_mask=mask)
        finally:
            transformers.AttentionInterface.register(NAME, integration.attention_forward)
        seen.clear()
        for layer, (query, key, value, kwargs, expected) in sorted(received.items()):
            module = ours.model.layers[layer].self_attn
            got, _ = integration.attention_forward(module, query, key, value, our_masks[layer], **kwargs)
            err = (got - expected)[keep].abs().max().item()
            bound = 1e-5 * expected[keep].abs().max().item()
            assert err <= bound, f"layer {layer} ({layer_types[layer]}): {err:.3g} > {bound:.3g}"
    assert routes["other"] == 0  # neither eager's function nor SDPA: the kernel routes
    # One attention() call per layer, with the sinks, the scale and (sliding layers) the window (3, 0).
    assert [(kw.get("window"), kw.get("softmax_scale")) for kw in seen] == [((3, 0), 0.4), (None, 0.4)] * 2
    assert all(kw.get("sinks") is not None for kw in seen)


def test_eager_route_warns_once_naming_the_reason_and_the_function():
    ours, _ = _family_models("gemma2", NAME, "eager")
    ids = torch.randint(3, VOCAB, (1, 9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            ours(ids)
            ours(ids)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "softcap" in messages[0] and "modeling_gemma2.eager_attention_forward" in messages[0]


class _PlainAttention(torch.nn.Module):
    """An attention module whose Python module (this test file) defines no eager_attention_forward."""

    def __init__(self, heads: int, kv_heads: int, sinks: torch.Tensor | None = None):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = 16
        self.is_causal = True
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


@pytest.mark.parametrize("feature", ["softcap", "s_aux", "position_bias"])
def test_generic_eager_fallback_matches_the_models_own(feature):
    # A module without an eager function of its own gets the generic one: it computes what transformers'
    # model-specific eager functions compute (Gemma 2's softcap, gpt-oss's sinks, T5's position bias),
    # on random inputs with a causal mask and left padding, and warns (once) that it took over.
    import importlib

    model = {"softcap": "gemma2", "s_aux": "gpt_oss", "position_bias": "t5"}[feature]
    reference = getattr(
        importlib.import_module(f"transformers.models.{model}.modeling_{model}"),
        "eager_attention_forward",
        None,
    )
    if reference is None:  # T5 took the attention interface (and position_bias) after 5.0
        pytest.skip(f"transformers {transformers.__version__}: {model} has no eager_attention_forward")
    heads, kv_heads = (4, 4) if feature == "position_bias" else (4, 2)  # T5's function has no GQA
    q = torch.randn(2, heads, 7, 16)
    k, v = torch.randn(2, kv_heads, 7, 16), torch.randn(2, kv_heads, 7, 16)
    module = _PlainAttention(heads, kv_heads, sinks=torch.randn(heads)).eval()
    extra = {
        "softcap": {"softcap": 1.5},
        "s_aux": {"s_aux": module.sinks},
        "position_bias": {"position_bias": torch.randn(1, heads, 7, 7)},
    }[feature]
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False
    with pytest.warns(RuntimeWarning, match="generic eager attention"):
        out, _ = integration.attention_forward(module, q, k, v, valid, scaling=0.25, **extra)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & valid[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want, _ = reference(module, q, k, v, additive, scaling=0.25, **extra)
    real = valid[:, :, None, None].expand_as(want)  # padded query rows see no key: not compared
    torch.testing.assert_close(out[real], want[real], rtol=1e-5, atol=1e-6)


def test_sparse_indices_and_bad_masks_are_refused():
    module = _PlainAttention(2, 2)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="indices"):
        integration.attention_forward(module, q, q, q, None, indices=torch.zeros(1, 8, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        integration.attention_forward(module, q, q, q, torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        integration.attention_forward(module, q, q, q, torch.ones(1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask.*n <= kv_length = 8"):  # more keys than there are
        integration.attention_forward(module, q, q, q, torch.ones(1, 9, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------------
# The mask function's decisions


def _versioned(kwargs: dict) -> dict:
    """Mask-function arguments in the installed transformers' form: since 5.x a query count and offset,
    before that the query positions themselves (``cache_position``)."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    if "q_length" in inspect.signature(sdpa_mask).parameters:
        return kwargs
    kwargs = dict(kwargs)
    q_length, q_offset = kwargs.pop("q_length"), kwargs.pop("q_offset", 0)
    if isinstance(q_offset, torch.Tensor):
        pytest.skip("tensor query offsets came with the q_length form of the mask functions")
    kwargs["cache_position"] = torch.arange(q_offset, q_offset + q_length)
    return kwargs


def _mask_call(**overrides):
    from transformers.masking_utils import causal_mask_function

    kwargs = dict(
        batch_size=2,
        q_length=5,
        kv_length=5,
        q_offset=0,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=None,
        allow_is_causal_skip=True,
        dtype=torch.float32,
        config=None,
        use_vmap=False,
        device="cpu",
    )
    kwargs.update(overrides)
    return integration.attention_mask(**_versioned(kwargs))


def test_mask_function_plain_causal_is_none():
    assert _mask_call() is None
    assert _mask_call(q_length=1, kv_length=9, q_offset=8) is None  # decoding with a DynamicCache
    assert _mask_call(q_length=3, kv_length=9, q_offset=6) is None  # a chunk of prefill after a cache
    assert _mask_call(attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None  # no padding at all


def test_mask_function_ignores_a_compileable_caches_skip_veto():
    # transformers vetoes the causal skip for a compileable (static) cache's one-token steps, so that its SDPA
    # route keeps one mask shape; the kernels need no mask when the query is the last key (a static cache's
    # sliding layer once its window is full), and the key mask of the keys up to the query when it is not
    # (a window still filling: empty slots after the query, left out). Its other vetoes (packed sequences,
    # more than one query) stand.
    assert _mask_call(q_length=1, kv_length=4, q_offset=8, kv_offset=5, allow_is_causal_skip=False) is None
    got = _mask_call(q_length=1, kv_length=4, q_offset=2, kv_offset=0, allow_is_causal_skip=False)
    assert got.dtype == torch.bool and got.shape == (2, 3) and got.all()


def test_mask_function_padding_is_a_2d_key_mask():
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    got = _mask_call(q_length=2, kv_length=7, q_offset=5, attention_mask=pad)
    assert got.dtype == torch.bool and torch.equal(got, pad.bool())
    # A mask shorter than the keys: the missing positions are not attendable.
    got = _mask_call(q_length=1, kv_length=8, q_offset=7, attention_mask=pad[:, :5])
    assert got.shape == (2, 8) and not got[:, 5:].any()


@pytest.mark.parametrize(
    "overrides",
    [
        {"allow_is_causal_skip": False},  # the caller wants a materialised mask (5 queries)
        {"local_size": 3},  # sliding window
        {"q_offset": torch.tensor(0)},  # static caches pass tensor offsets
    ],
)
def test_mask_function_other_cases_are_sdpa_masks(overrides):
    from transformers.masking_utils import sdpa_mask

    got = _mask_call(**overrides)
    kwargs = dict(
        batch_size=2,
        q_length=5,
        kv_length=5,
        q_offset=0,
        kv_offset=0,
        allow_is_causal_skip=False,
        device="cpu",
    )
    kwargs.update({k: v for k, v in overrides.items() if k != "allow_is_causal_skip"})
    assert got is not None and got.dim() == 4
    assert torch.equal(got, sdpa_mask(**_versioned(kwargs)))


def test_mask_function_sliding_window_is_a_marked_key_mask():
    """A causal sliding window of W keys (create_sliding_window_causal_mask's function, recognised by what it
    answers) becomes the 2-D key mask marked with the kernel's window (W - 1, 0); the explicit mask the
    other routes build from it is transformers' own."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    fn3 = sliding_window_causal_mask_function(3)
    for overrides in (
        {"q_length": 9, "kv_length": 9},
        {"q_length": 1, "kv_length": 9, "q_offset": 8},  # decoding
        {"q_length": 4, "kv_length": 6, "q_offset": 10, "kv_offset": 8},  # a cache that dropped old keys
        {"q_length": 9, "kv_length": 9, "attention_mask": torch.tensor([[0] * 3 + [1] * 6, [1] * 9])},
    ):
        got = _mask_call(mask_function=fn3, local_size=3, **overrides)
        assert got.dim() == 2 and got.dtype == torch.bool and got._flash_attention_window == (2, 0)
        kwargs = dict(batch_size=2, q_offset=0, kv_offset=0, mask_function=fn3, local_size=3, device="cpu")
        expected = sdpa_mask(**_versioned({**kwargs, **overrides, "allow_is_causal_skip": False}))
        q_length, kv_length = overrides["q_length"], overrides["kv_length"]
        explicit = integration._explicit_mask(got, q_length, kv_length, True, "cpu", square_causal_flag=False)
        assert torch.equal(explicit.expand_as(expected), expected)
    # No key far enough to be cut: plain causal (None, the decode route's mask).
    assert _mask_call(mask_function=fn3, local_size=3, q_length=1, kv_length=3, q_offset=2) is None
    # Something else with a local size (chunked attention, a bidirectional window): the 4-D mask.
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    bidir = sliding_window_bidirectional_mask_function(3)
    assert _mask_call(mask_function=bidir, local_size=3, allow_is_bidirectional_skip=True).dim() == 4


def test_mask_function_static_cache_is_row_lengths_in_inference():
    from transformers.masking_utils import sdpa_mask

    static_cases = [
        ({"q_length": 5, "kv_length": 9, "q_offset": 0}, 5),  # a static cache's prefill
        ({"q_length": 1, "kv_length": 9, "q_offset": torch.tensor(3)}, 4),  # a decoding step
        ({"q_length": 2, "kv_length": 9, "q_offset": torch.tensor(6)}, 8),  # speculative decoding
    ]
    for overrides, filled in static_cases:
        with torch.no_grad():
            got = _mask_call(**overrides)
            # generate() hands the mask it made back to the model, whose own mask creation sees it again.
            again = _mask_call(**overrides, attention_mask=got)
        assert got.dtype == torch.int32 and got.tolist() == [filled, filled] and again is got
        # The lengths mean what transformers' 4-D mask of the same call means (the other routes use it).
        kwargs = dict(batch_size=2, q_offset=0, kv_offset=0, allow_is_causal_skip=False, device="cpu")
        expected = sdpa_mask(**_versioned({**kwargs, **overrides}))
        assert torch.equal(integration._static_cache_mask(got, overrides["q_length"], 9), expected)
        # Recording gradients, the lengths handed back become that 4-D mask.
        assert torch.equal(_mask_call(**overrides, attention_mask=got), expected)
    # A padded batch's decoding step: the lengths carry each row's keys, from its first real token to its
    # filled length; they mean what transformers' 4-D mask means.
    padded = {"q_length": 1, "kv_length": 9, "q_offset": torch.tensor(3)}
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        got = _mask_call(**padded, attention_mask=pad)
    assert got.tolist() == [4, 4] and got._flash_attention_key_range.tolist() == [[1, 4], [0, 4]]
    kwargs = dict(batch_size=2, kv_offset=0, allow_is_causal_skip=False, device="cpu", attention_mask=pad)
    expected = sdpa_mask(**_versioned({**kwargs, **padded}))
    assert torch.equal(integration._static_cache_mask(got, 1, 9), expected)
    with torch.no_grad():
        for overrides in (
            {"q_length": 1, "kv_length": 9, "q_offset": torch.tensor(3), "local_size": 3},  # sliding window
            {**padded, "attention_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])},  # padding with a hole
            {**padded, "q_length": 2, "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1] * 5])},  # 2 new
        ):  # fmt: skip
            assert _mask_call(**overrides).dim() == 4


def test_mask_function_leaves_out_the_keys_after_the_last_query():
    # Causal calls whose keys run past the last query (a static cache's prefill: its empty slots) get the 2-D
    # key mask of the keys up to the last query, with their padding and window: its explicit mask is
    # transformers' own on those keys, and transformers' mask hides every key left out from every query.
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    long = integration.STATIC_CACHE_MAX_QUERIES + 1  # more queries than the lengths route takes
    pad = torch.tensor([[0, 0] + [1] * (long + 2), [1] * (long + 4)])
    fn3 = sliding_window_causal_mask_function(3)
    cases = [  # (arguments, recording gradients, keys kept, window)
        ({"q_length": 5, "kv_length": 9}, True, 5, None),
        ({"q_length": long, "kv_length": long + 4}, False, long, None),
        ({"q_length": 3, "kv_length": 9, "q_offset": 4}, True, 7, None),  # a chunk after cached keys
        ({"q_length": long, "kv_length": long + 4, "attention_mask": pad}, False, long, None),
        ({"q_length": 6, "kv_length": 9, "mask_function": fn3, "local_size": 3}, True, 6, (2, 0)),
    ]
    for overrides, grad, width, window in cases:
        with torch.set_grad_enabled(grad):
            got = _mask_call(**overrides)
        assert got.dtype == torch.bool and got.shape == (2, width), overrides
        assert getattr(got, "_flash_attention_window", None) == window
        kwargs = dict(batch_size=2, q_offset=0, kv_offset=0, allow_is_causal_skip=False, device="cpu")
        expected = sdpa_mask(**_versioned({**kwargs, **overrides}))
        assert not expected[..., width:].any()
        q_length = overrides["q_length"]
        explicit = integration._explicit_mask(got, q_length, width, True, "cpu", square_causal_flag=False)
        assert torch.equal(explicit.expand(2, 1, q_length, width), expected[..., :width])


@pytest.mark.parametrize("route", ["kernel", "sdpa", "eager"])
def test_a_key_mask_narrower_than_the_keys_reads_only_its_keys(route, monkeypatch):
    # The attention function reads only the first n keys of a 2-D key mask of n columns, causal aligned to
    # the last of them, on every route: the keys after them are NaN here, which any read would spread.
    seen = {"kernel": 0, "sdpa": 0, "eager": 0}
    count_calls(monkeypatch, fn, "attention", seen, "kernel")
    count_calls(monkeypatch, integration, "_eager_attention", seen, "eager")
    count_sdpa(monkeypatch, seen)
    if route == "kernel":
        monkeypatch.setattr(fn, "kernel_expected", lambda t: True)  # the key-range route, as on CUDA
    softcap = None if route == "sdpa" else 1.5  # soft-capping: the kernel, or else the eager function
    module = _PlainAttention(4, 2).eval()
    width, slots, q_length = 8, 12, 5
    q = torch.randn(2, 4, q_length, 16)
    k, v = torch.randn(2, 2, slots, 16), torch.randn(2, 2, slots, 16)
    k[:, :, width:], v[:, :, width:] = float("nan"), float("nan")
    valid = torch.ones(2, width, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the generic eager function's notice
        out, _ = integration.attention_forward(module, q, k, v, valid, scaling=0.25, softcap=softcap)
    assert seen[route] == 1 and sum(seen.values()) == 1, seen
    # float64 on the first `width` keys: query i is key width - q_length + i, and sees the keys up to it.
    kk, vv = (t[:, :, :width].double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = q.double() @ kk.transpose(2, 3) * 0.25
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.ones(q_length, width, dtype=torch.bool).tril(width - q_length) & valid[:, None, None, :]
    want = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_mask_function_custom_pattern_is_sdpa_mask():
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    def even_keys(b, h, q, kv):
        return kv % 2 == 0

    fn_ = and_masks(causal_mask_function, even_keys)
    got = _mask_call(mask_function=fn_)
    expected = sdpa_mask(
        **_versioned(
            dict(batch_size=2, q_length=5, kv_length=5, mask_function=fn_, allow_is_causal_skip=False)
        )
    )
    assert torch.equal(got, expected)


def test_register_rejects_flash_names():
    with pytest.raises(ValueError, match="without 'flash'"):
        integration.register("flash_attention_fs")
    assert integration.register() == NAME
    assert NAME in transformers.AttentionInterface().valid_keys()


def test_mask_function_unpadded_window_mask_needs_no_host_read(monkeypatch):
    # The all-True key mask of an unpadded sliding window carries its ranges: no layer reads it back.
    from transformers.masking_utils import sliding_window_causal_mask_function

    from flash_attention.nn import functional as fn

    got = _mask_call(
        mask_function=sliding_window_causal_mask_function(3), local_size=3, q_length=9, kv_length=9
    )

    def no_read(mask):
        raise AssertionError("the mask was read back")

    monkeypatch.setattr(fn, "_key_ranges", no_read)
    ranges = fn.key_ranges(got)
    assert ranges.is_full(9) and ranges.starts == (0, 0)


# ------------------------------------------------------------------------------------------------------
# Packed sequences (position_ids restarting, no padding, no cache): one attention_varlen call per layer


@pytest.fixture
def varlen_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """The packed route's calls of attention_varlen: (cu_seqlens, window, sinks given)."""
    seen: list = []
    real = integration.attention_varlen

    def spy(q, k, v, cu_q, cu_k, **kwargs):
        seen.append((cu_q.tolist(), kwargs.get("window"), kwargs.get("sinks") is not None))
        return real(q, k, v, cu_q, cu_k, **kwargs)

    monkeypatch.setattr(integration, "attention_varlen", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_sequences_run_one_varlen_call_per_layer_and_match_eager(family, varlen_calls):
    # Three documents packed into one row, as DataCollatorWithFlattening makes them: our route gives each
    # its own causal attention (and sliding window) through attention_varlen; logits and a training step's
    # gradients as eager's, which masks the same from the same position_ids. (gpt-oss's masks ignore
    # packed position_ids in transformers itself, so its layers take the ordinary routes there.)
    if family == "llama":
        cfg = _config("llama")
        make = transformers.AutoModelForCausalLM.from_config
        ours = make(copy.deepcopy(cfg), attn_implementation=NAME)
        eager = make(copy.deepcopy(cfg), attn_implementation="eager")
        eager.load_state_dict(ours.state_dict())
    else:
        ours, eager = _family_models(family, NAME, "eager")
    ids = torch.randint(3, VOCAB, (1, 21))
    positions = torch.tensor([list(range(7)) + list(range(5)) + list(range(9))])
    with torch.no_grad():
        o = ours(ids, position_ids=positions, use_cache=False).logits
        e = eager(ids, position_ids=positions, use_cache=False).logits
    layers = len(ours.model.layers)
    assert len(varlen_calls) == layers and all(c[0] == [0, 7, 12, 21] for c in varlen_calls)
    if family == "mistral":
        assert all(c[1] == (3, 0) for c in varlen_calls)  # its sliding window (4) on every layer
    torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-4 * e.abs().max().item())
    # Eager on the same documents one by one: packing changed nothing.
    starts = [0, 7, 12, 21]
    with torch.no_grad():
        spans = zip(starts[:-1], starts[1:], strict=True)
        alone = torch.cat([eager(ids[:, a:b], use_cache=False).logits for a, b in spans], 1)
    torch.testing.assert_close(e, alone, rtol=1e-4, atol=1e-4 * e.abs().max().item())
    ours.train(), eager.train()
    labels = ids.clone()
    loss_o = ours(ids, position_ids=positions, labels=labels, use_cache=False).loss
    loss_e = eager(ids, position_ids=positions, labels=labels, use_cache=False).loss
    loss_o.backward()
    loss_e.backward()
    assert torch.allclose(loss_o, loss_e, rtol=1e-5, atol=0)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        if q.grad is None:
            continue
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name
