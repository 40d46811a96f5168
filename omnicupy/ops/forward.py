"""The forward operation: ``attention()`` and the low-level ``omni_attn_mma_blockmask()``.

Checks the call (ops/inputs.py), asks dispatch for a Plan, fills the forward kernel's parameter
struct (dispatch/params.py, FORWARD) by field name and launches on the current CuPy stream. Every
check runs before any launch and raises an ArgumentError (or MaskError) naming the argument.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np

from .. import arrays, jit
from ..dispatch.arch import check_arch, current_arch
from ..dispatch.params import struct_for
from ..dispatch.plan import Plan, plan_forward
from ..errors import ArgumentError, CompileError, OmnicupyError
from ..mask import BlockMask, expressions
from . import decode, recall, tma
from .arg_checks import check_decode_args, check_flags, steady_state_possible
from . import fields as group
from .inputs import (Bias, Inputs, aligned, check_bias, check_bool, check_device, check_expressions, check_lse_buffer,
                     check_mask_matches, check_out, check_qkv, check_scale, check_score_mod, check_stages, device_out,
                     on_device, require_gpu)

#: What ``causal=`` takes: False, True (= "top_left") or "bottom_right" (docs/design.md, Semantics).
Causal = Union[bool, Literal["top_left", "bottom_right"]]
CAUSAL_MODES = {False: None, True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}


@functools.lru_cache(maxsize=64)
def _builtin_mask(mode: Optional[str], q_len: int, kv_len: int) -> BlockMask:
    if mode is None:
        return BlockMask.full(q_len, kv_len)
    return BlockMask.causal(q_len, kv_len, bottom_right=mode == "bottom_right")


def steady_mask(block_mask: Any, causal: Any, q_len: int, kv_len: int) -> Optional[BlockMask]:
    """The mask a steady-state call keeps its recipe on (ops/recall.py): the caller's BlockMask, or
    the built-in one that ``causal`` names; None where only the general path can say what is wrong
    (a bad ``causal``, a mask of another type, sizes no mask can have)."""
    if isinstance(block_mask, BlockMask):
        return block_mask
    if block_mask is not None or not isinstance(causal, (bool, str)) or causal not in CAUSAL_MODES:
        return None
    try:
        return _builtin_mask(CAUSAL_MODES[causal], q_len, kv_len)
    except OmnicupyError:
        return None


def resolve_mask(block_mask: Optional[BlockMask], causal: Any, inp: Inputs) -> BlockMask:
    try:
        mode = CAUSAL_MODES[causal]
    except (KeyError, TypeError):
        raise ArgumentError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}") from None
    if block_mask is None:
        return _builtin_mask(mode, inp.q_len, inp.kv_len)
    if mode is not None:
        raise ArgumentError("pass either block_mask or causal, not both (build a causal BlockMask instead)")
    if not isinstance(block_mask, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(block_mask).__name__}")
    check_mask_matches(block_mask, inp)
    return block_mask


#: What a plan for a named architecture assumes of the machine that runs it.
TARGET_ASSUMES = ("assumes the target has a CUDA driver and NVIDIA's cuda-bindings, which encode its TMA tensor "
                  "maps (without them it runs the wgmma family)")


@dataclass(frozen=True)
class Extras:
    """Per-score work beyond the block mask: bias, a score modifier, a fused mask expression."""

    bias: Optional[Bias] = None
    score_expr: Optional[expressions.CudaExpr] = None
    mask_expr: Optional[expressions.CudaExpr] = None

    @property
    def transforms_scores(self) -> bool:
        """With a bias or score modifier the kernel scales scores itself (softmax in natural units)."""
        return self.bias is not None or self.score_expr is not None


def make_plan(inp: Inputs, bm: BlockMask, stages: Optional[int], extras: Extras, arch: Optional[str],
              family: Optional[str] = None, target: bool = False) -> Plan:
    """The forward Plan. ``target``: planning for a named GPU, not this machine's: what the tma family
    needs of the driver (tensor maps encoded through cuda-bindings) is assumed of the target, and the
    plan says so; only what the inputs themselves decide (strides, alignment) moves it to wgmma."""
    plan = plan_forward(head_dim=inp.head_dim, dtype=inp.dtype, batch=inp.batch, heads=inp.heads, block_mask=bm,
                        stages=stages, bias=extras.bias.dtype if extras.bias else None,
                        mask_expr=extras.mask_expr.key if extras.mask_expr else None,
                        score_expr=extras.score_expr.key if extras.score_expr else None, arch=arch, family=family)
    if plan.variant.family == "tma":  # inputs TMA cannot address run on the wgmma family (ops/tma.py)
        why = tma.unusable(plan.variant, {"q": inp.q, "k": inp.k, "v": inp.v}, inp.dtype, need_driver=not target)
        if why is not None:
            logging.getLogger("omnicupy").info(f"omnicupy: tma family not used ({why}); wgmma instead")
            return make_plan(inp, bm, stages, extras, arch, family="wgmma", target=target)
        if target:
            plan = dataclasses.replace(plan, reason=plan.reason + f"; {TARGET_ASSUMES}")
    return plan


def _on_device(bm: BlockMask, what: tuple, host: Optional[np.ndarray]):
    """``host`` (a schedule array of the mask's plans) on the current device, uploaded once per
    device and ``what``, cached on the mask; None for None. No synchronization, also while a graph
    is being captured."""
    if host is None:
        return None
    key = ("device", arrays.cupy_module().cuda.runtime.getDevice(), *what)
    if key not in bm._tile_orders:
        bm._tile_orders[key] = arrays.upload(host)
    return bm._tile_orders[key]


def _cta_tile_fields(bm: BlockMask, plan: Plan) -> dict[str, Any]:
    """The persistent tma launch's per-CTA tile lists as launch fields (null: grid stride). Keyed
    by identity: schedule.cta_tile_lists caches the host arrays on this mask for its lifetime."""
    offsets, tiles = plan.cta_tiles if plan.cta_tiles is not None else (None, None)
    return {"cta_tiles": _on_device(bm, ("cta_offsets", id(offsets)), offsets),
            "tile_list": _on_device(bm, ("cta_tiles", id(tiles)), tiles)}


def _launch(inp: Inputs, o, lse, bm: BlockMask, scale: float, plan: Plan, extras: Extras = Extras()) -> recall.Recipe:
    bm = plan.block_mask or bm  # a rule mask the plan re-blocked for its tile
    try:
        kernel = jit.get_kernel(plan.variant)
    except CompileError as exc:
        exprs = [e.text for e in (extras.mask_expr, extras.score_expr) if e is not None]
        if not exprs:
            raise
        raise CompileError(f"the CUDA expression(s) {exprs} did not compile:\n{exc}") from None
    fields = {
        "q": inp.q, "k": inp.k, "v": inp.v, "o": o, "lse": lse,
        **group.strides(inp.q, "q"), **group.strides(inp.k, "k"), **group.strides(inp.v, "v"),
        **group.strides(o, "o"),
        "num_heads": inp.heads, "q_len": inp.q_len, "kv_len": inp.kv_len, "kv_group": inp.heads // inp.kv_heads,
        "scale": scale,
        # The softmax works on raw scores with the scale folded into exp2, unless the kernel
        # already scaled them (per-score extras): then in natural units.
        "scale_log2": math.log2(math.e) * (1.0 if extras.transforms_scores else scale),
        **group.mask_rows(bm),
        "q_tile_order": _on_device(bm, ("order", plan.variant.br), plan.q_tile_order),
        **group.bias(extras.bias),
        **group.user_arrays(extras.mask_expr, extras.score_expr),
    }
    params, maps = struct_for(plan.operation, plan.variant.family), None
    if plan.variant.family == "tma":  # TMA tensor maps of q, k, v (ops/tma.py; cached per buffer)
        maps = tma.MapWriter.make(plan.variant, inp.q, inp.k, inp.v, inp.dtype)
        fields.update(maps.fields(inp.q.data.ptr, inp.k.data.ptr, inp.v.data.ptr), batch=inp.batch,
                      **_cta_tile_fields(bm, plan))
    # The first call launches through its recipe too: one route for first and later calls.
    recipe = recall.Recipe.make(kernel, plan, fields, params, maps)
    recipe.launch(*(0 if x is None else x.data.ptr for x in (inp.q, inp.k, inp.v, o, lse)))
    return recipe


def _check_call(q, k, v, block_mask, causal, stages, bias, score_mod, fuse_mask) -> tuple[Inputs, BlockMask, Extras]:
    """The checks attention() and plan() share: inputs, mask, pipeline, per-score extras."""
    inp = check_qkv(q, k, v)
    bm = resolve_mask(block_mask, causal, inp)
    check_flags(fuse_mask=fuse_mask)
    check_stages(stages)
    extras = Extras(
        bias=check_bias(bias, inp),
        score_expr=check_score_mod(score_mod),
        mask_expr=expressions.fused_mask_expr(bm.mask_mod) if fuse_mask and bm.features.partial else None,
    )
    check_expressions((extras.mask_expr, extras.score_expr), inp)
    return inp, bm, extras


def plan(q: Any, k: Any, v: Any, block_mask: Optional[BlockMask] = None, *, causal: Causal = False,
         stages: Optional[int] = None, bias: Any = None, score_mod: Any = None, fuse_mask: bool = False,
         arch: Optional[str] = None, kv_lens: Any = None,
         num_splits: Optional[int] = None) -> "Plan | decode.DecodePlan":
    """Which kernel ``attention()`` with these arguments would run, how, and why.

    Takes the arguments of ``attention()`` that decide the kernel (q/k/v may be NumPy arrays; only
    their shapes and dtypes are read) and returns the Plan: variant, grid, block, shared memory,
    q-tile launch order and the reason for the family and tile. ``arch`` ('sm_80', 'sm_90', ...)
    plans for that GPU; by default, for the current device (a GPU is needed then).

        print(omnicupy.plan(q, k, v, bm))

    Where attention() would take the split-KV decode kernel (few query rows per kv head, or
    ``kv_lens`` / ``num_splits`` given), the answer is that kernel's ``decode.DecodePlan``
    (split count, m tile packing, the combine) instead.
    """
    target = arch is not None
    arch = check_arch(arch) if target else None
    inp, bm, extras = _check_call(q, k, v, block_mask, causal, stages, bias, score_mod, fuse_mask)
    if arch is None:
        require_gpu()
        arch = current_arch()
    split_kv = decode.decode_plan(inp, block_mask if isinstance(block_mask, BlockMask) else None, kv_lens, num_splits,
                                  causal=causal, score_expr=extras.score_expr, bias=extras.bias, arch=arch)
    if split_kv is not None:
        return split_kv
    return make_plan(inp, bm, stages, extras, arch, target=target)


def _steady_key(q, k, v, out, kv_lens, block_mask, causal, scale, bias, score_mod, return_lse, stages, fuse_mask,
                num_splits, cp) -> tuple:
    """(key, mask, views of q, k, v, view of out, view of kv_lens) of a call the steady state may
    serve (ops/recall.py), or (None, None, ...): then the general path runs. The key holds what
    decides the launch: the arrays' layouts, the other arguments, the dispatch switches
    (recall.signature) and the decode's tunables (decode.settings(): they decide whether the
    decode kernel runs, and its plan)."""
    nothing = None, None, None, None, None
    # Device lengths only: host lengths are read on the host (they pick the decode plan), per call.
    if not (kv_lens is None or type(kv_lens) is cp.ndarray) or not (bias is None or type(bias) is cp.ndarray):
        return nothing
    views = (recall.view(q, cp), recall.view(k, cp), recall.view(v, cp))
    # A user ``out`` only as a CuPy array: the general path returns other kinds as CuPy views
    out_view = None if out is None or type(out) is not cp.ndarray else recall.view(out, cp)
    lens_view = None if kv_lens is None else recall.view(kv_lens, cp)
    if None in views or len(views[0][1]) != 4 or len(views[1][1]) != 4 or len(views[2][1]) != 4 \
            or (out is not None and out_view is None):
        return nothing
    if (scale is None and return_lse is False and stages is None and out is None and bias is None
            and score_mod is None and fuse_mask is False and kv_lens is None and num_splits is None):
        options = ()  # every option at its default: the common call keys on its arrays and causal only
    else:  # scalars enter with their types: 2 and 2.0 (or 1 and True) are equal keys but not equally valid
        options = (out_view is None or out_view[1:], id(bias), id(score_mod), scale, return_lse, stages, fuse_mask,
                   num_splits, type(scale), type(return_lse), type(stages), type(fuse_mask), type(num_splits),
                   None if lens_view is None else lens_view[1:])
    key = recall.signature(views, (causal, type(causal), decode.settings(), *options))
    return key, steady_mask(block_mask, causal, views[0][1][2], views[1][1][2]), views, out_view, lens_view


def attention(
    q: Any,
    k: Any,
    v: Any,
    block_mask: Optional[BlockMask] = None,
    *,
    causal: Causal = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    stages: Optional[int] = None,
    out: Any = None,
    bias: Any = None,
    score_mod: Any = None,
    fuse_mask: bool = False,
    kv_lens: Any = None,
    num_splits: Optional[int] = None,
):
    """Exact softmax attention under a block-sparse mask.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` in float16 or bfloat16, last dim contiguous, other
    strides free. ``block_mask`` (an omnicupy.BlockMask) or ``causal`` selects the allowed pairs;
    neither means full attention. ``causal=True`` (or ``"top_left"``) is ``q_idx >= kv_idx``
    (flex-attention's convention); ``causal="bottom_right"`` is ``q_idx + Nkv - Nq >= kv_idx``
    (FlashAttention-2's, for prefill against a KV cache). ``scale`` defaults to ``1/sqrt(D)``.
    ``stages`` picks the kernel pipeline (1: shared K/V buffer, 2: prefetch; None: tuned default).

    ``bias`` (fp16, bf16 or fp32; ``[B|1, H|1, Nkv]`` or ``[B|1, H|1, Nq, Nkv]``, any strides) is added
    to the scaled scores; ``score_mod`` (from omnicupy.score_mods) then modifies them; the mask
    comes last. With ``fuse_mask=True``, when the BlockMask's mask_mod carries a CUDA expression
    (simple built-in masks, omnicupy.cuda_mask), PARTIAL blocks evaluate it in the kernel instead of
    loading the stored bits; the output is bit-identical. Stored bits are the default because they
    measured faster (lab/notes, "Fused mask expressions").

    Few query rows per kv head (decode, speculative verification: GQA group x Nq <= 64) run the
    split-KV decode kernel (ops/decode.py), which splits each sequence's keys across CTAs and merges
    the partial results. ``kv_lens`` (int32 ``[B]``) gives each sequence of a contiguous cache its
    own length (causal is then bottom-right per sequence); ``num_splits`` overrides the split count.
    Either one asks for the decode kernel (ArgumentError when it cannot serve the call).

    NumPy inputs give NumPy outputs; anything else (CuPy, DLPack, CUDA array interface) gives CuPy
    arrays on the current device, computed on the current stream. Returns ``out`` or, with
    ``return_lse``, ``(out, lse)`` where lse is float32 ``[B, Hq, Nq]`` (natural log, -inf for rows
    with no allowed key, whose output is 0).
    """
    key = None
    cp = steady_state_possible()
    if cp is not None:
        # The steady state (ops/recall.py): no GPU query here; a recipe exists only after a call ran.
        key, mask, views, out_view, lens_view = _steady_key(q, k, v, out, kv_lens, block_mask, causal, scale, bias,
                                                            score_mod, return_lse, stages, fuse_mask, num_splits, cp)
        if mask is not None:
            result = recall.launch_if_known(mask, key, views, None if out is None else (out, out_view), return_lse,
                                            cp, lens_view)
            if result is not None:
                return result
    host_result = arrays.is_numpy(q)
    inp, bm, extras = _check_call(q, k, v, block_mask, causal, stages, bias, score_mod, fuse_mask)
    scale = check_scale(scale, inp.head_dim)
    return_lse = check_bool(return_lse, "return_lse")
    out = check_out(out, inp, inputs={"bias": extras.bias.array if extras.bias else None})
    check_decode_args(kv_lens, num_splits, inp.batch, inp.kv_len)
    require_gpu()  # every check above runs without a GPU for NumPy inputs
    inp = on_device(inp)
    if key is not None and any(x.data.ptr != vw[0] for x, vw in zip((inp.q, inp.k, inp.v), views)):
        key = None  # an input was copied to make its rows 16-byte aligned: the recipe would not fit it
    o, copy_into = device_out(out, inp)
    cp = arrays.cupy_module()
    lse = cp.empty((inp.batch, inp.heads, inp.q_len), dtype=np.float32) if return_lse else None
    split_kv = decode.decode_plan(inp, block_mask if isinstance(block_mask, BlockMask) else None, kv_lens, num_splits,
                                  causal=causal, score_expr=extras.score_expr, bias=extras.bias, arch=current_arch())
    if split_kv is not None:
        record = [] if key is not None and copy_into is None and not host_result else None
        decode.run_decode(split_kv, inp, o, lse, scale, kv_lens=decode.check_lengths(kv_lens, inp.batch, inp.kv_len),
                          block_mask=block_mask if isinstance(block_mask, BlockMask) else None,
                          score_expr=extras.score_expr, record=record)
        if record:  # the steady state replays the recorded launches with the next call's pointers
            pointers = {"q": inp.q.data.ptr, "k": inp.k.data.ptr, "v": inp.v.data.ptr, "o": o.data.ptr,
                        "lse": None if lse is None else lse.data.ptr,
                        "kv_lens": None if kv_lens is None else kv_lens.data.ptr}  # a CuPy array here
            chain = recall.ChainRecipe.from_record(record, pointers, decode.SCRATCH_FIELDS)
            if chain is not None:
                recall.remember(bm, key, chain, bias, score_mod)
    else:
        recipe = _launch(inp, o, lse, bm, scale, make_plan(inp, bm, stages, extras, current_arch()), extras)
        if copy_into is None and not host_result:
            recall.remember(bm, key, recipe, bias, score_mod)
    if copy_into is not None:
        if arrays.is_numpy(copy_into):
            copy_into[...] = o.get()
        else:
            copy_into[...] = o
        o = copy_into
    if host_result:
        o = o if arrays.is_numpy(o) else o.get()
        lse = None if lse is None else lse.get()
    return (o, lse) if return_lse else o


def omni_attn_mma_blockmask(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    kv_num_blocks: Any,
    kv_indices: Any,
    block_mask_types: Any,
    stages: Optional[int] = None,
    *,
    partial_block_mask_indices: Any = None,
    partial_block_masks: Any = None,
    q_block_size: int = 128,
    kv_block_size: int = 128,
    scale: Optional[float] = None,
    lse: Any = None,
):
    """Low-level call on raw metadata (docs/design.md, "Block mask metadata") and a caller-owned output buffer.

    All arrays are device arrays (CuPy, DLPack or CUDA array interface). The metadata is validated on
    the device on every call; build a BlockMask once and call ``attention`` to avoid that cost.
    ``lse``, if given, is a contiguous float32 ``[B, Hq, Nq]`` buffer. Returns ``o``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
        if arrays.is_numpy(x):
            raise ArgumentError(f"{name} must be a device array for the low-level call, got a NumPy array")
    require_gpu()
    inp = on_device(check_qkv(q, k, v))
    meta_arrays = [kv_num_blocks, kv_indices, block_mask_types, partial_block_mask_indices, partial_block_masks]
    names = ["kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks"]
    meta_arrays = [None if a is None else arrays.to_cupy(a, n) for a, n in zip(meta_arrays, names)]
    bm = BlockMask(*meta_arrays[:3], q_len=inp.q_len, kv_len=inp.kv_len, q_block_size=q_block_size,
                   kv_block_size=kv_block_size, partial_block_mask_indices=meta_arrays[3],
                   partial_block_masks=meta_arrays[4])
    check_mask_matches(bm, inp)
    check_stages(stages)
    od = arrays.to_cupy(check_out(o, inp, "o"), "o")
    check_device(od, "o")
    if not aligned(od):
        raise ArgumentError("o must be 16-byte aligned with row strides a multiple of 8 elements")
    if arrays.is_numpy(lse):
        raise ArgumentError("lse must be a device array for the low-level call, got a NumPy array")
    lse_d = None if lse is None else arrays.to_cupy(check_lse_buffer(lse, inp, od), "lse")
    _launch(inp, od, lse_d, bm, check_scale(scale, inp.head_dim), make_plan(inp, bm, stages, Extras(), current_arch()))
    return o
