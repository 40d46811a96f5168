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


# ------------------------------------------------------------------ issue 39's mask families
#: Issue 39's families, in its order (the benchmark's and the plan tests' names).
FAMILIES = ("causal", "sliding_window", "document", "prefix_lm", "interleaved", "global_window", "sink_window",
            "shared_prefix", "cross_attention", "random_10", "random_50")
GLOBAL_TOKENS, WINDOW = 64, 2048


def family_mod(name: str, n: int, seed: int = 0):
    """The mask_mod of a family at length n (random blocks have none: see ``family_mask``). Sizes
    shrink with n so that small test sequences keep the family's shape."""
    window = min(WINDOW, max(n // 16, 64))
    glob = min(GLOBAL_TOKENS, max(n // 64, 8))
    if name == "causal":
        return masks.causal()
    if name == "sliding_window":
        return masks.sliding_window(2 * window)
    if name == "document":
        return issue_mask("document", n, seed) if n >= 8192 else masks.document(
            masks.doc_ids_from_lengths(np.random.default_rng(seed).integers(40, 401, size=n // 40 + 1))[:n])
    if name == "prefix_lm":
        return masks.prefix_lm(n // 4)
    if name == "interleaved":
        return masks.interleaved(alternating_segments(n, *((512, 576) if n >= 8192 else (90, 140))))
    if name == "global_window":  # the first tokens see and are seen by every token, the rest a causal window
        return masks.or_masks(masks.sliding_window(window), _rows_below(glob), _cols_below(glob))
    if name == "sink_window":  # StreamingLLM: leading tokens always visible (causally), a causal window
        return masks.or_masks(masks.sliding_window(window), masks.and_masks(_cols_below(glob), masks.causal()))
    if name == "shared_prefix":  # one prompt, then sequences that each read it and themselves causally
        prompt = n // 8
        ids = np.concatenate([np.zeros(prompt, np.int64), 1 + np.arange(n - prompt) // max(n // 16, 64)])
        return masks.and_masks(masks.causal(), masks.or_masks(_cols_below(prompt), masks.document(ids)))
    if name == "cross_attention":  # Flamingo-like: [image, text] chunks; text reads all text causally and its image
        image, chunk = (256, 2048) if n >= 8192 else (32, 256)
        return _flamingo(image, chunk)
    raise ValueError(name)


def _rows_below(count: int):
    def global_rows(b, h, q_idx, kv_idx):
        """q_idx < count"""
        return (q_idx < count) & (kv_idx >= 0)

    return masks.MaskMod(global_rows, f"global_rows_{count}")


def _cols_below(count: int):
    def global_cols(b, h, q_idx, kv_idx):
        """kv_idx < count"""
        return (kv_idx < count) & (q_idx >= 0)

    return masks.MaskMod(global_cols, f"global_cols_{count}")


def _flamingo(image: int, chunk: int):
    def cross_attention(b, h, q_idx, kv_idx):
        """text q: (text kv and kv <= q) or kv in its chunk's image; image q: its own image"""
        q_text, kv_text = q_idx % chunk >= image, kv_idx % chunk >= image
        same_chunk = q_idx // chunk == kv_idx // chunk
        text = q_text & ((kv_text & (kv_idx <= q_idx)) | (~kv_text & same_chunk))
        return text | (~q_text & ~kv_text & same_chunk)

    return masks.MaskMod(cross_attention, f"cross_attention_{image}_{chunk}")


def random_blocks(n: int, density: float, seed: int = 0, block: int = 128):
    """FULL blocks at ``density`` (the diagonal always: no empty row), from a seeded grid."""
    from omnicupy import BlockMask, BlockType

    nb = -(-n // block)
    grid = np.random.default_rng(seed).random((nb, nb)) < density
    grid[np.arange(nb), np.arange(nb)] = True
    types = np.where(grid, int(BlockType.FULL), int(BlockType.MASKED))[None, None]
    return BlockMask.from_block_types(types, q_len=n, kv_len=n, q_block_size=block, kv_block_size=block)


def family_mask(name: str, n: int, seed: int = 0, block: int = 128):
    """Host BlockMask of a family (elementwise evaluation: keep n to a few thousand, except for
    ``global_window_large``)."""
    if name.startswith("random_"):
        return random_blocks(n, int(name.split("_")[1]) / 100, seed, block)
    return host_mask(family_mod(name, n, seed), n, q_block_size=block, kv_block_size=block)


def global_window_large(n: int = 131072, glob: int = GLOBAL_TOKENS, window: int = WINDOW):
    """The issue's mask (64 global tokens + a causal window of 2048) at large n, exact, built in
    about a second: the window's structured build, with the first q block row and kv block column
    (where the global tokens live) evaluated densely and written back."""
    from omnicupy import BlockMask, BlockType

    base = host_mask(masks.sliding_window(window), n)
    blk = 128
    nb = -(-n // blk)
    grid = base.block_grid()[0, 0].astype(np.int32)  # the window's types (CAUSAL on the diagonal)
    pool = [np.asarray(base.partial_block_masks)] if base.partial_block_masks is not None else []
    pidx_grid = np.zeros_like(grid)
    if base.partial_block_mask_indices is not None:
        listed = np.arange(base.kv_indices.shape[-1]) < np.asarray(base.kv_num_blocks)[0, 0][:, None]
        rows, slots = np.nonzero(listed)
        pidx_grid[rows, np.asarray(base.kv_indices)[0, 0][rows, slots]] = \
            np.asarray(base.partial_block_mask_indices)[0, 0][rows, slots]
    used = sum(p.shape[0] for p in pool)
    pos = np.arange(n)
    q_block_row = pos[:blk]
    edges = [(0, j) for j in range(nb)] + [(i, 0) for i in range(1, nb)]
    patterns = []
    for i, j in edges:
        q = (i * blk + np.arange(blk))[:, None]
        kv = (j * blk + np.arange(blk))[None, :]
        allowed = ((q >= kv) & (q - kv < window)) | (q < glob) | (kv < glob)
        allowed &= (q < n) & (kv < n)
        if allowed.all():
            grid[i, j] = BlockType.FULL
        elif not allowed.any():
            grid[i, j] = BlockType.MASKED
        else:
            grid[i, j] = BlockType.PARTIAL
            pidx_grid[i, j] = used + len(patterns)
            patterns.append(np.packbits(allowed, axis=-1, bitorder="little").view(np.uint32))
    del q_block_row
    pool_all = np.concatenate(pool + [np.stack(patterns)]) if patterns else (pool[0] if pool else None)
    return BlockMask.from_block_types(grid[None, None], q_len=n, kv_len=n, partial_grid=pidx_grid[None, None],
                                      partial_block_masks=pool_all)
