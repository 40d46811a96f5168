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

#: The backward operation's three kernels (preprocess, kv-tile main loop, dQ conversion) share one
#: struct; each reads the fields it needs (templates/attention_bwd.cu.jinja).
BACKWARD = ParamStruct("BwdParams", (
    Param("q", "ptr", "const u16*", doc="[B, Hq, Nq, D]"),
    Param("k", "ptr", "const u16*", doc="[B, Hkv, Nkv, D]"),
    Param("v", "ptr", "const u16*", doc="[B, Hkv, Nkv, D]"),
    Param("o", "ptr", "const u16*", doc="[B, Hq, Nq, D] the forward's output"),
    Param("dout", "ptr", "const u16*", doc="[B, Hq, Nq, D] gradient of the output"),
    Param("lse", "ptr", "const float*", doc="[B, Hq, Nq] contiguous, the forward's natural-log LSE"),
    Param("dq", "ptr", "u16*", doc="[B, Hq, Nq, D] written by the conversion kernel"),
    Param("dk", "ptr", "u16*", doc="[B, Hkv, Nkv, D]"),
    Param("dv", "ptr", "u16*", doc="[B, Hkv, Nkv, D]"),
    *_strides("q", "q"), *_strides("k", "k"), *_strides("v", "v"), *_strides("o", "o"), *_strides("do", "dout"),
    *_strides("dq", "dq"), *_strides("dk", "dk"), *_strides("dv", "dv"),
    # workspace, O(B * Hq * Nq * D): rows padded to whole q tiles for the two row vectors
    Param("lse_log2", "ptr", "float*", doc="[B, Hq, q_len_pad] LSE in log2 units, +inf for empty/padded rows"),
    Param("delta", "ptr", "float*", doc="[B, Hq, q_len_pad] rowsum(dO * O), 0 for padded rows"),
    Param("dq_accum", "ptr", "float*", doc="[B, Hq, Nq, D] fp32 dQ accumulator (unscaled)"),
    Param("dq_semaphore", "ptr", "int*",
          doc="[B, Hq, q tiles, column passes] zeroed; null: dQ by unordered atomics"),
    Param("q_len_pad", "i32", doc="row stride of lse_log2 / delta: q_len rounded up to whole q tiles"),
    Param("num_heads", "i32", doc="Hq"),
    Param("q_len", "i32"),
    Param("kv_len", "i32"),
    Param("kv_group", "i32", doc="Hq / Hkv"),
    Param("scale", "f32", doc="softmax scale (applied to dK here and to dQ by the conversion)"),
    Param("scale_log2", "f32", doc="what P's exponent multiplies (transformed) scores by"),
    # transposed block index (ops/backward_index.py): row (b, h, kv block) is
    # b * t_row_sb + h * t_row_sh + kv_block; each row has t_width slots.
    Param("q_num_blocks", "ptr", "const int*", doc="[rows] q blocks listed for this kv block"),
    Param("q_indices", "ptr", "const int*", doc="[rows, t_width] q block of each slot, increasing"),
    Param("q_types", "ptr", "const int*", doc="[rows, t_width] BlockType"),
    Param("q_partial_index", "ptr", "const int*", doc="[rows, t_width] into partial_masks, or null"),
    Param("q_rank", "ptr", "const int*", doc="[rows, t_width] kv tiles before this block in the q row, or null"),
    Param("t_row_sb", "i64"),
    Param("t_row_sh", "i64"),
    Param("t_width", "i32"),
    Param("partial_masks", "ptr", "const u32*", doc="[P, q_block_size, kv_block_size / 32], or null"),
    Param("q_block_size", "i32"),
    Param("kv_block_size", "i32"),
    Param("bias", "ptr", "const void*", doc="[B|1, H|1, Nq|1, Nkv] fp16/bf16/fp32, or null (a constant: no dbias)"),
    Param("bias_sb", "i64"), Param("bias_sh", "i64"), Param("bias_sq", "i64"), Param("bias_sk", "i64"),
    Param("user_arrays", "ptr", "const void*", count=MAX_USER_ARRAYS, doc="lookup arrays of user expressions"),
))

#: operation -> its struct (Variant.operation keys this).
STRUCTS = {"forward": FORWARD, "backward": BACKWARD}

__all__ = ["FORWARD", "BACKWARD", "STRUCTS", "MAX_USER_ARRAYS"]
