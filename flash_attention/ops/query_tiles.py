"""A packed batch's query tiles: each sequence's rows cut into tiles of their own (FwdParams::q_tiles, read by
the warp-specialized forward's segments build), built on the device from the offsets that
flash_attention.varlen notes on the runs."""

from __future__ import annotations

import torch

__all__ = ["query_tiles", "sequence_bucket", "tile_count"]


def query_tiles(segments: tuple[torch.Tensor, torch.Tensor], block_q: int) -> torch.Tensor | None:
    """The query tiles of a packed batch for a kernel of ``block_q``-row tiles, as an int32 (n, 2) tensor of
    row ranges [start, end) (FwdParams::q_tiles), or None when the runs carry no offsets (then the kernels
    tile the packed row as one sequence). Each sequence's rows are cut into tiles of its own, so no tile
    straddles two sequences (a straddling tile visits both sequences' keys, every block masked: kernel log
    96); the rows before the first and after the last sequence are tiles too, so every row is written. The
    tiles are ordered by the keys they visit, most first, so that the longest run first and the last wave
    is of short ones. n = :func:`tile_count` (an upper bound, known without reading the offsets; the unused
    tail is empty tiles, [total_q, total_q)). Built on the device (no host read) once per
    runs and tile height."""
    row_keys = segments[0]
    cu_q = getattr(row_keys, "_cu_q", None)
    if cu_q is None:
        return None
    made = row_keys._query_tiles.get(block_q)
    if made is not None:
        return made
    total_q = row_keys.shape[0]
    count = tile_count(total_q, cu_q.numel() - 1, block_q)
    device = row_keys.device
    if total_q == 0:
        made = torch.zeros(count, 2, dtype=torch.int32, device=device)
    else:
        # Piece boundaries: 0, the offsets, total_q, made nondecreasing and clamped to the rows (offsets that
        # break the caller's promise then give wrong tiles, never rows outside q or rows written twice).
        # (Fills, not a host tensor copied over: no synchronisation, and a CUDA graph can capture it.)
        first = torch.zeros(1, dtype=torch.int64, device=device)
        last = torch.full((1,), total_q, dtype=torch.int64, device=device)
        bounds = torch.cat((first, cu_q.to(torch.int64).clamp(0, total_q), last)).cummax(0).values
        rows = bounds[1:] - bounds[:-1]
        tiles = (rows + block_q - 1) // block_q
        after = tiles.cumsum(0)  # one past each piece's last tile
        t = torch.arange(count, device=device)
        piece = torch.searchsorted(after, t, right=True).clamp_max(rows.numel() - 1)
        used = t < after[-1]
        start = bounds[piece] + (t - (after[piece] - tiles[piece])) * block_q
        end = torch.minimum(start + block_q, bounds[piece + 1])
        start = torch.where(used, start, total_q)
        end = torch.where(used, end, total_q)
        keys = row_keys.to(torch.int64)
        first_key = keys[start.clamp_max(total_q - 1), 0]
        end_key = keys[(end - 1).clamp(0, total_q - 1), 1]
        cost = torch.where(used & (end > start), end_key - first_key, -1)
        order = torch.sort(cost, descending=True, stable=True).indices
        made = torch.stack((start[order], end[order]), dim=1).to(torch.int32).contiguous()
    row_keys._query_tiles[block_q] = made
    return made


def tile_count(total_q: int, batch: int, block_q: int) -> int:
    """The length of :func:`query_tiles`'s table: every piece of rows (the batch's sequences, the rows before
    the first and after the last) rounds up to whole tiles, at most one tile more than its share each. The
    batch is counted by its :func:`sequence_bucket`, so that packed batches of one token count and a
    varying number of documents share a few plans (and launch grids) instead of one per count."""
    return -(-total_q // block_q) + sequence_bucket(batch) + 2


def sequence_bucket(batch: int) -> int:
    """``batch`` rounded up to a power of two (0 stays 0): the sequence count plans are made for. The
    unused tail of a table is empty tiles, which exit at once."""
    return 0 if batch <= 0 else 1 << (batch - 1).bit_length()
