"""A BlockMask from exact row bounds given by pieces, built on the device in two kernels.

The host path (builders.py, from a MaskMod's windows) does O(q blocks + cut blocks) NumPy work:
some hundred NumPy calls whatever N is, which is most of a build at N = 8192 and 131072 (lab/notes
§17, §22, §36). Here the device does that work (templates/mask_pieces.cu.jinja, one CTA per q block):

1. ``pieces_scan``: each q block finds its window of kv blocks from its rows' bounds, types the
   cut blocks from their row codes, counts its blocks of each type and appends (block, hash) for
   each PARTIAL one. Each PARTIAL block is also compared with the first block that claimed its
   hash (a table on the device), so that equal hashes are known to mean equal bits. Its results
   are read back: the build's one wait, on a stream of the build's own (KernelBackend.stream), so
   that it does not queue behind the caller's work.
2. the host: pool entries are the distinct hashes in ascending order, which is the pool's canonical
   order (blocks.pool_order), each with one of its blocks as representative; the summary and
   features come from the counts. A collision (equal hashes, other bits) returns None, and the
   caller builds on the host path instead.
3. ``pieces_layout``, on the caller's stream (nothing read back): each q block writes its row of
   the metadata, a PARTIAL block taking the pool entry of its hash (a binary search); one CTA per
   pool entry writes its bits from its representative.

The output equals the host path's: the same arrays, pool and summary (the CPU tests, with the
kernels emulated, and the GPU tests compare them); it keeps no RowRuns (inspection reads the
metadata). This module knows pieces, the two kernels' contracts (through kernels.Backend) and
BlockMask's constructor; the host path and its windows are builders.py's.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np

from .block_mask import BlockMask, MaskSummary
from .kernels import Backend
from .mask_mod import MaskMod
from .types import WORK_WEIGHTS, BlockType, MaskFeatures, cdiv

#: One thread per row of a q block, in CTAs of at most 256 threads (their __launch_bounds__).
MAX_Q_BLOCK_SIZE = 256
#: Records the scan has room for before it must run again with the count it found: a few PARTIAL
#: blocks per q block (every built-in mask at N = 131072 fits).
RECORDS_PER_Q_BLOCK = 4
MIN_RECORDS = 64


def applies(mask_mod: Any, backend: Optional[Backend], q_block_size: int) -> bool:
    """Whether a build of ``mask_mod`` can run here: a MaskMod with pieces, built on a device."""
    return (backend is not None and isinstance(mask_mod, MaskMod) and mask_mod.pieces is not None
            and q_block_size <= MAX_Q_BLOCK_SIZE)


#: Each MaskMod's pieces on each device it was built on: (the Pieces object, {device: array}).
_uploaded: "weakref.WeakKeyDictionary[MaskMod, tuple[Any, dict]]" = weakref.WeakKeyDictionary()


def _device_table(backend: Backend, mask_mod: MaskMod) -> tuple[Any, int]:
    """``table(mask_mod)`` on the device, uploaded once per MaskMod and device; and the piece count."""
    pieces = mask_mod.pieces
    known = _uploaded.get(mask_mod)
    if known is None or known[0] is not pieces:
        known = (pieces, {})
        _uploaded[mask_mod] = known
    device = backend.device_id()
    if device not in known[1]:
        known[1][device] = backend.upload(table(mask_mod))
    return known[1][device], len(pieces.q)


def table(mask_mod: MaskMod) -> np.ndarray:
    """The pieces as the kernels read them: ``[5 * P]`` int64, the rows q, start, start_slope, end,
    end_slope one after the other."""
    p = mask_mod.pieces
    return np.concatenate([p.q, p.start, p.start_slope, p.end, p.end_slope]).astype(np.int64)


def build(backend: Backend, mask_mod: MaskMod, batch_heads: tuple[int, int], q_len: int, kv_len: int,
          qbs: int, kbs: int) -> Optional[BlockMask]:
    """The BlockMask of ``mask_mod`` (broadcast to ``batch_heads``), or None after a hash collision."""
    nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
    sizes = (q_len, kv_len, qbs, kbs)
    with backend.stream():
        pieces, piece_count = _device_table(backend, mask_mod)
        capacity = RECORDS_PER_Q_BLOCK * nqb + MIN_RECORDS
        scan = backend.pieces_scan(pieces, piece_count, sizes, capacity)
        if int(scan[0]) > capacity:  # more PARTIAL blocks than room: again, with room for all
            capacity = int(scan[0])
            scan = backend.pieces_scan(pieces, piece_count, sizes, capacity)
    if scan[1]:
        return None
    partials = int(scan[0])
    stats = scan[2:2 + 4 * nqb].reshape(nqb, 4)  # listed, FULL, CAUSAL, PARTIAL per q block
    records = scan[2 + 4 * nqb:2 + 4 * nqb + 2 * partials].reshape(partials, 2)  # (block, hash), any order
    hashes, first = np.unique(records[:, 1].view(np.uint64), return_index=True)  # ascending: the pool's order
    lookup = np.concatenate([hashes.view(np.int64), records[first, 0]])
    max_blocks = max(int(stats[:, 0].max()) if nqb else 0, 1)
    # On the caller's stream, like any other build's layout: nothing more to wait for.
    counts, idx, types, pidx, pool = backend.pieces_layout(pieces, piece_count, sizes, lookup, len(hashes), max_blocks)
    copies = batch_heads[0] * batch_heads[1]
    listed, full, causal, partial = (int(t) * copies for t in stats.sum(axis=0))
    weights = np.asarray(WORK_WEIGHTS, dtype=np.int64)[[BlockType.FULL, BlockType.CAUSAL, BlockType.PARTIAL]]
    work = (stats[:, 1:] @ weights) * copies
    summary = MaskSummary(counts=(nqb * nkvb * copies - listed, causal, full, partial), q_block_work=work)
    features = MaskFeatures(causal=causal > 0, partial=pool is not None)
    xp = backend.xp
    counts = xp.broadcast_to(counts.reshape(1, 1, nqb), batch_heads + (nqb,))
    idx, types, pidx = (None if a is None else xp.broadcast_to(a.reshape(1, 1, nqb, max_blocks),
                                                               batch_heads + (nqb, max_blocks))
                        for a in (idx, types, pidx))
    return BlockMask(counts, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=pidx, partial_block_masks=pool, mask_mod=mask_mod,
                     _features=features, _summary=summary)


__all__ = ["applies", "build", "table", "MAX_Q_BLOCK_SIZE"]
