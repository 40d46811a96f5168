"""Mask families that FlexAttention users write (the attention-gym catalogue), each a plain Python
mask_mod ``f(b, h, q_idx, kv_idx)`` written from the published description of the pattern, so that
``compile_mask`` translates it (numbers and tables of the closure become kernel arguments). They
use NumPy's elementwise functions, which CuPy arrays take too (``__array_ufunc__``).

    mod = masks.families.neighborhood_2d(height=64, width=64, radius=3)
    bm = BlockMask.from_mask_mod(mod, None, None, 64 * 64, 64 * 64)   # compiled on the way

Unlike the zoo's MaskMods these carry no row bounds: a build evaluates them, which is what the
compiled path is for. ``EXAMPLES`` gives one instance of each family for a sequence length (tests
and benchmarks/bench_mask_families.py). Knows masks as index arithmetic; nothing of builds.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import MaskError
from .mask_mod import check_mask_int


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn


def global_sliding_window(n_global: int, window: int) -> Callable:
    """Every query sees the first ``n_global`` keys and the ``window`` keys up to itself:
    ``kv_idx < n_global | 0 <= q_idx - kv_idx < window`` (Longformer's global tokens, causal)."""
    n_global, window = check_mask_int(n_global, "n_global", 0), check_mask_int(window, "window", 1)

    def global_sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx < n_global) | ((q_idx >= kv_idx) & (q_idx - kv_idx < window))

    return _named(global_sliding_window, f"global_{n_global}_sliding_{window}")


def neighborhood_1d(radius: int) -> Callable:
    """1-D neighbourhood attention: ``|q_idx - kv_idx| <= radius`` (bidirectional)."""
    radius = check_mask_int(radius, "radius", 0)

    def neighborhood_1d(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= radius

    return _named(neighborhood_1d, f"neighborhood_1d_{radius}")


def neighborhood_2d(height: int, width: int, radius: int) -> Callable:
    """2-D neighbourhood attention on a ``height x width`` grid in row-major order: each query sees
    the ``(2 radius + 1)^2`` window around it, the window's centre moved inward at the borders so
    that it stays whole (NATTEN's rule): ``|clamp(r_q) - r_kv| <= radius`` and the same for columns."""
    height, width = check_mask_int(height, "height", 1), check_mask_int(width, "width", 1)
    radius = check_mask_int(radius, "radius", 0)
    if 2 * radius + 1 > min(height, width):
        raise MaskError(f"neighborhood_2d: a window of {2 * radius + 1} does not fit a {height}x{width} grid")
    last_row, last_col = height - 1 - radius, width - 1 - radius

    def neighborhood_2d(b, h, q_idx, kv_idx):
        q_row = np.minimum(np.maximum(q_idx // width, radius), last_row)
        q_col = np.minimum(np.maximum(q_idx % width, radius), last_col)
        return (abs(q_row - kv_idx // width) <= radius) & (abs(q_col - kv_idx % width) <= radius)

    return _named(neighborhood_2d, f"neighborhood_2d_{height}x{width}_r{radius}")


def sliding_tile_2d(height: int, width: int, tile: int, window: int) -> Callable:
    """Sliding-tile attention on a ``height x width`` grid stored tile by tile (each ``tile x tile``
    tile contiguous, tiles row-major): a query's tile sees the ``window x window`` tiles around it,
    the window moved inward at the borders. ``window`` odd; ``tile`` divides both sides."""
    tile, window = check_mask_int(tile, "tile", 1), check_mask_int(window, "window", 1)
    if height % tile or width % tile or window % 2 == 0:
        raise MaskError(f"sliding_tile_2d: tile {tile} must divide {height}x{width} and window {window} be odd")
    tiles_x, tiles_y, half, area = width // tile, height // tile, window // 2, tile * tile
    if window > min(tiles_x, tiles_y):
        raise MaskError(f"sliding_tile_2d: a window of {window} tiles does not fit {tiles_y}x{tiles_x} tiles")

    def sliding_tile_2d(b, h, q_idx, kv_idx):
        q_tile, kv_tile = q_idx // area, kv_idx // area
        q_y = np.minimum(np.maximum(q_tile // tiles_x, half), tiles_y - 1 - half)
        q_x = np.minimum(np.maximum(q_tile % tiles_x, half), tiles_x - 1 - half)
        return (abs(q_y - kv_tile // tiles_x) <= half) & (abs(q_x - kv_tile % tiles_x) <= half)

    return _named(sliding_tile_2d, f"sliding_tile_{height}x{width}_t{tile}_w{window}")


def block_diffusion(seq_len: int, block: int) -> Callable:
    """Block diffusion (BD3-LM): the input is the noisy sequence then the clean one, ``2 seq_len``
    positions. A noisy token sees its own noisy block and the clean blocks before it; a clean token
    sees the clean blocks up to its own."""
    seq_len, block = check_mask_int(seq_len, "seq_len", 1), check_mask_int(block, "block", 1)

    def block_diffusion(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= seq_len, kv_idx >= seq_len
        q_block, kv_block = (q_idx % seq_len) // block, (kv_idx % seq_len) // block
        noisy_own = ~q_clean & ~kv_clean & (q_block == kv_block)
        noisy_to_clean = ~q_clean & kv_clean & (kv_block < q_block)
        clean = q_clean & kv_clean & (kv_block <= q_block)
        return noisy_own | noisy_to_clean | clean

    return _named(block_diffusion, f"block_diffusion_{seq_len}_b{block}")


def dilated_window(window: int, dilation: int) -> Callable:
    """Causal dilated window: ``window`` keys ``dilation`` apart, ``d = q_idx - kv_idx``,
    ``0 <= d < window * dilation`` and ``d % dilation == 0``."""
    window, dilation = check_mask_int(window, "window", 1), check_mask_int(dilation, "dilation", 1)
    span = window * dilation

    def dilated_window(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < span) & (d % dilation == 0)

    return _named(dilated_window, f"dilated_{window}_x{dilation}")


def shared_prefix(prefix: int, suffixes: Sequence[int]) -> Callable:
    """One prompt shared by several continuations packed after it: causal, and a continuation sees
    the prompt and itself, not the other continuations. ``segment`` is 0 on the prompt, i on
    continuation i."""
    prefix = check_mask_int(prefix, "prefix", 1)
    lengths = [check_mask_int(n, "suffixes[i]", 1) for n in suffixes]
    segment = np.repeat(np.arange(len(lengths) + 1, dtype=np.int32), [prefix] + lengths)

    def shared_prefix(b, h, q_idx, kv_idx):
        kv_segment = segment[kv_idx]
        return (q_idx >= kv_idx) & ((kv_segment == 0) | (kv_segment == segment[q_idx]))

    return _named(shared_prefix, f"shared_prefix_{prefix}_{len(lengths)}x")


def cross_attention_images(text_image: np.ndarray, tokens_per_image: int) -> Callable:
    """Flamingo-style cross attention from text (queries) to image tokens (keys): a text token sees
    only the tokens of the latest image before it (``text_image[q_idx]``, -1: none yet); image i
    holds keys ``[i * tokens_per_image, (i + 1) * tokens_per_image)``."""
    text_image = np.asarray(text_image, dtype=np.int32)
    tokens = check_mask_int(tokens_per_image, "tokens_per_image", 1)

    def cross_attention_images(b, h, q_idx, kv_idx):
        return text_image[q_idx] == kv_idx // tokens

    return _named(cross_attention_images, f"cross_attention_{int(text_image.max()) + 1}images_{tokens}tok")


def packed_documents(doc_ids: np.ndarray, causal: bool = True) -> Callable:
    """Packed sequences: ``doc[q_idx] == doc[kv_idx]``, and ``q_idx >= kv_idx`` when causal; ids
    ``[N]`` or per batch ``[B, N]``."""
    doc = np.asarray(doc_ids)
    if doc.ndim == 1:
        def packed_documents(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & ((q_idx >= kv_idx) | (not causal))
    else:
        def packed_documents(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & ((q_idx >= kv_idx) | (not causal))

    return _named(packed_documents, f"packed_{'causal_' if causal else ''}{len(np.unique(doc))}docs")


def prefix_lm(prefix_lengths) -> Callable:
    """Prefix LM: the first ``prefix`` keys seen by every query, the rest causally; ``prefix_lengths``
    one int, or one per batch row (``prefix[b]``)."""
    if np.ndim(prefix_lengths) == 0:
        prefix = check_mask_int(prefix_lengths, "prefix_lengths", 0)

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return _named(prefix_lm, f"prefix_lm_{prefix}")
    per_batch = np.asarray(prefix_lengths, dtype=np.int32)

    def prefix_lm_per_batch(b, h, q_idx, kv_idx):
        return (kv_idx < per_batch[b]) | (q_idx >= kv_idx)

    return _named(prefix_lm_per_batch, f"prefix_lm_{len(per_batch)}rows")


def interleaved_text_image(segments: Sequence[tuple]) -> Callable:
    """Interleaved text and images, ``("text", n)`` / ``("image", n)`` segments: causal, and the
    tokens of one image also see each other (bidirectional inside an image)."""
    kinds = [s[0] for s in segments]
    if any(k not in ("text", "image") for k in kinds) or not segments:
        raise MaskError("interleaved_text_image: segments are ('text', n) or ('image', n)")
    sizes = [check_mask_int(s[1], "segment length", 1) for s in segments]
    segment = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    image = np.repeat(np.array([k == "image" for k in kinds]), sizes)

    def interleaved_text_image(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (image[q_idx] & (segment[q_idx] == segment[kv_idx]))

    return _named(interleaved_text_image, f"interleaved_{kinds.count('text')}text_{kinds.count('image')}image")


def _side(n: int) -> int:
    return max(8, int(math.isqrt(n)) // 8 * 8)


def _lengths(n: int, low: int, high: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n:
        out.append(min(int(rng.integers(low, high + 1)), n - total))
        total += out[-1]
    return out


def _examples(n: int) -> dict:
    """One instance of each family at sequence length about ``n``: name -> (mask_mod, q_len, kv_len)."""
    side = _side(n)
    docs = np.repeat(np.arange(len(_lengths(n, 256, 2048, 0))), _lengths(n, 256, 2048, 0))
    text = 2 * (n // 4)
    images = max(1, n // 1024)
    per_image = max(1, (n - text // 2) // images)
    text_image = np.minimum(np.arange(text) * images // text, images - 1).astype(np.int32) - (np.arange(text) < 7)
    tile = 8 if side >= 128 else 4
    tiles = side // tile
    tile_window = max(1, min(5, tiles - 1 if tiles % 2 == 0 else tiles - 2))  # odd, fewer than the tiles
    return {
        "global_sliding": (global_sliding_window(64, min(2048, n // 4)), n, n),
        "neighborhood_1d": (neighborhood_1d(min(512, n // 8)), n, n),
        "neighborhood_2d": (neighborhood_2d(side, side, min(7, side // 2 - 1)), side * side, side * side),
        "sliding_tile_2d": (sliding_tile_2d(side, side, tile, tile_window), side * side, side * side),
        "block_diffusion": (block_diffusion(n // 2, 64), 2 * (n // 2), 2 * (n // 2)),
        "dilated_window": (dilated_window(min(256, n // 8), 4), n, n),
        "shared_prefix": (shared_prefix(n // 4, _lengths(n - n // 4, 128, 1024, 1)), n, n),
        "cross_attention": (cross_attention_images(text_image, per_image), text, images * per_image),
        "packed_documents": (packed_documents(docs), n, n),
        "prefix_lm": (prefix_lm(n // 4), n, n),
        "interleaved": (interleaved_text_image([("text", 512), ("image", 576)] * (n // 1088) + [("text", n % 1088 or 1)]),
                        (n // 1088) * 1088 + (n % 1088 or 1), (n // 1088) * 1088 + (n % 1088 or 1)),
    }


def examples(n: int, names: Optional[Sequence[str]] = None) -> dict:
    """``_examples(n)``, restricted to ``names``."""
    found = _examples(n)
    return {k: v for k, v in found.items() if names is None or k in names}


FAMILY_NAMES = ("global_sliding", "neighborhood_1d", "neighborhood_2d", "sliding_tile_2d", "block_diffusion",
                "dilated_window", "shared_prefix", "cross_attention", "packed_documents", "prefix_lm", "interleaved")

__all__ = ["global_sliding_window", "neighborhood_1d", "neighborhood_2d", "sliding_tile_2d", "block_diffusion",
           "dilated_window", "shared_prefix", "cross_attention_images", "packed_documents", "prefix_lm",
           "interleaved_text_image", "examples", "FAMILY_NAMES"]
