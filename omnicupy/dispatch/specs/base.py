"""What every kernel slot shares: the KernelSpec contract, the tile records, the launch record and
the constants more than one slot's formula uses.

A KernelSpec (one module per (operation, family) beside this one, registered in
``specs/__init__.py``) is everything one kernel is: the Variant knobs it reads beyond the shared
ones, its checks, its shared-memory formula, its template and entry points, its parameter struct,
the template values beyond the shared ones, and its launches. ``dispatch/variant.py``'s Variant is
the shared key (name, cache stem, template values) and asks its spec for everything else.

Knows shapes and kernels' needs; nothing of arrays, NVRTC or the architecture table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ...errors import VariantError
from ..abi import ParamStruct

if TYPE_CHECKING:
    from ..variant import Variant

#: Elements of padding per shared-memory row of the mma.sync kernels (keeps ldmatrix conflict-free).
SMEM_PAD_ELEMS = 8
#: Alignment slack of the wgmma kernels' swizzled tiles.
SWIZZLE_ATOM_BYTES = 1024
#: Head dims of the wgmma-based kernels' tiles (the 128-byte swizzle works in 64-column blocks).
WGMMA_HEAD_DIMS = (64, 128, 256)
#: kv tile widths with a wgmma shape (tools/gen_wgmma_ops.py).
WGMMA_BC = (32, 64, 128, 256)

#: Variant fields every spec reads; the others are a spec's own knobs (KernelSpec.knobs).
SHARED_FIELDS = frozenset({"head_dim", "dtype", "br", "bc", "warps", "stages", "causal", "partial", "bias",
                           "mask_expr", "score_expr", "family", "operation", "head_dim_valid"})
#: The value a knob has when a spec does not own it (Variant's defaults).
KNOB_DEFAULTS: dict[str, Any] = {"overlap": False, "poly_exp": 0, "score_grad": None, "pingpong": False, "parts": 1}


@dataclass(frozen=True)
class Tile:
    """A forward tile: ``br`` q rows, ``bc`` kv rows, ``warps``, and the Hopper pipelines' options."""

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
        if len(parts) < 3 or unknown or not all(p.isdigit() for p in parts[:3]):
            raise VariantError(f"tile spec {spec!r}: want br:bc:warps[:o][:pN][:pp]")
        br, bc, warps = (int(p) for p in parts[:3])
        return cls(br, bc, warps, overlap="o" in flags, poly_exp=poly[0] if poly else 0, pingpong="pp" in flags)

    def options(self) -> dict:
        """The Variant fields this tile sets beyond br, bc, warps."""
        return {"overlap": self.overlap, "poly_exp": self.poly_exp, "pingpong": self.pingpong}


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: the entry point (the variant's name plus a suffix), grid, block,
    dynamic shared memory."""

    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0


class KernelSpec:
    """One kernel slot. Subclasses set the class attributes and override what differs."""

    operation: str = ""
    family: str = ""
    #: The template under templates/ that renders it.
    template: str = ""
    #: The kernel-name prefix of its operation.
    prefix: str = ""
    #: Its parameter struct (dispatch/params.py, composed of shared groups).
    struct: ParamStruct
    #: Variant fields it reads beyond SHARED_FIELDS.
    knobs: frozenset[str] = frozenset()
    #: Entry-point suffixes of its module beside the main one ("" is the main entry).
    entries: tuple[str, ...] = ("",)

    def check(self, v: "Variant") -> None:
        """Raise VariantError when ``v`` is not a kernel of this slot (after the shared checks)."""

    def smem_bytes(self, v: "Variant") -> int:
        """Dynamic shared memory of ``v``'s main entry (every registered slot defines it)."""
        raise VariantError(f"the {self.operation} {self.family} slot defines no shared-memory formula")

    def m_tiles(self, v: "Variant") -> int:
        """m16 tiles of q rows per warp (the template's ``m_tiles``)."""
        return v.br // v.warps // 16

    def persistent(self, v: "Variant") -> bool:
        """Whether the launch is persistent (one CTA per SM looping over tiles)."""
        return False

    def staging_swizzled(self, v: "Variant") -> bool:
        return False

    def name_suffix(self, v: "Variant") -> str:
        """The family's part of the kernel name (after the tile, before the features)."""
        return ""

    def template_values(self, v: "Variant") -> dict[str, Any]:
        """Template values beyond the shared ones (Variant.template_params)."""
        return {}

    def check_knobs(self, v: "Variant") -> None:
        """Refuse a knob this slot does not read, set away from its default."""
        for knob, default in KNOB_DEFAULTS.items():
            if knob not in self.knobs and getattr(v, knob) != default:
                raise VariantError(self.foreign_knob(knob))

    def foreign_knob(self, knob: str) -> str:
        if knob == "parts":
            return "parts: q parts are an mma.sync backward option"
        return f"{knob} is not an option of the {self.operation} {self.family} kernel"

    def main_launch(self, v: "Variant", grid: tuple[int, int, int]) -> Launch:
        return Launch(v.name, grid, (v.threads, 1, 1), v.smem_bytes)

    def __repr__(self) -> str:
        return f"<KernelSpec {self.operation}/{self.family}: {self.template}>"


def tile_error(label: str, rows: int, warps: int) -> Optional[str]:
    """The shared rule of the warp-per-16-rows kernels: ``rows`` a multiple of 16 * warps."""
    if warps < 1 or rows % (16 * warps):
        return f"{label}={rows} must be a multiple of 16 * warps ({warps})"
    return None


__all__ = ["KernelSpec", "Launch", "Tile", "SHARED_FIELDS", "KNOB_DEFAULTS", "SMEM_PAD_ELEMS", "SWIZZLE_ATOM_BYTES",
           "WGMMA_HEAD_DIMS", "WGMMA_BC", "tile_error"]
