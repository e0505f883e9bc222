"""Context parallelism: attention over a sequence sharded across the ranks of a ``torch.distributed`` group.

Each of the W ranks holds a contiguous share of every sequence's queries, keys and values (dimension 1,
the (batch, seqlen, heads, head_dim) layout). :func:`ring_attention` passes the K/V shares around the ring
(rank r sends to r + 1 and receives from r - 1, point-to-point, the next share in flight while the current
one is attended), computes the attention of its queries against each share with :func:`flash_attention.
attention`'s kernels (the custom ops: the PyTorch fallback on CPU), and merges the partial results with
their log-sum-exps in float32 (the LSE merge kernel). The backward rotates the K/V shares again with their
dK/dV accumulators, which arrive back at their owner after the last step; each step's gradients come from
the backward kernels run with the final output and LSE, which makes every partial exact. Both directions
run one ring pass per group of heads (:func:`_head_groups`), so what a pass holds beyond the inputs (float32
accumulators, the share in flight, the kernels' workspaces) is one group's and the peak memory stays near
the share's own.

Causal attention balances the ranks' work with the "zigzag" layout: the sequence is cut into 2W chunks and
rank r holds chunks r and 2W - 1 - r (:func:`shard_sequence` / :func:`unshard_sequence` convert). Every
step is then one attention call of the same size on every rank: against its own share, causal over its two
chunks; against an earlier rank's share, both its chunks against the share's first chunk (the second lies
in the future); against a later rank's share, its second chunk against both of the share's chunks (its
first chunk precedes both). Blocks in the future are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..ops.merge import lse_merge_
from ..sinks import apply_sinks, check_sinks, sinks_gradient
from ..spec import OpOptions
from ..spec.score_functions import values_of
from ..spec.validate import check_score, check_window, validate
from ..torch_ops import attention as custom_ops

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialised torch.distributed process group")
    return dist.get_rank(group), dist.get_world_size(group)


def _chunks(seqlen: int, world: int, zigzag: bool) -> list[tuple[int, int]]:
    """The (start, end) spans of each rank's share: W contiguous spans, or the zigzag pairs of 2W chunks."""
    if zigzag:
        if seqlen % (2 * world):
            raise ValueError(
                f"a zigzag shard needs seqlen divisible by 2 * world size = {2 * world}; got {seqlen}"
            )
        c = seqlen // (2 * world)
        return [(i * c, (i + 1) * c) for i in range(2 * world)]
    if seqlen % world:
        raise ValueError(f"seqlen must be divisible by the world size {world}; got {seqlen}")
    c = seqlen // world
    return [(i * c, (i + 1) * c) for i in range(world)]


def shard_sequence(x: torch.Tensor, group=None, *, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim``: with ``zigzag`` (the causal layout) chunks r and 2W - 1 - r
    of 2W, else the r-th of W contiguous spans. Every rank passes the same full tensor."""
    rank, world = _group_info(group)
    spans = _chunks(x.shape[dim], world, zigzag)
    mine = [spans[rank], spans[2 * world - 1 - rank]] if zigzag else [spans[rank]]
    return torch.cat([x.narrow(dim, a, b - a) for a, b in mine], dim=dim).contiguous()


def unshard_sequence(x: torch.Tensor, group=None, *, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """The full tensor from every rank's share (all-gather), the inverse of :func:`shard_sequence`."""
    rank, world = _group_info(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if not zigzag:
        return torch.cat(parts, dim=dim)
    half = x.shape[dim] // 2
    order: list[Any] = [None] * (2 * world)
    for r, part in enumerate(parts):
        order[r] = part.narrow(dim, 0, half)
        order[2 * world - 1 - r] = part.narrow(dim, half, half)
    return torch.cat(order, dim=dim)


def _exchange(tensors: torch.Tensor, group, rank: int, world: int, tag: int = 0) -> tuple[list, torch.Tensor]:
    """Send ``tensors`` to the next rank and receive the previous rank's into a new buffer (asynchronous:
    the caller waits on the requests before reading the buffer). Exchanges in flight together take
    distinct ``tag``s: messages between two ranks are matched by tag, not by order, on some backends."""
    incoming = torch.empty_like(tensors)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ops = [
        dist.P2POp(dist.isend, tensors, dist.get_global_rank(group, nxt) if group else nxt, group, tag),
        dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, prv) if group else prv, group, tag),
    ]
    return dist.batch_isend_irecv(ops), incoming


@dataclass
class _Step:
    """What this rank computes at one ring step: its query rows ``rows`` against the keys ``keys`` of the
    share it holds (from rank ``src``), causally or not, or through per-row key runs (``runs``: a sliding
    window, the segments build on the batch folded into one row); ``empty``: nothing to compute."""

    src: int
    rows: slice
    keys: slice
    causal: bool = False
    runs: tuple[torch.Tensor, torch.Tensor] | None = None
    empty: bool = False


def _steps(rank: int, world: int, causal: bool, window, batch: int, local: int, device) -> list[_Step]:
    """The ring's steps for this rank (every rank takes the same number, in lockstep).

    Without a window: W steps; causal in the zigzag layout, each one call of the same size (module
    docstring). With a window (contiguous shares, ``zigzag=False``): runs per step from the shares' global
    offsets, and when no key after a row is visible (right <= 0) only the steps whose shares reach back into
    some row's window: 1 + (local - 1 + left) // local of them, the rest of the ring skipped entirely."""
    everything = slice(0, local)
    if window is None:
        out = []
        half = local // 2
        for step in range(world):
            src = (rank - step) % world
            if not causal:
                out.append(_Step(src, everything, everything))
            elif src == rank:
                out.append(_Step(src, everything, everything, causal=True))
            elif src < rank:  # both query chunks see the share's first chunk only
                out.append(_Step(src, everything, slice(0, half)))
            else:  # only the second query chunk sees the later share
                out.append(_Step(src, slice(half, local), everything))
        return out
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    n_steps = world
    if right == 0 and left >= 0:  # no later key: the shares more than `left` keys back are never seen
        n_steps = min(world, 1 + (local - 1 + left) // local)
    out = []
    idx = torch.arange(local, device=device)
    fold = (torch.arange(batch, device=device) * local).view(-1, 1, 1)  # the batch folded into one row
    for step in range(n_steps):
        src = (rank - step) % world
        off = (rank - src) * local  # a row's global position minus its key's, at equal local indices
        lo = torch.zeros_like(idx) if left < 0 else (idx + off - left).clamp(0, local)
        hi = torch.full_like(idx, local) if right < 0 else (idx + off + right + 1).clamp(0, local)
        hi = torch.maximum(hi, lo)
        qlo = torch.zeros_like(idx) if right < 0 else (idx - off - right).clamp(0, local)
        qhi = torch.full_like(idx, local) if left < 0 else (idx - off + left + 1).clamp(0, local)
        qhi = torch.maximum(qhi, qlo)
        # Some row sees some key iff the window's far edges reach the share (decided on the host).
        if (right >= 0 and local - 1 + off + right < 0) or (left >= 0 and off - left > local - 1):
            out.append(_Step(src, everything, everything, empty=True))
            continue
        runs = tuple(
            (torch.stack(pair, 1).unsqueeze(0) + fold).reshape(-1, 2).to(torch.int32).contiguous()
            for pair in ((lo, hi), (qlo, qhi))
        )
        out.append(_Step(src, everything, everything, runs=runs))
    return out


def _step_options(options: OpOptions, step: _Step) -> tuple[list[int], list[float]]:
    """The op options of one step, packed: the call's, with the step's causal (a sliding window's steps are
    runs, which carry it)."""
    return options._replace(causal=step.causal and step.runs is None).pack()


def _fwd_step(q, k, v, step: _Step, options: OpOptions):
    """(out, lse) of one step's attention: the custom op on the step's rows and keys."""
    qs, ks, vs = q[:, step.rows], k[:, step.keys], v[:, step.keys]
    if step.runs is None:
        return custom_ops.fwd(qs, ks, vs, *_step_options(options, step))
    b, n, h = qs.shape[:3]
    o, lse = custom_ops.fwd(
        *(t.reshape(1, -1, *t.shape[2:]) for t in (qs, ks, vs)), *_step_options(options, step),
        row_keys=step.runs[0], key_rows=step.runs[1],
    )  # fmt: skip
    return o.view(b, n, h, vs.shape[3]), lse[0].view(h, b, n).transpose(0, 1)


def _bwd_step(dout, q, k, v, out, lse, step: _Step, options: OpOptions):
    """(dq, dk, dv) of one step: the backward op with the final output and LSE (exact partials)."""
    r, c = step.rows, step.keys
    args = (dout[:, r], q[:, r], k[:, c], v[:, c], out[:, r])
    if step.runs is None:
        return custom_ops.bwd(*args, lse[:, :, r].contiguous(), *_step_options(options, step))
    b, n, h, _ = args[1].shape
    folded = [t.reshape(1, -1, *t.shape[2:]) for t in args]
    lse_f = lse[:, :, r].transpose(0, 1).reshape(1, h, b * n).contiguous()
    dq, dk, dv = custom_ops.bwd(
        *folded, lse_f, *_step_options(options, step), row_keys=step.runs[0], key_rows=step.runs[1],
    )  # fmt: skip
    return dq.view(args[1].shape), dk.view(args[2].shape), dv.view(args[3].shape)


def _head_groups(
    batch: int, keys: int, heads_q: int, heads_kv: int, device: torch.device
) -> list[tuple[slice, slice]]:
    """The groups of K/V heads (each with its query heads, GQA) the ring runs one after another, as
    (query heads, K/V heads) slices.

    Everything a ring pass holds beyond its inputs scales with its heads: the float32 output (forward) or
    dQ and dK/dV accumulators (backward), the K/V share in flight, and each backward call's fp32 dQ
    workspace and LSE rows. One pass over all heads held about three times the query rows' bytes on top of
    the inputs and set the peak memory (0.84x of one GPU's at 128k tokens, 16/8 heads, on 2 H200s; the bar
    is 0.6x). A pass per group holds one group's worth; the transfers carry the same bytes in all, in
    smaller messages. Up to 4 groups; fewer when a group's calls would leave the GPU short of blocks (a K/V
    head's are its keys / 128, and 4 waves of SMs keep the tail small)."""
    # (On the CPU the fallback's temporaries scale the same way and there are no blocks to keep busy.)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    blocks_per_head = batch * -(-keys // 128)
    count = 1
    for g in range(2, 5):
        if heads_kv % g == 0 and heads_kv // g * blocks_per_head >= 4 * sms:
            count = g
    kv, per = heads_kv // count, heads_q // count
    return [(slice(g * per, (g + 1) * per), slice(g * kv, (g + 1) * kv)) for g in range(count)]


def _send_home(dkv: torch.Tensor, group, rank: int, world: int, hops: int) -> torch.Tensor:
    """After ``hops`` forward hops the accumulators this rank holds belong to rank - hops: send them there
    and receive this rank's own from rank + hops."""
    if hops % world == 0:
        return dkv
    incoming = torch.empty_like(dkv)
    to, frm = (rank - hops) % world, (rank + hops) % world
    ops = [
        dist.P2POp(dist.isend, dkv, dist.get_global_rank(group, to) if group else to, group, 2),
        dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, frm) if group else frm, group, 2),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return incoming


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as the one buffer a ring hop sends: stacked, (2, ...), or, where v has a head_dim of its own,
    side by side along the last dimension (the views :func:`_unpack` gives keep it contiguous, which is all
    the kernels and the fallback ask of a layout)."""
    return torch.stack((k, v)) if k.shape == v.shape else torch.cat((k, v), dim=-1)


def _unpack(kv: torch.Tensor, head_dim: int, packed_pair: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of a :func:`_pack` buffer (``packed_pair``: a stacked one), or of an accumulator laid out so."""
    return (kv[0], kv[1]) if packed_pair else (kv[..., :head_dim], kv[..., head_dim:])


def _ring_forward(q, k, v, steps: list[_Step], options: OpOptions, group, rank: int, world: int):
    """One ring pass of the forward over the heads of q, k, v: (out, lse) in float32. The share in hand is
    sent on as each step starts (the transfer overlaps the step's kernels); each step's part is merged into
    the running result in place (the LSE merge kernel)."""
    batch, local, heads_q, _ = q.shape
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, local), float("-inf"), dtype=torch.float32, device=q.device)
    kv, pair = _pack(k, v), k.shape == v.shape
    for i, step in enumerate(steps):
        reqs, incoming = _exchange(kv, group, rank, world) if i + 1 < len(steps) else ([], None)
        if not step.empty:
            part_out, part_lse = _fwd_step(q, *_unpack(kv, k.shape[3], pair), step, options)
            lse_merge_(out[:, step.rows], lse[:, :, step.rows], part_out, part_lse)
        for req in reqs:
            req.wait()
        if incoming is not None:
            kv = incoming
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, steps: list[_Step], options: OpOptions, group, rank, world):
    """One ring pass of the backward over the heads of its arguments: (dq, dk, dv) in float32.

    The share in hand travels one hop a step, sent as the step starts (overlapping its kernels). Its fp32
    dK/dV accumulator follows one step behind: a step's partial gradients are computed while the
    accumulator of the same share is still on its way from the previous rank, then added to it, and it
    leaves for the next rank while the next step computes. After the last step the accumulators go straight
    home (_send_home: one hop when the ring ran whole)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    d, pair = k.shape[3], k.shape == v.shape
    kv = _pack(k, v)
    acc_reqs, acc, sending = [], None, None
    for i, step in enumerate(steps):
        last = i + 1 == len(steps)
        kv_reqs, next_kv = ([], None) if last else _exchange(kv, group, rank, world)
        grads = None if step.empty else _bwd_step(dout, q, *_unpack(kv, d, pair), out, lse, step, options)
        if grads is not None:
            dq[:, step.rows].add_(grads[0])  # (the add promotes the partial: no float32 temporary)
        for req in acc_reqs:
            req.wait()
        if acc is None:
            acc = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        if grads is not None:
            acc_k, acc_v = _unpack(acc, d, pair)
            acc_k[:, step.keys].add_(grads[1])
            acc_v[:, step.keys].add_(grads[2])
        if not last:
            sending = acc  # (kept referenced until its transfer has been waited on)
            acc_reqs, acc = _exchange(sending, group, rank, world, tag=1)
        for req in kv_reqs:
            req.wait()
        if next_kv is not None:
            kv = next_kv
    del sending, kv
    acc = _send_home(acc, group, rank, world, len(steps) - 1)
    return (dq, *_unpack(acc, d, pair))


class _RingAttention(torch.autograd.Function):
    """Ring attention, one ring pass per group of heads (_head_groups: what a pass holds scales with its
    heads, so the groups bound the peak memory) in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window, options, group, rank, world):
        batch, local, heads_q, _ = q.shape
        steps = _steps(rank, world, causal, window, batch, local, q.device)
        heads = _head_groups(batch, local, heads_q, k.shape[2], q.device)
        out = q.new_empty((*q.shape[:3], v.shape[3]))
        lse = torch.empty((batch, heads_q, local), dtype=torch.float32, device=q.device)
        for qh, kvh in heads:
            shares = q[:, :, qh], k[:, :, kvh], v[:, :, kvh]
            o_g, lse_g = _ring_forward(*shares, steps, options, group, rank, world)
            if sinks is not None:  # a sink joins each row's softmax once, after every share's keys
                o_g, lse_g = apply_sinks(o_g, lse_g, sinks[qh])
            out[:, :, qh], lse[:, qh] = o_g, lse_g
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.steps, ctx.heads, ctx.options = steps, heads, options
        ctx.group, ctx.rank, ctx.world = group, rank, world
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qh, kvh in ctx.heads:
            dq[:, :, qh], dk[:, :, kvh], dv[:, :, kvh] = _ring_backward(
                dout[:, :, qh], q[:, :, qh], k[:, :, kvh], v[:, :, kvh], out[:, :, qh], lse[:, qh], ctx.steps,
                ctx.options, ctx.group, ctx.rank, ctx.world,
            )  # fmt: skip
        # With the sinks in the saved O and LSE the steps' gradients are exact (flash_attention.sinks); the
        # sinks' own is this rank's rows' share of it (a replicated parameter's gradient is then summed
        # over the ranks with the others', as examples/ring_llama.py does).
        dsinks = sinks_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries against every rank's keys and values (context parallelism).

    Args:
        q, k, v: this rank's shares, (batch, seqlen_local, heads, head_dim) as :func:`flash_attention.
            attention` takes them (GQA: heads_q a multiple of heads_kv), the same seqlen_local on every
            rank; with ``causal``, in the zigzag layout of :func:`shard_sequence` (seqlen_local even).
        group: the process group (default: the world).
        causal: causal attention over the whole (unsharded) sequence, bottom-right aligned as everywhere.
        softmax_scale: default 1 / sqrt(head_dim).
        window: a sliding window ``(left, right)`` over the whole sequence, as :func:`flash_attention.
            attention` takes it, on contiguous shares (``shard_sequence(..., zigzag=False)``): each step
            attends through per-row key runs, and a window that sees no later key (causal, or right 0)
            runs only the steps whose shares reach into it, the rest of the ring skipped.
        softcap: > 0 caps the scaled scores, ``softcap * tanh(s / softcap)``, as :func:`flash_attention.
            attention` does (every step's kernels apply it).
        sinks: (heads_q,) attention-sink logits, as :func:`flash_attention.attention` takes them: each
            row's softmax includes its head's sink once (applied after the last step's merge).
            Differentiable; its gradient on each rank is that rank's rows' share, to be summed over the
            ranks like any replicated parameter's.
        return_lse: also return this rank's rows' float32 (batch, heads_q, seqlen_local) LSE.

    ALiBi is not taken: its bias depends on the distance between a query's and a key's positions in the
    whole sequence, and a step's kernels see only the positions within the shares they are given.

    Returns:
        This rank's share of the output (differentiable with respect to q, k and v on every rank: the
        backward runs the same ring), and with ``return_lse`` the LSE.
    """
    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, out=None)
    if q.dtype == torch.float64:
        # The float64 fallback's backward renormalises each row's probabilities over the keys it is given
        # (its LSE is float32), which is right for a whole row and wrong for a share of its keys.
        raise TypeError("ring_attention takes float16, bfloat16 or float32 tensors; got float64")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold equal shares of the sequence; got {q.shape[1]} and {k.shape[1]}")
    window = check_window(window)
    check_score(None, q, softcap=softcap)  # (naming the argument)
    check_sinks(sinks, q)
    rank, world = _group_info(group)
    if causal and window is None and q.shape[1] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards of even length; got {q.shape[1]}")
    # The options every step's ops share (each step sets its own causal: _step_options).
    options = OpOptions(False, problem.scale, score=values_of(softcap=softcap))
    out, lse = _RingAttention.apply(q, k, v, sinks, bool(causal), window, options, group, rank, world)
    return (out, lse) if return_lse else out
