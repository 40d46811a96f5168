"""What the commands need to know of the kernels, from the modules that define them: the shipped
list of every operation, the supported values, a kernel's family and whether it runs on an arch.
The one place in cli/ that imports dispatch, ops and mask, so that moving them touches one file."""
from __future__ import annotations

import argparse
from typing import Any, Optional

from ..dispatch import tiles
from ..dispatch.arch import SPECIFIC, ArchError, build_target, check_arch
from ..dispatch.variant import HOPPER_FAMILIES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_STAGES, Variant

__all__ = ["ARCH_SPECIFIC", "HOPPER_FAMILIES", "OPERATIONS", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_STAGES", "Variant", "arch_list", "build_target", "family", "runs_on", "shipped_variants",
           "kernel_for"]

#: Arch-specific targets (the architecture table's): asked for alone, they mean "only the variants
#: built as this target" (sm_90a: the wgmma and tma variants).
ARCH_SPECIFIC = tuple(SPECIFIC)


def arch_list(text: str) -> Optional[tuple[str, ...]]:
    """``--arch``: 'auto' -> None (decide at run time); 'sm_80,sm_90a' -> ('sm_80', 'sm_90a'), each
    name checked against the architecture table (dispatch/arch.py check_arch, the one check)."""
    if text.strip() == "auto":
        return None
    archs: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        try:
            arch = check_arch(item)
        except ArchError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if arch not in archs:
            archs.append(arch)
    return tuple(archs)


#: The kernel groups ``precompile --ops`` chooses from.
OPERATIONS = ("forward", "backward", "decode", "mask")


def shipped_variants(dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS, stages=SUPPORTED_STAGES,
                     ops=OPERATIONS) -> list[Any]:
    """Every kernel a call can need without a user expression, by group: the forward's tuned
    variants of every family, the backward's, the decode and combine kernels, the mask builders'."""
    from ..mask.kernels import precompile_specs
    from ..ops import decode

    out: list[Any] = []
    if "forward" in ops:
        out += tiles.shipped_variants(dtypes=dtypes, head_dims=head_dims, stages=stages)
    if "backward" in ops:
        out += tiles.shipped_backward_variants(dtypes=dtypes, head_dims=head_dims)
    if "decode" in ops:
        out += decode.shipped_variants(head_dims=head_dims, dtypes=dtypes)
    if "mask" in ops:
        out += precompile_specs()
    return out


def family(kernel: Any) -> str:
    """'sync' (mma.sync), 'wgmma' or 'tma' (Hopper, built as sm_90a); the mask builders' kernels are
    plain CUDA ('sync')."""
    return getattr(kernel, "family", "sync")


def runs_on(kernel: Any, arch: str) -> bool:
    """Whether the kernel can run on ``arch`` (its family exists there and its shared memory fits)."""
    check = getattr(kernel, "runs_on", None)
    return True if check is None else check(arch)


def kernel_for(head_dim: int, dtype: str, block_mask, arch: Optional[str]) -> Variant:
    """The forward variant ``attention(q, k, v, block_mask)`` runs for these inputs on ``arch``."""
    from ..dispatch.plan import plan_forward

    return plan_forward(head_dim=head_dim, dtype=dtype, batch=1, heads=1, block_mask=block_mask, stages=None,
                        bias=None, mask_expr=None, score_expr=None, arch=arch).variant
