"""TMA tensor maps for the tma forward family and the warp-specialized backward, and whether a
call's inputs allow them.

The tma kernels (templates/attention_fwd_tma.cu.jinja) load q, k and v with TMA (the
warp-specialized backward, kernels/bwd_ws.cuh, q and dout), which reads a
tensor through a tensor map: a 128-byte descriptor that the CUDA driver encodes on the host
(``cuTensorMapEncodeTiled``, called through NVIDIA's ``cuda-bindings``; no hand-written driver
prototypes). Each input is described as the rank-4 tensor (D, N, H, B), innermost first, with its
own byte strides, and read in boxes of (64 columns, br or bc rows, 1, 1) into the 128-byte swizzled
layout of kernels/wgmma.cuh; rows past the sequence's end come back as zeros.

A map holds the tensor's address, so it is encoded per (pointer, shape, strides, dtype, box) and
cached: a steady-state call on the same buffers encodes nothing. What TMA cannot express (no
cuda-bindings, strides that are not positive multiples of 16 bytes, a base not 16-byte aligned)
is reported by ``unusable()``; the forward then plans the wgmma family instead, and the backward
copies Q and dO with cp.async in the same kernel (``tma_loads`` 0).

Knows the tma family's boxes and the driver's encode call; nothing of masks or launches.
"""
from __future__ import annotations

import functools
import logging
import operator
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import arrays
from ..dispatch.abi import ParamStruct
from ..dispatch.params import FORWARD_TMA
from ..dispatch.variant import Variant
from ..errors import OmnicupyError

_log = logging.getLogger("omnicupy")

#: TMA's limits (CUDA driver API, cuTensorMapEncodeTiled).
STRIDE_ALIGN = 16  # bytes: every stride but the innermost, and the base address
MAX_STRIDE = 1 << 40  # bytes
MAX_DIM = 1 << 32  # elements per dimension
BOX_COLS = 64  # 128 bytes of 16-bit elements: one swizzle row
MAP_BYTES = 128

#: Encoded maps kept per process (each entry 128 bytes plus its key).
CACHE_SIZE = 1024


class TmaError(OmnicupyError, RuntimeError):
    """The driver refused to encode a tensor map (the call falls back to the wgmma family)."""


@functools.lru_cache(maxsize=1)
def _driver() -> Optional[Any]:
    """``cuda.bindings.driver``, imported on first use; None (logged once) when it is not installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        _log.warning("omnicupy: TMA tensor maps need NVIDIA's cuda-bindings (pip install cuda-bindings); "
                     "the forward uses the wgmma family instead, the backward cp.async copies")
        return None
    try:  # already initialised by CuPy's runtime in practice; cheap and idempotent
        err, = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - no driver library (a CPU-only machine)
        err = exc
    if not isinstance(err, driver.CUresult) or int(err) != 0:
        _log.warning(f"omnicupy: the CUDA driver is not usable for tensor maps ({err}); the forward uses the "
                     "wgmma family, the backward cp.async copies")
        return None
    return driver


def available() -> bool:
    """Whether tensor maps can be encoded in this process (cuda-bindings importable, driver up)."""
    return _driver() is not None


@dataclass(frozen=True)
class TensorLayout:
    """One input as TMA sees it: (D, N, H, B) innermost first, strides in bytes of N, H, B."""

    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    dtype: str  # "fp16" or "bf16"

    @classmethod
    def of(cls, x: Any, dtype: str) -> "TensorLayout":
        B, H, N, D = (int(n) for n in x.shape)
        sb, sh, sn = (int(s) for s in x.strides[:3])
        return cls((D, N, H, B), (sn, sh, sb), dtype)

    def problem(self) -> Optional[str]:
        """Why TMA cannot address this tensor, or None."""
        if any(n >= MAX_DIM for n in self.dims):
            return f"a dimension of {max(self.dims)} elements (TMA: below 2^32)"
        for name, stride, extent in zip(("sequence", "head", "batch"), self.strides, self.dims[1:]):
            if extent == 1:
                continue  # never stepped over: encoded with a stand-in stride
            if stride <= 0 or stride % STRIDE_ALIGN or stride >= MAX_STRIDE:
                return f"{name} stride of {stride} bytes (TMA: positive multiples of {STRIDE_ALIGN} below 2^40)"
        return None

    def encoding_strides(self) -> tuple[int, int, int]:
        """The strides handed to the driver: a dimension of extent 1 is never stepped over, so its
        stride (anything for a broadcast or squeezed view) becomes that of a dense tensor."""
        out, dense = [], self.dims[0] * 2
        for stride, extent in zip(self.strides, self.dims[1:]):
            dense_aligned = -(-dense // STRIDE_ALIGN) * STRIDE_ALIGN
            out.append(stride if extent > 1 else dense_aligned)
            dense = (stride if extent > 1 else dense_aligned) * extent
        return tuple(out)


def unusable(variant: Variant, tensors: dict[str, Any], dtype: str, need_driver: bool = True) -> Optional[str]:
    """Why TMA cannot read these inputs ({name: array}: q, k, v for the tma forward; q, dout for the
    warp-specialized backward), or None. ``need_driver`` False: planning for another machine, whose
    driver and cuda-bindings are assumed (ops/forward.py TARGET_ASSUMES)."""
    if variant.head_dim % BOX_COLS:
        return f"head_dim {variant.head_dim} is not a multiple of {BOX_COLS}"
    for name, x in tensors.items():
        problem = TensorLayout.of(x, dtype).problem()
        if problem is not None:
            return f"{name} has a {problem}"
        ptr = x.data.ptr if arrays.is_cupy(x) else None  # host arrays: copied aligned before the launch
        if ptr is not None and ptr % STRIDE_ALIGN:
            return f"{name} starts at an address that is not {STRIDE_ALIGN}-byte aligned"
    if need_driver and not available():
        return "cuda-bindings is not installed"
    return None


@functools.lru_cache(maxsize=CACHE_SIZE)
def encode(ptr: int, layout: TensorLayout, box_rows: int) -> bytes:
    """The 128-byte tensor map of ``layout`` at device address ``ptr``, read in boxes of
    (64, box_rows, 1, 1) with the 128-byte swizzle. Cached: the same buffer encodes once."""
    drv = _driver()
    if drv is None:
        raise TmaError("cuda-bindings is not installed: no tensor maps")
    dtype = {"fp16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             "bf16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[layout.dtype]
    err, tensor_map = drv.cuTensorMapEncodeTiled(
        dtype, 4, ptr,
        [drv.cuuint64_t(n) for n in layout.dims],
        [drv.cuuint64_t(s) for s in layout.encoding_strides()],
        [drv.cuuint32_t(n) for n in (BOX_COLS, box_rows, 1, 1)],
        [drv.cuuint32_t(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        # 256-byte L2 promotion: a box row is 128 bytes, and K/V rows of one tile are read together.
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,  # zeros past the ends
    )
    if int(err) != 0:
        raise TmaError(f"cuTensorMapEncodeTiled failed ({err}) for {layout} at {ptr:#x}, box rows {box_rows}")
    return struct.pack("<16Q", *(int(w) for w in tensor_map.opaque))


@dataclass(frozen=True)
class MapWriter:
    """The tensor-map fields of one call signature: the inputs' layouts and boxes are fixed; the maps
    follow the data pointers (encoded once per pointer, ``encode``'s cache). A steady-state call
    writes its maps as one copy, looked up by their pointers alone: hashing the layouts for
    ``encode``'s cache on every call cost more than the rest of the write.

    ``names``: the map fields, adjacent in the struct (one slice of the packed struct, from byte
    ``start``, holds them); ``key``: picks the inputs' pointers out of the pointers a recipe launches
    with (an ``operator.itemgetter``: a steady-state call does no Python-level loop here)."""

    names: tuple[str, ...]
    layouts: tuple[TensorLayout, ...]
    boxes: tuple[int, ...]
    key: Callable[[tuple], tuple]
    start: int
    #: pointers -> the maps' bytes in field order; cleared when it reaches WRITER_CACHE_SIZE
    _blobs: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def make(cls, variant: Variant, q: Any, k: Any, v: Any, dtype: str) -> "MapWriter":
        """The tma forward's q, k, v maps (FwdTmaParams; pointers q, k, v first)."""
        return cls.of(FORWARD_TMA, ("q_map", "k_map", "v_map"), (q, k, v), (variant.br, variant.bc, variant.bc),
                      (0, 1, 2), dtype)

    @classmethod
    def of(cls, params: ParamStruct, names: tuple[str, ...], tensors: tuple, boxes: tuple[int, ...],
           positions: tuple[int, ...], dtype: str) -> "MapWriter":
        start = params.offset(names[0])
        if [params.offset(n) for n in names] != list(range(start, start + len(names) * MAP_BYTES, MAP_BYTES)):
            raise TmaError(f"{params.name}: the tensor maps {names} must be adjacent fields")
        if len(positions) < 2:
            raise TmaError("a MapWriter writes two maps or more (itemgetter of one position returns no tuple)")
        return cls(tuple(names), tuple(TensorLayout.of(x, dtype) for x in tensors), tuple(boxes),
                   operator.itemgetter(*positions), start)

    def fields(self, *pointers: int) -> dict[str, bytes]:
        """{map field: its bytes} for these data pointers (one per input, in ``names``' order)."""
        return {name: encode(ptr, layout, box)
                for name, ptr, layout, box in zip(self.names, pointers, self.layouts, self.boxes)}

    def __call__(self, buf: Any, pointers: tuple[int, ...]) -> None:
        """Writes the maps of a launch's pointers (all of them, in the recipe's order) into the
        packed struct ``buf``."""
        key = self.key(pointers)
        blob = self._blobs.get(key)
        if blob is None:
            if len(self._blobs) >= WRITER_CACHE_SIZE:
                self._blobs.clear()
            blob = self._blobs[key] = b"".join(self.fields(*key).values())
        buf[self.start:self.start + len(blob)] = blob


#: Pointer tuples kept per MapWriter (one call signature); each entry 128 bytes per map plus its key.
WRITER_CACHE_SIZE = 64

__all__ = ["MapWriter", "TensorLayout", "TmaError", "available", "encode", "unusable"]
