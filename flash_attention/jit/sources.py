"""KernelConfig / BwdConfig -> the text of one translation unit, and the names of its entry points.

A translation unit is the kernel header of the config's family, the ``static_assert``s that pin the params
struct to its ctypes twin (jit/params.py), the config's struct of named constants and one ``extern "C"``
entry point per instantiation (causal and not; the key-range, dropout and debug builds are separate units
with their own entry-point suffixes, compiled only when a call first needs them).
"""

from __future__ import annotations

import itertools

from ..configs import BwdConfig, KernelConfig
from ..configs.decode import DecodeConfig
from ..configs.fp8_cast import FP8_CAST_SOURCES, Fp8CastConfig
from ..configs.merge import MERGE_PART_DTYPES, MergeConfig
from ..configs.values_transpose import KEY_ORDER_16, VALUES_TRANSPOSE_HEAD_DIMS, ValuesTransposeConfig
from ..spec import score_builds
from .params import (
    BwdParams,
    BwdTmaParams,
    DecodeParams,
    Fp8CastParams,
    FwdParams,
    FwdTmaParams,
    LseMergeParams,
    ValuesTransposeParams,
    offset_asserts,
    trace_layout_asserts,
)

__all__ = [
    "bwd_kernel_source",
    "decode_kernel_source",
    "fp8_cast_kernel_source",
    "kernel_source",
    "kernel_symbol",
    "mask_causals",
    "merge_kernel_source",
    "values_transpose_kernel_source",
    "variant_name",
    "variant_type",
]

KERNEL_HEADER = "fwd/fwd_kernel.cuh"


def _cpp_bool(x: bool) -> str:
    return "true" if x else "false"


#: The ``window`` value of the segments build: per-row key runs of a packed batch (varlen), whose arrays
#: carry causal and any window (fa/visible_keys.cuh, SegmentKeys). ``window`` is otherwise a bool (True:
#: the sliding-window build); both are "mask builds" with one entry point.
SEGMENTS = "segments"


def variant_type(causal: bool, ranged: bool, window: bool | str = False, score: str | None = None) -> str:
    """The C++ variant (csrc/include/fa/variant.cuh) a kernel body is instantiated with: the mask policy of
    the causal flag and the per-batch key ranges, of a sliding window (which carries causal as its right
    bound 0) and the key ranges, or of segments (``window=SEGMENTS``); and the score function. A new variant
    is a new policy type named here (docs/design.md, "Adding an attention variant")."""
    if window == SEGMENTS and ranged:
        raise ValueError("the segments build takes no key ranges (its runs carry them)")
    if score is not None:
        if score not in SCORE_MODS:
            raise ValueError(f"score must be one of {tuple(SCORE_MODS)} or None; got {score!r}")
        if window == SEGMENTS:
            mask = "fa::SegmentMask"
        elif window:
            mask = f"fa::WindowMask<{_cpp_bool(ranged)}>"
        else:
            mask = f"fa::CausalRangeMask<{_cpp_bool(causal)}, {_cpp_bool(ranged)}>"
        return f"fa::Variant<{mask}, {SCORE_MODS[score]}>"
    if window == SEGMENTS:
        return "fa::Variant<fa::SegmentMask, fa::NoScoreMod>"
    if window:
        return f"fa::WindowVariant<{_cpp_bool(ranged)}>"
    return f"fa::DefaultVariant<{_cpp_bool(causal)}, {_cpp_bool(ranged)}>"


#: The score functions a build can take (csrc/include/fa/variant.cuh): name -> C++ policy, both made from a
#: spec.ScoreSpec's features (spec.score_builds): the scalar functions of spec.score_functions joined in
#: that table's order, then "alibi" (its bias added after them); "..._runs" measures ALiBi from each query
#: row's run end (a packed batch of causal sequences), "..._table" from each row's entry of a table of
#: diagonals (a packed batch without causal whose query and key counts differ); all segments builds only.
#: A "_rows" suffix reads a slope per query row (a packed batch whose sequences have slopes of their own;
#: "alibi_rows": the packed row's own index, as "alibi" on segments).
SCORE_MODS = score_builds()


def mask_causals(window: bool | str) -> tuple[bool, ...]:
    """The causal flags a build has entry points for: both, or (a sliding window, whose bounds include
    causal) one, named as not causal."""
    return (False,) if window else (False, True)


def variant_name(
    trace: bool, ranged: bool, dropout: bool = False, window: bool | str = False, score: str | None = None
) -> str:
    """The instantiation's suffix: "" (normal), "trace", or the build's features joined by "__" in the order
    "window", the score function (spec.ScoreSpec.build), "ranged", "dropout"."""
    if trace and (ranged or dropout or window or score):
        raise ValueError(
            "the debug (trace) build has no key-range, dropout, window or score-function variant"
        )
    if trace:
        return "trace"
    mask = SEGMENTS if window == SEGMENTS else "window"
    parts = ((mask, bool(window)), (score or "", score is not None), ("ranged", ranged), ("dropout", dropout))
    return "__".join(x for x, on in parts if on)


def kernel_symbol(
    cfg: KernelConfig,
    causal: bool,
    trace: bool = False,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> str:
    """Entry point name. The debug build's carries a ``__trace`` suffix (so a profiler tells them apart),
    the per-batch key-range build's ``__ranged``, the dropout build's ``__dropout``, the sliding window's
    ``__window``, a score function's its name."""
    variant = variant_name(trace, ranged, dropout, window, score)
    return cfg.symbol(causal) + (f"__{variant}" if variant else "")


def kernel_source(
    cfg: KernelConfig,
    trace: bool = False,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> str:
    """The translation unit of one config: its constants and the causal / non-causal entry points.

    ``trace=True`` is the debug build (csrc/include/fa/trace.cuh) of the sm80 or the warp-specialized kernel
    (the sm90 kernel has none): FA_TRACE=1 and the trace buffer's layout pinned to jit/params.py.
    ``ranged=True`` is the key-padding build (per-batch key ranges), compiled only when a call first needs
    it. ``window=True`` is the sliding-window build (one entry point: the window carries causal). Their texts
    differ from the normal build's, so do their cache keys.
    """
    if isinstance(cfg, BwdConfig):
        return bwd_kernel_source(cfg, ranged=ranged, dropout=dropout, window=window, score=score)
    if isinstance(cfg, DecodeConfig):
        return decode_kernel_source(cfg)
    if isinstance(cfg, MergeConfig):
        return merge_kernel_source(cfg)
    if isinstance(cfg, ValuesTransposeConfig):
        return values_transpose_kernel_source(cfg)
    if isinstance(cfg, Fp8CastConfig):
        return fp8_cast_kernel_source(cfg)
    variant = variant_name(trace, ranged, dropout, window, score)
    if trace and cfg.wgmma and not cfg.warp_specialized:
        raise ValueError(
            "the debug (trace) build exists for the sm80 kernel and the warp-specialized Hopper kernel only; "
            "pick a config without wgmma or with ws"
        )
    # The wgmma kernel's body lives in namespace fa::sm90; each entry point may hold two blocks per
    # multiprocessor (the register budget that leaves is 255 at 128 threads, 128 at 256). The
    # warp-specialized one runs one block per multiprocessor (its registers are split between roles with
    # setmaxnreg, which needs the block's budget fixed) and takes the tensor maps with its params.
    if cfg.warp_specialized:
        body, params, bounds = "fa::sm90::fwd_ws_body", "fa::FwdTmaParams", f"{cfg.threads}, 1"
        header = "sm90/fwd_ws/fwd_kernel.cuh"
    else:
        body = "fa::sm90::fwd_kernel_body" if cfg.wgmma else "fa::fwd_kernel_body"
        params, bounds = "fa::FwdParams", f"{cfg.threads}"
        header = f"{'sm90' if cfg.wgmma else 'sm80'}/{KERNEL_HEADER}"
    entries = []
    for causal in mask_causals(window):
        entries.append(
            f'extern "C" __global__ void __launch_bounds__({bounds})\n'
            f"{kernel_symbol(cfg, causal, trace, ranged=ranged, dropout=dropout, window=window, score=score)}"
            f"(const __grid_constant__ {params} p) {{\n"
            f"  {body}<Cfg, {variant_type(causal, ranged, window, score)}, {_cpp_bool(dropout)}>(p);\n}}\n"
        )
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}{f' ({variant} build)' if variant else ''}\n"
        + ("#define FA_TRACE 1\n" if trace else "")
        + f'#include "{header}"\n\n'
        + offset_asserts(FwdParams, "fa::FwdParams")
        + (offset_asserts(FwdTmaParams, "fa::FwdTmaParams") if cfg.warp_specialized else "")
        + "\n"
        + cfg.cpp_struct("Cfg")
        + (trace_layout_asserts(cfg) if trace else "")
        + "\n"
        + "\n".join(entries)
    )


#: The backward entry points' grid-dependency calls (fa/grid_dependency.cuh; no-ops before sm_90).
_WAIT_PREVIOUS = "  fa::grid_dependency_wait();\n"
_ALLOW_NEXT = "  fa::allow_dependent_launch();\n"


def bwd_kernel_source(
    cfg: BwdConfig,
    *,
    ranged: bool = False,
    dropout: bool = False,
    window: bool | str = False,
    score: str | None = None,
) -> str:
    """The translation unit of one backward config: the preprocessing kernel, the cast of the dQ workspace
    and, for causal and not, the dK/dV kernel with atomic dQ, the one without (deterministic mode) and the
    deterministic dQ kernel. ``ranged=True``: the per-batch key-range instantiations instead (key padding)."""
    # The three launches' grid dependencies (fa/grid_dependency.cuh): the launch layer may queue the second
    # and third programmatically on Hopper (ops.backward's launches), so each of them waits for the one
    # before it at its start, before any memory access (the warp-specialized dK/dV kernel waits itself,
    # after loading what does not come from the preprocessing kernel); the first two let their successor
    # be scheduled from their own start.
    entries = [
        f'extern "C" __global__ void __launch_bounds__(128)\n'
        f"{cfg.symbol('pre')}(const __grid_constant__ fa::BwdParams p) {{\n"
        f"{_ALLOW_NEXT}  fa::bwd_preprocess_body<Cfg>(p);\n}}\n",
        f'extern "C" __global__ void __launch_bounds__(128)\n'
        f"{cfg.symbol('convert')}(const __grid_constant__ fa::BwdParams p) {{\n"
        f"{_WAIT_PREVIOUS}  fa::bwd_convert_dq_body<Cfg>(p);\n}}\n",
    ]
    if cfg.wgmma:
        # The Hopper family: the mask-free kernels and the atomic-dQ dK/dV kernel, nothing else; the
        # warp-specialized and wide ones also have the key-range build (their mask policy's q_blocks and
        # mask_key_rows) and the dropout build.
        if (dropout or ranged or window or score) and not (cfg.warp_specialized or cfg.wide):
            raise ValueError(
                "the sm90 wgmma backward has no key-range, dropout or window build; use its warp-specialized "
                "form or an sm80 config"
            )
        # The warp-specialized form: one block per multiprocessor, whose launch allocation setmaxnreg
        # divides between producer and consumers.
        if cfg.wide_ws:
            body, header = "fa::sm90::bwd_wide_ws_dkdv_body", "sm90/bwd_wide_ws/bwd_kernel.cuh"
        elif cfg.warp_specialized:
            body, header = "fa::sm90::bwd_ws_dkdv_body", "sm90/bwd_ws/bwd_kernel.cuh"
        elif cfg.wide:
            body, header = "fa::sm90::bwd_wide_dkdv_body", "sm90/bwd_wide/bwd_kernel.cuh"
        else:
            body, header = "fa::sm90::bwd_dkdv_body", "sm90/bwd/bwd_kernel.cuh"
        # With tma_loads the dK/dV kernels take BwdTmaParams (q's and dO's tensor maps after the BwdParams,
        # which the maps' TMA loads address in the parameter space).
        params, args = ("fa::BwdParams p", "p")
        if cfg.tma_loads:
            params, args = ("fa::BwdTmaParams tp", "tp.p, &tp.q_map, &tp.do_map")
        for causal, kind in itertools.product(mask_causals(window), cfg.entry_kinds()):
            targs = f"Cfg, {variant_type(causal, ranged, window, score)}"
            if cfg.warp_specialized:
                targs += f", {_cpp_bool(dropout)}, {_cpp_bool(kind == 'dkdv_det')}"
                if cfg.tma_loads:
                    targs += ", true" + (", true" if cfg.dq_writer else "")
            elif cfg.wide:
                targs += f", {_cpp_bool(dropout)}, {_cpp_bool(kind == 'dkdv_det')}"
            entries.append(
                f'extern "C" __global__ void __launch_bounds__({cfg.kernel_threads(kind)}, 1)\n'
                f"{cfg.symbol(kind, causal, ranged, dropout, window, score)}"
                f"(const __grid_constant__ {params}) {{\n"
                f"{'' if cfg.warp_specialized else _WAIT_PREVIOUS}{_ALLOW_NEXT}"
                f"  {body}<{targs}>({args});\n}}\n"
            )
        variant = variant_name(False, ranged, dropout, window, score)
        return (
            f"// Generated by flash_attention.jit for {cfg.name()}"
            + (f" ({variant} build)\n" if variant else "\n")
            + f'#include "{header}"\n'
            + '#include "fa/grid_dependency.cuh"\n'
            + ('#include "fa/tma_params.h"\n' if cfg.tma_loads else "")
            + "\n"
            + offset_asserts(BwdParams, "fa::BwdParams")
            + (offset_asserts(BwdTmaParams, "fa::BwdTmaParams") if cfg.tma_loads else "")
            + "\n"
            + cfg.cpp_struct("Cfg")
            + "\n"
            + "\n".join(entries)
        )
    dr = _cpp_bool(dropout)
    for causal in mask_causals(window):
        v = variant_type(causal, ranged, window, score)
        for kind, atomic in (("dkdv", "true"), ("dkdv_det", "false")):
            entries.append(
                f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
                f"{cfg.symbol(kind, causal, ranged, dropout, window, score)}"
                "(const __grid_constant__ fa::BwdParams p) {\n"
                f"{_WAIT_PREVIOUS}{_ALLOW_NEXT}  fa::bwd_dkdv_body<Cfg, {v}, {atomic}, {dr}>(p);\n}}\n"
            )
        entries.append(
            f'extern "C" __global__ void __launch_bounds__({cfg.dq_threads})\n'
            f"{cfg.symbol('dq', causal, ranged, dropout, window, score)}"
            "(const __grid_constant__ fa::BwdParams p) {\n"
            f"{_WAIT_PREVIOUS}  fa::bwd_dq_body<Cfg, {v}, {dr}>(p);\n}}\n"
        )
    variant = variant_name(False, ranged, dropout, window)
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}{f' ({variant} build)' if variant else ''}\n"
        '#include "sm80/bwd/bwd_kernel.cuh"\n'
        '#include "fa/grid_dependency.cuh"\n\n'
        + offset_asserts(BwdParams, "fa::BwdParams")
        + "\n"
        + cfg.cpp_struct("Cfg")
        + "\n"
        + "\n".join(entries)
    )


#: Threads of the combine and append kernels' blocks.
DECODE_AUX_THREADS = 128


def decode_kernel_source(cfg: DecodeConfig) -> str:
    """The translation unit of one decode config: the decode kernel for causal and not, contiguous and paged
    caches (the sm80 instruction set's, or the Hopper one for a wgmma config); the split combine; the cache
    append for both layouts. One unit, so a decode step loads one module."""
    # A decode call's launches (append, decode, combine; on Hopper those after the first queued
    # programmatically, the first too unless FLASH_ATTENTION_DECODE_PDL_FIRST=0: ops.decode) wait for the
    # kernel before them at their start, before any access to memory (the append
    # reads new tokens a previous kernel wrote; the decode kernel a cache it appended), and let the next be
    # scheduled from theirs (fa/grid_dependency.cuh): the combine lets the next call's first kernel launch
    # while it runs. A wait in an ordinary launch returns at once.
    entries = []
    body = "fa::sm90::decode_kernel_body" if cfg.wgmma else "fa::decode_kernel_body"
    for causal in (False, True):
        for paged in (False, True):
            entries.append(
                f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
                f"{cfg.symbol('decode', causal, paged)}(const __grid_constant__ fa::DecodeParams p) {{\n"
                f"{_WAIT_PREVIOUS}{_ALLOW_NEXT}"
                f"  {body}<Cfg, {_cpp_bool(causal)}, {_cpp_bool(paged)}>(p);\n}}\n"
            )
    bf = _cpp_bool(cfg.dtype == "bf16")
    entries.append(
        f'extern "C" __global__ void __launch_bounds__({DECODE_AUX_THREADS})\n'
        f"{cfg.symbol('combine')}(const __grid_constant__ fa::DecodeParams p) {{\n"
        f"{_WAIT_PREVIOUS}{_ALLOW_NEXT}"
        f"  fa::decode_combine_body<{bf}, {cfg.head_dim}, {DECODE_AUX_THREADS}>(p);\n}}\n"
    )
    for paged in (False, True):
        entries.append(
            f'extern "C" __global__ void __launch_bounds__({DECODE_AUX_THREADS})\n'
            f"{cfg.symbol('append', paged=paged)}(const __grid_constant__ fa::DecodeParams p) {{\n"
            f"{_WAIT_PREVIOUS}{_ALLOW_NEXT}"
            f"  fa::cache_append_body<{_cpp_bool(paged)}, {DECODE_AUX_THREADS}>(p);\n}}\n"
        )
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}\n"
        + f'#include "{"sm90" if cfg.wgmma else "sm80"}/decode/decode_kernel.cuh"\n'
        + '#include "fa/decode_combine.cuh"\n'
        + '#include "fa/cache_append.cuh"\n'
        + '#include "fa/grid_dependency.cuh"\n\n'
        + offset_asserts(DecodeParams, "fa::DecodeParams")
        + "\n"
        + cfg.cpp_struct("Cfg")
        + "\n"
        # (the launch layer sizes the dynamic shared memory from configs.decode's mirror of the kernel's)
        + f"static_assert({'fa::sm90' if cfg.wgmma else 'fa'}::DecodeSmem<Cfg>::kBytes == {cfg.smem_bytes},"
        + ' "configs.decode.DecodeConfig.smem_bytes must match the kernel\'s DecodeSmem");\n\n'
        + "\n".join(entries)
    )


def merge_kernel_source(cfg: MergeConfig) -> str:
    """The translation unit of the LSE merge (fa/lse_merge.cuh): an entry point per part dtype."""
    entries = [
        f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
        f"{cfg.symbol(name)}(const __grid_constant__ fa::LseMergeParams p) {{\n"
        f"  fa::lse_merge_body<{code}, {cfg.threads}>(p);\n}}\n"
        for name, code in MERGE_PART_DTYPES.items()
    ]
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}\n"
        + '#include "fa/lse_merge.cuh"\n\n'
        + offset_asserts(LseMergeParams, "fa::LseMergeParams")
        + "\n"
        + "\n".join(entries)
    )


def values_transpose_kernel_source(cfg: ValuesTransposeConfig) -> str:
    """The translation unit of the FP8 forward's V^T layout (fa/values_transpose.cuh): an entry point per
    head_dim, and static_asserts that pin the kernel's key order to ops.fp8_values' KEY_ORDER_16 and its tile
    to the config's (both compilers take these, unlike the offset asserts)."""
    entries = [
        f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
        f"{cfg.symbol(d)}(const __grid_constant__ fa::ValuesTransposeParams p) {{\n"
        f"  fa::values_transpose_body<{d}, {cfg.threads}>(p);\n}}\n"
        for d in VALUES_TRANSPOSE_HEAD_DIMS
    ]
    pins = [
        f'static_assert(fa::values_key_at({p}) == {key}, "V^T\'s key order differs from KEY_ORDER_16");'
        for p, key in enumerate(KEY_ORDER_16)
    ]
    pins.append(
        f"static_assert(fa::kValuesTileKeys == {cfg.keys_per_block}, "
        '"the tile differs from ValuesTransposeConfig.keys_per_block");'
    )
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}\n"
        + '#include "fa/values_transpose.cuh"\n\n'
        + offset_asserts(ValuesTransposeParams, "fa::ValuesTransposeParams")
        + "\n".join(pins)
        + "\n\n"
        + "\n".join(entries)
    )


def fp8_cast_kernel_source(cfg: Fp8CastConfig) -> str:
    """The translation unit of the FP8 casts (fa/fp8_cast.cuh): the amax and converting passes per source
    dtype (in fa::Fp8CastSource's order, FP8_CAST_SOURCES) and the dequantizer, one entry point each."""
    entries = []
    for index, source in enumerate(FP8_CAST_SOURCES):
        for kind in ("amax", "quantize"):
            entries.append(
                f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
                f"{cfg.symbol(f'{kind}_{source}')}(const __grid_constant__ fa::Fp8CastParams p) {{\n"
                f"  fa::fp8_{kind}_body<{index}>(p);\n}}\n"
            )
    entries.append(
        f'extern "C" __global__ void __launch_bounds__({cfg.threads})\n'
        f"{cfg.symbol('dequantize')}(const __grid_constant__ fa::Fp8CastParams p) {{\n"
        "  fa::fp8_dequantize_body(p);\n}\n"
    )
    pins = [
        f'static_assert(fa::kCast{s.upper()} == {i}, "fa::Fp8CastSource differs from FP8_CAST_SOURCES");'
        for i, s in enumerate(FP8_CAST_SOURCES)
    ]
    return (
        f"// Generated by flash_attention.jit for {cfg.name()}\n"
        + '#include "fa/fp8_cast.cuh"\n\n'
        + offset_asserts(Fp8CastParams, "fa::Fp8CastParams")
        + "\n".join(pins)
        + "\n\n"
        + "\n".join(entries)
    )
