"""Argument checks every operation shares: q/k/v (shapes, dtypes, layout, device, sizes the kernels
can index), scale, bias, score modifiers and their lookup arrays, output buffers (writable, not
overlapping the inputs or themselves), and the mask's agreement with the inputs.

Every check raises a named omnicupy error (ArgumentError and its kinds MaskError, ExpressionError,
SizeLimitError, AliasError; NoGPUError) before anything is launched; checks of NumPy inputs need no
GPU. Knows arrays and the attention contract (docs/design.md, "Semantics"); knows nothing of kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .. import arrays
from ..checks import check_positive_float
from ..dispatch.params import MAX_USER_ARRAYS
from ..dispatch.variant import check_head_dim
from ..errors import AliasError, ArgumentError, ExpressionError, MaskError, NoGPUError, SizeLimitError
from ..mask import BlockMask, expressions

MAX_GRID_YZ = 65535  # heads ride on grid.y, batch on grid.z
#: Longest q or kv sequence: the kernels hold positions in 32-bit ints and compute positions up to
#: a tile (<= 256) past the end, and block starts rounded to a block; 2**16 of headroom covers both.
MAX_SEQ_LEN = 2**31 - 2**16
#: The kernels multiply raw scores by scale * log2(e) in float32.
MAX_SCALE = float(np.finfo(np.float32).max) / math.log2(math.e)
#: Work np.shares_memory may spend proving two strided arrays disjoint before giving up (and refusing).
SHARES_MEMORY_WORK = 1 << 20
BIAS_DTYPES = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32"}
if arrays.BFLOAT16 is not None:
    BIAS_DTYPES[arrays.BFLOAT16] = "bf16"


@dataclass(frozen=True)
class Inputs:
    """q, k, v (NumPy or CuPy) and the sizes read off them."""

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


def require_gpu() -> None:
    if arrays.cupy_module() is None:
        raise NoGPUError("omnicupy needs CuPy: pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]'")
    if not arrays.gpu_available():
        raise NoGPUError("omnicupy.attention needs an NVIDIA GPU and driver; none is usable on this machine")


def dtype_name(x: Any, name: str) -> str:
    dt = np.dtype(x.dtype)
    if dt not in arrays.DTYPE_NAMES:
        raise ArgumentError(f"{name} must be float16 or bfloat16 (ml_dtypes.bfloat16), got dtype {dt}")
    return arrays.DTYPE_NAMES[dt]


def check_device(x: Any, name: str) -> None:
    cp = arrays.cupy_module()
    current = cp.cuda.runtime.getDevice()
    if x.device.id != current:
        raise ArgumentError(f"{name} is on CUDA device {x.device.id} but the current device is {current}")


def aligned(x: Any) -> bool:
    """16-byte loads need a 16-byte aligned base and row strides that are multiples of 8 elements."""
    item = x.itemsize
    return x.data.ptr % 16 == 0 and all((s // item) % 8 == 0 for s in x.strides[:-1])


def as_array(x: Any, name: str):
    """NumPy and CuPy arrays pass through (their checks need no GPU); DLPack and CUDA-array-interface
    objects become zero-copy CuPy views."""
    if x is None:
        raise ArgumentError(f"{name} is required")
    if arrays.is_numpy(x) or arrays.is_cupy(x):
        return x
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        require_gpu()
        return arrays.to_cupy(x, name)
    raise ArgumentError(f"{name} must be a NumPy/CuPy array or a DLPack / CUDA-array-interface object, "
                        f"got {type(x).__name__}")


def check_layout(x: Any, name: str) -> str:
    """Shape, dtype and last-dim contiguity of one input; returns its dtype name."""
    if x.ndim != 4:
        raise ArgumentError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(x.shape)}")
    dtype = dtype_name(x, name)
    if any(s == 0 for s in x.shape):
        raise ArgumentError(f"{name} has a zero-size dimension: shape {tuple(x.shape)}")
    if x.shape[3] > 1 and x.strides[3] != x.itemsize:
        raise ArgumentError(f"{name} must be contiguous in its last dim (head_dim); got strides {x.strides} bytes")
    return dtype


def to_device(x: Any, name: str):
    """A CuPy array on the current device whose rows allow 16-byte loads (one copy if they don't)."""
    d = arrays.to_cupy(x, name)
    check_device(d, name)
    if not aligned(d):
        d = arrays.cupy_module().ascontiguousarray(d)  # rare: offset views; one copy keeps 16-byte loads legal
    return d


def check_qkv(q: Any, k: Any, v: Any) -> Inputs:
    qa, ka, va = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    dtypes = {n: check_layout(a, n) for n, a in (("q", qa), ("k", ka), ("v", va))}
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
    check_head_dim(int(D))  # HeadDimError: a multiple of 8 from 8 to 256 (padded onto the next tile)
    if Hq % Hkv:
        raise ArgumentError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) (GQA/MQA)")
    if Hq > MAX_GRID_YZ or B > MAX_GRID_YZ:
        raise SizeLimitError(f"q: batch ({B}) and heads ({Hq}) must each be <= {MAX_GRID_YZ}")
    for name, length in (("q", Nq), ("k/v", Nkv)):
        if length > MAX_SEQ_LEN:
            raise SizeLimitError(f"{name}: sequence length {length} is more than the kernels can index "
                                 f"({MAX_SEQ_LEN} = 2**31 - 2**16: positions are 32-bit)")
    return Inputs(qa, ka, va, dtypes["q"], B, Hq, Hkv, Nq, Nkv, D)


def on_device(inp: Inputs) -> Inputs:
    return replace(inp, q=to_device(inp.q, "q"), k=to_device(inp.k, "k"), v=to_device(inp.v, "v"))


def check_scale(scale: Optional[float], head_dim: int) -> float:
    """The softmax scale: None gives 1/sqrt(D); else a real number, finite and normal in float32,
    whose product with log2(e) (what the kernels multiply scores by) is finite in float32 too."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_positive_float(scale, "scale", maximum=MAX_SCALE)


@dataclass(frozen=True)
class Bias:
    array: Any  # NumPy or CuPy, 3-D [B|1, H|1, Nkv] or 4-D [B|1, H|1, Nq, Nkv]
    dtype: str


def check_bias(bias: Any, inp: Inputs) -> Optional[Bias]:
    """A vector bias [B|1, H|1, Nkv] or a matrix bias [B|1, H|1, Nq, Nkv] in fp16, bf16 or fp32."""
    if bias is None:
        return None
    bias = as_array(bias, "bias")
    dtype = BIAS_DTYPES.get(np.dtype(bias.dtype))
    if dtype is None:
        raise ArgumentError(f"bias must be float16, bfloat16 or float32, got dtype {bias.dtype}")
    if bias.ndim not in (3, 4):
        raise ArgumentError(f"bias must be [B|1, H|1, Nkv] or [B|1, H|1, Nq, Nkv], got shape {tuple(bias.shape)}")
    want = (inp.batch, inp.heads) + ((inp.q_len,) if bias.ndim == 4 else ()) + (inp.kv_len,)
    for dim, (got, full) in enumerate(zip(bias.shape, want)):
        if got != full and not (got == 1 and dim < len(want) - 1):
            raise ArgumentError(f"bias shape {tuple(bias.shape)} does not broadcast to {want} (dim {dim})")
    return Bias(bias, dtype)


def check_score_mod(score_mod: Any) -> Optional[expressions.CudaExpr]:
    if score_mod is None:
        return None
    expr = getattr(score_mod, "cuda", None)
    if not isinstance(expr, expressions.CudaExpr):
        raise ArgumentError("score_mod must come from omnicupy.score_mods (alibi, softcap, cuda_score), "
                            f"got {type(score_mod).__name__}")
    return expr


def check_mask_matches(bm: BlockMask, inp: Inputs) -> None:
    Bm, Hm, q_len, kv_len = bm.shape
    if q_len != inp.q_len or kv_len != inp.kv_len:
        raise MaskError(f"block_mask is for q_len={q_len}, kv_len={kv_len} but q/k have {inp.q_len}, {inp.kv_len}")
    if Bm not in (1, inp.batch):
        raise MaskError(f"block_mask batch dim ({Bm}) must be 1 or the batch size ({inp.batch})")
    if Hm not in (1, inp.heads):
        raise MaskError(f"block_mask head dim ({Hm}) must be 1 or the number of q heads ({inp.heads})")


def check_stages(stages: Any) -> None:
    if stages is not None and (isinstance(stages, (bool, np.bool_)) or not isinstance(stages, (int, np.integer))
                               or stages not in (1, 2)):
        raise ArgumentError(f"stages must be None, 1 or 2, got {stages!r}")


def check_bool(value: Any, name: str) -> bool:
    """A flag (return_lse, fuse_mask, ...): True or False, not any truthy object."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_expression_arrays(expr: Optional[expressions.CudaExpr], q_len: int, kv_len: int, heads: int,
                            batch: int) -> None:
    """Every lookup array of ``expr`` (a fused mask or a score modifier) covers the indices the kernel
    reads it at for a call of these sizes (see mask/expressions.py: subscripts name their axis, a
    computed index needs its declared extent or every axis); ExpressionError otherwise."""
    if expr is not None:
        expr.check_lengths(q_len=q_len, kv_len=kv_len, heads=heads, batch=batch)


def check_expressions(exprs: Sequence[Optional[expressions.CudaExpr]], inp: Inputs) -> None:
    """The expressions fused into one kernel: names that agree, lookup arrays that fit the
    kernel's slots, and arrays long enough for this call."""
    expressions.merge_names(*exprs)
    count = sum(len(e.array_decls) for e in exprs if e is not None)
    if count > MAX_USER_ARRAYS:
        raise ExpressionError(f"the fused expressions read {count} lookup arrays; a kernel has "
                              f"{MAX_USER_ARRAYS} slots")
    for e in exprs:
        check_expression_arrays(e, inp.q_len, inp.kv_len, inp.heads, inp.batch)


# ---------------------------------------------------------------- memory overlap of outputs
@dataclass(frozen=True)
class Span:
    """Where an array's bytes lie: its memory space ("host" or ("cuda", device)), the first and one
    past the last byte it can touch, and what np.shares_memory needs to decide exactly."""

    space: Any
    low: int
    high: int
    address: int
    shape: tuple
    strides: tuple
    itemsize: int


def memory_span(x: Any) -> Optional[Span]:
    """The Span of a NumPy or CuPy array (None when it has no elements)."""
    if x.size == 0:
        return None
    if arrays.is_numpy(x):
        space, address = "host", int(x.__array_interface__["data"][0])
    else:
        space, address = ("cuda", int(x.device.id)), int(x.data.ptr)
    shape, strides = tuple(int(n) for n in x.shape), tuple(int(s) for s in x.strides)
    low = address + sum(min(0, s * (n - 1)) for n, s in zip(shape, strides))
    high = address + sum(max(0, s * (n - 1)) for n, s in zip(shape, strides)) + x.itemsize
    return Span(space, low, high, address, shape, strides, x.itemsize)


class _AddressOnly:
    """An array interface at a given address, for np.shares_memory's arithmetic on strides and
    addresses (of device memory too); the memory itself is never read."""

    def __init__(self, span: Span) -> None:
        self.__array_interface__ = {"data": (span.address, True), "shape": span.shape, "strides": span.strides,
                                    "typestr": f"|V{span.itemsize}", "version": 3}


def spans_overlap(a: Span, b: Span) -> bool:
    """Whether two spans share a byte (exactly, for strided layouts; refusing when NumPy's solver
    gives up counts as sharing)."""
    if a.space != b.space or a.high <= b.low or b.high <= a.low:
        return False
    too_hard = getattr(np, "exceptions", np).TooHardError
    try:
        return bool(np.shares_memory(np.asarray(_AddressOnly(a)), np.asarray(_AddressOnly(b)),
                                     max_work=SHARES_MEMORY_WORK))
    except too_hard:
        return True


def self_overlapping(span: Span) -> bool:
    """Whether two elements of one array share bytes (a zero stride, or strides that interleave):
    true unless the dims, sorted by stride, each step over all the smaller ones."""
    reach = span.itemsize
    for n, s in sorted(((n, abs(s)) for n, s in zip(span.shape, span.strides) if n > 1), key=lambda d: d[1]):
        if s < reach:
            return True
        reach = s * (n - 1) + reach
    return False


def check_writable_buffer(x: Any, name: str) -> None:
    """An output buffer: writable (NumPy flags), each element at its own address."""
    if arrays.is_numpy(x) and not x.flags.writeable:
        raise AliasError(f"{name} is a read-only NumPy array; pass a writable buffer")
    span = memory_span(x)
    if span is not None and self_overlapping(span):
        raise AliasError(f"{name} has overlapping elements (strides {tuple(x.strides)} bytes for shape "
                         f"{tuple(x.shape)}): each output element needs its own memory")


def check_disjoint(outputs: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """No output shares memory with an input or with another output (None entries are skipped)."""
    outs = [(n, memory_span(x)) for n, x in outputs.items() if x is not None]
    ins = [(n, memory_span(x)) for n, x in inputs.items() if x is not None]
    for i, (name, span) in enumerate(outs):
        for other, other_span in ins + outs[i + 1:]:
            if span is not None and other_span is not None and spans_overlap(span, other_span):
                raise AliasError(f"{name} shares memory with {other}; outputs must not overlap the inputs or "
                                 f"each other")


def check_out(out: Any, inp: Inputs, name: str = "out", *, inputs: Optional[Mapping[str, Any]] = None):
    """Shape/dtype/layout checks of a user ``out`` (no GPU needed for NumPy): writable, each element
    its own memory, sharing none with q, k, v or the other ``inputs`` (e.g. {"bias": ...}; None
    entries skipped). Returns it as an array."""
    if out is None:
        return None
    shape = (inp.batch, inp.heads, inp.q_len, inp.head_dim)
    out = as_array(out, name)
    if tuple(out.shape) != shape or np.dtype(out.dtype) != np.dtype(inp.q.dtype):
        raise ArgumentError(f"{name} must have shape {shape} and dtype {inp.q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.strides[3] != out.itemsize:
        raise ArgumentError(f"{name} must be contiguous in its last dim; got strides {out.strides} bytes")
    check_writable_buffer(out, name)
    check_disjoint({name: out}, {"q": inp.q, "k": inp.k, "v": inp.v, **(inputs or {})})
    return out


def check_lse_buffer(lse: Any, inp: Inputs, out: Any = None, name: str = "lse"):
    """A caller's LSE buffer (the low-level call): contiguous float32 [B, Hq, Nq], writable, sharing no
    memory with q, k, v or ``out``; returned as an array."""
    if lse is None:
        return None
    lse = as_array(lse, name)
    shape = (inp.batch, inp.heads, inp.q_len)
    if tuple(lse.shape) != shape or np.dtype(lse.dtype) != np.float32 or not lse.flags.c_contiguous:
        raise ArgumentError(f"{name} must be a contiguous float32 array of shape {shape}, got {tuple(lse.shape)} "
                            f"{lse.dtype}")
    check_writable_buffer(lse, name)
    check_disjoint({name: lse}, {"q": inp.q, "k": inp.k, "v": inp.v, "out": out})
    return lse


def device_out(out: Any, inp: Inputs):
    """(device buffer the kernel writes, user object to copy into afterwards or None)."""
    cp = arrays.cupy_module()
    shape = (inp.batch, inp.heads, inp.q_len, inp.head_dim)
    if out is None:
        return cp.empty(shape, dtype=inp.q.dtype), None
    if arrays.is_numpy(out):
        return cp.empty(shape, dtype=inp.q.dtype), out
    check_device(out, "out")
    if not aligned(out):
        return cp.empty(shape, dtype=inp.q.dtype), out
    return out, None
