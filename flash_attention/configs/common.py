"""What every kernel family's configuration shares: the compiled head dims and dtypes, the per-architecture
shared-memory limits, and the emitter of the C++ struct of named constants a kernel is instantiated with."""

from __future__ import annotations

from .architectures import ARCHITECTURES, architecture, runs_family

__all__ = [
    "DTYPES",
    "FP8_DTYPE",
    "HEAD_DIMS",
    "SMEM_LIMIT_SM80",
    "SMEM_LIMIT_SM90",
    "SMEM_OPTIN",
    "cpp_struct",
    "is_hopper",
    "padded_head_dim",
    "smem_optin",
]

#: Head dimensions a kernel is instantiated for. Any other head_dim up to 256 runs on the next size up with
#: the tail masked: loads zero-fill the missing columns and stores skip them. All are multiples of 64 so a
#: shared-memory row holds whole groups of eight 16-byte chunks, which the XOR swizzle needs.
HEAD_DIMS = (64, 128, 192, 256)

DTYPES = ("fp16", "bf16")

#: The FP8 input type of the warp-specialized forward: q, k, v and P in e4m3, the output in bf16
#: (docs/fp8-study.md). Not in DTYPES, whose types every family and the catalog build.
FP8_DTYPE = "e4m3"

#: The dynamic shared memory one block may opt into, per architecture (bytes; configs/architectures.py). The
#: heuristics pick configs that fit the GPU's own limit, so every GPU from sm_80 on gets kernels that launch.
SMEM_OPTIN = {name: a.smem_optin for name, a in ARCHITECTURES.items()}

#: The largest dynamic shared memory one block may opt into on sm_80 (A100: 163 KB) and on sm_90 (227 KB);
#: the validity rules bound the sm80-family configs by the former and the wgmma configs by the latter.
SMEM_LIMIT_SM80 = SMEM_OPTIN["sm_80"]
SMEM_LIMIT_SM90 = SMEM_OPTIN["sm_90"]


def smem_optin(arch: str) -> int:
    """The opt-in shared memory per block of ``arch`` (``"sm_86"``); the table's smallest if unknown."""
    return architecture(arch).smem_optin


def is_hopper(arch: str) -> bool:
    """Whether ``arch`` runs the wgmma kernel families (configs/architectures.py)."""
    return runs_family(arch, "wgmma")


def padded_head_dim(head_dim: int) -> int:
    """The instantiated head dimension a problem of ``head_dim`` runs on."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {HEAD_DIMS[-1]}; got {head_dim}")


def cpp_struct(struct_name: str, fields: list[tuple[str, str, object]]) -> str:
    """A C++ struct of named compile-time constants: (name, C++ type, Python value) per field."""

    def literal(value: object) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    body = "\n".join(f"  static constexpr {t} {n} = {literal(v)};" for n, t, v in fields)
    return f"struct {struct_name} {{\n{body}\n}};\n"
