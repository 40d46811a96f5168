"""The element masks of cut blocks from exact row bounds, without calling the mask_mod.

When a MaskMod's bounds are exact, row q allows exactly the keys ``start(q) <= kv < end(q)``: a
block's element mask is, per row, one run of columns ``[lo, hi)`` (clipped to the block and to
real positions; empty runs and rows past q_len are written (0, 0)). So a cut block is ``qbs``
small codes (``lo * (kbs + 1) + hi``: equal codes, equal bits) instead of ``qbs * kbs`` evaluated
elements: its type, its identity for deduplication and, for the few distinct ones, its packed bits
follow from them on the host. The common case (a block inside both sequences, away from the
diagonal) takes a dozen passes over the codes; blocks at the sequence ends or on the diagonal
are finished separately. Blocks come in the chunks of the structure; distinct patterns are
collected across chunks (``PatternPool``). This module knows row intervals and packed rows
(blocks.py); nothing of mask_mods or devices.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from . import blocks
from .blocks import PARTIAL, hash_multipliers, pool_order, prefix_rows
from .mask_mod import CAUSAL, FULL, MASKED
from .types import PARTIAL_WORD_BITS


def _codes(lo: np.ndarray, hi: np.ndarray, kv_block_size: int) -> np.ndarray:
    """int32 codes of runs ``[lo, hi)`` (already within the block): empty runs are 0. Overwrites ``lo``."""
    empty = hi <= lo
    lo *= kv_block_size + 1
    lo += hi
    lo[empty] = 0
    return lo


def _within(bound: np.ndarray, kv0: np.ndarray, kbs: int) -> np.ndarray:
    """``clip(bound - kv0, 0, kbs)`` per row of ``bound`` ``[K, qbs]``, as int32."""
    if bound.dtype != np.int32:
        bound = bound.astype(np.int64, copy=False)
    first = kv0.astype(bound.dtype)[:, None]
    out = np.maximum(bound, first)
    out -= first
    np.minimum(out, kbs, out=out)
    return out.astype(np.int32, copy=False)


def cut_blocks(start: np.ndarray, end: np.ndarray, q0: np.ndarray, kv0: np.ndarray, q_len: int, kv_len: int,
               kv_block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Types (``[K]`` int8: MASKED, FULL, CAUSAL or PARTIAL, the rules of ``blocks.block_types``) and
    row codes (``[K, qbs]`` int32) of K blocks with first elements (``q0``, ``kv0``) whose rows have
    the bounds ``start``/``end`` (``[K, qbs]``, any integer type)."""
    kbs = kv_block_size
    k, qbs = start.shape
    # Runs within the block: max(bound, kv0) - kv0 cannot overflow (it lies in [0, bound - kv0] when
    # bound > kv0), so int32 bounds (BlockPieces.block_rows) stay int32 throughout; other integer
    # types are taken as int64. In place: a new array per step costs more than the arithmetic here.
    lo, hi = (_within(a, kv0, kbs) for a in (start, end))
    rows = np.arange(qbs)
    # Blocks that reach past an end: their runs are cut to the real columns, their rows past q_len emptied.
    tail = np.flatnonzero((kv0 + kbs > kv_len) | (q0 + qbs > q_len))
    real_cols = np.full(k, kbs, dtype=np.int64)
    real_rows = np.full(k, qbs, dtype=np.int64)
    if tail.size:
        real_cols[tail] = np.minimum(kv_len - kv0[tail], kbs)
        real_rows[tail] = np.minimum(q_len - q0[tail], qbs)
        past = rows >= real_rows[tail, None]
        lo[tail] = np.minimum(lo[tail], real_cols[tail, None]) * ~past
        hi[tail] = np.minimum(hi[tail], real_cols[tail, None]) * ~past
    codes = _codes(lo, hi, kbs)
    most, least = codes.max(axis=1), codes.min(axis=1)
    types = np.full(k, PARTIAL, dtype=np.int8)
    types[(most == kbs) & (least == kbs)] = FULL  # every row (0, kbs)
    if tail.size:  # every real row (0, real columns), the others empty
        want = np.where(rows >= real_rows[tail, None], 0, real_cols[tail, None])
        types[tail] = np.where((codes[tail] == want).all(axis=1), FULL, PARTIAL)
    types[most == 0] = MASKED
    # CAUSAL: each real row runs from 0 to its diagonal (only a block the diagonal crosses can).
    maybe = np.flatnonzero((types == PARTIAL) & (kv0 < q0 + qbs) & (q0 < kv0 + real_cols))
    if maybe.size:
        diagonal = np.clip(q0[maybe, None] + rows + 1 - kv0[maybe, None], 0, real_cols[maybe, None])
        diagonal *= rows < real_rows[maybe, None]
        types[maybe[(codes[maybe] == diagonal).all(axis=1)]] = CAUSAL
    return types, codes


#: Up to this kv block size a cut block's rows are packed by one lookup of their codes in a table of
#: every run (``run_rows``: 266 KiB at 128); larger blocks XOR two prefix rows per row.
RUN_TABLE_MAX_KV_BLOCK = 128


@functools.lru_cache(maxsize=4)
def run_rows(kv_block_size: int) -> np.ndarray:
    """``[(kbs + 1) ** 2, kbs / 32]`` uint32: row ``lo * (kbs + 1) + hi`` is the packed run ``[lo, hi)``
    (0 where ``hi <= lo``, so code 0 is the empty row), read-only."""
    prefix = prefix_rows(kv_block_size // PARTIAL_WORD_BITS)
    lo, hi = np.divmod(np.arange((kv_block_size + 1) ** 2), kv_block_size + 1)
    table = np.take(prefix, hi, axis=0) ^ np.take(prefix, lo, axis=0)
    table[hi <= lo] = 0
    table.flags.writeable = False
    return table


def packed_bits(codes: np.ndarray, kv_block_size: int) -> np.ndarray:
    """Packed element masks ``[P, qbs, kbs / 32]`` uint32 of blocks given by their row codes."""
    if kv_block_size <= RUN_TABLE_MAX_KV_BLOCK:  # one gather, no [P, qbs, W] temporaries
        return np.take(run_rows(kv_block_size), codes, axis=0)
    prefix = prefix_rows(kv_block_size // PARTIAL_WORD_BITS)
    lo, hi = np.divmod(codes, kv_block_size + 1)
    # np.take gathers rows far faster than fancy indexing does.
    return np.take(prefix, hi, axis=0) ^ np.take(prefix, lo, axis=0)


class PatternPool:
    """Distinct partial-block patterns met so far (as row codes), across chunks."""

    def __init__(self, q_block_size: int, kv_block_size: int) -> None:
        self.qbs, self.kbs = q_block_size, kv_block_size
        self._by_hash: dict[int, list[int]] = {}
        self.codes: list[np.ndarray] = []
        # Codes are hashed two at a time, as uint64 words (qbs is even).
        self._multipliers = hash_multipliers(q_block_size // 2)

    def add(self, codes: np.ndarray) -> np.ndarray:
        """Pattern ids (``[K]`` int64, in order of first appearance) of K partial blocks' codes."""
        if not len(codes):
            return np.zeros(0, dtype=np.int64)
        codes = np.ascontiguousarray(codes, dtype=np.int32)
        hashes = np.einsum("kw,w->k", codes.view(np.uint64), self._multipliers)  # mod 2**64, no temporary
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        if len(first) < len(codes) and not np.array_equal(codes, codes[first[inverse]]):
            # A collision within the chunk: exact grouping.
            _, first, inverse = np.unique(codes, axis=0, return_index=True, return_inverse=True)
            inverse = inverse.reshape(-1)
        if not self.codes:  # the first chunk: every pattern is new
            self.codes = list(codes[first])
            for j, i in enumerate(first):
                self._by_hash.setdefault(int(hashes[i]), []).append(j)
            return inverse.astype(np.int64)
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


__all__ = ["cut_blocks", "packed_bits", "run_rows", "PatternPool", "RUN_TABLE_MAX_KV_BLOCK"]
