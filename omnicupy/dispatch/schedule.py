"""Launch order of the q tiles: heaviest first (longest-processing-time first).

The grid walks blockIdx.x fastest, so the order of q tiles along x is the order in which one
(batch, head)'s CTAs reach the SMs. A CTA's time is about its number of kv tiles. When the heavy
q tiles come last, the final wave is a few long CTAs on otherwise idle SMs; heaviest first leaves
the short ones to fill in at the end. For causal, full and sliding-window masks heaviest first is
the kernel's default order (last q tile first), and no order array is passed; for packed
documents, where the heavy tiles are the ends of long documents, the order comes from the mask.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..jit import env
from ..mask import BlockMask, cdiv

def q_block_work(bm: BlockMask) -> np.ndarray:
    """[nQB] int64: the estimated cost of each q block (mask/types.py WORK_WEIGHTS per listed block,
    summed over the mask's batch and head dims). The mask computed it on the host when it was
    built or validated, so asking needs no transfer from the device and no synchronization."""
    return bm.q_block_work


def heaviest_first(work: np.ndarray, q_len: int, q_block_size: int, br: int) -> np.ndarray:
    """Tile indices (tiles of ``br`` rows) ordered by their block's work, ties by the later tile first."""
    tiles = np.arange(cdiv(q_len, br))
    block_work = work[tiles * br // q_block_size]
    return np.lexsort((-tiles, -block_work)).astype(np.int32)  # last key is the primary one


def launch_order(bm: BlockMask, br: int) -> Optional[np.ndarray]:
    """Host int32 array: q tile to run for each blockIdx.x, or None when that is the kernel's
    default order (last tile first) or OMNICUPY_SCHEDULE=natural. Cached on the mask per tile height."""
    if env.schedule() == "natural":
        return None
    cache = bm._tile_orders
    if br not in cache:
        order = heaviest_first(q_block_work(bm), bm.q_len, bm.q_block_size, br)
        natural = np.arange(order.size - 1, -1, -1, dtype=np.int32)
        cache[br] = None if np.array_equal(order, natural) else order
    return cache[br]
