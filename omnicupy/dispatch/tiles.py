"""Tile configurations per head dim: the one table to tune.

``select_variant`` turns a call's needs (head dim, dtype, stages, block sizes, mask features) into
a Variant: the tuned tile if it divides the mask's block sizes, else the best fallback that does.
``select_backward_variant`` does the same for the backward kernels (BACKWARD_TILES below).
Tables are keyed by the tile head dim; a caller's head dim between them runs padded on the next
one (variant.tile_head_dim, Variant.head_dim_valid).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from ..errors import ArgumentError, VariantError
from ..jit import env
from .arch import has_wgmma
from .variant import SUPPORTED_HEAD_DIMS, Variant, bwd_dq_row_warps, bwd_parts_error, check_head_dim, tile_head_dim


@dataclass(frozen=True)
class Tile:
    br: int
    bc: int
    warps: int
    overlap: bool = False  # wgmma and tma: software-pipelined P V (Variant.overlap)
    poly_exp: int = 0  # Variant.poly_exp: every poly_exp-th n8 tile's exp2 on the FMA pipe
    pingpong: bool = False  # tma only: consumer warpgroups take turns at the GEMMs (Variant.pingpong)

    @classmethod
    def parse(cls, spec: str) -> "Tile":
        """'br:bc:warps' plus optional flags: 'o' overlap, 'pN' poly_exp N, 'pp' ping-pong (tuning scripts)."""
        parts = spec.split(":")
        flags = parts[3:]
        poly = [int(f[1:]) for f in flags if f.startswith("p") and f[1:].isdigit()]
        unknown = [f for f in flags if f not in ("o", "pp") and not (f.startswith("p") and f[1:].isdigit())]
        if len(parts) < 3 or unknown:
            raise VariantError(f"tile spec {spec!r}: want br:bc:warps[:o][:pN][:pp]")
        return cls(*map(int, parts[:3]), overlap="o" in flags, poly_exp=poly[0] if poly else 0,
                   pingpong="pp" in flags)

    def options(self) -> dict:
        """The Variant fields this tile sets beyond br, bc, warps."""
        return {"overlap": self.overlap, "poly_exp": self.poly_exp, "pingpong": self.pingpong}


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

#: Hopper's wgmma family (sm_90a): (head_dim, stages) -> tile, one warpgroup per 64 query rows.
#: Chosen by benchmarks/tune_masks.py and tune_tiles.py on the lent H200 (NOTES.md §9, §10). At
#: head_dim 64 one warpgroup per CTA (three CTAs per SM, no barrier shared between warpgroups)
#: beat two per CTA on every mask. The family double-buffers K and V, so it has no kStage 1:
#: stages=1 selects the mma.sync kernel.
WGMMA_TUNED: dict[tuple[int, int], Tile] = {
    (64, 2): Tile(64, 128, 4), (128, 2): Tile(128, 128, 8), (256, 2): Tile(128, 64, 8, overlap=True),
}

#: wgmma tiles for block sizes the tuned one does not divide (q blocks must be multiples of 64).
WGMMA_FALLBACKS = (Tile(64, 64, 4),)

#: Hopper's warp-specialized TMA family (sm_90a, templates/attention_fwd_tma.cu.jinja):
#: (head_dim, stages) -> tile; warps = one per 16 query rows plus the producer warpgroup's 4.
#: Two consumer warpgroups (128 query rows) with 240 registers each, one CTA per SM. The plain
#: pipeline: at D = 64 the three pipelines measured equal, at D = 128 and 256 plain was fastest on
#: full attention and within 1 % of the others on causal (NOTES.md §12).
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
#: Same-process A/B against the tuned 128-row tile on the H200 (NOTES.md §30; fp16, H 16, B x N =
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
#: Measured on the H200 (NOTES.md §30, call 10, N = 8192): the benchmark's structured masks built
#: at 192-row blocks on this tile against the same masks at 128-row blocks on the tuned path:
#: D = 64 +3..+16 %, D = 128 0..+11 % (random blocks drawn on a 128-row grid lose at 192-row
#: blocks: most of their blocks turn PARTIAL). Same conditions as the rule tiles.
TMA_BLOCK_TILES: dict[tuple[int, int], Tile] = {
    (64, 2): Tile(192, 128, 16),
    (128, 2): Tile(192, 128, 16),
}
#: Head dims for which OMNICUPY_MMA=auto picks the tma family on sm_90: only where it measured
#: faster than the wgmma family (NOTES.md §12: D = 128 +24/+41 %, D = 256 +34/+28 % full/causal);
#: at D = 64 it measured 3-5 % slower before its CTAs were persistent (§12), and now wins only on
#: masks with CAUSAL blocks (TMA_AUTO_CAUSAL_HEAD_DIMS below).
TMA_AUTO_HEAD_DIMS: frozenset[int] = frozenset({128, 256})
#: Head dims for which auto picks the tma family only for masks with CAUSAL blocks and no per-score
#: work or fused mask expression. D = 64, measured on the H200 (NOTES.md §24, benchmarks.run, fp16,
#: N = 8192, two rounds each): causal +6-9 %, prefix-LM +4-5 %, interleaved +7 %, sliding window and
#: documents -1 to -1.5 % (noise level); without CAUSAL blocks the wgmma family stays: random block
#: masks -6 % on tma, full attention within the noise.
TMA_AUTO_CAUSAL_HEAD_DIMS: frozenset[int] = frozenset({64})


def auto_picks_tma(hopper_dim: int, causal: bool, extras: bool = False, mask_expr: Optional[tuple] = None) -> bool:
    """Whether OMNICUPY_MMA=auto takes the tma family for a forward variant on sm_90: the measured
    head dims (TMA_AUTO_HEAD_DIMS), and TMA_AUTO_CAUSAL_HEAD_DIMS where the mask has CAUSAL blocks
    and the variant neither transforms scores (``extras``) nor evaluates a fused mask."""
    if hopper_dim in TMA_AUTO_HEAD_DIMS:
        return True
    return hopper_dim in TMA_AUTO_CAUSAL_HEAD_DIMS and causal and not extras and mask_expr is None

#: Stage used when the caller does not choose one.
DEFAULT_STAGES: dict[int, int] = {32: 2, 64: 2, 96: 2, 128: 2, 256: 2}

#: Smaller tiles, most preferred first, for block sizes the tuned tile does not divide.
FALLBACKS = (Tile(64, 64, 4), Tile(64, 32, 4), Tile(32, 32, 2), Tile(16, 32, 1))


@contextlib.contextmanager
def use_tiles(overrides: Mapping[tuple[int, int], Tile], family: str = "sync") -> Iterator[None]:
    """Temporarily replace entries of TUNED (or WGMMA_TUNED, TMA_TUNED), for tuning scripts that time candidates."""
    table = _TABLES[family]
    saved = dict(table)
    table.update(overrides)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def select_tile(head_dim: int, stages: int, q_block_size: int, kv_block_size: int, extras: bool = False) -> Tile:
    tuned = (FEATURE_TILES if extras else TUNED)[(head_dim, stages)]
    for tile in (tuned, *FALLBACKS):
        if q_block_size % tile.br == 0 and kv_block_size % tile.bc == 0:
            return tile
    raise ArgumentError(
        f"block_mask: q_block_size={q_block_size} and kv_block_size={kv_block_size} are not divisible by any "
        f"kernel tile (q_block_size must be a multiple of 16, kv_block_size a multiple of 32)"
    )


def _hopper_tile(family: str, head_dim: int, stages: int, q_block_size: int, kv_block_size: int,
                 fallbacks: bool = True) -> Optional[Tile]:
    tuned = _TABLES[family].get((head_dim, stages))
    if tuned is None:
        return None
    others = (TMA_FALLBACKS if family == "tma" else WGMMA_FALLBACKS) if fallbacks else ()
    for tile in (tuned, *others):
        if q_block_size % tile.br == 0 and kv_block_size % tile.bc == 0:
            return tile
    return None


#: Caller head dims the Hopper families take: those whose wgmma tile (64-column blocks) is the tile
#: mma.sync would use, so that they never pad more. 8..32 and 72..96 stay on mma.sync everywhere,
#: as 32 and 96 always have (the wgmma tile would add 32 or more zero columns).
HOPPER_HEAD_DIM_RANGES = "40..64, 104..128, 136..256"


def _three_warpgroups_allowed(arch: Optional[str], family: str, extras: bool, mask_expr: Optional[tuple]) -> bool:
    """The conditions of TMA_RULE_TILES and TMA_BLOCK_TILES: sm_90, OMNICUPY_MMA (``family``)
    allowing the tma family, nothing per score (their consumers have 160 registers)."""
    return (not extras and mask_expr is None and family in ("auto", "tma") and arch is not None
            and has_wgmma(arch))


def rule_tile(rule: str, head_dim: int, stages: Optional[int], kv_len: int, arch: Optional[str], extras: bool = False,
              mask_expr: Optional[tuple] = None, family: Optional[str] = None) -> Optional[Tile]:
    """The tile a rule mask (BlockMask.rule) of ``kv_len`` keys is planned on, or None: its
    TMA_RULE_TILES entry on sm_90 when OMNICUPY_MMA (or ``family``) allows the tma family, for an
    unpadded head dim with nothing per score."""
    valid = check_head_dim(head_dim)
    stages = DEFAULT_STAGES[tile_head_dim(valid)] if stages is None else stages
    if not _three_warpgroups_allowed(arch, family or env.mma_family(), extras, mask_expr):
        return None
    entry = TMA_RULE_TILES.get((valid, stages, rule))
    return entry.tile if entry is not None and kv_len >= entry.min_kv_len else None


def hopper_head_dim(head_dim: int) -> Optional[int]:
    """The wgmma/tma tile head dim of a caller's (checked) head dim, or None where those families
    would pad more than mma.sync (HOPPER_HEAD_DIM_RANGES)."""
    hopper = tile_head_dim(head_dim, "wgmma")
    return hopper if hopper == tile_head_dim(head_dim) else None


def select_variant(head_dim: int, dtype: str, stages: Optional[int], q_block_size: int, kv_block_size: int,
                   causal: bool, partial: bool, bias: Optional[str] = None, mask_expr: Optional[tuple] = None,
                   score_expr: Optional[tuple] = None, arch: Optional[str] = None,
                   family: Optional[str] = None, rule_tile: Optional[Tile] = None) -> Variant:
    """``arch`` is the device's (``jit.device_arch()``); on sm_90 the wgmma family is used wherever
    it has a tile for the head dim and block sizes, unless OMNICUPY_MMA says otherwise. The tma
    family is used on sm_90 with OMNICUPY_MMA=tma, or by default where ``auto_picks_tma``; where it
    has no tile the wgmma family serves (and ops/tma.py falls back to it for inputs TMA cannot
    address). ``rule_tile``: a built-in rule mask's tile (rule_tile()), taken where the block sizes
    allow it; masks whose q blocks are a multiple of 192 rows take TMA_BLOCK_TILES the same way."""
    valid = check_head_dim(head_dim)
    head_dim = tile_head_dim(valid)  # mma.sync's tile
    hopper_dim = hopper_head_dim(valid)
    if stages is None:
        stages = DEFAULT_STAGES[head_dim]
    if stages not in (1, 2):
        raise ArgumentError(f"stages must be None, 1 or 2, got {stages!r}")
    # A fused mask expression keeps the tile of the stored-bits kernel, so that the two give
    # bit-identical outputs; per-score work (bias, score modifier) needs the leaner feature tiles.
    extras = bias is not None or score_expr is not None
    family = family or env.mma_family()
    hopper = arch is not None and has_wgmma(arch)
    hopper = hopper and hopper_dim is not None
    if hopper and _three_warpgroups_allowed(arch, family, extras, mask_expr):
        for rt in (rule_tile, TMA_BLOCK_TILES.get((valid, stages))):
            if rt is not None and q_block_size % rt.br == 0 and kv_block_size % rt.bc == 0:
                return Variant(hopper_dim, dtype, rt.br, rt.bc, rt.warps, stages, causal, partial, bias, mask_expr,
                               score_expr, family="tma", head_dim_valid=valid, **rt.options())
    if hopper and (family == "tma" or (family == "auto" and auto_picks_tma(hopper_dim, causal, extras, mask_expr))):
        # auto: only the tuned tile measured faster; the fallback tiles run when asked for
        tm = _hopper_tile("tma", hopper_dim, stages, q_block_size, kv_block_size, fallbacks=family == "tma")
        if tm is not None and extras:  # per-score work needs the registers the pipelines hold P in
            tm = dataclasses.replace(tm, overlap=False, pingpong=False)
        if tm is not None:
            return Variant(hopper_dim, dtype, tm.br, tm.bc, tm.warps, stages, causal, partial, bias, mask_expr,
                           score_expr, family="tma", head_dim_valid=valid, **tm.options())
    if family != "sync" and hopper:
        wg = _hopper_tile("wgmma", hopper_dim, stages, q_block_size, kv_block_size)
        if wg is not None and extras:
            # per-score work needs the registers the overlapped pipeline holds P in
            wg = dataclasses.replace(wg, overlap=False)
        if wg is not None:
            return Variant(hopper_dim, dtype, wg.br, wg.bc, wg.warps, stages, causal, partial, bias, mask_expr,
                           score_expr, family="wgmma", head_dim_valid=valid, **wg.options())
    if family == "wgmma":
        raise ArgumentError(
            f"OMNICUPY_MMA=wgmma, but no wgmma kernel fits (device arch {arch}, head_dim {valid}, "
            f"q_block_size {q_block_size}, kv_block_size {kv_block_size}); wgmma needs sm_90, a head dim in "
            f"{HOPPER_HEAD_DIM_RANGES} and q blocks a multiple of 64")
    tile = select_tile(head_dim, stages, q_block_size, kv_block_size, extras)
    return Variant(head_dim, dtype, tile.br, tile.bc, tile.warps, stages, causal, partial, bias, mask_expr, score_expr,
                   head_dim_valid=valid, **tile.options())


def shipped_variants(dtypes=("fp16", "bf16"), head_dims=SUPPORTED_HEAD_DIMS, stages=(1, 2),
                     families=("sync", "wgmma", "tma")) -> list[Variant]:
    """Every tuned variant with every mask-feature combination: what CI compiles and the CLI precompiles.

    wgmma and tma variants build for sm_90 only (as sm_90a); see Variant.target_arch."""
    out = []
    for family in families:
        table = _TABLES[family]
        for valid in head_dims:
            # a padded head dim (not a tile's) ships on the tile select_variant gives it
            hd = tile_head_dim(valid) if family == "sync" else hopper_head_dim(valid)
            for dt in dtypes:
                for st in stages:
                    tile = table.get((hd, st))
                    if tile is None:
                        continue
                    for causal in (False, True):
                        for partial in (False, True):
                            out.append(Variant(hd, dt, tile.br, tile.bc, tile.warps, st, causal, partial, family=family,
                                               head_dim_valid=valid, **tile.options()))
                    # the rule and block tiles (192-row q blocks), every mask feature combination
                    extra = {e.tile for (d, s_, _), e in TMA_RULE_TILES.items() if (d, s_) == (valid, st)}
                    extra |= {t for key, t in TMA_BLOCK_TILES.items() if key == (valid, st)}
                    for rt in (sorted(extra, key=repr) if family == "tma" else ()):
                        for causal in (False, True):
                            for partial in (False, True):
                                out.append(Variant(hd, dt, rt.br, rt.bc, rt.warps, st, causal, partial,
                                                   family=family, head_dim_valid=valid, **rt.options()))
    return out


#: family -> its tuned table.
_TABLES = {"sync": TUNED, "wgmma": WGMMA_TUNED, "tma": TMA_TUNED}


# ---------------------------------------------------------------- backward (mma.sync and wgmma)
@dataclass(frozen=True)
class BwdTile:
    """A backward tile: ``br`` q rows per walked q tile, ``bc`` kv rows per CTA split among ``warps``
    warps, ``stages`` Q/dO buffers (2: the next q tile prefetched), ``parts`` q parts (mma.sync:
    Variant.parts)."""

    br: int
    bc: int
    warps: int
    stages: int = 2
    parts: int = 1

    def fits(self, head_dim: int) -> bool:
        """The kernel's static rules (kernels/bwd_kv_tile.cuh Shape): whole m16 tiles of kv rows per
        warp, and dQ columns per warp in whole n16 pairs."""
        return (self.bc % (16 * self.warps) == 0 and self.bc % 32 == 0 and self.br % 16 == 0
                and bwd_dq_row_warps(self.warps, self.br, min(head_dim, 128)) > 0
                and bwd_parts_error(head_dim, self.br, self.bc, self.warps, self.parts) is None)


#: head_dim -> backward tile. D = 64 and 128 measured on the lent H200 (benchmarks/tune_backward.py,
#: N = 8192, full and causal): 128 kv rows per CTA on 8 warps beat 64 on 4 by 1.3-1.6x (half the
#: dQ atomics per q tile), and two q parts beat one by 1.07-1.14x (NOTES.md §40). 32 and 96 follow
#: 64 and 128 untimed (with one part); D = 256 runs as two column passes of 128 with the smaller
#: tile its registers allow.
BACKWARD_TILES: dict[int, BwdTile] = {
    32: BwdTile(64, 128, 8), 64: BwdTile(64, 128, 8, parts=2), 96: BwdTile(64, 128, 8),
    128: BwdTile(64, 128, 8, parts=2), 256: BwdTile(32, 64, 4),
}
#: With a bias or score modifier (more registers per score: 32-row q tiles at D = 128; one q part,
#: as two spilled or ran 7-15 % slower with them, NOTES.md §40).
BACKWARD_FEATURE_TILES: dict[int, BwdTile] = {
    32: BwdTile(64, 128, 8), 64: BwdTile(64, 128, 8), 96: BwdTile(64, 128, 8), 128: BwdTile(32, 128, 8),
    256: BwdTile(32, 64, 4),
}
#: For block sizes the tuned tile does not divide, or shared memory it does not fit (the two-part
#: D = 128 tile keeps Pᵀ in shared memory too: 173 KB, over sm_80's and sm_86's limits); most
#: preferred first.
BACKWARD_FALLBACKS = (BwdTile(64, 128, 8), BwdTile(32, 128, 8), BwdTile(64, 64, 4), BwdTile(32, 64, 4),
                      BwdTile(64, 32, 2), BwdTile(32, 32, 2), BwdTile(16, 32, 2), BwdTile(32, 32, 2, stages=1),
                      BwdTile(16, 32, 2, stages=1))

#: The wgmma backward (sm_90a): head_dim -> tile, q tiles of 64 rows. D = 64: one consumer
#: warpgroup owning 64 kv rows (kernels/bwd_wgmma.cuh), three CTAs per SM. D = 128: the
#: warp-specialized kernel (kernels/bwd_ws.cuh), 12 warps: two consumer warpgroups owning 128 kv
#: rows and a producer warpgroup that loads Q/dO and adds dQ. Measured on the H200 against
#: BwdTile(64, 64, 4) (NOTES.md §31, B = 2, H = 16, N = 8192, one process): 1.14x on full,
#: 1.10x on causal, 1.0-1.03x on document and random blocks; 1.33-1.54x in deterministic mode.
#: BwdTile(64, 128, 8) (two warpgroups, no producer) also builds.
WGMMA_BACKWARD_TILES: dict[int, BwdTile] = {64: BwdTile(64, 64, 4), 128: BwdTile(64, 128, 12)}
#: Head dims for which OMNICUPY_BWD=auto picks the wgmma backward on sm_90. Measured on the H200
#: (BENCHMARKS.md, fp16, B = 2, H = 16, N = 8192, 8 masks): 1.26-1.43x the mma.sync backward at
#: D = 64 and 1.24-1.34x at D = 128, on every mask.
WGMMA_BWD_AUTO_HEAD_DIMS: frozenset[int] = frozenset({64, 128})


def backward_variant(tile: BwdTile, head_dim: int, dtype: str, causal: bool, partial: bool, bias: Optional[str] = None,
                     mask_expr: Optional[tuple] = None, score_expr: Optional[tuple] = None,
                     score_grad: Optional[str] = None, head_dim_valid: Optional[int] = None,
                     family: str = "sync") -> Variant:
    """``head_dim``: the tile's (BACKWARD_TILES' key); ``head_dim_valid``: the caller's when smaller."""
    return Variant(head_dim, dtype, tile.br, tile.bc, tile.warps, tile.stages, causal, partial, bias, mask_expr,
                   score_expr, operation="backward", score_grad=score_grad, head_dim_valid=head_dim_valid,
                   family=family, parts=tile.parts)


def backward_family(head_dim: int, arch: Optional[str]) -> str:
    """The family the switches ask for: OMNICUPY_BWD (auto, sync, wgmma), with OMNICUPY_MMA=sync
    forcing mma.sync under auto; auto takes wgmma for WGMMA_BWD_AUTO_HEAD_DIMS on sm_90. A wgmma
    request is served only where a wgmma kernel can run (select_backward_variant falls back)."""
    wanted = env.backward_family()
    if wanted == "auto":
        hopper = arch is not None and has_wgmma(arch)
        auto = hopper and head_dim in WGMMA_BWD_AUTO_HEAD_DIMS and env.mma_family() != "sync"
        return "wgmma" if auto else "sync"
    return wanted


#: For kv blocks the tuned wgmma tile does not divide (64-row kv blocks at D = 128), and for calls
#: with a bias: its loads on top of the warp-specialized consumers' 224 registers spilled 196-292
#: bytes (unmeasured on a GPU), so those keep the plain kernel. Score modifiers spill too and still
#: measured 1.12-1.17x faster on the warp-specialized kernel (soft-cap, ALiBi; NOTES.md §31).
WGMMA_BACKWARD_FALLBACK = BwdTile(64, 64, 4)


def _wgmma_backward_tile(head_dim: int, q_block_size: int, kv_block_size: int, arch: Optional[str],
                         extras: bool = False) -> Optional[BwdTile]:
    tile = WGMMA_BACKWARD_TILES.get(head_dim)
    if tile is None or arch is None or not has_wgmma(arch):
        return None
    candidates = (WGMMA_BACKWARD_FALLBACK,) if extras else (tile, WGMMA_BACKWARD_FALLBACK)
    return next((c for c in candidates if q_block_size % c.br == 0 and kv_block_size % c.bc == 0), None)


def select_backward_variant(head_dim: int, dtype: str, q_block_size: int, kv_block_size: int, causal: bool,
                            partial: bool, bias: Optional[str] = None, mask_expr: Optional[tuple] = None,
                            score_expr: Optional[tuple] = None, score_grad: Optional[str] = None,
                            arch: Optional[str] = None, family: Optional[str] = None) -> Variant:
    """The backward kernel for a call. ``family`` (default: ``backward_family``) "wgmma": the wgmma
    tile where it runs (sm_90, its head dims unpadded, block sizes it divides), else mma.sync as
    below. mma.sync: the tuned tile if it divides the block sizes (and its shared memory fits
    ``arch``), else the first fallback that does."""
    valid = check_head_dim(head_dim)
    if (family or backward_family(valid, arch)) == "wgmma":
        tile = _wgmma_backward_tile(valid, q_block_size, kv_block_size, arch, extras=bias is not None)
        if tile is not None:
            return backward_variant(tile, valid, dtype, causal, partial, bias, mask_expr, score_expr, score_grad,
                                    family="wgmma")
    head_dim = tile_head_dim(valid)
    extras = bias is not None or score_expr is not None
    tuned = (BACKWARD_FEATURE_TILES if extras else BACKWARD_TILES)[head_dim]
    for tile in dict.fromkeys((tuned, *BACKWARD_FALLBACKS)):  # the tuned tile may be a fallback too
        if not tile.fits(head_dim) or q_block_size % tile.br or kv_block_size % tile.bc:
            continue
        variant = backward_variant(tile, head_dim, dtype, causal, partial, bias, mask_expr, score_expr, score_grad,
                                   head_dim_valid=valid)
        if arch is None or variant.runs_on(arch):
            return variant
    raise ArgumentError(
        f"block_mask: no backward tile divides q_block_size={q_block_size} and kv_block_size={kv_block_size} "
        f"and fits the shared memory of {arch} at head_dim {valid} (q blocks must be a multiple of 16, "
        f"kv blocks of 32)")


def shipped_backward_variants(dtypes=("fp16", "bf16"), head_dims=SUPPORTED_HEAD_DIMS,
                              families=("sync", "wgmma")) -> list[Variant]:
    """Every tuned backward variant with every mask-feature combination: what CI compiles and the
    CLI precompiles (mma.sync builds for sm_80 and sm_90, every head dim on its padded tile; wgmma
    for sm_90 only, as sm_90a, at its own head dims)."""
    out = []
    if "sync" in families:
        out += [backward_variant(BACKWARD_TILES[tile_head_dim(hd)], tile_head_dim(hd), dt, causal, partial,
                                 head_dim_valid=hd)
                for hd in head_dims for dt in dtypes for causal in (False, True) for partial in (False, True)]
    if "wgmma" in families:
        out += [backward_variant(WGMMA_BACKWARD_TILES[hd], hd, dt, causal, partial, family="wgmma")
                for hd in head_dims if hd in WGMMA_BACKWARD_TILES
                for dt in dtypes for causal in (False, True) for partial in (False, True)]
    return out
