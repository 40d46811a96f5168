"""The variant key: everything that selects one compiled kernel, and the values its template reads.

A Variant names its operation and family (the slot: ``dispatch/specs``, one KernelSpec per
(operation, family)), its tile and its features. The fields are the union of the slots' knobs;
each slot reads the shared ones (specs/base.SHARED_FIELDS) and its own (KernelSpec.knobs), and a
knob set on a slot that does not read it is refused. The checks, the shared memory, the template,
the parameter struct and the family's part of the name come from the slot; the name, the cache
key and the shared template values (``template_params()``) are built here, once for every slot.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Optional

from ..errors import HeadDimError, VariantError
from ..mask import expressions
from .arch import ARCHS, build_target, caps, runs_family
from .specs import SPECS, KernelSpec, spec_for
from .specs.backward_sync import (BWD_BOUND_ROWS, BWD_ROW_WARPS, bwd_column_parts, bwd_dq_row_warps,  # noqa: F401
                                  bwd_parts_error, row_kernel_rows)
from .specs.backward_wgmma import WGMMA_BWD_HEAD_DIMS  # noqa: F401
from .specs.backward_ws import WS_BWD_BARRIER_BYTES, WS_BWD_PRODUCER_WARPS, is_ws
from .specs.base import SMEM_PAD_ELEMS, SWIZZLE_ATOM_BYTES, WGMMA_BC, WGMMA_HEAD_DIMS  # noqa: F401
from .specs.decode_split import (DECODE_BC, DECODE_BR, DECODE_RING_BYTES, DECODE_STAGES,  # noqa: F401
                                 DECODE_WARP_ROWS, kv_groups)
from .specs.forward_tma import TMA_BARRIER_BYTES, TMA_PRODUCER_WARPS  # noqa: F401

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
BIAS_DTYPES = ("fp16", "bf16", "fp32")

#: (operation, family) -> template under templates/ (from the registry).
TEMPLATES = {key: spec.template for key, spec in SPECS.items()}
OPERATIONS = tuple(dict.fromkeys(op for op, _ in SPECS))
FAMILIES = tuple(dict.fromkeys(family for _, family in SPECS))
#: Families built on wgmma (their code is arch-specific: sm_90a).
HOPPER_FAMILIES = ("wgmma", "tma")
#: Kernel-name prefix per operation.
PREFIXES = {op: spec.prefix for (op, _), spec in SPECS.items()}


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
    #: sets of warps take half of its columns each, bwd_parts_error, lab/notes/backward.md#s40).
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
        if self.bc % 32 or self.bc < 32:
            raise VariantError(f"bc={self.bc} must be a positive multiple of 32")
        spec = spec_for(self.operation, self.family)
        spec.check_knobs(self)
        spec.check(self)

    @property
    def spec(self) -> KernelSpec:
        """This variant's slot (dispatch/specs)."""
        return spec_for(self.operation, self.family)

    @property
    def kv_groups(self) -> int:
        """decode: groups of warps that walk kv tiles independently (each owns a ring)."""
        return kv_groups(self)

    @property
    def name(self) -> str:
        features = "".join(f"_{f}" for f, on in (("causal", self.causal), ("partial", self.partial)) if on)
        if self.bias:
            features += f"_bias{self.bias}"
        score_key = self.score_expr if self.score_grad is None else (self.score_expr, self.score_grad)
        for label, key in (("mask", self.mask_expr), ("score", score_key)):
            if key is not None:
                features += f"_{label}{hashlib.sha256(repr(key).encode()).hexdigest()[:8]}"
        family = self.spec.name_suffix(self)
        if self.poly_exp:
            family += f"_pe{self.poly_exp}"
        if self.parts != 1:
            family += f"_qp{self.parts}"
        # a padded variant: hd<caller's D>p<tile>, so that D = 40 and D = 64 never share a name
        hd = f"{self.head_dim}" if self.head_dim_valid is None else f"{self.head_dim_valid}p{self.head_dim}"
        return (
            f"{self.spec.prefix}_{self.dtype}_hd{hd}_br{self.br}_bc{self.bc}_w{self.warps}_st{self.stages}"
            f"{family}{features}"
        )

    @property
    def persistent(self) -> bool:
        """tma: whether a CTA may loop over tiles (persistent CTAs, one per SM; specs/forward_tma.py)."""
        return self.spec.persistent(self)

    @property
    def staging_swizzled(self) -> bool:
        """tma: the epilogue stages O in unpadded, XOR-swizzled rows (specs/forward_tma.py)."""
        return self.spec.staging_swizzled(self)

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
        """wgmma backward: a producer warpgroup beside the bc / 64 consumer warpgroups (specs/backward_ws.py)."""
        return is_ws(self)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main entry: the slot's formula (dispatch/specs)."""
        return self.spec.smem_bytes(self)

    @property
    def template(self) -> str:
        return self.spec.template

    def target_arch(self, arch: str) -> str:
        """The arch to compile for on a device of ``arch`` (the wgmma families: its arch-specific target)."""
        target = build_target(arch, self.family)
        if target is None:
            where = ", ".join(a for a in ARCHS if runs_family(a, self.family))
            raise VariantError(f"{self.name} uses the {self.family} family, which only {where} run(s); cannot build "
                               f"for {arch} ({caps(arch).gpus})")
        return target

    def runs_on(self, arch: str) -> bool:
        """Whether this kernel can run on ``arch``: its family's instructions exist there and its
        shared memory fits the arch's opt-in limit per block."""
        return runs_family(arch, self.family) and self.smem_bytes <= caps(arch).smem_optin

    @property
    def dq_row_warps(self) -> int:
        """backward: warps along dQ's q rows (specs/backward_sync.bwd_dq_row_warps)."""
        return bwd_dq_row_warps(self.warps, self.br, min(self.head_dim, 128))

    @property
    def column_parts(self) -> bool:
        """backward (mma.sync): whether its q parts split dK and dV's columns (bwd_column_parts)."""
        return self.operation == "backward" and self.family == "sync" and bwd_column_parts(self.head_dim, self.parts)

    @property
    def row_kernel_rows(self) -> int:
        """backward: query rows per CTA of its row kernels (``row_kernel_rows``)."""
        return row_kernel_rows(self.real_head_dim)

    def template_params(self) -> dict[str, Any]:
        """Every value the template reads: the fields, the shared values, the slot's own."""
        spec = self.spec
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["variant_name"] = self.name
        values["smem_bytes"] = self.smem_bytes
        values["mask_expr"] = _expr_params(self.mask_expr, "mask")
        values["score_expr"] = _expr_params(self.score_expr, "score")
        values["score_grad"] = expressions.check_grad(self.score_grad, self.score_expr)  # checked where rendered
        # Constants of both expressions, once each (expressions.merge_names rejects conflicts).
        values["constants"] = sorted({c for e in (self.mask_expr, self.score_expr) if e for c in e[1]})
        values["params_struct"] = spec.struct.cpp()
        values["m_tiles"] = spec.m_tiles(self)
        values["smem_pad"] = SMEM_PAD_ELEMS
        values["head_dim_valid"] = self.real_head_dim
        values["persistent"] = self.persistent  # tma: the host launches one CTA per SM (plan.py)
        values["staging_swizzled"] = self.staging_swizzled
        values.update(spec.template_values(self))
        return values


def _expr_params(key: Optional[tuple], kind: str) -> Optional[dict]:
    """CudaExpr.key (text, ((name, ctype, literal), ...), ((array, ctype), ...)) -> template dict."""
    if key is None:
        return None
    text, _, array_decls = expressions.check_key(key, kind=kind)  # a hand-made key cannot inject source
    return {"text": text, "arrays": list(array_decls)}
