"""The variant key: everything that selects one compiled kernel.

A Variant names its operation (``forward`` today; backward, decode and combine take their slots in
OPERATIONS), its family (the matrix instruction it is built on: ``sync`` for mma.sync, sm_80+;
``wgmma`` for Hopper's warpgroup MMA, sm_90a; ``tma``: wgmma fed by a TMA producer warpgroup,
sm_90a), its tile and its features. Everything a template
renders comes from ``template_params()``, including the operation's parameter struct
(``dispatch/params.py``) and the block-type enum (``mask/types.py``), so each is declared once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Optional

from ..mask import expressions
from . import params
from ..errors import HeadDimError, VariantError
from .arch import has_wgmma, smem_limit

#: Head dims the kernels compute on (their tiles): shipped, tuned and precompiled. A caller's head
#: dim D is any multiple of HEAD_DIM_STEP up to MAX_HEAD_DIM; it runs on the smallest tile that
#: holds it (tile_head_dim), with the columns past D zero-filled on load and skipped on store
#: (Variant.head_dim_valid; docs/design.md, "Padded head dims").
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
TILE_HEAD_DIMS = SUPPORTED_HEAD_DIMS
#: D % 8 == 0: every 16-byte chunk of a row (8 fp16/bf16 elements) is wholly real or wholly padding.
HEAD_DIM_STEP = 8
MAX_HEAD_DIM = 256
#: Every head dim a call may have (the CLI's choices).
ACCEPTED_HEAD_DIMS = tuple(range(HEAD_DIM_STEP, MAX_HEAD_DIM + 1, HEAD_DIM_STEP))
SUPPORTED_DTYPES = ("fp16", "bf16")
SUPPORTED_STAGES = (1, 2)
#: Elements of padding per shared-memory row of the mma.sync family (keeps ldmatrix conflict-free).
SMEM_PAD_ELEMS = 8
BIAS_DTYPES = ("fp16", "bf16", "fp32")

#: (operation, family) -> template under templates/. The operation axis: a new operation adds its
#: templates here, its parameter struct in params.py and its launch in omnicupy/ops.
TEMPLATES = {
    ("forward", "sync"): "attention_fwd.cu.jinja",
    ("forward", "wgmma"): "attention_fwd_sm90.cu.jinja",
    ("forward", "tma"): "attention_fwd_tma.cu.jinja",
    ("backward", "sync"): "attention_bwd.cu.jinja",
    ("backward", "wgmma"): "attention_bwd_sm90.cu.jinja",
    ("decode", "sync"): "attention_decode.cu.jinja",
    ("combine", "sync"): "attention_decode_combine.cu.jinja",
}
OPERATIONS = tuple(dict.fromkeys(op for op, _ in TEMPLATES))
FAMILIES = ("sync", "wgmma", "tma")
#: Families built on wgmma (sm_90a only).
HOPPER_FAMILIES = ("wgmma", "tma")
#: Kernel-name prefix per operation.
PREFIXES = {"forward": "omni_fwd", "backward": "omni_bwd", "decode": "omni_decode", "combine": "omni_combine"}
#: Split-KV decode (ops/decode.py, kernels/decode_split.cuh): br is the m tile (packed query rows:
#: 16, 32 or 64), one warp per 16 of them; the warps form warps / (br / 16) kv groups, each walking
#: its own 32-key tiles through a ``stages``-deep cp.async ring.
DECODE_BC = 32
DECODE_BR = (16, 32, 64)
DECODE_STAGES = (2, 3, 4, 5)
DECODE_WARP_ROWS = 16
#: Per kv group and stage, the ring's record of the tile in flight (start, type, pool index, valid bits).
DECODE_RING_BYTES = 16
WGMMA_HEAD_DIMS = (64, 128, 256)  # the 128-byte swizzle works in 64-column blocks
WGMMA_BC = (32, 64, 128, 256)  # kv tile widths with a wgmma shape (tools/gen_wgmma_ops.py)
#: Head dims of the wgmma backward (kernels/bwd_wgmma.cuh); 256 stays on mma.sync.
WGMMA_BWD_HEAD_DIMS = (64, 128)
#: The warp-specialized wgmma backward (kernels/bwd_ws.cuh): a producer warpgroup (two loader
#: warps and a dQ writer warp) beside two consumer warpgroups (bc = 128), and its shared memory
#: beyond the plain kernel's: the q tile's fp32 dQ staging, a second dSᵀ buffer, 8 mbarrier slots
#: of 8 bytes, and three 32-byte q-tile records (the loader's walk, handed to the consumers per
#: stage and by them to the dQ writer).
WS_BWD_PRODUCER_WARPS = 4
WS_BWD_BARRIER_BYTES = 64 + 3 * 32
SWIZZLE_ATOM_BYTES = 1024  # alignment slack for the wgmma family's swizzled tiles
#: tma family: the producer warpgroup's warps (one thread issues the loads), and the shared memory
#: its mbarriers take after the tiles (q full, then full/empty of K and V per stage: 8 bytes each).
TMA_PRODUCER_WARPS = 4
TMA_BARRIER_BYTES = 128


def check_head_dim(head_dim: object, name: str = "q") -> int:
    """``head_dim`` if the kernels can take it (a multiple of 8 in 8..256), else HeadDimError."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise HeadDimError(f"{name}: head_dim must be an int, got {head_dim!r}")
    if head_dim % HEAD_DIM_STEP or not HEAD_DIM_STEP <= head_dim <= MAX_HEAD_DIM:
        raise HeadDimError(f"{name}: head_dim {head_dim} is not supported: it must be a multiple of {HEAD_DIM_STEP} "
                           f"from {HEAD_DIM_STEP} to {MAX_HEAD_DIM} (rows of whole 16-byte chunks)")
    return head_dim


def tile_head_dim(head_dim: int, family: str = "sync") -> Optional[int]:
    """The tile a caller's head dim runs on in ``family``: the smallest of the family's tile head
    dims that holds it (mma.sync: TILE_HEAD_DIMS; wgmma and tma: WGMMA_HEAD_DIMS). None when the
    family has none (never for a checked head dim)."""
    check_head_dim(head_dim)
    dims = WGMMA_HEAD_DIMS if family in HOPPER_FAMILIES else TILE_HEAD_DIMS
    return next((d for d in dims if d >= head_dim), None)


#: Warps per CTA of the backward's row kernels (kernels/bwd_rows.cuh kRowWarps).
BWD_ROW_WARPS = 8
#: Rows of K and V per CTA of the wgmma backward's ``_kvb`` kernel (kernels/bwd_rows.cuh kBoundRows;
#: the template static_asserts they agree).
BWD_BOUND_ROWS = 256


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
    """Warps along the q rows of the mma.sync backward's dQ = dS K (kernels/bwd_kv_tile.cuh
    kDqRowWarps; the others split its ``d_out`` columns in whole n16 pairs): as many as divide the
    warps and the q tile's m16 tiles (one m16 tile per warp where they can), except at 128 columns
    on 8 warps, where a warp reading (rows + columns) x bc elements of dSᵀ and K reads least on the
    squarest split (32 x 32 on BwdTile(64, 128, 8): 2-3 % faster on the H200, NOTES.md §40; at
    D = 64 the same rule measured a tie, and on 4 warps it made the D = 256 tile spill). 0 if no
    split divides (BwdTile.fits rejects the tile)."""
    valid = [r for r in (1, 2, 4, 8, 16) if r <= warps and warps % r == 0 and (br // 16) % r == 0
             and (d_out // (warps // r)) % 16 == 0]
    if d_out == 128 and warps == 8:  # accumulators of at most 32 floats a lane (m16 tiles x at most 64 columns)
        small = [r for r in valid if (br // r // 16) * min(d_out * r // warps, 64) // 8 * 4 <= 32]
        if small:
            return min(small, key=lambda r: (br // r + d_out * r // warps, -r))
    return max(valid, default=0)


def bwd_column_parts(head_dim: int, parts: int) -> bool:
    """Whether the q parts split dK and dV's columns (kernels/bwd_kv_tile.cuh kColumnParts; Pᵀ and dSᵀ
    then go through shared memory) rather than summing dK and dV over q (head dims up to 64)."""
    return parts == 2 and head_dim > 64


def row_kernel_rows(head_dim: int) -> int:
    """Query rows per CTA of the backward's row kernels for rows of ``head_dim`` columns (the
    caller's): kernels/bwd_rows.cuh RowShape, one lane per 16-byte chunk, the chunks rounded up to a
    power of two, as many rows per warp as fit in 32 lanes. The templates static_assert that the
    kernel agrees (Variant.template_params ``row_rows``)."""
    lanes = 1
    while lanes < head_dim // 8:
        lanes *= 2
    return BWD_ROW_WARPS * (32 // lanes)


@dataclass(frozen=True, order=True)
class Variant:
    """One rendering of an operation's template for one family.

    ``name`` is the kernel's ``extern "C"`` symbol, the cache entry's stem and the log line, e.g.
    ``omni_fwd_fp16_hd128_br64_bc64_w4_st2_causal``.
    """

    head_dim: int
    dtype: str
    br: int
    bc: int
    warps: int
    stages: int
    causal: bool = False
    partial: bool = False
    #: dtype of an additive bias read by the kernel (None: no bias).
    bias: Optional[str] = None
    #: expressions.CudaExpr.key of a mask expression evaluated in PARTIAL blocks instead of bits.
    mask_expr: Optional[tuple] = None
    #: expressions.CudaExpr.key of a score modifier applied to every score.
    score_expr: Optional[tuple] = None
    #: "sync" (mma.sync, sm_80+), "wgmma" (Hopper warpgroup MMA, sm_90a only) or "tma" (wgmma
    #: consumers fed by a TMA producer warpgroup, sm_90a only).
    family: str = "sync"
    #: wgmma and tma: run P V of the previous tile behind S of this one (software pipeline).
    overlap: bool = False
    #: Every poly_exp-th n8 tile of S takes its exp2 on the FMA pipe instead of MUFU (0: never).
    poly_exp: int = 0
    #: What the kernel computes: one of OPERATIONS.
    operation: str = "forward"
    #: backward only: the CUDA text of d(score_expr)/d(score) (score_mods.ScoreMod.cuda_grad), over
    #: the score expression's names; score_mods.UNIT_GRAD for additive modifiers.
    score_grad: Optional[str] = None
    #: tma only, with overlap and two consumer warpgroups: they take turns issuing their GEMMs
    #: (named barriers), so that one's softmax runs under the other's GEMMs.
    pingpong: bool = False
    #: The caller's head dim when it is smaller than the tile's ``head_dim`` (a padded variant:
    #: loads zero-fill the 16-byte chunks past it, stores skip them); None when they are equal.
    head_dim_valid: Optional[int] = None
    #: backward (mma.sync) only: q parts of each q tile (kernels/bwd_kv_tile.cuh kQSplit; 2: two
    #: sets of warps take half of its columns each, bwd_parts_error, NOTES.md §40).
    parts: int = 1

    def __post_init__(self) -> None:
        if self.head_dim_valid == self.head_dim:  # one key, one name, one kernel per tile
            object.__setattr__(self, "head_dim_valid", None)
        if self.head_dim_valid is not None:
            try:
                check_head_dim(self.head_dim_valid)
            except HeadDimError as exc:
                raise VariantError(str(exc)) from None
            if self.head_dim_valid > self.head_dim:
                raise VariantError(f"head_dim_valid {self.head_dim_valid} exceeds the tile's head_dim {self.head_dim}")
        if self.bias not in (None, *BIAS_DTYPES):
            raise VariantError(f"bias dtype must be one of {BIAS_DTYPES} or None, got {self.bias!r}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise VariantError(f"head_dim {self.head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
        if self.dtype not in SUPPORTED_DTYPES:
            raise VariantError(f"dtype {self.dtype!r} is not supported (supported: {SUPPORTED_DTYPES})")
        if self.operation in ("decode", "combine"):
            self._check_decode()
        elif self.stages not in SUPPORTED_STAGES:
            raise VariantError(f"stages must be 1 or 2, got {self.stages}")
        else:
            # The warps split the rows of the tile they own: q rows in the forward, kv rows
            # (bc) in the backward, whose CTA owns a kv tile and walks q tiles of br rows.
            rows, label = (self.bc, "bc") if self.operation == "backward" else (self.br, "br")
            # tma and the warp-specialized backward: warps counts the producer warpgroup too; their
            # own checks below
            if self.warps < 1 or (self.family != "tma" and not self.warp_specialized and rows % (16 * self.warps)):
                raise VariantError(f"{label}={rows} must be a multiple of 16 * warps ({self.warps})")
            if self.operation == "backward" and self.br % 16:
                raise VariantError(f"backward: br={self.br} must be a multiple of 16")
        if self.bc % 32 or self.bc < 32:
            raise VariantError(f"bc={self.bc} must be a positive multiple of 32")
        if (self.operation, self.family) not in TEMPLATES:
            raise VariantError(f"no {self.family!r} kernel for operation {self.operation!r} "
                             f"(have {sorted(TEMPLATES)})")
        if self.overlap and self.family not in HOPPER_FAMILIES:
            raise VariantError("overlap is a wgmma/tma pipeline option")
        if self.pingpong and (self.family != "tma" or not self.overlap or self.br != 128):
            raise VariantError("pingpong is a tma option that needs overlap and two consumer warpgroups (br=128)")
        if self.poly_exp < 0 or (self.poly_exp and (self.bc // 8) % self.poly_exp):
            raise VariantError(f"poly_exp={self.poly_exp} must be 0 or divide the bc/8 = {self.bc // 8} n8 tiles")
        if self.parts != 1 and (self.operation, self.family) != ("backward", "sync"):
            raise VariantError(f"parts={self.parts}: q parts are an mma.sync backward option")
        problem = bwd_parts_error(self.head_dim, self.br, self.bc, self.warps, self.parts)
        if problem:
            raise VariantError(problem)
        if self.family == "wgmma" and self.operation == "backward":
            self._check_wgmma_backward()
        elif self.family == "wgmma":
            if self.head_dim not in WGMMA_HEAD_DIMS:
                raise VariantError(f"the wgmma family supports head_dim {WGMMA_HEAD_DIMS}, got {self.head_dim}")
            if self.br % 64 or self.warps != self.br // 16:
                raise VariantError(f"wgmma: br={self.br} must be a multiple of 64 with one warp per 16 rows "
                                 f"(warps={self.br // 16}), got warps={self.warps}")
            if self.bc not in WGMMA_BC:
                raise VariantError(f"wgmma: bc must be one of {WGMMA_BC}, got {self.bc}")
        if self.family == "tma":
            consumers = self.br // 16
            if self.head_dim not in WGMMA_HEAD_DIMS:
                raise VariantError(f"the tma family supports head_dim {WGMMA_HEAD_DIMS}, got {self.head_dim}")
            if self.br not in (64, 128, 192) or self.warps != consumers + TMA_PRODUCER_WARPS:
                raise VariantError(f"tma: br must be 64, 128 or 192 (one consumer warpgroup per 64 rows) and warps the "
                                   f"consumers' {consumers} plus {TMA_PRODUCER_WARPS} producer warps, got br={self.br}, "
                                   f"warps={self.warps}")
            if self.bc not in WGMMA_BC or self.stages != 2:
                raise VariantError(f"tma: bc must be one of {WGMMA_BC} and stages 2, got bc={self.bc}, "
                                   f"stages={self.stages}")

    def _check_wgmma_backward(self) -> None:
        """wgmma backward (kernels/bwd_wgmma.cuh): q tiles of 64 rows (one m64 wgmma for dQ), one
        consumer warpgroup (4 warps) per 64 kv rows, double-buffered Q/dO, head dims whose dQ
        columns split into whole 64-column swizzle blocks per warpgroup."""
        groups = self.bc // 64
        if (self.head_dim not in WGMMA_BWD_HEAD_DIMS or self.br != 64 or self.bc not in (64, 128)
                or self.warps not in (4 * groups, 4 * groups + WS_BWD_PRODUCER_WARPS) or self.stages != 2
                or (self.head_dim // groups) % 64 or (self.warp_specialized and groups != 2)):
            raise VariantError(f"wgmma backward: head_dim in {WGMMA_BWD_HEAD_DIMS}, br=64, bc 64 or 128 with 4 warps "
                               f"per 64 kv rows (plus {WS_BWD_PRODUCER_WARPS} producer warps when warp-specialized, "
                               f"with bc=128), "
                               f"stages=2, and head_dim / (bc / 64) a multiple of 64; got "
                               f"head_dim={self.head_dim} br={self.br} bc={self.bc} warps={self.warps} "
                               f"stages={self.stages}")

    def _check_decode(self) -> None:
        """decode: br query rows per m tile (16/32/64), 32-row kv tiles per warp, a 2-4 deep ring;
        combine: one warp per output row, br == warps."""
        if self.warps < 1 or self.warps > 8:
            raise VariantError(f"{self.operation}: warps must be 1..8, got {self.warps}")
        if self.bc != DECODE_BC:
            raise VariantError(f"{self.operation}: bc must be {DECODE_BC}, got {self.bc}")
        if self.operation == "combine":
            if self.br != self.warps or self.stages != 1:
                raise VariantError(f"combine: br must equal warps and stages be 1, got br={self.br} stages={self.stages}")
            return
        if self.br not in DECODE_BR or self.stages not in DECODE_STAGES:
            raise VariantError(f"decode: br must be one of {DECODE_BR} and stages one of {DECODE_STAGES}, "
                             f"got br={self.br} stages={self.stages}")
        if self.warps % (self.br // DECODE_WARP_ROWS) or self.kv_groups > 8:
            raise VariantError(f"decode: warps ({self.warps}) must be a multiple of br / {DECODE_WARP_ROWS} "
                             f"({self.br // DECODE_WARP_ROWS}) with at most 8 kv groups")

    @property
    def kv_groups(self) -> int:
        """decode: groups of warps that walk kv tiles independently (each owns a ring)."""
        return self.warps // (self.br // DECODE_WARP_ROWS)

    @property
    def name(self) -> str:
        features = "".join(f"_{f}" for f, on in (("causal", self.causal), ("partial", self.partial)) if on)
        if self.bias:
            features += f"_bias{self.bias}"
        score_key = self.score_expr if self.score_grad is None else (self.score_expr, self.score_grad)
        for label, key in (("mask", self.mask_expr), ("score", score_key)):
            if key is not None:
                features += f"_{label}{hashlib.sha256(repr(key).encode()).hexdigest()[:8]}"
        family = ("_wgmma" + ("o" if self.overlap else "")) if self.family == "wgmma" else ""
        if self.family == "tma":
            family = "_tma" + ("o" if self.overlap else "") + ("p" if self.pingpong else "")
        if self.poly_exp:
            family += f"_pe{self.poly_exp}"
        if self.parts != 1:
            family += f"_qp{self.parts}"
        # a padded variant: hd<caller's D>p<tile>, so that D = 40 and D = 64 never share a name
        hd = f"{self.head_dim}" if self.head_dim_valid is None else f"{self.head_dim_valid}p{self.head_dim}"
        return (
            f"{PREFIXES[self.operation]}_{self.dtype}_hd{hd}_br{self.br}_bc{self.bc}_w{self.warps}_st{self.stages}"
            f"{family}{features}"
        )

    @property
    def persistent(self) -> bool:
        """tma: whether the epilogue's staging rows fit beside Q and the ring (sm_90's shared memory),
        so that a CTA may loop over tiles (persistent CTAs, one per SM); else one CTA per tile."""
        return self.family == "tma" and self._tma_tiles_bytes + self._tma_staging_bytes <= smem_limit("sm_90")

    @property
    def _tma_tiles_bytes(self) -> int:
        """tma: one swizzle atom of alignment slack, Q, the K/V ring and the mbarriers."""
        return SWIZZLE_ATOM_BYTES + (self.br + self.stages * 2 * self.bc) * self.head_dim * 2 + TMA_BARRIER_BYTES

    @property
    def staging_swizzled(self) -> bool:
        """tma: the epilogue stages O in unpadded rows (XOR swizzle, kernels/fwd_epilogue.cuh), the
        only staging that fits beside Q and the ring for persistent CTAs (the 192-row tile at D = 128);
        padded rows everywhere else, as before."""
        limit = smem_limit("sm_90")
        padded = self.br * (self.head_dim + SMEM_PAD_ELEMS) * 2
        return (self.family == "tma" and self._tma_tiles_bytes + padded > limit
                and self._tma_tiles_bytes + self.br * self.head_dim * 2 <= limit)

    @property
    def _tma_staging_bytes(self) -> int:
        """tma: the epilogue's rows of O (their own bytes only when persistent)."""
        return self.br * (self.head_dim + (0 if self.staging_swizzled else SMEM_PAD_ELEMS)) * 2

    @property
    def real_head_dim(self) -> int:
        """The caller's head dim: the columns of q, k, v and the outputs that exist."""
        return self.head_dim if self.head_dim_valid is None else self.head_dim_valid

    @property
    def padded(self) -> bool:
        return self.head_dim_valid is not None

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def warp_specialized(self) -> bool:
        """wgmma backward: a producer warpgroup beside the bc / 64 consumer warpgroups (kernels/bwd_ws.cuh)."""
        return (self.operation == "backward" and self.family == "wgmma"
                and self.warps == self.bc // 16 + WS_BWD_PRODUCER_WARPS)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile plus the kv tiles.

        mma.sync: padded rows; kStage 1 shares one buffer between K and V, kStage 2 has one of each.
        wgmma: unpadded swizzled rows, ``stages`` buffers of K and V, plus one swizzle atom of slack
        to align the tiles. tma: the same plus the ring's mbarriers.

        backward (mma.sync): the CTA's K and V tiles (bc rows), ``stages`` buffers of the q tile's
        Q and dO (br rows) with its LSE, rowsum(dO O) and fixed-point units (fp32; the units read by
        the deterministic entry only), and dSᵀ (bc x br, padded rows), with column parts Pᵀ too;
        backward (wgmma): the same tiles unpadded and swizzled, plus one swizzle atom of slack and per
        stage a PARTIAL q tile's bits over the kv tile (bc / 8 bytes per q row) and its rows'
        fixed-point units (fp32, read by the deterministic entry only)."""
        if self.family == "tma":
            return self._tma_tiles_bytes + (self._tma_staging_bytes if self.persistent else 0)
        if self.operation == "backward" and self.family == "wgmma":
            # kernels/bwd_wgmma.cuh Smem: swizzled K, V, Q/dO stages; dSᵀ padded (two buffers when
            # warp-specialized); LSE, delta; then the warp-specialized kernel's dQ staging and mbarriers
            ws = self.warp_specialized
            return (SWIZZLE_ATOM_BYTES + (2 * self.bc + 2 * self.stages * self.br) * self.head_dim * 2
                    + (2 if ws else 1) * self.bc * (self.br + SMEM_PAD_ELEMS) * 2 + 2 * self.stages * self.br * 4
                    + self.stages * self.br * self.bc // 8  # a PARTIAL q tile's bits per stage
                    + (self.br * self.head_dim * 4 + WS_BWD_BARRIER_BYTES if ws else 0)
                    + self.stages * self.br * 4)  # the q rows' fixed-point units (deterministic=True)
        if self.operation == "backward":
            row_bytes = (self.head_dim + SMEM_PAD_ELEMS) * 2
            transposed = self.bc * (self.br + SMEM_PAD_ELEMS) * 2  # dSᵀ, and Pᵀ with column parts
            return ((2 * self.bc + 2 * self.stages * self.br) * row_bytes + (2 if self.column_parts else 1) * transposed
                    + 3 * self.stages * self.br * 4)  # LSE, delta and the fixed-point units per q row
        if self.family == "wgmma":
            return SWIZZLE_ATOM_BYTES + (self.br + self.stages * 2 * self.bc) * self.head_dim * 2
        if self.operation == "combine":
            return 0
        if self.operation == "decode":
            # Q tile, then either every kv group's ring of K and V tiles plus its ring records, or
            # (after the kv loop, in the same bytes) the fp32 merge of the groups' partial rows.
            row_bytes = (self.head_dim + SMEM_PAD_ELEMS) * 2
            ring = self.kv_groups * self.stages * (2 * self.bc * row_bytes + DECODE_RING_BYTES)
            merge = self.kv_groups * self.br * ((self.head_dim + 4) * 4 + 8)
            return self.br * row_bytes + max(ring, merge)
        row_bytes = (self.head_dim + SMEM_PAD_ELEMS) * 2
        return (self.br + self.stages * self.bc) * row_bytes

    @property
    def template(self) -> str:
        return TEMPLATES[(self.operation, self.family)]

    def target_arch(self, arch: str) -> str:
        """The arch to compile for on a device of ``arch``: wgmma needs sm_90a, and only sm_90 has it."""
        if self.family not in HOPPER_FAMILIES:
            return arch
        if not has_wgmma(arch):
            raise VariantError(f"{self.name} uses wgmma, which only sm_90 (Hopper) has; cannot build for {arch}")
        return "sm_90a"

    def runs_on(self, arch: str) -> bool:
        """Whether this kernel can run on ``arch``: wgmma needs sm_90, and the shared memory must fit
        the arch's opt-in limit per block."""
        return (self.family not in HOPPER_FAMILIES or has_wgmma(arch)) and self.smem_bytes <= smem_limit(arch)

    @property
    def dq_row_warps(self) -> int:
        """backward (mma.sync): warps along dQ's q rows (bwd_dq_row_warps)."""
        return bwd_dq_row_warps(self.warps, self.br, min(self.head_dim, 128))

    @property
    def column_parts(self) -> bool:
        """backward (mma.sync): whether its q parts split dK and dV's columns (bwd_column_parts)."""
        return self.operation == "backward" and self.family == "sync" and bwd_column_parts(self.head_dim, self.parts)

    @property
    def row_kernel_rows(self) -> int:
        """backward: query rows per CTA of its row kernels (``row_kernel_rows``)."""
        return row_kernel_rows(self.real_head_dim)

    def template_params(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["variant_name"] = self.name
        values["smem_bytes"] = self.smem_bytes
        values["mask_expr"] = _expr_params(self.mask_expr, "mask")
        values["score_expr"] = _expr_params(self.score_expr, "score")
        values["score_grad"] = expressions.check_grad(self.score_grad, self.score_expr)  # checked where rendered
        # Constants of both expressions, once each (expressions.merge_names rejects conflicts).
        values["constants"] = sorted({c for e in (self.mask_expr, self.score_expr) if e for c in e[1]})
        values["params_struct"] = params.struct_for(self.operation, self.family).cpp()
        values["m_tiles"] = 1 if self.family in HOPPER_FAMILIES else self.br // self.warps // 16
        values["smem_pad"] = SMEM_PAD_ELEMS
        values["head_dim_valid"] = self.real_head_dim
        values["persistent"] = self.persistent  # tma: the host launches one CTA per SM (plan.py)
        values["staging_swizzled"] = self.staging_swizzled
        if self.operation == "backward":  # the row kernels' grid, checked against RowShape in the kernel
            values["row_rows"] = self.row_kernel_rows
            values["column_parts"] = self.column_parts
            values["dq_row_warps"] = self.dq_row_warps
            values["bound_rows"] = BWD_BOUND_ROWS
        return values


def _expr_params(key: Optional[tuple], kind: str) -> Optional[dict]:
    """CudaExpr.key (text, ((name, ctype, literal), ...), ((array, ctype), ...)) -> template dict."""
    if key is None:
        return None
    text, _, array_decls = expressions.check_key(key, kind=kind)  # a hand-made key cannot inject source
    return {"text": text, "arrays": list(array_decls)}
