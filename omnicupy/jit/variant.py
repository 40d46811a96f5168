"""The variant key: everything that selects one compiled forward kernel."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Optional

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = ("fp16", "bf16")
SUPPORTED_STAGES = (1, 2)
SMEM_PAD_ELEMS = 8  # per smem row; must match kLd in the template
BIAS_DTYPES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True, order=True)
class Variant:
    """One rendering of templates/attention_fwd.cu.jinja.

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

    def __post_init__(self) -> None:
        if self.bias not in (None, *BIAS_DTYPES):
            raise ValueError(f"bias dtype must be one of {BIAS_DTYPES} or None, got {self.bias!r}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported (supported: {SUPPORTED_DTYPES})")
        if self.stages not in SUPPORTED_STAGES:
            raise ValueError(f"stages must be 1 or 2, got {self.stages}")
        if self.warps < 1 or self.br % (16 * self.warps):
            raise ValueError(f"br={self.br} must be a multiple of 16 * warps ({self.warps})")
        if self.bc % 32 or self.bc < 32:
            raise ValueError(f"bc={self.bc} must be a positive multiple of 32")

    @property
    def name(self) -> str:
        features = "".join(f"_{f}" for f, on in (("causal", self.causal), ("partial", self.partial)) if on)
        if self.bias:
            features += f"_bias{self.bias}"
        for label, key in (("mask", self.mask_expr), ("score", self.score_expr)):
            if key is not None:
                features += f"_{label}{hashlib.sha256(repr(key).encode()).hexdigest()[:8]}"
        return (
            f"omni_fwd_{self.dtype}_hd{self.head_dim}_br{self.br}_bc{self.bc}_w{self.warps}_st{self.stages}{features}"
        )

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile plus one (kStage 1) or two (kStage 2) kv tiles."""
        row_bytes = (self.head_dim + SMEM_PAD_ELEMS) * 2
        return (self.br + self.stages * self.bc) * row_bytes

    def template_params(self) -> dict:
        params = {f.name: getattr(self, f.name) for f in fields(self)}
        params["variant_name"] = self.name
        params["mask_expr"] = _expr_params(self.mask_expr)
        params["score_expr"] = _expr_params(self.score_expr)
        # Constants of both expressions, once each (expressions.merge_names rejects conflicts).
        params["constants"] = sorted({c for e in (self.mask_expr, self.score_expr) if e for c in e[1]})
        return params


def _expr_params(key: Optional[tuple]) -> Optional[dict]:
    """CudaExpr.key (text, ((name, ctype, literal), ...), ((array, ctype), ...)) -> template dict."""
    if key is None:
        return None
    text, _, array_decls = key
    return {"text": text, "arrays": list(array_decls)}
