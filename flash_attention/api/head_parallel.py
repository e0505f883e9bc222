"""Head-parallel context parallelism: attention over a sequence sharded across the ranks of a
``torch.distributed`` group, by all-to-all over heads (the scheme DeepSpeed-Ulysses made known).

Each of the W ranks holds a share of every sequence's queries, keys and values along dimension 1, in the
layouts :func:`flash_attention.shard_sequence` makes (contiguous, or zigzag). :func:`head_parallel_attention`
exchanges them once (``all_to_all``) so that each rank holds the whole sequence of 1/W of the heads, runs
:func:`flash_attention.attention` on it (its kernels; the PyTorch fallback on CPU), and exchanges the output
back to the sequence shares. The backward is the same two exchanges in reverse around the attention's own
backward.

Against :func:`flash_attention.ring_attention`: a rank attends whole rows, so every option of
``attention()`` applies as it is (causal, windows, soft-capping, ALiBi, sinks) and no partial results are
merged; it moves each of q, k, v and the output once per direction (about 4 x the share's bytes, each going
to W - 1 ranks over all-to-all links) where the ring moves K/V W - 1 times point to point; and it needs
the heads to divide among the ranks: heads_q a multiple of W, and heads_kv a multiple of W or a divisor of
it (then each K/V head is repeated to W heads before the exchange, which sends K/V W / heads_kv times over).
Its memory per rank is the whole sequence of 1/W of the heads: what one GPU holds, divided by W.

The hybrid (``ring_group``): heads exchanged among the ranks of ``group`` (few, on fast links: one node's
GPUs), the ring over ``ring_group`` on the longer shares that exchange gathers; for more ranks than K/V heads,
or links too slow for an all-to-all among all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sinks import check_sinks
from ..spec.validate import check_score, check_window, validate
from .attention import attention
from .ring import ring_attention

__all__ = ["head_parallel_attention"]


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("head_parallel_attention needs an initialised torch.distributed process group")
    return dist.get_rank(group), dist.get_world_size(group)


def _natural_order(world: int, zigzag: bool, device) -> torch.Tensor | None:
    """For the 2W half-shares in rank order (rank r's share is chunks r and 2W - 1 - r of the zigzag
    layout), the index of each chunk of the natural order; None for contiguous shares (rank order is the
    natural order)."""
    if not zigzag:
        return None
    index = [2 * c if c < world else 2 * (2 * world - 1 - c) + 1 for c in range(2 * world)]
    return torch.tensor(index, device=device)


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over the leading dimension (W): chunk i goes to rank i, chunk j of the result came from
    rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # (after contiguous(): empty_like keeps a permuted view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, world: int, order: torch.Tensor | None) -> torch.Tensor:
    """(batch, seqlen_local, heads, d) shares -> (batch, seqlen, heads / W, d): the whole sequence, in
    natural order, of this rank's group of heads."""
    b, s_local, h, d = x.shape
    y = _exchange(x.reshape(b, s_local, world, h // world, d).permute(2, 0, 1, 3, 4), group)
    y = y.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h // world, d)  # rank order
    if order is not None:
        y = y.reshape(b, 2 * world, s_local // 2, h // world, d).index_select(1, order)
        y = y.reshape(b, world * s_local, h // world, d)
    return y


def _heads_to_seq(y: torch.Tensor, group, world: int, order: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: (batch, seqlen, heads / W, d) -> this rank's share of every
    head, (batch, seqlen_local, heads, d)."""
    b, s, h_local, d = y.shape
    s_local = s // world
    if order is not None:  # natural -> rank order: the inverse permutation of the chunks
        y = y.reshape(b, 2 * world, s_local // 2, h_local, d).index_select(1, torch.argsort(order))
    x = _exchange(y.reshape(b, world, s_local, h_local, d).permute(1, 0, 2, 3, 4), group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s_local, world * h_local, d)


class _Exchange(torch.autograd.Function):
    """:func:`_seq_to_heads` (``to_heads``) or :func:`_heads_to_seq`, whose gradient is the other one of the
    output's (each is a permutation of the elements across the ranks, and a permutation's transpose is its
    inverse)."""

    @staticmethod
    def forward(ctx, x, to_heads, group, world, order):
        ctx.args = (not to_heads, group, world, order)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, world, order)

    @staticmethod
    def backward(ctx, grad):
        to_heads, *args = ctx.args
        return (_seq_to_heads if to_heads else _heads_to_seq)(grad, *args), None, None, None, None


def head_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    zigzag: bool | None = None,
    ring_group=None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's share of a sequence against the whole sequence, by all-to-all over heads
    (and, with ``ring_group``, the ring over the rest of the ranks).

    Args:
        q, k, v: this rank's shares, (batch, seqlen_local, heads, head_dim), the same seqlen_local on every
            rank, laid out as :func:`flash_attention.shard_sequence` makes them; heads_q a multiple of the
            world size W, heads_kv a multiple of W or a divisor of it.
        group: the process group (default: the world).
        causal, softmax_scale, window, softcap: as :func:`flash_attention.attention` takes them, over the
            whole (unsharded) sequence.
        alibi_slopes: (heads_q,) or (batch, heads_q) float32, as attention() takes them; every rank passes
            the same tensor (each uses its heads' slopes).
        sinks: (heads_q,) attention-sink logits, as attention() takes them; every rank passes the same
            tensor. Differentiable: its gradient on each rank is that rank's heads' part, to be summed over
            the ranks like any replicated parameter's.
        zigzag: whether the shares are zigzag ones (chunks r and 2W - 1 - r of 2W); None: as
            :func:`flash_attention.ring_attention` takes them, zigzag when ``causal`` without a ``window``.
        ring_group: the hybrid of the two schemes: ``group`` exchanges heads among a few ranks (those of
            one node, say), and :func:`flash_attention.ring_attention` runs over ``ring_group`` (one rank
            of each head group) on what the exchange gathers. The shares are then a ring share (zigzag or
            contiguous, as the ring takes it: ``zigzag``) cut contiguously among ``group``:
            ``shard_sequence(shard_sequence(x, ring_group, zigzag=z), group, zigzag=False)``. The ring takes
            no ALiBi.
        return_lse: also return this rank's rows' float32 (batch, heads_q, seqlen_local) LSE.

    Returns:
        This rank's share of the output (differentiable with respect to q, k, v, and the sinks), and with
        ``return_lse`` the LSE.
    """
    validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=None)
    window = check_window(window)
    check_score(alibi_slopes, q, softcap=softcap)  # (naming the argument)
    check_sinks(sinks, q)
    rank, world = _group_info(group)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold equal shares of the sequence; got {q.shape[1]} and {k.shape[1]}")
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_q % world:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of the world size ({world})")
    if heads_kv % world and world % heads_kv:
        raise ValueError(f"heads_kv ({heads_kv}) must be a multiple or a divisor of the world size ({world})")
    zigzag = causal and window is None if zigzag is None else bool(zigzag)
    if ring_group is not None and alibi_slopes is not None:
        raise ValueError("alibi_slopes: the ring (ring_group) takes no ALiBi")
    if zigzag and ring_group is None and q.shape[1] % 2:
        raise ValueError(f"zigzag shares have an even length; got {q.shape[1]}")
    if heads_kv < world:  # each rank's query heads read one K/V head: repeated to W heads, one per rank
        k, v = (t.repeat_interleave(world // heads_kv, dim=2) for t in (k, v))
    # (hybrid: each rank holds a contiguous piece of its ring share, whose own layout is the ring's concern)
    order = _natural_order(world, zigzag and ring_group is None, q.device)
    qh, kh, vh = (_Exchange.apply(t, True, group, world, order) for t in (q, k, v))
    mine = slice(rank * heads_q // world, (rank + 1) * heads_q // world)
    slopes = None if alibi_slopes is None else alibi_slopes[..., mine]
    sinks_mine = None if sinks is None else sinks[mine]
    if ring_group is None:
        out, lse = attention(
            qh, kh, vh, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
            alibi_slopes=None if slopes is None else slopes.contiguous(), sinks=sinks_mine, return_lse=True,
        )  # fmt: skip
    else:
        out, lse = ring_attention(
            qh, kh, vh, group=ring_group, causal=causal, softmax_scale=softmax_scale, window=window,
            softcap=softcap, sinks=sinks_mine, return_lse=True,
        )  # fmt: skip
    out = _Exchange.apply(out, False, group, world, order)
    if not return_lse:
        return out
    # (batch, heads / W, seqlen) -> (batch, heads, seqlen_local): the output's exchange, on a head_dim of 1
    lse = _Exchange.apply(lse.transpose(1, 2).unsqueeze(-1).contiguous(), False, group, world, order)
    return out, lse.squeeze(-1).transpose(1, 2)
