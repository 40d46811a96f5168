"""Text pictures of a block mask (``BlockMask.to_string``), in memory that grows with the listed blocks.

The picture is read from the metadata rows (``kv_num_blocks``, ``kv_indices``, ``block_mask_types``
of one (batch, head)), a bounded number of rows at a time, never from a dense grid of every
(q block, kv block) pair: a sliding window at N = 2**24 (131072 x 131072 blocks of 128) is drawn
from its 131072 x 9 listed entries. When the grid is wider than the picture, each character stands
for a square of blocks (FlexAttention's printout does the same). This module knows the metadata
layout and the block characters; nothing of devices beyond copying rows to the host.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from .types import BLOCK_CHARS, BlockType, cdiv

#: Rows of metadata copied to the host and counted at once: bounds the picture's working memory.
SLOTS_PER_CHUNK = 1 << 22
#: A square whose blocks are all visited but are not all of one type.
MIXED_CHAR = "*"


def type_counts_per_cell(nb: Any, idx: Any, types: Any, num_kv_blocks: int, side: int) -> np.ndarray:
    """``[R, C, 4]`` int64: per square of ``side x side`` blocks, how many listed blocks of each
    type it holds (R = ceil(nQB / side), C = ceil(nKVB / side)). ``nb`` ``[nQB]``, ``idx`` and
    ``types`` ``[nQB, maxB]`` (NumPy or CuPy); entries past a row's count are ignored."""
    nqb, maxb = (int(n) for n in idx.shape)
    n_rows, n_cols = cdiv(nqb, side), cdiv(num_kv_blocks, side)
    counts = np.zeros(n_rows * n_cols * 4, dtype=np.int64)
    step = max(1, SLOTS_PER_CHUNK // max(maxb, 1))
    for lo in range(0, nqb, step):
        hi = min(lo + step, nqb)
        count = arrays.to_numpy(nb[lo:hi])
        row_idx = arrays.to_numpy(idx[lo:hi])
        row_types = arrays.to_numpy(types[lo:hi])
        listed = (np.arange(maxb) < count[:, None]) & (row_types > BlockType.MASKED) & (row_types <= BlockType.PARTIAL)
        q, slot = np.nonzero(listed)
        cell = ((q + lo) // side) * n_cols + row_idx[q, slot] // side
        counts += np.bincount(cell * 4 + row_types[q, slot], minlength=counts.size)
    return counts.reshape(n_rows, n_cols, 4)


def type_counts_from_runs(q_block: np.ndarray, kv: np.ndarray, length: np.ndarray, kind: np.ndarray,
                          num_q_blocks: int, num_kv_blocks: int, side: int) -> np.ndarray:
    """``type_counts_per_cell`` from runs of blocks: run i is ``length[i]`` blocks of type ``kind[i]``
    from kv block ``kv[i]`` on, in q block ``q_block[i]``. O(runs x squares a run touches)."""
    n_rows, n_cols = cdiv(num_q_blocks, side), cdiv(num_kv_blocks, side)
    listed = (length > 0) & (kind > BlockType.MASKED) & (kind <= BlockType.PARTIAL)
    q_block, kv, length, kind = q_block[listed], kv[listed], length[listed], kind[listed].astype(np.int64)
    first, last = kv // side, (kv + length - 1) // side
    touched = last - first + 1
    run = np.repeat(np.arange(len(kv)), touched)
    cell = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(touched) - touched, touched)
    overlap = np.minimum(kv[run] + length[run], (cell + 1) * side) - np.maximum(kv[run], cell * side)
    key = ((q_block[run] // side) * n_cols + cell) * 4 + kind[run]
    counts = np.bincount(key, weights=overlap, minlength=n_rows * n_cols * 4)
    return counts.astype(np.int64).reshape(n_rows, n_cols, 4)


def picture(nb: Any, idx: Any, types: Any, num_kv_blocks: int, width: int, runs: Any = None) -> str:
    """The rows of one (batch, head) as text, at most ``width`` characters wide and tall.

    One character per block while the grid fits ('#' FULL, '\\' CAUSAL, '+' PARTIAL, '.' MASKED or
    unlisted); otherwise each character is a square of blocks: a block character where all of them
    are of that type, '*' where all are visited but of several types, and a digit 1-9 where only
    part are visited (tenths of the square's blocks, to the nearest, 1 to 9). A last line then says so.
    ``runs`` (q block, kv, length, kind), when the rows are known as runs, are counted instead of
    the slots."""
    nqb = int(idx.shape[0])
    side = max(1, cdiv(num_kv_blocks, width), cdiv(nqb, width))
    if runs is not None:
        counts = type_counts_from_runs(*runs, nqb, num_kv_blocks, side)
    else:
        counts = type_counts_per_cell(nb, idx, types, num_kv_blocks, side)
    rows_in = np.minimum(side, nqb - side * np.arange(counts.shape[0]))
    cols_in = np.minimum(side, num_kv_blocks - side * np.arange(counts.shape[1]))
    total = rows_in[:, None] * cols_in[None, :]
    visited = counts[..., 1:].sum(axis=-1)
    tenths = np.clip(np.rint(10 * visited / total), 1, 9).astype(np.int64)
    chars = np.where(visited == total, MIXED_CHAR, tenths.astype(str)).astype(object)
    chars[visited == 0] = BLOCK_CHARS[BlockType.MASKED]
    for t in (BlockType.CAUSAL, BlockType.FULL, BlockType.PARTIAL):
        chars[counts[..., int(t)] == total] = BLOCK_CHARS[t]
    lines = ["".join(row) for row in chars]
    if side > 1:
        lines.append(f"({nqb}x{num_kv_blocks} blocks, {side}x{side} per character: '#' '\\' '+' '.' where all "
                     f"are of one type, '{MIXED_CHAR}' all visited, 1-9 tenths visited)")
    return "\n".join(lines)


__all__ = ["picture", "type_counts_per_cell", "type_counts_from_runs", "SLOTS_PER_CHUNK", "MIXED_CHAR"]
