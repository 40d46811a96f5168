"""The steady-state call: what a repeated ``attention()`` call skips.

The first call of a signature (shapes, strides, dtypes, mask, options, device, dispatch switches)
checks everything, plans and packs the kernel's parameter struct; it leaves a ``Recipe`` on the
BlockMask. A later call with the same signature only reads its arrays' pointers, allocates the
output and launches: no checks to redo (the signature fixes every value they looked at), no plan,
no packing by name, no synchronization. Arrays are read without conversion: CuPy arrays by their
attributes, other CUDA arrays (torch, JAX) through ``__cuda_array_interface__`` when their stream
is the one CuPy launches on (else the general path, whose DLPack exchange orders the streams).

Knows arrays' layouts and the forward's struct offsets; decides nothing (ops/forward.py does).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np

from ..dispatch.abi import ParamStruct
from ..dispatch.params import FORWARD
from ..dispatch.plan import Plan
from ..mask import BlockMask

#: The per-call pointer fields: everything else in the struct is fixed by the call's signature.
POINTER_FIELDS = ("q", "k", "v", "o", "lse")
_POINTER = struct.Struct("<Q")
#: Recipes kept per mask (on the BlockMask object, so they go with it).
MAX_RECIPES_PER_MASK = 64
#: Environment switches that change the plan; read raw per call (parsed on the general path).
SWITCHES = ("OMNICUPY_MMA", "OMNICUPY_SCHEDULE")
_TYPESTRS = {"<f2": np.dtype(np.float16), "<f4": np.dtype(np.float32)}


@dataclass(frozen=True)
class Recipe:
    """A launch with everything but the five data pointers decided."""

    kernel: Any
    plan: Plan
    template: bytes
    slots: tuple[int, ...]  # byte offsets of q, k, v, o, lse in the struct
    keep: tuple  # what the struct points at (metadata, bias, expression tables), kept alive
    params: ParamStruct = FORWARD
    #: tma family: writes the tensor maps of the call's q, k, v pointers (ops/tma.MapWriter)
    maps: Optional[Callable[[bytearray, tuple], None]] = None

    @classmethod
    def make(cls, kernel, plan: Plan, fields: dict, params: ParamStruct = FORWARD, maps=None) -> "Recipe":
        fixed = dict(fields, **{name: None for name in POINTER_FIELDS})
        keep = tuple(v for k, v in fields.items() if k not in POINTER_FIELDS and hasattr(v, "data"))
        return cls(kernel, plan, bytes(params.pack(fixed)), tuple(params.offset(n) for n in POINTER_FIELDS), keep,
                   params, maps)

    def launch(self, *pointers: int) -> None:
        buf = bytearray(self.template)
        for offset, ptr in zip(self.slots, pointers):
            _POINTER.pack_into(buf, offset, ptr)
        if self.maps is not None:
            self.maps(buf, pointers)
        plan = self.plan
        self.kernel(plan.grid, plan.block, (np.frombuffer(buf, dtype=self.params.record_dtype)[0],),
                    shared_mem=plan.smem_bytes)


def view(x: Any, cp) -> Optional[tuple]:
    """(pointer, shape, strides in bytes, dtype, device) of a CUDA array, read without conversion,
    or None when that takes the general path (NumPy, bf16 through the array interface, another
    stream, anything unusual)."""
    if type(x) is cp.ndarray:
        return x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id
    try:
        cai = x.__cuda_array_interface__
    except Exception:  # noqa: BLE001 - no interface, or one that cannot describe the dtype (bf16)
        return None
    dtype = _TYPESTRS.get(cai.get("typestr"))
    stream = cai.get("stream")
    if dtype is None or cai.get("mask") is not None or (stream is not None and stream != _stream_token(cp)):
        return None
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
    ptr = cai["data"][0]
    return ptr, shape, tuple(strides), dtype, cp.cuda.runtime.pointerGetAttributes(ptr).device


def _stream_token(cp) -> int:
    """How the array interface names CuPy's current stream: its pointer, or 1 for the legacy default."""
    ptr = cp.cuda.get_current_stream().ptr
    return ptr if ptr else 1


def signature(views, extras: tuple) -> tuple:
    """The key of a call: the arrays' layouts (not their pointers), the other arguments, the device
    and the dispatch switches."""
    environ = os.environ
    return (*(v[1:] for v in views), *extras, *(environ.get(name) for name in SWITCHES))


def launch_if_known(bm: BlockMask, key: tuple, qkv, out_view, return_lse: bool, cp):
    """Launch from the mask's recipe for ``key``; None when there is none or the pointers do not
    allow it (misaligned, on another device): then the general path runs."""
    try:
        recipe = bm._recipes.get(key)
    except TypeError:  # an unhashable argument: the general path says what is wrong
        return None
    if recipe is None:
        return None
    (qp, shape, _, dtype, dev), (kp, *_, kdev), (vp, *_, vdev) = qkv
    if (qp | kp | vp) % 16 or kdev != dev or vdev != dev or dev != cp.cuda.runtime.getDevice():
        return None
    if out_view is None:
        o = cp.empty(shape, dtype=dtype)
        op = o.data.ptr
    else:
        o, (op, *_, odev) = out_view
        if op % 16 or odev != dev:
            return None
    lse = cp.empty(shape[:3], dtype=np.float32) if return_lse else None
    recipe.launch(qp, kp, vp, op, 0 if lse is None else lse.data.ptr)
    return (o, lse) if return_lse else o


def remember(bm: BlockMask, key: Optional[tuple], recipe: Recipe, *alive: Any) -> None:
    """Keep ``recipe`` for ``key`` on the mask; ``alive``: objects the key names by identity."""
    if key is None:
        return
    try:
        hash(key)
    except TypeError:
        return
    if len(bm._recipes) >= MAX_RECIPES_PER_MASK:
        bm._recipes.clear()
    bm._recipes[key] = replace(recipe, keep=recipe.keep + alive)


__all__ = ["Recipe", "view", "signature", "launch_if_known", "remember", "POINTER_FIELDS"]
