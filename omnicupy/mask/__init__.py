"""Masks: block types, BlockMask metadata, mask functions, the mask zoo, builders and CUDA expressions.

Layers, each importing only those above it:

    types        BlockType, block-size rules (the one source the kernels are rendered from)
    block_mask   BlockMask: validated flex-attention metadata, device copies, inspection
    mask_mod     MaskMod: a mask function with its row intervals (block structure)
    zoo          the built-in masks (public as ``omnicupy.masks``)
    builders     BlockMask from a mask_mod, a dense mask, flex's arrays, causal/full rules
    expressions  CUDA C expressions (``cuda_mask``) fused into kernels

``BlockMask``'s builder class methods are attached here, where both layers are known, so that
block_mask.py needs no import of builders.py.
"""
from __future__ import annotations

from . import builders
from .block_mask import BlockMask, DeviceMetadata, validate_metadata
from .mask_mod import MaskMod
from .types import BlockType, MaskFeatures, cdiv

BlockMask.full = staticmethod(builders.full)
BlockMask.causal = staticmethod(builders.causal)
BlockMask.from_mask_mod = staticmethod(builders.from_mask_mod)
BlockMask.from_dense = staticmethod(builders.from_dense)
BlockMask.from_flex = staticmethod(builders.from_flex)

__all__ = ["BlockMask", "BlockType", "DeviceMetadata", "MaskFeatures", "MaskMod", "builders", "cdiv",
           "validate_metadata"]
