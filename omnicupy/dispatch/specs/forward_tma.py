"""The forward on wgmma fed by a TMA producer warpgroup (sm_90a): templates/attention_fwd_tma.cu.jinja,
FwdTmaParams (FwdParams plus the persistent schedule and three tensor maps).

Knobs: ``overlap``, ``pingpong`` (two consumer warpgroups take turns at their GEMMs), ``poly_exp``.
Its tables: the tuned tiles, the fallbacks, the built-in rule masks' and 192-row blocks' tiles
(when OMNICUPY_MMA=auto takes it over wgmma is the selection's policy: dispatch/tiles.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import VariantError
from .. import params
from ..arch import HOPPER_SMEM
from .base import SMEM_PAD_ELEMS, SWIZZLE_ATOM_BYTES, WGMMA_BC, WGMMA_HEAD_DIMS, KernelSpec, Tile
from .forward_sync import check_forward

if TYPE_CHECKING:
    from ..variant import Variant

#: The producer warpgroup's warps (one thread issues the loads), and the shared memory its
#: mbarriers take after the tiles (q full, then full/empty of K and V per stage: 8 bytes each).
TMA_PRODUCER_WARPS = 4
TMA_BARRIER_BYTES = 128

#: (head_dim, stages) -> tile; warps = one per 16 query rows plus the producer warpgroup's 4.
#: Two consumer warpgroups (128 query rows) with 240 registers each, one CTA per SM. The plain
#: pipeline: at D = 64 the three pipelines measured equal, at D = 128 and 256 plain was fastest on
#: full attention and within 1 % of the others on causal (lab/notes/forward.md#s12).
TMA_TUNED: dict[tuple[int, int], Tile] = {
    (64, 2): Tile(128, 128, 12),
    (128, 2): Tile(128, 128, 12),
    (256, 2): Tile(128, 64, 12),
}
#: tma tiles for block sizes the tuned one does not divide (q blocks of 64: one consumer warpgroup).
TMA_FALLBACKS = (Tile(64, 64, 8, overlap=True),)


@dataclass(frozen=True)
class RuleTile:
    """A tile for a built-in rule mask, used from ``min_kv_len`` keys on (shorter walks lost)."""

    tile: Tile
    min_kv_len: int = 0


#: tma tiles for the built-in rule masks (BlockMask.rule: full attention, top-left causal), which
#: the planner re-blocks to the tile's height (builders.reblocked): three consumer warpgroups of 64
#: rows on 192-row q blocks, consumers at 160 registers; (head_dim, stages, rule) -> RuleTile.
#: Same-process A/B against the tuned 128-row tile on the H200 (lab/notes/forward.md#s30; fp16, H 16, B x N =
#: 16k tokens, N 1024..16384, three rounds): D = 64 full +7 % (N 1024) to +23 %, D = 64 causal
#: -10 % at N 1024 and +4..+16 % from 2048 on; D = 128 (persistent through unpadded staging rows,
#: Variant.staging_swizzled) full even at 1024 and +3..+7 % (medians) from 2048 on, causal -14 % at
#: 1024, even at 2048 and 4096, +5..+6 % (medians) at 8192 and 16384. Only where nothing else needs
#: registers (no bias, score modifier or fused mask), and only at the head dims measured (no padded
#: ones).
TMA_RULE_TILES: dict[tuple[int, int, str], RuleTile] = {
    (64, 2, "full"): RuleTile(Tile(192, 128, 16)),
    (64, 2, "causal"): RuleTile(Tile(192, 128, 16), min_kv_len=2048),
    (128, 2, "full"): RuleTile(Tile(192, 128, 16), min_kv_len=2048),
    (128, 2, "causal"): RuleTile(Tile(192, 128, 16), min_kv_len=8192),
}
#: tma tiles for masks whose q blocks are a multiple of 192 rows however they were built (a caller
#: passes q_block_size=192 to a builder): the rule tiles' three consumer warpgroups, at any length.
#: Measured on the H200 (lab/notes/forward.md#s30, call 10, N = 8192): the benchmark's structured masks built
#: at 192-row blocks on this tile against the same masks at 128-row blocks on the tuned path:
#: D = 64 +3..+16 %, D = 128 0..+11 % (random blocks drawn on a 128-row grid lose at 192-row
#: blocks: most of their blocks turn PARTIAL). Same conditions as the rule tiles.
TMA_BLOCK_TILES: dict[tuple[int, int], Tile] = {
    (64, 2): Tile(192, 128, 16),
    (128, 2): Tile(192, 128, 16),
}
def _tiles_bytes(v: "Variant") -> int:
    """One swizzle atom of alignment slack, Q, the K/V ring and the mbarriers."""
    return SWIZZLE_ATOM_BYTES + (v.br + v.stages * 2 * v.bc) * v.head_dim * 2 + TMA_BARRIER_BYTES


class ForwardTma(KernelSpec):
    operation, family, prefix = "forward", "tma", "omni_fwd"
    template = "attention_fwd_tma.cu.jinja"
    struct = params.FORWARD_TMA
    knobs = frozenset({"overlap", "pingpong", "poly_exp"})

    def check(self, v: "Variant") -> None:
        check_forward(v)
        if v.pingpong and (not v.overlap or v.br != 128):
            raise VariantError("pingpong is a tma option that needs overlap and two consumer warpgroups (br=128)")
        consumers = v.br // 16
        if v.head_dim not in WGMMA_HEAD_DIMS:
            raise VariantError(f"the tma family supports head_dim {WGMMA_HEAD_DIMS}, got {v.head_dim}")
        if v.br not in (64, 128, 192) or v.warps != consumers + TMA_PRODUCER_WARPS:
            raise VariantError(f"tma: br must be 64, 128 or 192 (one consumer warpgroup per 64 rows) and warps the "
                               f"consumers' {consumers} plus {TMA_PRODUCER_WARPS} producer warps, got br={v.br}, "
                               f"warps={v.warps}")
        if v.bc not in WGMMA_BC or v.stages != 2:
            raise VariantError(f"tma: bc must be one of {WGMMA_BC} and stages 2, got bc={v.bc}, stages={v.stages}")

    def staging_swizzled(self, v: "Variant") -> bool:
        """The epilogue stages O in unpadded rows (XOR swizzle, kernels/fwd_epilogue.cuh), the only
        staging that fits beside Q and the ring for persistent CTAs (the 192-row tile at D = 128);
        padded rows everywhere else."""
        padded = v.br * (v.head_dim + SMEM_PAD_ELEMS) * 2
        tiles = _tiles_bytes(v)
        return tiles + padded > HOPPER_SMEM and tiles + v.br * v.head_dim * 2 <= HOPPER_SMEM

    def _staging_bytes(self, v: "Variant") -> int:
        """The epilogue's rows of O (their own bytes only when persistent)."""
        return v.br * (v.head_dim + (0 if self.staging_swizzled(v) else SMEM_PAD_ELEMS)) * 2

    def persistent(self, v: "Variant") -> bool:
        """Whether the epilogue's staging rows fit beside Q and the ring (sm_90's shared memory), so
        that a CTA may loop over tiles (one CTA per SM); else one CTA per tile."""
        return _tiles_bytes(v) + self._staging_bytes(v) <= HOPPER_SMEM

    def smem_bytes(self, v: "Variant") -> int:
        return _tiles_bytes(v) + (self._staging_bytes(v) if self.persistent(v) else 0)

    def m_tiles(self, v: "Variant") -> int:
        return 1

    def name_suffix(self, v: "Variant") -> str:
        return "_tma" + ("o" if v.overlap else "") + ("p" if v.pingpong else "")


SPEC = ForwardTma()
