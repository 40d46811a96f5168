"""Exact row bounds given piecewise, and what the builders read from them without touching rows.

The exact bounds of the built-in masks are, over runs of query rows, either constant or moving
with the query: ``start(q) = start_i + slope_i * (q - q_i)`` with a slope of 0 or 1 (and the same
for ``end``), a handful of pieces where a mask has documents or segments, one piece for causal or
sliding-window masks. From those pieces a build finds each q block's extremes (the window of
kv blocks it can reach) and names each cut block's element pattern by a few numbers, so that it
does O(pieces + q blocks + cut blocks) work plus the rows of the distinct patterns, instead of
O(N) work on row arrays (``MaskMod._windows``). This module knows piecewise row bounds and q blocks;
nothing of mask functions, BlockMask metadata or devices.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MaskError
from .types import cdiv

#: Odd 64-bit constants of the key hash (splitmix64's, and one per field of a piece's key).
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_FIELD_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                               0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D,
                               0x9FB21C651E98DF25], dtype=np.uint64)


@dataclass(frozen=True)
class Pieces:
    """Row bounds by pieces: piece i covers query rows ``q[i] .. q[i + 1] - 1`` (the last one every
    row from ``q[-1]`` on) and allows there the keys ``[start(q), end(q))`` with ``start(q) =
    start[i] + start_slope[i] * (q - q[i])`` and ``end(q)`` likewise. Arrays ``[P]`` int64,
    ``q[0] == 0``, ``q`` increasing, slopes 0 or 1."""

    q: np.ndarray
    start: np.ndarray
    start_slope: np.ndarray
    end: np.ndarray
    end_slope: np.ndarray

    @classmethod
    def of(cls, q, start, start_slope, end, end_slope) -> "Pieces":
        """Pieces from array-likes (scalars broadcast), checked."""
        arrays = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64).reshape(-1)
                                       for a in (q, start, start_slope, end, end_slope)))
        q, start, start_slope, end, end_slope = (np.array(a) for a in arrays)
        if not len(q) or q[0] != 0 or np.any(np.diff(q) <= 0):
            raise MaskError("pieces must start at row 0 and go up")
        if np.any((start_slope != 0) & (start_slope != 1)) or np.any((end_slope != 0) & (end_slope != 1)):
            raise MaskError("the slopes of pieces must be 0 or 1")
        for a in (q, start, start_slope, end, end_slope):
            a.flags.writeable = False
        return cls(q, start, start_slope, end, end_slope)

    def rows(self, q_len: int) -> tuple[np.ndarray, np.ndarray]:
        """``start``, ``end`` of rows ``0 .. q_len - 1`` (``[q_len]`` int64): the bounds these pieces stand for."""
        start, _, end, _ = self.at(np.arange(q_len))
        return start, end

    def at(self, q: np.ndarray) -> tuple[np.ndarray, ...]:
        """(start, start_slope, end, end_slope) of rows ``q``: the bounds there and their slopes."""
        i = np.searchsorted(self.q, q, side="right") - 1
        shift = q - self.q[i]
        return (self.start[i] + self.start_slope[i] * shift, self.start_slope[i],
                self.end[i] + self.end_slope[i] * shift, self.end_slope[i])


@dataclass(frozen=True)
class BlockPieces:
    """Pieces cut at the edges of q blocks, real rows only: sub-piece i lies in q block ``block[i]``,
    its rows ``row[i] .. row[i] + rows[i] - 1`` of that block, with the bounds ``start[i]`` / ``end[i]``
    at its first row and their slopes. Block b's sub-pieces are ``first[b] .. first[b + 1] - 1``
    (every q block has at least one)."""

    block: np.ndarray
    row: np.ndarray
    rows: np.ndarray
    start: np.ndarray
    start_slope: np.ndarray
    end: np.ndarray
    end_slope: np.ndarray
    first: np.ndarray  # [nQB + 1]
    qbs: int

    def extremes(self) -> tuple[np.ndarray, ...]:
        """Per q block (``[nQB]``): the least and greatest start, the least and greatest end, and
        whether every row ends at its diagonal (``end == q + 1``). Slopes are 0 or 1, so a
        sub-piece's least value is at its first row and its greatest at its last."""
        at, last = self.first[:-1], self.rows - 1
        lo_start = np.minimum.reduceat(self.start, at)
        hi_start = np.maximum.reduceat(self.start + self.start_slope * last, at)
        lo_end = np.minimum.reduceat(self.end, at)
        hi_end = np.maximum.reduceat(self.end + self.end_slope * last, at)
        q_first = self.block * self.qbs + self.row
        diagonal = (self.end == q_first + 1) & ((self.end_slope == 1) | (self.rows == 1))
        return lo_start, hi_start, lo_end, hi_end, np.logical_and.reduceat(diagonal, at)

    def block_rows(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``start``, ``end`` (``[K, qbs]``) of the rows of q blocks ``blocks``, int32 where every bound
        fits (else int64); rows past q_len continue the last sub-piece (the cut-block rules empty them).

        Each row's sub-piece comes from a running count of the sub-pieces begun at or before it,
        and its bound is that sub-piece's line ``intercept + slope * row``: a few [K, qbs] arrays in
        all. (Rows written piece by piece took ~8 int64 temporaries of the rows' size; on the
        lent machines a fresh temporary can cost more in page faults than its arithmetic.)"""
        first = self.first[blocks]
        count = self.first[blocks + 1] - first
        dtype = self._row_dtype()
        row = np.arange(self.qbs, dtype=dtype)
        if np.all(count == 1):  # one sub-piece per block: one line each
            piece = first[:, None]
        else:
            begins = np.zeros((len(blocks), self.qbs), dtype=np.int32)
            pair_block, pieces = self._pairs(blocks)
            begins[pair_block, self.row[pieces]] = 1
            piece = np.cumsum(begins, axis=1, dtype=np.int32, out=begins)
            piece += (first - 1).astype(np.int32)[:, None]
        out = []
        for value, slope in ((self.start, self.start_slope), (self.end, self.end_slope)):
            intercept = (value - slope * self.row).astype(dtype)
            rows = np.take(slope.astype(dtype), piece) * row  # [K, qbs] whether piece is [K, 1] or [K, qbs]
            rows += np.take(intercept, piece)
            out.append(rows)
        return out[0], out[1]

    def _row_dtype(self) -> type:
        """int32 when every row's bound fits it (lengths are below 2**31; bounds of a mask may reach past them)."""
        reach = [np.abs(a).max(initial=0) for a in (self.start, self.end)]
        return np.int32 if max(reach) + 2 * self.qbs < 2**31 else np.int64

    def _pairs(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into ``blocks``, sub-piece) of every sub-piece of every q block in ``blocks``, in order."""
        count = self.first[blocks + 1] - self.first[blocks]
        pair_block = np.repeat(np.arange(len(blocks)), count)
        piece = np.repeat(self.first[blocks] - (np.cumsum(count) - count), count) + np.arange(len(pair_block))
        return pair_block, piece


def block_pieces(pieces: Pieces, q_len: int, qbs: int) -> BlockPieces:
    """``pieces`` cut at every q block's first row, rows ``0 .. q_len - 1``."""
    keep = pieces.q < q_len
    q0 = pieces.q[keep]
    # Two sorted runs (block starts, piece starts inside blocks) merged: a stable sort of two runs is
    # a merge (timsort), ten times cheaper than union1d's sort and unique at 1024 q blocks.
    edges = np.concatenate([np.arange(0, q_len, qbs), q0[q0 % qbs != 0]])
    edges.sort(kind="stable")
    which = np.searchsorted(q0, edges, side="right") - 1
    shift = edges - q0[which]
    block = edges // qbs
    start_slope, end_slope = pieces.start_slope[keep][which], pieces.end_slope[keep][which]
    return BlockPieces(block=block, row=edges - block * qbs, rows=np.diff(np.append(edges, q_len)),
                       start=pieces.start[keep][which] + start_slope * shift, start_slope=start_slope,
                       end=pieces.end[keep][which] + end_slope * shift, end_slope=end_slope,
                       first=np.searchsorted(edges, np.arange(cdiv(q_len, qbs) + 1) * qbs), qbs=qbs)


def _crossings(lo: np.ndarray, hi: np.ndarray, f: np.ndarray, f_slope: np.ndarray, g: np.ndarray,
               g_slope: np.ndarray) -> np.ndarray:
    """The rows strictly inside ``[lo, hi)`` where two lines of slopes 0 and 1 (values ``f``, ``g`` at
    ``lo``) meet: from there on the rising one is the greater."""
    rising, flat = np.where(f_slope > g_slope, f, g), np.where(f_slope > g_slope, g, f)
    meet = lo + (flat - rising)
    return meet[(f_slope != g_slope) & (meet > lo) & (meet < hi)]


def intersect(a: Pieces, b: Pieces) -> Pieces:
    """The pieces of the rows' intersections, ``[max(start_a, start_b), min(end_a, end_b))``: still lines
    of slope 0 or 1, cut where two of them cross (what ``and_masks`` of two pieced masks allows)."""
    lo = np.union1d(a.q, b.q)
    hi = np.append(lo[1:], np.iinfo(np.int64).max)
    sa, ssa, ea, esa = a.at(lo)
    sb, ssb, eb, esb = b.at(lo)
    q = np.union1d(lo, np.concatenate([_crossings(lo, hi, sa, ssa, sb, ssb), _crossings(lo, hi, ea, esa, eb, esb)]))
    sa, ssa, ea, esa = a.at(q)
    sb, ssb, eb, esb = b.at(q)
    # Where two lines are equal at a row, the one that wins over the rest of its piece: for the
    # greater start the rising one, for the lesser end the flat one.
    start = np.maximum(sa, sb)
    start_slope = np.where(sa > sb, ssa, np.where(sb > sa, ssb, np.maximum(ssa, ssb)))
    end = np.minimum(ea, eb)
    end_slope = np.where(ea < eb, esa, np.where(eb < ea, esb, np.minimum(esa, esb)))
    # A piece that only continues the one before it is dropped.
    shift = np.diff(q)
    same = ((start_slope[1:] == start_slope[:-1]) & (start[1:] == start[:-1] + start_slope[:-1] * shift)
            & (end_slope[1:] == end_slope[:-1]) & (end[1:] == end[:-1] + end_slope[:-1] * shift))
    keep = np.concatenate([[True], ~same])
    return Pieces.of(q[keep], start[keep], start_slope[keep], end[keep], end_slope[keep])


def _mixed(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64, wrapping): a sum of mixed values keeps which fields went together."""
    x = x ^ (x >> np.uint64(30))
    x *= _MIX[0]
    x ^= x >> np.uint64(27)
    x *= _MIX[1]
    return x ^ (x >> np.uint64(31))


def group_cut_blocks(bp: BlockPieces, q_block: np.ndarray, kv0: np.ndarray, kv_len: int,
                     kbs: int) -> tuple[np.ndarray, np.ndarray]:
    """Groups of cut blocks (q block ``q_block``, first column ``kv0``, ``[K]``) with the same element
    pattern, from their sub-pieces alone: ``(representatives, group of each block)``, so that only
    the representatives' rows are written and classified.

    A block's pattern is, per row, its bounds relative to ``kv0`` clipped to ``[0, real columns]``.
    Over a sub-piece of L rows that is fixed by its first row, row span and slopes, with the first
    row's relative bound clipped to ``[0, c]`` (slope 0) or ``[1 - L, c]`` (slope 1): those
    numbers (and the block's real columns c and diagonal offset) are the sub-piece's key, and equal
    keys mean equal rows and an equal type. Blocks are grouped by a hash
    of their keys, then every block's keys are compared with its representative's; a collision
    makes each block its own group (exact, only slower)."""
    k = len(q_block)
    if not k:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pair_block, piece = bp._pairs(q_block)
    cols = np.minimum(kv_len - kv0, kbs)[pair_block]
    length = bp.rows[piece]
    keys = [bp.row[piece], length]
    for value, slope in ((bp.start, bp.start_slope), (bp.end, bp.end_slope)):
        slope = slope[piece]
        lowest = np.where(slope == 1, 1 - length, 0)
        keys += [slope, np.clip(value[piece] - kv0[pair_block], lowest, cols)]
    # The type CAUSAL also asks whether the rows are the block's own diagonal: the block's
    # diagonal offset is part of its key where the diagonal crosses it (-qbs < q0 - kv0 < c).
    diagonal = np.clip((q_block * bp.qbs - kv0)[pair_block], -bp.qbs, cols)
    keys += [cols, diagonal]
    fields = np.stack(keys, axis=1).astype(np.int64, copy=False)  # [pairs, 8]
    # The fields' two's-complement words times the multipliers, summed mod 2**64 (einsum: no
    # [pairs, 8] temporary, and 4x faster than a product and a sum over the short axis).
    pair_hash = _mixed(np.einsum("pf,f->p", fields.view(np.uint64), _FIELD_MULTIPLIERS))
    starts = np.flatnonzero(np.r_[True, pair_block[1:] != pair_block[:-1]])
    block_hash = np.add.reduceat(pair_hash, starts)
    _, reps, group = np.unique(block_hash, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    if len(reps) < k and not _same_keys(fields, starts, reps[group]):
        return np.arange(k), np.arange(k)
    return reps, group


def _same_keys(fields: np.ndarray, starts: np.ndarray, rep: np.ndarray) -> bool:
    """Whether every block (its pairs ``starts[j] ..``) has the same keys as block ``rep[j]``."""
    count = np.diff(np.append(starts, len(fields)))
    if not np.array_equal(count, count[rep]):
        return False
    offset = np.arange(len(fields)) - np.repeat(starts, count)
    return bool(np.array_equal(fields, fields[np.repeat(starts[rep], count) + offset]))


__all__ = ["Pieces", "BlockPieces", "block_pieces", "group_cut_blocks", "intersect"]
