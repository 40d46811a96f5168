"""The backward on mma.sync (sm_80+): templates/attention_bwd.cu.jinja, BwdParams; entry points
``_pre`` (delta, LSE in log2 units), the main kv-tile kernel, ``_det`` (fixed-point dQ), ``_dq``
(conversion) and ``_kvb`` (K/V bounds for the fixed point).

Knobs: ``score_grad`` (the score modifier's derivative), ``parts`` (q parts per q tile). Its tile
tables, the rules of its tiles (q parts, dQ row warps, column parts), the row kernels' shape, and
the launches of one backward call (``launches``), which the wgmma backward shares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ...errors import VariantError
from .. import params
from .base import SMEM_PAD_ELEMS, KernelSpec, Launch, tile_error

if TYPE_CHECKING:
    from ..variant import Variant

#: Warps per CTA of the backward's row kernels (kernels/bwd_rows.cuh kRowWarps).
BWD_ROW_WARPS = 8
#: Rows of K and V per CTA of the ``_kvb`` kernel (kernels/bwd_rows.cuh kBoundRows; the template
#: static_asserts they agree).
BWD_BOUND_ROWS = 256
SUPPORTED_STAGES = (1, 2)


def bwd_parts_error(head_dim: int, br: int, bc: int, warps: int, parts: int) -> Optional[str]:
    """Why the mma.sync backward cannot run ``parts`` q parts on this tile (kernels/bwd_kv_tile.cuh
    kQSplit), or None. Two parts: each warp owns 32 kv rows (two m16 tiles) for half of each q
    tile's columns, whole k16 steps of them; its dK and dV fit its registers whole up to D = 64 (the
    parts' sums meet in the epilogue) and by halves of their columns at D = 128 (bwd_column_parts)."""
    if parts == 1:
        return None
    if parts != 2:
        return f"parts={parts}: one or two q parts"
    if not (br % 32 == 0 and warps % 2 == 0 and 2 * bc == 32 * warps):
        return (f"two q parts need br a multiple of 32 and bc = 16 * warps (32 kv rows per warp), "
                f"got br={br}, bc={bc}, warps={warps}")
    if not (head_dim <= 64 or head_dim == 128):
        return f"two q parts: head_dim up to 64 or 128 (dK and dV in registers), got {head_dim}"
    return None


def bwd_dq_row_warps(warps: int, br: int, d_out: int) -> int:
    """Warps along the q rows of dQ = dS K (kernels/bwd_kv_tile.cuh kDqRowWarps; the others split
    its ``d_out`` columns in whole n16 pairs): as many as divide the warps and the q tile's m16
    tiles (one m16 tile per warp where they can), except at 128 columns on 8 warps, where a warp
    reading (rows + columns) x bc elements of dSᵀ and K reads least on the squarest split (32 x 32
    on BwdTile(64, 128, 8): 2-3 % faster on the H200, lab/notes/backward.md#s40; at D = 64 the same rule
    measured a tie, and on 4 warps it made the D = 256 tile spill). 0 if no split divides."""
    valid = [r for r in (1, 2, 4, 8, 16) if r <= warps and warps % r == 0 and (br // 16) % r == 0
             and (d_out // (warps // r)) % 16 == 0]
    if d_out == 128 and warps == 8:  # accumulators of at most 32 floats a lane (m16 tiles x at most 64 columns)
        small = [r for r in valid if (br // r // 16) * min(d_out * r // warps, 64) // 8 * 4 <= 32]
        if small:
            return min(small, key=lambda r: (br // r + d_out * r // warps, -r))
    return max(valid, default=0)


def bwd_column_parts(head_dim: int, parts: int) -> bool:
    """Whether the q parts split dK and dV's columns (kernels/bwd_kv_tile.cuh kColumnParts; Pᵀ and
    dSᵀ then go through shared memory) rather than summing dK and dV over q (head dims up to 64)."""
    return parts == 2 and head_dim > 64


def row_kernel_rows(head_dim: int) -> int:
    """Query rows per CTA of the row kernels for rows of ``head_dim`` columns (the caller's):
    kernels/bwd_rows.cuh RowShape, one lane per 16-byte chunk, the chunks rounded up to a power of
    two, as many rows per warp as fit in 32 lanes (the templates static_assert that they agree)."""
    lanes = 1
    while lanes < head_dim // 8:
        lanes *= 2
    return BWD_ROW_WARPS * (32 // lanes)


@dataclass(frozen=True)
class BwdTile:
    """A backward tile: ``br`` q rows per walked q tile, ``bc`` kv rows per CTA split among ``warps``
    warps, ``stages`` Q/dO buffers (2: the next q tile prefetched), ``parts`` q parts."""

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
#: dQ atomics per q tile), and two q parts beat one by 1.07-1.14x (lab/notes/backward.md#s40). 32 and 96 follow
#: 64 and 128 untimed (with one part); D = 256 runs as two column passes of 128 with the smaller
#: tile its registers allow.
BACKWARD_TILES: dict[int, BwdTile] = {
    32: BwdTile(64, 128, 8), 64: BwdTile(64, 128, 8, parts=2), 96: BwdTile(64, 128, 8),
    128: BwdTile(64, 128, 8, parts=2), 256: BwdTile(32, 64, 4),
}
#: With a bias or score modifier (more registers per score: 32-row q tiles at D = 128; one q part,
#: as two spilled or ran 7-15 % slower with them, lab/notes/backward.md#s40).
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


def backward_values(v: "Variant", column_parts: bool) -> dict[str, Any]:
    """The template values of both backward families beyond the shared ones."""
    return {"row_rows": row_kernel_rows(v.real_head_dim), "column_parts": column_parts,
            "dq_row_warps": bwd_dq_row_warps(v.warps, v.br, min(v.head_dim, 128)), "bound_rows": BWD_BOUND_ROWS}


def backward_launches(v: "Variant", main_grid: tuple[int, int, int], *, batch: int, heads: int, kv_heads: int,
                      q_len: int, kv_len: int, fixed_point: bool) -> tuple[Launch, ...]:
    """Every launch of one backward call, in order: the K/V bounds (fixed-point dQ only), the
    preprocess over q rows padded to whole q tiles, the main kernel (``_det`` for the fixed point),
    the dQ conversion."""
    rows, row_block = row_kernel_rows(v.real_head_dim), (32 * BWD_ROW_WARPS, 1, 1)
    q_len_pad = -(-q_len // v.br) * v.br
    out = [Launch(f"{v.name}_kvb", (-(-kv_len // BWD_BOUND_ROWS), kv_heads, batch), row_block)] if fixed_point else []
    return (*out, Launch(f"{v.name}_pre", (-(-q_len_pad // rows), heads, batch), row_block),
            Launch(v.name + ("_det" if fixed_point else ""), main_grid, (v.threads, 1, 1), v.smem_bytes),
            Launch(f"{v.name}_dq", (-(-q_len // rows), heads, batch), row_block))


class BackwardSync(KernelSpec):
    operation, family, prefix = "backward", "sync", "omni_bwd"
    template = "attention_bwd.cu.jinja"
    struct = params.BACKWARD
    knobs = frozenset({"score_grad", "parts"})
    entries = ("_pre", "", "_det", "_dq", "_kvb")

    def check(self, v: "Variant") -> None:
        if v.stages not in SUPPORTED_STAGES:
            raise VariantError(f"stages must be 1 or 2, got {v.stages}")
        # the CTA owns a kv tile (bc rows, split among the warps) and walks q tiles of br rows
        problem = tile_error("bc", v.bc, v.warps) or (f"backward: br={v.br} must be a multiple of 16" if v.br % 16
                                                      else None)
        problem = problem or bwd_parts_error(v.head_dim, v.br, v.bc, v.warps, v.parts)
        if problem:
            raise VariantError(problem)

    def column_parts(self, v: "Variant") -> bool:
        return bwd_column_parts(v.head_dim, v.parts)

    def smem_bytes(self, v: "Variant") -> int:
        """The CTA's K and V tiles (bc rows), ``stages`` buffers of the q tile's Q and dO (br rows)
        with its LSE, rowsum(dO O) and fixed-point units (fp32; read by the deterministic entry
        only), and dSᵀ (bc x br, padded rows), with column parts Pᵀ too."""
        row_bytes = (v.head_dim + SMEM_PAD_ELEMS) * 2
        transposed = v.bc * (v.br + SMEM_PAD_ELEMS) * 2
        return ((2 * v.bc + 2 * v.stages * v.br) * row_bytes + (2 if self.column_parts(v) else 1) * transposed
                + 3 * v.stages * v.br * 4)

    def template_values(self, v: "Variant") -> dict[str, Any]:
        return backward_values(v, self.column_parts(v))


SPEC = BackwardSync()
