"""Split-KV decode (sm_80+): templates/attention_decode.cu.jinja, kernels/decode_split.cuh,
DecodeParams. ``br`` is the m tile (packed query rows: 16, 32 or 64), one warp per 16 of them; the
warps form warps / (br / 16) kv groups, each walking its own 32-key tiles through a ``stages``-deep
cp.async ring.

Its tile table (DECODE_TILES, rebindable by tuning tools) and ``decode_variant``, which trims the
ring to an arch's shared memory. How rows are packed and keys split: dispatch/decode_plan.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ...errors import ArgumentError, VariantError
from .. import params
from .base import SMEM_PAD_ELEMS, KernelSpec

if TYPE_CHECKING:
    from ..variant import Variant

DECODE_BC = 32
DECODE_BR = (16, 32, 64)
DECODE_STAGES = (2, 3, 4, 5)
DECODE_WARP_ROWS = 16
#: Per kv group and stage, the ring's record of the tile in flight (start, type, pool index, valid bits).
DECODE_RING_BYTES = 16


class TileTable(Mapping):
    """DECODE_TILES' type: a read-only mapping, hashed once, so that the plan cache and the
    steady-state keys can hold the table itself (decode_plan.settings()). Tuning tools change it
    by rebinding: ``decode.DECODE_TILES = decode.DECODE_TILES.updated({(128, 16): (2, 3)})``."""

    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping) -> None:
        self._entries = dict(entries)
        self._hash = hash(frozenset(self._entries.items()))

    def __getitem__(self, key: Any) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self._entries == dict(other) if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return f"TileTable({self._entries!r})"

    def updated(self, entries: Mapping) -> "TileTable":
        """A new table: this one with ``entries`` added or replaced."""
        return TileTable({**self._entries, **dict(entries)})


#: (head_dim, m tile rows) -> (warps, ring stages). One warp per 16 rows; the rest of the warps
#: form independent kv groups (decode_split.cuh). Shared memory per CTA stays under Hopper's
#: 227 KB; decode_variant trims stages, then kv groups, where the arch has less.
DECODE_TILES = TileTable({
    (32, 16): (4, 4), (32, 32): (4, 4), (32, 64): (8, 4),
    (64, 16): (4, 4), (64, 32): (4, 4), (64, 64): (8, 3),
    (96, 16): (4, 3), (96, 32): (4, 3), (96, 64): (8, 3),
    (128, 16): (4, 3), (128, 32): (4, 3), (128, 64): (8, 3),
    (256, 16): (2, 3), (256, 32): (4, 3), (256, 64): (4, 3),
})


def kv_groups(v: "Variant") -> int:
    """Groups of warps that walk kv tiles independently (each owns a ring)."""
    return v.warps // (v.br // DECODE_WARP_ROWS)


def check_warps(v: "Variant") -> None:
    """Both decode kernels: 1..8 warps on 32-key tiles."""
    if v.warps < 1 or v.warps > 8:
        raise VariantError(f"{v.operation}: warps must be 1..8, got {v.warps}")
    if v.bc != DECODE_BC:
        raise VariantError(f"{v.operation}: bc must be {DECODE_BC}, got {v.bc}")


class DecodeSplit(KernelSpec):
    operation, family, prefix = "decode", "sync", "omni_decode"
    template = "attention_decode.cu.jinja"
    struct = params.DECODE

    def check(self, v: "Variant") -> None:
        check_warps(v)
        if v.br not in DECODE_BR or v.stages not in DECODE_STAGES:
            raise VariantError(f"decode: br must be one of {DECODE_BR} and stages one of {DECODE_STAGES}, "
                               f"got br={v.br} stages={v.stages}")
        if v.warps % (v.br // DECODE_WARP_ROWS) or kv_groups(v) > 8:
            raise VariantError(f"decode: warps ({v.warps}) must be a multiple of br / {DECODE_WARP_ROWS} "
                               f"({v.br // DECODE_WARP_ROWS}) with at most 8 kv groups")

    def smem_bytes(self, v: "Variant") -> int:
        """The Q tile, then either every kv group's ring of K and V tiles plus its ring records, or
        (after the kv loop, in the same bytes) the fp32 merge of the groups' partial rows."""
        row_bytes = (v.head_dim + SMEM_PAD_ELEMS) * 2
        ring = kv_groups(v) * v.stages * (2 * v.bc * row_bytes + DECODE_RING_BYTES)
        merge = kv_groups(v) * v.br * ((v.head_dim + 4) * 4 + 8)
        return v.br * row_bytes + max(ring, merge)


SPEC = DecodeSplit()


def decode_variant(head_dim: int, dtype: str, br: int, *, causal: bool, partial: bool,
                   score_expr: Optional[tuple], smem_limit: int) -> "Variant":
    """The split kernel for this tile, with its ring trimmed to ``smem_limit`` bytes. A head dim
    between the tiles' runs padded on the next one (Variant.head_dim_valid)."""
    from ..variant import Variant, tile_head_dim

    valid, head_dim = head_dim, tile_head_dim(head_dim)
    warps, stages = DECODE_TILES[(head_dim, br)]
    row_warps = br // DECODE_WARP_ROWS
    while True:
        v = Variant(head_dim, dtype, br, DECODE_BC, warps, stages, causal, partial, score_expr=score_expr,
                    operation="decode", head_dim_valid=valid)
        if v.smem_bytes <= smem_limit:
            return v
        if stages > 2:
            stages -= 1
        elif warps > row_warps:
            warps -= row_warps
        else:
            raise ArgumentError(f"no decode tile for head_dim {head_dim} fits {smem_limit} bytes of shared memory")
