"""The work of a BlockMask at unit granularity: which (q unit, kv unit) pairs carry blocks, and how much.

Knows: a BlockMask's host metadata and the block weights (a cost per BlockType; measured costs go
in through ``weights=``), and where units lie in the sequence (``units_positions``, ``unit_runs``).
Does not know ranks: the planner (planner.py) assigns the units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from .. import BlockMask, BlockType
from ..checks import check_positive_float
from ..errors import ArgumentError, MaskError
from .submask import cdiv, host_metadata

#: Relative cost of one listed block by type: CAUSAL blocks compute about half their elements.
BLOCK_WEIGHTS: Mapping[BlockType, int] = {BlockType.MASKED: 0, BlockType.CAUSAL: 1, BlockType.FULL: 2,
                                          BlockType.PARTIAL: 2}

@dataclass(frozen=True)
class MaskWork:
    """The work of a BlockMask at unit granularity, summed over the mask's batch and head dims.

    ``q_unit``/``kv_unit``: one entry per distinct (q unit, kv unit) pair with a listed, non-MASKED
    block, ``pair_work`` its weighted block count; ``unit_work``: the same per q unit."""

    seq_len: int
    unit: int
    q_unit: np.ndarray  # [E] int64
    kv_unit: np.ndarray  # [E] int64
    pair_work: np.ndarray  # [E] float64
    unit_work: np.ndarray  # [U] float64
    unit_tokens: np.ndarray  # [U] int64

    @property
    def num_units(self) -> int:
        return len(self.unit_tokens)



def _block_type(key: Any) -> BlockType:
    try:
        return BlockType[key] if isinstance(key, str) else BlockType(key)
    except (KeyError, ValueError):
        raise ArgumentError(f"weights: {key!r} is not a block type (MASKED, CAUSAL, FULL, PARTIAL or 0..3)") from None


def _check_weights(weights: Any) -> Mapping:
    """``weights`` is None or a mapping {block type: cost} (anything else: ArgumentError, not AttributeError)."""
    if weights is None:
        return {}
    if not isinstance(weights, Mapping):
        raise ArgumentError(f"weights must be a mapping {{block type: cost}} (e.g. {{'FULL': 2, 'PARTIAL': 3}}), "
                            f"got {type(weights).__name__}")
    return weights


def _weight_table(weights: Optional[Mapping]) -> np.ndarray:
    """Weights indexed by BlockType; ``weights`` (keys: BlockType, its name or value) override the defaults."""
    weights = _check_weights(weights)
    merged = dict(BLOCK_WEIGHTS)
    merged.update({_block_type(t): w for t, w in (weights or {}).items()})
    table = np.zeros(len(BlockType), dtype=np.float64)
    for t, w in merged.items():
        table[int(t)] = check_positive_float(w, f"weights[{t.name}]") if w else 0.0
    if table[BlockType.MASKED]:
        raise ArgumentError("weights[MASKED] must be 0: a masked block costs nothing")
    return table


def mask_work(bm: BlockMask, weights: Optional[Mapping] = None) -> MaskWork:
    """Unit-level work and (q unit, kv unit) pairs of ``bm`` (host copy of its metadata, O(listed
    entries)). Batch and head dims the metadata broadcasts by stride 0 are counted once and scaled.
    """
    if not isinstance(bm, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(bm).__name__}")
    if bm.q_len != bm.kv_len:
        raise MaskError(f"context parallelism shards one sequence: q_len ({bm.q_len}) must equal kv_len ({bm.kv_len})")
    table = _weight_table(weights)
    host = host_metadata(bm)
    nb, idx, types, scale = host.kv_num_blocks, host.kv_indices, host.block_mask_types, host.copies
    qbs, kbs = bm.q_block_size, bm.kv_block_size
    unit = qbs * kbs // math.gcd(qbs, kbs)
    n = bm.q_len
    num_units = cdiv(n, unit)
    listed = np.arange(idx.shape[3]) < nb[..., None]
    b, h, qb, slot = np.nonzero(listed & (types != BlockType.MASKED))
    kind = types[b, h, qb, slot]
    if np.any((kind < 0) | (kind >= len(BlockType))):
        raise MaskError("block_mask_types has listed entries outside 0..3")
    kvb = idx[b, h, qb, slot].astype(np.int64)
    q_unit = qb.astype(np.int64) * qbs // unit
    kv_unit = kvb * kbs // unit
    unit_work = np.bincount(q_unit, weights=table[kind], minlength=num_units) * scale
    pairs, which = np.unique(q_unit * num_units + kv_unit, return_inverse=True)
    pair_work = np.bincount(which.reshape(-1), weights=table[kind], minlength=len(pairs)) * scale
    unit_tokens = np.full(num_units, unit, dtype=np.int64)
    unit_tokens[-1] = n - unit * (num_units - 1)
    return MaskWork(n, unit, pairs // num_units, pairs % num_units, pair_work.astype(np.float64),
                    unit_work.astype(np.float64), unit_tokens)



def units_positions(units: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Token positions covered by ``units`` (in their order); ``starts`` from ``ShardPlan.unit_starts``."""
    units = np.asarray(units, dtype=np.int64)
    if not units.size:
        return np.zeros(0, dtype=np.int64)
    lengths = starts[units + 1] - starts[units]
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts[units], lengths) + offsets


def unit_runs(units: np.ndarray, starts: np.ndarray) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of the runs of consecutive units in ``units``, where the
    local position is the position in the concatenation of ``units``' tokens."""
    units = np.asarray(units, dtype=np.int64)
    runs, local = [], 0
    if not units.size:
        return runs
    breaks = np.flatnonzero(np.diff(units) != 1) + 1
    for group in np.split(units, breaks):
        start, end = int(starts[group[0]]), int(starts[group[-1] + 1])
        runs.append((start, local, end - start))
        local += end - start
    return runs



__all__ = ["BLOCK_WEIGHTS", "MaskWork", "mask_work", "units_positions", "unit_runs"]
