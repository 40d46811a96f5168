"""Launch order of the q tiles: heaviest first (longest-processing-time first).

The grid walks blockIdx.x fastest, so the order of q tiles along x is the order in which one
(batch, head)'s CTAs reach the SMs. A CTA's time is about its number of kv tiles. When the heavy
q tiles come last, the final wave is a few long CTAs on otherwise idle SMs; heaviest first leaves
the short ones to fill in at the end. For causal, full and sliding-window masks heaviest first is
the kernel's default order (last q tile first), and no order array is passed; for packed
documents, where the heavy tiles are the ends of long documents, the order comes from the mask.

Persistent CTAs (the tma family) take their tiles from a list instead of the hardware's dynamic
dispatch. Handing them out round robin (grid stride) is exact when every tile costs the same, but
for causal masks it left the busiest CTA 11 % above the mean and ran 3 % slower than one CTA per
tile (lab/notes/forward.md#s16). ``cta_tile_lists`` balances them on the host with the mask's work estimates
(longest processing time first).
"""
from __future__ import annotations

import heapq
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


#: Above this many tiles the greedy assignment (a Python heap) costs more than it saves: grid stride.
MAX_ASSIGNED_TILES = 1 << 17


def cta_tile_lists(bm: BlockMask, br: int, batch: int, heads: int, ctas: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(offsets int32 [ctas + 1], tiles int32 [B * H * q tiles]): CTA c of a persistent launch runs the
    flat tiles ``tiles[offsets[c]:offsets[c + 1]]`` in that order. A flat tile is ``(b * H + h) * q_tiles
    + rank``, ``rank`` the q tile's place in the launch order (launch_order). None when grid stride
    is as good (every tile costs the same) or the list would be too long. Cached on the mask."""
    q_tiles = cdiv(bm.q_len, br)
    total = q_tiles * batch * heads
    if total > MAX_ASSIGNED_TILES or ctas >= total:
        return None
    key = ("cta_tiles", br, batch, heads, ctas)
    cache = bm._tile_orders
    if key not in cache:
        order = launch_order(bm, br)
        ranked = order if order is not None else np.arange(q_tiles - 1, -1, -1, dtype=np.int32)
        tile_work = q_block_work(bm)[ranked.astype(np.int64) * br // bm.q_block_size]  # by rank
        if np.all(tile_work == tile_work[0]):
            cache[key] = None
        else:
            cache[key] = _greedy(np.tile(tile_work, batch * heads), ctas)
    return cache[key]


def _greedy(work: np.ndarray, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest processing time first: the heaviest remaining tile to the CTA with the least work so
    far; then each CTA runs its tiles in flat order, so that the CTAs move through the (batch, head)s
    together and share their K/V in L2."""
    free = [(0, c) for c in range(ctas)]
    owner = np.empty(work.size, dtype=np.int64)
    for item in np.argsort(-work, kind="stable").tolist():
        load, c = heapq.heappop(free)
        owner[item] = c
        heapq.heappush(free, (load + max(int(work[item]), 1), c))
    tiles = np.argsort(owner, kind="stable").astype(np.int32)  # per CTA, in flat order
    offsets = np.zeros(ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(owner, minlength=ctas), out=offsets[1:])
    return offsets, tiles
