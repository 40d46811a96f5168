"""Block rows as items -> flex's layout (``kv_num_blocks``, ``kv_indices``, ``block_mask_types``,
``partial_block_mask_indices``) and the mask's summary.

Every builder ends with the same description of its rows, ``Items``: item i is ``length[i]``
consecutive kv blocks of one type from ``kv[i]`` on, in row ``row[i]`` of the grid ``[Bs, Hs, nQB]``,
items in (row, kv) order. Consecutive items of one type (not PARTIAL) form a segment: a run of
slots whose kv index is the slot's flat position plus the segment's offset. The host works per
item and per segment; only the final write touches every slot of the ``[rows, maxB]`` arrays: with
NumPy here, on a device by the layout kernel (kernels.py) from one table of O(rows + segments)
numbers (``device_table``). Each row lists its non-MASKED blocks in increasing kv order, then
inactive slots 0. This module knows the layout; nothing of mask_mods or devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .block_mask import MaskSummary
from .mask_mod import MASKED
from .types import WORK_WEIGHTS, BlockType

PARTIAL = int(BlockType.PARTIAL)


@dataclass(frozen=True)
class Items:
    row: np.ndarray  # int64, flat index into the grid [Bs, Hs, nQB]
    kv: np.ndarray  # int64, first kv block
    length: np.ndarray  # int64, blocks
    kind: np.ndarray  # int8, BlockType
    pidx: Optional[np.ndarray] = None  # int32, pool index of PARTIAL items (0 elsewhere)

    def select(self, keep: np.ndarray) -> "Items":
        return Items(self.row[keep], self.kv[keep], self.length[keep], self.kind[keep],
                     None if self.pidx is None else self.pidx[keep])


def items_from_runs(row_ids: np.ndarray, first: np.ndarray, lengths: np.ndarray, kinds: np.ndarray,
                    split: int) -> Items:
    """Rows given as runs -> Items. Row ``row_ids[i]`` is, from kv block ``first[i]`` on,
    ``lengths[i, j]`` blocks of type ``kinds[i, j]``; runs of type ``split`` become one item per
    block (those are evaluated one by one), every other non-empty run not MASKED one item."""
    n = lengths.shape[-1]
    kinds = np.broadcast_to(kinds, lengths.shape).reshape(-1)
    lengths = lengths.reshape(-1, n).astype(np.int64)
    # Each run's first block: the row's first plus the lengths before it. The sum runs down the
    # transposed [n, rows] array: along the long axis, not n-element rows one by one (4x at n = 3).
    before = np.cumsum(lengths.T, axis=0)
    before -= lengths.T
    before += first.reshape(1, -1)
    starts = before.T.reshape(-1)
    lengths = lengths.reshape(-1)
    is_split = kinds == split
    runs = np.flatnonzero(np.where(is_split, lengths, (kinds != MASKED) & (lengths > 0)))
    count = np.where(is_split[runs], lengths[runs], 1)
    run = np.repeat(runs, count)
    offset = np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    return Items(row=row_ids.reshape(-1)[run // n], kv=starts[run] + offset,
                 length=np.where(is_split[run], 1, lengths[run]), kind=kinds[run].astype(np.int8))


@dataclass(frozen=True)
class Segments:
    counts: np.ndarray  # [rows] int64: listed blocks per row
    max_blocks: int
    start: np.ndarray  # [S] int64: flat slot (row * max_blocks + slot) of each segment's first block
    end: np.ndarray  # [S] int64: one past its last
    offset: np.ndarray  # [S] int64: kv index minus flat slot, along the segment
    kind: np.ndarray  # [S] int64: BlockType
    pidx: Optional[np.ndarray]  # [S] int64: pool index (PARTIAL segments are one block long)

    @property
    def rows(self) -> int:
        return len(self.counts)


def segments_of(items: Items, n_rows: int) -> Segments:
    """The segments of the rows (O(items))."""
    keep = items.kind != MASKED
    items = items.select(keep)
    row, kv, length, kind = items.row, items.kv, items.length, items.kind
    counts = np.bincount(row, weights=length, minlength=n_rows).astype(np.int64)
    maxb = max(int(counts.max()) if n_rows else 0, 1)
    # Flat slot (row * maxb + slot in the row) of each item's first block.
    flat = row * maxb + np.cumsum(length) - length - (np.cumsum(counts) - counts)[row]
    # An item starts a segment unless it continues the previous one (same row and type, not
    # PARTIAL, the next kv block), so a run stays one segment whatever the path that listed it.
    new = np.ones(len(row), dtype=bool)
    new[1:] = ((row[1:] != row[:-1]) | (kind[1:] != kind[:-1]) | (kind[1:] == PARTIAL)
               | (kv[1:] != kv[:-1] + length[:-1]))
    seg = np.flatnonzero(new)
    last = np.append(seg[1:], len(row))[:len(seg)] - 1
    return Segments(counts=counts, max_blocks=maxb, start=flat[seg], end=flat[last] + length[last],
                    offset=(kv - flat)[seg], kind=kind[seg].astype(np.int64),
                    pidx=None if items.pidx is None else items.pidx[seg].astype(np.int64))


def write_host(seg: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """kv_num_blocks ``[rows]``, kv_indices, block_mask_types, partial indices ``[rows, maxB]`` (int32
    NumPy; the last None without PARTIAL items). Every output slot is written once or twice, with
    one temporary of a byte per slot: the [rows, maxB] arrays are most of a large build's time."""
    shape = (seg.rows, seg.max_blocks)
    listed = _spread(seg, np.ones(len(seg.start), dtype=np.int8)).view(bool)
    types = _spread(seg, seg.kind.astype(np.int32))
    return (seg.counts.astype(np.int32), _indices(seg, listed).reshape(shape), types.reshape(shape),
            None if seg.pidx is None else _partial_indices(seg).reshape(shape))


def _spread(seg: Segments, values: np.ndarray) -> np.ndarray:
    """``[rows * maxB]``: each segment's value over its slots, 0 in the gaps (a run-length decode)."""
    n_slots = seg.rows * seg.max_blocks
    counts = np.empty(2 * len(seg.start) + 1, dtype=np.int64)
    counts[0::2] = np.append(seg.start, n_slots) - np.insert(seg.end, 0, 0)
    counts[1::2] = seg.end - seg.start
    runs = np.zeros(len(counts), dtype=values.dtype)
    runs[1::2] = values
    return np.repeat(runs, counts)


def _indices(seg: Segments, listed: np.ndarray) -> np.ndarray:
    """kv_indices, flat: slot s of row r holds ``s + offset`` of its segment, 0 when not listed.
    When every row's blocks are one run of kv blocks (its segments share one offset: the built-in
    masks), row r is ``base[r] + s`` masked by ``listed``; else each segment's offset is spread."""
    rows, maxb = seg.rows, seg.max_blocks
    row = seg.start // maxb
    contiguous = not len(row) or bool(np.all((seg.offset[1:] == seg.offset[:-1]) | (row[1:] != row[:-1])))
    if not contiguous:
        n_slots = rows * maxb
        dt = np.int32 if n_slots < 2**31 else np.int64
        idx = _spread(seg, seg.offset.astype(dt))
        idx += np.arange(n_slots, dtype=dt)
        idx *= listed
        return idx.astype(np.int32, copy=False)
    base = np.zeros(rows, dtype=np.int64)
    base[row] = seg.offset + row * maxb  # the kv block of each row's slot 0
    slot = np.arange(maxb, dtype=np.int32)
    idx = np.empty((rows, maxb), dtype=np.int32)
    if np.any(base):
        np.add(base.astype(np.int32)[:, None], slot, out=idx)
        np.multiply(idx, listed.reshape(rows, maxb), out=idx)
    else:  # rows from kv block 0 (causal-like): one pass
        np.multiply(slot, listed.reshape(rows, maxb), out=idx)
    return idx.reshape(-1)


def _partial_indices(seg: Segments) -> np.ndarray:
    """partial_block_mask_indices, flat. Only PARTIAL segments (one block each) have a pool index
    in the builds: zeros and one write per such block, not a pass over the slots."""
    single = seg.end - seg.start == 1
    if not np.all(single | (seg.pidx == 0)):
        return _spread(seg, seg.pidx.astype(np.int32))
    out = np.zeros(seg.rows * seg.max_blocks, dtype=np.int32)
    out[seg.start[single]] = seg.pidx[single]
    return out


def device_table(seg: Segments) -> np.ndarray:
    """What the layout kernel reads (int64): the rows' counts, then per segment its start, offset,
    type and pool index."""
    pidx = np.zeros(len(seg.start), dtype=np.int64) if seg.pidx is None else seg.pidx
    return np.concatenate([seg.counts, seg.start, seg.offset, seg.kind, pidx]).astype(np.int64)


def summary_of(items: Items, grid: tuple[int, int, int], copies: int, num_kv_blocks: int) -> MaskSummary:
    """Block counts and q-block work of rows ``grid`` ``[Bs, Hs, nQB]`` that stand for ``copies``
    (batch, head) pairs each (broadcast)."""
    weights = np.asarray(WORK_WEIGHTS, dtype=np.int64)
    per_type = np.bincount(items.kind.astype(np.int64), weights=items.length, minlength=len(weights)).astype(np.int64)
    visited = [int(per_type[t]) * copies for t in (BlockType.CAUSAL, BlockType.FULL, BlockType.PARTIAL)]
    total = int(np.prod(grid)) * copies * num_kv_blocks
    work = np.bincount(items.row, weights=weights[items.kind] * items.length, minlength=int(np.prod(grid)))
    work = work.reshape(-1, grid[2]).sum(axis=0).astype(np.int64) * copies
    return MaskSummary(counts=(total - sum(visited), *visited), q_block_work=work)


__all__ = ["Items", "Segments", "items_from_runs", "segments_of", "write_host", "device_table", "summary_of"]
