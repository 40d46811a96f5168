"""Element masks of whole blocks, bit-packed: their type, their hash, and the deduplicated pool.

A block's element mask is ``[qbs, kbs / 32]`` uint32 words (bit c of word w = column 32 w + c),
with every position past the sequence ends cleared. Its type is MASKED (no bit), FULL (every real
position), CAUSAL (exactly the real positions at or below the diagonal) or PARTIAL; its hash is
``sum(word * multiplier)`` mod 2**64 over its words with fixed odd multipliers, so the pool's order
(ascending hash) is the same whichever path built it. This module is the host (NumPy) definition
of these rules; ``kernels`` computes the same on the GPU, and ``patterns`` the same from row bounds.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .. import arrays
from .mask_mod import CAUSAL, FULL, MASKED, LookupTable
from .types import BlockType, PARTIAL_WORD_BITS

PARTIAL = int(BlockType.PARTIAL)
ALL_BITS = np.uint32(0xFFFFFFFF)


@functools.lru_cache(maxsize=8)
def prefix_rows(n_words: int) -> np.ndarray:
    """``[32 * n_words + 1, n_words]`` uint32: row n is a packed row with its first n columns set."""
    n = np.arange(PARTIAL_WORD_BITS * n_words + 1)[:, None] - PARTIAL_WORD_BITS * np.arange(n_words)
    return ((np.uint64(1) << np.clip(n, 0, 32).astype(np.uint64)) - np.uint64(1)).astype(np.uint32)


@functools.lru_cache(maxsize=8)
def prefix_table(n_words: int) -> LookupTable:
    """``prefix_rows`` copied once to each device that asks."""
    return LookupTable(prefix_rows(n_words))


@functools.lru_cache(maxsize=16)
def hash_multipliers(n_words: int) -> np.ndarray:
    """Odd 64-bit multipliers, one per word of a packed block (``qbs * kbs / 32`` of them). Fixed,
    so the pool's order is the same on every path and every machine."""
    rng = np.random.default_rng(0x6F6D6E69)
    return rng.integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1)


@functools.lru_cache(maxsize=16)
def _multiplier_table(n_words: int) -> LookupTable:
    return LookupTable(hash_multipliers(n_words))


def block_hashes(packed: Any, xp: Any = np):
    """A 64-bit hash of each packed block ``[K, qbs, W]`` (NumPy or CuPy): sum of word * multiplier,
    mod 2**64."""
    words = packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])
    multipliers = _multiplier_table(words.shape[1]).on(words)
    if isinstance(words, np.ndarray):
        # NumPy's einsum casts through small buffers: no [K, qbs * W] uint64 temporary, whose fresh
        # pages can cost more than the arithmetic (lab/notes/masks.md#s19: 1.3 MiB and up to 1.1 ms at 324 blocks).
        return np.einsum("kw,w->k", words, multipliers)
    words = words.astype(np.uint64)
    words *= multipliers
    return words.sum(axis=1)


def block_types(bits, q0, kv0, q_len: int, kv_len: int):
    """MASKED, FULL, CAUSAL or PARTIAL (``[K]`` int8) of K packed blocks ``[K, qbs, W]`` (NumPy)
    whose first elements are at (``q0``, ``kv0``), after clearing (in place) the bits of positions
    past the sequence ends, so that only real positions decide the type and the pool's tail is 0."""
    k, qbs, n_words = bits.shape
    kbs = PARTIAL_WORD_BITS * n_words
    prefix = prefix_rows(n_words)
    rows = np.arange(qbs)
    q0, kv0 = np.asarray(q0, dtype=np.int64), np.asarray(kv0, dtype=np.int64)
    real_rows = rows < (q_len - q0)[:, None]  # [K, qbs]
    real_cols = np.minimum(kv_len - kv0, kbs)[:, None]  # [K, 1]
    real = np.take(prefix, np.where(real_rows, real_cols, 0), axis=0)  # [K, qbs, W]
    bits &= real
    flat, real_flat = bits.reshape(k, -1), real.reshape(k, -1)
    none = ~flat.any(axis=1)
    full = (flat == real_flat).all(axis=1)
    # CAUSAL: each real row r allows the real columns up to its diagonal, kv <= q0 + r. (Only a block
    # the diagonal crosses can be that without being all or nothing, which take precedence.)
    diagonal = q0[:, None] + rows - kv0[:, None] + 1
    np.clip(diagonal, 0, real_cols, out=diagonal)
    diagonal *= real_rows
    causal = (bits == np.take(prefix, diagonal, axis=0)).reshape(k, -1).all(axis=1)
    return np.select([none, full, causal], [MASKED, FULL, CAUSAL], PARTIAL).astype(np.int8)


def pool_order(pool: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """The canonical order of distinct pool entries ``[P, qbs, W]`` (host): ascending hash, ties
    (collisions) by their words in order."""
    order = np.argsort(hashes, kind="stable")
    if np.all(np.diff(hashes[order].astype(np.uint64)) > 0):  # no collision: the hashes decide
        return order
    words = pool.reshape(len(pool), -1)
    return np.lexsort(tuple(words[:, ::-1].T) + (hashes,))


def deduplicate(bits, rows, hashes, xp, backend=None):
    """Identical partial blocks share one pool entry (pool in hash order). The blocks are
    ``bits[rows]`` (``rows`` host indices, or None: all of ``bits``) with host ``hashes``; they are
    grouped by hash, then each is compared with its group's representative; a hash collision
    falls back to an exact row-wise unique on the host. Returns (pool [P, QBS, W] uint32 in ``xp``,
    pool index of each block [n] int32 host). ``backend`` (kernels.Backend) gathers and compares
    on a device; without it, NumPy indexing does."""
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1).astype(np.int32)
    rep = first[inverse]
    dup = np.flatnonzero(rep != np.arange(len(rep)))
    select = (lambda i: i) if rows is None else (lambda i: rows[i])
    if backend is None:
        same = not len(dup) or bool(np.all(bits[select(dup)] == bits[select(rep[dup])]))
        if same:
            return bits[select(first)], inverse
    else:
        pool = backend.gather_blocks(bits, select(first))
        if not len(dup) or not backend.blocks_differ(bits, select(dup), bits, select(rep[dup])):
            return pool, inverse
    packed = arrays.to_numpy(bits)  # a collision: rare, so the simple way
    packed = packed if rows is None else packed[rows]
    _, first, inverse = np.unique(packed.reshape(len(packed), -1), axis=0, return_index=True, return_inverse=True)
    return xp.asarray(packed[first]), inverse.reshape(-1).astype(np.int32)


__all__ = ["prefix_rows", "prefix_table", "hash_multipliers", "block_hashes", "block_types", "pool_order",
           "deduplicate", "PARTIAL", "ALL_BITS"]
