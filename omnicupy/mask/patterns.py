"""The element masks of cut blocks from exact row bounds, without calling the mask_mod.

When a MaskMod's bounds are exact, row q allows exactly the keys ``start(q) <= kv < end(q)``: a
block's element mask is, per row, one run of columns ``[lo, hi)`` (clipped to the block and to
real positions; an empty run is written (0, 0), and rows past q_len are empty). So a cut block is
``qbs`` small pairs instead of ``qbs * kbs`` evaluated elements: its type, its identity for
deduplication (equal pairs, equal bits) and, for the few distinct ones, its packed bits follow
from them on the host in O(cut blocks * qbs). Blocks are handled in the chunks the structure
comes in, and distinct patterns are collected across chunks (``PatternPool``). This module knows
row intervals and packed rows (blocks.py); nothing of mask_mods or devices.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import blocks
from .blocks import PARTIAL, hash_multipliers, pool_order, prefix_rows
from .mask_mod import CAUSAL, FULL, MASKED
from .types import PARTIAL_WORD_BITS


def row_runs(start: np.ndarray, end: np.ndarray, q0: np.ndarray, kv0: np.ndarray, q_len: int, kv_len: int,
             kv_block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block (``[K]`` first positions) and row (``start``/``end`` ``[K, qbs]``: the rows' bounds),
    the run of allowed columns ``[lo, hi)`` within the block (``[K, qbs]`` int32 each), (0, 0) when
    empty or past q_len."""
    qbs = start.shape[1]
    real_cols = np.minimum(kv_len - kv0, kv_block_size)[:, None]
    lo = np.clip(start - kv0[:, None], 0, real_cols)
    hi = np.clip(end - kv0[:, None], 0, real_cols)
    empty = (hi <= lo) | (np.arange(qbs) >= (q_len - q0)[:, None])
    lo[empty] = 0
    hi[empty] = 0
    return lo.astype(np.int32), hi.astype(np.int32)


def run_types(lo: np.ndarray, hi: np.ndarray, q0: np.ndarray, kv0: np.ndarray, q_len: int, kv_len: int,
              kv_block_size: int) -> np.ndarray:
    """MASKED, FULL, CAUSAL or PARTIAL (``[K]`` int8) of blocks given by their row runs: the rules of
    ``blocks.block_types`` (only real positions count; nothing > all > the diagonal > partial)."""
    qbs = lo.shape[1]
    rows = np.arange(qbs)
    real_rows = rows < (q_len - q0)[:, None]
    real_cols = np.minimum(kv_len - kv0, kv_block_size)[:, None]
    none = ~(hi > 0).any(axis=1)
    starts_at_zero = (lo == 0) | ~real_rows
    full = (starts_at_zero & ((hi == real_cols) | ~real_rows)).all(axis=1)
    diagonal = np.clip(q0[:, None] + rows - kv0[:, None] + 1, 0, real_cols)
    causal = (starts_at_zero & ((hi == diagonal) | ~real_rows)).all(axis=1)
    return np.select([none, full, causal], [MASKED, FULL, CAUSAL], PARTIAL).astype(np.int8)


def run_codes(lo: np.ndarray, hi: np.ndarray, kv_block_size: int) -> np.ndarray:
    """One int per row that identifies its run: equal codes, equal bits (empty runs are (0, 0))."""
    return lo.astype(np.int64) * (kv_block_size + 1) + hi


def packed_bits(codes: np.ndarray, kv_block_size: int) -> np.ndarray:
    """Packed element masks ``[P, qbs, kbs / 32]`` uint32 of blocks given by their row codes."""
    prefix = prefix_rows(kv_block_size // PARTIAL_WORD_BITS)
    lo, hi = np.divmod(codes, kv_block_size + 1)
    return prefix[hi] ^ prefix[lo]


class PatternPool:
    """Distinct partial-block patterns met so far (as row codes), across chunks."""

    def __init__(self, q_block_size: int, kv_block_size: int) -> None:
        self.qbs, self.kbs = q_block_size, kv_block_size
        self._by_hash: dict[int, list[int]] = {}
        self.codes: list[np.ndarray] = []
        self._multipliers = hash_multipliers(q_block_size)

    def add(self, codes: np.ndarray) -> np.ndarray:
        """Pattern ids (``[K]`` int64, in order of first appearance) of K partial blocks' codes."""
        if not len(codes):
            return np.zeros(0, dtype=np.int64)
        hashes = (codes.astype(np.uint64) * self._multipliers).sum(axis=1)
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        if not np.array_equal(codes, codes[first[inverse]]):  # a collision within the chunk: exact
            _, first, inverse = np.unique(codes, axis=0, return_index=True, return_inverse=True)
            inverse = inverse.reshape(-1)
        ids = np.empty(len(first), dtype=np.int64)
        for j, i in enumerate(first):
            key = int(hashes[i])
            found = next((p for p in self._by_hash.get(key, ()) if np.array_equal(self.codes[p], codes[i])), None)
            if found is None:
                found = len(self.codes)
                self.codes.append(codes[i].copy())
                self._by_hash.setdefault(key, []).append(found)
            ids[j] = found
        return ids[inverse]

    def finish(self, ids: np.ndarray) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """The pool ``[P, qbs, W]`` (NumPy, in the canonical order: ``blocks.pool_order``) and each
        of ``ids``' index into it (int32), or (None, None) when there is no partial block."""
        if not self.codes:
            return None, None
        bits = packed_bits(np.stack(self.codes), self.kbs)
        order = pool_order(bits, blocks.block_hashes(bits))
        rank = np.empty(len(order), dtype=np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        return bits[order], rank[ids]


__all__ = ["row_runs", "run_types", "run_codes", "packed_bits", "PatternPool"]
