"""Block types and the block-size rules shared by the host and the kernels.

This module is the one source of these facts: ``dispatch`` renders ``BlockType`` into every kernel's
configuration (so the C++ enum cannot drift from it), and the tile rules below are what the
kernels' static_asserts require. It knows nothing of arrays, devices or kernels.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockType(enum.IntEnum):
    """What a listed (q block, kv block) pair needs: nothing, the causal rule, or stored bits."""

    MASKED = 0
    CAUSAL = 1
    FULL = 2
    PARTIAL = 3


#: One character per block in ``BlockMask.to_string()``.
BLOCK_CHARS = {BlockType.MASKED: ".", BlockType.CAUSAL: "\\", BlockType.FULL: "#", BlockType.PARTIAL: "+"}

#: The kernels walk kv blocks in tiles of at least 32 columns (one 32-bit word of partial bits)
#: and q blocks in tiles of at least 16 rows (one mma row tile).
KV_BLOCK_MULTIPLE = 32
Q_BLOCK_MULTIPLE = 16
#: Bits per word of the partial-block pool (bit c of word w is column 32 w + c).
PARTIAL_WORD_BITS = 32

#: Positions, block indices and sequence lengths are 32-bit ints in the kernels and the metadata.
#: A kernel computes the first position of the block after the last one (``n_blocks * block_size``)
#: and one tile past it, so a length's padded end plus one block must stay below this.
POSITION_LIMIT = 2**31


def max_length(block_size: int) -> int:
    """The longest sequence the kernels can index with blocks of ``block_size`` positions: whole
    blocks up to it, plus one more block, stay below ``POSITION_LIMIT``."""
    return ((POSITION_LIMIT - 1) // block_size - 1) * block_size


#: Relative cost of visiting one block of each type (indexed by BlockType), for launch orders: a
#: CAUSAL block is computed up to its diagonal only, a MASKED one not at all.
WORK_WEIGHTS = (0, 1, 2, 2)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MaskFeatures:
    """Which per-element work a mask needs; part of the kernel variant key."""

    causal: bool
    partial: bool


def cpp_enum() -> str:
    """``BlockType`` as the C++ enum the kernels use (``kMasked = 0``, ...)."""
    items = ", ".join(f"k{t.name.capitalize()} = {int(t)}" for t in BlockType)
    return f"enum BlockType : int {{ {items} }};"


__all__ = ["BlockType", "BLOCK_CHARS", "KV_BLOCK_MULTIPLE", "Q_BLOCK_MULTIPLE", "PARTIAL_WORD_BITS", "POSITION_LIMIT",
           "WORK_WEIGHTS", "max_length", "cdiv", "MaskFeatures", "cpp_enum"]
