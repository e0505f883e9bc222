"""GPU tests of flash_attention.nn and the transformers integration (marked gpu; need sm_80+).

The modules in fp16/bf16 on CUDA against PyTorch's own modules in the same precision, with the accuracy rule
of DESIGN.md at module level: against the same module computed in float64, our max error is at most 2x the
stock module's, plus 1e-5. Each test also checks that our kernel actually ran (a spy on
``ops.forward.launch_plan``, which every forward launch runs, repeat calls included): a test that silently
fell back to PyTorch would prove nothing. Key padding whose valid keys are one run per row (right or left
padding) must reach the kernel as one launch with ``key_range`` (per-batch key ranges computed inside the
kernel), with the mask's ranges.
"""

from __future__ import annotations

import copy
import warnings
import zlib

import pytest
import torch
from torch import nn

from flash_attention.fallback.reference import causal_allowed
from flash_attention.nn import FlashAttention, MultiheadAttention, replace_attention
from flash_attention.nn import functional as fn
from flash_attention.ops import forward as launch
from flash_attention.ops import repeat

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(fn, "_warned", set())


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every launch of our forward kernel: (q shape, k shape, causal, key_range on the CPU or None)."""
    seen: list = []
    real = launch.launch_plan

    def spy(plan, q, k, v, o, lse, key_range=None, *rest):
        kr = None if key_range is None else key_range.cpu()
        seen.append((tuple(q.shape), tuple(k.shape), plan.causal, kr))
        return real(plan, q, k, v, o, lse, key_range, *rest)

    # The one function every planned forward launch runs (a first call of a signature and its repeats in
    # Python; the host library's form of repeat calls launches from C++, so these tests use the Python one).
    monkeypatch.setattr(launch, "launch_plan", spy)
    monkeypatch.setattr(repeat, "MODE", "python" if repeat.MODE == "native" else repeat.MODE)
    return seen


def _check_rule(ours, stock, exact, what=""):
    assert not ours.isnan().any(), f"NaN in output: {what}"
    err = (ours.double() - exact).abs().max().item()
    bound = 2 * (stock.double() - exact).abs().max().item() + 1e-5
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}: {what}"


def _padding(batch, seqlen, side):
    """(batch, seqlen) bool key_padding_mask, True = padded: row 0 unpadded, the others padded on ``side``
    (right or left) to a random length of at least one key."""
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device="cuda")
    for b in range(1, batch):
        n = int(torch.randint(1, seqlen, ()))  # keys kept
        if side == "right":
            mask[b, n:] = True
        else:
            mask[b, : seqlen - n] = True
    return mask


def _key_range_of(key_padding_mask):
    """[start, end) of each row's valid keys, read off the mask on the host (rows are one run here)."""
    rows = []
    for row in key_padding_mask.tolist():
        valid = [j for j, padded in enumerate(row) if not padded]
        assert valid == list(range(valid[0], valid[-1] + 1))
        rows.append((valid[0], valid[-1] + 1))
    return torch.tensor(rows, dtype=torch.int32)


def _assert_key_range_launches(launches, key_padding_mask, n):
    """``n`` launches in all, each with the mask's key ranges: padding handled inside the kernel."""
    assert len(launches) == n, launches
    expected = _key_range_of(key_padding_mask)
    for *_, kr in launches:
        assert kr is not None, "a padded call launched without key_range"
        assert torch.equal(kr.to(torch.int32), expected)


# ------------------------------------------------------------------------------------------------------
# MultiheadAttention


MHA_CASES = [
    # (dtype, batch_first, kind, causal, padding side or None, seqlen)
    ("bf16", True, "self", False, None, 1000),
    ("fp16", False, "self", False, None, 777),
    ("bf16", True, "self", True, None, 1025),
    ("fp16", True, "cross", False, None, 513),
    ("bf16", False, "kv_shared", False, None, 300),
    ("bf16", True, "self", False, "right", 1500),
    ("fp16", True, "self", True, "right", 1300),
    ("bf16", True, "self", True, "left", 1100),
    ("fp16", False, "self", False, "left", 999),
    ("fp16", True, "cross", False, "left", 900),
    ("bf16", True, "unbatched", True, None, 999),
]


@pytest.mark.parametrize("case", MHA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_mha_matches_stock(case, launches):
    dtype, batch_first, kind, causal, padding, L = case
    E, H, B = 512, 8, 3
    S = L if kind in ("self", "unbatched") else L // 2 + 17
    stock = nn.MultiheadAttention(E, H, batch_first=batch_first, device="cuda", dtype=DTYPES[dtype]).eval()
    ours = MultiheadAttention(E, H, batch_first=batch_first, device="cuda", dtype=DTYPES[dtype]).eval()
    ours.load_state_dict(stock.state_dict())
    exact_m = copy.deepcopy(stock).double()

    def t(n):
        shape = (n, E) if kind == "unbatched" else ((B, n, E) if batch_first else (n, B, E))
        return torch.randn(shape, device="cuda")

    x = t(L)
    if kind in ("self", "unbatched"):
        args32 = (x, x, x)
    elif kind == "kv_shared":
        y = t(S)
        args32 = (x, y, y)
    else:
        args32 = (x, t(S), t(S))
    kwargs = {"need_weights": False}
    if causal:
        kwargs.update(attn_mask=torch.ones(L, L, dtype=torch.bool, device="cuda").triu(1), is_causal=True)
    kpm = None
    if padding:
        kpm = kwargs["key_padding_mask"] = _padding(B, S, padding)

    def cast(a, dt):
        out, seen = [], {}
        for t_ in a:
            seen.setdefault(id(t_), t_.to(dt))
            out.append(seen[id(t_)])
        return out

    low = cast(args32, DTYPES[dtype])  # the exact answer is for these (rounded) inputs
    with torch.no_grad():
        o, _ = ours(*low, **kwargs)
        s, _ = stock(*low, **kwargs)
        e, _ = exact_m(*cast(low, torch.float64), **kwargs)
    assert o.dtype == DTYPES[dtype] and o.shape == s.shape
    rows = torch.ones(o.shape[:-1], dtype=torch.bool, device="cuda")
    if padding:
        # One launch, with the padding as key ranges. Every batch row keeps >= 1 key, so no row is fully
        # padded; but under causal, left padding leaves the padded query positions without any key:
        # PyTorch gives NaN there, ours an attention output of 0 (out_proj's bias). The others compare.
        _assert_key_range_launches(launches, kpm, 1)
        if causal:
            has_key = (~kpm).cumsum(1) > 0  # (batch, query): query i sees the valid keys j <= i
            rows = has_key if batch_first else has_key.T
            assert torch.equal(o[~rows], ours.out_proj.bias.expand_as(o[~rows]))
            assert padding == "right" or not rows.all()
    else:
        assert len(launches) == 1 and launches[0][3] is None
    _check_rule(o[rows], s[rows], e[rows], str(case))


@pytest.mark.parametrize("side", ["right", "left", "many_lengths", "holes"])
def test_mha_padding_is_one_kernel_launch(side, launches):
    # Right and left padding, and 32 rows of 32 distinct lengths, all run as ONE launch with key ranges (no
    # per-length launches, no cost model). A mask with holes has no key range: PyTorch's implementation.
    E, H = 1024, 16
    stock = nn.MultiheadAttention(E, H, batch_first=True, device="cuda", dtype=torch.bfloat16).eval()
    ours = replace_attention(copy.deepcopy(stock))
    exact_m = copy.deepcopy(stock).double()
    if side == "many_lengths":
        B, L = 32, 128
        kpm = torch.arange(L, device="cuda")[None, :] >= torch.arange(96, 128, device="cuda")[:, None]
    else:
        B, L = 2, 3072
        kpm = torch.zeros(B, L, dtype=torch.bool, device="cuda")
        if side == "right":
            kpm[1, 2000:] = True
        elif side == "left":
            kpm[1, :1071] = True
        else:
            kpm[1, 1000:1100] = True
    x = torch.randn(B, L, E, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        o, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
        s, _ = stock(x, x, x, key_padding_mask=kpm, need_weights=False)
        e, _ = exact_m(x.double(), x.double(), x.double(), key_padding_mask=kpm, need_weights=False)
    if side == "holes":
        assert launches == [] and torch.equal(o, s)
    else:
        _assert_key_range_launches(launches, kpm, 1)
        _check_rule(o, s, e, side)


@pytest.mark.parametrize("side", [None, "left"])
def test_mha_training_runs_our_backward_and_matches_stock(side, launches):
    # Training goes through our forward and backward kernels (attention() is differentiable); the input's
    # and the parameters' gradients obey the accuracy rule against the float64 module, with stock bf16 MHA
    # as the yardstick.
    torch.manual_seed(3)
    stock = nn.MultiheadAttention(256, 4, batch_first=True, device="cuda", dtype=torch.bfloat16)
    ours = MultiheadAttention(256, 4, batch_first=True, device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(stock.state_dict())
    exact_m = copy.deepcopy(stock).double()
    x = torch.randn(3, 200, 256, device="cuda", dtype=torch.bfloat16)
    kpm = None if side is None else _padding(3, 200, side)
    g = torch.randn(3, 200, 256, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for name, m, dt in (
        ("ours", ours, torch.bfloat16),
        ("stock", stock, torch.bfloat16),
        ("exact", exact_m, torch.float64),
    ):
        xi = x.detach().to(dt).clone().requires_grad_(True)
        o, _ = m(xi, xi, xi, key_padding_mask=kpm, need_weights=False)
        o.backward(g.to(dt))
        grads[name] = [xi.grad] + [p.grad for p in m.parameters()]
    assert launches, "the training call did not reach our kernel"
    for k, (a, b, e) in enumerate(zip(grads["ours"], grads["stock"], grads["exact"], strict=True)):
        assert torch.isfinite(a).all()
        _check_rule(a, b, e, f"gradient {k} ({side})")


# ------------------------------------------------------------------------------------------------------
# FlashAttention


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "heads, kv_heads, causal, L, S, padding",
    [
        (16, 4, True, 1537, 1537, None),
        (8, 1, False, 700, 1234, None),
        (16, 2, True, 2048, 2048, "right"),
        (16, 4, True, 1200, 1200, "left"),  # the padded query positions see no key: output = bias
        (8, 2, False, 1000, 1500, "left"),
    ],
)
def test_flash_attention_matches_reference(dtype, heads, kv_heads, causal, L, S, padding, launches):
    d_model, B = 1024, 2
    m = FlashAttention(d_model, heads, num_kv_heads=kv_heads, causal=causal, device="cuda").eval()
    x = torch.randn(B, L, d_model, device="cuda", dtype=DTYPES[dtype])
    y = x if S == L else torch.randn(B, S, d_model, device="cuda", dtype=DTYPES[dtype])
    kpm = _padding(B, S, padding) if padding else None
    low = m.to(DTYPES[dtype])
    with torch.no_grad():
        o, _ = low(x, y, key_padding_mask=kpm)
        # PyTorch's attention on the same low-precision projections: the error the rule allows (twice).
        q = low.q_proj(x).unflatten(-1, (heads, -1))
        k = low.k_proj(y).unflatten(-1, (kv_heads, -1))
        v = low.v_proj(y).unflatten(-1, (kv_heads, -1))
        s = low.out_proj(
            fn.sdpa_attention(q, k, v, causal=causal, key_valid=None if kpm is None else ~kpm).reshape(
                B, L, -1
            )
        )
        m64 = copy.deepcopy(low).double()
        q, k, v = (
            m64.q_proj(x.double()).unflatten(-1, (heads, -1)),
            m64.k_proj(y.double()).unflatten(-1, (kv_heads, -1)),
            m64.v_proj(y.double()).unflatten(-1, (kv_heads, -1)),
        )
        group = heads // kv_heads
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) / q.shape[-1] ** 0.5
        allowed = (
            causal_allowed(L, S, device="cuda")[None, None]
            if causal
            else torch.ones(1, 1, L, S, dtype=torch.bool, device="cuda")
        )
        if kpm is not None:
            allowed = allowed & ~kpm[:, None, None, :]
        # A query row without any visible key: attention output 0 (softmax over nothing is NaN; made 0).
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        e = m64.out_proj(torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(group, 2)).reshape(B, L, -1))
    _check_rule(o, s, e)
    assert all(k_[2] == kv_heads for _, k_, _, _ in launches), "K/V must reach the kernel unrepeated"
    if kpm is None:
        assert len(launches) == 1 and launches[0][3] is None
    else:
        _assert_key_range_launches(launches, kpm, 1)


# ------------------------------------------------------------------------------------------------------
# replace_attention on an encoder


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", [None, "causal", "padding-right", "padding-left"])
def test_encoder_replaced_matches_stock(dtype, mask, launches):
    d, H, n_layers, B, L = 512, 8, 3, 2, 1200
    layer = nn.TransformerEncoderLayer(d, H, 4 * d, dropout=0.0, batch_first=True, device="cuda")
    stock32 = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False).eval()
    for p in stock32.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    stock = stock32.to(DTYPES[dtype])
    ours = replace_attention(copy.deepcopy(stock))
    exact_m = copy.deepcopy(stock).double()
    x = torch.randn(B, L, d, device="cuda").to(DTYPES[dtype])
    kw, kw64 = {}, {}
    if mask == "causal":
        m = nn.Transformer.generate_square_subsequent_mask(L, device="cuda")
        kw = {"mask": m.to(DTYPES[dtype]), "is_causal": True}
        kw64 = {"mask": m.double(), "is_causal": True}
    elif mask is not None:
        kpm = _padding(B, L, mask.split("-")[1])
        kw, kw64 = {"src_key_padding_mask": kpm}, {"src_key_padding_mask": kpm}
    with torch.no_grad():
        o = ours(x, **kw)
        s = stock(x, **kw)
        e = exact_m(x.double(), **kw64)
    _check_rule(o, s, e, f"{dtype} {mask}")
    if mask is not None and mask.startswith("padding"):
        _assert_key_range_launches(launches, kpm, n_layers)  # one launch per layer, padding in the kernel
    else:
        assert len(launches) == n_layers and all(kr is None for *_, kr in launches)


# ------------------------------------------------------------------------------------------------------
# transformers


def _hf_models(kind, dtype):
    transformers = pytest.importorskip("transformers")
    from flash_attention.integrations.transformers import register

    name = register()
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            initializer_range=0.2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        cfg = transformers.GPT2Config(
            vocab_size=512,
            n_embd=256,
            n_layer=2,
            n_head=4,
            n_positions=2048,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    make = transformers.AutoModelForCausalLM.from_config
    ref = make(copy.deepcopy(cfg), attn_implementation="sdpa").eval().to("cuda", DTYPES[dtype])
    ours = make(copy.deepcopy(cfg), attn_implementation=name).eval().to("cuda", DTYPES[dtype])
    ours.load_state_dict(ref.state_dict())
    # The exact answer for the same (rounded) weights.
    exact = copy.deepcopy(ref).to(torch.float64)
    return ours, ref, exact


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("padding", [False, True])
def test_transformers_logits_match_sdpa(kind, dtype, padding, launches):
    ours, ref, exact = _hf_models(kind, dtype)
    ids = torch.randint(3, 512, (3, 700), device="cuda")
    mask = torch.ones_like(ids)
    if padding:
        mask[1, :100] = 0  # left padding, as generation uses
        mask[2, :333] = 0
    with torch.no_grad():
        o = ours(ids, attention_mask=mask).logits
        s = ref(ids, attention_mask=mask).logits
        e = exact(ids, attention_mask=mask).logits
    keep = mask.bool()
    _check_rule(o[keep], s[keep], e[keep], f"{kind} {dtype} padding={padding}")
    if padding:
        # One launch per layer with the left padding as key ranges: [first real token, 700).
        _assert_key_range_launches(launches, ~keep, 2)
    else:
        assert len(launches) == 2 and all(kr is None for *_, kr in launches)


def _first_divergence_is_a_tie(ours_tokens, ref_tokens, prompt, mask, ref, exact):
    """True when greedy sequences agree, or first differ where the exact model's two choices are closer
    than the error PyTorch's own low-precision model makes there (twice): a tie within the accuracy rule."""
    for b in range(prompt.shape[0]):
        diff = (ours_tokens[b] != ref_tokens[b]).nonzero()
        if not len(diff):
            continue
        i = int(diff[0])
        prefix = torch.cat([prompt[b], ref_tokens[b, :i]])[None]
        m = torch.cat([mask[b], torch.ones(i, dtype=mask.dtype, device=mask.device)])[None]
        with torch.no_grad():
            s = ref(prefix, attention_mask=m).logits[0, -1].double()
            e = exact(prefix, attention_mask=m).logits[0, -1]
        a, c = ours_tokens[b, i], ref_tokens[b, i]
        tol = 2 * (s - e).abs().max().item() + 1e-5
        if (e[a] - e[c]).abs().item() > 2 * tol:
            return False
    return True


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", [False, True])
def test_transformers_generate_greedy(kind, padding, launches, monkeypatch):
    from flash_attention.ops import decode

    decoded: list = []
    real = decode.DecodePlan.repeat

    def spy(self, *args, **kwargs):  # once per call, whether it repeats a signature or plans it
        decoded.append(args[1].shape)  # k_cache
        return real(self, *args, **kwargs)

    monkeypatch.setattr(decode.DecodePlan, "repeat", spy)
    ours, ref, exact = _hf_models(kind, "fp16")
    prompt = torch.randint(3, 512, (4, 300), device="cuda")
    mask = torch.ones_like(prompt)
    if padding:
        mask[1, :50] = 0
        mask[3, :120] = 0
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(prompt, attention_mask=mask, **kwargs)[:, 300:]
        b = ref.generate(prompt, attention_mask=mask, **kwargs)[:, 300:]
    assert a.shape == b.shape == (4, 24)
    same = (a == b).all(dim=1)
    assert _first_divergence_is_a_tie(a, b, prompt, mask, ref, exact), f"rows equal: {same.tolist()}"
    # With padding: prefill and every decoding step of both layers on the forward kernel, each with key
    # ranges from the row's first real token to the current length. Without: the prefill on the forward
    # kernel, the 23 decoding steps after it on the decode kernels (the DynamicCache, one longer per step).
    if padding:
        assert len(launches) >= 2 * 24 and not decoded
        for _, k_shape, causal, kr in launches:
            assert causal and kr is not None
            assert kr[:, 0].tolist() == [0, 50, 0, 120] and kr[:, 1].tolist() == [k_shape[1]] * 4
    else:
        assert len(launches) == 2
        assert [shape[1] for shape in decoded] == [301 + step // 2 for step in range(2 * 23)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_transformers_static_cache_decodes_on_the_decode_kernels(kind, monkeypatch):
    # generate() with a static cache: the prefill (<= 64 tokens) and every decoding step of both layers run
    # as attention_with_kvcache on the decode kernels (a DecodePlan call each: no composed fallback), with
    # the rows' filled lengths on the device; greedy tokens as sdpa's, up to ties within the accuracy rule.
    from flash_attention.ops import decode

    ours, ref, exact = _hf_models(kind, "bf16")
    decoded: list = []
    real = decode.DecodePlan.repeat

    def spy(self, *args, **kwargs):  # once per call, whether it repeats a signature or plans it
        decoded.append(self.problem.seqlen_q)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(decode.DecodePlan, "repeat", spy)
    prompt = torch.randint(3, 512, (3, 40), device="cuda")
    mask = torch.ones_like(prompt)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        b = ref.generate(prompt, attention_mask=mask, **kwargs)[:, 40:]
        # Eager steps (generate() would compile a static cache's decoding step otherwise): every call is one.
        a = ours.generate(
            prompt, attention_mask=mask, cache_implementation="static", disable_compile=True, **kwargs
        )[:, 40:]
        assert decoded == [40, 40] + [1] * (2 * 15)
        # generate()'s default: the decoding step compiled and replayed as a CUDA graph, our op inside it; the
        # plans run only while the step is traced and recorded, the replays launch what was captured.
        decoded.clear()
        compiled = ours.generate(prompt, attention_mask=mask, cache_implementation="static", **kwargs)[:, 40:]
    assert decoded[:2] == [40, 40] and set(decoded[2:]) <= {1}
    for got in (a, compiled):
        assert got.shape == b.shape == (3, 16)
        same = (got == b).all(dim=1)
        assert _first_divergence_is_a_tie(got, b, prompt, mask, ref, exact), f"rows equal: {same.tolist()}"


@pytest.mark.parametrize("padding", [False, True])
def test_transformers_training_with_attention_dropout_runs_the_kernels(padding, monkeypatch):
    # A Llama-style model trained with attention_dropout: every layer's attention runs on our kernels with
    # the model's dropout probability (one launch per layer, with key ranges when padded); two passes
    # draw different masks, torch.manual_seed repeats one (outputs and gradients); eval mode is exact.
    transformers = pytest.importorskip("transformers")
    from flash_attention.integrations.transformers import register

    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        attention_dropout=0.5,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=register())
    model = model.to("cuda", torch.bfloat16).train()
    launched: list = []
    real = launch.launch_plan

    def spy(plan, q, k, v, o, lse, key_range=None, *rest):
        launched.append((plan.dropout_p, key_range is not None))
        return real(plan, q, k, v, o, lse, key_range, *rest)

    monkeypatch.setattr(launch, "launch_plan", spy)
    monkeypatch.setattr(repeat, "MODE", "python" if repeat.MODE == "native" else repeat.MODE)
    ids = torch.randint(3, 512, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    if padding:
        mask[1, :77] = 0
    keep = mask.bool()

    def step(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    a, grads_a = step(3)
    b, _ = step()
    c, grads_c = step(3)
    assert launched == [(0.5, padding)] * 6
    assert (a[keep].float() - b[keep].float()).abs().max() > 0.1
    assert torch.equal(a, c)
    for ga, gc in zip(grads_a, grads_c, strict=True):
        assert torch.isfinite(ga).all()
        # Repeatable up to the order of atomic additions (our dQ, the embedding's backward), which moves a
        # bf16 gradient by an ulp here and there; another dropout mask would change it by tens of percent.
        assert (ga.float() - gc.float()).norm() <= 1e-2 * gc.float().norm() + 1e-6
    model.eval()
    with torch.no_grad():
        e, f = model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    assert torch.equal(e, f) and launched[6:] == [(0.0, padding)] * 4


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "gpt_oss"])
def test_transformers_sliding_window_and_softcap_families_match_eager(family, launches):
    # bf16 Gemma 2 (softcap: our kernel with softcap=, its sliding layer with the window too), Gemma 3 (the
    # sliding layer: our kernel with the window; the full-attention layer: our kernel), Mistral (every
    # layer sliding: our kernel with the window) and gpt-oss (sinks: our kernel with sinks=, its sliding
    # layer with the window too) against "eager" in bf16, with float32 "eager" on the same rounded weights
    # as the exact answer: the accuracy rule.
    transformers = pytest.importorskip("transformers")
    from flash_attention.integrations.transformers import register

    name = register()
    classes = {
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "mistral": "MistralConfig",
        "gpt_oss": "GptOssConfig",
    }
    config_class = classes[family]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    kwargs = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.2,
        sliding_window=128,  # < the 300 tokens
        pad_token_id=0,
    )
    if family != "mistral":
        kwargs.update(layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=64)
    if family == "gemma2":
        kwargs.update(attn_logit_softcapping=2.0, final_logit_softcapping=None)
    if family == "gpt_oss":
        kwargs.pop("query_pre_attn_scalar")
        kwargs.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    cfg = getattr(transformers, config_class)(**kwargs)
    make = transformers.AutoModelForCausalLM.from_config
    eager = make(copy.deepcopy(cfg), attn_implementation="eager").eval().to("cuda", torch.bfloat16)
    ours = make(copy.deepcopy(cfg), attn_implementation=name).eval().to("cuda", torch.bfloat16)
    if family == "gpt_oss":  # sinks of a size that shows (initialised to 0)
        with torch.no_grad():
            for layer in eager.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
    ours.load_state_dict(eager.state_dict())
    exact = copy.deepcopy(eager).to(torch.float32)
    ids = torch.randint(3, 512, (2, 300), device="cuda")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Gemma 2's one-time eager-route notice
        o, e, x = ours(ids).logits, eager(ids).logits, exact(ids).logits
    _check_rule(o, e, x, family)
    assert len(launches) == 2


def test_flash_attention_training_with_dropout_runs_the_kernels(launches):
    # Dropout in training mode stays on our kernels (their own counter-based mask): finite outputs and
    # gradients, reproducible under torch.manual_seed, different masks for different seeds, and eval mode
    # equal to the dropout-free computation.
    m = FlashAttention(256, 4, dropout=0.2, causal=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(7)
    a, _ = m(x)
    torch.manual_seed(7)
    b, _ = m(x)
    torch.manual_seed(8)
    c, _ = m(x)
    assert launches and torch.equal(a, b) and not torch.equal(a, c)
    a.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in m.parameters())
    m.eval()
    with torch.no_grad():
        e, _ = m(x)
        m.dropout = 0.0
        f, _ = m(x)
    assert torch.equal(e, f)
