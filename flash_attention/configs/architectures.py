"""The GPU architectures the kernels know, each once: its limits, the kernel families it runs, the target its
architecture-specific kernels compile for. Everything that depends on the GPU generation reads this table
(the heuristics, the JIT's target, occupancy reports, precompiling without a GPU), so a new generation is
one entry here plus its kernel families (configs/families.py, csrc/kernels/<arch>/), not an edit of every
``if arch == ...``.

Limits: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "Architecture", "architecture", "runs_family"]


@dataclass(frozen=True)
class Architecture:
    """One compute capability, as the kernels see it.

    ``smem_optin``: the dynamic shared memory one block may opt into; ``smem_per_sm``, ``threads_per_sm``,
    ``blocks_per_sm``, ``regs_per_sm``, ``reserved_smem``: the multiprocessor's limits (occupancy);
    ``sm_count``: the multiprocessors assumed when no GPU says (precompiling for a named architecture: the
    decode split heuristic reads it); ``families``: the kernel kinds it runs (configs/families.py: the
    portable sm80-instruction kernels everywhere, the wgmma ones where ``kernel_target`` names the target
    they compile for, "sm_90a": wgmma has no portable form)."""

    name: str
    gpus: str
    smem_optin: int
    smem_per_sm: int
    threads_per_sm: int
    blocks_per_sm: int
    sm_count: int
    families: frozenset[str] = frozenset({"portable"})
    kernel_target: str | None = None
    regs_per_sm: int = 65536
    reserved_smem: int = 1024


_PORTABLE = frozenset({"portable"})
_HOPPER = frozenset({"portable", "wgmma", "ws", "wide", "wide_ws"})

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("sm_80", "A100", 163 * 1024, 167936, 2048, 32, 108),
        Architecture("sm_86", "RTX 30xx, A10, A40", 99 * 1024, 102400, 1536, 16, 84),
        Architecture("sm_87", "Jetson Orin", 163 * 1024, 167936, 1536, 16, 16),
        Architecture("sm_89", "RTX 40xx, L4, L40", 99 * 1024, 102400, 1536, 24, 128),
        Architecture("sm_90", "H100, H200", 227 * 1024, 233472, 2048, 32, 132, _HOPPER, "sm_90a"),
        # The architecture-specific target itself, as the JIT names its builds.
        Architecture("sm_90a", "H100, H200", 227 * 1024, 233472, 2048, 32, 132, _HOPPER, "sm_90a"),
    )
}

#: What an architecture the table does not know is assumed to be: the portable kernels within the smallest
#: limits of the table (so a config chosen for it launches on every GPU from sm_80 on), and a large GPU's
#: multiprocessor count (the decode heuristic then plans for the most parallel machine).
_UNKNOWN = Architecture(
    "unknown",
    "",
    min(a.smem_optin for a in ARCHITECTURES.values()),
    min(a.smem_per_sm for a in ARCHITECTURES.values()),
    min(a.threads_per_sm for a in ARCHITECTURES.values()),
    min(a.blocks_per_sm for a in ARCHITECTURES.values()),
    132,
    _PORTABLE,
)


def architecture(arch: str) -> Architecture:
    """The entry of ``arch`` (``"sm_90"``), or the smallest-limits portable one for an unknown name."""
    return ARCHITECTURES.get(arch, _UNKNOWN)


def runs_family(arch: str, kind: str) -> bool:
    """Whether ``arch`` runs the kernel family of ``kind`` ("portable", "wgmma", "ws", "wide", "wide_ws")."""
    return kind in architecture(arch).families
