"""The kernel slots: one KernelSpec per (operation, family), one module each, and the registry.

    base            the KernelSpec contract, Tile, Launch, shared constants
    forward_sync    forward_wgmma    forward_tma
    backward_sync   backward_wgmma   (backward_ws: its warp-specialized kernel)
    decode_split    decode_combine

Adding a kernel: its module here (config checks, shared memory, tiles, struct, template, launches),
its template under templates/, its tests, and one line in SPECS below.
"""
from __future__ import annotations

from ...errors import VariantError
from . import backward_sync, backward_wgmma, decode_combine, decode_split, forward_sync, forward_tma, forward_wgmma
from .base import KernelSpec, Launch, Tile

#: (operation, family) -> its spec.
SPECS: dict[tuple[str, str], KernelSpec] = {
    ("forward", "sync"): forward_sync.SPEC,
    ("forward", "wgmma"): forward_wgmma.SPEC,
    ("forward", "tma"): forward_tma.SPEC,
    ("backward", "sync"): backward_sync.SPEC,
    ("backward", "wgmma"): backward_wgmma.SPEC,
    ("decode", "sync"): decode_split.SPEC,
    ("combine", "sync"): decode_combine.SPEC,
}


def spec_for(operation: str, family: str) -> KernelSpec:
    """The spec of ``operation`` on ``family``; VariantError naming the registered ones."""
    spec = SPECS.get((operation, family))
    if spec is None:
        raise VariantError(f"no {family!r} kernel for operation {operation!r} (have {sorted(SPECS)})")
    return spec


__all__ = ["SPECS", "KernelSpec", "Launch", "Tile", "spec_for"]
