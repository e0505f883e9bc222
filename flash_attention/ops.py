"""The only layer that touches tensors and launches kernels.

It re-checks, at run time, every assumption the compiled kernel makes (dtype, head_dim within the compiled
size, 16-byte aligned rows, strides in range, shared memory that fits this GPU), allocates outputs, picks the
stream and launches through the driver API (flash_attention.jit). Shape and argument validation that the
user sees first lives in flash_attention._validate; this module trusts nothing it could check cheaply.
"""

from __future__ import annotations

import math
import os
from functools import cache
from typing import NamedTuple

import torch

from .configs import KernelConfig, default_config, parse_config
from .jit import compiler as _compiler
from .jit.params import TRACE_FAULTS, FwdParams, TraceLayout

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


@cache
def _device_problem(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        name = torch.cuda.get_device_name(index)
        return f"{name} (sm_{major}{minor}) is older than sm_80, which the kernels' instructions need"
    try:
        from .jit import driver

        driver.libcuda()
    except Exception as exc:  # noqa: BLE001 - any driver failure means the PyTorch path
        return f"the CUDA driver API is unusable: {exc}"
    return None


@cache
def _compiler_problem() -> str | None:
    if _compiler.choose_compiler() is None:
        return "no CUDA compiler was found (NVRTC from PyTorch's CUDA wheels, or nvcc from a CUDA toolkit)"
    return None


def cuda_unavailable_reason(q: torch.Tensor) -> str | None:
    """None when our kernel can run on ``q``'s device and dtype; otherwise why not, in words."""
    if not q.is_cuda:
        return "the tensors are on the CPU"
    if q.dtype not in _DTYPES:
        return f"the kernels take float16 or bfloat16, not {q.dtype}"
    return _device_problem(q.get_device()) or _compiler_problem()


def _dtype_name(t: torch.Tensor) -> str:
    return _DTYPES[t.dtype]


@cache
def smem_limit(device_index: int) -> int:
    from .jit import driver

    return driver.device_attribute(driver.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device_index)


def check_config(cfg: KernelConfig, q: torch.Tensor, head_dim: int, index: int) -> None:
    """Raise ValueError when ``cfg`` cannot compute this problem on this GPU."""
    if cfg.dtype != _dtype_name(q):
        raise ValueError(f"config {cfg.name()} is for {cfg.dtype}, but q is {q.dtype}")
    if head_dim > cfg.head_dim:
        raise ValueError(f"config {cfg.name()} is compiled for head_dim <= {cfg.head_dim}; got {head_dim}")
    limit = smem_limit(index)
    if cfg.smem_bytes > limit:
        raise ValueError(
            f"config {cfg.name()} needs {cfg.smem_bytes} bytes of shared memory per block; "
            f"{torch.cuda.get_device_name(q.device)} allows {limit}"
        )


def _aligned(t: torch.Tensor) -> bool:
    # cp.async and the vector stores move 16 bytes: the base and every row/head/batch start must be
    # 16-byte aligned, i.e. strides multiples of 8 elements.
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:3])


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel can read it in place, else a contiguous copy (correct, one extra pass)."""
    if t.stride(-1) == 1 and _aligned(t) and max(t.stride()[:3]) < 2**62:
        return t
    return t.contiguous()


def _fill_strides(params: FwdParams, prefix: str, t: torch.Tensor) -> None:
    setattr(params, f"{prefix}_batch_stride", t.stride(0))
    setattr(params, f"{prefix}_row_stride", t.stride(1))
    setattr(params, f"{prefix}_head_stride", t.stride(2))


@cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def choose_config(
    dtype: str,
    head_dim: int,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    group: int = 1,
    device: int | None = None,
) -> KernelConfig:
    """The tuned winner for this problem on this GPU if the autotune cache has one, else the heuristic."""
    from . import autotune

    index = torch.cuda.current_device() if device is None else device
    cfg = autotune.lookup(_gpu_name(index), dtype, head_dim, causal, seqlen_q, seqlen_k, group)
    if cfg is not None:
        return cfg
    return default_config(dtype, head_dim, causal, seqlen_q, seqlen_k, device_arch(index))


def device_arch(index: int) -> str:
    from .jit.kernels import device_arch as _arch

    return _arch(index)


def resolve_config(
    config, q: torch.Tensor, causal: bool, seqlen_k: int, scale: float, group: int = 1
) -> KernelConfig:
    """The configuration a call runs: ``config`` if given, else the tuned winner, else the heuristic."""
    head_dim = q.shape[-1]
    if config is None:
        cfg = choose_config(_dtype_name(q), head_dim, causal, q.shape[1], seqlen_k, group, q.get_device())
        if scale < 0 and cfg.opt_softmax:
            # The folded softmax takes the row max of the unscaled scores, which is the scaled scores'
            # max only for a positive scale. The wgmma kernel has only the folded form: the sm80 one runs.
            if cfg.wgmma:
                cfg = default_config(cfg.dtype, head_dim, causal, q.shape[1], seqlen_k)
            cfg = cfg.replace(opt_softmax=False)
        return cfg
    cfg = parse_config(config)
    if scale < 0 and cfg.opt_softmax:
        raise ValueError(
            f"softmax_scale must be positive for config {cfg.name()} (opt_softmax folds the scale into the "
            "exponent after taking the max); use a config without opt_softmax"
        )
    return cfg


def prepare(cfg, causal: bool, device) -> None:
    """Compile (or load from the cache) ``cfg`` for ``device`` ahead of a timed call."""
    from .jit.kernels import get_kernel

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    get_kernel(parse_config(cfg), bool(causal), index)


class TraceTarget(NamedTuple):
    """Which warp the debug build traces (flash_attention.sim.TraceSpec has the same fields)."""

    batch: int
    head: int
    row_block: int
    warp: int


#: The raw trace of the last traced launch (flash_attention.debug decodes it), or None.
_last_trace: dict | None = None


def last_trace() -> dict | None:
    """The last traced launch: its device buffer and everything needed to decode it (see debug.py)."""
    return _last_trace


def trace_from_env() -> tuple[TraceTarget, str] | None:
    """``FLASH_ATTENTION_TRACE=batch,head,row_block,warp`` (and ``FLASH_ATTENTION_TRACE_FAULT``), parsed."""
    text = os.environ.get("FLASH_ATTENTION_TRACE")
    if not text:
        return None
    try:
        target = TraceTarget(*(int(x) for x in text.split(",")))
    except (TypeError, ValueError):
        raise ValueError(
            f"FLASH_ATTENTION_TRACE must be 'batch,head,row_block,warp' (four integers); got {text!r}"
        ) from None
    return target, os.environ.get("FLASH_ATTENTION_TRACE_FAULT", "none")


def _trace_buffer(cfg: KernelConfig, target, fault: str, shape: tuple, device) -> tuple[torch.Tensor, int]:
    """A NaN-filled trace buffer for the debug build (unwritten entries stay NaN), and the fault's code."""
    batch, heads_q, seqlen_q, seqlen_k = shape
    checks = [
        ("batch", target.batch, batch),
        ("head", target.head, heads_q),
        ("row_block", target.row_block, math.ceil(seqlen_q / cfg.block_q)),
        ("warp", target.warp, cfg.num_warps),
    ]
    for name, value, limit in checks:
        if not 0 <= value < limit:
            raise ValueError(f"trace {name} must be in [0, {limit}) for this problem and config; got {value}")
    if fault not in TRACE_FAULTS:
        raise ValueError(f"trace fault must be one of {sorted(TRACE_FAULTS)}; got {fault!r}")
    steps = max(1, math.ceil(seqlen_k / cfg.block_kv))
    buf = torch.full((TraceLayout.of(cfg).size(steps),), float("nan"), dtype=torch.float32, device=device)
    return buf, TRACE_FAULTS[fault]


def cuda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    return_lse: bool,
    out: torch.Tensor | None,
    config=None,
    trace=None,
    trace_fault: str = "none",
    key_range: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel. Inputs were validated by flash_attention._validate.

    ``dropout_p`` > 0 runs the dropout build with the keep mask of ``dropout_seed``
    (:mod:`flash_attention.dropout`).

    ``key_range`` (batch, 2) integers runs the key-padding build: batch row b attends only keys
    ``key_range[b, 0] <= j < key_range[b, 1]`` (clamped in the kernel, so any values are safe).

    ``trace`` (an object with ``batch``, ``head``, ``row_block``, ``warp``, e.g. a
    :class:`flash_attention.sim.TraceSpec`), or the environment variable ``FLASH_ATTENTION_TRACE``, runs
    the debug build instead: that warp's intermediates land in a buffer kept in :func:`last_trace`, and
    ``trace_fault`` (or ``FLASH_ATTENTION_TRACE_FAULT``) plants a known bug. Debugging only: it
    synchronizes and allocates.
    """
    from .jit.kernels import get_kernel

    if trace is None and "FLASH_ATTENTION_TRACE" in os.environ:
        env = trace_from_env()
        if env is not None:
            trace, trace_fault = env

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    cfg = resolve_config(config, q, causal, seqlen_k, softmax_scale, heads_q // heads_kv)
    if trace is not None and cfg.wgmma and config is None:
        # The debug build instruments the sm80 kernel only.
        cfg = default_config(cfg.dtype, head_dim, causal, seqlen_q, seqlen_k)
    if dropout_p and config is None:
        cfg = dropout_config(cfg)
    if heads_q > _MAX_GRID_YZ or batch > _MAX_GRID_YZ:
        raise ValueError(
            f"batch and heads must be at most {_MAX_GRID_YZ}; got batch={batch}, heads={heads_q}"
        )
    if seqlen_q >= 2**31 or seqlen_k >= 2**31:
        raise ValueError("sequence lengths must be below 2**31")
    device = q.device
    index = q.get_device()
    check_config(cfg, q, head_dim, index)

    q_, k_, v_ = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    if out is None:
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        o = out if (out.stride(-1) == 1 and _aligned(out)) else torch.empty_like(q)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=device) if return_lse else None
    if o.numel() == 0:
        if out is not None and o is not out:
            out.copy_(o)
        return (out if out is not None else o), lse

    p = FwdParams()
    p.q, p.k, p.v, p.o = q_.data_ptr(), k_.data_ptr(), v_.data_ptr(), o.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    if key_range is not None:
        if trace is not None:
            raise ValueError("the debug (trace) build does not take key_range")
        # The kernel reads two int32 per batch row, contiguous; kept alive until the launch is queued.
        key_range = key_range.to(device=device, dtype=torch.int32).contiguous()
        p.key_range = key_range.data_ptr()
    _fill_strides(p, "q", q_)
    _fill_strides(p, "k", k_)
    _fill_strides(p, "v", v_)
    _fill_strides(p, "o", o)
    if lse is not None:
        p.lse_batch_stride, p.lse_head_stride = lse.stride(0), lse.stride(1)
    p.batch, p.heads_q, p.heads_kv = batch, heads_q, heads_kv
    p.seqlen_q, p.seqlen_k, p.head_dim = seqlen_q, seqlen_k, head_dim
    p.group = heads_q // heads_kv
    p.num_m_blocks = math.ceil(seqlen_q / cfg.block_q)
    p.scale = softmax_scale
    p.scale_log2 = softmax_scale * _LOG2E
    _fill_dropout(p, dropout_p, dropout_seed)
    if dropout_p and trace is not None:
        raise ValueError("the debug (trace) build does not take dropout")
    trace_buf = None
    if trace is not None:
        trace_buf, p.trace_fault = _trace_buffer(
            cfg, trace, trace_fault, (batch, heads_q, seqlen_q, seqlen_k), device
        )
        p.trace = trace_buf.data_ptr()
        p.trace_batch, p.trace_head = trace.batch, trace.head
        p.trace_m_block, p.trace_warp = trace.row_block, trace.warp

    kernel = get_kernel(
        cfg,
        bool(causal),
        index,
        trace=trace is not None,
        ranged=key_range is not None,
        dropout=bool(dropout_p),
    )
    kernel.ensure_dynamic_smem(cfg.smem_bytes, index)
    stream = torch.cuda.current_stream(device).cuda_stream
    grid = (p.num_m_blocks, heads_q, batch)
    if index == torch.cuda.current_device():
        kernel.launch(grid, (cfg.threads, 1, 1), cfg.smem_bytes, stream, p)
    else:
        # The launch goes to the current context: make it q's device's (PyTorch's primary context).
        with torch.cuda.device(index):
            kernel.launch(grid, (cfg.threads, 1, 1), cfg.smem_bytes, stream, p)
    if trace_buf is not None:
        global _last_trace
        _last_trace = {
            "buffer": trace_buf,
            "config": cfg,
            "target": TraceTarget(trace.batch, trace.head, trace.row_block, trace.warp),
            "fault": trace_fault,
            "causal": bool(causal),
            "shape": (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim),
            "scale": softmax_scale,
        }
    if out is not None and o is not out:
        out.copy_(o)
        o = out
    return o, lse


# ------------------------------------------------------------------------------------------------------
# Backward


def dropout_config(cfg: KernelConfig) -> KernelConfig:
    """The forward config of a dropout call: the hash adds registers, so a tile with two 16-row mma tiles
    per warp (up to 255 registers without dropout) runs with one, instead of spilling."""
    if cfg.block_q // cfg.num_warps > 16:
        return cfg.replace(block_q=cfg.block_q // 2)
    return cfg


def _fill_dropout(p, dropout_p: float, dropout_seed) -> None:
    if not dropout_p:
        return
    from .dropout import dropout_key, dropout_threshold, seed_pair

    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (flash_attention.dropout.draw_seed())")
    p.dropout_key = dropout_key(*seed_pair(dropout_seed))
    p.dropout_threshold = dropout_threshold(dropout_p)
    p.dropout_rp = 1.0 / (1.0 - dropout_p)


def cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,
    key_range: torch.Tensor | None = None,
    config=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of :func:`cuda_forward`'s output, from its output ``out`` and LSE ``lse``.

    Three launches: the preprocessing kernel (delta = rowsum(dout * out), LSE in base 2), the dK/dV kernel
    (with atomic fp32 dQ accumulation, or without in ``deterministic`` mode), then either one cast of the
    dQ workspace or the deterministic dQ kernel. dq/dk/dv are new contiguous tensors of q/k/v's dtype.
    """
    from .configs import default_bwd_config, parse_bwd_config
    from .jit.kernels import get_bwd_kernels
    from .jit.params import BwdParams

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q > _MAX_GRID_YZ or batch > _MAX_GRID_YZ:
        raise ValueError(
            f"batch and heads must be at most {_MAX_GRID_YZ}; got batch={batch}, heads={heads_q}"
        )
    if seqlen_q >= 2**31 or seqlen_k >= 2**31:
        raise ValueError("sequence lengths must be below 2**31")
    if config is None:
        from .autotune_bwd import lookup_bwd

        index = q.get_device()
        cfg = lookup_bwd(
            _gpu_name(index), _dtype_name(q), head_dim, causal, seqlen_q, seqlen_k, heads_q // heads_kv
        )
        if cfg is None:
            cfg = default_bwd_config(_dtype_name(q), head_dim, device_arch(index))
        if cfg.wgmma and (deterministic or key_range is not None or dropout_p):
            # The Hopper kernel has the atomic-dQ, unpadded, dropout-free instantiation only.
            cfg = default_bwd_config(_dtype_name(q), head_dim)
    else:
        cfg = parse_bwd_config(config)
        if cfg.wgmma and (deterministic or key_range is not None or dropout_p):
            raise ValueError(
                f"backward config {cfg.name()} (wgmma) has no deterministic, key-range or dropout build"
            )
    if cfg.dtype != _dtype_name(q) or head_dim > cfg.head_dim:
        raise ValueError(f"backward config {cfg.name()} cannot run {q.dtype} head_dim {head_dim}")
    device, index = q.device, q.get_device()
    limit = smem_limit(index)
    if max(cfg.smem_bytes, cfg.dq_smem_bytes) > limit:
        raise ValueError(
            f"backward config {cfg.name()} needs more shared memory than this GPU allows ({limit})"
        )

    dq = torch.empty(q.shape, dtype=q.dtype, device=device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=device)
    if seqlen_q == 0 or seqlen_k == 0 or heads_q == 0 or batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()

    q_, k_, v_, o_, do_ = (_kernel_ready(t) for t in (q, k, v, out, dout))
    lse_ = lse if lse.stride(-1) == 1 else lse.contiguous()
    seqlen_q_pad = -(-seqlen_q // 128) * 128
    lse_log2 = torch.empty((batch, heads_q, seqlen_q_pad), dtype=torch.float32, device=device)
    delta = torch.empty_like(lse_log2)
    dq_accum = None
    if not deterministic:
        dq_accum = torch.zeros(
            (batch, heads_q, seqlen_q_pad, cfg.head_dim), dtype=torch.float32, device=device
        )

    p = BwdParams()
    p.q, p.k, p.v, p.o, p.dout = (t.data_ptr() for t in (q_, k_, v_, o_, do_))
    p.lse, p.lse_log2, p.delta = lse_.data_ptr(), lse_log2.data_ptr(), delta.data_ptr()
    p.dq_accum = dq_accum.data_ptr() if dq_accum is not None else None
    p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    for prefix, t in (
        ("q", q_),
        ("k", k_),
        ("v", v_),
        ("o", o_),
        ("do", do_),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ):
        _fill_strides(p, prefix, t)
    p.lse_batch_stride, p.lse_head_stride = lse_.stride(0), lse_.stride(1)
    if key_range is not None:
        key_range = key_range.to(device=device, dtype=torch.int32).contiguous()
        p.key_range = key_range.data_ptr()
    p.batch, p.heads_q, p.heads_kv = batch, heads_q, heads_kv
    p.seqlen_q, p.seqlen_k, p.head_dim = seqlen_q, seqlen_k, head_dim
    p.group = heads_q // heads_kv
    p.seqlen_q_pad = seqlen_q_pad
    p.num_m_blocks = math.ceil(seqlen_q / cfg.block_q)
    p.num_n_blocks = math.ceil(seqlen_k / cfg.block_kv)
    p.scale, p.scale_log2 = softmax_scale, softmax_scale * _LOG2E
    _fill_dropout(p, dropout_p, dropout_seed)

    ranged, dropout = key_range is not None, bool(dropout_p)
    kerns = get_bwd_kernels(cfg, index, ranged=ranged, dropout=dropout)
    stream = torch.cuda.current_stream(device).cuda_stream
    kind = "dkdv_det" if deterministic else "dkdv"
    dkdv = kerns[cfg.symbol(kind, causal, ranged, dropout)]
    with torch.cuda.device(index):
        kerns["pre"].launch((seqlen_q_pad // 64, heads_q, batch), (128, 1, 1), 0, stream, p)
        dkdv.ensure_dynamic_smem(cfg.smem_bytes, index)
        grid = (p.num_n_blocks * cfg.split, heads_kv, batch)
        dkdv.launch(grid, (cfg.threads, 1, 1), cfg.smem_bytes, stream, p)
        if deterministic:
            dqk = kerns[cfg.symbol("dq", causal, ranged, dropout)]
            dqk.ensure_dynamic_smem(cfg.dq_smem_bytes, index)
            grid = (p.num_m_blocks * cfg.split, heads_q, batch)
            dqk.launch(grid, (cfg.dq_threads, 1, 1), cfg.dq_smem_bytes, stream, p)
    if dq_accum is not None:
        # The workspace holds scale * dS K already; one cast into q's layout.
        dq.copy_(dq_accum[:, :, :seqlen_q, :head_dim].transpose(1, 2))
    return dq, dk, dv
