"""Where gpt-oss's bf16 logits part from float32's: the attention, layer by layer, or the experts' router.

    python tools/gptoss_layers.py [--device cuda] [--seq 512] [--window 128] [--batch 2] [--pad 37]

Builds small models with random weights (no download): gpt-oss (sliding and full layers alternating,
attention sinks, top-k experts), the same gpt-oss with every expert on every token (no routing choice
left), and a Llama of the same size. Each model's float32 "eager" run, on the bf16-rounded weights that the
bf16 runs use, is the reference. For every model and batch (unpadded, and left-padded by --pad tokens in
its second row) it prints two tables:

* same input -- each layer's attention function alone, on the reference's q, k, v (rounded to bf16) and its
  own mask: the relative difference (Frobenius norm over the real query rows) of its output from the float32
  eager output: the attention computation's own rounding (bf16's unit is 2^-8 = 3.9e-3). A semantic
  difference (sinks, window bounds, scaling, mask) stands out here only where it moves the output by more
  than that; tests/test_transformers.py checks the semantics in float32, layer by layer.
* whole model -- the model run end to end in bf16 (ours, eager, sdpa where the model has it) and in float32
  with each attention output perturbed by a relative 2^-8 (the size of one bf16 rounding): per layer the
  attention output's relative difference from the reference run's, the fraction of tokens routed to another
  set of experts, and the logits' relative difference (norm; max |d| / max |ref|) and argmax agreement. The
  last rows compare ours with eager (and sdpa) directly, both bf16: no reference, two roundings.

Reading it: the same-input rows tell the attention apart from the model (an error of bf16's size, no larger
than eager's, is rounding); the perturbed float32 row measures how much the model itself amplifies one bf16
rounding of its attention outputs (top-k routing, every expert, Llama); the whole-model rows are what a
comparison of bf16 runs sees. docs/design.md ("Modules and integrations") gives an H200's numbers.

Needs transformers with GptOssConfig. On a GPU the bf16 runs use our kernels; with --device cpu (small
sizes: --seq 64 --window 16) ours runs the PyTorch fallback on the route CUDA takes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flash_attention

import transformers  # noqa: E402
from transformers.integrations import sdpa_attention  # noqa: E402

from flash_attention.integrations import transformers as integration  # noqa: E402
from flash_attention.nn import functional as fn  # noqa: E402

NAME = integration.register()
NOISE = 2.0**-8  # one bf16 rounding, relative


def _config(family: str, args: argparse.Namespace, every_expert: bool = False):
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        head_dim=args.head_dim,
        max_position_embeddings=max(1024, 2 * args.seq),
        initializer_range=args.init,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.GptOssConfig(
        **common,
        sliding_window=args.window,
        layer_types=["sliding_attention", "full_attention"] * (args.layers // 2),
        num_local_experts=args.experts,
        num_experts_per_tok=args.experts if every_expert else args.top_k,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _models(family: str, impls: list[str], cfg, device: str) -> dict:
    """The implementations' bf16 models and the float32 reference, all on the same bf16-rounded weights."""
    make = transformers.AutoModelForCausalLM.from_config
    base = make(copy.deepcopy(cfg), attn_implementation="eager").eval()
    if hasattr(base.model.layers[0].self_attn, "sinks"):  # gpt-oss: sinks that matter (initialised near 0)
        with torch.no_grad():
            for layer in base.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, cfg.num_attention_heads))
    base = base.to(device, torch.bfloat16)
    models = {"reference": copy.deepcopy(base).float()}
    for impl in impls:
        m = make(copy.deepcopy(cfg), attn_implementation=impl).eval()
        m.load_state_dict(base.state_dict())
        models[impl] = m.to(device, torch.bfloat16)
    return models


# ------------------------------------------------------------------------------------------------------
# Capturing each layer's attention call and routing


def _eager_module(model):
    return sys.modules[type(model.model.layers[0].self_attn).__module__]


def _attention_function(model, impl: str):
    if impl == "eager":
        return _eager_module(model).eager_attention_forward
    return {NAME: integration.attention_forward, "sdpa": sdpa_attention.sdpa_attention_forward}[impl]


@contextlib.contextmanager
def _spy(model, impl: str, record: dict, noise: float = 0.0):
    """While active, ``record[layer]`` = (q, k, v, mask, kwargs, output) of each attention call of
    ``model``, and ``record["experts"][layer]`` its router's expert indices. ``noise``: each attention output
    is multiplied by 1 + noise * U(-1, 1) (float32 runs that stand in for one bf16 rounding)."""
    real = _attention_function(model, impl)

    def spy(module, q, k, v, mask, **kwargs):
        out, weights = real(module, q, k, v, mask, **kwargs)
        if noise:
            out = out * (1 + noise * (2 * torch.rand_like(out) - 1))
        record[module.layer_idx] = (q, k, v, mask, kwargs, out)
        return out, weights

    # transformers looks "eager" up in the modeling module, the others in its attention registry, per call.
    owner = _eager_module(model)
    if impl == "eager":
        owner.eager_attention_forward = spy
    else:
        transformers.AttentionInterface.register(impl, spy)
    hooks = []
    record["experts"] = {}
    for i, layer in enumerate(model.model.layers):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            hooks.append(router.register_forward_hook(_routing_hook(record["experts"], i)))
    try:
        yield
    finally:
        if impl == "eager":
            owner.eager_attention_forward = real
        else:
            transformers.AttentionInterface.register(impl, real)
        for h in hooks:
            h.remove()


def _routing_hook(store: dict, layer: int):
    def hook(module, inputs, output):
        # (logits, scores, indices) in transformers 5.x: the indices are the integer tensor, in any order.
        outputs = output if isinstance(output, tuple) else (output,)
        ints = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if ints:
            store[layer] = ints[0].sort(dim=-1).values

    return hook


def _run(model, impl: str, ids, mask, noise: float = 0.0) -> tuple[torch.Tensor, dict]:
    record: dict = {}
    with _spy(model, impl, record, noise), torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    return logits.float(), record


# ------------------------------------------------------------------------------------------------------
# Measures


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _logit_measures(a: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> str:
    a, ref = a[keep].double(), ref[keep].double()
    max_rel = ((a - ref).abs().max() / ref.abs().max()).item()
    agree = (a.argmax(-1) == ref.argmax(-1)).double().mean().item()
    return f"{_rel(a, ref):8.2e} {max_rel:8.2e} {agree:6.3f}"


def _same_input(models: dict, runs: dict, impl: str, keep: torch.Tensor) -> list[float]:
    """Per layer: ``impl``'s attention function on the reference's q, k, v in bf16, against the reference's
    float32 output."""
    out = []
    model = models[impl]
    fn_ = _attention_function(model, impl)
    reference = runs["reference"][1]
    own = runs[impl][1]
    for layer in range(len(model.model.layers)):
        q, k, v, _, _, ref_out = reference[layer]
        _, _, _, mask, kwargs, _ = own[layer]  # its own mask, sinks, scaling
        with torch.no_grad():
            module = model.model.layers[layer].self_attn
            got, _ = fn_(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, **kwargs)
        out.append(_rel(got[keep], ref_out[keep]))  # the real query rows
    return out


def _in_model(run: dict, reference: dict, keep: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer: the attention output's relative difference from the reference run's, and the fraction of
    real tokens routed to another set of experts."""
    layers = sorted(k for k in reference if isinstance(k, int))
    attn = [_rel(run[i][5][keep], reference[i][5][keep]) for i in layers]
    flips = []
    for i in layers:
        a, r = run["experts"].get(i), reference["experts"].get(i)
        if a is None or r is None:
            flips.append(float("nan"))
            continue
        flat = keep.reshape(-1)
        flips.append((a != r).any(-1)[flat].double().mean().item())
    return attn, flips


def _compare(label: str, family: str, cfg, impls: list[str], args) -> None:
    models = _models(family, impls, cfg, args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    for pad in (0, args.pad):
        mask = torch.ones_like(ids)
        mask[1:, :pad] = 0  # left padding, as batched generation uses
        keep = mask.bool()
        runs = {"reference": _run(models["reference"], "eager", ids, mask)}
        for impl in impls:
            runs[impl] = _run(models[impl], impl, ids, mask)
        runs["noise"] = _run(models["reference"], "eager", ids, mask, noise=NOISE)
        layers = cfg.num_hidden_layers
        head = " ".join(f"L{i:<7}" for i in range(layers))
        print(f"\n{label}, {'left-padded by ' + str(pad) if pad else 'no padding'}")
        print(f"  same input   {'':17} attn rel  {head}")
        for impl in impls:
            values = " ".join(f"{x:8.2e}" for x in _same_input(models, runs, impl, keep))
            print(f"  {_name(impl) + ' bf16':30} {'':8} {values}")
        print(f"  whole model  {'':17} {'logits':>8} {'max':>8} {'argmax':>6}  attn rel per layer | flips")
        ref_logits, ref_record = runs["reference"]
        for key in [*impls, "noise"]:
            logits, record = runs[key]
            attn, flips = _in_model(record, ref_record, keep)
            what = "fp32 + 2^-8 noise" if key == "noise" else f"{_name(key)} bf16"
            flip_text = " ".join("-" if f != f else f"{f:.2f}" for f in flips)
            print(
                f"  {what:30} {_logit_measures(logits, ref_logits, keep)}  "
                f"{' '.join(f'{x:8.2e}' for x in attn)} | {flip_text}"
            )
        for other in ("eager", "sdpa"):  # the comparisons of issue 47: two bf16 runs, neither exact
            if other in impls:
                direct = _logit_measures(runs[NAME][0], runs[other][0], keep)
                print(f"  {'ours vs ' + other + ', both bf16':30} {direct}")


def _name(impl: str) -> str:
    return "ours" if impl == NAME else impl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--pad", type=int, default=37, help="left padding of the padded batch's rows 1..")
    parser.add_argument("--window", type=int, default=128, help="gpt-oss's sliding window (keys)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    # 0.2 (the tests' value, not transformers' 0.02): attention that moves the logits enough to be compared
    parser.add_argument("--init", type=float, default=0.2, help="the weights' standard deviation")
    args = parser.parse_args(argv)
    if not hasattr(transformers, "GptOssConfig"):
        raise SystemExit(f"transformers {transformers.__version__} has no GptOssConfig")
    if args.layers % 2 or args.heads % 2 or not 0 < args.pad < args.seq:
        raise SystemExit("--layers and --heads must be even, and 0 < --pad < --seq")
    # A float32 reference in TF32 would carry 10-bit products: not a reference for bf16.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cpu":
        # The route CUDA takes (padding as key ranges), computed by the fallback: the tests' seam.
        fn.kernel_expected = lambda t: True
    torch.manual_seed(0)
    start = time.perf_counter()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.device}; "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads of {args.head_dim}, "
        f"batch {args.batch} x {args.seq} tokens, weights' std {args.init}; gpt-oss window {args.window}. "
        "Relative differences from float32 eager on the same bf16-rounded weights"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gptoss = f"gpt-oss (top-{args.top_k} of {args.experts} experts)"
        _compare(gptoss, "gpt_oss", _config("gpt_oss", args), [NAME, "eager"], args)
        every = f"gpt-oss (all {args.experts} experts on every token)"
        _compare(every, "gpt_oss", _config("gpt_oss", args, every_expert=True), [NAME, "eager"], args)
        _compare("llama", "llama", _config("llama", args), [NAME, "eager", "sdpa"], args)
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
