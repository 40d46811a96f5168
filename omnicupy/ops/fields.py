"""The fill of each shared parameter group (dispatch/params.py MASK_ROWS, BIAS, USER_ARRAYS and the
strides of a [B, H, N, D] tensor): one function per group, used by every operation that launches
a struct holding it (ops/forward.py, ops/backward.py, ops/decode.py).

Knows the groups' field names and the arrays they describe; nothing of plans or launches.
"""
from __future__ import annotations

from typing import Any, Optional

from .. import arrays
from ..mask import BlockMask, expressions
from .inputs import Bias, check_device


def strides(x: Any, prefix: str) -> dict[str, int]:
    """``<prefix>_sb``, ``_sh``, ``_sn``: the element strides of a [B, H, N, D] array over batch, heads, rows."""
    item = x.itemsize
    return {f"{prefix}_s{axis}": s // item for axis, s in zip("bhn", x.strides[:3])}


def bias(b: Optional[Bias]) -> dict[str, Any]:
    """The BIAS group: the device array and its element strides (0 where it broadcasts; a vector
    bias [B|1, H|1, Nkv] has the same row for every query)."""
    if b is None:
        return {"bias": None, "bias_sb": 0, "bias_sh": 0, "bias_sq": 0, "bias_sk": 0}
    d = arrays.to_cupy(b.array, "bias")
    check_device(d, "bias")
    st = [s // d.itemsize if n > 1 else 0 for s, n in zip(d.strides, d.shape)]
    if d.ndim == 3:
        st = st[:2] + [0] + st[2:]
    return {"bias": d, "bias_sb": st[0], "bias_sh": st[1], "bias_sq": st[2], "bias_sk": st[3]}


def mask_rows(bm: Optional[BlockMask]) -> dict[str, Any]:
    """The MASK_ROWS group from the mask's device metadata (cached per device); nulls for None (the
    decode's rule mode)."""
    if bm is None:
        return {"kv_num_blocks": None, "kv_indices": None, "block_types": None, "partial_index": None,
                "partial_masks": None, "mask_row_sb": 0, "mask_row_sh": 0, "max_blocks": 0, "q_block_size": 0,
                "kv_block_size": 0}
    meta = bm.device_metadata()
    return {"kv_num_blocks": meta.kv_num_blocks, "kv_indices": meta.kv_indices,
            "block_types": meta.block_mask_types, "partial_index": meta.partial_block_mask_indices,
            "partial_masks": meta.partial_block_masks, "mask_row_sb": meta.row_stride_batch,
            "mask_row_sh": meta.row_stride_head, "max_blocks": bm.max_blocks, "q_block_size": bm.q_block_size,
            "kv_block_size": bm.kv_block_size}


def user_arrays(*exprs: Optional[expressions.CudaExpr]) -> dict[str, Any]:
    """The USER_ARRAYS group: the lookup arrays of the call's expressions, in order (mask, score)."""
    return {"user_arrays": [a for e in exprs if e is not None for a in e.device_arrays()]}
