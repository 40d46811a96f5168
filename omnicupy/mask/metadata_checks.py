"""Value checks on block-mask metadata (docs/design.md, "Block mask metadata"): counts, indices,
types, duplicates, the causal band and the partial pool, run where the arrays live (NumPy or CuPy),
with the summary the checks yield. Knows the layout's rules; knows nothing of BlockMask objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import arrays
from ..errors import MaskError
from .types import WORK_WEIGHTS, BlockType, MaskFeatures, cdiv


@dataclass(frozen=True)
class MaskSummary:
    """What inspection and scheduling need, over the mask's whole (broadcast) shape.

    ``counts[t]``: how many (batch, head, q block, kv block) pairs have BlockType t (MASKED counts
    the pairs not visited, listed or not). ``q_block_work``: ``[nQB]`` int64, per q block the sum
    over batch, heads and listed blocks of ``WORK_WEIGHTS[type]``."""

    counts: tuple[int, int, int, int]
    q_block_work: np.ndarray

    @property
    def visited(self) -> int:
        return sum(self.counts[1:])


def causal_band(q_block: Any, kv_block: Any, q_len: int, kv_len: int, q_block_size: int, kv_block_size: int, xp=np):
    """Where a CAUSAL block is valid (element-wise over the broadcast block indices): the causal rule
    ``q_idx >= kv_idx`` cuts it, within real positions (q < q_len, kv < kv_len): some real element
    lies at or below the diagonal (the first kv position <= the last q) and some above it (the
    first q position < the last kv). A block wholly below is FULL, wholly above is MASKED."""
    q_lo = xp.asarray(q_block).astype(np.int64) * q_block_size
    kv_lo = xp.asarray(kv_block).astype(np.int64) * kv_block_size
    q_hi = xp.minimum(q_lo + q_block_size, q_len) - 1
    kv_hi = xp.minimum(kv_lo + kv_block_size, kv_len) - 1
    return (kv_lo <= q_hi) & (q_lo < kv_hi)


def validate_metadata(nb, idx, types, pidx, pool, *, q_len: int, kv_len: int, q_block_size: int,
                      kv_block_size: int) -> tuple[MaskFeatures, MaskSummary]:
    """Value checks on the metadata, run where the arrays live (one reduction on the device, one
    transfer of a handful of flags, the block counts and the q blocks' work back). Returns which
    block types occur and the summary (``MaskSummary``)."""
    xp = arrays.array_namespace(idx)
    num_kv_blocks = cdiv(kv_len, kv_block_size)
    # Plain ints: CuPy's ufuncs do not accept IntEnum operands.
    causal, partial = int(BlockType.CAUSAL), int(BlockType.PARTIAL)
    nqb, maxb = int(idx.shape[2]), int(idx.shape[3])
    slots = xp.arange(maxb, dtype=np.int32)
    active = slots[None, None, None, :] < nb[..., None]
    listed = xp.where(active, types, 0)  # entries past a row's count may hold anything
    is_partial = listed == partial
    # Duplicates: give inactive slots distinct out-of-range values; rows that already increase
    # strictly (what the builders emit) have none, and only otherwise is each row sorted.
    keyed = xp.where(active, idx, num_kv_blocks + slots[None, None, None, :])
    if maxb > 1 and not bool(xp.all(xp.diff(keyed, axis=-1) > 0)):
        dup = xp.any(xp.diff(xp.sort(keyed, axis=-1), axis=-1) == 0)
    else:
        dup = xp.zeros((), dtype=bool)
    npool = 0 if pool is None else int(pool.shape[0])
    q_block = xp.arange(nqb, dtype=np.int64)[:, None]
    off_band = (listed == causal) & ~causal_band(q_block, idx, q_len, kv_len, q_block_size, kv_block_size, xp)
    checks = [
        xp.any(nb < 0),
        xp.any(nb > maxb),
        xp.any(active & ((idx < 0) | (idx >= num_kv_blocks))),
        xp.any((listed < 0) | (listed > partial)),
        dup,
        xp.any(off_band),
        xp.any(listed == causal),
        xp.any(is_partial),
        xp.any(is_partial & ((pidx < 0) | (pidx >= npool))) if pidx is not None else xp.zeros((), dtype=bool),
    ]
    counts = [xp.count_nonzero(listed == int(t)) for t in (BlockType.CAUSAL, BlockType.FULL, BlockType.PARTIAL)]
    weights = xp.asarray(np.array(WORK_WEIGHTS, dtype=np.int64))
    work = weights[xp.clip(listed, 0, partial)].sum(axis=(0, 1, 3))
    found = arrays.to_numpy(xp.concatenate([xp.stack([xp.asarray(c) for c in checks + counts]).astype(np.int64),
                                            work.astype(np.int64)]))
    nb_neg, nb_big, idx_bad, type_bad, dup, off_band, has_causal, has_partial, pidx_bad = (bool(f) for f in found[:9])
    if nb_neg:
        raise MaskError("kv_num_blocks has negative entries")
    if nb_big:
        raise MaskError(f"kv_num_blocks has entries larger than kv_indices' last dim ({maxb})")
    if idx_bad:
        raise MaskError(f"kv_indices has active entries outside [0, {num_kv_blocks}) (the number of kv blocks)")
    if type_bad:
        raise MaskError("block_mask_types has active entries outside {0 MASKED, 1 CAUSAL, 2 FULL, 3 PARTIAL}")
    if dup:
        raise MaskError("kv_indices lists the same kv block twice in one row; each block may appear once")
    if off_band:
        raise MaskError("block_mask_types has CAUSAL blocks that the diagonal q_idx == kv_idx does not cut: a CAUSAL "
                        "block must hold real positions both at or below the diagonal and above it (a block wholly "
                        "below it is FULL, one wholly above it is not listed, or MASKED)")
    if has_partial and pidx is None:
        raise MaskError("block_mask_types has PARTIAL blocks but no partial_block_mask_indices/partial_block_masks")
    if pidx_bad:
        raise MaskError(f"partial_block_mask_indices has PARTIAL entries outside [0, {npool}) (the pool size)")
    visited = [int(c) for c in found[9:12]]
    total = int(np.prod(idx.shape[:3])) * num_kv_blocks
    summary = MaskSummary(counts=(total - sum(visited), *visited), q_block_work=found[12:])
    return MaskFeatures(causal=has_causal, partial=has_partial), summary


__all__ = ["MaskSummary", "causal_band", "validate_metadata"]
