"""Slice a BlockMask to a rank's queries against one message of keys, at block granularity.

Knows: the BlockMask layout (docs/design.md, "Block mask metadata") and units (planner.py): the local queries are some units
of the sequence laid end to end, and so are the keys of a message. Does not know: ranks, steps,
GPUs (everything here is NumPy on a host copy of the metadata; the result uploads itself on its
first ``attention`` call like any BlockMask).

The slice keeps the rows of the chosen q blocks and, in each row, the entries whose kv block lies
in the chosen kv units, renumbered to the message's positions; PARTIAL entries keep their pool
index and the pool is reused as is. A CAUSAL block means ``q_idx >= kv_idx`` on positions, and
positions move when units are laid end to end: where a block's q and kv move by the same amount
(always so in the local step, whose queries and keys are the same units in the same order) it
stays CAUSAL; elsewhere its rule, ``q0 + r >= kv0 + c`` for the block's global first positions
(q0, kv0), becomes FULL, MASKED or a PARTIAL bit pattern appended to the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Top-level names only: the mask modules' paths inside the package are being reorganized.
from .. import BlockMask, BlockType, arrays
from ..errors import ArgumentError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_MASKED, _CAUSAL, _FULL, _PARTIAL = (int(t) for t in (BlockType.MASKED, BlockType.CAUSAL, BlockType.FULL,
                                                       BlockType.PARTIAL))


@dataclass(frozen=True)
class HostMetadata:
    """A BlockMask's metadata as NumPy arrays, batch/head dims that every per-block array
    broadcasts by stride 0 reduced to size 1 (``batch_heads`` keeps the mask's own sizes)."""

    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    block_mask_types: np.ndarray
    partial_block_mask_indices: Optional[np.ndarray]
    partial_block_masks: Optional[np.ndarray]
    batch_heads: tuple[int, int]

    @property
    def copies(self) -> int:
        """How many (batch, head) rows of the mask each stored row stands for."""
        return (self.batch_heads[0] // self.kv_num_blocks.shape[0]) * (self.batch_heads[1] // self.kv_num_blocks.shape[1])


def host_metadata(bm: BlockMask) -> HostMetadata:
    """One host copy of ``bm``'s metadata (a device mask crosses the bus once, broadcast dims not at all)."""
    per_bh = [a for a in (bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, bm.partial_block_mask_indices)
              if a is not None]
    keep = tuple(slice(0, 1) if all(a.strides[d] == 0 for a in per_bh) else slice(None) for d in (0, 1))

    def host(a, sliced=True):
        return None if a is None else np.asarray(arrays.to_numpy(a[keep] if sliced else a))

    return HostMetadata(host(bm.kv_num_blocks), host(bm.kv_indices), host(bm.block_mask_types),
                        host(bm.partial_block_mask_indices), host(bm.partial_block_masks, sliced=False),
                        tuple(int(n) for n in bm.kv_num_blocks.shape[:2]))


def unit_blocks(units: np.ndarray, unit: int, block_size: int, seq_len: int) -> np.ndarray:
    """Global block ids covered by ``units`` (in their order); the tail unit has fewer blocks."""
    per_unit = unit // block_size
    ids = (np.asarray(units, dtype=np.int64)[:, None] * per_unit + np.arange(per_unit)).reshape(-1)
    return ids[ids < cdiv(seq_len, block_size)]


def causal_pattern(offset: int, q_block_size: int, kv_block_size: int) -> np.ndarray:
    """Bits ``[q_block_size, kv_block_size / 32]`` uint32 of ``r + offset >= c`` (bit c of word w =
    column 32w + c): a CAUSAL block whose first query sits ``offset`` positions after its first key."""
    rows = np.arange(q_block_size)[:, None]
    cols = np.arange(kv_block_size)[None, :]
    bits = np.packbits(rows + offset >= cols, axis=-1, bitorder="little")
    return np.ascontiguousarray(bits).view("<u4").astype(np.uint32)


def _tail_last(units: np.ndarray, num_units: int, name: str) -> np.ndarray:
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    if units.size and (units.min() < 0 or units.max() >= num_units):
        raise ArgumentError(f"{name} has units outside [0, {num_units})")
    if np.unique(units).size != units.size:
        raise ArgumentError(f"{name} lists a unit twice")
    tail = np.flatnonzero(units == num_units - 1)
    if tail.size and tail[0] != units.size - 1:
        raise ArgumentError(f"{name}: the sequence's last (possibly short) unit must come last")
    return units


def submask(bm: BlockMask, q_units: np.ndarray, kv_units: np.ndarray, unit: int,
            host: Optional[HostMetadata] = None) -> Optional[BlockMask]:
    """The BlockMask of the queries of ``q_units`` against the keys of ``kv_units`` (each laid end to
    end in the given order), or None when no block of the pair carries work. ``unit`` must be a
    multiple of both block sizes; a sequence's last unit may be short and must come last.
    ``host``: ``host_metadata(bm)``, when the caller slices the same mask many times."""
    qbs, kbs = bm.q_block_size, bm.kv_block_size
    if unit % qbs or unit % kbs:
        raise ArgumentError(f"unit ({unit}) must be a multiple of the block sizes ({qbs}, {kbs})")
    n = bm.q_len
    num_units = cdiv(n, unit)
    q_units = _tail_last(q_units, num_units, "q_units")
    kv_units = _tail_last(kv_units, num_units, "kv_units")
    unit_tokens = np.full(num_units, unit, dtype=np.int64)
    unit_tokens[-1] = n - unit * (num_units - 1)
    q_len, kv_len = int(unit_tokens[q_units].sum()), int(unit_tokens[kv_units].sum())
    if not q_len or not kv_len:
        return None

    q_rows = unit_blocks(q_units, unit, qbs, n)
    kv_blocks = unit_blocks(kv_units, unit, kbs, n)
    num_kv_blocks = cdiv(n, kbs)
    kv_local = np.full(num_kv_blocks, -1, dtype=np.int64)
    kv_local[kv_blocks] = np.arange(kv_blocks.size)

    host = host_metadata(bm) if host is None else host
    bh_shape = host.batch_heads  # dims the host copy reduced to 1 are broadcast back at the end
    nb, idx, types = (a[:, :, q_rows] for a in (host.kv_num_blocks, host.kv_indices, host.block_mask_types))
    pidx = None if host.partial_block_mask_indices is None else host.partial_block_mask_indices[:, :, q_rows]

    maxb = idx.shape[3]
    listed = np.arange(maxb) < nb[..., None]
    local_kv = np.where(listed, kv_local[np.clip(idx, 0, num_kv_blocks - 1)], -1)
    kept = (local_kv >= 0) & (types != _MASKED)

    # CAUSAL entries whose q and kv moved by different amounts take their rule along explicitly.
    q_global = q_rows[None, None, :, None] * qbs
    q_shift = q_global - np.arange(q_rows.size)[None, None, :, None] * qbs
    kv_shift = idx.astype(np.int64) * kbs - local_kv * kbs
    moved = kept & (types == _CAUSAL) & (q_shift != kv_shift)
    offset = q_global - idx.astype(np.int64) * kbs  # first query minus first key of the block
    new_types = types.astype(np.int32, copy=True)
    new_pidx = np.zeros(types.shape, dtype=np.int32) if pidx is None else pidx.astype(np.int32, copy=True)
    new_types[moved & (offset >= kbs - 1)] = _FULL
    kept &= ~(moved & (offset <= -qbs))
    cut = moved & (offset > -qbs) & (offset < kbs - 1)
    pool = host.partial_block_masks
    if cut.any():
        offsets, which = np.unique(offset[cut], return_inverse=True)
        patterns = np.stack([causal_pattern(int(d), qbs, kbs) for d in offsets])
        base = 0 if pool is None else pool.shape[0]
        pool = patterns if pool is None else np.concatenate([pool, patterns])
        new_types[cut] = _PARTIAL
        new_pidx[cut] = base + which.reshape(-1)
    if not kept.any():
        return None

    # Compact each row: kept entries first, in their order (a stable sort on "not kept").
    counts = kept.sum(axis=-1).astype(np.int32)
    width = max(int(counts.max()), 1)
    order = np.argsort(~kept, axis=-1, kind="stable")[..., :width]
    slot_live = np.arange(width) < counts[..., None]

    def gather(a):
        return np.where(slot_live, np.take_along_axis(a, order, axis=-1), 0).astype(np.int32)

    out_idx, out_types, out_pidx = gather(local_kv), gather(new_types), gather(new_pidx)
    has_partial = bool(np.any(slot_live & (out_types == _PARTIAL)))
    shape = bh_shape + counts.shape[2:]
    out = [np.broadcast_to(a, shape + a.shape[3:]) for a in (counts, out_idx, out_types, out_pidx)]
    return BlockMask(out[0], out[1], out[2], q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=out[3] if has_partial else None,
                     partial_block_masks=pool if has_partial else None)


__all__ = ["submask", "unit_blocks", "causal_pattern", "host_metadata", "HostMetadata", "cdiv"]
