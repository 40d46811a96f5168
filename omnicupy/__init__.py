"""omnicupy: exact block-sparse attention for NumPy/CuPy on NVIDIA GPUs, no deep-learning framework.

    import omnicupy
    out = omnicupy.attention(q, k, v, causal=True)
    bm = omnicupy.BlockMask.from_mask_mod(omnicupy.masks.sliding_window(1024), None, None, N, N)
    out = omnicupy.attention(q, k, v, bm)
    out, lse = omnicupy.attention(q, k, v, bm, return_lse=True)
    dq, dk, dv = omnicupy.attention_backward(dout, q, k, v, out, lse, bm)
"""
from __future__ import annotations

import importlib

from ._version import __version__
from .dispatch.plan import Plan
from .ops.forward import attention, omni_attn_mma_blockmask, plan
from .ops.backward import attention_backward
from .ops.paged import paged_attention
from .ops.varlen import varlen_attention
from .mask import BlockMask, BlockType
from .errors import ArgumentError, CompileError, KVCacheError, MaskError, NoGPUError, OmnicupyError
from .mask.expressions import cuda_mask
from .mask.compile_mask import compile_mask
from . import reference

__all__ = [
    "__version__", "attention", "attention_backward", "plan", "Plan", "omni_attn_mma_blockmask", "BlockMask",
    "BlockType", "reference", "masks", "score_mods", "cuda_mask", "compile_mask", "cuda_score", "paged_attention", "varlen_attention",
    "ArgumentError", "CompileError", "KVCacheError", "MaskError", "NoGPUError", "OmnicupyError",
]

# "torch" and "jax": the framework adapters, imported (with their framework) only when asked for.
_LAZY_SUBMODULES = {"masks", "mask", "cli", "jit", "dispatch", "ops", "score_mods", "distributed", "torch", "jax"}


def __getattr__(name: str):
    if name == "cuda_score":
        from .score_mods import cuda_score

        return cuda_score
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'omnicupy' has no attribute {name!r}")
