"""``bench --mode model``: one training step (forward, loss, backward) of a Llama-style transformers model
with random weights, with our attention against PyTorch's, in one run.

Ours is transformers' ``attn_implementation="fa_scratch"`` (:mod:`flash_attention.integrations.transformers`);
the baselines are ``"sdpa"`` as transformers runs it (``sdpa``: PyTorch's own backend choice) and the same
pinned to cuDNN (``sdpa_cudnn``), which is what PyTorch picks on Hopper. The model is built once and its
attention implementation switched between the timed calls, so every implementation trains the same weights on
the same tokens; the steps' losses are recorded next to the times as a check that they computed the same
thing. Each implementation is timed in alternating rounds (three by default, ``--rounds``) and a row records
the median of the rounds' medians, as ``--mode decode`` does.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..common import Timing, time_cuda
from .results import OURS

__all__ = ["MODEL_IMPLS", "ModelSettings", "build_model", "model_text", "run_model"]

#: Ours, transformers' sdpa as PyTorch dispatches it, and sdpa pinned to cuDNN.
MODEL_IMPLS = (OURS, "sdpa", "sdpa_cudnn")


@dataclass(frozen=True)
class ModelSettings:
    """The model (Llama-style: RMSNorm, rotary positions, SwiGLU, grouped-query attention) and the steps.
    The default is the issue's shape: 8 layers of width 2048, head_dim 128 (16 query / 8 K/V heads), 4k
    tokens."""

    impls: tuple[str, ...] = MODEL_IMPLS
    layers: int = 8
    width: int = 2048
    head_dim: int = 128
    heads_kv: int = 8
    vocab: int = 32000
    batch: int = 1
    seqlen: int = 4096
    dtype: str = "bf16"
    rounds: int = 3
    warmup: int = 3
    min_reps: int = 10
    min_time_s: float = 0.5


def build_model(settings: ModelSettings, device: str | torch.device) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of random weights in ``settings.dtype`` on ``device``, in training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flash_attention.integrations.transformers import register

    register()
    heads = settings.width // settings.head_dim
    config = LlamaConfig(
        vocab_size=settings.vocab,
        hidden_size=settings.width,
        intermediate_size=256 * -(-8 * settings.width // 3 // 256),  # ~8/3 of the width, as Llama's
        num_hidden_layers=settings.layers,
        num_attention_heads=heads,
        num_key_value_heads=settings.heads_kv,
        head_dim=settings.head_dim,
        max_position_embeddings=settings.seqlen,
        attention_dropout=0.0,
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[settings.dtype]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    return model


def _attention_name(impl: str) -> str:
    from flash_attention.integrations.transformers import NAME

    return NAME if impl == OURS else "sdpa"


def _context(impl: str):
    if impl == "sdpa_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    return contextlib.nullcontext()


def run_model(
    settings: ModelSettings, device: str | torch.device = "cuda", timer: Callable[..., Timing] = time_cuda
) -> list[dict]:
    """One row per implementation: the training step's time (median of the rounds' medians), tokens per
    second and the step's loss. ``timer`` times ``fn(i)`` (:func:`flash_attention.tools.common.time_cuda`;
    the tests pass one that runs on the CPU)."""
    model = build_model(settings, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(settings.vocab, (settings.batch, settings.seqlen), generator=gen).to(device)
    losses: dict[str, float] = {}

    def step_of(impl: str) -> Callable[[int], None]:
        def step(_: int) -> None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            losses[impl] = loss.detach()

        return step

    timing = dict(warmup=settings.warmup, min_reps=settings.min_reps, min_time_s=settings.min_time_s)
    samples: dict[str, list[Timing]] = {impl: [] for impl in settings.impls}
    for _ in range(settings.rounds):
        for impl in settings.impls:
            model.set_attn_implementation(_attention_name(impl))
            with _context(impl):
                samples[impl].append(timer(step_of(impl), 1, **timing))
    rows = []
    tokens = settings.batch * settings.seqlen
    for impl in settings.impls:
        ms = statistics.median(t.ms for t in samples[impl])
        rows.append(
            dict(
                mode="model",
                impl=impl,
                dtype=settings.dtype,
                layers=settings.layers,
                width=settings.width,
                head_dim=settings.head_dim,
                heads=settings.width // settings.head_dim,
                kv_heads=settings.heads_kv,
                batch=settings.batch,
                seqlen=settings.seqlen,
                ms=ms,
                ms_rounds=[t.ms for t in samples[impl]],
                tokens_per_s=tokens / (ms * 1e-3),
                loss=float(losses[impl]),
            )
        )
    return rows


def model_text(rows: list[dict]) -> str:
    """The rows as a table, each implementation's step time against ours."""
    ours = {(r["batch"], r["seqlen"]): r["ms"] for r in rows if r["impl"] == OURS}
    header = f"{'batch':>5} {'tokens':>7} {'impl':<16} {'step ms':>9} {'tokens/s':>10} {'impl/ours':>9}"
    lines = [header + f" {'loss':>8}"]
    for r in rows:
        mine = ours.get((r["batch"], r["seqlen"]))
        ratio = f"{r['ms'] / mine:.2f}x" if mine else "-"
        lines.append(
            f"{r['batch']:>5} {r['batch'] * r['seqlen']:>7} {r['impl']:<16} {r['ms']:>9.2f} "
            f"{r['tokens_per_s']:>10.0f} {ratio:>9} {r['loss']:>8.4f}"
        )
    return "\n".join(lines)
