"""The warp-specialized wgmma backward (kernels/bwd_ws.cuh, rendered by the wgmma backward's
template): a producer warpgroup (two loader warps and a dQ writer warp) beside two consumer
warpgroups (bc = 128); Q and dO through TMA where the inputs allow it (BwdParams' q_map/do_map).

What tells it apart from the plain wgmma backward (its warps) and what it adds to that kernel's
shared memory; the wgmma backward's spec (backward_wgmma.py) asks here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..variant import Variant

#: The producer warpgroup's warps.
WS_BWD_PRODUCER_WARPS = 4
#: Beyond the plain kernel's shared memory: 8 mbarrier slots of 8 bytes and three 32-byte q-tile
#: records (the loader's walk, handed to the consumers per stage and by them to the dQ writer).
WS_BWD_BARRIER_BYTES = 64 + 3 * 32
#: The tensor maps it reads (BwdParams fields) and the tensors they describe.
TENSOR_MAPS = (("q_map", "q"), ("do_map", "dout"))


def is_ws(v: "Variant") -> bool:
    """A wgmma backward with a producer warpgroup beside its bc / 64 consumer warpgroups."""
    return v.operation == "backward" and v.family == "wgmma" and v.warps == v.bc // 16 + WS_BWD_PRODUCER_WARPS


def extra_smem(v: "Variant") -> int:
    """The q tile's fp32 dQ staging and the mbarriers (a second dSᵀ buffer: backward_wgmma)."""
    return v.br * v.head_dim * 4 + WS_BWD_BARRIER_BYTES
