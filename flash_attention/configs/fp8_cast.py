"""The FP8 cast kernels' build (csrc/include/fa/fp8_cast.cuh): attention(fp8=True)'s quantization of
bf16/fp16/fp32 tensors to e4m3 per (batch, kv head), and the dequantization of e4m3 tensors to bf16
(ops.fp8_cast)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FP8_CAST_ENTRY_POINTS", "FP8_CAST_SOURCES", "Fp8CastConfig"]

#: The quantizer's source dtypes, by the name its entry points carry (fa::Fp8CastSource's order).
FP8_CAST_SOURCES = ("bf16", "fp16", "fp32")

#: Every entry point of the module, by key: the amax and converting passes per source dtype, and the
#: dequantizer.
FP8_CAST_ENTRY_POINTS = (
    *(f"amax_{s}" for s in FP8_CAST_SOURCES),
    *(f"quantize_{s}" for s in FP8_CAST_SOURCES),
    "dequantize",
)


@dataclass(frozen=True)
class Fp8CastConfig:
    """One module, an entry point per pass and source dtype (:data:`FP8_CAST_ENTRY_POINTS`). A block of
    ``threads`` takes the rows of one (batch, head) that make about ``elements_per_block`` elements (eight
    per thread and item, ``elements_per_block / threads / 8`` items each): enough bytes a block to keep the
    copies in flight, few enough blocks' atomics in the amax pass (one per block)."""

    threads: int = 256
    elements_per_block: int = 16384

    def rows_per_block(self, head_dim: int) -> int:
        return max(1, self.elements_per_block // head_dim)

    def name(self) -> str:
        return f"fp8_cast_t{self.threads}"

    def symbol(self, key: str) -> str:
        return f"fa_fp8_{key}_t{self.threads}"
