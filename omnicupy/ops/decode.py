"""Split-KV decode: attention for a few query rows per kv head against a long KV cache.

When the query side is small (decode, speculative verification, short chunks), a kernel that tiles
queries (the forward) launches too few CTAs to read the cache at the memory-bandwidth limit. The
decode kernel (templates/attention_decode.cu.jinja, kernels/decode_split.cuh) instead packs the
query heads of one GQA group and their positions into the rows of one m tile, so that one read of
K/V serves the whole group, and splits each sequence's keys across ``num_splits`` CTAs. Each split
leaves unnormalized fp32 partial rows with their (max, sum); a combine kernel
(kernels/decode_combine.cuh) merges them exactly. One split writes the output directly.

This module plans and launches both kernels for contiguous caches (``attention(kv_lens=...,
num_splits=...)``: ``decode_plan`` + ``run_decode``) and, through ``plan_split_kv`` and ``launch``,
for paged caches (ops/paged.py). It knows the decode kernel's needs and the split heuristic; the
forward kernel and paged-table layouts are not its business.

What a row sees, per sequence b with ``L = kv_lens[b]`` keys (or the cache's length):
  rule mode   keys j < L, and with ``causal`` j <= pos, with ``window`` W j > pos - W, where query i
              sits at ``pos = i + L - Nq`` (``bottom_right``) or ``pos = i``;
  mask mode   a BlockMask's pairs (q block 0, one mask row for all of a tile's rows), and j < L.
"""
from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import arrays, jit
from ..checks import check_int
from ..dispatch import decode_plan as _plan
from ..dispatch.arch import current_arch
from ..dispatch.decode_plan import (DecodePlan, Rows, Rule, choose_splits, combine_variant, decode_variant,  # noqa: F401
                                    pack_rows, plan_split_kv, rule_span, settings, shipped_variants)
from ..dispatch.params import COMBINE, DECODE
from ..dispatch.specs.decode_split import DECODE_BC, TileTable  # noqa: F401
from ..errors import ArgumentError, KVCacheError
from ..jit.launch import KernelLaunch, Launcher
from ..mask import BlockMask, cdiv, expressions
from . import fields as group
from .inputs import (Inputs, check_device, check_mask_matches, check_out, check_qkv, check_scale, check_score_mod,
                     device_out, on_device, require_gpu)

#: Bits of the device error word (kernels/decode_split.cuh).
ERROR_KV_LEN, ERROR_PAGE = 1, 2


# ------------------------------------------------------------------------------------ arguments
def check_num_splits(num_splits: Any) -> Optional[int]:
    if num_splits is None:
        return None
    splits = check_int(num_splits, "num_splits", minimum=1)
    if splits > _plan.MAX_SPLITS:
        raise ArgumentError(f"num_splits must be <= {_plan.MAX_SPLITS}, got {splits}")
    return splits


def check_lengths(kv_lens: Any, batch: int, capacity: int, name: str = "kv_lens"):
    """kv_lens as an int32 [B] array (NumPy or CuPy). Host values are checked here against
    [0, capacity]; device values are clamped by the kernel (and flagged), or checked by
    ``validate_on_device``."""
    if kv_lens is None:
        return None
    x = arrays.as_array(kv_lens, name)
    if x.ndim != 1 or x.shape[0] != batch:
        raise ArgumentError(f"{name} must be a 1-D integer array of length B={batch}, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype).kind not in "iu":
        raise ArgumentError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    if arrays.is_numpy(x):
        if x.size and (int(x.min()) < 0 or int(x.max()) > capacity):
            raise KVCacheError(f"{name} must lie in [0, {capacity}] (the cache's capacity), got values in "
                               f"[{int(x.min())}, {int(x.max())}]")
        return x.astype(np.int32, copy=False)
    if x.dtype != np.int32:
        raise ArgumentError(f"{name} on the device must be int32 (no hidden copies), got {x.dtype}")
    return x


def is_ragged(kv_lens: Any) -> bool:
    """Whether lengths may differ: device lengths (unknown here) or host lengths that do."""
    if kv_lens is None:
        return False
    if not arrays.is_numpy(kv_lens):
        return True
    return kv_lens.size > 1 and int(kv_lens.min()) != int(kv_lens.max())


def _longest(kv_lens: Any, capacity: int) -> int:
    """The longest sequence, known on the host only for host lengths; else the capacity."""
    if kv_lens is not None and arrays.is_numpy(kv_lens):
        return int(kv_lens.max()) if kv_lens.size else 0
    return capacity


# ---------------------------------------------------------------------------- attention() hook
_CAUSAL = {False: None, True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}


def decode_plan(inp: Inputs, block_mask: Optional[BlockMask], kv_lens: Any = None, num_splits: Any = None, *,
                causal: Any = False, score_expr: Optional[expressions.CudaExpr] = None, bias: Any = None,
                arch: Optional[str] = None, num_sms: Optional[int] = None, force: bool = False) -> Optional[DecodePlan]:
    """What ``attention()`` should launch for this call, or None when the forward kernel should run.

    ``block_mask`` is the caller's BlockMask (None when ``causal`` was used instead); ``causal`` the
    caller's value (False, True/'top_left', 'bottom_right'). With ``kv_lens`` (int32 [B]) each
    sequence b has ``kv_lens[b]`` keys and ``causal=True`` means bottom-right per sequence (the last
    query sees the last key); 'top_left' is refused there. Without ``kv_lens`` and ``num_splits``,
    the decode kernel runs only when the packed query rows of a kv head (group x Nq) are at most
    DECODE_MAX_ROWS and the mask allows it. ``kv_lens`` or ``num_splits`` given (or ``force``) ask
    for it: a call it cannot serve raises ArgumentError. Needs no GPU for NumPy arrays when ``arch``
    is given."""
    try:
        mode = _CAUSAL[causal]
    except (KeyError, TypeError):
        raise ArgumentError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}") from None
    splits = check_num_splits(num_splits)
    forced = force or kv_lens is not None or splits is not None
    lens = check_lengths(kv_lens, inp.batch, inp.kv_len)
    group = inp.heads // inp.kv_heads

    def refuse(why: str) -> None:
        if forced:
            raise ArgumentError(f"kv_lens/num_splits: the decode kernel cannot run this call: {why}")
        return None

    if bias is not None:
        return refuse("bias= is not supported by the decode kernel")
    if kv_lens is not None and isinstance(causal, str) and causal == "top_left":
        raise ArgumentError("with kv_lens, causal is bottom-right per sequence: pass causal=True or 'bottom_right'")
    if block_mask is not None and mode is not None:
        raise ArgumentError("pass either block_mask or causal, not both (build a causal BlockMask instead)")
    shared = True
    if block_mask is not None:
        if block_mask.num_q_blocks != 1:
            return refuse(f"a block mask needs q_len <= its q_block_size ({block_mask.q_block_size}) here")
        shared = group == 1 or block_mask.shape[1] == 1
        if block_mask.kv_block_size % DECODE_BC:
            return refuse(f"kv_block_size must be a multiple of {DECODE_BC}")
    rows = pack_rows(group, inp.q_len, shared)
    if not forced and (group if shared else 1) * inp.q_len > _plan.DECODE_MAX_ROWS:
        return None
    if arch is None:
        require_gpu()
        arch = current_arch()
    longest = _longest(lens, inp.kv_len)
    skey = score_expr.key if score_expr is not None else None
    if block_mask is not None:
        features = (block_mask.features.causal, block_mask.features.partial)
        return plan_split_kv(head_dim=inp.head_dim, dtype=inp.dtype, batch=inp.batch, heads=inp.heads,
                             kv_heads=inp.kv_heads, q_len=inp.q_len, longest=longest, rows=rows, rule=None,
                             mask_features=features, score_expr=skey, num_splits=splits, ragged=is_ragged(lens),
                             arch=arch, num_sms=num_sms, why=f"{rows.br}-row m tiles over a block mask")
    rule = Rule(causal=mode is not None, bottom_right=mode == "bottom_right" or (kv_lens is not None and mode is not None))
    return plan_split_kv(head_dim=inp.head_dim, dtype=inp.dtype, batch=inp.batch, heads=inp.heads,
                         kv_heads=inp.kv_heads, q_len=inp.q_len, longest=rule_span(rule, inp.q_len, longest),
                         rows=rows, rule=rule, score_expr=skey, num_splits=splits, ragged=is_ragged(lens), arch=arch,
                         num_sms=num_sms,
                         why=f"{group * inp.q_len} query rows per kv head (GQA group {group} x Nq {inp.q_len})")


def decode_attention(q: Any, k: Any, v: Any, block_mask: Optional[BlockMask] = None, *, kv_lens: Any = None,
                     num_splits: Any = None, causal: Any = False, scale: Optional[float] = None,
                     return_lse: bool = False, out: Any = None, score_mod: Any = None):
    """``attention()`` through the split-KV decode kernel, always (the path attention() takes for
    kv_lens / num_splits / few query rows; see decode_plan for the arguments). q ``[B, Hq, Nq, D]``,
    k/v ``[B, Hkv, Nkv, D]``; returns out or (out, lse) like attention()."""
    host_result = arrays.is_numpy(q)
    inp = check_qkv(q, k, v)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(block_mask).__name__}")
        check_mask_matches(block_mask, inp)
    score_expr = check_score_mod(score_mod)
    scale = check_scale(scale, inp.head_dim)
    out = check_out(out, inp)
    lens = check_lengths(kv_lens, inp.batch, inp.kv_len)
    plan = decode_plan(inp, block_mask, lens, num_splits, causal=causal, score_expr=score_expr, force=True)
    inp = on_device(inp)
    o, copy_into = device_out(out, inp)
    cp = arrays.cupy_module()
    lse = cp.empty((inp.batch, inp.heads, inp.q_len), dtype=np.float32) if return_lse else None
    run_decode(plan, inp, o, lse, scale, kv_lens=lens, block_mask=block_mask, score_expr=score_expr)
    if copy_into is not None:
        copy_into[...] = o.get() if arrays.is_numpy(copy_into) else o
        o = copy_into
    if host_result:
        o = o if arrays.is_numpy(o) else o.get()
        lse = None if lse is None else lse.get()
    return (o, lse) if return_lse else o


def run_decode(plan: DecodePlan, inp: Inputs, o: Any, lse: Any, scale: float, *, kv_lens: Any = None,
               block_mask: Optional[BlockMask] = None, score_expr: Optional[expressions.CudaExpr] = None,
               record: Optional[list] = None) -> None:
    """Launch ``plan`` on device inputs (``ops.inputs.on_device``) into the device output ``o``
    ([B, Hq, Nq, D], 16-byte aligned rows) and ``lse`` (contiguous float32 [B, Hq, Nq] or None).
    ``record``: see ``launch``."""
    cache = KVSource.contiguous(inp.k, inp.v)
    launch(plan, inp.q, cache, o, lse, scale, kv_lens=device_lengths(kv_lens), block_mask=block_mask,
           score_expr=score_expr, record=record)


# ------------------------------------------------------------------------------------------ launch
@dataclass(frozen=True)
class KVSource:
    """Where key j of (batch b, kv head hk) lives: element ``page * s_page + hk * s_head + slot * s_slot``
    of k (and v), with (page, slot) = (b, j) for a contiguous cache and
    (page_table[b, j // page_size], j % page_size) for a paged one."""

    k: Any
    v: Any
    k_strides: tuple[int, int, int]  # (page or batch, head, slot), elements
    v_strides: tuple[int, int, int]
    kv_heads: int
    capacity: int  # keys a sequence can hold: Nkv, or max_pages * page_size
    page_table: Any = None
    page_size: int = 0
    num_pages: int = 0

    @classmethod
    def contiguous(cls, k: Any, v: Any) -> "KVSource":
        def st(x):
            return tuple(s // x.itemsize for s in x.strides[:3])

        return cls(k, v, st(k), st(v), int(k.shape[1]), int(k.shape[2]))


def device_lengths(kv_lens: Any):
    if kv_lens is None:
        return None
    d = arrays.to_cupy(kv_lens, "kv_lens")
    check_device(d, "kv_lens")
    return arrays.cupy_module().ascontiguousarray(d, dtype=np.int32)


_error_words: dict[int, Any] = {}
_split_counters: dict[tuple[int, int], Any] = {}


def split_counters(units: int):
    """Zeroed int32 counters for a fused combine of ``units`` (m tile, kv head, batch) units, one
    buffer per (device, stream): the last CTA of each unit resets its counter, so the buffer is
    zero again after every launch, and launches on one stream never share a counter at once. Grown
    (a fresh zeroed buffer) when a launch needs more units."""
    cp = arrays.cupy_module()
    key = (cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream().ptr)
    buf = _split_counters.get(key)
    if buf is None or buf.size < units:
        buf = _split_counters[key] = cp.zeros(max(units, 1024), dtype=np.int32)
    return buf


def error_word():
    """This device's error word of the decode kernels (bits ERROR_KV_LEN, ERROR_PAGE)."""
    cp = arrays.cupy_module()
    dev = cp.cuda.runtime.getDevice()
    if dev not in _error_words:
        _error_words[dev] = cp.zeros(1, dtype=np.int32)
    return _error_words[dev]


def take_device_errors(raise_error: bool = True) -> int:
    """Read and clear the current device's decode error word (this synchronizes the stream): bits 1
    (a kv_lens entry outside the cache, clamped) and 2 (a page id outside the pool, its keys
    masked), set by kernels whose metadata was not checked before launch. Raises KVCacheError when
    a bit is set and ``raise_error``; returns the bits."""
    word = error_word()
    bits = int(word.get()[0])
    word.fill(0)
    if bits and raise_error:
        what = [text for bit, text in ((ERROR_KV_LEN, "kv_lens entries outside the cache (clamped)"),
                                       (ERROR_PAGE, "page ids outside the page pool (their keys were skipped)"))
                if bits & bit]
        raise KVCacheError("a decode kernel met bad cache metadata on the device: " + "; ".join(what))
    return bits


#: Launch fields that launch() allocates per call (the split results the combine merges): the
#: steady state allocates them anew per call (ops/recall.py, ChainRecipe).
SCRATCH_FIELDS = ("part_o", "part_ml")


def _call(kernel: Any, grid: tuple, block: tuple, params: Any, fields: dict, shared_mem: int,
          record: Optional[list]) -> None:
    """One launch with its struct packed by name, through a Launcher (jit/launch.py): the code the
    steady state's replays run (ops/recall.py, ChainRecipe), so that first and later calls launch
    alike, as the forward's and backward's do. ``record`` collects what was launched, in order."""
    item = KernelLaunch(kernel, grid, block, shared_mem)
    Launcher(bytes(params.pack(fields)), [item]).launch()
    if record is not None:
        record.append((item, params, fields))


def launch(plan: DecodePlan, q: Any, cache: KVSource, o: Any, lse: Any, scale: float, *, kv_lens: Any = None,
           block_mask: Optional[BlockMask] = None, score_expr: Optional[expressions.CudaExpr] = None,
           record: Optional[list] = None) -> None:
    """Fill DecodeParams by name and launch the split kernel (and the combine) on the current stream.
    ``record``, a list, receives (KernelLaunch, struct, fields) per launch: what the steady state
    replays with new pointers (ops/recall.py, ChainRecipe)."""
    cp = arrays.cupy_module()
    B, Hq, Nq, D = (int(n) for n in q.shape)
    os_ = [s // o.itemsize for s in o.strides[:3]]
    kv_heads = cache.kv_heads
    splits = plan.num_splits
    part_o = part_ml = None
    if splits > 1:
        # rows of the kernel's tile head dim (wider than D when padded: decode_combine.cuh's stride)
        part_o = cp.empty((splits, B * Hq * Nq, plan.split.variant.head_dim), dtype=np.float32)
        part_ml = cp.empty((splits, B * Hq * Nq, 2), dtype=np.float32)
    rule = plan.rule or Rule()
    transforms = score_expr is not None
    r = plan.rows
    fields = {
        "q": q, "k": cache.k, "v": cache.v, "o": o, "lse": lse if splits == 1 or plan.fused else None,
        "part_o": part_o, "part_ml": part_ml,
        "split_counters": split_counters(B * kv_heads * plan.rows.m_tiles) if plan.fused else None,
        **group.strides(q, "q"),
        "k_sb": cache.k_strides[0], "k_sh": cache.k_strides[1], "k_sn": cache.k_strides[2],
        "v_sb": cache.v_strides[0], "v_sh": cache.v_strides[1], "v_sn": cache.v_strides[2],
        "o_sb": os_[0], "o_sh": os_[1], "o_sn": os_[2],
        "kv_lens": kv_lens,
        "page_table": cache.page_table,
        "page_table_sb": 0 if cache.page_table is None else cache.page_table.strides[0] // 4,
        "max_pages": 0 if cache.page_table is None else int(cache.page_table.shape[1]),
        "page_size": cache.page_size, "num_pages": cache.num_pages,
        "errors": error_word(),
        "batch": B, "num_heads": Hq, "kv_heads": kv_heads, "q_len": Nq, "kv_len": cache.capacity,
        "kv_group": Hq // kv_heads,
        "heads_per_tile": r.heads_per_tile, "q_per_tile": r.q_per_tile, "head_blocks": r.head_blocks,
        "m_tiles": r.m_tiles, "num_splits": splits,
        "causal": int(rule.causal), "window": int(rule.window), "bottom_right": int(rule.bottom_right),
        "q_abs": int(rule.q_abs),
        "scale": scale,
        # Scores reach the softmax raw, the scale folded into exp2, unless a score modifier needs
        # them scaled first (then the softmax works in natural units).
        "scale_log2": math.log2(math.e) * (1.0 if transforms else scale),
        **group.mask_rows(block_mask if plan.rule is None else None),
        **group.user_arrays(score_expr),
    }
    kernel = jit.get_kernel(plan.split.variant)
    _call(kernel, plan.split.grid, plan.split.block, DECODE, fields, plan.split.smem_bytes, record)
    if plan.combine is not None:
        cfields = {"part_o": part_o, "part_ml": part_ml, "o": o, "lse": lse,
                   "o_sb": os_[0], "o_sh": os_[1], "o_sn": os_[2], "rows": B * Hq * Nq, "num_heads": Hq,
                   "q_len": Nq, "num_splits": splits}
        combine = jit.get_kernel(plan.combine.variant)
        _call(combine, plan.combine.grid, plan.combine.block, COMBINE, cfields, 0, record)


__all__ = ["DecodePlan", "Rows", "Rule", "KVSource", "decode_plan", "run_decode", "decode_attention",
           "plan_split_kv", "launch", "pack_rows", "choose_splits", "take_device_errors", "DECODE_MAX_ROWS",
           "MAX_SPLITS", "DECODE_TILES", "SCRATCH_FIELDS", "FUSED_COMBINE", "TileTable", "settings"]


def _forwarded(name: str) -> property:
    """Reads and writes of tunable ``name`` go to the module that holds it (decode_plan.TUNABLES)."""
    return property(lambda self: getattr(_plan.tunable_home(name), name),
                    lambda self, value: setattr(_plan.tunable_home(name), name, value))


#: Tuning tools and tests rebind the decode's tunables here (``decode.FUSED_COMBINE = False``,
#: ``decode.DECODE_TILES = ...``); they live with the plan (dispatch/decode_plan.py) and the slots,
#: where the planner reads them. Data descriptors on the module's class forward both ways (and a
#: monkeypatch's undo restores through them).
_Tunables = type("_Tunables", (types.ModuleType,), {name: _forwarded(name) for name in _plan.TUNABLES})
sys.modules[__name__].__class__ = _Tunables
