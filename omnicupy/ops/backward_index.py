"""The transposed block index the backward kernel walks: for each kv block, the q blocks that list it.

The forward metadata lists, per (batch, head, q block), the kv blocks to visit. The backward
kernel owns a kv tile and needs the transpose: per (batch, head, kv block) the q blocks whose rows
list it, in increasing q order, with the block type and partial-pool index of each pair. For
``deterministic=True`` each pair also gets its rank: how many kv tiles of earlier kv blocks the
q block's row lists, which is the pair's turn in the fixed order of dQ accumulation.

Built on the device from ``BlockMask.device_metadata()`` with a handful of CuPy array operations
over the dense [rows, nQB, nKVB] block grid (linear in the number of block pairs; no host round
trip), and cached on the BlockMask per device (ranks also per kv tile width). Knows the metadata
layout; knows nothing of kernels or launches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import arrays
from ..mask import BlockMask, BlockType, cdiv


@dataclass(frozen=True)
class BackwardIndex:
    """Contiguous int32 CuPy arrays; row ``(b, h, kv block)`` is ``b * row_stride_batch +
    h * row_stride_head + kv_block`` (0 strides where the mask broadcasts), ``width`` slots per row."""

    q_num_blocks: Any  # [rows]: listed q blocks of this kv block
    q_indices: Any  # [rows, width]: q block per slot, increasing
    q_types: Any  # [rows, width]: BlockType per slot
    q_partial_index: Any  # [rows, width] or None: index into the partial pool
    row_stride_batch: int
    row_stride_head: int
    width: int
    #: (listed [Bs, Hs, nKVB, nQB] bool, flat slot of each grid cell): what the ranks are derived from
    grid: Any = None


def _cache(bm: BlockMask) -> dict:
    return bm._backward_index


def backward_index(bm: BlockMask) -> BackwardIndex:
    """The transposed index of ``bm`` on the current device (built once per device)."""
    cp = arrays.cupy_module()
    key = ("index", cp.cuda.runtime.getDevice())
    cache = _cache(bm)
    if key not in cache:
        meta = bm.device_metadata()
        cache[key] = transpose(meta.kv_num_blocks, meta.kv_indices, meta.block_mask_types,
                               meta.partial_block_mask_indices, bm.num_kv_blocks)
    return cache[key]


def dq_ranks(bm: BlockMask, kv_tile: int) -> Any:
    """The device ranks of ``ranks()`` for ``bm``'s transposed index, cached per device and tile width."""
    cp = arrays.cupy_module()
    key = ("ranks", cp.cuda.runtime.getDevice(), kv_tile)
    cache = _cache(bm)
    if key not in cache:
        cache[key] = ranks(backward_index(bm), bm.kv_len, bm.kv_block_size, kv_tile)
    return cache[key]


def transpose(nb, idx, types, pidx, num_kv_blocks: int) -> BackwardIndex:
    """The transposed index of forward metadata (NumPy or CuPy arrays, [Bs, Hs, nQB(, maxB)]); the
    result lives where the inputs do."""
    xp = arrays.array_namespace(idx)
    Bs, Hs, nqb, maxb = (int(n) for n in idx.shape)
    nkvb = num_kv_blocks
    # Scatter every listed (q block, kv block) pair into the dense transposed grid [Bs, Hs, nKVB, nQB];
    # unlisted slots (and MASKED entries, which the kernels skip) land in a spare kv row nKVB.
    listed = (xp.arange(maxb, dtype=np.int32)[None, None, None, :] < nb[..., None]) & (types != int(BlockType.MASKED))
    kv = xp.where(listed, idx, nkvb).astype(np.int64)
    b = xp.arange(Bs, dtype=np.int64)[:, None, None, None]
    h = xp.arange(Hs, dtype=np.int64)[None, :, None, None]
    q = xp.arange(nqb, dtype=np.int64)[None, None, :, None]
    at = (((b * Hs + h) * (nkvb + 1) + kv) * nqb + q).ravel()
    grid_type = xp.zeros((Bs, Hs, nkvb + 1, nqb), dtype=np.int32)
    grid_type.reshape(-1)[at] = xp.where(listed, types, 0).astype(np.int32).ravel()
    grid_type = grid_type[:, :, :nkvb]
    grid_pidx = None
    if pidx is not None:
        grid_pidx = xp.zeros((Bs, Hs, nkvb + 1, nqb), dtype=np.int32)
        grid_pidx.reshape(-1)[at] = xp.asarray(pidx, dtype=np.int32).ravel()
        grid_pidx = grid_pidx[:, :, :nkvb]

    # Compact each kv block's row: the listed q blocks, in increasing order, to the front.
    present = grid_type != 0
    counts = present.sum(axis=-1, dtype=np.int32)
    slot = xp.where(present, xp.cumsum(present, axis=-1, dtype=np.int32) - 1, nqb)  # spare slot nqb
    width = nqb + 1
    rows = Bs * Hs * nkvb
    flat = (xp.arange(rows, dtype=np.int64).reshape(Bs, Hs, nkvb, 1) * width + slot).ravel()

    def compact(values):
        out = xp.zeros((rows, width), dtype=np.int32)
        out.reshape(-1)[flat] = values.ravel()
        return out

    q_blocks = xp.broadcast_to(xp.arange(nqb, dtype=np.int32), grid_type.shape)
    return BackwardIndex(
        q_num_blocks=xp.ascontiguousarray(counts.reshape(rows)),
        q_indices=compact(q_blocks),
        q_types=compact(grid_type),
        q_partial_index=None if grid_pidx is None else compact(grid_pidx),
        row_stride_batch=Hs * nkvb if Bs > 1 else 0,
        row_stride_head=nkvb if Hs > 1 else 0,
        width=width,
        grid=(present, flat),
    )


def ranks(index: BackwardIndex, kv_len: int, kv_block_size: int, kv_tile: int):
    """[rows, width] int32: the turn of the first kv tile of each listed (kv block, q block) pair in
    the deterministic dQ sum of each q tile of that q block, where the kv tiles listed in the q
    block's row add in DECREASING kv order: the number of kv tiles (of width ``kv_tile``) of the
    row's later kv blocks, plus this block's tiles after the first. Tile ``t`` of the block takes
    turn ``rank - t``.

    Why decreasing: the kernel launches the last kv tile first and every CTA walks its q tiles in
    increasing order, so under a causal mask kv tile j reaches q tile i just after kv tile j + 1 has
    left it: nobody waits. In increasing order kv tile j would wait at its first q tile for every
    earlier kv tile to arrive there, serializing the launch (measured 2x slower, causal, H200)."""
    present, flat = index.grid
    xp = arrays.array_namespace(present)
    nkvb = int(present.shape[2])
    tiles_per_block = kv_block_size // kv_tile
    kv_tiles = cdiv(kv_len, kv_tile)
    # kv tiles that exist in each kv block (the last block may be cut by kv_len)
    tiles = xp.minimum(tiles_per_block, kv_tiles - xp.arange(nkvb, dtype=np.int32) * tiles_per_block)
    per_block = present.astype(np.int32) * tiles.astype(np.int32)[None, None, :, None]  # [Bs, Hs, nKVB, nQB]
    # tiles of this and every later listed kv block, minus one: the turn of this block's first tile
    from_here = xp.flip(xp.cumsum(xp.flip(per_block, axis=2), axis=2, dtype=np.int32), axis=2) - 1
    out = xp.zeros(index.q_indices.shape, dtype=np.int32)
    out.reshape(-1)[flat] = from_here.ravel()
    return out


__all__ = ["BackwardIndex", "backward_index", "dq_ranks", "transpose", "ranks"]
