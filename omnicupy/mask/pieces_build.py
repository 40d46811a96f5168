"""A BlockMask from exact row bounds given by pieces, built on the device in two kernels.

The host path (builders.py, from a MaskMod's windows) does O(q blocks + cut blocks) NumPy work:
some hundred NumPy calls whatever N is, which is most of a build at N = 8192 and 131072 (NOTES.md
§17, §22). Here the device does that work (templates/mask_pieces.cu.jinja, one CTA per q block):

1. ``pieces_scan``: each q block finds its window of kv blocks from its rows' bounds, types the
   cut blocks from their row codes, counts its blocks of each type and appends (block, hash) for
   each PARTIAL one. One read back (the build's first wait).
2. the host: pool entries are the distinct hashes in ascending order, which is the pool's canonical
   order (blocks.pool_order); the q blocks' PARTIAL blocks get their entries in (q block, kv block)
   order; the summary and features come from the counts.
3. ``pieces_layout``: each q block writes its row of the metadata, checking each PARTIAL block
   against its pool entry's representative; one CTA per pool entry writes its bits. One read back
   of that check (the second wait): blocks with equal hashes but other bits make the build return
   None, and the caller builds on the host path instead.

The output equals the host path's: the same arrays, pool and summary (the CPU and GPU tests
compare them). Both waits are on a stream of the build's own, so a build does not queue behind
the caller's work. This module knows pieces, the two kernels' contracts (through kernels.Backend)
and BlockMask's constructor; the host path and its windows are builders.py's.
"""
from __future__ import annotations

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
    host_table = table(mask_mod)
    piece_count = len(host_table) // 5
    with backend.stream():
        pieces = backend.upload(host_table)
        capacity = RECORDS_PER_Q_BLOCK * nqb + MIN_RECORDS
        scan = backend.pieces_scan(pieces, piece_count, sizes, capacity)
        if int(scan[0]) > capacity:  # more PARTIAL blocks than room: again, with room for all
            capacity = int(scan[0])
            scan = backend.pieces_scan(pieces, piece_count, sizes, capacity)
        partials = int(scan[0])
        stats = scan[1:1 + 4 * nqb].reshape(nqb, 4)  # listed, FULL, CAUSAL, PARTIAL per q block
        records = scan[1 + 4 * nqb:1 + 4 * nqb + 2 * partials].reshape(partials, 2)
        records = records[np.argsort(records[:, 0], kind="stable")]  # (q block, kv block) order
        hashes = np.ascontiguousarray(records[:, 1]).view(np.uint64)
        _, first, entry = np.unique(hashes, return_index=True, return_inverse=True)  # ascending hash
        offsets = np.cumsum(stats[:, 3]) - stats[:, 3]
        lookup = np.concatenate([offsets, entry.reshape(-1), records[first, 0]]).astype(np.int64)
        max_blocks = max(int(stats[:, 0].max()) if nqb else 0, 1)
        counts, idx, types, pidx, pool, differ = backend.pieces_layout(pieces, piece_count, sizes, lookup, partials,
                                                                       len(first), max_blocks)
    if differ:
        return None
    copies = batch_heads[0] * batch_heads[1]
    visited = [int(stats[:, column].sum()) * copies for column in (2, 1, 3)]  # CAUSAL, FULL, PARTIAL
    weights = np.asarray(WORK_WEIGHTS, dtype=np.int64)
    work = (stats[:, 2] * weights[BlockType.CAUSAL] + stats[:, 1] * weights[BlockType.FULL]
            + stats[:, 3] * weights[BlockType.PARTIAL]) * copies
    summary = MaskSummary(counts=(nqb * nkvb * copies - sum(visited), *visited), q_block_work=work.astype(np.int64))
    features = MaskFeatures(causal=bool(stats[:, 2].any()), partial=pool is not None)
    xp = backend.xp
    counts = xp.broadcast_to(counts.reshape(1, 1, nqb), batch_heads + (nqb,))
    idx, types, pidx = (None if a is None else xp.broadcast_to(a.reshape(1, 1, nqb, max_blocks),
                                                               batch_heads + (nqb, max_blocks))
                        for a in (idx, types, pidx))
    return BlockMask(counts, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     partial_block_mask_indices=pidx, partial_block_masks=pool, mask_mod=mask_mod,
                     _features=features, _summary=summary)


__all__ = ["applies", "build", "table", "MAX_Q_BLOCK_SIZE"]
