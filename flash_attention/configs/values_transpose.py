"""The values-transpose kernel's build (csrc/include/fa/values_transpose.cuh): V (batch, seqlen_k, heads_kv,
head_dim) of 1-byte elements as the FP8 forward reads it, V^T with each 16-key group in P's fragment order
(ops.fp8_values), in one pass."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KEY_GROUP", "KEY_ORDER_16", "VALUES_TRANSPOSE_HEAD_DIMS", "ValuesTransposeConfig"]

#: Keys per permuted group: half of a 32-key k-step.
KEY_GROUP = 16


def _key_at(position: int) -> int:
    # Position p = 4 t + j of a group (lane t of a quad, byte j of its register) holds the key of S's
    # accumulator at n-tile j // 2, column 2 t + j % 2 (fa/frag.cuh's accumulator layout).
    t, j = divmod(position, 4)
    return 8 * (j // 2) + 2 * t + j % 2


#: KEY_ORDER_16[p]: the key (within its group of 16) that V^T's position p holds (ops.fp8_values says why;
#: the kernel's fa::values_key_at is static_asserted equal to it in its translation unit).
KEY_ORDER_16: tuple[int, ...] = tuple(_key_at(p) for p in range(KEY_GROUP))

#: The head_dims the module has an entry point for: a key's row must be whole 128-byte lines for the tile's
#: bank swizzle, or half of one (64: its rows also swap within pairs, fa/values_transpose.cuh).
VALUES_TRANSPOSE_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class ValuesTransposeConfig:
    """One module, an entry point per head_dim. ``threads`` per block, each block a tile of 128 keys by every
    column of one (batch, head): 256 threads make one (group, column word) item each at head_dim 128, two at
    256, and four 16-byte copies each (8 blocks a multiprocessor at head_dim 128, by threads and the 16 KB
    tile; the kernel is bound by memory)."""

    threads: int = 256
    keys_per_block: int = 128  # (fa::kValuesTileKeys; the source static_asserts the two equal)
    smem_bytes: int = 0  # dynamic shared memory: none (the tile is static, keys_per_block x head_dim bytes)

    def name(self) -> str:
        return f"values_transpose_t{self.threads}"

    def symbol(self, head_dim: int) -> str:
        return f"fa_values_transpose_d{head_dim}_t{self.threads}"
