"""Train a small Llama-style model on one long sequence split over the ranks (context parallelism).

    torchrun --nproc-per-node 2 examples/ring_llama.py --tokens 131072        # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ring_llama.py --cpu --tokens 256     # CPU, gloo

Every rank holds the same weights and a zigzag share of the sequence (flash_attention.api.ring:
shard_sequence), with the share's own position ids, so rotary embeddings, norms and MLPs (all
token-local) run on the share alone; only attention needs the other shares, and gets them through
ring_attention, registered as a transformers attention implementation. The loss is each rank's share of
the mean token loss, and the parameter gradients are summed over the ranks afterwards (all-reduce), which
makes them the single-sequence gradients.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

RING = "fa_ring"


def register_ring_attention(group=None) -> str:
    """Register ``ring_attention`` under ``RING`` with transformers (attention and a mask function that
    builds no mask: the ring computes causal itself)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from flash_attention.api.ring import ring_attention

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise NotImplementedError("ring attention takes no attention dropout (yet)")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, share, heads, head_dim)
        return ring_attention(q, k, v, group=group, causal=True, softmax_scale=scaling), None

    AttentionInterface.register(RING, attention)
    AttentionMaskInterface.register(RING, lambda **kwargs: None)
    return RING


def tiny_llama(seed: int = 0, **overrides):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1 << 20, initializer_range=0.2, **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def ring_step(model, ids: torch.Tensor, group=None) -> torch.Tensor:
    """One training step's loss (summed over the ranks) and this rank's parameter gradients, summed over
    the ranks into every rank's ``.grad``; ``ids`` (1, tokens) the whole sequence, the same on every rank."""
    from flash_attention.api.ring import shard_sequence

    model.set_attn_implementation(register_ring_attention(group))
    tokens = ids.shape[1]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # next-token labels of the whole sequence, before sharding
    positions = torch.arange(tokens, device=ids.device).unsqueeze(0)
    ids_s, labels_s, pos_s = (shard_sequence(t, group) for t in (ids, labels, positions))
    logits = model(input_ids=ids_s, position_ids=pos_s, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels_s.flatten(), ignore_index=-100, reduction="sum"
    ) / (tokens - 1)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 17)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (the PyTorch fallback)")
    args = ap.parse_args()
    backend = "gloo" if args.cpu else "nccl"
    rank = int(os.environ.get("RANK", 0))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    model = tiny_llama().to(device, torch.float32 if args.cpu else torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (1, args.tokens), device=device)
    for step in range(args.steps):
        opt.zero_grad()
        loss = ring_step(model, ids)
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
