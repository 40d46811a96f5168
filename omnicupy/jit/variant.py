"""The variant key: everything that selects one compiled forward kernel."""
from __future__ import annotations

from dataclasses import asdict, dataclass

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = ("fp16", "bf16")
SUPPORTED_STAGES = (1, 2)
SMEM_PAD_ELEMS = 8  # per smem row; must match kLd in the template


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

    def __post_init__(self) -> None:
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
        params = asdict(self)
        params["variant_name"] = self.name
        return params
