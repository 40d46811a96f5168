"""Masks: block types, BlockMask metadata, mask functions, the mask zoo, builders and CUDA expressions.

Layers, each importing only those above it:

    types        BlockType, block-size rules, the int32 position limit (the one source the kernels
                 are rendered from)
    display      text pictures of metadata rows, downsampled (``BlockMask.to_string``)
    block_mask   BlockMask: validated flex-attention metadata it owns, its summary (block counts,
                 ``q_block_work``), device copies, inspection in O(listed blocks)
    mask_mod     MaskMod: a mask function with its row windows (block structure); result checks
    zoo          the built-in masks (public as ``omnicupy.masks``)
    blocks       packed blocks: type, hash, deduplicated pool (the host's rules)
    patterns     cut blocks of exact masks from their row bounds (no evaluation)
    evaluate     calling a mask_mod on blocks: the broadcast contract, the scalar (vmap) mode
    layout       rows as items -> flex's layout and the summary
    kernels      the builders' GPU kernels as omnicupy kernels (``precompile_specs``) and their
                 NumPy emulation
    build_pass   one build: windows, pieces or evaluated blocks -> items -> metadata (chunked)
    builders     BlockMask from a mask_mod, a dense mask, flex's arrays, causal/full rules
    constructors the builders as BlockMask class methods (imported when called)
    expressions  CUDA C expressions (``cuda_mask``) fused into kernels

``BlockMask``'s builders are class methods of BlockMask (``BlockMask.causal`` ...) that import
builders.py when called, so that block_mask.py has no import of builders.py at load time.
"""
from __future__ import annotations

from . import builders
from .block_mask import BlockMask, DeviceMetadata, MaskSummary, validate_metadata
from .kernels import precompile_specs
from .mask_mod import MaskMod
from .types import BlockType, MaskFeatures, cdiv

__all__ = ["BlockMask", "BlockType", "DeviceMetadata", "MaskFeatures", "MaskMod", "MaskSummary", "builders", "cdiv",
           "precompile_specs", "validate_metadata"]
