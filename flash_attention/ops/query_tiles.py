"""A packed batch's tile tables, built on the device from the offsets that flash_attention.api.varlen notes
on the runs (no host read: CUDA-graph safe):

* :func:`query_tiles`: each sequence's rows cut into tiles of their own (FwdParams::q_tiles, the
  warp-specialized forward's segments build);
* :func:`key_tiles`: each sequence's keys cut into tiles of their own, with the first row and workspace row
  of the sequence's queries (BwdParams::k_tiles, the warp-specialized dK/dV kernel), which walks its query
  blocks from the sequence's first row;
* :func:`query_units`: the backward's workspace laid out by sequence (BwdParams::q_units): each piece of
  rows starts a 128-row block of the workspace, so that query blocks anchored at a sequence's first row are
  whole 64-row units of the dQ accumulator (fa/dq_accum.cuh); :func:`workspace_rows` maps the packed rows
  into it.

A piece is a run of rows (or keys) with one owner: the rows before the first sequence, each sequence's,
the rows after the last. Every table has a length known from the shapes and the sequence count alone (an
upper bound: the unused tail is empty entries)."""

from __future__ import annotations

import torch

__all__ = [
    "key_tiles",
    "query_tiles",
    "query_units",
    "sequence_bucket",
    "tile_count",
    "unit_count",
    "workspace_rows",
]

#: Rows of the workspace per block a piece starts (the dK/dV kernels' tallest query block).
WORKSPACE_ALIGN = 128
#: Rows of a workspace unit (the dQ accumulator's 64-row tiles, fa/dq_accum.cuh).
UNIT = 64


def query_tiles(segments: tuple[torch.Tensor, ...], block_q: int) -> torch.Tensor | None:
    """The query tiles of a packed batch for a kernel of ``block_q``-row tiles, as an int32 (n, 2) tensor of
    row ranges [start, end) (FwdParams::q_tiles), or None when the runs carry no offsets (then the kernels
    tile the packed row as one sequence). Each sequence's rows are cut into tiles of its own, so no tile
    straddles two sequences (a straddling tile visits both sequences' keys, every block masked: kernel log
    96); the rows before the first and after the last sequence are tiles too, so every row is written. The
    tiles are ordered by the keys they visit, most first, so that the longest run first and the last wave
    is of short ones. n = :func:`tile_count`. Made once per runs and tile height."""
    row_keys = segments[0]
    cu_q = getattr(row_keys, "_cu_q", None)
    if cu_q is None:
        return None
    made = row_keys._query_tiles.get(block_q)
    if made is None:
        total_q = row_keys.shape[0]
        count = tile_count(total_q, cu_q.numel() - 1, block_q)
        start, end, _ = _cut(_bounds(cu_q, total_q), block_q, count)
        made = _longest_first(start, end, row_keys, torch.stack((start, end), dim=1))
        row_keys._query_tiles[block_q] = made
    return made


def key_tiles(segments: tuple[torch.Tensor, ...], block_kv: int) -> torch.Tensor | None:
    """The key tiles of a packed batch for a dK/dV kernel of ``block_kv``-key tiles, as an int32 (n, 8)
    tensor (BwdParams::k_tiles): keys [k0, k1) of one piece, the first row of the matching piece of rows
    (the sequence's queries), that row's workspace row in :func:`query_units`' layout, and the piece's end
    row (the kernel walks no row past it, whatever the runs say: offsets past the tensors would otherwise
    walk blocks past the workspace), then three unused ints. A tile
    straddling two sequences walks both sequences' query rows; one anchored at the packed row's grid cuts
    each sequence's first and last query block (kernel log 98). Ordered by the query rows they visit, most
    first. None without offsets. n = :func:`tile_count` over the keys."""
    row_keys, key_rows = segments[0], segments[1]
    cu_q, cu_k = getattr(row_keys, "_cu_q", None), getattr(key_rows, "_cu_k", None)
    if cu_q is None or cu_k is None:
        return None
    made = key_rows._key_tiles.get(block_kv)
    if made is None:
        total_q, total_k = row_keys.shape[0], key_rows.shape[0]
        k_bounds = _bounds(cu_k, total_k)
        k0, k1, piece = _cut(k_bounds, block_kv, tile_count(total_k, cu_k.numel() - 1, block_kv))
        q_bounds = _bounds(cu_q, total_q)
        q_origin, q_end = q_bounds[piece], q_bounds[piece + 1]
        v_origin = _piece_units(q_bounds)[1][piece] * UNIT
        # (8 ints a tile, the last three unused: two 16-byte loads in the kernel)
        spare = torch.zeros_like(k0)
        table = torch.stack((k0, k1, q_origin, v_origin, q_end, spare, spare, spare), dim=1)
        made = _longest_first(k0, k1, key_rows, table)
        key_rows._key_tiles[block_kv] = made
    return made


def query_units(segments: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The backward workspace's rows by sequence, as an int32 (n, 2) tensor (BwdParams::q_units): unit u is
    workspace rows [64 u, 64 u + 64), holding packed rows [start, start + count) of one piece (count <= 64;
    its other rows are padding: no key, zero gradient). Each piece starts a 128-row block, in the pieces'
    order. n = :func:`unit_count`; the unused tail is units of no rows. None without offsets."""
    row_keys = segments[0]
    cu_q = getattr(row_keys, "_cu_q", None)
    if cu_q is None:
        return None
    made = row_keys._query_tiles.get("units")
    if made is None:
        total_q = row_keys.shape[0]
        bounds = _bounds(cu_q, total_q)
        units, first = _piece_units(bounds)
        n = unit_count(total_q, cu_q.numel() - 1)
        u = torch.arange(n, device=bounds.device)
        after = first + units
        piece = torch.searchsorted(after, u, right=True).clamp_max(units.numel() - 1)
        used = u < after[-1]
        start = bounds[piece] + (u - first[piece]) * UNIT
        count = (bounds[piece + 1] - start).clamp(0, UNIT)
        made = torch.stack((torch.where(used, start, total_q), torch.where(used, count, 0)), dim=1)
        made = made.to(torch.int32).contiguous()
        row_keys._query_tiles["units"] = made
    return made


def workspace_rows(segments: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """int64 (total_q,): each packed row's workspace row in :func:`query_units`' layout (for reading the
    workspace back by packed row: the sinks' gradient). Runs that carry no offsets raise."""
    units = query_units(segments)
    if units is None:
        raise ValueError("the runs carry no offsets (flash_attention.api.varlen notes them)")
    made = segments[0]._query_tiles.get("rows")
    if made is not None:  # (made once per runs, as the tables are)
        return made
    total_q = segments[0].shape[0]
    start, count = units[:, 0].to(torch.int64), units[:, 1].to(torch.int64)
    r = torch.arange(UNIT, device=units.device)
    u = torch.arange(units.shape[0], device=units.device)
    # Rows past a unit's count go to a spare slot (a scatter, not a boolean index: no host read).
    dst = torch.where(r < count[:, None], start[:, None] + r, total_q)
    out = torch.empty(total_q + 1, dtype=torch.int64, device=units.device)
    out.scatter_(0, dst.flatten(), (u[:, None] * UNIT + r).flatten())
    segments[0]._query_tiles["rows"] = out[:total_q]
    return out[:total_q]


def tile_count(total: int, batch: int, block: int) -> int:
    """The length of a tile table: every piece (the batch's sequences, the rows before the first and after
    the last) rounds up to whole tiles, at most one tile more than its share each. The batch is counted by
    its :func:`sequence_bucket`, so that packed batches of one token count and a varying number of documents
    share a few plans (and launch grids) instead of one per count."""
    return -(-total // block) + sequence_bucket(batch) + 2


def unit_count(total_q: int, batch: int) -> int:
    """The length of :func:`query_units`' table (the workspace's rows per head over 64): every piece rounds
    up to whole 128-row blocks, at most one block more than its share each (batch: as in
    :func:`tile_count`)."""
    return tile_count(total_q, batch, WORKSPACE_ALIGN) * (WORKSPACE_ALIGN // UNIT)


def sequence_bucket(batch: int) -> int:
    """``batch`` rounded up to a power of two (0 stays 0): the sequence count plans are made for. The
    unused tail of a table is empty tiles, which exit at once."""
    return 0 if batch <= 0 else 1 << (batch - 1).bit_length()


def _bounds(cu: torch.Tensor, total: int) -> torch.Tensor:
    """The pieces' boundaries: 0, the offsets, total, made nondecreasing and clamped to [0, total] (offsets
    that break the caller's promise then give wrong tiles, never rows outside the tensor or rows written
    twice). int64 (batch + 3,). (Fills, not a host tensor copied over: no synchronisation, and a CUDA graph
    can capture it.)"""
    first = torch.zeros(1, dtype=torch.int64, device=cu.device)
    last = torch.full((1,), total, dtype=torch.int64, device=cu.device)
    return torch.cat((first, cu.to(torch.int64).clamp(0, total), last)).cummax(0).values


def _cut(bounds: torch.Tensor, block: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of ``block`` rows cut from each piece: (start, end, piece) int64 (count,); the unused tail is
    [total, total) of the last piece."""
    total = bounds[-1]
    rows = bounds[1:] - bounds[:-1]
    tiles = (rows + block - 1) // block
    after = tiles.cumsum(0)  # one past each piece's last tile
    t = torch.arange(count, device=bounds.device)
    piece = torch.searchsorted(after, t, right=True).clamp_max(rows.numel() - 1)
    used = t < after[-1]
    start = bounds[piece] + (t - (after[piece] - tiles[piece])) * block
    end = torch.minimum(start + block, bounds[piece + 1])
    return torch.where(used, start, total), torch.where(used, end, total), piece


def _piece_units(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each piece of rows' workspace units (whole 128-row blocks) and its first unit, int64."""
    rows = bounds[1:] - bounds[:-1]
    units = (rows + WORKSPACE_ALIGN - 1) // WORKSPACE_ALIGN * (WORKSPACE_ALIGN // UNIT)
    return units, units.cumsum(0) - units


def _longest_first(
    start: torch.Tensor, end: torch.Tensor, runs: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """``table``'s rows (one per tile [start, end) of ``runs``' side) ordered by what the tile visits on the
    other side (from its first entry's first to its last entry's end), most first; empty tiles last. int32,
    contiguous."""
    total = runs.shape[0]
    if total == 0:
        return torch.zeros_like(table, dtype=torch.int32)
    r = runs.to(torch.int64)
    first_seen = r[start.clamp_max(total - 1), 0]
    end_seen = r[(end - 1).clamp(0, total - 1), 1]
    cost = torch.where(end > start, end_seen - first_seen, -1)
    order = torch.sort(cost, descending=True, stable=True).indices
    return table[order].to(torch.int32).contiguous()
