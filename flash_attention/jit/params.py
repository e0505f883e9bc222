"""The ctypes twin of ``csrc/include/fa/params.h`` (``fa::FwdParams``).

The generated translation unit static_asserts every field offset and the struct size from this class
(:func:`offset_asserts`), so a field added on one side only fails the compile instead of corrupting a launch.
"""

from __future__ import annotations

import ctypes

_I64 = ctypes.c_longlong
_I32 = ctypes.c_int
_F32 = ctypes.c_float
_PTR = ctypes.c_void_p


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", _PTR),
        ("k", _PTR),
        ("v", _PTR),
        ("o", _PTR),
        ("lse", _PTR),
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
    ]


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
        off = getattr(struct, name).offset
        lines.append(
            f"static_assert(__builtin_offsetof({cpp_name}, {name}) == {off}, "
            f'"{cpp_name}::{name} offset differs from flash_attention/jit/params.py");'
        )
    lines.append("#endif")
    return "\n".join(lines) + "\n"
