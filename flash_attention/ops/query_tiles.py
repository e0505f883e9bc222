"""A packed batch's tiles: each sequence's rows (or keys) cut into tiles of their own, built on the device
from the offsets that flash_attention.varlen notes on the runs. The warp-specialized forward reads the query
tiles (FwdParams::q_tiles), the warp-specialized backward's dK/dV kernel the key tiles (BwdParams::k_tiles);
the other families tile the packed row."""

from __future__ import annotations

import torch

__all__ = ["key_tiles", "query_tiles", "tile_count"]


def query_tiles(segments: tuple[torch.Tensor, torch.Tensor], block_q: int) -> torch.Tensor | None:
    """The query tiles of a packed batch for a kernel of ``block_q``-row tiles, as an int32 (n, 2) tensor of
    row ranges [start, end) (FwdParams::q_tiles), or None when the runs carry no offsets (then the kernels
    tile the packed row as one sequence). Each sequence's rows are cut into tiles of its own, so no tile
    straddles two sequences (a straddling tile visits both sequences' keys, every block masked: kernel log
    96); the rows before the first and after the last sequence are tiles too, so every row is written. The
    tiles are ordered by the keys they visit, most first, so that the longest run first and the last wave
    is of short ones. n = :func:`tile_count` (an upper bound, known without reading the offsets; the unused
    tail is empty tiles, [total_q, total_q)). Built on the device (no host read) once per runs and tile
    height."""
    return _tiles(segments[0], "_cu_q", block_q)


def key_tiles(segments: tuple[torch.Tensor, torch.Tensor], block_kv: int) -> torch.Tensor | None:
    """The key tiles of a packed batch for a dK/dV kernel of ``block_kv``-key tiles (BwdParams::k_tiles):
    as :func:`query_tiles`, over the keys and their runs of rows (a tile straddling two sequences visits
    both sequences' query rows), ordered by the query rows they visit, most first."""
    return _tiles(segments[1], "_cu_k", block_kv)


def tile_count(total: int, batch: int, block: int) -> int:
    """The length of a tile table: every piece of rows (the batch's sequences, the rows before the first and
    after the last) rounds up to whole tiles, at most one tile more than its share each."""
    return -(-total // block) + batch + 2


def _tiles(runs: torch.Tensor, offsets_name: str, block: int) -> torch.Tensor | None:
    """The tile table of one side: ``runs`` (total, 2) the row_keys or key_rows array, which carries the
    side's offsets (attribute ``offsets_name``) and its tables made so far (``_tiles``)."""
    cu = getattr(runs, offsets_name, None)
    if cu is None:
        return None
    made = runs._tiles.get(block)
    if made is not None:
        return made
    total = runs.shape[0]
    count = tile_count(total, cu.numel() - 1, block)
    device = runs.device
    if total == 0:
        made = torch.zeros(count, 2, dtype=torch.int32, device=device)
    else:
        # Piece boundaries: 0, the offsets, total, made nondecreasing and clamped to the rows (offsets that
        # break the caller's promise then give wrong tiles, never rows outside the tensor or rows written
        # twice). (Fills, not a host tensor copied over: no synchronisation, and a CUDA graph can capture
        # it.)
        first = torch.zeros(1, dtype=torch.int64, device=device)
        last = torch.full((1,), total, dtype=torch.int64, device=device)
        bounds = torch.cat((first, cu.to(torch.int64).clamp(0, total), last)).cummax(0).values
        rows = bounds[1:] - bounds[:-1]
        tiles = (rows + block - 1) // block
        after = tiles.cumsum(0)  # one past each piece's last tile
        t = torch.arange(count, device=device)
        piece = torch.searchsorted(after, t, right=True).clamp_max(rows.numel() - 1)
        used = t < after[-1]
        start = bounds[piece] + (t - (after[piece] - tiles[piece])) * block
        end = torch.minimum(start + block, bounds[piece + 1])
        start = torch.where(used, start, total)
        end = torch.where(used, end, total)
        runs64 = runs.to(torch.int64)
        first_seen = runs64[start.clamp_max(total - 1), 0]
        end_seen = runs64[(end - 1).clamp(0, total - 1), 1]
        cost = torch.where(used & (end > start), end_seen - first_seen, -1)
        order = torch.sort(cost, descending=True, stable=True).indices
        made = torch.stack((start[order], end[order]), dim=1).to(torch.int32).contiguous()
    runs._tiles[block] = made
    return made
