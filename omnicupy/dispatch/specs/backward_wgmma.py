"""The backward on Hopper's warpgroup MMA (sm_90a): templates/attention_bwd_sm90.cu.jinja, BwdParams,
the same entry points as the mma.sync backward (backward_sync.py). Plain (one consumer warpgroup per
64 kv rows) or warp-specialized (backward_ws.py: a producer warpgroup beside two).

Knob: ``score_grad``. Its tiles and the head dims OMNICUPY_BWD=auto takes it for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import VariantError
from .. import params
from . import backward_ws
from .backward_sync import BwdTile, backward_values
from .base import SMEM_PAD_ELEMS, SWIZZLE_ATOM_BYTES, KernelSpec

if TYPE_CHECKING:
    from ..variant import Variant

#: Head dims of the wgmma backward (kernels/bwd_wgmma.cuh); 256 stays on mma.sync.
WGMMA_BWD_HEAD_DIMS = (64, 128)
#: head_dim -> tile, q tiles of 64 rows. D = 64: one consumer warpgroup owning 64 kv rows, three
#: CTAs per SM. D = 128: the warp-specialized kernel, 12 warps: two consumer warpgroups owning 128
#: kv rows and a producer warpgroup that loads Q/dO and adds dQ. Measured on the H200 against
#: BwdTile(64, 64, 4) (lab/notes/backward.md#s31, B = 2, H = 16, N = 8192, one process): 1.14x on full,
#: 1.10x on causal, 1.0-1.03x on document and random blocks; 1.33-1.54x in deterministic mode.
#: BwdTile(64, 128, 8) (two warpgroups, no producer) also builds.
WGMMA_BACKWARD_TILES: dict[int, BwdTile] = {64: BwdTile(64, 64, 4), 128: BwdTile(64, 128, 12)}
#: Head dims for which OMNICUPY_BWD=auto picks the wgmma backward on sm_90. Measured on the H200
#: (docs/performance.md, fp16, B = 2, H = 16, N = 8192, 8 masks): 1.26-1.43x the mma.sync backward at
#: D = 64 and 1.24-1.34x at D = 128, on every mask.
WGMMA_BWD_AUTO_HEAD_DIMS: frozenset[int] = frozenset({64, 128})
#: For kv blocks the tuned tile does not divide (64-row kv blocks at D = 128), and for calls with a
#: bias: its loads on top of the warp-specialized consumers' 224 registers spilled 196-292 bytes
#: (unmeasured on a GPU), so those keep the plain kernel. Score modifiers spill too and still
#: measured 1.12-1.17x faster on the warp-specialized kernel (soft-cap, ALiBi; lab/notes/backward.md#s31).
WGMMA_BACKWARD_FALLBACK = BwdTile(64, 64, 4)


class BackwardWgmma(KernelSpec):
    operation, family, prefix = "backward", "wgmma", "omni_bwd"
    template = "attention_bwd_sm90.cu.jinja"
    struct = params.BACKWARD
    knobs = frozenset({"score_grad"})
    entries = ("_pre", "", "_det", "_dq", "_kvb")

    def check(self, v: "Variant") -> None:
        """q tiles of 64 rows (one m64 wgmma for dQ), one consumer warpgroup (4 warps) per 64 kv
        rows, double-buffered Q/dO, head dims whose dQ columns split into whole 64-column swizzle
        blocks per warpgroup."""
        groups = v.bc // 64
        producer = backward_ws.WS_BWD_PRODUCER_WARPS
        if (v.head_dim not in WGMMA_BWD_HEAD_DIMS or v.br != 64 or v.bc not in (64, 128)
                or v.warps not in (4 * groups, 4 * groups + producer) or v.stages != 2
                or (v.head_dim // groups) % 64 or (backward_ws.is_ws(v) and groups != 2)):
            raise VariantError(f"wgmma backward: head_dim in {WGMMA_BWD_HEAD_DIMS}, br=64, bc 64 or 128 with 4 warps "
                               f"per 64 kv rows (plus {producer} producer warps when warp-specialized, with bc=128), "
                               f"stages=2, and head_dim / (bc / 64) a multiple of 64; got "
                               f"head_dim={v.head_dim} br={v.br} bc={v.bc} warps={v.warps} stages={v.stages}")

    def smem_bytes(self, v: "Variant") -> int:
        """kernels/bwd_wgmma.cuh Smem: swizzled K, V, Q/dO stages; dSᵀ padded (two buffers when
        warp-specialized); LSE, delta; a PARTIAL q tile's bits per stage; the rows' fixed-point
        units (read by the deterministic entry only); the warp-specialized kernel's own part."""
        ws = backward_ws.is_ws(v)
        return (SWIZZLE_ATOM_BYTES + (2 * v.bc + 2 * v.stages * v.br) * v.head_dim * 2
                + (2 if ws else 1) * v.bc * (v.br + SMEM_PAD_ELEMS) * 2 + 2 * v.stages * v.br * 4
                + v.stages * v.br * v.bc // 8
                + (backward_ws.extra_smem(v) if ws else 0)
                + v.stages * v.br * 4)

    def m_tiles(self, v: "Variant") -> int:
        return 1

    def name_suffix(self, v: "Variant") -> str:
        return "_wgmma"

    def template_values(self, v: "Variant") -> dict[str, Any]:
        return backward_values(v, False)


SPEC = BackwardWgmma()
