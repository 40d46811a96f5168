"""The parameter struct of every operation's kernels, declared once (see abi.py).

Each kernel takes its operation's struct by value as its only argument; the template renders the
struct from here and ``omnicupy/ops`` fills it by field name. Adding a field is one line here plus
the code that reads it in the kernel and the line that fills it in the ops module.
"""
from __future__ import annotations

import dataclasses

from .abi import Param, ParamStruct

#: Slots for the lookup arrays of user expressions (cuda_mask / cuda_score), read by the
#: rendered functors as ``p.user_arrays[i]``.
MAX_USER_ARRAYS = 8


def _strides(tensor: str, doc: str) -> list[Param]:
    """The strides group of one [B, H, N, D] tensor (filled by ops/fields.py strides)."""
    return [Param(f"{tensor}_s{axis}", "i64", doc=f"{doc} stride over {what}, elements" if axis == "b" else "")
            for axis, what in (("b", "batch"), ("h", "heads"), ("n", "sequence"))]


def _bare(group: tuple[Param, ...]) -> tuple[Param, ...]:
    """A group without its comments (the structs that declared it so render as they always have)."""
    return tuple(dataclasses.replace(p, doc="") for p in group)


# The parameter groups more than one struct holds, declared once; each is filled by one function
# of ops/fields.py (named beside it).

#: The block mask's rows (mask/block_mask.py DeviceMetadata): row (b, h, q block) is
#: b * mask_row_sb + h * mask_row_sh + q_block; 0 strides broadcast. Filled by fields.mask_rows.
MASK_ROWS = (
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
)
#: An additive bias [B|1, H|1, Nq|1, Nkv] and its element strides. Filled by fields.bias.
BIAS = (
    Param("bias", "ptr", "const void*", doc="[B|1, H|1, Nq|1, Nkv] fp16/bf16/fp32, or null"),
    Param("bias_sb", "i64"), Param("bias_sh", "i64"), Param("bias_sq", "i64"), Param("bias_sk", "i64"),
)
#: The lookup arrays of user expressions. Filled by fields.user_arrays.
USER_ARRAYS = (
    Param("user_arrays", "ptr", "const void*", count=MAX_USER_ARRAYS, doc="lookup arrays of user expressions"),
)


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
    *MASK_ROWS,
    Param("q_tile_order", "ptr", "const int*", doc="[gridDim.x] q tile per blockIdx.x, or null: last first"),
    *BIAS,
    *USER_ARRAYS,
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
          doc="[B, Hq, q tiles, column passes] zeroed: the mma.sync kernel's ordered dQ; else null"),
    Param("dq_unit", "ptr", "float*",
          doc="[B, Hq, q_len_pad] 2^x per row: the int32 fixed-point dQ (deterministic); else null"),
    Param("kv_bound", "ptr", "float*", doc="[B, Hkv, 2] zeroed: max |K|, max |V_j|^2 (with dq_unit)"),
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
    dataclasses.replace(BIAS[0], doc=BIAS[0].doc + " (a constant: no dbias)"), *BIAS[1:],
    *USER_ARRAYS,
    # The warp-specialized wgmma backward (kernels/bwd_ws.cuh) loads Q and dO with TMA where the
    # inputs allow it (omnicupy/ops/tma.py encodes the maps); the other kernels never read these.
    Param("tma_loads", "i32", doc="1: q_map and do_map are valid and Q/dO load through them; 0: cp.async"),
    Param("q_map", "tmap", doc="q as (D, Nq, Hq, B), box (64, br, 1, 1), 128-byte swizzle"),
    Param("do_map", "tmap", doc="dout as (D, Nq, Hq, B), box (64, br, 1, 1)"),
))

#: Split-KV decode (templates/attention_decode.cu.jinja, kernels/decode_split.cuh): one CTA per
#: (m tile, split, kv head, batch), flattened on grid.x. The rows of an m tile are query heads of
#: one kv head's group times query positions (GQA packing); see omnicupy/ops/decode.py.
DECODE = ParamStruct("DecodeParams", (
    Param("q", "ptr", "const u16*", doc="[B, Hq, Nq, D]"),
    Param("k", "ptr", "const u16*", doc="contiguous [B, Hkv, Nkv, D] or pages (NHD / HND)"),
    Param("v", "ptr", "const u16*", doc="same layout as k"),
    Param("o", "ptr", "u16*", doc="[B, Hq, Nq, D]; written when num_splits == 1"),
    Param("lse", "ptr", "float*", doc="[B, Hq, Nq] fp32 natural log, or null; when num_splits == 1"),
    Param("part_o", "ptr", "float*", doc="[splits, B*Hq*Nq, D] fp32 unnormalized partial outputs, or null"),
    Param("part_ml", "ptr", "float*", doc="[splits, B*Hq*Nq, 2] fp32 (row max in log2 units, row sum), or null"),
    *_strides("q", "q"),
    # k/v: element offset of kv row j of (batch b, kv head hk) is
    #   page * k_sb + hk * k_sh + slot * k_sn, with (page, slot) = (b, j) for a contiguous cache and
    #   (page_table[b, j / page_size], j % page_size) for a paged one.
    Param("k_sb", "i64", doc="k stride over batch (contiguous) or pages (paged), elements"),
    Param("k_sh", "i64"), Param("k_sn", "i64"),
    Param("v_sb", "i64"), Param("v_sh", "i64"), Param("v_sn", "i64"),
    *_strides("o", "o"),
    Param("kv_lens", "ptr", "const int*", doc="[B] keys per sequence, or null: kv_len for all"),
    Param("page_table", "ptr", "const int*", doc="[B, max_pages] page ids, or null: contiguous cache"),
    Param("page_table_sb", "i64", doc="page_table stride over batch, elements"),
    Param("max_pages", "i32"),
    Param("page_size", "i32"),
    Param("num_pages", "i32"),
    Param("errors", "ptr", "int*", doc="bit flags of bad kv_lens / page ids met on the device, or null"),
    Param("split_counters", "ptr", "int*",
          doc="[B * Hkv * m_tiles] zeroed, or null: the last split of each unit merges (no combine launch)"),
    Param("batch", "i32"),
    Param("num_heads", "i32", doc="Hq"),
    Param("kv_heads", "i32", doc="Hkv"),
    Param("q_len", "i32", doc="Nq"),
    Param("kv_len", "i32", doc="capacity: Nkv, or max_pages * page_size"),
    Param("kv_group", "i32", doc="Hq / Hkv"),
    Param("heads_per_tile", "i32", doc="query heads of one group per m tile (P)"),
    Param("q_per_tile", "i32", doc="query positions per m tile (Q); row r is head r / Q, position r % Q"),
    Param("head_blocks", "i32", doc="ceil(kv_group / P)"),
    Param("m_tiles", "i32", doc="head_blocks * ceil(Nq / Q)"),
    Param("num_splits", "i32"),
    Param("causal", "i32", doc="rule mode: 1 allows kv <= the query's position"),
    Param("window", "i32", doc="rule mode: > 0 allows kv > the query's position - window"),
    Param("bottom_right", "i32", doc="query i sits at position kv_len(b) - Nq + i (else i)"),
    Param("q_abs", "i32", doc="score modifiers see that position as q_idx (else i)"),
    Param("scale", "f32"),
    Param("scale_log2", "f32"),
    # Block-mask mode (kv_num_blocks non-null): the CTA walks one row of the mask, shared by its
    # rows (q block 0; one head unless the mask broadcasts over heads).
    *_bare(MASK_ROWS),
    *USER_ARRAYS,
))

#: Merge of split-KV partials: one warp per output row (b, h, i), rows = B * Hq * Nq.
COMBINE = ParamStruct("CombineParams", (
    Param("part_o", "ptr", "const float*", doc="[splits, rows, D]"),
    Param("part_ml", "ptr", "const float*", doc="[splits, rows, 2]"),
    Param("o", "ptr", "u16*", doc="[B, Hq, Nq, D]"),
    Param("lse", "ptr", "float*", doc="[B, Hq, Nq] or null"),
    *_strides("o", "o"),
    Param("rows", "i32"),
    Param("num_heads", "i32"),
    Param("q_len", "i32"),
    Param("num_splits", "i32"),
))

#: The forward of the TMA family (templates/attention_fwd_tma.cu.jinja): the same fields plus one
#: TMA tensor map per input (omnicupy/ops/tma.py encodes them). The kernel hands TMA the address of
#: the map inside the __grid_constant__ parameter, never of a copy.
FORWARD_TMA = ParamStruct("FwdTmaParams", FORWARD.params + (
    Param("batch", "i32", doc="B: persistent CTAs walk flat tile indices over q tiles x Hq x B"),
    Param("cta_tiles", "ptr", "const int*", doc="[gridDim.x + 1] offsets into tile_list per CTA, or null: grid stride"),
    Param("tile_list", "ptr", "const int*", doc="[B * Hq * q tiles] flat tiles, CTA by CTA (schedule.cta_tile_lists)"),
    Param("q_map", "tmap", doc="q as (D, Nq, Hq, B), box (64, br, 1, 1), 128-byte swizzle"),
    Param("k_map", "tmap", doc="k as (D, Nkv, Hkv, B), box (64, bc, 1, 1)"),
    Param("v_map", "tmap", doc="v as (D, Nkv, Hkv, B), box (64, bc, 1, 1)"),
))

#: Every struct by name (tests/cpu/test_abi.py proves each one's layout against NVRTC); an operation's
#: name keys its own struct (Variant.operation).
STRUCTS = {"forward": FORWARD, "forward_tma": FORWARD_TMA, "backward": BACKWARD, "decode": DECODE, "combine": COMBINE}
#: (operation, family) whose kernels take a struct other than their operation's.
FAMILY_STRUCTS = {("forward", "tma"): FORWARD_TMA}


def struct_for(operation: str, family: str) -> ParamStruct:
    """The parameter struct of ``operation``'s kernels in ``family``."""
    return FAMILY_STRUCTS.get((operation, family)) or STRUCTS[operation]


__all__ = ["MASK_ROWS", "BIAS", "USER_ARRAYS", "FORWARD", "FORWARD_TMA", "BACKWARD", "DECODE", "COMBINE", "STRUCTS", "FAMILY_STRUCTS", "struct_for",
           "MAX_USER_ARRAYS"]
