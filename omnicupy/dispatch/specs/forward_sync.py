"""The forward on mma.sync (sm_80+): templates/attention_fwd.cu.jinja, FwdParams.

Its knob beyond the shared ones: ``poly_exp``. Its tile tables (tuned per (head_dim, stages), with
per-score extras, fallbacks) and the checks every forward family shares (``check_forward``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ArgumentError, VariantError
from .. import params
from .base import SMEM_PAD_ELEMS, KernelSpec, Tile, tile_error

if TYPE_CHECKING:
    from ..variant import Variant

#: (head_dim, stages) -> tuned tile. Chosen by benchmarks/tune_tiles.py on the lent H100/H200;
#: see lab/notes for the measurements behind each entry.
TUNED: dict[tuple[int, int], Tile] = {
    (32, 1): Tile(128, 64, 4), (32, 2): Tile(128, 64, 4),
    (64, 1): Tile(64, 128, 4), (64, 2): Tile(128, 128, 4),
    (96, 1): Tile(64, 64, 4), (96, 2): Tile(128, 64, 4),
    (128, 1): Tile(64, 64, 4), (128, 2): Tile(128, 64, 4),
    (256, 1): Tile(64, 32, 4), (256, 2): Tile(64, 64, 4),
}

#: Tiles for variants with per-score extras (bias, score modifier): the extra
#: registers those need push the largest tiles above into spills (tools/ptxas_report.py).
FEATURE_TILES: dict[tuple[int, int], Tile] = {
    (32, 1): Tile(128, 64, 4), (32, 2): Tile(128, 64, 4),
    (64, 1): Tile(64, 128, 4), (64, 2): Tile(128, 64, 4),
    (96, 1): Tile(64, 64, 4), (96, 2): Tile(64, 64, 4),
    (128, 1): Tile(64, 64, 4), (128, 2): Tile(128, 32, 4),
    (256, 1): Tile(64, 32, 4), (256, 2): Tile(64, 32, 4),
}

#: Stage used when the caller does not choose one.
DEFAULT_STAGES: dict[int, int] = {32: 2, 64: 2, 96: 2, 128: 2, 256: 2}

#: Smaller tiles, most preferred first, for block sizes the tuned tile does not divide.
FALLBACKS = (Tile(64, 64, 4), Tile(64, 32, 4), Tile(32, 32, 2), Tile(16, 32, 1))

SUPPORTED_STAGES = (1, 2)


def select_tile(head_dim: int, stages: int, q_block_size: int, kv_block_size: int, extras: bool = False) -> Tile:
    tuned = (FEATURE_TILES if extras else TUNED)[(head_dim, stages)]
    for tile in (tuned, *FALLBACKS):
        if q_block_size % tile.br == 0 and kv_block_size % tile.bc == 0:
            return tile
    raise ArgumentError(
        f"block_mask: q_block_size={q_block_size} and kv_block_size={kv_block_size} are not divisible by any "
        f"kernel tile (q_block_size must be a multiple of 16, kv_block_size a multiple of 32)"
    )


def check_forward(v: "Variant") -> None:
    """What every forward family checks: stages, and poly_exp dividing the n8 tiles."""
    if v.stages not in SUPPORTED_STAGES:
        raise VariantError(f"stages must be 1 or 2, got {v.stages}")
    if v.poly_exp < 0 or (v.poly_exp and (v.bc // 8) % v.poly_exp):
        raise VariantError(f"poly_exp={v.poly_exp} must be 0 or divide the bc/8 = {v.bc // 8} n8 tiles")


class ForwardSync(KernelSpec):
    operation, family, prefix = "forward", "sync", "omni_fwd"
    template = "attention_fwd.cu.jinja"
    struct = params.FORWARD
    knobs = frozenset({"poly_exp"})

    def check(self, v: "Variant") -> None:
        check_forward(v)
        problem = tile_error("br", v.br, v.warps)
        if problem:
            raise VariantError(problem)

    def smem_bytes(self, v: "Variant") -> int:
        """Padded rows of Q and the kv tiles: kStage 1 shares one buffer between K and V, kStage 2
        has one of each."""
        return (v.br + v.stages * v.bc) * (v.head_dim + SMEM_PAD_ELEMS) * 2

    def foreign_knob(self, knob: str) -> str:
        if knob == "overlap":
            return "overlap is a wgmma/tma pipeline option"
        return super().foreign_knob(knob)


SPEC = ForwardSync()
