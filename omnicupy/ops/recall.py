"""The steady-state call: what a repeated ``attention()`` (or ``attention_backward()``) call skips.

The first call of a signature (shapes, strides, dtypes, mask, options, device, dispatch switches)
checks everything, plans and packs the kernel's parameter struct; it leaves a ``Recipe`` on the
BlockMask. A later call with the same signature only reads its arrays' pointers, allocates the
outputs, writes the pointers into the recipe's parameter buffer and launches (jit/launch.py): no
checks to redo (the signature fixes every value they looked at), no plan, no packing by name, no
synchronization.

Arrays are read without conversion: CuPy arrays by their attributes; torch tensors by theirs (no
import of torch: only when the object already is one) when they need no gradient and torch's
current stream is the one CuPy launches on; other CUDA arrays (JAX, ...) through
``__cuda_array_interface__`` when their stream is CuPy's. Anything else takes the general path,
whose DLPack exchange orders the streams.

The dispatch switches (OMNICUPY_MMA, OMNICUPY_SCHEDULE) are part of the key and read on every
call, from ``os.environ``'s own mapping (no decoding): a change through ``os.environ`` takes effect
on the next call, as on the general path. So are the decode's tunables (ops/decode.settings(),
added by the decode callers): a tunable changed between calls plans anew.

Knows arrays' layouts and struct offsets; decides nothing (ops/forward.py, ops/backward.py do).
"""
from __future__ import annotations

import functools
import operator
import os
import struct
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from ..dispatch.abi import ParamStruct
from ..dispatch.params import FORWARD
from ..dispatch.plan import Plan
from ..jit.launch import KernelLaunch, Launcher
from ..mask import BlockMask

#: The forward's per-call pointer fields: everything else in the struct is fixed by the call's signature.
POINTER_FIELDS = ("q", "k", "v", "o", "lse")
_POINTER = struct.Struct("<Q")
#: Recipes one RecipeStore keeps (each BlockMask's, paged_attention()'s).
MAX_RECIPES = 64
#: Environment switches that change the plan; read raw per call (parsed on the general path).
SWITCHES = ("OMNICUPY_MMA", "OMNICUPY_SCHEDULE")
_TYPESTRS = {"<f2": np.dtype(np.float16), "<f4": np.dtype(np.float32)}

# os.environ keeps its values in a dict of encoded keys and values; reading that dict skips the
# encode/decode of os.environ.get (1.4 us for two reads -> 0.05 us, benchmarks/bench_overhead.py --cpu).
# Equal raw values mean equal decoded ones, which is all a key needs.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(name) for name in SWITCHES) if _ENV_DATA is not None \
    and hasattr(os.environ, "encodekey") else None


def switches() -> tuple:
    """The raw values of the dispatch switches now (None where unset)."""
    if _ENV_KEYS is not None and getattr(os.environ, "_data", None) is _ENV_DATA:
        return tuple(map(_ENV_DATA.get, _ENV_KEYS))
    return tuple(map(os.environ.get, SWITCHES))


class PointerSlots:
    """Writes a call's data pointers at their struct offsets, one ``pack_into`` per contiguous run."""

    __slots__ = ("offsets", "_runs", "_single")

    def __init__(self, offsets: Iterable[int]) -> None:
        self.offsets = tuple(offsets)
        runs, start = [], 0
        for i in range(1, len(self.offsets) + 1):
            if i == len(self.offsets) or self.offsets[i] != self.offsets[i - 1] + 8:
                runs.append((self.offsets[start], struct.Struct(f"<{i - start}Q"), start, i))
                start = i
        self._runs = tuple(runs)
        self._single = runs[0][:2] if len(runs) == 1 else None

    def write(self, buf: Any, pointers: Sequence[int]) -> None:
        if self._single is not None:
            at, packer = self._single
            packer.pack_into(buf, at, *pointers)
            return
        for at, packer, lo, hi in self._runs:
            packer.pack_into(buf, at, *pointers[lo:hi])


def _kept(fields: dict, pointer_fields: Sequence[str]) -> tuple:
    """The arrays a packed struct points at (metadata, bias, expression tables): kept alive with it."""
    keep = []
    for name, value in fields.items():
        if name in pointer_fields:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        keep.extend(item for item in items if hasattr(item, "data"))
    return tuple(keep)


@dataclass(frozen=True)
class Recipe:
    """A launch with everything but the per-call data pointers decided."""

    plan: Plan
    launcher: Launcher
    slots: PointerSlots  # where the per-call pointers go in the struct
    keep: tuple  # what the struct points at (metadata, bias, expression tables), kept alive
    params: ParamStruct = FORWARD
    #: tma family: writes the tensor maps of the call's q, k, v pointers (ops/tma.MapWriter)
    maps: Optional[Callable[[Any, tuple], None]] = None
    #: backward: bytes and layout of the per-call workspace (ops/backward.py); None for the forward
    workspace: Any = None

    @classmethod
    def make(cls, kernel, plan: Plan, fields: dict, params: ParamStruct = FORWARD, maps=None, *,
             pointer_fields: Sequence[str] = POINTER_FIELDS, launches: Optional[Sequence[KernelLaunch]] = None,
             workspace: Any = None) -> "Recipe":
        """From the first call's fields (by name): the struct with its per-call pointers zeroed, and
        the kernels to launch (default: ``kernel`` with the plan's geometry)."""
        fixed = dict(fields, **{name: None for name in pointer_fields})
        template = bytes(params.pack(fixed))
        if launches is None:
            launches = [KernelLaunch(kernel, plan.grid, plan.block, plan.smem_bytes)]
        return cls(plan, Launcher(template, launches), PointerSlots(params.offset(n) for n in pointer_fields),
                   _kept(fields, pointer_fields), params, maps, workspace)

    @property
    def template(self) -> bytes:
        return self.launcher.template

    @property
    def kernel(self) -> Any:
        """The (first) kernel the recipe launches."""
        return self.launcher.launches[0].kernel

    def launch(self, *pointers: int) -> None:
        """Write ``pointers`` (in the recipe's pointer-field order) and launch on the current stream."""
        launcher = self.launcher
        slot = launcher.slot()
        self.slots.write(slot.view, pointers)
        if self.maps is not None:
            self.maps(slot.view, pointers)
        launcher.fire(slot)


#: Allocations a graph captured on some stream may still use (hold_if_capturing).
CAPTURED: list = []
_captured_lock = threading.Lock()


def hold_if_capturing(memory: Any, stream: Any) -> None:
    """Keep ``memory`` (per-call scratch) for the life of the process when ``stream`` is being captured
    into a CUDA graph: every replay uses the captured addresses, which must not go back to the pool."""
    if stream.is_capturing():
        with _captured_lock:
            CAPTURED.append(memory)


def release_captured() -> int:
    """Drop the scratch kept for captured graphs (call once no such graph replays any more); returns
    how many allocations there were."""
    with _captured_lock:
        count = len(CAPTURED)
        CAPTURED.clear()
    return count


#: Fields a recorded chain takes from the call (ChainRecipe); anything else is fixed or scratch.
CALL_FIELDS = ("q", "k", "v", "o", "lse", "kv_lens", "page_table")
SCRATCH_ALIGN = 256


@dataclass(frozen=True)
class ChainRecipe:
    """Several launches recorded from a first call (the decode's split kernel and combine, each with
    its own struct), replayed with the call's pointers (CALL_FIELDS, by name) and per-call scratch
    buffers (one allocation, its parts at the same offsets in every struct that names them)."""

    steps: tuple  # (Launcher, PointerSlots, field names) per launch, in order
    scratch: tuple  # (field name, byte offset) in the per-call allocation
    scratch_bytes: int
    keep: tuple

    @classmethod
    def from_record(cls, record: Sequence[tuple], call_pointers: dict, scratch_fields: Sequence[str]
                    ) -> Optional["ChainRecipe"]:
        """From ``(KernelLaunch, struct, fields)`` per launch (ops/decode.py's record). ``call_pointers``:
        the first call's pointer of each CALL_FIELDS name it passed (None: absent). None when a
        recorded field does not hold the call's array (a copy was made): such a call cannot be replayed."""
        steps, scratch, keep, at = [], {}, [], 0
        for item, params, fields in record:
            names = []
            for p in params.params:
                value = fields.get(p.name)
                if p.kind != "ptr" or value is None:
                    continue
                if p.name in CALL_FIELDS:
                    if call_pointers.get(p.name) != getattr(getattr(value, "data", None), "ptr", None):
                        return None
                    names.append(p.name)
                elif p.name in scratch_fields:
                    if p.name not in scratch:
                        scratch[p.name] = at
                        at += -(-int(value.nbytes) // SCRATCH_ALIGN) * SCRATCH_ALIGN
                    names.append(p.name)
            fixed = dict(fields, **{name: None for name in names})
            launcher = Launcher(bytes(params.pack(fixed)), [item])
            steps.append((launcher, PointerSlots(params.offset(n) for n in names), tuple(names)))
            keep.extend(_kept(fields, names))
        return cls(tuple(steps), tuple(scratch.items()), at, tuple(keep))

    def launch(self, cp, pointers: dict) -> None:
        """Launch every step with the call's ``pointers`` (CALL_FIELDS name -> pointer, 0 for none)."""
        memory = None
        if self.scratch:
            memory = cp.cuda.alloc(self.scratch_bytes)
            pointers = dict(pointers, **{name: memory.ptr + off for name, off in self.scratch})
            hold_if_capturing(memory, cp.cuda.get_current_stream())
        for launcher, slots, names in self.steps:
            slot = launcher.slot()  # this thread's buffer, looked up once per step (as Recipe.launch)
            slots.write(slot.view, [pointers[n] for n in names])
            launcher.fire(slot)
        del memory  # back to CuPy's pool, reusable by later work on this stream only


# ------------------------------------------------------------------------------------- views
def view(x: Any, cp) -> Optional[tuple]:
    """(pointer, shape, strides in bytes, dtype, device) of a CUDA array, read without conversion,
    or None when that takes the general path (NumPy, another stream, a tensor that needs a
    gradient, anything unusual)."""
    if type(x) is cp.ndarray:
        data = x.data
        return data.ptr, x.shape, x.strides, x.dtype, data.device_id
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_view(x, torch, cp)
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


_torch_dtypes: dict = {}


def _torch_view(x: Any, torch: Any, cp) -> Optional[tuple]:
    """A torch tensor's view, read from its attributes (the general path takes it through DLPack,
    which also orders torch's current stream before CuPy's: here the two must be the same stream)."""
    if x.requires_grad or not x.is_cuda:
        return None
    if not _torch_dtypes:
        from .. import arrays

        _torch_dtypes.update({torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32)})
        if arrays.BFLOAT16 is not None:
            _torch_dtypes[torch.bfloat16] = arrays.BFLOAT16
    dtype = _torch_dtypes.get(x.dtype)
    if dtype is None:
        return None
    device = x.get_device()
    if _torch_stream(torch, device) != cp.cuda.get_current_stream().ptr:
        return None
    item = dtype.itemsize
    return x.data_ptr(), tuple(x.shape), tuple([s * item for s in x.stride()]), dtype, device


def _torch_stream(torch: Any, device: int) -> int:
    """torch's current stream on ``device`` as a raw pointer (0: the legacy default stream)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def _stream_token(cp) -> int:
    """How the array interface names CuPy's current stream: its pointer, or 1 for the legacy default."""
    ptr = cp.cuda.get_current_stream().ptr
    return ptr if ptr else 1


def signature(views, extras: tuple) -> tuple:
    """The key of a call: the arrays' layouts (not their pointers), the other arguments, the device
    and the dispatch switches."""
    return (*map(_LAYOUT, views), *extras, *switches())


#: A view's layout: everything but its pointer (C-level slicing: 0.3 us less per key than a comprehension).
_LAYOUT = operator.itemgetter(slice(1, None))


def _same_device(views, cp) -> Optional[int]:
    """The device of every view when they agree and it is the current one, else None."""
    dev = views[0][4]
    for vw in views:
        if vw[4] != dev:
            return None
    return dev if dev == cp.cuda.runtime.getDevice() else None


def launch_if_known(bm: BlockMask, key: tuple, qkv, out_view, return_lse: bool, cp, kv_lens_view=None):
    """Launch from the mask's recipe for ``key``; None when there is none or the pointers do not
    allow it (misaligned, on another device): then the general path runs."""
    recipe = recipe_for(bm, key)
    if recipe is None:
        return None
    qv, kv, vv = qkv
    qp, kp, vp, dev = qv[0], kv[0], vv[0], qv[4]
    if (qp | kp | vp) % 16 or kv[4] != dev or vv[4] != dev or dev != cp.cuda.runtime.getDevice():
        return None
    shape, dtype = qv[1], qv[3]
    if out_view is None:
        o = cp.ndarray(shape, dtype)
        op = o.data.ptr
    else:
        o, ov = out_view
        op, odev = ov[0], ov[4]
        if op % 16 or odev != dev or overlaps(ov, qkv):  # the general path says what is wrong
            return None
    lse = cp.ndarray(shape[:3], np.float32) if return_lse else None
    lp = 0 if lse is None else lse.data.ptr
    if type(recipe) is ChainRecipe:
        if kv_lens_view is not None and kv_lens_view[4] != dev:
            return None
        recipe.launch(cp, {"q": qp, "k": kp, "v": vp, "o": op, "lse": lp,
                           "kv_lens": 0 if kv_lens_view is None else kv_lens_view[0]})
    else:
        recipe.launch(qp, kp, vp, op, lp)
    return (o, lse) if return_lse else o


@functools.lru_cache(maxsize=256)
def _extent(shape: tuple, strides: tuple, itemsize: int) -> tuple[int, int]:
    """[lowest, highest) byte offsets an array of this layout touches, from its pointer."""
    if 0 in shape:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return low, high + itemsize


def overlaps(view: tuple, others: Sequence[tuple]) -> bool:
    """Whether the memory spans of ``view`` and any of ``others`` intersect (views as from ``view()``)."""
    ptr, shape, strides, dtype, _ = view
    lo, hi = _extent(shape, strides, dtype.itemsize)
    lo, hi = ptr + lo, ptr + hi
    for optr, oshape, ostrides, odtype, _ in others:
        olo, ohi = _extent(oshape, ostrides, odtype.itemsize)
        if optr + olo < hi and lo < optr + ohi:
            return True
    return False


class RecipeStore:
    """Steady-state recipes by call signature, at most ``limit`` of them: when full, the store is
    cleared before a new signature goes in, so that a workload of ever-new signatures plans again
    instead of keeping every launch (and the arrays its struct points at) alive. A key that cannot
    be hashed is never stored nor found: the general path says what is wrong with such a call.
    One per BlockMask (made with its first recipe, store_of: the recipes go with the mask) and one
    for paged_attention(), which has no mask to keep them on."""

    __slots__ = ("limit", "_recipes")

    def __init__(self, limit: int = MAX_RECIPES) -> None:
        self.limit = limit
        self._recipes: dict = {}

    def get(self, key: Any) -> Optional[Any]:
        try:
            return self._recipes.get(key)
        except TypeError:
            return None

    def put(self, key: Any, recipe: Any) -> None:
        try:
            known = key in self._recipes
        except TypeError:
            return
        if not known and len(self._recipes) >= self.limit:
            self._recipes.clear()
        self._recipes[key] = recipe

    def clear(self) -> None:
        self._recipes.clear()

    def __len__(self) -> int:
        return len(self._recipes)

    def __iter__(self):
        return iter(self._recipes)

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def values(self):
        return self._recipes.values()


def store_of(bm: BlockMask) -> RecipeStore:
    """The mask's recipe store, made on first use (the mask module knows nothing of recipes)."""
    store = bm._recipes
    if store is None:
        store = bm._recipes = RecipeStore()
    return store


def recipe_for(bm: BlockMask, key: Optional[tuple]) -> Optional[Recipe]:
    """The mask's recipe for ``key``, or None (also for an unhashable key)."""
    store = bm._recipes
    if store is None or key is None:
        return None
    return store.get(key)


def remember(bm: BlockMask, key: Optional[tuple], recipe: Recipe, *alive: Any) -> None:
    """Keep ``recipe`` for ``key`` on the mask; ``alive``: objects the key names by identity."""
    if key is not None:
        store_of(bm).put(key, replace(recipe, keep=recipe.keep + alive))


__all__ = ["CALL_FIELDS", "ChainRecipe", "MAX_RECIPES", "POINTER_FIELDS", "PointerSlots", "Recipe", "RecipeStore",
           "SWITCHES", "hold_if_capturing", "launch_if_known", "overlaps", "recipe_for", "release_captured", "remember",
           "signature", "store_of", "switches", "view"]
