"""Masks for the omnicupy.distributed tests, built on the host whatever the machine.

``host_mask`` finds the builders where they live (``omnicupy.mask.builders`` after the package's
reorganization, ``omnicupy.builders`` before) and builds with NumPy, so plans and sub-masks are
compared with dense masks on the host even on a GPU machine.
"""
from __future__ import annotations

import numpy as np

from omnicupy import masks

from mask_cases import alternating_segments

try:
    from omnicupy.mask import builders
except ImportError:  # the layout before omnicupy.mask
    from omnicupy import builders


def host_mask(mask_mod, n: int, *, B=None, H=None, q_block_size: int = 128, kv_block_size: int = 128):
    """BlockMask of ``mask_mod`` for one sequence of ``n`` tokens, metadata in NumPy."""
    return builders.from_mask_mod(mask_mod, B, H, n, n, q_block_size=q_block_size, kv_block_size=kv_block_size,
                                  xp=np)


def issue_mask(name: str, n: int, seed: int = 0):
    """Issue 18's masks: causal, documents of 256-2048 tokens, sliding window 4096, text 512 / image 576."""
    if name == "causal":
        return masks.causal()
    if name == "document":
        lengths = np.random.default_rng(seed).integers(256, 2049, size=n // 256 + 1)
        return masks.document(masks.doc_ids_from_lengths(lengths)[:n])
    if name == "sliding_window_4096":
        return masks.sliding_window(4096)
    if name == "interleaved":
        return masks.interleaved(alternating_segments(n, 512, 576))
    raise ValueError(name)
