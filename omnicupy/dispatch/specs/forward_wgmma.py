"""The forward on Hopper's warpgroup MMA (sm_90a): templates/attention_fwd_sm90.cu.jinja, FwdParams.

Knobs: ``overlap`` (P V of the previous tile behind S of this one), ``poly_exp``. One warpgroup
per 64 query rows, swizzled unpadded rows, K and V double-buffered.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import VariantError
from .. import params
from .base import SWIZZLE_ATOM_BYTES, WGMMA_BC, WGMMA_HEAD_DIMS, KernelSpec, Tile
from .forward_sync import check_forward

if TYPE_CHECKING:
    from ..variant import Variant

#: (head_dim, stages) -> tile, one warpgroup per 64 query rows. Chosen by benchmarks/tune_masks.py
#: and tune_tiles.py on the lent H200 (lab/notes/forward.md#s9, lab/notes/forward.md#s10). At head_dim 64 one warpgroup per CTA
#: (three CTAs per SM, no barrier shared between warpgroups) beat two per CTA on every mask. The
#: family double-buffers K and V, so it has no kStage 1: stages=1 selects the mma.sync kernel.
WGMMA_TUNED: dict[tuple[int, int], Tile] = {
    (64, 2): Tile(64, 128, 4), (128, 2): Tile(128, 128, 8), (256, 2): Tile(128, 64, 8, overlap=True),
}

#: wgmma tiles for block sizes the tuned one does not divide (q blocks must be multiples of 64).
WGMMA_FALLBACKS = (Tile(64, 64, 4),)


class ForwardWgmma(KernelSpec):
    operation, family, prefix = "forward", "wgmma", "omni_fwd"
    template = "attention_fwd_sm90.cu.jinja"
    struct = params.FORWARD
    knobs = frozenset({"overlap", "poly_exp"})

    def check(self, v: "Variant") -> None:
        check_forward(v)
        if v.head_dim not in WGMMA_HEAD_DIMS:
            raise VariantError(f"the wgmma family supports head_dim {WGMMA_HEAD_DIMS}, got {v.head_dim}")
        if v.br % 64 or v.warps != v.br // 16:
            raise VariantError(f"wgmma: br={v.br} must be a multiple of 64 with one warp per 16 rows "
                               f"(warps={v.br // 16}), got warps={v.warps}")
        if v.bc not in WGMMA_BC:
            raise VariantError(f"wgmma: bc must be one of {WGMMA_BC}, got {v.bc}")

    def smem_bytes(self, v: "Variant") -> int:
        """Unpadded swizzled rows, ``stages`` buffers of K and V, one swizzle atom of alignment slack."""
        return SWIZZLE_ATOM_BYTES + (v.br + v.stages * 2 * v.bc) * v.head_dim * 2

    def m_tiles(self, v: "Variant") -> int:
        return 1

    def name_suffix(self, v: "Variant") -> str:
        return "_wgmma" + ("o" if v.overlap else "")


SPEC = ForwardWgmma()
