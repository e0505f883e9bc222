"""``bench --progression``: what each optimisation step of the kernel buys on the GPU at hand (with ``--mode
fwd_bwd``: the backward's steps, timed alone).

The steps follow the project this one descends from, as far as our configuration knobs express them. Each
step changes one thing from the previous one, so a row's gain is that change's.
"""

from __future__ import annotations

import torch

from flash_attention import ops
from flash_attention.api import attention as interface
from flash_attention.configs import (
    BwdConfig,
    KernelConfig,
    default_bwd_config,
    hopper_bwd_config,
    padded_head_dim,
    portable_config,
    ws_config,
)
from flash_attention.configs.heuristics import classic_hopper_config

from ..common import flops, time_cuda


def progression_configs(
    dtype: str, head_dim: int, causal: bool, seqlen: int, tuned: KernelConfig
) -> list[tuple[str, KernelConfig]]:
    """The steps, each a (label, config) pair; ``tuned`` is what ``attention()`` runs at this shape."""
    d = padded_head_dim(head_dim)
    # The ancestor's tile: 64 query rows over 4 warps, 64 keys per K/V block, Q held in registers, K and V
    # fed to the tensor cores one 16-wide slice at a time.
    base = KernelConfig(
        dtype,
        d,
        64,
        64,
        4,
        async_copy=False,
        eager=False,
        swizzle=False,
        q_frags=0 if d <= 128 else 1,
        k_frags=1,
        v_frags=1,
        double_buffer=False,
        opt_softmax=False,
    )
    steps = [("plain: sync copies, no swizzle", base)]
    steps.append(("swizzled shared memory", steps[-1][1].replace(swizzle=True)))
    steps.append(("cp.async copies", steps[-1][1].replace(async_copy=True)))
    steps.append(("eager K/V loading", steps[-1][1].replace(eager=True)))
    steps.append(("fragment interleaving (2 slices per load)", steps[-1][1].replace(k_frags=2, v_frags=2)))
    steps.append(("double-buffered fragment loads", steps[-1][1].replace(double_buffer=True)))
    steps.append(("exp2-folded softmax", steps[-1][1].replace(opt_softmax=True)))
    if tuned.wgmma:
        # On Hopper the later steps are other kernels: the sm80 one as tuned, the wgmma kernel fed by
        # cp.async, then the warp-specialized kernel one technique at a time (docs/kernel-log.md, steps
        # 25-35), ending with what attention() runs.
        steps.append(("tuned sm80 kernel", portable_config(dtype, head_dim, causal, seqlen, seqlen)))
        steps.append(
            ("wgmma, cp.async, tuned (sm90 kernel)", classic_hopper_config(dtype, d, seqlen, causal))
        )
        if tuned.warp_specialized:
            steps += _warp_specialized_steps(dtype, d, tuned)
        steps.append(("tuned (what attention() runs)", tuned))
    else:
        steps.append(("tuned (what attention() runs)", tuned))
    return steps


def _warp_specialized_steps(dtype: str, d: int, tuned: KernelConfig) -> list[tuple[str, KernelConfig]]:
    """The warp-specialized kernel's techniques added one at a time on two consumer warpgroups (ping-pong
    needs two) over one key tile: the tuned config's (128 keys where it has three consumers), or the
    largest below it that leaves room for the persistent grid's output buffer."""
    first = tuned.block_kv if tuned.block_q == 128 else 128
    for block_kv in [first] + [n for n in (128, 112, 96, 80, 64, 48, 32) if n < first]:
        try:
            ws_config(dtype, d, 128, block_kv, 2, pingpong=True, overlap=True, persistent=True)
            break
        except ValueError:
            continue
    knobs = [
        ("TMA loads, producer + 2 consumer warpgroups", {}),
        ("+ ping-pong between the consumers", dict(pingpong=True)),
        ("+ intra-warpgroup overlap (S_j+1 under softmax_j)", dict(pingpong=True, overlap=True)),
        ("+ persistent grid, tiles taken dynamically", dict(pingpong=True, overlap=True, persistent=True)),
        ("+ output through TMA stores", dict(pingpong=True, overlap=True, persistent=True, tma_store=True)),
        (
            "+ epilogue under next tile's S (no ping-pong)",
            dict(overlap=True, persistent=True, tma_store=True, tile_overlap=True),
        ),
    ]
    steps = []
    for label, kw in knobs:
        try:
            steps.append((label, ws_config(dtype, d, 128, block_kv, 2, **kw)))
        except ValueError:  # tile_overlap's second Q buffer does not fit beside head_dim 256's tiles
            continue
    return steps


def run_progression(dtype: str, head_dims, seqlens, causals, timing: dict) -> list[dict]:
    rows = []
    for d in head_dims:
        for causal in causals:
            for n in seqlens:
                batch, heads = max(1, 16384 // n), max(1, 2048 // d)
                dt = torch.bfloat16 if dtype == "bf16" else torch.float16
                q = torch.randn(batch, n, heads, d, device="cuda", dtype=dt)
                k, v = torch.randn_like(q), torch.randn_like(q)
                fl = flops(batch, heads, n, n, d, causal, "fwd")
                prev = first = None
                print(
                    f"\nprogression: {dtype} head_dim {d} {'causal' if causal else 'non-causal'} seqlen {n}"
                )
                print(f"  {'step':44} {'TFLOP/s':>8} {'step gain':>9} {'total':>7}  config")
                tuned = ops.chosen_config(q, k, causal=causal, softmax_scale=d**-0.5)

                def row(step, config, ms, tf, d=d, causal=causal, n=n):
                    return dict(step=step, config=config, dtype=dtype, head_dim=d, causal=causal, seqlen=n,
                                ms=ms, tflops=round(tf, 2))  # fmt: skip

                for label, cfg in progression_configs(dtype, d, causal, n, tuned):
                    t = time_cuda(
                        lambda i, cfg=cfg, q=q, k=k, v=v, c=causal: interface.forward(cfg, q, k, v, causal=c),
                        1,
                        **timing,
                    )
                    tf = fl / (t.ms * 1e9)
                    first = first or tf
                    gain = f"{tf / prev:.2f}x" if prev else ""
                    print(f"  {label:44} {tf:8.1f} {gain:>9} {tf / first:6.2f}x  {cfg.name()}", flush=True)
                    rows.append(row(label, cfg.name(), t.ms, tf))
                    prev = tf
                # PyTorch's own kernels on the same inputs, cuDNN (sdpa's default on Hopper) first.
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                f = torch.nn.functional.scaled_dot_product_attention
                call = lambda i, f=f, qt=qt, kt=kt, vt=vt, c=causal: f(qt, kt, vt, is_causal=c)  # noqa: E731
                for name, t in _sdpa_references(lambda call=call: call, timing, 44):
                    tf = fl / (t.ms * 1e9)
                    print(f"  {'(reference) ' + name:44} {tf:8.1f}   ours/{name} {prev / tf:.2f}x")
                    rows.append(row(name, None, t.ms, tf))
    return rows


def _sdpa_references(make_call, timing: dict, width: int):
    """(name, timing) of ``make_call()``'s call (made inside the backend's context) on cuDNN, then
    FlashAttention-2, skipping (with a line saying why) a backend this GPU or build lacks."""
    backends = torch.nn.attention.SDPBackend
    for name, backend in (("sdpa_cudnn", backends.CUDNN_ATTENTION), ("sdpa_flash", backends.FLASH_ATTENTION)):
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                t = time_cuda(make_call(), 1, **timing)
        except RuntimeError as exc:
            print(f"  {'(reference) ' + name:{width}} unavailable: {str(exc).splitlines()[0][:60]}")
            continue
        yield name, t


# ---- the backward ------------------------------------------------------------------------------------------


def backward_progression_configs(
    dtype: str, head_dim: int, arch: str, tuned: BwdConfig
) -> list[tuple[str, BwdConfig, bool]]:
    """The backward's steps, each (label, config, deterministic); ``tuned`` is what a training call runs at
    this shape. The portable kernel first (the ancestor's backward: dK/dV per key block, dQ by atomics),
    then on Hopper the kernels that replaced it (docs/kernel-log.md, steps 44-45, 75-78), then the
    deterministic mode, on the portable pair and on the Hopper kernel's turn-taking form."""
    d = padded_head_dim(head_dim)
    portable = default_bwd_config(dtype, d, arch, portable=True)
    steps = [("portable (sm80) dK/dV kernel, dQ by atomics", portable, False)]
    if tuned.wgmma:
        if d <= 128:
            steps.append(
                ("wgmma, cp.async (sm90 kernel)", hopper_bwd_config(dtype, d, warp_specialized=False), False)
            )
            steps.append(
                ("warp-specialized: loads, dQ by 16 KB bulk adds", hopper_bwd_config(dtype, d), False)
            )
        else:
            steps.append(("wgmma, one accumulator per warpgroup (wide)", hopper_bwd_config(dtype, d), False))
    if steps[-1][1] != tuned:
        steps.append(("tuned (what training runs)", tuned, False))
    steps.append(("deterministic: portable dK/dV + dQ kernels", portable, True))
    if tuned.wgmma:
        steps.append(("deterministic: dQ adds in turns (Hopper)", tuned, True))
    return steps


def run_backward_progression(dtype: str, head_dims, seqlens, causals, timing: dict) -> list[dict]:
    """The backward alone (preprocessing, dK/dV, dQ's cast or kernel) at each step, against the backward
    of PyTorch's own kernels (autograd of scaled_dot_product_attention on the same inputs)."""
    from flash_attention.ops.plans import device_facts

    facts = device_facts(torch.cuda.current_device())
    rows = []
    for d in head_dims:
        for causal in causals:
            for n in seqlens:
                rows += _backward_shape(dtype, d, causal, n, facts, timing)
    return rows


def _backward_shape(dtype: str, d: int, causal: bool, n: int, facts: dict, timing: dict) -> list[dict]:
    from flash_attention.ops import backward_config

    batch, heads = max(1, 16384 // n), max(1, 2048 // d)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q, k, v, do = (torch.randn(batch, n, heads, d, device="cuda", dtype=dt) for _ in range(4))
    scale = d**-0.5
    o, lse = ops.cuda_forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=None)
    fl = flops(batch, heads, n, n, d, causal, "bwd")
    print(f"\nbackward progression: {dtype} head_dim {d} {'causal' if causal else 'non-causal'} seqlen {n}")
    print(f"  {'step':48} {'TFLOP/s':>8} {'step gain':>9} {'total':>7}  config")
    tuned = backward_config(dtype, padded_head_dim(d), causal, n, n, 1, **facts, features=(), config=None)

    def row(step, config, ms, tf, det=False):
        return dict(step=step, config=config, deterministic=det, dtype=dtype, head_dim=d, causal=causal,
                    seqlen=n, ms=ms, tflops=round(tf, 2))  # fmt: skip

    def ours(cfg, det):
        return lambda i: ops.cuda_backward(
            do, q, k, v, o, lse, causal=causal, softmax_scale=scale, config=cfg, deterministic=det
        )

    rows = []
    prev = first = None
    for label, cfg, det in backward_progression_configs(dtype, d, facts["arch"], tuned):
        t = time_cuda(ours(cfg, det), 1, **timing)
        tf = fl / (t.ms * 1e9)
        first = first or tf
        gain = f"{tf / prev:.2f}x" if prev else ""
        print(f"  {label:48} {tf:8.1f} {gain:>9} {tf / first:6.2f}x  {cfg.name()}", flush=True)
        rows.append(row(label, cfg.name(), t.ms, tf, det))
        if not det:
            prev = tf
    # PyTorch's own backward on the same inputs, cuDNN (sdpa's default on Hopper) first.
    leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    dot = do.transpose(1, 2)

    def backward_call():
        # The backend's forward, once; its backward is what is timed.
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        return lambda i: torch.autograd.grad(out, leaves, dot, retain_graph=True)

    for name, t in _sdpa_references(backward_call, timing, 48):
        tf = fl / (t.ms * 1e9)
        print(f"  {'(reference) ' + name:48} {tf:8.1f}   ours/{name} {prev / tf:.2f}x")
        rows.append(row(name, None, t.ms, tf))
    return rows
