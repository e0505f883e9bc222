"""``flash_attention.precompile``: compile, in parallel and before the first call, the kernels that calls of
a given kind will load.

A first call compiles its kernels (a few seconds each, once per machine: they stay in the disk cache). A
model that knows its shapes can pay that up front instead, on every core at once, before training or
serving starts: ``precompile(128, heads_q=32, heads_kv=8, causal=True, training=True)``. The transformers
integration derives the arguments from a model's config (:func:`flash_attention.integrations.transformers.
precompile_model`). The kernels are chosen exactly as the calls will choose them (ops.precompile), for the
length buckets the selection distinguishes, so the calls then load from the cache and compile nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

import torch

from flash_attention.ops.device import KERNEL_DTYPES
from flash_attention.ops.precompile import DeviceFacts, KernelJob, compile_jobs, kernel_jobs, square_lengths
from flash_attention.spec import ScoreSpec
from flash_attention.spec.validate import check_window

__all__ = ["jobs_for_calls", "precompile"]


def precompile(
    head_dim: int | Iterable[int],
    *,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    heads_q: int = 1,
    heads_kv: int | None = None,
    causal: bool | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi: bool = False,
    key_range: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
    deterministic: bool = False,
    varlen: bool = False,
    decode: bool = False,
    decode_queries: Iterable[int] = (1,),
    seqlens: Iterable[int] | None = None,
    device: int | str | torch.device | None = None,
    workers: int | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Compile the kernels that calls of this kind will load; returns their names (those already in the
    cache are read, not rebuilt).

    The arguments say what the calls look like, as ``attention()`` takes them: ``head_dim`` (one or several),
    ``head_dim_v`` (v's head_dim where it is its own, at most ``head_dim``: DeepSeek's 192 / 128), ``dtype``
    (torch.float16 or torch.bfloat16), ``heads_q`` / ``heads_kv`` (their ratio, the query group, picks
    kernels; ``heads_kv`` defaults to ``heads_q``), ``causal`` (None: both), ``window`` (any ``(left,
    right)``: the sliding window's kernels, whatever its size), ``softcap`` (> 0: soft-capped scores),
    ``alibi`` (ALiBi slopes), ``key_range`` (per-row key ranges), ``dropout_p`` (> 0: the dropout kernels).
    ``training`` adds the backward's kernels (``deterministic``: of that mode), ``varlen`` the packed-batch
    (``attention_varlen``) kernels instead of the batched ones, ``decode`` the kernels of
    ``attention_with_kvcache`` for each query count in ``decode_queries``, and those of ``attention()`` with
    that many queries against each length. ``seqlens``: the sequence lengths (default: every length bucket the
    kernel choice distinguishes, 512 to 16k). ``device``: the CUDA device the calls will run on (default: the
    current one), or an architecture such as ``"sm_90"`` to compile on a machine without a GPU (a container
    image's build step, say; the heuristics' kernels then, as the tuned winners of ``autotune`` are kept per
    GPU name). ``workers``: compiles at once (default: one per CPU core). ``dry_run``: name the kernels,
    compile nothing.

    Raises ValueError or TypeError naming the argument that is wrong, and the compiler's error if a compile
    fails (after the others have finished).
    """
    jobs = jobs_for_calls(
        head_dim, head_dim_v=head_dim_v, dtype=dtype, heads_q=heads_q, heads_kv=heads_kv, causal=causal,
        window=window, softcap=softcap, alibi=alibi, key_range=key_range, dropout_p=dropout_p,
        training=training, deterministic=deterministic, varlen=varlen, decode=decode,
        decode_queries=decode_queries, seqlens=seqlens, device=device,
    )  # fmt: skip
    if not dry_run:
        compile_jobs(jobs, workers)
    return [job.describe() for job in jobs]


def jobs_for_calls(
    head_dim: int | Iterable[int],
    *,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    heads_q: int = 1,
    heads_kv: int | None = None,
    causal: bool | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi: bool = False,
    key_range: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
    deterministic: bool = False,
    varlen: bool = False,
    decode: bool = False,
    decode_queries: Iterable[int] = (1,),
    seqlens: Iterable[int] | None = None,
    device: int | str | torch.device | None = None,
) -> list[KernelJob]:
    """:func:`precompile`'s kernels, validated and listed (for callers that gather several kinds of call
    into one parallel compile: the transformers integration's model precompile)."""
    head_dims = _head_dims(head_dim)
    narrowest = min(head_dims)
    if head_dim_v is not None and (
        isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int) or not 1 <= head_dim_v <= narrowest
    ):
        raise ValueError(
            f"head_dim_v must be an int from 1 to head_dim ({narrowest}; no kernel holds a v wider than "
            f"q); got {head_dim_v!r}"
        )
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype}")
    for name, value in (("heads_q", heads_q), ("heads_kv", heads_kv if heads_kv is not None else heads_q)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    heads_kv = heads_q if heads_kv is None else heads_kv
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be True, False or None (both); got {causal!r}")
    window = check_window(window)  # what attention() takes: a (left, right) tuple or list, -1 unbounded
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite float >= 0 (0: none); got {softcap!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: none); got {softcap}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    if varlen and key_range:
        raise ValueError("varlen calls take no key_range (their sequences bound the keys)")
    queries = [_positive("decode_queries", n) for n in decode_queries] if decode else []
    lengths = square_lengths(None if seqlens is None else [_positive("seqlens", n) for n in seqlens])
    # Decoding through attention() itself (a dynamic cache in transformers): few queries against each length.
    lengths += [(n, k) for n in queries for _, k in lengths]
    facts = _facts(device)

    group = heads_q // heads_kv
    dtype_name = KERNEL_DTYPES[dtype]
    base = ScoreSpec.of(softcap=float(softcap), alibi=bool(alibi))
    jobs: list[KernelJob] = []
    for d in head_dims:
        for is_causal in (False, True) if causal is None else (causal,):
            for score in _scores(base, varlen, is_causal):
                jobs += kernel_jobs(
                    facts, dtype_name, d, group, causal=(is_causal,), lengths=lengths,
                    window=window, segments=varlen, score=score, key_range=key_range,
                    dropout=dropout_p > 0, backward=training, deterministic=deterministic,
                    head_dim_v=head_dim_v or 0,
                )  # fmt: skip
        # (the decode kernels take windows, soft-capping and ALiBi at run time: one build per head_dim; none
        # takes v's own head_dim, whose calls run attention()'s kernels, named above)
        jobs += kernel_jobs(facts, dtype_name, d, group, causal=(), lengths=(), decode_rows=[
            n * group for n in queries
        ], head_dim_v=head_dim_v or 0)  # fmt: skip
    return list(dict.fromkeys(jobs))


def _head_dims(head_dim: int | Iterable[int]) -> list[int]:
    dims = [head_dim] if isinstance(head_dim, int) and not isinstance(head_dim, bool) else head_dim
    try:
        dims = list(dims)
    except TypeError:
        raise TypeError(f"head_dim must be an int or an iterable of ints; got {head_dim!r}") from None
    if not dims:
        raise ValueError("head_dim must name at least one head dimension")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 256:
            raise ValueError(f"head_dim must be an int from 1 to 256; got {d!r}")
    return dims


def _positive(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must hold positive ints; got {n!r}")
    return n


def _scores(base: ScoreSpec, varlen: bool, causal: bool) -> list[ScoreSpec]:
    """The score functions of calls with ``base`` (spec.validate.score_spec): a packed batch's ALiBi measures
    from its sequences' runs (causal) or its rows (not), or from a table of diagonals when its queries and
    keys are packed differently; with a slope per sequence, each form with ``alibi_rows``."""
    if not varlen or not base.alibi:
        return [base]
    # (and each with a slope per sequence: flash_attention.api.varlen's (batch, heads_q) slopes)
    forms = [replace(base, alibi_origin=origin) for origin in ("runs" if causal else "diagonal", "table")]
    return forms + [replace(form, alibi_rows=True) for form in forms]


def _facts(device: int | str | torch.device | None) -> DeviceFacts:
    if isinstance(device, str) and device.startswith("sm_"):
        return DeviceFacts.of_arch(device)
    if not torch.cuda.is_available():
        raise ValueError(
            "device: no CUDA GPU here; name the architecture the kernels are for instead (device='sm_90' for "
            "an H100/H200, 'sm_80' for an A100)"
        )
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device or an architecture such as 'sm_90'; got {device!r}")
    return DeviceFacts.of_device(dev.index if dev.index is not None else torch.cuda.current_device())
