"""What the commands need to know of the kernel variants, from the modules that define them: the
shipped list, the supported values, a variant's family and whether it runs on an arch. The one
place in cli/ that imports the variant and tile modules, so that moving them touches one file."""
from __future__ import annotations

from typing import Optional

from .. import jit, tiles
from ..jit.variant import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_STAGES, Variant, has_wgmma

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "SUPPORTED_STAGES", "Variant", "has_wgmma", "family",
           "runs_on", "shipped_variants", "kernel_for"]

shipped_variants = tiles.shipped_variants


def family(variant: Variant) -> str:
    """'sync' (mma.sync) or 'wgmma' (Hopper, built as sm_90a)."""
    return variant.mma


def runs_on(variant: Variant, arch: str) -> bool:
    """Whether the variant can run on ``arch`` (its family exists there and its shared memory fits)."""
    return jit.arch_supports(variant, arch)


def kernel_for(head_dim: int, dtype: str, block_mask, arch: Optional[str]) -> Variant:
    """The variant ``attention(q, k, v, block_mask)`` runs for these inputs on ``arch``."""
    return tiles.select_variant(head_dim, dtype, None, block_mask.q_block_size, block_mask.kv_block_size,
                                block_mask.features.causal, block_mask.features.partial, arch=arch)
