"""attention(): check arguments, pick the variant, launch on the current CuPy stream.

Every check runs before any launch and raises an ArgumentError (or MaskError) naming the argument.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from . import arrays, expressions, jit, schedule, tiles
from .block_mask import BlockMask, DeviceMetadata
from .checks import check_positive_float
from .errors import ArgumentError, CompileError, MaskError, NoGPUError

MAX_GRID_YZ = 65535  # heads ride on grid.y, batch on grid.z
CAUSAL_MODES = {False: None, True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}
BIAS_DTYPES = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32"}
if arrays.BFLOAT16 is not None:
    BIAS_DTYPES[arrays.BFLOAT16] = "bf16"


@dataclass(frozen=True)
class _Inputs:
    q: Any
    k: Any
    v: Any
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


def _require_gpu() -> None:
    if arrays.cupy_module() is None:
        raise NoGPUError("omnicupy needs CuPy: pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]'")
    if not arrays.gpu_available():
        raise NoGPUError("omnicupy.attention needs an NVIDIA GPU and driver; none is usable on this machine")


def _dtype_name(x: Any, name: str) -> str:
    dt = np.dtype(x.dtype)
    if dt not in arrays.DTYPE_NAMES:
        raise ArgumentError(f"{name} must be float16 or bfloat16 (ml_dtypes.bfloat16), got dtype {dt}")
    return arrays.DTYPE_NAMES[dt]


def _check_device(x: Any, name: str) -> None:
    cp = arrays.cupy_module()
    current = cp.cuda.runtime.getDevice()
    if x.device.id != current:
        raise ArgumentError(f"{name} is on CUDA device {x.device.id} but the current device is {current}")


def _aligned(x: Any) -> bool:
    """16-byte loads need a 16-byte aligned base and row strides that are multiples of 8 elements."""
    item = x.itemsize
    return x.data.ptr % 16 == 0 and all((s // item) % 8 == 0 for s in x.strides[:-1])


def _as_array(x: Any, name: str):
    """NumPy and CuPy arrays pass through (their checks need no GPU); DLPack and CUDA-array-interface
    objects become zero-copy CuPy views."""
    if x is None:
        raise ArgumentError(f"{name} is required")
    if arrays.is_numpy(x) or arrays.is_cupy(x):
        return x
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        _require_gpu()
        return arrays.to_cupy(x, name)
    raise ArgumentError(f"{name} must be a NumPy/CuPy array or a DLPack / CUDA-array-interface object, "
                        f"got {type(x).__name__}")


def _check_layout(x: Any, name: str) -> str:
    """Shape, dtype and last-dim contiguity of one input; returns its dtype name."""
    if x.ndim != 4:
        raise ArgumentError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(x.shape)}")
    dtype = _dtype_name(x, name)
    if any(s == 0 for s in x.shape):
        raise ArgumentError(f"{name} has a zero-size dimension: shape {tuple(x.shape)}")
    if x.shape[3] > 1 and x.strides[3] != x.itemsize:
        raise ArgumentError(f"{name} must be contiguous in its last dim (head_dim); got strides {x.strides} bytes")
    return dtype


def _to_device(x: Any, name: str):
    """A CuPy array on the current device whose rows allow 16-byte loads (one copy if they don't)."""
    d = arrays.to_cupy(x, name)
    _check_device(d, name)
    if not _aligned(d):
        d = arrays.cupy_module().ascontiguousarray(d)  # rare: offset views; one copy keeps 16-byte loads legal
    return d


def _check_inputs(q: Any, k: Any, v: Any) -> _Inputs:
    qa, ka, va = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    dtypes = {n: _check_layout(a, n) for n, a in (("q", qa), ("k", ka), ("v", va))}
    if len(set(dtypes.values())) != 1:
        raise ArgumentError(f"q, k and v must share one dtype, got {dtypes}")
    B, Hq, Nq, D = qa.shape
    if ka.shape != va.shape:
        raise ArgumentError(f"k and v must have the same shape, got k {tuple(ka.shape)} and v {tuple(va.shape)}")
    Bk, Hkv, Nkv, Dk = ka.shape
    if Bk != B:
        raise ArgumentError(f"k/v batch ({Bk}) must equal q batch ({B})")
    if Dk != D:
        raise ArgumentError(f"k/v head_dim ({Dk}) must equal q head_dim ({D})")
    if D not in jit.SUPPORTED_HEAD_DIMS:
        raise ArgumentError(f"q: head_dim {D} is not supported (supported: {jit.SUPPORTED_HEAD_DIMS})")
    if Hq % Hkv:
        raise ArgumentError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) (GQA/MQA)")
    if Hq > MAX_GRID_YZ or B > MAX_GRID_YZ:
        raise ArgumentError(f"q: batch ({B}) and heads ({Hq}) must each be <= {MAX_GRID_YZ}")
    return _Inputs(qa, ka, va, dtypes["q"], B, Hq, Hkv, Nq, Nkv, D)


def _on_device(inp: _Inputs) -> _Inputs:
    return replace(inp, q=_to_device(inp.q, "q"), k=_to_device(inp.k, "k"), v=_to_device(inp.v, "v"))


def _check_scale(scale: Optional[float], head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else check_positive_float(scale, "scale")


@functools.lru_cache(maxsize=64)
def _builtin_mask(mode: Optional[str], q_len: int, kv_len: int) -> BlockMask:
    if mode is None:
        return BlockMask.full(q_len, kv_len)
    return BlockMask.causal(q_len, kv_len, bottom_right=mode == "bottom_right")


def _resolve_mask(block_mask: Optional[BlockMask], causal: Any, inp: _Inputs) -> BlockMask:
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


@dataclass(frozen=True)
class _Bias:
    array: Any  # NumPy or CuPy, 3-D [B|1, H|1, Nkv] or 4-D [B|1, H|1, Nq, Nkv]
    dtype: str


def _check_bias(bias: Any, inp: _Inputs) -> Optional[_Bias]:
    """A vector bias [B|1, H|1, Nkv] or a matrix bias [B|1, H|1, Nq, Nkv] in fp16, bf16 or fp32."""
    if bias is None:
        return None
    bias = _as_array(bias, "bias")
    dtype = BIAS_DTYPES.get(np.dtype(bias.dtype))
    if dtype is None:
        raise ArgumentError(f"bias must be float16, bfloat16 or float32, got dtype {bias.dtype}")
    if bias.ndim not in (3, 4):
        raise ArgumentError(f"bias must be [B|1, H|1, Nkv] or [B|1, H|1, Nq, Nkv], got shape {tuple(bias.shape)}")
    want = (inp.batch, inp.heads) + ((inp.q_len,) if bias.ndim == 4 else ()) + (inp.kv_len,)
    for dim, (got, full) in enumerate(zip(bias.shape, want)):
        if got != full and not (got == 1 and dim < len(want) - 1):
            raise ArgumentError(f"bias shape {tuple(bias.shape)} does not broadcast to {want} (dim {dim})")
    return _Bias(bias, dtype)


def _check_score_mod(score_mod: Any) -> Optional[expressions.CudaExpr]:
    if score_mod is None:
        return None
    expr = getattr(score_mod, "cuda", None)
    if not isinstance(expr, expressions.CudaExpr):
        raise ArgumentError("score_mod must come from omnicupy.score_mods (alibi, softcap, cuda_score), "
                            f"got {type(score_mod).__name__}")
    return expr


def check_mask_matches(bm: BlockMask, inp: _Inputs) -> None:
    Bm, Hm, q_len, kv_len = bm.shape
    if q_len != inp.q_len or kv_len != inp.kv_len:
        raise MaskError(f"block_mask is for q_len={q_len}, kv_len={kv_len} but q/k have {inp.q_len}, {inp.kv_len}")
    if Bm not in (1, inp.batch):
        raise MaskError(f"block_mask batch dim ({Bm}) must be 1 or the batch size ({inp.batch})")
    if Hm not in (1, inp.heads):
        raise MaskError(f"block_mask head dim ({Hm}) must be 1 or the number of q heads ({inp.heads})")


def _check_stages(stages: Any) -> None:
    if stages not in (None, 1, 2):
        raise ArgumentError(f"stages must be None, 1 or 2, got {stages!r}")


def _check_out(out: Any, inp: _Inputs, name: str = "out"):
    """Shape/dtype/layout checks of a user ``out`` (no GPU needed for NumPy); returns it as an array."""
    if out is None:
        return None
    shape = (inp.batch, inp.heads, inp.q_len, inp.head_dim)
    out = _as_array(out, name)
    if tuple(out.shape) != shape or np.dtype(out.dtype) != np.dtype(inp.q.dtype):
        raise ArgumentError(f"{name} must have shape {shape} and dtype {inp.q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.strides[3] != out.itemsize:
        raise ArgumentError(f"{name} must be contiguous in its last dim; got strides {out.strides} bytes")
    return out


def _device_out(out: Any, inp: _Inputs):
    """(device buffer the kernel writes, user object to copy into afterwards or None)."""
    cp = arrays.cupy_module()
    shape = (inp.batch, inp.heads, inp.q_len, inp.head_dim)
    if out is None:
        return cp.empty(shape, dtype=inp.q.dtype), None
    if arrays.is_numpy(out):
        return cp.empty(shape, dtype=inp.q.dtype), out
    _check_device(out, "out")
    if not _aligned(out):
        return cp.empty(shape, dtype=inp.q.dtype), out
    return out, None


@dataclass(frozen=True)
class _Extras:
    """Per-score work beyond the block mask: bias, a score modifier, a fused mask expression."""

    bias: Optional[_Bias] = None
    score_expr: Optional[expressions.CudaExpr] = None
    mask_expr: Optional[expressions.CudaExpr] = None


def _launch(inp: _Inputs, o, lse, bm: BlockMask, meta: DeviceMetadata, scale: float, stages: Optional[int],
            extras: _Extras = _Extras()) -> None:
    variant = tiles.select_variant(
        inp.head_dim, inp.dtype, stages, bm.q_block_size, bm.kv_block_size, bm.features.causal, bm.features.partial,
        bias=extras.bias.dtype if extras.bias else None,
        mask_expr=extras.mask_expr.key if extras.mask_expr else None,
        score_expr=extras.score_expr.key if extras.score_expr else None, arch=jit.device_arch())
    try:
        kernel = jit.get_kernel(variant)
    except CompileError as exc:
        exprs = [e.text for e in (extras.mask_expr, extras.score_expr) if e is not None]
        if not exprs:
            raise
        raise CompileError(f"the CUDA expression(s) {exprs} did not compile:\n{exc}") from None
    Bm, Hm = meta.kv_indices.shape[:2]  # may be 1 where the BlockMask broadcasts by stride
    item = inp.q.itemsize

    def strides(x):
        return [np.int64(s // item) for s in x.strides[:3]]

    null = np.uint64(0)
    # With per-score work the kernel scales scores itself and the softmax runs in natural units.
    transform = extras.bias is not None or extras.score_expr is not None
    scale_log2 = math.log2(math.e) * (1.0 if transform else scale)
    bias_args = [null, np.int64(0), np.int64(0), np.int64(0), np.int64(0)]
    if extras.bias is not None:
        b = arrays.to_cupy(extras.bias.array, "bias")
        _check_device(b, "bias")
        st = [s // b.itemsize if n > 1 else 0 for s, n in zip(b.strides, b.shape)]
        if b.ndim == 3:  # vector bias: the same row for every query
            st = st[:2] + [0] + st[2:]
        bias_args = [b] + [np.int64(x) for x in st]
    order = schedule.q_tile_order(bm, variant.br)
    expr_arrays = [a for e in (extras.mask_expr, extras.score_expr) if e is not None for a in e.device_arrays()]
    args = (
        inp.q, inp.k, inp.v, o, null if lse is None else lse,
        *strides(inp.q), *strides(inp.k), *strides(inp.v), *strides(o),
        np.int32(inp.heads), np.int32(inp.q_len), np.int32(inp.kv_len), np.int32(inp.heads // inp.kv_heads),
        np.float32(scale_log2),
        meta.kv_num_blocks, meta.kv_indices, meta.block_mask_types,
        null if meta.partial_block_mask_indices is None else meta.partial_block_mask_indices,
        null if meta.partial_block_masks is None else meta.partial_block_masks,
        np.int32(Hm), np.int32(1 if Bm > 1 else 0), np.int32(1 if Hm > 1 else 0),
        np.int32(bm.num_q_blocks), np.int32(bm.max_blocks),
        np.int32(bm.q_block_size), np.int32(bm.kv_block_size),
        null if order is None else order,
        np.float32(scale), *bias_args, *expr_arrays,
    )
    grid = (bm.q_len // variant.br + (bm.q_len % variant.br > 0), inp.heads, inp.batch)
    kernel(grid, (variant.threads,), args, shared_mem=variant.smem_bytes)


def attention(
    q: Any,
    k: Any,
    v: Any,
    block_mask: Optional[BlockMask] = None,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    stages: Optional[int] = None,
    out: Any = None,
    bias: Any = None,
    score_mod: Any = None,
    fuse_mask: bool = False,
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
    measured faster (NOTES.md, "Fused mask expressions").

    NumPy inputs give NumPy outputs; anything else (CuPy, DLPack, CUDA array interface) gives CuPy
    arrays on the current device, computed on the current stream. Returns ``out`` or, with
    ``return_lse``, ``(out, lse)`` where lse is float32 ``[B, Hq, Nq]`` (natural log, -inf for rows
    with no allowed key, whose output is 0).
    """
    host_result = arrays.is_numpy(q)
    inp = _check_inputs(q, k, v)
    bm = _resolve_mask(block_mask, causal, inp)
    scale = _check_scale(scale, inp.head_dim)
    _check_stages(stages)
    out = _check_out(out, inp)
    extras = _Extras(
        bias=_check_bias(bias, inp),
        score_expr=_check_score_mod(score_mod),
        mask_expr=expressions.fused_mask_expr(bm.mask_mod) if fuse_mask and bm.features.partial else None,
    )
    expressions.merge_names(extras.mask_expr, extras.score_expr)
    _require_gpu()  # every check above runs without a GPU for NumPy inputs
    inp = _on_device(inp)
    o, copy_into = _device_out(out, inp)
    cp = arrays.cupy_module()
    lse = cp.empty((inp.batch, inp.heads, inp.q_len), dtype=np.float32) if return_lse else None
    _launch(inp, o, lse, bm, bm.device_metadata(), scale, stages, extras)
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
    """Low-level call on raw metadata (DESIGN.md §1 arrays) and a caller-owned output buffer.

    All arrays are device arrays (CuPy, DLPack or CUDA array interface). The metadata is validated on
    the device on every call; build a BlockMask once and call ``attention`` to avoid that cost.
    ``lse``, if given, is a contiguous float32 ``[B, Hq, Nq]`` buffer. Returns ``o``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
        if arrays.is_numpy(x):
            raise ArgumentError(f"{name} must be a device array for the low-level call, got a NumPy array")
    _require_gpu()
    inp = _on_device(_check_inputs(q, k, v))
    meta_arrays = [kv_num_blocks, kv_indices, block_mask_types, partial_block_mask_indices, partial_block_masks]
    names = ["kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks"]
    meta_arrays = [None if a is None else arrays.to_cupy(a, n) for a, n in zip(meta_arrays, names)]
    bm = BlockMask(*meta_arrays[:3], q_len=inp.q_len, kv_len=inp.kv_len, q_block_size=q_block_size,
                   kv_block_size=kv_block_size, partial_block_mask_indices=meta_arrays[3],
                   partial_block_masks=meta_arrays[4])
    check_mask_matches(bm, inp)
    _check_stages(stages)
    od = arrays.to_cupy(_check_out(o, inp, "o"), "o")
    _check_device(od, "o")
    if not _aligned(od):
        raise ArgumentError("o must be 16-byte aligned with row strides a multiple of 8 elements")
    lse_d = None
    if lse is not None:
        lse_d = arrays.to_cupy(lse, "lse")
        if tuple(lse_d.shape) != tuple(od.shape[:3]) or lse_d.dtype != np.float32 or not lse_d.flags.c_contiguous:
            raise ArgumentError(f"lse must be a contiguous float32 array of shape {tuple(od.shape[:3])}")
    _launch(inp, od, lse_d, bm, bm.device_metadata(), _check_scale(scale, inp.head_dim), stages)
    return o
