"""The merge of split-KV partials (sm_80+): templates/attention_decode_combine.cu.jinja,
kernels/decode_combine.cuh, CombineParams. One warp per output row (b, h, i); no shared memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import VariantError
from .. import params
from .base import KernelSpec
from .decode_split import DECODE_BC, check_warps

if TYPE_CHECKING:
    from ..variant import Variant

#: Output rows (one warp each) per CTA.
COMBINE_WARPS = 4


class DecodeCombine(KernelSpec):
    operation, family, prefix = "combine", "sync", "omni_combine"
    template = "attention_decode_combine.cu.jinja"
    struct = params.COMBINE

    def check(self, v: "Variant") -> None:
        check_warps(v)
        if v.br != v.warps or v.stages != 1:
            raise VariantError(f"combine: br must equal warps and stages be 1, got br={v.br} stages={v.stages}")

    def smem_bytes(self, v: "Variant") -> int:
        return 0


SPEC = DecodeCombine()


def combine_variant(head_dim: int, dtype: str) -> "Variant":
    from ..variant import Variant, tile_head_dim

    return Variant(tile_head_dim(head_dim), dtype, COMBINE_WARPS, DECODE_BC, COMBINE_WARPS, 1, operation="combine",
                   head_dim_valid=head_dim)
