"""Tile configurations per head dim: the one table to tune (issue: performance).

``select_variant`` turns a call's needs (head dim, dtype, stages, block sizes, mask features) into
a Variant: the tuned tile if it divides the mask's block sizes, else the best fallback that does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from .errors import ArgumentError
from .jit.variant import SUPPORTED_HEAD_DIMS, Variant


@dataclass(frozen=True)
class Tile:
    br: int
    bc: int
    warps: int


#: (head_dim, stages) -> tuned tile. Chosen by benchmarks/tune_tiles.py on the lent H100/H200;
#: see NOTES.md for the measurements behind each entry.
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


@contextlib.contextmanager
def use_tiles(overrides: Mapping[tuple[int, int], Tile]) -> Iterator[None]:
    """Temporarily replace entries of TUNED (for tuning scripts that time candidate tiles)."""
    saved = dict(TUNED)
    TUNED.update(overrides)
    try:
        yield
    finally:
        TUNED.clear()
        TUNED.update(saved)


def select_tile(head_dim: int, stages: int, q_block_size: int, kv_block_size: int, extras: bool = False) -> Tile:
    tuned = (FEATURE_TILES if extras else TUNED)[(head_dim, stages)]
    for tile in (tuned, *FALLBACKS):
        if q_block_size % tile.br == 0 and kv_block_size % tile.bc == 0:
            return tile
    raise ArgumentError(
        f"block_mask: q_block_size={q_block_size} and kv_block_size={kv_block_size} are not divisible by any "
        f"kernel tile (q_block_size must be a multiple of 16, kv_block_size a multiple of 32)"
    )


def select_variant(head_dim: int, dtype: str, stages: Optional[int], q_block_size: int, kv_block_size: int,
                   causal: bool, partial: bool, bias: Optional[str] = None, mask_expr: Optional[tuple] = None,
                   score_expr: Optional[tuple] = None) -> Variant:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ArgumentError(f"q: head_dim {head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if stages is None:
        stages = DEFAULT_STAGES[head_dim]
    if stages not in (1, 2):
        raise ArgumentError(f"stages must be None, 1 or 2, got {stages!r}")
    # A fused mask expression keeps the tile of the stored-bits kernel, so that the two give
    # bit-identical outputs; per-score work (bias, score modifier) needs the leaner feature tiles.
    extras = bias is not None or score_expr is not None
    tile = select_tile(head_dim, stages, q_block_size, kv_block_size, extras)
    return Variant(head_dim, dtype, tile.br, tile.bc, tile.warps, stages, causal, partial, bias, mask_expr, score_expr)


def shipped_variants(dtypes=("fp16", "bf16"), head_dims=SUPPORTED_HEAD_DIMS, stages=(1, 2)) -> list[Variant]:
    """Every tuned variant with every mask-feature combination: what CI compiles and the CLI precompiles."""
    out = []
    for hd in head_dims:
        for dt in dtypes:
            for st in stages:
                tile = TUNED[(hd, st)]
                for causal in (False, True):
                    for partial in (False, True):
                        out.append(Variant(hd, dt, tile.br, tile.bc, tile.warps, st, causal, partial))
    return out
