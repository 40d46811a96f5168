"""``paged_attention()``: attention of a few queries per sequence against a paged KV cache.

The cache is a pool of pages, ``[num_pages, page_size, Hkv, D]`` ("NHD", as vLLM and FlashInfer
store them) or ``[num_pages, Hkv, page_size, D]`` ("HND"); sequence b owns the pages listed in
``page_table[b]`` (int32 ``[B, max_pages]``) and holds ``kv_lens[b]`` keys, key j on page
``page_table[b, j // page_size]`` at slot ``j % page_size``. The queries are the last Nq positions
of each sequence (bottom-right), so query i of sequence b sits at ``pos = kv_lens[b] - Nq + i``.

This module checks the call (shapes, dtypes, the page table against the pool and kv_lens) and
hands it to the split-KV decode kernel (ops/decode.py) with the page table as its address map.
Table entries past a sequence's last page are never read, so they may hold anything (padding).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import numpy as np

from .. import arrays
from ..checks import check_int
from ..dispatch.variant import check_head_dim
from ..errors import ArgumentError, KVCacheError
from . import decode, recall
from .arg_checks import check_flags, check_outputs, require_gpu_for, steady_state_possible
from .inputs import aligned, as_array, check_device, check_layout, check_scale, check_score_mod, require_gpu, to_device

LAYOUTS = ("NHD", "HND")
MAX_CAPACITY = 2**31 - 1
#: Steady-state launches of ``paged_attention(validate=False)`` per call signature (ops/recall.py):
#: there is no BlockMask to keep them on.
_recipes = recall.RecipeStore()


def _check_pages(k_pages: Any, v_pages: Any, q: Any, layout: str) -> tuple[Any, Any, int, int, int]:
    """(k, v, num_pages, page_size, kv_heads) after shape/dtype/layout checks."""
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ka, va = as_array(k_pages, "k_pages"), as_array(v_pages, "v_pages")
    for name, x in (("k_pages", ka), ("v_pages", va)):
        if x.ndim != 4:
            want = "[num_pages, page_size, Hkv, D]" if layout == "NHD" else "[num_pages, Hkv, page_size, D]"
            raise ArgumentError(f"{name} must be 4-D {want} (layout {layout!r}), got shape {tuple(x.shape)}")
        check_layout(x, name)
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise ArgumentError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if ka.shape != va.shape:
        raise ArgumentError(f"k_pages and v_pages must have the same shape, got {tuple(ka.shape)} and {tuple(va.shape)}")
    if layout == "NHD":
        num_pages, page_size, kv_heads, dim = (int(n) for n in ka.shape)
    else:
        num_pages, kv_heads, page_size, dim = (int(n) for n in ka.shape)
    if dim != q.shape[3]:
        raise ArgumentError(f"k_pages head_dim ({dim}) must equal q head_dim ({q.shape[3]})")
    if q.shape[1] % kv_heads:
        raise ArgumentError(f"q heads ({q.shape[1]}) must be a multiple of the cache's kv heads ({kv_heads}) (GQA/MQA)")
    return ka, va, num_pages, page_size, kv_heads


def _check_table(page_table: Any, batch: int):
    t = arrays.as_array(page_table, "page_table")
    if t.ndim != 2 or t.shape[0] != batch or t.shape[1] < 1:
        raise ArgumentError(f"page_table must be an integer array [B={batch}, max_pages >= 1], got shape {tuple(t.shape)}")
    if np.dtype(t.dtype).kind not in "iu":
        raise ArgumentError(f"page_table must be an integer array (int32), got dtype {t.dtype}")
    if arrays.is_numpy(t):
        if t.size and (int(t.min()) < np.iinfo(np.int32).min or int(t.max()) > np.iinfo(np.int32).max):
            raise KVCacheError("page_table has values outside the int32 range")
        return t.astype(np.int32, copy=False)
    if t.dtype != np.int32:
        raise ArgumentError(f"page_table on the device must be int32 (no hidden copies), got {t.dtype}")
    return t


def check_cache_metadata(page_table: Any, kv_lens: Any, page_size: int, num_pages: int) -> None:
    """Every page a sequence uses (the first ceil(kv_lens[b] / page_size) of its row) must lie in
    [0, num_pages), and kv_lens in [0, max_pages * page_size]. Runs where the arrays live: on the
    device, one reduction and one small copy back (a synchronization). Raises KVCacheError."""
    xp = arrays.array_namespace(page_table)
    if xp is not arrays.array_namespace(kv_lens):
        kv_lens = xp.asarray(arrays.to_numpy(kv_lens)) if xp is np else xp.asarray(kv_lens)
    capacity = int(page_table.shape[1]) * page_size
    lens = kv_lens.astype(np.int64)
    pages_used = (xp.clip(lens, 0, capacity) + page_size - 1) // page_size
    used = xp.arange(page_table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    flags = xp.stack([xp.any((lens < 0) | (lens > capacity)), xp.any(bad)])
    bad_len, bad_page = (bool(f) for f in arrays.to_numpy(flags))
    if bad_len:
        raise KVCacheError(f"kv_lens must lie in [0, {capacity}] (max_pages * page_size)")
    if bad_page:
        b, e = (int(i) for i in arrays.to_numpy(xp.argwhere(bad)[0]))
        raise KVCacheError(f"page_table[{b}, {e}] = {int(page_table[b, e])} is outside the page pool [0, {num_pages}) "
                           f"and sequence {b} uses that page")


def paged_attention(q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lens: Any, *, causal: bool = True,
                    window: Optional[int] = None, scale: Optional[float] = None, score_mod: Any = None,
                    return_lse: bool = False, out: Any = None, layout: str = "NHD", num_splits: Optional[int] = None,
                    validate: bool = True):
    """Attention of q ``[B, Hq, Nq, D]`` against a paged KV cache (module docstring for the layout).

    The queries are the last Nq positions of each sequence: with ``causal`` query i of sequence b
    (position ``pos = kv_lens[b] - Nq + i``) sees keys ``j <= pos``; ``window=W`` keeps only its last
    W keys (``j > pos - W``); pages wholly outside are never read. ``score_mod`` (omnicupy.score_mods)
    sees ``q_idx = pos`` and ``kv_idx = j``. A query with no key (``kv_lens[b] = 0``, or
    ``kv_lens[b] < Nq`` with causal) gets zeros and LSE -inf. ``num_splits`` overrides the split-KV
    heuristic.

    ``validate``: check the page table and kv_lens before launch (free for NumPy arrays; for device
    arrays one reduction and a synchronization). With ``validate=False`` device metadata is not
    checked, but the kernel still never reads outside the cache: bad lengths are clamped, keys on
    bad pages are skipped, and ``omnicupy.ops.decode.take_device_errors()`` reports them.

    Returns out (NumPy for NumPy q, else CuPy) or ``(out, lse)``, lse float32 ``[B, Hq, Nq]``.

    A repeated call with ``validate=False``, CuPy metadata and the same signature (shapes, strides,
    dtypes, options) skips the checks and the plan: it writes its pointers into the first call's
    launch and never synchronizes (a decode loop can be captured in a CUDA graph)."""
    key = views = None
    cp = steady_state_possible()
    if validate is False and cp is not None and type(page_table) is cp.ndarray and type(kv_lens) is cp.ndarray:
        key, views = _steady_key((q, k_pages, v_pages, page_table, kv_lens), out, (
            causal, window, scale, id(score_mod), return_lse, layout, num_splits, out is None), cp)
        if key is not None:
            found = _launch_if_known(key, views, out, return_lse, cp)
            if found is not None:
                return found
    host_result = arrays.is_numpy(q)
    qa = as_array(q, "q")
    dtype = check_layout(qa, "q")
    B, Hq, Nq, D = (int(n) for n in qa.shape)
    check_head_dim(D)  # before any copy: HeadDimError
    ka, va, num_pages, page_size, kv_heads = _check_pages(k_pages, v_pages, qa, layout)
    table = _check_table(page_table, B)
    capacity = int(table.shape[1]) * page_size
    if capacity > MAX_CAPACITY:
        raise ArgumentError(f"max_pages * page_size = {capacity} exceeds {MAX_CAPACITY} keys per sequence")
    lens = decode.check_lengths(kv_lens, B, capacity)
    if lens is None:
        raise ArgumentError("kv_lens is required: int32 [B], the keys each sequence holds")
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentError(f"causal must be True or False, got {causal!r}")
    win = 0 if window is None else check_int(window, "window", minimum=1)
    scale = check_scale(scale, D)
    score_expr = check_score_mod(score_mod)
    splits = decode.check_num_splits(num_splits)
    out_shape = (B, Hq, Nq, D)
    if out is not None:
        out = as_array(out, "out")
        if tuple(out.shape) != out_shape or np.dtype(out.dtype) != np.dtype(qa.dtype) or out.strides[3] != out.itemsize:
            raise ArgumentError(f"out must have shape {out_shape}, dtype {qa.dtype} and a contiguous last dim, "
                                f"got {tuple(out.shape)} {out.dtype}")
    check_flags(causal=causal, validate=validate, return_lse=return_lse)
    check_outputs({"out": out}, {"q": qa, "k_pages": ka, "v_pages": va, "page_table": table, "kv_lens": lens})
    if arrays.is_numpy(table) and arrays.is_numpy(lens):
        check_cache_metadata(table, lens, page_size, num_pages)
    require_gpu_for("omnicupy.paged_attention")  # every check above runs without a GPU for NumPy inputs

    cp = arrays.cupy_module()
    qd = to_device(qa, "q")
    kd, vd = (_device_pages(x, name) for x, name in ((ka, "k_pages"), (va, "v_pages")))
    table_d = cp.ascontiguousarray(arrays.to_cupy(table, "page_table"))
    lens_d = decode.device_lengths(lens)
    check_device(table_d, "page_table")
    if validate and not (arrays.is_numpy(table) and arrays.is_numpy(lens)):
        check_cache_metadata(table_d, lens_d, page_size, num_pages)

    def strides(x):
        s = [st // x.itemsize for st in x.strides[:3]]
        return (s[0], s[2], s[1]) if layout == "NHD" else (s[0], s[1], s[2])  # (page, head, slot)

    cache = decode.KVSource(kd, vd, strides(kd), strides(vd), kv_heads, capacity, table_d, page_size, num_pages)
    rule = decode.Rule(causal=bool(causal), window=win, bottom_right=True, q_abs=True)
    longest = decode.rule_span(rule, Nq, decode._longest(lens, capacity))
    plan = decode.plan_split_kv(head_dim=D, dtype=dtype, batch=B, heads=Hq, kv_heads=kv_heads, q_len=Nq,
                                longest=longest, rows=decode.pack_rows(Hq // kv_heads, Nq), rule=rule,
                                score_expr=score_expr.key if score_expr is not None else None, num_splits=splits,
                                ragged=decode.is_ragged(lens), arch=decode.current_arch(),
                                why=f"paged cache ({layout}, page size {page_size})")
    o = None
    if out is not None and arrays.is_cupy(out):
        check_device(out, "out")
        o = out if aligned(out) else None
    if o is None:
        o = cp.empty(out_shape, dtype=qd.dtype)
    lse = cp.empty((B, Hq, Nq), dtype=np.float32) if return_lse else None
    record = [] if key is not None and not host_result and (out is None or o is out) else None
    decode.launch(plan, qd, cache, o, lse, scale, kv_lens=lens_d, score_expr=score_expr, record=record)
    if record and all(x.data.ptr == vw[0] for x, vw in zip((qd, kd, vd, table_d, lens_d), views)):
        pointers = {"q": qd.data.ptr, "k": kd.data.ptr, "v": vd.data.ptr, "o": o.data.ptr,
                    "lse": None if lse is None else lse.data.ptr, "kv_lens": lens_d.data.ptr,
                    "page_table": table_d.data.ptr}
        chain = recall.ChainRecipe.from_record(record, pointers, decode.SCRATCH_FIELDS)
        if chain is not None:
            _recipes.put(key, replace(chain, keep=chain.keep + (score_mod,)))  # the key names it by identity
    if out is not None and o is not out:
        out[...] = o.get() if arrays.is_numpy(out) else o
        o = out
    if host_result:
        o = o if arrays.is_numpy(o) else o.get()
        lse = None if lse is None else lse.get()
    return (o, lse) if return_lse else o


def _steady_key(arrays_in: tuple, out: Any, scalars: tuple, cp) -> tuple[Optional[tuple], Optional[tuple]]:
    """(key, views of q, k_pages, v_pages, page_table, kv_lens[, out]) of a call the steady state may
    serve, or (None, None). Scalars enter with their types (2 and 2.0 are equal keys); the decode's
    tunables (decode.settings()) decide the plan, so they are part of the key too."""
    views = tuple(recall.view(x, cp) for x in arrays_in)
    out_view = None
    if out is not None:
        out_view = recall.view(out, cp) if type(out) is cp.ndarray else None
        if out_view is None:
            return None, None
    if None in views:
        return None, None
    all_views = views if out_view is None else (*views, out_view)
    # An unhashable argument makes an unhashable key, which the RecipeStore neither finds nor keeps:
    # the general path then says what is wrong with the call.
    key = (*recall.signature(all_views, ()), *scalars, *map(type, scalars), *decode.settings())
    return key, all_views


def _launch_if_known(key: tuple, views: tuple, out: Any, return_lse: bool, cp):
    """Launch the recipe of ``key`` (None when there is none or the pointers do not allow it)."""
    recipe = _recipes.get(key)
    if recipe is None:
        return None
    dev = views[0][4]
    for i, vw in enumerate(views):
        if vw[4] != dev or (i in (0, 1, 2, 5) and vw[0] % 16):  # q, k, v, out: 16-byte loads and stores
            return None
    if dev != cp.cuda.runtime.getDevice() or (out is not None and recall.overlaps(views[5], views[:3])):
        return None
    q_view = views[0]
    o = out if out is not None else cp.ndarray(q_view[1], q_view[3])
    lse = cp.ndarray(q_view[1][:3], np.float32) if return_lse else None
    recipe.launch(cp, {"q": q_view[0], "k": views[1][0], "v": views[2][0], "o": o.data.ptr,
                       "lse": 0 if lse is None else lse.data.ptr, "kv_lens": views[4][0], "page_table": views[3][0]})
    return (o, lse) if return_lse else o


def _device_pages(x: Any, name: str):
    d = arrays.to_cupy(x, name)
    check_device(d, name)
    if not aligned(d):
        if arrays.is_numpy(x):  # a fresh upload: make it contiguous (and aligned) instead
            return arrays.cupy_module().ascontiguousarray(d)
        raise ArgumentError(f"{name} must be 16-byte aligned with strides that are multiples of 8 elements "
                            f"(a copy of a whole cache is not made silently), got strides {d.strides}")
    return d


__all__ = ["paged_attention", "check_cache_metadata", "LAYOUTS"]
