"""omnicupy: exact block-sparse attention for NumPy/CuPy on NVIDIA GPUs, no deep-learning framework.

    import omnicupy
    out = omnicupy.attention(q, k, v, causal=True)
    bm = omnicupy.BlockMask.from_mask_mod(omnicupy.masks.sliding_window(1024), None, None, N, N)
    out = omnicupy.attention(q, k, v, bm)
"""
from __future__ import annotations

import importlib

from ._version import __version__
from .api import attention, omni_attn_mma_blockmask
from .block_mask import BlockMask, BlockType
from .errors import ArgumentError, CompileError, MaskError, NoGPUError, OmnicupyError
from .expressions import cuda_mask
from . import reference

__all__ = [
    "__version__", "attention", "omni_attn_mma_blockmask", "BlockMask", "BlockType", "reference", "masks",
    "score_mods", "cuda_mask", "cuda_score",
    "ArgumentError", "CompileError", "MaskError", "NoGPUError", "OmnicupyError",
]

_LAZY_SUBMODULES = {"masks", "builders", "cli", "jit", "tiles", "score_mods", "distributed"}


def __getattr__(name: str):
    if name == "cuda_score":
        from .score_mods import cuda_score

        return cuda_score
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'omnicupy' has no attribute {name!r}")
