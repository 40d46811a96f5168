"""Builders of BlockMask metadata (docs/design.md): from a mask_mod, a dense mask, flex-attention's arrays.

All three end the same way, from block rows given as runs: for each (b, h, q block), from kv block
``first`` on, runs of blocks of one type, some EVALUATE. For a mask_mod with known structure a row is
four runs around the allowed keys, in which only the blocks an interval end cuts are EVALUATE
(``MaskMod.block_runs``); for an opaque one every block is; for flex, the blocks it calls partial.
Those are classified by evaluating the mask_mod on their elements; partial blocks are bit-packed and
deduplicated into the pool; the rows are laid out in flex's layout.

Where the work runs: the host works per run and per evaluated block (O(nQB + cut blocks) for a
structured mask, with NumPy, where each step costs microseconds), never per slot of the
[nQB, maxB] layout. The array module ``xp`` (CuPy on the GPU when one is usable) does everything
per element or per slot: it evaluates the EVALUATE blocks (chunk by chunk, so that peak memory stays
bounded whatever N is), classifies and hashes them, gathers the pool, and writes the layout from
one small table per build. Per build on a device: one transfer of the blocks' coordinates, per chunk
one transfer of their types and hashes back, one of pool indices (and one flag back when some blocks
share a hash), one of the layout's table; no array of the metadata's size crosses the bus.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError
from . import zoo
from .block_mask import BlockMask, _as_index_array, _check_positive_int
from .mask_mod import CAUSAL, EVALUATE, FULL, MASKED, LookupTable, MaskMod
from .types import KV_BLOCK_MULTIPLE, Q_BLOCK_MULTIPLE, BlockType, MaskFeatures, cdiv

PARTIAL = int(BlockType.PARTIAL)

#: Elements evaluated at once (one chunk of blocks) on the host. The chunk's int64 temporaries
#: inside a mask_mod take 8 bytes per element, so this bounds the builders' peak memory near 100 MB.
CHUNK_ELEMENTS = 1 << 22
#: The same on a device, where a chunk costs a round trip: 64M elements (4096 blocks of 128 x 128)
#: take the cut blocks of every built-in mask at N = 131072 at once, with int64 temporaries of
#: 512 MB at most.
DEVICE_CHUNK_ELEMENTS = 1 << 26

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


def full(q_len: int, kv_len: int, *, q_block_size: int = 128, kv_block_size: int = 128) -> BlockMask:
    """Every query attends to every key."""
    return _from_block_rule(*_check_sizes(q_len, kv_len, q_block_size, kv_block_size), causal=False)


def causal(q_len: int, kv_len: int, *, bottom_right: bool = False, q_block_size: int = 128,
           kv_block_size: int = 128) -> BlockMask:
    """``q_idx >= kv_idx`` (top-left aligned, flex-attention's convention), or with
    ``bottom_right`` ``q_idx + kv_len - q_len >= kv_idx`` (the last query sees the last key,
    FlashAttention-2's convention for prefill against a KV cache)."""
    q_len, kv_len, qbs, kbs = _check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    offset = kv_len - q_len if bottom_right else 0
    if offset == 0:
        return _from_block_rule(q_len, kv_len, qbs, kbs, causal=True)
    # The shifted diagonal is not the CAUSAL block pattern: its blocks become PARTIAL, built by
    # the structured path (and evaluable in the kernel from the mask's expression).
    return from_mask_mod(zoo.causal(offset), None, None, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs)


def _from_block_rule(q_len: int, kv_len: int, q_block_size: int, kv_block_size: int, *, causal: bool) -> BlockMask:
    nqb, nkvb = cdiv(q_len, q_block_size), cdiv(kv_len, kv_block_size)
    q_lo = np.arange(nqb)[:, None] * q_block_size
    q_hi = np.minimum(q_lo + q_block_size, q_len) - 1
    kv_lo = np.arange(nkvb)[None, :] * kv_block_size
    kv_hi = np.minimum(kv_lo + kv_block_size, kv_len) - 1
    if causal:
        types = np.where(q_lo >= kv_hi, BlockType.FULL, np.where(q_hi >= kv_lo, BlockType.CAUSAL, BlockType.MASKED))
    else:
        types = np.full((nqb, nkvb), BlockType.FULL)
    return BlockMask.from_block_types(types[None, None], q_len=q_len, kv_len=kv_len,
                                      q_block_size=q_block_size, kv_block_size=kv_block_size)


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
    runs = None
    if isinstance(mask_mod, MaskMod):
        mask_mod.check_extent(B, q_len, kv_len)
        if use_structure:
            runs = mask_mod.block_runs(Bm, Hm, q_len, kv_len, qbs, kbs)
    if runs is None:  # every row is one run of blocks to evaluate
        nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
        runs = np.zeros((Bm, Hm, nqb), dtype=np.int64), nkvb, np.full((Bm, Hm, nqb, 1), EVALUATE, dtype=np.int8)
    return _build(*runs, mask_mod, (Bm, Hm), q_len, kv_len, qbs, kbs, default_array_module() if xp is None else xp)


def from_dense(mask: Any, *, q_block_size: int = 128, kv_block_size: int = 128) -> BlockMask:
    """Block metadata for a boolean mask ``[B|1, H|1, Nq, Nkv]`` (NumPy, CuPy or DLPack); the work
    runs where the mask lives."""
    mask = _as_array(mask, "mask")
    mod = zoo.dense(mask)  # validates the mask
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
    if isinstance(mask_mod, MaskMod):
        mask_mod.check_extent(shape[0], q_len, kv_len)
    types = np.zeros(shape, dtype=np.int8)
    types.reshape(-1)[listed[0]] = EVALUATE
    if len(listed) > 1:
        types.reshape(-1)[listed[1]] = FULL
    return _build(np.zeros(shape[:3], dtype=np.int64), 1, types, mask_mod, shape[:2], q_len, kv_len, qbs, kbs, xp)


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
def _build(first, lengths, kinds, mask_mod, batch_heads: tuple[int, int], q_len: int, kv_len: int, qbs: int,
           kbs: int, xp: Any):
    """Block rows given as runs -> BlockMask broadcast to ``batch_heads``, its arrays in ``xp``.

    ``first`` [Bs, Hs, nQB]; ``lengths`` and ``kinds`` [Bs, Hs, nQB, n] (``lengths`` may broadcast):
    from kv block ``first`` on, each row is ``lengths[..., i]`` blocks of type ``kinds[..., i]``, in
    increasing kv order. The blocks of EVALUATE runs are evaluated, the PARTIAL ones pooled; every
    other run stays one item, so the host's work is O(runs + evaluated blocks), never O(nQB * maxB):
    the dense rows are written where the metadata lives (``_layout``)."""
    grid = first.shape
    n = kinds.shape[-1]
    lengths = np.broadcast_to(lengths, grid + (n,)).reshape(-1, n).astype(np.int64)
    starts = (first.reshape(-1, 1) + np.cumsum(lengths, axis=1) - lengths).reshape(-1)
    lengths, kinds = lengths.reshape(-1), kinds.reshape(-1)
    # Items: one per block of an EVALUATE run, one per other non-empty run that is not MASKED; in
    # (row, kv) order, so the evaluation (and the pool) follows C order over the block grid.
    evaluate = kinds == EVALUATE
    runs = np.flatnonzero(np.where(evaluate, lengths, (kinds != MASKED) & (lengths > 0)))
    count = np.where(evaluate[runs], lengths[runs], 1)
    run = np.repeat(runs, count)
    offset = np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    row, kv, kind = run // n, starts[run] + offset, kinds[run].astype(np.int8)
    length = np.where(evaluate[run], 1, lengths[run])
    at = np.flatnonzero(evaluate[run])
    pidx = pool = None
    if at.size:
        xp = _evaluation_module(mask_mod, xp)
        b, h, qb = np.unravel_index(row[at], grid)
        types, pool, pool_index = _evaluate_blocks(mask_mod, b, h, qb * qbs, kv[at] * kbs, q_len, kv_len, qbs, kbs,
                                                   xp)
        kind[at] = types
        if pool is not None:
            pidx = np.zeros(len(kind), dtype=np.int32)
            pidx[at[types == PARTIAL]] = pool_index
    # Valid by construction (rows strictly increase, every index is in range): BlockMask checks the
    # shapes only, not the values.
    features = MaskFeatures(causal=bool(np.any(kind == CAUSAL)), partial=pool is not None)
    nb, idx, types, pidx = _layout(grid, row, kv, length, kind, pidx, xp)
    # Rows computed for one (b, h) stand for all of them: zero-stride views, no copies.
    nb, idx, types, pidx = (None if a is None else xp.broadcast_to(a, batch_heads + a.shape[2:])
                            for a in (nb, idx, types, pidx))
    return BlockMask(nb, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=pidx, partial_block_masks=pool, mask_mod=mask_mod,
                     _features=features)


def _evaluate_blocks(mask_mod, b, h, q0, kv0, q_len, kv_len, qbs, kbs, xp):
    """Types ([K] int8, host) of the K blocks whose first element is (q0, kv0), from their elements,
    in chunks; the deduplicated pool of the PARTIAL ones' bits (in ``xp``) and each one's index
    into it ([n] int32, host), or Nones. The bits stay where they were evaluated: per chunk, the
    host gets the blocks' types and hashes back (one transfer), and the pool is gathered in ``xp``."""
    k = len(b)
    per_chunk = max(1, (CHUNK_ELEMENTS if xp is np else DEVICE_CHUNK_ELEMENTS) // (qbs * kbs))
    chunks = [(lo, min(lo + per_chunk, k)) for lo in range(0, k, per_chunk)]
    # Per chunk, the blocks with positions past the sequence ends and those the diagonal crosses: the
    # only ones whose type takes more than a min and a max. Sent with the coordinates: one transfer.
    subsets = []
    for lo, hi in chunks:
        q, kv = q0[lo:hi], kv0[lo:hi]
        subsets += [np.flatnonzero((q + qbs > q_len) | (kv + kbs > kv_len)),
                    np.flatnonzero((q + qbs > kv) & (q < kv + kbs))]
    at = xp.asarray(np.concatenate([np.stack([b, h, q0, kv0], axis=1).reshape(-1)] + subsets).astype(np.int64))
    ends = np.cumsum([4 * k] + [len(s) for s in subsets])
    subsets = [at[lo:hi] for lo, hi in zip(ends[:-1], ends[1:])]
    at = at[:4 * k].reshape(k, 4)
    types, hashes, kept = [], [], []
    for i, (lo, hi) in enumerate(chunks):
        chunk = at[lo:hi]
        bits = _element_bits(mask_mod, chunk, q_len, kv_len, qbs, kbs, xp)
        # Types first: they clear the bits past the ends, which the hashes and the pool must not see.
        kinds = _block_types(bits, chunk[:, 2], chunk[:, 3], *subsets[2 * i:2 * i + 2], q_len, kv_len, xp)
        found = arrays.to_numpy(xp.stack([_block_hashes(bits, xp), kinds.astype(np.uint64)]))  # one transfer
        types.append(found[1].astype(np.int8))
        partial = np.flatnonzero(types[-1] == PARTIAL)
        hashes.append(found[0][partial])
        if partial.size == len(bits):
            kept.append((bits, None))
        elif partial.size and len(chunks) > 1:  # keep the partial blocks' bits only
            kept.append((bits[xp.asarray(partial)], None))
        elif partial.size:
            kept.append((bits, partial))
    types, hashes = np.concatenate(types), np.concatenate(hashes)
    if not len(hashes):
        return types, None, None
    bits, rows = kept[0] if len(kept) == 1 else (xp.concatenate([k for k, _ in kept]), None)
    return types, *_deduplicate(bits, rows, hashes, xp)


def _element_bits(mask_mod, at, q_len, kv_len, qbs, kbs, xp):
    """The element masks of K blocks as bits [K, qbs, kbs/32] uint32 in ``xp`` (bit c of word w =
    column 32w + c); ``at`` [K, 4] int64 in ``xp`` holds each block's (b, h, q0, kv0). Positions past
    the sequence ends are evaluated at clamped indices (lookup tables stay in range);
    ``_block_types`` clears them."""
    k = at.shape[0]
    q = xp.minimum(at[:, 2, None] + xp.arange(qbs), q_len - 1)
    kv = xp.minimum(at[:, 3, None] + xp.arange(kbs), kv_len - 1)
    allowed = mask_mod(at[:, 0, None, None], at[:, 1, None, None], q[:, :, None], kv[:, None, :])
    allowed = xp.broadcast_to(xp.asarray(allowed, dtype=bool), (k, qbs, kbs))
    # Little bit order: bit c of byte j is element 8j + c, so little-endian words hold column 32w + c.
    return xp.packbits(allowed, bitorder="little").view(np.uint32).reshape(k, qbs, kbs // 32)


def _block_types(bits, q0, kv0, tail, maybe, q_len, kv_len, xp):
    """MASKED, FULL, CAUSAL or PARTIAL ([K], in ``xp``) for K blocks given by their bits
    (``_element_bits``) and first elements, after clearing (in place) the bits of positions past
    the sequence ends, so only real positions decide the type and the pool's tail is 0. ``tail``
    lists the blocks with such positions, ``maybe`` those the diagonal crosses (indices in ``xp``,
    whose lengths the host knows: nothing waits for the device)."""
    k, qbs, n_words = bits.shape
    kbs = 32 * n_words
    prefix = _prefix_table(n_words).on(bits)
    rows = xp.arange(qbs)
    flat = bits.reshape(k, -1)
    if len(tail):
        real_rows = rows < (q_len - q0[tail])[:, None]
        real = prefix[xp.minimum(kv_len - kv0[tail], kbs)][:, None, :] * real_rows[:, :, None]
        bits[tail] &= real
    none = flat.max(axis=1) == 0
    full = flat.min(axis=1) == _ALL_BITS
    if len(tail):
        full[tail] = (bits[tail] == real).all(axis=(1, 2))
    # CAUSAL: each real row r allows the real columns up to its diagonal, kv <= q0 + r. (Only a block
    # the diagonal crosses can be that without being all or nothing, which take precedence.)
    causal = xp.zeros(k, dtype=bool)
    if len(maybe):
        q, kv = q0[maybe], kv0[maybe]
        real_cols = xp.minimum(kv_len - kv, kbs)[:, None]
        diagonal = xp.minimum(xp.maximum(q[:, None] + rows - kv[:, None] + 1, 0), real_cols)
        causal[maybe] = (bits[maybe] == prefix[diagonal * (rows < (q_len - q)[:, None])]).all(axis=(1, 2))
    return xp.where(none, np.int8(MASKED), xp.where(full, np.int8(FULL),
                                                     xp.where(causal, np.int8(CAUSAL), np.int8(PARTIAL))))


@functools.lru_cache(maxsize=8)
def _prefix_rows(n_words: int) -> np.ndarray:
    """``[32 * n_words + 1, n_words]`` uint32: row n is a packed row with its first n columns set."""
    n = np.arange(32 * n_words + 1)[:, None] - 32 * np.arange(n_words)
    return ((np.uint64(1) << np.clip(n, 0, 32).astype(np.uint64)) - np.uint64(1)).astype(np.uint32)


@functools.lru_cache(maxsize=8)
def _prefix_table(n_words: int) -> LookupTable:
    """``_prefix_rows`` copied once to each device that asks."""
    return LookupTable(_prefix_rows(n_words))


@functools.lru_cache(maxsize=8)
def _hash_multipliers(n_words: int) -> LookupTable:
    """Odd 64-bit multipliers, one per word of a packed block. Fixed, so the pool's order is the
    same on every path."""
    rng = np.random.default_rng(0x6F6D6E69)
    return LookupTable(rng.integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1))


def _block_hashes(packed, xp):
    """A 64-bit hash of each packed block (NumPy or CuPy): sum of word * multiplier, mod 2**64."""
    words = packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])
    return (words.astype(np.uint64) * _hash_multipliers(words.shape[1]).on(words)).sum(axis=1)


def _deduplicate(bits, rows, hashes, xp):
    """Identical partial blocks share one pool entry (pool in hash order). The blocks are
    ``bits[rows]`` (``rows`` host indices, or None: all of ``bits``) with host ``hashes``; they are
    grouped by hash, then each is compared (in ``xp``) with its group's representative; a hash
    collision falls back to an exact row-wise unique on the host. Returns (pool [P, QBS, W] uint32
    in ``xp``, pool index of each block [n] int32)."""
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    rep = first[inverse]
    dup = np.flatnonzero(rep != np.arange(len(rep)))
    at = np.concatenate([first, dup, rep[dup]])
    at = xp.asarray(at if rows is None else rows[at])  # one transfer
    p, d = len(first), len(dup)
    if not d or bool(xp.all(bits[at[p:p + d]] == bits[at[p + d:]])):
        return bits[at[:p]], inverse.astype(np.int32)
    packed = arrays.to_numpy(bits if rows is None else bits[xp.asarray(rows)])
    _, first, inverse = np.unique(packed.reshape(len(packed), -1), axis=0, return_index=True, return_inverse=True)
    return xp.asarray(packed[first]), inverse.reshape(-1).astype(np.int32)


def _layout(grid, row, kv, length, kind, pidx, xp):
    """Flex's layout (what ``BlockMask.from_block_types`` makes), written in ``xp`` from the items of
    the rows: item i is ``length[i]`` blocks of type ``kind[i]`` from kv block ``kv[i]`` on, in row
    ``row[i]`` of ``grid``, items in (row, kv) order, PARTIAL items one block long with pool index
    ``pidx[i]``. Each row lists its non-MASKED blocks in increasing kv order, then inactive slots 0.

    The host works per item; the [rows, maxB] arrays are written in ``xp`` from one transfer of
    O(items) numbers: each slot finds its segment (a run of consecutive blocks of one type), and
    its kv index is the slot's flat position plus the segment's offset. Returns kv_num_blocks,
    kv_indices, block_mask_types, partial_block_mask_indices (int32, or None)."""
    keep = kind != MASKED
    row, kv, length, kind = row[keep], kv[keep], length[keep], kind[keep]
    n_rows = int(np.prod(grid))
    nb = np.bincount(row, weights=length, minlength=n_rows).astype(np.int64)
    maxb = max(int(nb.max()), 1)
    # Flat slot (row * maxb + slot in the row) of each item's first block.
    end = np.cumsum(length)
    flat = row * maxb + end - length - (np.cumsum(nb) - nb)[row]
    # Segments: an item starts one unless it continues the previous one (same row and type, not
    # PARTIAL, the next kv block), so a run stays one segment whatever the path that listed it.
    new = np.ones(len(row), dtype=bool)
    new[1:] = ((row[1:] != row[:-1]) | (kind[1:] != kind[:-1]) | (kind[1:] == PARTIAL)
               | (kv[1:] != kv[:-1] + length[:-1]))
    seg = np.flatnonzero(new)
    last = np.append(seg[1:], len(row))[:len(seg)] - 1
    seg_start, seg_end = flat[seg], flat[last] + length[last]
    n_slots = n_rows * maxb
    dt = np.int32 if n_slots < 2**31 else np.int64
    values = [(kv - flat)[seg], kind[seg]] + ([] if pidx is None else [pidx[keep][seg]])
    if xp is np:
        # Write the slots out run by run: before each segment a gap (the previous row's slots past
        # its count, 0), then the segment.
        counts = np.empty(2 * len(seg) + 1, dtype=np.int64)
        counts[0::2] = np.append(seg_start, n_slots) - np.insert(seg_end, 0, 0)
        counts[1::2] = seg_end - seg_start

        def spread(v, dtype=dt):
            runs = np.zeros(len(counts), dtype=dtype)
            runs[1::2] = v
            return np.repeat(runs, counts)

        idx = spread(values[0])
        idx += np.arange(n_slots, dtype=dt)
        idx *= spread(True, bool)
        out = [nb, idx] + [spread(v) for v in values[1:]]
    else:
        # One transfer of O(segments) numbers: the counts, the segment starts, and per segment (past
        # a leading 0) its values. Each slot binary-searches the starts (a repeat with array counts
        # is no device operation) and gathers its segment's values; slots past a row's count, 0.
        table = np.zeros((len(values), len(seg) + 1), dtype=dt)
        table[:, 1:] = values
        meta = xp.asarray(np.concatenate([nb.astype(dt), seg_start.astype(dt), table.reshape(-1)]))
        nb, starts, table = meta[:n_rows], meta[n_rows:n_rows + len(seg)], meta[n_rows + len(seg):]
        table = table.reshape(len(values), len(seg) + 1)
        pos = xp.arange(n_slots, dtype=dt)
        active = (xp.arange(maxb, dtype=dt) < nb[:, None]).reshape(-1)
        at = xp.searchsorted(starts, pos, side="right") * active if len(seg) else xp.zeros(n_slots, dtype=dt)
        out = [nb, (pos + table[0][at]) * active] + [table[i][at] for i in range(1, len(values))]
    out += [None] * (4 - len(out))
    return tuple(None if a is None else a.reshape(grid + (maxb,) if i else grid).astype(np.int32, copy=False)
                 for i, a in enumerate(out))


__all__ = ["full", "causal", "from_mask_mod", "from_dense", "from_flex", "default_array_module", "CHUNK_ELEMENTS",
           "DEVICE_CHUNK_ELEMENTS"]
