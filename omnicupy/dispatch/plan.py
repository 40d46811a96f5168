"""Plan: which kernel a call runs and how it is launched, decided once and inspectable.

``plan_forward`` turns a call's needs (shapes, dtype, mask features, per-score extras, the device
arch) into a ``Plan``: the Variant, the grid, block and shared memory, the q-tile launch order, and
a sentence saying why this family and tile were chosen. ``attention()`` runs the plan it gets;
``omnicupy.plan()``, the CLI's ``demo`` and the tuning tools print the same object instead of
re-deriving it. Knows variants, tiles and the schedule; nothing of arrays or NVRTC.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import SizeLimitError
from ..jit import env
from ..mask import BlockMask, cdiv
from ..mask.builders import reblocked
from . import schedule, tiles
from .arch import runs_family, sm_count
from .specs.backward_sync import backward_launches
from .specs.base import Launch
from .variant import Variant

MAX_GRID_YZ = 65535
#: The tma family's flat tile index is an int32 (and grid.x at most 2^31 - 1).
MAX_FLAT_TILES = 2**31 - 1


@dataclass(frozen=True)
class Plan:
    """A launch, ready to run: the kernel, its geometry and the order of its q tiles."""

    variant: Variant
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    #: Host int32 [grid x]: q tile per blockIdx.x, or None for the kernel's own order (last first).
    q_tile_order: Optional[np.ndarray]
    arch: Optional[str]
    reason: str
    #: tma, persistent CTAs: host int32 (offsets [grid x + 1], flat tiles) from
    #: schedule.cta_tile_lists, or None: grid stride over the flat tiles.
    cta_tiles: Optional[tuple[np.ndarray, np.ndarray]] = None
    #: The mask the launch reads when it is not the caller's: a rule mask re-blocked for the tile
    #: (builders.reblocked, kept on the caller's mask); None: the caller's mask.
    block_mask: Optional[BlockMask] = None
    #: Every launch of the call, in order (the slot's launches; default: the main launch alone).
    launches: tuple[Launch, ...] = ()

    def __post_init__(self) -> None:
        if not self.launches:
            object.__setattr__(self, "launches", (Launch(self.variant.name, self.grid, self.block, self.smem_bytes),))

    @property
    def operation(self) -> str:
        return self.variant.operation

    @property
    def kernel(self) -> str:
        return self.variant.name

    def describe(self) -> str:
        order = "heaviest q tiles first (from the mask)" if self.q_tile_order is not None else "last q tile first"
        return (f"{self.operation}: {self.kernel}\n"
                f"  family {self.variant.family}, tile {self.variant.br}x{self.variant.bc}, "
                f"{self.variant.warps} warps, stages {self.variant.stages}, arch {self.arch or 'unknown'}\n"
                + (f"  head dim {self.variant.real_head_dim} padded to the tile's {self.variant.head_dim} (zero "
                   f"columns loaded, never stored)\n" if self.variant.padded else "")
                + f"  grid {self.grid}, block {self.block}, {self.smem_bytes} bytes of shared memory, {order}\n"
                f"  why: {self.reason}")

    def __str__(self) -> str:
        return self.describe()


def _why(variant: Variant, arch: Optional[str], extras: bool) -> str:
    family = env.mma_family()
    if variant.family == "tma":
        how = "OMNICUPY_MMA=tma" if family == "tma" else "measured faster than wgmma here"
        return (f"tma: the device is sm_90 and {how}; tile {variant.br}x{variant.bc} (TMA producer warpgroup, "
                f"{variant.br // 64} consumer warpgroups"
                + (", ping-pong" if variant.pingpong else "") + ") divides the mask's blocks; "
                + ("persistent CTAs, one per SM" if variant.persistent else "one CTA per tile (no room for "
                   "persistent CTAs' staging rows)"))
    if variant.family == "wgmma":
        return (f"wgmma: the device is sm_90 and the tuned Hopper tile {variant.br}x{variant.bc} divides the mask's "
                f"blocks" + (" (no P V overlap: per-score extras need its registers)" if extras else ""))
    if family == "sync":
        return "mma.sync: OMNICUPY_MMA=sync"
    if not runs_family(arch, "wgmma"):
        return f"mma.sync: wgmma needs sm_90 (device arch {arch or 'unknown'})"
    return (f"mma.sync: no wgmma tile for head_dim {variant.real_head_dim}, stages {variant.stages} and these "
            f"block sizes (wgmma: head_dim 40..64, 104..128 or 136..256, stages 2, q blocks a multiple of 64)")


def plan_forward(*, head_dim: int, dtype: str, batch: int, heads: int, block_mask: BlockMask,
                 stages: Optional[int], bias: Optional[str], mask_expr: Optional[tuple], score_expr: Optional[tuple],
                 arch: Optional[str], family: Optional[str] = None) -> Plan:
    """``family`` overrides OMNICUPY_MMA (the forward falls back to "wgmma" where TMA cannot go). A
    built-in rule mask (``block_mask.rule``) is re-blocked to the q blocks of its tile
    (tiles.rule_tile) when its own do not fit that tile; the plan then names the mask it launches."""
    bm = block_mask
    extras = bias is not None or score_expr is not None
    rt = None
    if bm.rule is not None:
        rt = tiles.rule_tile(bm.rule, head_dim, stages, bm.kv_len, arch, extras, mask_expr, family)
    if rt is not None and bm.q_block_size % rt.br and bm.kv_block_size % rt.bc == 0:
        bm = reblocked(bm, rt.br)
    variant = tiles.select_variant(head_dim, dtype, stages, bm.q_block_size, bm.kv_block_size, bm.features.causal,
                                   bm.features.partial, bias=bias, mask_expr=mask_expr, score_expr=score_expr,
                                   arch=arch, family=family, rule_tile=rt)
    order = schedule.launch_order(bm, variant.br)
    q_tiles = cdiv(bm.q_len, variant.br)
    grid, cta_tiles = (q_tiles, heads, batch), None
    if variant.family == "tma":  # flat tile indices; persistent CTAs: one per SM, looping over tiles
        flat = q_tiles * heads * batch
        if flat > MAX_FLAT_TILES:
            raise SizeLimitError(f"{flat} q tiles (q tiles x heads x batch) exceed the tma kernel's flat tile index "
                                 f"(at most {MAX_FLAT_TILES})")
        grid = (min(flat, sm_count()) if variant.persistent else flat, 1, 1)
        if variant.persistent:
            cta_tiles = schedule.cta_tile_lists(bm, variant.br, batch, heads, grid[0])
    reason = _why(variant, arch, extras)
    if bm is not block_mask:
        reason += (f"; the {bm.rule} rule mask re-blocked from {block_mask.q_block_size}- to {bm.q_block_size}-row "
                   f"q blocks for this tile")
    return Plan(variant=variant, grid=grid, block=(variant.threads, 1, 1),
                smem_bytes=variant.smem_bytes, q_tile_order=order, arch=arch, reason=reason, cta_tiles=cta_tiles,
                block_mask=bm if bm is not block_mask else None)


def plan_backward(*, head_dim: int, dtype: str, batch: int, kv_heads: int, block_mask: BlockMask,
                  bias: Optional[str], mask_expr: Optional[tuple], score_expr: Optional[tuple],
                  score_grad: Optional[str], arch: Optional[str], ordered_dq: bool = False,
                  heads: Optional[int] = None, deterministic: bool = False) -> Plan:
    """The backward's main kernel: one CTA per (kv tile, column pass) of each (batch, kv head); the
    row kernels around it (ops/backward.py) need no plan. Column passes split head dims above 128.
    ``ordered_dq``: a deterministic dQ the fixed point cannot bound (the mma.sync kernel's ordered sum).
    ``heads`` (Hq, default ``kv_heads``) and ``deterministic`` shape the launches around the main
    kernel (specs/backward_sync.backward_launches): a deterministic dQ in fixed point runs the
    ``_det`` entry after the K/V bounds."""
    bm = block_mask
    variant = tiles.select_backward_variant(head_dim, dtype, bm.q_block_size, bm.kv_block_size, bm.features.causal,
                                            bm.features.partial, bias=bias, mask_expr=mask_expr,
                                            score_expr=score_expr, score_grad=score_grad, arch=arch,
                                            family="sync" if ordered_dq else None)
    tile_dim = variant.head_dim  # the tile's head dim: padded columns are computed, never stored
    passes = tile_dim // min(tile_dim, 128) if variant.family == "sync" else 1
    if variant.family == "wgmma":
        reason = (f"backward wgmma ({'OMNICUPY_BWD=wgmma' if env.backward_family() == 'wgmma' else 'WGMMA_BWD_AUTO_HEAD_DIMS'}"
                  f" on sm_90): kv tiles of {variant.bc} rows, {variant.bc // 64} consumer warpgroup(s)"
                  f"{' and a producer warpgroup (loads, dQ adds)' if variant.warp_specialized else ''}, walking q "
                  f"tiles of {variant.br}")
    else:
        wanted = tiles.backward_family(head_dim, arch)
        why = ("deterministic dQ with a score derivative that may exceed 1 (summed in order)" if ordered_dq else
               "no wgmma backward tile for this head dim, arch and these block sizes (wgmma: sm_90, head_dim 64/128, "
               "q and kv blocks multiples of 64)" if wanted == "wgmma" else
               "OMNICUPY_BWD=sync" if env.backward_family() == "sync" else "the default (OMNICUPY_BWD=auto)")
        reason = (f"backward mma.sync: kv tiles of {variant.bc} rows walking q tiles of {variant.br} "
                  f"(BACKWARD_TILES): {why}")
    grid = (cdiv(bm.kv_len, variant.bc) * passes, kv_heads, batch)
    launches = backward_launches(variant, grid, batch=batch, heads=kv_heads if heads is None else heads,
                                 kv_heads=kv_heads, q_len=bm.q_len, kv_len=bm.kv_len,
                                 fixed_point=deterministic and not ordered_dq)
    return Plan(variant=variant, grid=grid, block=(variant.threads, 1, 1), smem_bytes=variant.smem_bytes,
                q_tile_order=None, arch=arch, reason=reason, launches=launches)


__all__ = ["Plan", "plan_forward", "plan_backward", "MAX_GRID_YZ"]
