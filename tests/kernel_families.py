"""One build job of each kernel family: what the default test tier compiles, where `pytest --full` compiles
the whole catalog (flash_attention.ops.select.catalog) for sm_80 and sm_90."""

from __future__ import annotations

from flash_attention.ops.select import BuildJob
from flash_attention.tools.build import jobs_for


def kernel_family(cfg) -> tuple:
    """What tells the kernel families apart: the kind of config (forward, backward, decode) and its Hopper
    forms (wgmma, warp-specialized, wide)."""
    return (
        type(cfg).__name__,
        *(bool(getattr(cfg, a, False)) for a in ("wgmma", "warp_specialized", "wide")),
    )


def catalog_families() -> set[tuple]:
    """The families of every kernel the catalog of sm_80 and sm_90 holds."""
    return {kernel_family(job.cfg) for job in jobs_for(["sm_80", "sm_90"], None)}


def family_sample() -> list[BuildJob]:
    """The first plain build (no key ranges, no dropout) of each family in the catalog of sm_80 and sm_90,
    bf16, head_dim 128 where the family has it (the wide backward starts at 192: 256 then)."""
    sample: dict[tuple, BuildJob] = {}
    for job in jobs_for(["sm_80", "sm_90"], None, ("bf16",), (128, 256)):
        if not job.ranged and not job.dropout:
            sample.setdefault(kernel_family(job.cfg), job)
    return list(sample.values())
