"""The parameter struct of every operation's kernels, declared once (see abi.py).

Each kernel takes its operation's struct by value as its only argument; the template renders the
struct from here and ``omnicupy/ops`` fills it by field name. Adding a field is one line here plus
the code that reads it in the kernel and the line that fills it in the ops module.
"""
from __future__ import annotations

from .abi import Param, ParamStruct

#: Slots for the lookup arrays of user expressions (cuda_mask / cuda_score), read by the
#: rendered functors as ``p.user_arrays[i]``.
MAX_USER_ARRAYS = 8


def _strides(tensor: str, doc: str) -> list[Param]:
    return [Param(f"{tensor}_s{axis}", "i64", doc=f"{doc} stride over {what}, elements" if axis == "b" else "")
            for axis, what in (("b", "batch"), ("h", "heads"), ("n", "sequence"))]


FORWARD = ParamStruct("FwdParams", (
    Param("q", "ptr", "const u16*", doc="[B, Hq, Nq, D]"),
    Param("k", "ptr", "const u16*", doc="[B, Hkv, Nkv, D]"),
    Param("v", "ptr", "const u16*", doc="[B, Hkv, Nkv, D]"),
    Param("o", "ptr", "u16*", doc="[B, Hq, Nq, D]"),
    Param("lse", "ptr", "float*", doc="[B, Hq, Nq] fp32 natural log, or null"),
    *_strides("q", "q"), *_strides("k", "k"), *_strides("v", "v"), *_strides("o", "o"),
    Param("num_heads", "i32", doc="Hq"),
    Param("q_len", "i32"),
    Param("kv_len", "i32"),
    Param("kv_group", "i32", doc="Hq / Hkv"),
    Param("scale", "f32", doc="softmax scale, applied by the score transform"),
    Param("scale_log2", "f32", doc="what the softmax multiplies raw scores by inside exp2"),
    # block mask (mask/block_mask.py DeviceMetadata): row (b, h, q block) is
    # b * mask_row_sb + h * mask_row_sh + q_block; 0 strides broadcast.
    Param("kv_num_blocks", "ptr", "const int*", doc="[rows]"),
    Param("kv_indices", "ptr", "const int*", doc="[rows, max_blocks]"),
    Param("block_types", "ptr", "const int*", doc="[rows, max_blocks] BlockType"),
    Param("partial_index", "ptr", "const int*", doc="[rows, max_blocks] into partial_masks, or null"),
    Param("partial_masks", "ptr", "const u32*", doc="[P, q_block_size, kv_block_size / 32], or null"),
    Param("mask_row_sb", "i64"),
    Param("mask_row_sh", "i64"),
    Param("max_blocks", "i32"),
    Param("q_block_size", "i32"),
    Param("kv_block_size", "i32"),
    Param("q_tile_order", "ptr", "const int*", doc="[gridDim.x] q tile per blockIdx.x, or null: last first"),
    Param("bias", "ptr", "const void*", doc="[B|1, H|1, Nq|1, Nkv] fp16/bf16/fp32, or null"),
    Param("bias_sb", "i64"), Param("bias_sh", "i64"), Param("bias_sq", "i64"), Param("bias_sk", "i64"),
    Param("user_arrays", "ptr", "const void*", count=MAX_USER_ARRAYS, doc="lookup arrays of user expressions"),
))

#: The forward of the TMA family (templates/attention_fwd_tma.cu.jinja): the same fields plus one
#: TMA tensor map per input (omnicupy/ops/tma.py encodes them). The kernel hands TMA the address of
#: the map inside the __grid_constant__ parameter, never of a copy.
FORWARD_TMA = ParamStruct("FwdTmaParams", FORWARD.params + (
    Param("q_map", "tmap", doc="q as (D, Nq, Hq, B), box (64, br, 1, 1), 128-byte swizzle"),
    Param("k_map", "tmap", doc="k as (D, Nkv, Hkv, B), box (64, bc, 1, 1)"),
    Param("v_map", "tmap", doc="v as (D, Nkv, Hkv, B), box (64, bc, 1, 1)"),
))

#: Every struct by name (tests/test_abi.py proves each one's layout against NVRTC).
STRUCTS = {"forward": FORWARD, "forward_tma": FORWARD_TMA}
#: (operation, family) whose kernels take a struct other than their operation's.
FAMILY_STRUCTS = {("forward", "tma"): FORWARD_TMA}


def struct_for(operation: str, family: str) -> ParamStruct:
    """The parameter struct of ``operation``'s kernels in ``family``."""
    return FAMILY_STRUCTS.get((operation, family)) or STRUCTS[operation]


__all__ = ["FORWARD", "FORWARD_TMA", "STRUCTS", "FAMILY_STRUCTS", "struct_for", "MAX_USER_ARRAYS"]
