"""One kernel translation unit compiled by NVRTC in a CPU test, for the tests that pin a unit's resources
(registers, spills, shared memory) or its compile-time checks; skipped where NVRTC is not installed."""

from __future__ import annotations

import pytest

from flash_attention.jit import compiler, sources


def require_nvrtc() -> None:
    """Skip the calling test where NVRTC is not installed."""
    if compiler.load_nvrtc() is None:
        pytest.skip("NVRTC is not installed")


def unit_resources(cfg, arch: str) -> dict:
    """``cfg``'s translation unit compiled for ``arch``: its entry points' resources by kernel name."""
    require_nvrtc()
    result = compiler.compile_nvrtc(sources.kernel_source(cfg), arch, cfg.name())
    return {r.kernel: r for r in result.resources}
