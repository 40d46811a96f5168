"""Tile selection: which slot and tile a call runs on. The tables live with their slots
(dispatch/specs); this module decides between the families.

``select_variant`` turns a call's needs (head dim, dtype, stages, block sizes, mask features, the
target arch's capabilities) into a forward Variant: the tuned tile if it divides the mask's block
sizes, else the best fallback that does. ``select_backward_variant`` does the same for the
backward. Tables are keyed by the tile head dim; a caller's head dim between them runs padded on
the next one (variant.tile_head_dim, Variant.head_dim_valid). The table names stay importable
from here (tuning scripts, tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping, Optional

from ..errors import ArgumentError
from ..jit import env
from .arch import runs_family
from .specs.backward_sync import (BACKWARD_FALLBACKS, BACKWARD_FEATURE_TILES, BACKWARD_TILES,  # noqa: F401
                                  BwdTile)
from .specs.backward_wgmma import WGMMA_BACKWARD_FALLBACK, WGMMA_BACKWARD_TILES, WGMMA_BWD_AUTO_HEAD_DIMS
from .specs.base import Tile
from .specs.forward_sync import DEFAULT_STAGES, FALLBACKS, FEATURE_TILES, TUNED, select_tile  # noqa: F401
from .specs.forward_tma import TMA_BLOCK_TILES, TMA_FALLBACKS, TMA_RULE_TILES, TMA_TUNED, RuleTile  # noqa: F401
from .specs.forward_wgmma import WGMMA_FALLBACKS, WGMMA_TUNED
from .variant import SUPPORTED_HEAD_DIMS, Variant, check_head_dim, tile_head_dim


#: Head dims for which OMNICUPY_MMA=auto picks the tma family on sm_90: only where it measured
#: faster than the wgmma family (lab/notes/forward.md#s12: D = 128 +24/+41 %, D = 256 +34/+28 % full/causal);
#: at D = 64 it measured 3-5 % slower before its CTAs were persistent (§12), and now wins only on
#: masks with CAUSAL blocks (TMA_AUTO_CAUSAL_HEAD_DIMS below).
TMA_AUTO_HEAD_DIMS: frozenset[int] = frozenset({128, 256})
#: Head dims for which auto picks the tma family only for masks with CAUSAL blocks and no per-score
#: work or fused mask expression. D = 64, measured on the H200 (lab/notes/forward.md#s24, benchmarks.run, fp16,
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
    return not extras and mask_expr is None and family in ("auto", "tma") and runs_family(arch, "tma")


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
    hopper = runs_family(arch, "wgmma") and hopper_dim is not None
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
        auto = runs_family(arch, "wgmma") and head_dim in WGMMA_BWD_AUTO_HEAD_DIMS and env.mma_family() != "sync"
        return "wgmma" if auto else "sync"
    return wanted


def _wgmma_backward_tile(head_dim: int, q_block_size: int, kv_block_size: int, arch: Optional[str],
                         extras: bool = False) -> Optional[BwdTile]:
    tile = WGMMA_BACKWARD_TILES.get(head_dim)
    if tile is None or not runs_family(arch, "wgmma"):
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
