"""Assignments of chunks to ranks: contiguous, zigzag and longest-processing-time-first with swaps.

Knows: chunk counts and per-chunk work (NumPy arrays). Does not know masks, units or plans: the
planner (planner.py) cuts the sequence into chunks and weighs them, then asks here who owns which.
"""
from __future__ import annotations

import numpy as np

#: Swaps tried by the lpt refinement, per chunk.
REFINE_SWAPS_PER_CHUNK = 8


def contiguous(num_chunks: int, world_size: int) -> np.ndarray:
    """Rank r owns chunks [r * k, (r + 1) * k), k = num_chunks / world_size."""
    return np.arange(num_chunks) // (num_chunks // world_size)


def zigzag(world_size: int) -> np.ndarray:
    """2W chunks; rank r owns chunks r and 2W - 1 - r (a causal mask's cheap and dear ends)."""
    first = np.arange(world_size)
    return np.concatenate([first, first[::-1]])


def lpt(work: np.ndarray, world_size: int) -> np.ndarray:
    """Chunks to ranks, ``len(work) / world_size`` each: heaviest chunk first onto the least
    loaded rank with room, then swaps between the heaviest rank and another that shrink the spread
    (each swap lowers the sum of squared loads, so the refinement ends)."""
    num_chunks = len(work)
    quota = num_chunks // world_size
    owner = np.full(num_chunks, -1, dtype=np.int64)
    load = np.zeros(world_size)
    count = np.zeros(world_size, dtype=np.int64)
    for c in np.argsort(-work, kind="stable"):
        open_ranks = np.flatnonzero(count < quota)
        r = open_ranks[np.argmin(load[open_ranks])]
        owner[c] = r
        load[r] += work[c]
        count[r] += 1
    for _ in range(REFINE_SWAPS_PER_CHUNK * num_chunks):
        if not _best_swap(owner, work, load):
            break
    return owner


def _best_swap(owner: np.ndarray, work: np.ndarray, load: np.ndarray) -> bool:
    """Apply the swap between the heaviest rank and another that most lowers the sum of squared
    loads: moving d = w_a - w_b from a rank to a lighter one by ``gap`` gains 2 d (gap - d)."""
    heavy = int(np.argmax(load))
    mine = np.flatnonzero(owner == heavy)
    best, best_gain = None, 1e-9 * max(float(load[heavy]), 1.0)
    for other in range(len(load)):
        gap = load[heavy] - load[other]
        if other == heavy or gap <= 0:
            continue
        theirs = np.flatnonzero(owner == other)
        d = work[mine][:, None] - work[theirs][None, :]
        gain = np.where((d > 0) & (d < gap), 2 * d * (gap - d), 0.0)
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] > best_gain:
            best, best_gain = (mine[i], theirs[j], other, float(d[i, j])), gain[i, j]
    if best is None:
        return False
    a, b, other, d = best
    owner[a], owner[b] = other, heavy
    load[heavy] -= d
    load[other] += d
    return True


__all__ = ["contiguous", "zigzag", "lpt", "REFINE_SWAPS_PER_CHUNK"]
