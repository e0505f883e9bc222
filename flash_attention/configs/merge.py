"""The LSE merge kernel's build (csrc/include/fa/lse_merge.cuh): two partial attentions of the same rows over
disjoint keys merged in place with their log-sum-exps (context parallelism's per-step merge)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MERGE_PART_DTYPES", "MergeConfig"]

#: The part's dtypes the module has an entry point for, with the kernel's code for each (fa::load_part4).
MERGE_PART_DTYPES = {"fp32": 0, "fp16": 1, "bf16": 2}


@dataclass(frozen=True)
class MergeConfig:
    """One module, an entry point per part dtype. ``threads`` per block: whole rows of head_dim / 4 threads
    each (256 holds 8 rows at head_dim 128; the kernel is bound by memory, the size barely matters)."""

    threads: int = 256
    smem_bytes: int = 0  # (the build tools' shared-memory check reads it)

    def name(self) -> str:
        return f"lse_merge_t{self.threads}"

    def symbol(self, part_dtype: str) -> str:
        return f"fa_lse_merge_{part_dtype}_t{self.threads}"
