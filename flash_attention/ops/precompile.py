"""The kernels a family of calls will load, worked out without the calls, and compiled ahead of them.

A call chooses its kernels from its dtype, head_dim, lengths, query group, mask and score function and the
GPU (:func:`select.forward_config`, :func:`select.backward_config`, ``configs.decode``); the kernels it then
loads are (config, architecture, build variant) triples that :func:`jit.cache.build` compiles into the disk
cache. :func:`kernel_jobs` asks the same selection functions about calls described by those facts alone
(no tensors), over the length buckets the heuristics and tuned winners distinguish, so that
:func:`compile_jobs` can compile what the calls will need, in parallel, before the first one comes
(``flash_attention.precompile``). What a job list cannot foresee (a named ``config=``, a negative scale, the
debug build, tensors whose layout the TMA loads cannot map) is left to the call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flash_attention.configs.architectures import architecture
from flash_attention.configs.decode import default_decode_config
from flash_attention.jit import cache as jit_cache
from flash_attention.jit.sources import SEGMENTS
from flash_attention.ops import winners
from flash_attention.spec import NO_SCORE, AttentionSpec, ScoreSpec

from .plans import feature_list, kernel_build, window_bounds
from .select import NoKernel, backward_config, forward_config, value_dim_backward_config
from .tensors import padded_to_8

__all__ = ["DeviceFacts", "KernelJob", "compile_jobs", "kernel_jobs"]


@dataclass(frozen=True)
class DeviceFacts:
    """What kernel selection reads from a GPU: its architecture (``"sm_90"``), its name (the tuned winners'
    key; "" for none), the shared memory a block may opt into, and its multiprocessor count."""

    arch: str
    gpu: str
    smem_limit: int
    sm_count: int

    @staticmethod
    def of_device(index: int) -> DeviceFacts:
        from .device import device_arch, gpu_name, sm_count, smem_limit

        return DeviceFacts(device_arch(index), gpu_name(index), smem_limit(index), sm_count(index))

    @staticmethod
    def of_arch(arch: str, gpu: str = "") -> DeviceFacts:
        """An architecture's facts without its GPU (the compile needs none): its opt-in shared memory and a
        typical multiprocessor count."""
        facts = architecture(arch)
        return DeviceFacts(arch, gpu, facts.smem_optin, facts.sm_count)


@dataclass(frozen=True)
class KernelJob:
    """One translation unit a call loads: a config, the architecture and :func:`jit.cache.build`'s variant."""

    cfg: object
    arch: str
    ranged: bool = False
    dropout: bool = False
    window: bool | str = False
    score: str | None = None

    def variant(self) -> dict:
        return dict(ranged=self.ranged, dropout=self.dropout, window=self.window, score=self.score)

    def describe(self) -> str:
        parts = [n for n, on in (("key_range", self.ranged), ("dropout", self.dropout)) if on]
        if self.window:
            parts.append("segments" if self.window == SEGMENTS else "window")
        if self.score:
            parts.append(self.score)
        return f"{self.cfg.name()}" + (f" [{'+'.join(parts)}]" if parts else "")


def kernel_jobs(
    facts: DeviceFacts,
    dtype: str,
    head_dim: int,
    group: int,
    *,
    causal: Iterable[bool],
    lengths: Iterable[tuple[int, int]],
    window: tuple[int, int] | None = None,
    segments: bool = False,
    score: ScoreSpec = NO_SCORE,
    key_range: bool = False,
    dropout: bool = False,
    backward: bool = False,
    deterministic: bool = False,
    decode_rows: Iterable[int] = (),
    head_dim_v: int = 0,
) -> list[KernelJob]:
    """The kernels of calls with these facts, in order and without repeats: for each causal flag and
    (seqlen_q, seqlen_k) in ``lengths``, the forward's, and with ``backward`` the backward's (both
    gradient modes' share a translation unit; ``deterministic`` picks the deterministic mode's config where
    it differs); then, for each of ``decode_rows`` (seqlen_q x group of a decode call), the decode kernels of
    a grid that fills the GPU and of one that splits its keys. ``window``: as attention() takes it; at a
    length where it bounds nothing the calls run the plain build, as here (ops.plans.window_bounds). A
    packed batch's (``segments``) window is carried by its runs. ``score``: the calls' score function
    (spec.ScoreSpec: its build is the kernels'). Lengths a kernel cannot run (a GPU without the shared
    memory) are skipped: the call would fall back the same way. ``head_dim_v``: v's head_dim where it is
    its own (0: head_dim's): the forward reading it, and the backward kernel reading it where one does
    (select.value_dim_backward_config), else q's head_dim's (the calls pad v); no decode kernel takes it
    (its calls run attention()'s kernels)."""
    d = padded_to_8(head_dim)
    dv = head_dim_v if head_dim_v and head_dim_v != head_dim else 0
    device = dict(arch=facts.arch, gpu=facts.gpu, smem_limit=facts.smem_limit)
    jobs: list[KernelJob] = []
    for is_causal in causal:
        for seqlen_q, seqlen_k in lengths:
            windowed = not segments and window_bounds(window, is_causal, seqlen_q, seqlen_k) is not None
            flags = dict(
                key_range=key_range, dropout=dropout, window=windowed, segments=segments,
                **score.features,
            )  # fmt: skip
            # (the spec of the calls these facts describe: their build is kernel_build's, as a call's is)
            spec = AttentionSpec(
                is_causal,
                1.0,
                window,
                score,
                key_range,
                0.5 if dropout else 0.0,
                segments=2 if segments else 0,
            )
            variant = kernel_build(spec, seqlen_q, seqlen_k).variant
            try:
                fwd = forward_config(
                    dtype, d, is_causal, seqlen_q, seqlen_k, group, **device, features=feature_list(**flags),
                    head_dim_v=padded_to_8(dv) if dv else 0,
                )  # fmt: skip
            except NoKernel:
                continue
            jobs.append(KernelJob(fwd, facts.arch, **variant))
            if backward:
                native = dv and value_dim_backward_config(
                    dtype, d, dv, is_causal, facts.arch, dropout, deterministic
                )
                try:
                    bwd = native or backward_config(
                        dtype, d, is_causal, seqlen_q, seqlen_k, group, **device,
                        features=feature_list(**flags, deterministic=deterministic),
                    )  # fmt: skip
                except NoKernel:
                    continue
                jobs.append(KernelJob(bwd, facts.arch, **variant))
    for rows in decode_rows if not dv else ():
        jobs.append(KernelJob(default_decode_config(dtype, d, rows, facts.arch), facts.arch))
    return list(dict.fromkeys(jobs))


def square_lengths(seqlens: Iterable[int] | None) -> list[tuple[int, int]]:
    """(n, n) for each of ``seqlens``, by default every length bucket the selection distinguishes."""
    return [(n, n) for n in (winners.SEQLEN_BUCKETS if seqlens is None else seqlens)]


def compile_jobs(jobs: list[KernelJob], workers: int | None = None) -> list[jit_cache.BuiltKernel]:
    """Compile ``jobs`` into the disk cache (entries already there are read, not rebuilt), ``workers`` at a
    time (default: one per CPU core, at most the job count); each compile says so on one line as it starts
    and ends (jit.cache). Raises the first compile error after the others have finished."""
    if not jobs:
        return []
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flash_attention precompile") as pool:
        futures = [pool.submit(jit_cache.build, job.cfg, job.arch, **job.variant()) for job in jobs]
    return [f.result() for f in futures]
