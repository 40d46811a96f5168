"""Issue 39's mask families at block granularity, for the scaling model's table at up to 1M tokens.

Knows: each family's allowed keys as a few intervals per query row (causal, sliding window 4096,
packed documents of 256-2048 tokens, prefix-LM N/4, interleaved text 512 / image 576, 64 global
tokens + window 2048, 64 leading always-visible tokens + window 2048, a shared prefix N/8 read by
sequences of N/16, Flamingo-like cross attention, random blocks at 10 % and 50 %). Does not
evaluate elements: a block is listed when some row of its q block reaches it (FULL, CAUSAL on the
diagonal of causal families), which is exact at the block level for every family but the image
gaps of the cross attention (taken as causal text). The tests build the same families element by
element (tests/support/distributed_cases.py); this module exists so that ``python -m
omnicupy.distributed.model --families`` runs in seconds on a laptop.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import BlockMask, BlockType

NAMES = ("causal", "sliding_window", "document", "prefix_lm", "interleaved", "global_window", "sink_window",
         "shared_prefix", "cross_attention", "random_10", "random_50")
GLOBAL_TOKENS, WINDOW = 64, 2048

Intervals = Callable[[np.ndarray, np.ndarray], list]  # (first row, one past last row) of each q block -> [(lo, hi)]


def _segments_end(n: int, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(sizes)
    ends = ends[: int(np.searchsorted(ends, n)) + 1]
    ends[-1] = n
    return ends - np.diff(ends, prepend=0), ends


def intervals(name: str, n: int, seed: int = 0) -> Intervals:
    """The family's kv intervals reached by the rows [a, b) of each q block (a and b arrays)."""
    zero = lambda a: np.zeros_like(a)  # noqa: E731
    if name == "causal" or name == "cross_attention":
        return lambda a, b: [(zero(a), b)]
    if name == "sliding_window":
        return lambda a, b: [(np.maximum(a - 2 * WINDOW + 1, 0), b)]
    if name == "prefix_lm":
        return lambda a, b: [(zero(a), np.maximum(b, n // 4))]
    if name in ("document", "shared_prefix", "interleaved"):
        if name == "document":
            sizes = np.random.default_rng(seed).integers(256, 2049, size=n // 256 + 2)
        elif name == "shared_prefix":
            sizes = np.concatenate([[n // 8], np.full(n // max(n // 16, 64) + 2, max(n // 16, 64))])
        else:
            sizes = np.tile([512, 576], n // 1088 + 2)
        starts, ends = _segments_end(n, sizes)

        def seg(rows):
            return np.searchsorted(ends, rows, side="right")

        if name == "interleaved":  # image rows (odd segments) reach their image's end
            def reach(a, b):
                last = seg(b - 1)
                return [(zero(a), np.where(last % 2 == 1, np.maximum(ends[last], b), b))]
            return reach
        if name == "document":
            return lambda a, b: [(starts[seg(a)], b)]
        prompt = n // 8
        return lambda a, b: [(zero(a), np.minimum(b, prompt)), (np.where(a < prompt, 0, starts[seg(a)]), b)]
    if name in ("global_window", "sink_window"):
        def reach(a, b):
            window = (np.maximum(a - WINDOW + 1, 0), b)
            cols = (zero(a), np.minimum(GLOBAL_TOKENS, b))
            rows = (zero(a), np.where(a < GLOBAL_TOKENS, n, 0))  # global rows reach everything
            return [window, cols] + ([rows] if name == "global_window" else [])
        return reach
    raise ValueError(f"unknown family {name!r}; choose from {NAMES}")


def block_mask(name: str, n: int, block: int, seed: int = 0) -> BlockMask:
    """The family at length n as a BlockMask of ``block``-token blocks (block-level: see the module)."""
    nb = -(-n // block)
    if name.startswith("random_"):
        grid = np.random.default_rng(seed).random((nb, nb)) < int(name.split("_")[1]) / 100
        grid[np.arange(nb), np.arange(nb)] = True
        types = np.where(grid, int(BlockType.FULL), int(BlockType.MASKED))
    else:
        a = np.arange(nb) * block
        b = np.minimum(a + block, n)
        kv_lo = np.arange(nb) * block
        kv_hi = np.minimum(kv_lo + block, n)
        reached = np.zeros((nb, nb), dtype=bool)
        for lo, hi in intervals(name, n, seed)(a, b):
            reached |= (kv_lo[None, :] < hi[:, None]) & (kv_hi[None, :] > lo[:, None])
        types = np.where(reached, int(BlockType.FULL), int(BlockType.MASKED))
        if name in ("causal", "document", "cross_attention", "shared_prefix", "sliding_window"):
            types[np.arange(nb), np.arange(nb)] = int(BlockType.CAUSAL)
    return BlockMask.from_block_types(types[None, None], q_len=n, kv_len=n, q_block_size=block, kv_block_size=block)


__all__ = ["NAMES", "intervals", "block_mask", "GLOBAL_TOKENS", "WINDOW"]
