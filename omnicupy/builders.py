"""Builders of BlockMask metadata (DESIGN.md §1): from a mask_mod, a dense mask, flex-attention's arrays.

All three end the same way, from block rows: for each (b, h, q block), the types of the kv blocks
``first, first + 1, ...``, some marked EVALUATE. For a mask_mod with known structure the row is a
window around the allowed keys in which only the blocks an interval end cuts are EVALUATE
(``MaskMod.block_rows``); for an opaque one every block is; for flex, the blocks it calls partial.
Those are classified by evaluating the mask_mod on their elements; partial blocks are bit-packed and
deduplicated into the pool; the rows are compacted into flex's layout.

Where the work runs: everything per block (rows, types, deduplication, compaction) is O(blocks) and
runs on the host with NumPy, where each step costs microseconds, not a kernel launch and a sync.
Only the elements of the EVALUATE blocks are evaluated with the array module ``xp`` (CuPy on the GPU
when one is usable), chunk by chunk so that peak memory stays bounded whatever N is: per chunk one
transfer of coordinates, the mask_mod's own operations, one ``packbits`` and one transfer of the bits
back. The finished metadata is moved to ``xp`` (one transfer per array).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np

from . import arrays, masks
from .block_mask import (BlockMask, BlockType, MaskFeatures, Q_BLOCK_MULTIPLE, KV_BLOCK_MULTIPLE, _as_index_array,
                         _check_positive_int, cdiv)
from .errors import MaskError
from .masks import CAUSAL, EVALUATE, FULL, MASKED

PARTIAL = int(BlockType.PARTIAL)

#: Elements evaluated at once (one chunk of blocks). The chunk's int64 temporaries inside a mask_mod
#: take 8 bytes per element, so this bounds the builders' peak memory near 100 MB.
CHUNK_ELEMENTS = 1 << 22

_ALL_BITS = np.uint32(0xFFFFFFFF)

#: mask_mods that took CuPy arrays once: ``_evaluation_module`` probes each only once (its probe
#: is a handful of kernel launches, as many as a small build's whole evaluation).
_TAKES_DEVICE_ARRAYS: "weakref.WeakSet[Callable]" = weakref.WeakSet()


def default_array_module():
    """CuPy when a GPU is usable, else NumPy."""
    return arrays.cupy_module() if arrays.gpu_available() else np


def _evaluation_module(mask_mod: Callable, xp: Any):
    """``xp``, unless it is CuPy and ``mask_mod`` cannot take CuPy index arrays (it indexes a NumPy
    table, say): then NumPy, with a warning, so that the same function still builds, on the host."""
    if xp is np:
        return xp
    with contextlib.suppress(TypeError):  # one that can't be weakly referenced is probed every time
        if mask_mod in _TAKES_DEVICE_ARRAYS:
            return xp
    zero = xp.zeros((1, 1, 1), dtype=np.int64)
    try:
        mask_mod(zero, zero, zero, zero)
    except TypeError as exc:
        warnings.warn(f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!s} does not take CuPy arrays ({exc}); "
                      "evaluating it with NumPy on the host, which is slower. Index CuPy copies of its tables "
                      "(xp.asarray) to build on the GPU.", stacklevel=4)
        return np
    with contextlib.suppress(TypeError):
        _TAKES_DEVICE_ARRAYS.add(mask_mod)
    return xp


def _check_sizes(q_len, kv_len, q_block_size, kv_block_size) -> tuple[int, int, int, int]:
    return (_check_positive_int(q_len, "q_len"), _check_positive_int(kv_len, "kv_len"),
            _check_positive_int(q_block_size, "q_block_size", Q_BLOCK_MULTIPLE),
            _check_positive_int(kv_block_size, "kv_block_size", KV_BLOCK_MULTIPLE))


def from_mask_mod(mask_mod: Callable, B: Optional[int], H: Optional[int], q_len: int, kv_len: int, *,
                  q_block_size: int = 128, kv_block_size: int = 128, xp: Any = None,
                  use_structure: bool = True) -> BlockMask:
    """Classify every (q block, kv block) of ``mask_mod(b, h, q_idx, kv_idx)`` as MASKED, FULL, CAUSAL
    or PARTIAL. ``B``/``H`` of None build a mask broadcast over batch/heads (size 1). ``xp`` picks
    the array module (default: CuPy with a GPU, else NumPy); ``use_structure=False`` ignores a
    MaskMod's structure and evaluates every block (the generic path, for tests and benchmarks)."""
    if not callable(mask_mod):
        raise MaskError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    Bm = 1 if B is None else _check_positive_int(B, "B")
    Hm = 1 if H is None else _check_positive_int(H, "H")
    q_len, kv_len, qbs, kbs = _check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    rows = None
    if isinstance(mask_mod, masks.MaskMod):
        mask_mod.check_extent(B, q_len, kv_len)
        if use_structure:
            rows = mask_mod.block_rows(Bm, Hm, q_len, kv_len, qbs, kbs)
    if rows is None:
        nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
        rows = np.zeros((Bm, Hm, nqb), dtype=np.int64), np.full((Bm, Hm, nqb, nkvb), EVALUATE, dtype=np.int8)
    return _build(*rows, mask_mod, (Bm, Hm), q_len, kv_len, qbs, kbs, default_array_module() if xp is None else xp)


def from_dense(mask: Any, *, q_block_size: int = 128, kv_block_size: int = 128) -> BlockMask:
    """Block metadata for a boolean mask ``[B|1, H|1, Nq, Nkv]`` (NumPy, CuPy or DLPack); the work
    runs where the mask lives."""
    mask = _as_array(mask, "mask")
    mod = masks.dense(mask)  # validates the mask
    bm, hm, q_len, kv_len = (int(n) for n in mask.shape)
    return from_mask_mod(mod, bm, hm, q_len, kv_len, q_block_size=q_block_size, kv_block_size=kv_block_size,
                         xp=arrays.array_namespace(mask))


def from_flex(kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any = None, full_kv_indices: Any = None, *,
              q_len: int, kv_len: int, q_block_size: int = 128, kv_block_size: int = 128,
              mask_mod: Optional[Callable] = None) -> BlockMask:
    """From the arrays of torch's ``BlockMask.as_tuple()`` (NumPy, CuPy or any DLPack array; no torch
    import): ``kv_*`` lists partial blocks, ``full_kv_*`` full ones. Partial blocks are classified
    (CAUSAL, PARTIAL, or dropped when all false) by evaluating ``mask_mod``, the NumPy/CuPy form of
    flex's mask_mod, which they therefore need."""
    q_len, kv_len, qbs, kbs = _check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise MaskError("full_kv_num_blocks and full_kv_indices must be given together")
    named = {"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices}
    if full_kv_num_blocks is not None:
        named.update(full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices)
    if mask_mod is not None and not callable(mask_mod):
        raise MaskError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    given = {name: _as_array(a, name) for name, a in named.items()}
    # The metadata goes where the arrays came from; the block-level work runs on the host.
    xp = arrays.cupy_module() if any(arrays.is_cupy(a) for a in given.values()) else np
    given = {name: _as_index_array(arrays.to_numpy(a), name, 4 if name.endswith("indices") else 3)
             for name, a in given.items()}
    shape = tuple(given["kv_num_blocks"].shape[:2]) + (cdiv(q_len, qbs), cdiv(kv_len, kbs))
    listed = [_listed_blocks(given, prefix, shape) for prefix in ("", "full_") if prefix + "kv_indices" in given]
    flat = np.concatenate(listed)
    if np.unique(flat).size != flat.size:
        raise MaskError("a kv block is listed twice in one row (within kv_indices, within full_kv_indices, "
                        "or in both); each block may appear once")
    if listed[0].size and mask_mod is None:
        raise MaskError(f"kv_num_blocks lists {int(listed[0].size)} partial blocks, whose element masks need "
                        "mask_mod= (the NumPy/CuPy form of flex's mask_mod)")
    if isinstance(mask_mod, masks.MaskMod):
        mask_mod.check_extent(shape[0], q_len, kv_len)
    types = np.zeros(shape, dtype=np.int8)
    types.reshape(-1)[listed[0]] = EVALUATE
    if len(listed) > 1:
        types.reshape(-1)[listed[1]] = FULL
    return _build(np.zeros(shape[:3], dtype=np.int64), types, mask_mod, shape[:2], q_len, kv_len, qbs, kbs, xp)


def _listed_blocks(given: dict, prefix: str, shape: tuple):
    """Flat ids (into a grid of ``shape``) of the blocks one flex (num_blocks, indices) pair lists."""
    num_name, idx_name = prefix + "kv_num_blocks", prefix + "kv_indices"
    num, idx = given[num_name], given[idx_name]
    bm, hm, nqb, nkvb = shape
    if tuple(num.shape) != (bm, hm, nqb):
        raise MaskError(f"{num_name} must have shape {(bm, hm, nqb)} ([B, H, nQB] with nQB = ceil(q_len / "
                        f"q_block_size)), got {tuple(num.shape)}")
    if tuple(idx.shape[:3]) != (bm, hm, nqb):
        raise MaskError(f"{idx_name} shape {tuple(idx.shape)} must start with {num_name} shape {(bm, hm, nqb)}")
    maxb = int(idx.shape[3])
    if np.any((num < 0) | (num > maxb)):
        raise MaskError(f"{num_name} has entries outside [0, {maxb}] (the last dim of {idx_name})")
    b, h, q, slot = np.nonzero(np.arange(maxb) < num[..., None])
    kv = idx[b, h, q, slot].astype(np.int64)
    if np.any((kv < 0) | (kv >= nkvb)):
        raise MaskError(f"{idx_name} has listed entries outside [0, {nkvb}) (the number of kv blocks)")
    return ((b * hm + h) * nqb + q) * nkvb + kv


def _as_array(x: Any, name: str):
    if x is None:
        raise MaskError(f"{name} is required")
    return arrays.as_array(x, name)


# -------------------------------------------------------------------------- shared construction
def _build(first, types, mask_mod, batch_heads: tuple[int, int], q_len: int, kv_len: int, qbs: int, kbs: int, xp: Any):
    """Block rows (``first`` [Bs, Hs, nQB], ``types`` [Bs, Hs, nQB, C], host) -> BlockMask broadcast to
    ``batch_heads``, its arrays in ``xp``: the EVALUATE blocks are evaluated (``types`` is updated in
    place), the PARTIAL ones pooled, the rows compacted."""
    at = np.flatnonzero(types == EVALUATE)  # C order, so the pool's order is the same on every path
    pidx = pool = None
    if at.size:
        xp = _evaluation_module(mask_mod, xp)
        row, col = np.divmod(at, types.shape[-1])
        b, h, qb = np.unravel_index(row, first.shape)
        kinds, pool, pool_index = _evaluate_blocks(mask_mod, b, h, qb * qbs, (first.reshape(-1)[row] + col) * kbs,
                                                   q_len, kv_len, qbs, kbs, xp)
        types.reshape(-1)[at] = kinds
        if pool is not None:
            pidx = np.zeros(types.shape, dtype=np.int32)
            pidx.reshape(-1)[at[kinds == PARTIAL]] = pool_index
    # Valid by construction (rows strictly increase, every index is in range): BlockMask checks the
    # shapes only, not the values.
    features = MaskFeatures(causal=bool(np.any(types == CAUSAL)), partial=pool is not None)
    nb, idx, types, pidx = _compact(first, types, pidx)
    nb, idx, types, pidx, pool = (None if a is None else xp.asarray(a) for a in (nb, idx, types, pidx, pool))
    # Rows computed for one (b, h) stand for all of them: zero-stride views, no copies.
    nb, idx, types, pidx = (None if a is None else xp.broadcast_to(a, batch_heads + a.shape[2:])
                            for a in (nb, idx, types, pidx))
    return BlockMask(nb, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=pidx, partial_block_masks=pool, mask_mod=mask_mod,
                     _features=features)


def _evaluate_blocks(mask_mod, b, h, q0, kv0, q_len, kv_len, qbs, kbs, xp):
    """Types ([K] int8) of the K blocks whose first element is (q0, kv0), from their elements, in
    chunks; the deduplicated pool of the PARTIAL ones' bits and each one's index into it (or Nones)."""
    per_chunk = max(1, CHUNK_ELEMENTS // (qbs * kbs))
    types, partial_bits = [], []
    for at in (slice(lo, lo + per_chunk) for lo in range(0, len(b), per_chunk)):
        bits = _element_bits(mask_mod, b[at], h[at], q0[at], kv0[at], q_len, kv_len, qbs, kbs, xp)
        types.append(_block_types(bits, q0[at], kv0[at], q_len, kv_len))
        partial_bits.append(bits[types[-1] == PARTIAL])
    types, bits = np.concatenate(types), np.concatenate(partial_bits)
    if not len(bits):
        return types, None, None
    return types, *_deduplicate(bits, _block_hashes(bits, np))


def _element_bits(mask_mod, b, h, q0, kv0, q_len, kv_len, qbs, kbs, xp) -> np.ndarray:
    """The element masks of K blocks as host bits [K, qbs, kbs/32] uint32 (bit c of word w = column
    32w + c), evaluated with ``xp``. Positions past the sequence ends are evaluated at clamped
    indices (lookup tables stay in range); ``_block_types`` clears them."""
    k = len(q0)
    q = np.minimum(q0[:, None] + np.arange(qbs), q_len - 1)
    kv = np.minimum(kv0[:, None] + np.arange(kbs), kv_len - 1)
    at = xp.asarray(np.concatenate([b[:, None], h[:, None], q, kv], axis=1))  # one transfer
    allowed = mask_mod(at[:, 0, None, None], at[:, 1, None, None], at[:, 2:2 + qbs, None], at[:, None, 2 + qbs:])
    allowed = xp.broadcast_to(xp.asarray(allowed, dtype=bool), (k, qbs, kbs))
    # Little bit order: bit c of byte j is element 8j + c, so little-endian words hold column 32w + c.
    bits = arrays.to_numpy(xp.packbits(allowed, bitorder="little")).view("<u4").astype(np.uint32, copy=False)
    return bits.reshape(k, qbs, kbs // 32)


def _block_types(bits, q0, kv0, q_len, kv_len) -> np.ndarray:
    """MASKED, FULL, CAUSAL or PARTIAL ([K] int8) for K blocks given by their bits (``_element_bits``),
    after clearing (in place) the bits of positions past the sequence ends, so only real positions
    decide the type and the pool's tail is 0."""
    k, qbs, n_words = bits.shape
    kbs = 32 * n_words
    rows = np.arange(qbs)
    real_rows = rows < (q_len - q0)[:, None]
    real_cols = np.minimum(kv_len - kv0, kbs)
    # Only blocks in the last q block or the last kv block have positions past the ends.
    tail = np.flatnonzero(~real_rows[:, -1] | (real_cols < kbs))
    real = _prefix_rows(n_words)[real_cols[tail]][:, None, :] * real_rows[tail, :, None]
    bits[tail] &= real
    flat = bits.reshape(k, -1)
    none = flat.max(axis=1) == 0
    full = flat.min(axis=1) == _ALL_BITS
    full[tail] = (bits[tail] == real).all(axis=(1, 2))
    # CAUSAL: each real row r allows the real columns up to its diagonal, kv <= q0 + r. Only a block
    # the diagonal passes through can be that without being all or nothing.
    maybe = np.flatnonzero(~none & ~full & (q0 + qbs > kv0) & (q0 < kv0 + kbs))
    diagonal = np.clip(q0[maybe, None] + rows - kv0[maybe, None] + 1, 0, real_cols[maybe, None]) * real_rows[maybe]
    causal = np.zeros(k, dtype=bool)
    causal[maybe] = (bits[maybe] == _prefix_rows(n_words)[diagonal]).all(axis=(1, 2))
    return np.select([none, full, causal], [MASKED, FULL, CAUSAL], PARTIAL).astype(np.int8)


@functools.lru_cache(maxsize=8)
def _prefix_rows(n_words: int) -> np.ndarray:
    """``[32 * n_words + 1, n_words]`` uint32: row n is a packed row with its first n columns set."""
    n = np.arange(32 * n_words + 1)[:, None] - 32 * np.arange(n_words)
    return ((np.uint64(1) << np.clip(n, 0, 32).astype(np.uint64)) - np.uint64(1)).astype(np.uint32)


@functools.lru_cache(maxsize=8)
def _hash_multipliers(n_words: int) -> np.ndarray:
    """Odd 64-bit multipliers, one per word of a packed block. Fixed, so the pool's order is the
    same on every path."""
    return np.random.default_rng(0x6F6D6E69).integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1)


def _block_hashes(packed, xp):
    """A 64-bit hash of each packed block (NumPy or CuPy): sum of word * multiplier, mod 2**64."""
    words = packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])
    return words.astype(np.uint64) @ xp.asarray(_hash_multipliers(words.shape[1]))


def _deduplicate(packed, hashes):
    """Identical partial blocks share one pool entry (pool in hash order). Blocks are grouped by hash,
    then each is compared with its group's representative; a hash collision falls back to an exact
    row-wise unique. Returns (pool [P, QBS, W] uint32, pool index of each block [n] int32)."""
    rows = packed.reshape(packed.shape[0], -1)
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    if not np.array_equal(rows, rows[first[inverse.reshape(-1)]]):
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return packed[first], inverse.reshape(-1).astype(np.int32)


def _compact(first, types, pidx):
    """Flex's layout from block rows: each row's non-MASKED blocks in increasing kv order, inactive
    slots 0 (the arrays ``BlockMask.from_block_types`` makes). Returns kv_num_blocks, kv_indices,
    block_mask_types, partial_block_mask_indices (int32, or None)."""
    active = types != MASKED
    nb = active.sum(axis=-1, dtype=np.int32)
    kv = first.astype(np.int32)[..., None] + np.arange(types.shape[-1], dtype=np.int32)
    if np.any(active[..., 1:] > active[..., :-1]):
        # A MASKED block before an active one: move the MASKED ones to the row's end, in order.
        order = np.argsort(~active, axis=-1, kind="stable")
        kv, types = np.take_along_axis(kv, order, axis=-1), np.take_along_axis(types, order, axis=-1)
        pidx = None if pidx is None else np.take_along_axis(pidx, order, axis=-1)
        active = types != MASKED
    kv *= active  # past a row's count, types (MASKED) and pidx are already 0
    maxb = max(int(nb.max()), 1)
    return (nb, np.ascontiguousarray(kv[..., :maxb]), types[..., :maxb].astype(np.int32),
            None if pidx is None else np.ascontiguousarray(pidx[..., :maxb]))


__all__ = ["from_mask_mod", "from_dense", "from_flex", "default_array_module", "CHUNK_ELEMENTS"]
