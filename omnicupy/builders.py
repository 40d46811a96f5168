"""Builders of BlockMask metadata (DESIGN.md §1): from a mask_mod, a dense mask, flex-attention's arrays.

All three end the same way. A grid of block types ``[Bm, Hm, nQB, nKVB]`` marks some blocks
EVALUATE: for a mask_mod with known structure only the blocks an interval end cuts
(``MaskMod.classify_blocks``), for an opaque one all of them, for flex the blocks it calls partial.
Those are classified by evaluating the mask_mod on their elements, chunk by chunk so that peak
memory stays bounded whatever N is; partial blocks are bit-packed and deduplicated into the pool;
the grid is compacted into flex's layout. The work runs with CuPy on the GPU when one is usable
(the metadata then lives on the device), with NumPy otherwise.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import numpy as np

from . import arrays, masks
from .block_mask import (BlockMask, BlockType, Q_BLOCK_MULTIPLE, KV_BLOCK_MULTIPLE, _as_index_array,
                         _check_positive_int, cdiv)
from .errors import MaskError
from .masks import CAUSAL, EVALUATE, FULL, MASKED

PARTIAL = int(BlockType.PARTIAL)

#: Elements evaluated at once (one chunk of blocks). The chunk's int64 temporaries inside a mask_mod
#: take 8 bytes per element, so this bounds the builders' peak memory near 100 MB.
CHUNK_ELEMENTS = 1 << 22


def default_array_module():
    """CuPy when a GPU is usable, else NumPy."""
    return arrays.cupy_module() if arrays.gpu_available() else np


def _evaluation_module(mask_mod: Callable, xp: Any):
    """``xp``, unless it is CuPy and ``mask_mod`` cannot take CuPy index arrays (it indexes a NumPy
    table, say): then NumPy, with a warning, so that the same function still builds, on the host."""
    if xp is np:
        return xp
    zero = xp.zeros((1, 1, 1), dtype=np.int64)
    try:
        mask_mod(zero, zero, zero, zero)
    except TypeError as exc:
        warnings.warn(f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!s} does not take CuPy arrays ({exc}); "
                      "evaluating it with NumPy on the host, which is slower. Index CuPy copies of its tables "
                      "(xp.asarray) to build on the GPU.", stacklevel=3)
        return np
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
    xp = _evaluation_module(mask_mod, default_array_module()) if xp is None else xp
    grid = None
    if isinstance(mask_mod, masks.MaskMod):
        mask_mod.check_extent(B, q_len, kv_len)
        if use_structure:
            grid = mask_mod.classify_blocks(Bm, Hm, q_len, kv_len, qbs, kbs, xp=xp)
    if grid is None:
        grid = xp.full((Bm, Hm, cdiv(q_len, qbs), cdiv(kv_len, kbs)), EVALUATE, dtype=np.int8)
    return _build(grid, mask_mod, (Bm, Hm), q_len, kv_len, qbs, kbs, xp)


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
    xp = arrays.cupy_module() if any(arrays.is_cupy(a) for a in given.values()) else np
    if mask_mod is not None:
        xp = _evaluation_module(mask_mod, xp)
    convert = arrays.to_numpy if xp is np else xp.asarray
    given = {name: _as_index_array(convert(a), name, 4 if name.endswith("indices") else 3)
             for name, a in given.items()}
    shape = tuple(given["kv_num_blocks"].shape[:2]) + (cdiv(q_len, qbs), cdiv(kv_len, kbs))
    listed = [_listed_blocks(given, prefix, shape, xp) for prefix in ("", "full_") if prefix + "kv_indices" in given]
    flat = xp.concatenate(listed)
    if int(xp.unique(flat).size) != int(flat.size):
        raise MaskError("a kv block is listed twice in one row (within kv_indices, within full_kv_indices, "
                        "or in both); each block may appear once")
    if listed[0].size and mask_mod is None:
        raise MaskError(f"kv_num_blocks lists {int(listed[0].size)} partial blocks, whose element masks need "
                        "mask_mod= (the NumPy/CuPy form of flex's mask_mod)")
    if isinstance(mask_mod, masks.MaskMod):
        mask_mod.check_extent(shape[0], q_len, kv_len)
    grid = xp.zeros(shape, dtype=np.int8)
    grid.reshape(-1)[listed[0]] = EVALUATE
    if len(listed) > 1:
        grid.reshape(-1)[listed[1]] = FULL
    return _build(grid, mask_mod, shape[:2], q_len, kv_len, qbs, kbs, xp)


def _listed_blocks(given: dict, prefix: str, shape: tuple, xp: Any):
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
    if bool(xp.any((num < 0) | (num > maxb))):
        raise MaskError(f"{num_name} has entries outside [0, {maxb}] (the last dim of {idx_name})")
    b, h, q, slot = xp.nonzero(xp.arange(maxb) < num[..., None])
    kv = idx[b, h, q, slot].astype(np.int64)
    if bool(xp.any((kv < 0) | (kv >= nkvb))):
        raise MaskError(f"{idx_name} has listed entries outside [0, {nkvb}) (the number of kv blocks)")
    return ((b * hm + h) * nqb + q) * nkvb + kv


def _as_array(x: Any, name: str):
    if x is None:
        raise MaskError(f"{name} is required")
    return arrays.as_array(x, name)


# -------------------------------------------------------------------------- shared construction
def _build(grid, mask_mod, batch_heads: tuple[int, int], q_len: int, kv_len: int, qbs: int, kbs: int, xp: Any):
    """Evaluate the grid's EVALUATE blocks, compact it, broadcast to ``batch_heads`` -> BlockMask."""
    pidx_grid, pool = _evaluate_blocks(grid, mask_mod, q_len, kv_len, qbs, kbs, xp)
    compact = _compact(grid, pidx_grid, xp)
    # A grid computed for one (b, h) stands for all of them: zero-stride views, no copies.
    nb, idx, types, pidx = (None if a is None else xp.broadcast_to(a, batch_heads + a.shape[2:]) for a in compact)
    return BlockMask(nb, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=pidx, partial_block_masks=pool, mask_mod=mask_mod)


def _evaluate_blocks(grid, mask_mod, q_len, kv_len, qbs, kbs, xp):
    """Replace every EVALUATE entry of ``grid`` (in place) by the block's type from its elements.
    Returns the pool index of each PARTIAL block (a grid) and the deduplicated pool, or two Nones."""
    flat_grid = grid.reshape(-1)
    todo = xp.flatnonzero(flat_grid == EVALUATE)  # C order, so the pool's order is the same on every path
    per_chunk = max(1, CHUNK_ELEMENTS // (qbs * kbs))
    partial, packed, hashes = [], [], []
    for start in range(0, int(todo.size), per_chunk):
        at = todo[start:start + per_chunk]
        types, bits = _classify_elements(mask_mod, xp.unravel_index(at, grid.shape), q_len, kv_len, qbs, kbs, xp)
        flat_grid[at] = types
        partial.append(at[types == PARTIAL])
        packed.append(bits)
        hashes.append(_block_hashes(bits, xp))
    if sum(int(p.size) for p in partial) == 0:
        return None, None
    pool, inverse = _deduplicate(xp.concatenate(packed), xp.concatenate(hashes), xp)
    pidx_grid = xp.zeros(grid.shape, dtype=np.int32)
    pidx_grid.reshape(-1)[xp.concatenate(partial)] = inverse
    return pidx_grid, pool


def _classify_elements(mask_mod, coords, q_len, kv_len, qbs, kbs, xp):
    """Types ([K] int8) of the K blocks at ``coords`` (b, h, q block, kv block) from their elements,
    and the packed bits of the PARTIAL ones."""
    b, h, qb, kb = coords
    q = (qb * qbs)[:, None, None] + xp.arange(qbs)[None, :, None]
    kv = (kb * kbs)[:, None, None] + xp.arange(kbs)[None, None, :]
    # Positions past the sequence end don't exist: evaluate at clamped indices (lookup tables stay
    # in range), then drop them, so only real positions decide the type and the pool's tail is 0.
    valid = (q < q_len) & (kv < kv_len)
    allowed = mask_mod(b[:, None, None], h[:, None, None], xp.minimum(q, q_len - 1), xp.minimum(kv, kv_len - 1))
    allowed = xp.asarray(allowed, dtype=bool) & valid
    n_allowed = allowed.sum(axis=(1, 2))
    n_valid = xp.minimum(q_len - qb * qbs, qbs) * xp.minimum(kv_len - kb * kbs, kbs)
    is_causal = (allowed == (valid & (q >= kv))).all(axis=(1, 2))
    types = xp.where(n_allowed == 0, MASKED, xp.where(n_allowed == n_valid, FULL,
                                                      xp.where(is_causal, CAUSAL, PARTIAL))).astype(np.int8)
    return types, _pack_bits(allowed[types == PARTIAL], xp)


def _pack_bits(blocks, xp):
    """[P, QBS, KBS] bool -> [P, QBS, KBS/32] uint32 with bit c of word w = column 32w + c."""
    p, rows, cols = blocks.shape
    words = blocks.reshape(p, rows, cols // 32, 32).astype(np.uint32)
    return (words << xp.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)


@functools.lru_cache(maxsize=8)
def _hash_multipliers(n_words: int) -> np.ndarray:
    """Odd 64-bit multipliers, one per word of a packed block. Fixed, so the pool's order is the
    same on every path and in NumPy and CuPy."""
    return np.random.default_rng(0x6F6D6E69).integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1)


def _block_hashes(packed, xp):
    """A 64-bit hash of each packed block: sum of word * multiplier, mod 2**64."""
    words = packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])
    return (words.astype(np.uint64) * xp.asarray(_hash_multipliers(words.shape[1]))).sum(axis=1, dtype=np.uint64)


def _deduplicate(packed, hashes, xp):
    """Identical partial blocks share one pool entry (pool in hash order). Blocks are grouped by hash,
    then each is compared with its group's representative; a hash collision falls back to an exact
    row-wise unique on the host. Returns (pool [P, QBS, W] uint32, pool index of each block [n] int32)."""
    rows = packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])
    _, first, inverse = xp.unique(hashes, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if not bool(xp.all(rows == rows[first[inverse]])):
        _, first, inverse = np.unique(arrays.to_numpy(rows), axis=0, return_index=True, return_inverse=True)
        first, inverse = xp.asarray(first), xp.asarray(inverse.reshape(-1))
    return packed[first], inverse.astype(np.int32)


def _compact(grid, pidx_grid, xp):
    """Flex's layout from a block-type grid: each row's non-MASKED kv blocks in increasing kv order,
    inactive slots 0 (the arrays ``BlockMask.from_block_types`` makes), in O(active blocks) with NumPy
    or CuPy. Returns kv_num_blocks, kv_indices, block_mask_types, partial_block_mask_indices."""
    nkvb = grid.shape[3]
    active = grid != MASKED
    nb = active.sum(axis=-1, dtype=np.int32)
    maxb = max(int(nb.max()), 1)
    at = xp.flatnonzero(active)  # row by row, kv increasing within a row
    row, kv = at // nkvb, at % nkvb
    row_start = xp.cumsum(nb.reshape(-1), dtype=np.int64) - nb.reshape(-1)
    slot_at = row * maxb + (xp.arange(at.size) - row_start[row])

    def scatter(values):
        out = xp.zeros(grid.shape[:3] + (maxb,), dtype=np.int32)
        out.reshape(-1)[slot_at] = values
        return out

    pidx = None if pidx_grid is None else scatter(pidx_grid.reshape(-1)[at])
    return nb, scatter(kv), scatter(grid.reshape(-1)[at]), pidx


__all__ = ["from_mask_mod", "from_dense", "from_flex", "default_array_module", "CHUNK_ELEMENTS"]
