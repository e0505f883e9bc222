"""The ctypes twin of ``csrc/include/fa/params.h`` (``fa::FwdParams``).

The generated translation unit static_asserts every field offset and the struct size from this class
(:func:`offset_asserts`), so a field added on one side only fails the compile instead of corrupting a launch.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from ..spec.score_functions import decode_fields

_I64 = ctypes.c_longlong
_I32 = ctypes.c_int
_F32 = ctypes.c_float
_PTR = ctypes.c_void_p

#: The slots of the scalar score functions' numbers (``score_values``; fa::kScoreValues in params.h): the
#: active functions' values fill them in spec.score_functions' order (ops.plans.bind_score_values).
SCORE_VALUES = 1


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", _PTR),
        ("k", _PTR),
        ("v", _PTR),
        ("o", _PTR),
        ("lse", _PTR),
        ("key_range", _PTR),
        ("q_batch_stride", _I64),
        ("q_row_stride", _I64),
        ("q_head_stride", _I64),
        ("k_batch_stride", _I64),
        ("k_row_stride", _I64),
        ("k_head_stride", _I64),
        ("v_batch_stride", _I64),
        ("v_row_stride", _I64),
        ("v_head_stride", _I64),
        ("o_batch_stride", _I64),
        ("o_row_stride", _I64),
        ("o_head_stride", _I64),
        ("lse_batch_stride", _I64),
        ("lse_head_stride", _I64),
        ("batch", _I32),
        ("heads_q", _I32),
        ("heads_kv", _I32),
        ("seqlen_q", _I32),
        ("seqlen_k", _I32),
        ("head_dim", _I32),
        ("group", _I32),
        ("num_m_blocks", _I32),
        ("scale", _F32),
        ("scale_log2", _F32),
        ("dropout_key", ctypes.c_uint),
        ("dropout_threshold", ctypes.c_uint),
        ("dropout_rp", _F32),
        ("head_dim_v", _I32),  # (v's and the output's head_dim: the 4 bytes before trace's pointer)
        # Debug build only (csrc/include/fa/trace.cuh); null / 0 for the normal build.
        ("trace", _PTR),
        ("trace_batch", _I32),
        ("trace_head", _I32),
        ("trace_m_block", _I32),
        ("trace_warp", _I32),
        ("trace_fault", _I32),
        ("window_left", _I32),
        ("window_right", _I32),
        ("score_values", _F32 * SCORE_VALUES),
        ("alibi_slopes", _PTR),
        ("alibi_batch_stride", _I32),
        ("sinks", _PTR),
        ("row_keys", _PTR),
        ("key_rows", _PTR),
        ("q_tiles", _PTR),
        ("alibi_diagonal", _PTR),
    ]


#: Bytes of a CUtensorMap (cuTensorMapEncodeTiled's output), which the kernels align to 64.
TENSOR_MAP_BYTES = 128


def _tma_padding() -> int:
    return -ctypes.sizeof(FwdParams) % 64


class FwdTmaParams(ctypes.Structure):
    """The twin of ``fa::FwdTmaParams`` (csrc/include/fa/tma_params.h): FwdParams, then the tensor maps of
    q, k, v and o at the next 64-byte boundary (the driver copies the bytes into the kernel's parameter
    space, which is aligned there; this buffer itself need not be; o's only for configs with tma_store),
    then the persistent grid's tile counter."""

    _fields_ = [
        ("p", FwdParams),
        ("_pad", ctypes.c_ubyte * _tma_padding()),
        ("q_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
        ("k_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
        ("v_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
        ("o_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
        ("tile_counter", _PTR),
        # The e4m3 build's descales (device pointers, null: 1) and their (batch, kv head) strides.
        ("q_descale", _PTR),
        ("k_descale", _PTR),
        ("v_descale", _PTR),
        ("descale_batch_stride", _I32),
        ("descale_head_stride", _I32),
        # The C++ struct is 64-byte aligned (its maps are), so its size rounds up to a multiple of 64.
        ("_tail", ctypes.c_ubyte * (64 - 4 * ctypes.sizeof(_PTR) - 2 * ctypes.sizeof(_I32))),
    ]


class BwdParams(ctypes.Structure):
    """The twin of ``fa::BwdParams`` (csrc/include/fa/bwd_params.h)."""

    _fields_ = (
        [
            (name, _PTR)
            for name in (
                "q",
                "k",
                "v",
                "o",
                "dout",
                "lse",
                "lse_log2",
                "delta",
                "dq_accum",
                "dq",
                "dk",
                "dv",
                "key_range",
            )
        ]
        + [
            (f"{t}_{s}_stride", _I64)
            for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
            for s in ("batch", "row", "head")
        ]
        + [("lse_batch_stride", _I64), ("lse_head_stride", _I64)]
        + [
            (name, _I32)
            for name in (
                "batch",
                "heads_q",
                "heads_kv",
                "seqlen_q",
                "seqlen_k",
                "head_dim",
                "group",
                "seqlen_q_pad",
                "num_m_blocks",
                "num_n_blocks",
            )
        ]
        + [("scale", _F32), ("scale_log2", _F32)]
        + [("dropout_key", ctypes.c_uint), ("dropout_threshold", ctypes.c_uint), ("dropout_rp", _F32)]
        + [("dq_lanes", _I32), ("window_left", _I32), ("window_right", _I32)]
        + [("score_values", _F32 * SCORE_VALUES), ("alibi_slopes", _PTR), ("alibi_batch_stride", _I32)]
        + [("row_keys", _PTR), ("key_rows", _PTR), ("k_tiles", _PTR), ("q_units", _PTR)]
        + [("alibi_diagonal", _PTR), ("kv_block_group", _I32), ("head_dim_v", _I32)]
        # The timeline build's record buffer (csrc/include/fa/timeline.cuh); null in every library call.
        + [("trace", _PTR)]
    )


class BwdTmaParams(ctypes.Structure):
    """The twin of ``fa::BwdTmaParams`` (csrc/include/fa/tma_params.h): BwdParams, then the tensor maps of
    q and dO at the next 64-byte boundary (the warp-specialized backward's with ``tma_loads``; the other
    backward kernels read the BwdParams prefix of the same bytes)."""

    _fields_ = [
        ("p", BwdParams),
        ("_pad", ctypes.c_ubyte * (-ctypes.sizeof(BwdParams) % 64)),
        ("q_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
        ("do_map", ctypes.c_ubyte * TENSOR_MAP_BYTES),
    ]


class DecodeParams(ctypes.Structure):
    """The twin of ``fa::DecodeParams`` (csrc/include/fa/decode_params.h)."""

    _fields_ = (
        [
            (name, _PTR)
            for name in (
                "q",
                "k",
                "v",
                "k_new",
                "v_new",
                "o",
                "lse",
                "o_partial",
                "lse_partial",
                "cache_seqlens",
                "block_table",
                "cache_starts",
                "split_counters",
            )
        ]
        + [
            (f"{t}_{kind}_stride", _I64)
            for t in ("q", "k", "v", "kn", "vn", "o")
            for kind in ("batch", "row", "head")
        ]
        + [("lse_batch_stride", _I64), ("lse_head_stride", _I64), ("block_table_stride", _I64)]
        + [
            (name, _I32)
            for name in (
                "batch",
                "heads_q",
                "heads_kv",
                "seqlen_q",
                "head_dim",
                "group",
                "seqlen_new",
                "cache_seqlen",
                "capacity",
                "page_size",
                "num_pages",
                "rows",
                "num_m_blocks",
                "num_splits",
                "keys_per_split",
            )
        ]
        + [("scale", _F32), ("window_left", _I32), ("window_right", _I32)]
        + [(name, _F32) for name, _ in decode_fields()]  # (the score functions' run-time values)
        + [("alibi_slopes", _PTR), ("alibi_batch_stride", _I64)]
    )


class LseMergeParams(ctypes.Structure):
    """The twin of ``fa::LseMergeParams`` (csrc/include/fa/lse_merge_params.h)."""

    _fields_ = (
        [(name, _PTR) for name in ("out", "lse", "part", "part_lse")]
        + [
            (f"{t}_{kind}_stride", _I64)
            for t, kinds in (
                ("out", ("batch", "row", "head")),
                ("lse", ("batch", "head")),
                ("part", ("batch", "row", "head")),
                ("part_lse", ("batch", "head")),
            )
            for kind in kinds
        ]
        + [(name, _I32) for name in ("batch", "rows", "heads", "head_dim")]
    )


class ValuesTransposeParams(ctypes.Structure):
    """The twin of ``fa::ValuesTransposeParams`` (csrc/include/fa/values_transpose_params.h)."""

    _fields_ = (
        [("v", _PTR), ("vt", _PTR)]
        + [(f"v_{kind}_stride", _I64) for kind in ("batch", "row", "head")]
        + [(name, _I32) for name in ("batch", "seqlen_k", "heads_kv", "keys")]
    )


class Fp8CastParams(ctypes.Structure):
    """The twin of ``fa::Fp8CastParams`` (csrc/include/fa/fp8_cast_params.h)."""

    _fields_ = (
        [(name, _PTR) for name in ("src", "dst", "amax", "descale")]
        + [(f"src_{kind}_stride", _I64) for kind in ("batch", "row", "head")]
        + [(name, _I32) for name in ("batch", "seqlen", "heads", "heads_kv", "head_dim")]
        + [(name, _I32) for name in ("rows_per_block", "descale_per_head")]
    )


def offset_asserts(struct: type[ctypes.Structure], cpp_name: str) -> str:
    """static_asserts pinning the C++ struct's layout to the ctypes one.

    NVRTC's front end rejects ``__builtin_offsetof``, so the asserts are compiled by nvcc only; the layout is
    the same under both (same ABI), and CI compiles every shipped kernel with nvcc.
    """
    lines = [
        "#ifndef __CUDACC_RTC__",
        f"static_assert(sizeof({cpp_name}) == {ctypes.sizeof(struct)}, "
        f'"{cpp_name} size differs from flash_attention/jit/params.py");',
    ]
    for name, _ in struct._fields_:
        if name.startswith("_"):  # padding the C++ side gets from alignas
            continue
        off = getattr(struct, name).offset
        lines.append(
            f"static_assert(__builtin_offsetof({cpp_name}, {name}) == {off}, "
            f'"{cpp_name}::{name} offset differs from flash_attention/jit/params.py");'
        )
    lines.append("#endif")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The trace buffer of the debug build: the twin of fa::trace::Layout in csrc/include/fa/trace.cuh.

#: Planted faults of the debug build (fa::trace::Fault).
TRACE_FAULTS = {"none": 0, "skip_rescale": 1, "wrong_swizzle": 2}

#: Written by a trace build into the buffer's first float, so an untraced buffer is recognised.
TRACE_MAGIC = 20241122.0

#: Per-step quantities in the order the kernel computes them, with their shapes in units of
#: (rows of the warp WM, keys of the tile BC, head_dim D).
TRACE_STEP_FIELDS = (
    ("Q", ("WM", "D")),
    ("K", ("BC", "D")),
    ("S", ("WM", "BC")),
    ("M", ("WM",)),
    ("alpha", ("WM",)),
    ("P", ("WM", "BC")),
    ("L", ("WM",)),
    ("V", ("BC", "D")),
    ("O", ("WM", "D")),
)


@dataclass(frozen=True)
class TraceLayout:
    """Float offsets in the trace buffer of one config (see fa::trace::Layout)."""

    wm: int
    bc: int
    d: int

    @classmethod
    def of(cls, cfg) -> TraceLayout:
        return cls(cfg.rows_per_warp, cfg.block_kv, cfg.head_dim)

    def shape(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple({"WM": self.wm, "BC": self.bc, "D": self.d}[x] for x in dims)

    header = 4  # magic, number of K/V blocks, steps written, spare
    magic, num_blocks, steps_done = 0, 1, 2

    @property
    def final_o(self) -> int:
        return self.header

    @property
    def final_lse(self) -> int:
        return self.final_o + self.wm * self.d

    @property
    def first_step(self) -> int:
        return self.final_lse + self.wm

    @property
    def step_offsets(self) -> dict[str, int]:
        """Offset of each per-step quantity within a step (after the step's K/V block index at 0)."""
        out, off = {}, 1
        for name, dims in TRACE_STEP_FIELDS:
            out[name] = off
            off += math.prod(self.shape(dims))
        out["_step"] = off
        return out

    @property
    def step_size(self) -> int:
        return self.step_offsets["_step"]

    def size(self, steps: int) -> int:
        return self.first_step + steps * self.step_size


def trace_layout_asserts(cfg, cpp_cfg: str = "Cfg") -> str:
    """static_asserts pinning fa::trace::Layout<Cfg> to :class:`TraceLayout` (both compilers accept them)."""
    lay = TraceLayout.of(cfg)
    cpp = f"fa::trace::Layout<{cpp_cfg}>"
    pairs = [
        ("kFinalO", lay.final_o),
        ("kFinalLse", lay.final_lse),
        ("kFirstStep", lay.first_step),
        ("kStep", lay.step_size),
    ]
    cpp_names = {"Q": "kQ", "K": "kK", "S": "kS", "M": "kM", "alpha": "kAlpha", "P": "kP", "L": "kL"}
    cpp_names.update({"V": "kV", "O": "kO"})
    pairs += [(cpp_names[n], off) for n, off in lay.step_offsets.items() if n != "_step"]
    return "".join(
        f'static_assert({cpp}::{name} == {value}, "trace layout {name} differs from jit/params.py");\n'
        for name, value in pairs
    )
