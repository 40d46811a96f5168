"""Builders of BlockMask metadata (docs/design.md): from a mask_mod, a dense mask, flex-attention's arrays,
and the causal / full rules.

All of them but the causal rows describe the rows as items (layout.py): runs of blocks of one
type, in which some blocks are still to be classified (EVALUATE). (A MaskMod whose exact bounds are
the causal ones, on a grid of at most ``CAUSAL_ROWS_MAX_SLOTS``, has its layout written
arithmetically, the same arrays in a fraction of the time.) Where the items come from:

- a MaskMod with pieces (exact bounds given piecewise: the built-in masks but dilated windows and
  and/or/not combinations), built on a device: two kernels do all of it (pieces_build.py);
- a MaskMod with exact row bounds: the bounds give each row's window of kv blocks, which of them are FULL or CAUSAL,
  and, for the few blocks an interval end cuts, their element masks as one run of columns per
  row (patterns.py). The mask_mod is never called;
- a MaskMod with inexact bounds: the windows rule blocks out; the blocks in them are evaluated;
- any other mask_mod, a dense mask, flex's partial blocks: every block is evaluated.

Evaluated blocks are called in chunks (so that peak memory stays bounded whatever N is) through
the broadcast contract, or the scalar mode for mask_mods written for flex's vmap (evaluate.py);
their elements are bit-packed, typed and hashed; PARTIAL ones are deduplicated into the pool
(blocks.py). The layout is written from the segments of the rows (layout.py).

Where the work runs: the host works per q block, per run and per cut block (NumPy: O(N) for the
bounds, O(cut blocks x q_block_size) for their patterns), never per slot of the [nQB, maxB]
layout unless the arrays are NumPy. On a device (``xp`` CuPy) only omnicupy's own kernels run
(kernels.py: compiled through omnicupy.jit and covered by ``omnicupy precompile``), plus the CuPy
operations of a mask_mod that must be evaluated element by element. A structured build on the
device from pieces is a scan kernel, whose results it reads back on a stream of its own (so it
does not wait behind the caller's work), and a layout kernel on the caller's stream; from row
bounds, one upload of a table, one upload of the pool and one layout kernel, with no wait for
the device. An evaluated build waits once per chunk for the blocks' types and hashes, and once for
the check that blocks with equal hashes are equal.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError
from . import blocks, compile_mask, evaluate, pieces_build, zoo
from .block_mask import BlockMask, MaskSummary, RowRuns, _as_index_array, _check_positive_int, check_sizes
from .evaluate import BroadcastFailure, ScalarEvaluator
from .kernels import Backend, backend_for, precompile_specs
from .layout import Items, device_table, items_from_runs, segments_of, summary_of, write_host
from .mask_mod import CAUSAL, EVALUATE, FULL, MASKED, MaskMod, check_mask_mod, name_of
from .patterns import PatternPool, cut_blocks
from .pieces import BlockPieces, group_cut_blocks
from .types import PARTIAL_WORD_BITS, BlockType, MaskFeatures, cdiv

PARTIAL = int(BlockType.PARTIAL)
logger = logging.getLogger("omnicupy.mask")

#: Elements evaluated at once (one chunk of blocks) on the host. The chunk's int64 temporaries
#: inside a mask_mod take 8 bytes per element, so this bounds the builders' peak memory near 100 MB.
CHUNK_ELEMENTS = 1 << 22
#: The same on a device, where a chunk costs a round trip: 64M elements (4096 blocks of 128 x 128)
#: take the cut blocks of every built-in mask at N = 131072 at once, with int64 temporaries of
#: 512 MB at most.
DEVICE_CHUNK_ELEMENTS = 1 << 26

#: Cut blocks from pieces are grouped by pattern key (pieces.py) from this many on; fewer are
#: classified one by one (the grouping's fixed cost, some 30 NumPy calls, is more than their rows').
GROUP_CUT_BLOCKS_FROM = 256

#: Causal rows (a MaskMod whose exact bounds are ``[0, q_idx + 1)``) are written arithmetically, as
#: ``BlockMask.causal`` computes them, with the layout of the structured path, up to this many
#: slots of the [nQB, nKVB] grid (N = 16384 at blocks of 128). Past it the arrays themselves cost
#: more than the structured path's work: fresh pages on the host, the upload on a device, where
#: the layout kernel writes them instead (NOTES.md §19).
CAUSAL_ROWS_MAX_SLOTS = 1 << 14

#: mask_mods that took CuPy arrays once: ``_evaluation_module`` probes each only once (its probe
#: is a handful of kernel launches, as many as a small build's whole evaluation).
_TAKES_DEVICE_ARRAYS: "weakref.WeakSet[Callable]" = weakref.WeakSet()
#: mask_mods whose broadcast results matched per-element calls once (see ``_check_elementwise``).
_ELEMENTWISE: "weakref.WeakSet[Callable]" = weakref.WeakSet()
_said_cupy_compiles = False


def default_array_module():
    """CuPy when a GPU is usable, else NumPy."""
    return arrays.cupy_module() if arrays.gpu_available() else np


def _evaluation_module(mask_mod: Callable, xp: Any):
    """``xp``, unless it is CuPy and ``mask_mod`` cannot take CuPy index arrays (it indexes a NumPy
    table, say): then NumPy, with a warning, so that the same function still builds, on the host."""
    if xp is np:
        return xp
    with contextlib.suppress(TypeError):  # one that can't be weakly referenced is probed every time
        if mask_mod in _TAKES_DEVICE_ARRAYS:
            return xp
    zero = xp.zeros((1, 1, 1), dtype=np.int64)
    try:
        mask_mod(zero, zero, zero, zero)
    except TypeError as exc:
        warnings.warn(f"mask_mod {name_of(mask_mod)} does not take CuPy arrays ({exc}); "
                      "evaluating it with NumPy on the host, which is slower. Index CuPy copies of its tables "
                      "(xp.asarray) to build on the GPU.", stacklevel=4)
        return np
    except Exception:  # noqa: BLE001 - not a question of where: the evaluation reports it, with the contract
        return xp
    with contextlib.suppress(TypeError):
        _TAKES_DEVICE_ARRAYS.add(mask_mod)
    return xp


def _is_causal(mask_mod: MaskMod) -> bool:
    """Whether a MaskMod's exact bounds are the causal ones, ``[0, q_idx + 1)`` on every row (its
    pieces say so: one piece, start 0, end q + 1). Exact bounds are the mask, whatever its function."""
    p = mask_mod.pieces
    return (p is not None and len(p.q) == 1 and int(p.start[0]) == 0 and int(p.start_slope[0]) == 0
            and int(p.end[0]) == 1 and int(p.end_slope[0]) == 1)


def _is_known_elementwise(mask_mod: Callable) -> bool:
    from .expressions import CudaExpr  # an expression runs as an elementwise kernel

    if getattr(mask_mod, "pointwise", False) or isinstance(getattr(mask_mod, "cuda", None), CudaExpr):
        return True
    with contextlib.suppress(TypeError):
        return mask_mod in _ELEMENTWISE
    return False


# ---------------------------------------------------------------------------------- the rules
def full(q_len: int, kv_len: int, *, q_block_size: int = 128, kv_block_size: int = 128) -> BlockMask:
    """Every query attends to every key. Its rows are all alike: stored once, broadcast (O(nKVB))."""
    q_len, kv_len, qbs, kbs = check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
    row = np.arange(nkvb, dtype=np.int32)
    nb = np.broadcast_to(np.int32(nkvb), (1, 1, nqb))
    idx = np.broadcast_to(row, (1, 1, nqb, nkvb))
    types = np.broadcast_to(np.int32(BlockType.FULL), (1, 1, nqb, nkvb))
    summary = MaskSummary(counts=(0, 0, nqb * nkvb, 0), q_block_work=np.full(nqb, 2 * nkvb, dtype=np.int64))
    q = np.arange(nqb)
    runs = RowRuns((1, 1, nqb), q, np.zeros(nqb, np.int64), np.full(nqb, nkvb), np.full(nqb, int(BlockType.FULL)))
    return BlockMask(nb, idx, types, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     _features=MaskFeatures(causal=False, partial=False), _summary=summary, _runs=runs, _rule="full")


def causal(q_len: int, kv_len: int, *, bottom_right: bool = False, q_block_size: int = 128,
           kv_block_size: int = 128) -> BlockMask:
    """``q_idx >= kv_idx`` (top-left aligned, flex-attention's convention), or with
    ``bottom_right`` ``q_idx + kv_len - q_len >= kv_idx`` (the last query sees the last key,
    FlashAttention-2's convention for prefill against a KV cache)."""
    q_len, kv_len, qbs, kbs = check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    offset = kv_len - q_len if bottom_right else 0
    if offset == 0:
        return _causal_rule(q_len, kv_len, qbs, kbs)
    # The shifted diagonal is not the CAUSAL block pattern: its blocks become PARTIAL, built by
    # the structured path (and evaluable in the kernel from the mask's expression).
    return from_mask_mod(zoo.causal(offset), None, None, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs)


def _causal_rule(q_len: int, kv_len: int, qbs: int, kbs: int) -> BlockMask:
    """The causal rows computed arithmetically, O(nQB + maxB) on the host: row q lists kv blocks
    0 .. count-1 in order, the first ``full`` of them FULL and the rest CAUSAL. ``kv_indices`` is one
    broadcast row; ``block_mask_types`` one row read at a shifting offset (a strided view) when the
    FULL run grows by the same number of blocks from row to row (kv_block_size divides
    q_block_size and the ends allow it), else written out."""
    nqb = cdiv(q_len, qbs)
    count, full_count = _causal_counts(q_len, kv_len, qbs, kbs)
    maxb = int(count.max())
    step = qbs // kbs if qbs % kbs == 0 else None
    has_causal = count > full_count
    linear = (step is not None and np.array_equal(full_count[has_causal], step * np.arange(nqb)[has_causal])
              and bool(np.all(count[~has_causal] <= step * np.arange(nqb)[~has_causal])))
    if linear:
        # types[q, s] = base[shift + s - step * q]: FULL before `shift`, CAUSAL from it on.
        shift = step * (nqb - 1)
        base = np.full(shift + maxb, int(BlockType.CAUSAL), dtype=np.int32)
        base[:shift] = BlockType.FULL
        at = base[shift:]
        types = np.lib.stride_tricks.as_strided(at, (nqb, maxb), (-step * at.itemsize, at.itemsize), writeable=False)
    else:
        types = np.where(np.arange(maxb) < full_count[:, None], int(BlockType.FULL), int(BlockType.CAUSAL))
        types = types.astype(np.int32)
        types.flags.writeable = False
    counts = count.astype(np.int32)
    counts.flags.writeable = False
    summary, runs = _causal_summary(count, full_count, cdiv(kv_len, kbs))
    return BlockMask(counts[None, None], np.broadcast_to(np.arange(maxb, dtype=np.int32), (1, 1, nqb, maxb)),
                     types[None, None], q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs,
                     _features=MaskFeatures(causal=bool(has_causal.any()), partial=False), _summary=summary,
                     _runs=runs, _rule="causal")


def reblocked(bm: BlockMask, q_block_size: int) -> BlockMask:
    """A built-in rule mask (``bm.rule``) in q blocks of ``q_block_size`` rows, its kv blocks
    unchanged: the same element mask, so the planner may launch a tile whose height does not divide
    ``bm.q_block_size`` (dispatch/plan.py). Kept on ``bm`` (one per size), so that launches recorded
    on ``bm`` keep its metadata alive. Raises MaskError for masks made from anything but a rule."""
    if bm.rule is None:
        raise MaskError("only the built-in rule masks (BlockMask.full, top-left BlockMask.causal) can change "
                        "their q block size; rebuild other masks with the block size you need")
    if q_block_size == bm.q_block_size:
        return bm
    if q_block_size not in bm._reblocked:
        make = full if bm.rule == "full" else causal
        bm._reblocked[q_block_size] = make(bm.q_len, bm.kv_len, q_block_size=q_block_size,
                                           kv_block_size=bm.kv_block_size)
    return bm._reblocked[q_block_size]


def _causal_counts(q_len: int, kv_len: int, qbs: int, kbs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per q block (int64 ``[nQB]``): how many kv blocks ``q_idx >= kv_idx`` reaches (0 .. count - 1),
    and how many of those, from 0 on, it covers whole (FULL; the rest are CAUSAL)."""
    nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
    q_lo = np.arange(nqb, dtype=np.int64) * qbs
    q_hi = np.minimum(q_lo + qbs, q_len) - 1
    count = np.minimum(q_hi // kbs + 1, nkvb)
    full_count = np.where(kv_len - 1 <= q_lo, nkvb, np.minimum((q_lo + 1) // kbs, nkvb))
    return count, full_count


def _causal_summary(count: np.ndarray, full_count: np.ndarray, nkvb: int,
                    copies: int = 1) -> tuple[MaskSummary, RowRuns]:
    """The summary and row runs of causal rows: one (b, h) row set, standing for ``copies`` of them."""
    nqb = len(count)
    causal_blocks = count - full_count
    counts = (nqb * nkvb - int(count.sum()), int(causal_blocks.sum()), int(full_count.sum()), 0)
    summary = MaskSummary(counts=tuple(c * copies for c in counts),
                          q_block_work=(2 * full_count + causal_blocks).astype(np.int64) * copies)
    # Per row a FULL run from kv block 0, then a CAUSAL one; empty runs are left out, as the
    # structured path leaves them out.
    row = np.repeat(np.arange(nqb), 2)
    kv = np.stack([np.zeros(nqb, np.int64), full_count], 1).reshape(-1)
    length = np.stack([full_count, causal_blocks], 1).reshape(-1)
    kind = np.tile([int(BlockType.FULL), int(BlockType.CAUSAL)], nqb)
    keep = length > 0
    return summary, RowRuns((1, 1, nqb), row[keep], kv[keep], length[keep], kind[keep])


# ------------------------------------------------------------------------------ from a mask_mod
def from_mask_mod(mask_mod: Callable, B: Optional[int], H: Optional[int], q_len: int, kv_len: int, *,
                  q_block_size: int = 128, kv_block_size: int = 128, xp: Any = None, use_structure: bool = True,
                  mode: str = "auto") -> BlockMask:
    """Classify every (q block, kv block) of ``mask_mod(b, h, q_idx, kv_idx)`` as MASKED, FULL, CAUSAL
    or PARTIAL. ``B``/``H`` of None build a mask broadcast over batch/heads (size 1). ``xp`` picks
    the array module (default: CuPy with a GPU, else NumPy); ``use_structure=False`` ignores a
    MaskMod's structure and evaluates every block (the generic path, for tests and benchmarks).
    ``mode``: how a mask_mod is called on the blocks it must be evaluated on: ``"broadcast"`` (index
    arrays, the contract of evaluate.py), ``"scalar"`` (one index a scalar at a time, for mask_mods
    written for flex's vmap), ``"auto"`` (broadcast, and the scalar mode when that fails)."""
    if not isinstance(mask_mod, MaskMod):  # a MaskMod's function was checked when it was made
        check_mask_mod(mask_mod)
    mode = evaluate.check_mode(mode)
    Bm = 1 if B is None else _check_positive_int(B, "B")
    Hm = 1 if H is None else _check_positive_int(H, "H")
    q_len, kv_len, qbs, kbs = check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    # A plain Python function is evaluated as its compiled CUDA expression where it translates (else as it is,
    # logged once; an explicit mode keeps today's evaluation); the mask records the caller's function.
    compiled = compile_mask.for_build(mask_mod, Bm, Hm, q_len, kv_len) if mode == "auto" else None
    build = _Build(compiled or mask_mod, (Bm, Hm), q_len, kv_len, qbs, kbs,
                   default_array_module() if xp is None else xp, mode, recorded=mask_mod)
    windows = None
    if isinstance(mask_mod, MaskMod):
        mask_mod.check_extent(B, q_len, kv_len)
        if use_structure and _is_causal(mask_mod) and build.nqb * build.nkvb <= CAUSAL_ROWS_MAX_SLOTS:
            return build.causal_rows()
        if use_structure and pieces_build.applies(mask_mod, build.backend, qbs):
            built = pieces_build.build(build.backend, mask_mod, (Bm, Hm), q_len, kv_len, qbs, kbs)
            if built is not None:
                return built
            logger.info("mask_mod %s: two distinct partial blocks share a hash; built on the host path",
                        name_of(mask_mod))
        if use_structure:
            windows = mask_mod.windows(Bm, Hm, q_len, kv_len, qbs, kbs)
    if windows is None:
        return build.every_block((Bm, Hm, build.nqb))
    return build.from_windows(windows)


def from_dense(mask: Any, *, q_block_size: int = 128, kv_block_size: int = 128) -> BlockMask:
    """Block metadata for a boolean mask ``[B|1, H|1, Nq, Nkv]`` (NumPy, CuPy or DLPack); the work
    runs where the mask lives, reading the mask directly (no mask_mod call)."""
    mask = _as_array(mask, "mask")
    mod = zoo.dense(mask)  # validates the mask
    bm, hm, q_len, kv_len = (int(n) for n in mask.shape)
    q_len, kv_len, qbs, kbs = check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    build = _Build(mod, (bm, hm), q_len, kv_len, qbs, kbs, arrays.array_namespace(mask), "broadcast")
    return build.every_block((bm, hm, build.nqb), dense=mask)


def from_flex(kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any = None, full_kv_indices: Any = None, *,
              q_len: int, kv_len: int, q_block_size: int = 128, kv_block_size: int = 128,
              mask_mod: Optional[Callable] = None, mode: str = "auto") -> BlockMask:
    """From the arrays of torch's ``BlockMask.as_tuple()`` (NumPy, CuPy or any DLPack array; no torch
    import): ``kv_*`` lists partial blocks, ``full_kv_*`` full ones. Partial blocks are classified
    (CAUSAL, PARTIAL, or dropped when all false) by evaluating ``mask_mod``, the NumPy/CuPy form of
    flex's mask_mod, which they therefore need (``mode`` as for ``from_mask_mod``)."""
    q_len, kv_len, qbs, kbs = check_sizes(q_len, kv_len, q_block_size, kv_block_size)
    mode = evaluate.check_mode(mode)
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise MaskError("full_kv_num_blocks and full_kv_indices must be given together")
    named = {"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices}
    if full_kv_num_blocks is not None:
        named.update(full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices)
    if mask_mod is not None:
        check_mask_mod(mask_mod)
    given = {name: _as_array(a, name) for name, a in named.items()}
    # The metadata goes where the arrays came from; the block-level work runs on the host.
    xp = arrays.cupy_module() if any(arrays.is_cupy(a) for a in given.values()) else np
    given = {name: _as_index_array(arrays.to_numpy(a), name, 4 if name.endswith("indices") else 3)
             for name, a in given.items()}
    shape = tuple(given["kv_num_blocks"].shape[:2]) + (cdiv(q_len, qbs), cdiv(kv_len, kbs))
    listed = [_listed_blocks(given, prefix, shape) for prefix in ("", "full_") if prefix + "kv_indices" in given]
    flat = np.concatenate(listed)
    if np.unique(flat).size != flat.size:
        raise MaskError("a kv block is listed twice in one row (within kv_indices, within full_kv_indices, "
                        "or in both); each block may appear once")
    if listed[0].size and mask_mod is None:
        raise MaskError(f"kv_num_blocks lists {int(listed[0].size)} partial blocks, whose element masks need "
                        "mask_mod= (the NumPy/CuPy form of flex's mask_mod)")
    if isinstance(mask_mod, MaskMod):
        mask_mod.check_extent(shape[0], q_len, kv_len)
    types = np.zeros(shape, dtype=np.int8)
    types.reshape(-1)[listed[0]] = EVALUATE
    if len(listed) > 1:
        types.reshape(-1)[listed[1]] = FULL
    build = _Build(mask_mod, shape[:2], q_len, kv_len, qbs, kbs, xp, mode)
    grid = shape[:3]
    items = items_from_runs(np.arange(int(np.prod(grid))), np.zeros(grid, dtype=np.int64),
                            np.ones(shape, dtype=np.int64), types, split=EVALUATE)
    return build.finish(items, grid)


def _listed_blocks(given: dict, prefix: str, shape: tuple):
    """Flat ids (into a grid of ``shape``) of the blocks one flex (num_blocks, indices) pair lists."""
    num_name, idx_name = prefix + "kv_num_blocks", prefix + "kv_indices"
    num, idx = given[num_name], given[idx_name]
    bm, hm, nqb, nkvb = shape
    if tuple(num.shape) != (bm, hm, nqb):
        raise MaskError(f"{num_name} must have shape {(bm, hm, nqb)} ([B, H, nQB] with nQB = ceil(q_len / "
                        f"q_block_size)), got {tuple(num.shape)}")
    if tuple(idx.shape[:3]) != (bm, hm, nqb):
        raise MaskError(f"{idx_name} shape {tuple(idx.shape)} must start with {num_name} shape {(bm, hm, nqb)}")
    maxb = int(idx.shape[3])
    if np.any((num < 0) | (num > maxb)):
        raise MaskError(f"{num_name} has entries outside [0, {maxb}] (the last dim of {idx_name})")
    b, h, q, slot = np.nonzero(np.arange(maxb) < num[..., None])
    kv = idx[b, h, q, slot].astype(np.int64)
    if np.any((kv < 0) | (kv >= nkvb)):
        raise MaskError(f"{idx_name} has listed entries outside [0, {nkvb}) (the number of kv blocks)")
    return ((b * hm + h) * nqb + q) * nkvb + kv


def _as_array(x: Any, name: str):
    if x is None:
        raise MaskError(f"{name} is required")
    return arrays.as_array(x, name)


# -------------------------------------------------------------------------- shared construction
class _Build:
    """One build: its mask_mod, sizes, where the metadata goes (``xp``, and the device ``backend``,
    None on the host) and how the mask_mod is called (``mode``)."""

    def __init__(self, mask_mod: Optional[Callable], batch_heads: tuple[int, int], q_len: int, kv_len: int,
                 qbs: int, kbs: int, xp: Any, mode: str, recorded: Optional[Callable] = None) -> None:
        self.mask_mod, self.batch_heads, self.mode = mask_mod, batch_heads, mode
        self.recorded = mask_mod if recorded is None else recorded  # the mask_mod the BlockMask remembers
        self.q_len, self.kv_len, self.qbs, self.kbs = q_len, kv_len, qbs, kbs
        self.nqb, self.nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
        self.xp, self.backend = xp, backend_for(xp)

    # ---------------------------------------------------------------- rows
    def causal_rows(self) -> BlockMask:
        """The causal rows, arithmetically: the metadata the structured path lays out for
        ``q_idx >= kv_idx`` (listed blocks 0 .. count - 1, FULL then CAUSAL, inactive slots 0),
        without windows, items or segments."""
        count, full_count = _causal_counts(self.q_len, self.kv_len, self.qbs, self.kbs)
        maxb = max(int(count.max()), 1)
        slot = np.arange(maxb, dtype=np.int32)
        active = slot < count[:, None]
        idx = slot * active  # int32, 0 past the listed blocks
        # MASKED 0, CAUSAL 1, FULL 2: listed blocks count 1, the FULL ones (a prefix of them) 1 more.
        types = active.astype(np.int32)
        types += slot < full_count[:, None]
        counts = count.astype(np.int32)
        summary, runs = _causal_summary(count, full_count, self.nkvb, copies=self.batch_heads[0] * self.batch_heads[1])
        if self.backend is not None:  # one upload: the three arrays are views of one device buffer
            rows = self.backend.upload(np.concatenate([counts, idx.reshape(-1), types.reshape(-1)]))
            n, shape = len(counts), idx.shape
            counts, idx, types = rows[:n], rows[n:n + idx.size].reshape(shape), rows[n + idx.size:].reshape(shape)
        else:
            for a in (counts, idx, types):
                a.flags.writeable = False
        xp = self.xp if self.backend is not None else np
        nb, idx, types = (xp.broadcast_to(a.reshape((1, 1) + a.shape), self.batch_heads + a.shape)
                          for a in (counts, idx, types))
        return BlockMask(nb, idx, types, q_len=self.q_len, kv_len=self.kv_len, q_block_size=self.qbs,
                         kv_block_size=self.kbs, mask_mod=self.mask_mod,
                         _features=MaskFeatures(causal=bool(np.any(count > full_count)), partial=False),
                         _summary=summary, _runs=runs)

    def every_block(self, grid: tuple[int, int, int], dense: Any = None) -> BlockMask:
        """Every block of every row of ``grid`` evaluated (the generic path, and a dense mask)."""
        rows = int(np.prod(grid))
        items = items_from_runs(np.arange(rows), np.zeros(rows, dtype=np.int64), np.full((rows, 1), self.nkvb),
                                np.int8(EVALUATE), split=EVALUATE)
        return self.finish(items, grid, dense=dense)

    def from_windows(self, windows) -> BlockMask:
        """Rows from a MaskMod's windows; with exact bounds the cut blocks come from their row runs
        (patterns.py), chunk by chunk, and nothing is evaluated."""
        parts, pattern_ids, pool = [], [], PatternPool(self.qbs, self.kbs)
        grid, exact = None, True
        for chunk in windows:
            bs, hs, n = chunk.first.shape
            grid = grid or (bs, hs, self.nqb)
            if (bs, hs) != grid[:2]:
                raise MaskError(f"the bounds of mask_mod {name_of(self.mask_mod)} broadcast over batch and heads "
                                f"differently from chunk to chunk ({grid[:2]}, then {(bs, hs)})")
            local = np.arange(bs * hs * n)
            b_h, q = np.divmod(local, n)
            row_ids = b_h * self.nqb + chunk.q_start + q
            lengths = np.stack([chunk.after, chunk.before - chunk.after, chunk.width - chunk.before], axis=-1)
            kinds = np.stack(np.broadcast_arrays(np.int8(EVALUATE), np.int8(FULL), chunk.tail), axis=-1)
            items = items_from_runs(row_ids, chunk.first, lengths, kinds, split=EVALUATE)
            ids = np.full(len(items.row), -1, dtype=np.int64)
            exact = exact and chunk.exact
            if exact and chunk.pieces is not None:
                self._cut_blocks_from_pieces(chunk.pieces, items, ids, pool)
            elif exact:
                self._cut_blocks(chunk, items, ids, pool)
            parts.append(items)
            pattern_ids.append(ids)
        if len(parts) == 1:  # one chunk (every build from pieces, most from rows): nothing to join
            items, ids = parts[0], pattern_ids[0]
        else:
            items = Items(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("row", "kv", "length", "kind")))
            ids = np.concatenate(pattern_ids)
        if len(parts) > 1 and grid[0] * grid[1] > 1:  # chunks split rows: back to (row, kv) order
            order = np.argsort(items.row, kind="stable")
            items, ids = items.select(order), ids[order]
        if exact:  # (PARTIAL and EVALUATE share a value: `exact` tells them apart)
            return self._exact(items, ids, pool, grid)
        return self.finish(items, grid)

    def _cut_blocks(self, chunk, items: Items, ids: np.ndarray, pool: PatternPool) -> None:
        """Types (in ``items.kind``) and partial pattern ids (in ``ids``) of a chunk's cut blocks,
        from the rows' bounds."""
        at = np.flatnonzero(items.kind == EVALUATE)
        if not at.size:
            return
        b_h, q = np.divmod(items.row[at], self.nqb)
        n = chunk.first.shape[2]
        local = b_h * n + q - chunk.q_start  # row of the chunk's [Bs * Hs * n, qbs] bounds
        q0, kv0 = q * self.qbs, items.kv[at] * self.kbs
        start, end = (np.take(a.reshape(-1, self.qbs), local, axis=0) for a in (chunk.start, chunk.end))
        types, codes = cut_blocks(start, end, q0, kv0, self.q_len, self.kv_len, self.kbs)
        items.kind[at] = types
        partial = types == PARTIAL
        ids[at[partial]] = pool.add(codes[partial])

    def _cut_blocks_from_pieces(self, rows: BlockPieces, items: Items, ids: np.ndarray, pool: PatternPool) -> None:
        """``_cut_blocks`` from the bounds' pieces: the cut blocks are grouped by their pattern's key
        (pieces.py) and only one block of each group is written out as rows and classified."""
        at = np.flatnonzero(items.kind == EVALUATE)
        if not at.size:
            return
        q_block, kv0 = items.row[at] % self.nqb, items.kv[at] * self.kbs  # broadcast rows: (b, h) = (0, 0)
        if len(at) > GROUP_CUT_BLOCKS_FROM:
            reps, group = group_cut_blocks(rows, q_block, kv0, self.kv_len, self.kbs)
        else:  # few: classifying every one costs less than grouping them
            reps = group = np.arange(len(at))
        start, end = rows.block_rows(q_block[reps])
        types, codes = cut_blocks(start, end, q_block[reps] * self.qbs, kv0[reps], self.q_len, self.kv_len, self.kbs)
        rep_ids = np.full(len(reps), -1, dtype=np.int64)
        partial = types == PARTIAL
        rep_ids[partial] = pool.add(codes[partial])
        items.kind[at] = types[group]
        ids[at] = rep_ids[group]

    def _exact(self, items: Items, ids: np.ndarray, pool: PatternPool, grid) -> BlockMask:
        partial = np.flatnonzero(items.kind == PARTIAL)
        bits, rank = pool.finish(ids[partial])
        pidx = None
        if bits is not None:
            pidx = np.zeros(len(items.row), dtype=np.int32)
            pidx[partial] = rank
        return self._assemble(Items(items.row, items.kv, items.length, items.kind, pidx), bits, grid)

    # ------------------------------------------------------------ evaluation
    def finish(self, items: Items, grid, dense: Any = None) -> BlockMask:
        """Evaluate the EVALUATE items (one block each), then lay the rows out."""
        at = np.flatnonzero(items.kind == EVALUATE)
        pool, pidx = None, None
        if at.size:
            b_h, qb = np.divmod(items.row[at], grid[2])
            b, h = np.divmod(b_h, grid[1])
            coords = np.stack([b, h, qb * self.qbs, items.kv[at] * self.kbs], axis=1).astype(np.int64)
            types, pool, pool_index = self._evaluate(coords, dense)
            items.kind[at] = types
            if pool is not None:
                pidx = np.zeros(len(items.row), dtype=np.int32)
                pidx[at[types == PARTIAL]] = pool_index
        return self._assemble(Items(items.row, items.kv, items.length, items.kind, pidx), pool, grid)

    def _evaluate(self, coords: np.ndarray, dense: Any):
        """Types ([K] int8, host), the pool (in ``xp`` or NumPy) and the PARTIAL blocks' pool indices
        of K blocks given by their coords ``[K, 4]`` (b, h, q0, kv0)."""
        if dense is not None:
            return self._classify(coords, dense=dense)
        if self.mode == "scalar":
            return self._scalar(coords)
        try:
            return self._classify(coords)
        except BroadcastFailure as failure:
            if self.mode == "broadcast":
                raise
            calls = evaluate.scalar_calls(len(coords), self.qbs, self.kbs)
            if calls > evaluate.AUTO_SCALAR_CALL_LIMIT:
                raise MaskError(f"{failure} (the scalar mode would take {calls} calls here, more than the "
                                f"{evaluate.AUTO_SCALAR_CALL_LIMIT} it is tried with automatically: pass "
                                "mode='scalar' to wait for them)") from failure
            evaluate.announce_fallback(self.mask_mod, failure)
            return self._scalar(coords)

    def _classify(self, coords: np.ndarray, dense: Any = None):
        """The broadcast path (or a dense mask), chunk by chunk, on the host or the device."""
        qbs, kbs = self.qbs, self.kbs
        backend = self.backend
        if dense is None and backend is not None and _evaluation_module(self.mask_mod, self.xp) is np:
            backend = None  # the mask_mod takes NumPy arrays only: evaluated on the host
        k = len(coords)
        budget = DEVICE_CHUNK_ELEMENTS if backend is not None else CHUNK_ELEMENTS
        per_chunk = max(1, budget // (qbs * kbs))
        on_device = backend.upload(coords) if backend is not None else coords
        types, hashes, kept = [], [], []
        for lo in range(0, k, per_chunk):
            hi = min(lo + per_chunk, k)
            at = on_device[lo:hi]
            if backend is None:
                bits = (_dense_bits(dense, coords[lo:hi], self.q_len, self.kv_len, qbs, kbs) if dense is not None
                        else _packed(self._evaluate_grid(at, np), hi - lo, qbs, kbs))
                chunk_types = blocks.block_types(bits, coords[lo:hi, 2], coords[lo:hi, 3], self.q_len, self.kv_len)
                chunk_hashes = blocks.block_hashes(bits)
            else:
                elements = dense if dense is not None else self._evaluate_grid(at, self.xp, backend)
                bits, summary = backend.classify(elements, dense is not None, at, qbs, kbs, self.q_len, self.kv_len)
                summary = backend.download(summary)  # the one wait of the chunk
                chunk_hashes, chunk_types = summary[:hi - lo], summary[hi - lo:].astype(np.int8)
            if lo == 0 and dense is None:
                self._check_elementwise(coords[lo:hi], bits, chunk_types, backend)
            types.append(chunk_types)
            partial = np.flatnonzero(chunk_types == PARTIAL)
            hashes.append(chunk_hashes[partial])
            kept.append((bits, partial))
        types, hashes = np.concatenate(types), np.concatenate(hashes)
        if not len(hashes):
            return types, None, None
        if len(kept) == 1:
            bits, rows = kept[0]
        elif backend is None:
            bits, rows = np.concatenate([b[p] for b, p in kept]), None
        else:  # the partial blocks of every chunk, side by side, by the gather kernel
            bits = self.xp.empty((len(hashes), qbs, kbs // PARTIAL_WORD_BITS), dtype=np.uint32)
            offset = 0
            for chunk_bits, partial in kept:
                backend.gather_blocks(chunk_bits, partial, bits, offset + np.arange(len(partial)))
                offset += len(partial)
            rows = None
        pool, index = blocks.deduplicate(bits, rows, hashes, self.xp if backend is not None else np, backend)
        return types, pool, index

    def _evaluate_grid(self, at, xp, backend: Optional[Backend] = None):
        """The mask_mod on the blocks ``at`` ``[K, 4]`` (in ``xp``), broadcast to ``[K, qbs, kbs]``."""
        global _said_cupy_compiles
        k = int(at.shape[0])
        if backend is not None:
            q, kv = backend.block_indices(at, self.qbs, self.kbs, self.q_len, self.kv_len)
            if not _said_cupy_compiles and getattr(xp, "__name__", "") == "cupy":
                _said_cupy_compiles = True
                logger.warning("evaluating mask_mod %s on the GPU with CuPy: CuPy compiles the kernels of its "
                               "operations at their first use (seconds on a fresh machine, cached by CuPy after). "
                               "Masks with exact row bounds (the built-in masks but dilated windows and or/not "
                               "combinations) are built without evaluating them.", name_of(self.mask_mod))
        else:
            q = np.minimum(at[:, 2, None] + np.arange(self.qbs), self.q_len - 1)
            kv = np.minimum(at[:, 3, None] + np.arange(self.kbs), self.kv_len - 1)
        return evaluate.evaluate_grid(self.mask_mod, at[:, 0, None, None], at[:, 1, None, None], q[:, :, None],
                                      kv[:, None, :], (k, self.qbs, self.kbs), xp)

    def _check_elementwise(self, coords: np.ndarray, bits, types: np.ndarray, backend: Optional[Backend]) -> None:
        """Once per mask_mod not known to be elementwise: sampled elements of a few evaluated blocks
        against calls with four scalars (flex's own semantics). A mask_mod that indexes with its
        arguments as if they were numbers can return a wrong mask of the right shape: this finds it."""
        mod = self.mask_mod
        if _is_known_elementwise(mod):
            return
        for i in sorted({0, len(coords) // 2, len(coords) - 1}):
            b, h, q0, kv0 = (int(v) for v in coords[i])
            real_rows, real_cols = min(self.qbs, self.q_len - q0), min(self.kbs, self.kv_len - kv0)
            r, c = evaluate.sample_positions(real_rows, real_cols, seed=i)
            truth = evaluate.scalar_values(mod, b, h, q0 + r, kv0 + c)
            if truth is None:
                return  # it cannot be called with scalars: nothing to compare
            block = arrays.to_numpy(bits[i]) if backend is None else backend.download(bits[i])
            got = ((block[r, c // PARTIAL_WORD_BITS] >> (c % PARTIAL_WORD_BITS).astype(np.uint32)) & 1).astype(bool)
            if not np.array_equal(got, truth):
                bad = int(np.flatnonzero(got != truth)[0])
                raise BroadcastFailure(
                    f"mask_mod {name_of(mod)} gives a different answer on broadcast index arrays ({bool(got[bad])}) "
                    f"than when called with scalars ({bool(truth[bad])}) at b={b}, h={h}, q_idx={q0 + r[bad]}, "
                    f"kv_idx={kv0 + c[bad]}: it is not elementwise. {evaluate.CONTRACT}")
        with contextlib.suppress(TypeError):
            _ELEMENTWISE.add(mod)

    def _scalar(self, coords: np.ndarray):
        """The scalar mode (evaluate.py), chunk by chunk, its results packed on the host; the pool goes
        to ``xp``. Index arrays are CuPy when the mask_mod takes CuPy arrays (its tables may be CuPy)."""
        index_module = np if self.backend is None else _evaluation_module(self.mask_mod, self.xp)
        scalar = ScalarEvaluator(self.mask_mod, self.q_len, self.kv_len, self.qbs, self.kbs, index_module)
        per_chunk = max(1, CHUNK_ELEMENTS // (self.qbs * self.kbs))
        types, hashes, kept = [], [], []
        for lo in range(0, len(coords), per_chunk):
            chunk = coords[lo:lo + per_chunk]
            grid = np.stack([scalar.block(*(int(v) for v in row)) for row in chunk])
            bits = _packed(grid, len(chunk), self.qbs, self.kbs)
            chunk_types = blocks.block_types(bits, chunk[:, 2], chunk[:, 3], self.q_len, self.kv_len)
            partial = chunk_types == PARTIAL
            types.append(chunk_types)
            hashes.append(blocks.block_hashes(bits)[partial])
            kept.append(bits[partial])
        types, hashes = np.concatenate(types), np.concatenate(hashes)
        if not len(hashes):
            return types, None, None
        pool, index = blocks.deduplicate(np.concatenate(kept), None, hashes, np)
        return types, pool, index

    # ---------------------------------------------------------------- layout
    def _assemble(self, items: Items, pool: Any, grid: tuple[int, int, int]) -> BlockMask:
        """Items with their final types -> BlockMask broadcast to ``batch_heads``, arrays in ``xp``."""
        bs, hs, nqb = grid
        copies = (self.batch_heads[0] // bs) * (self.batch_heads[1] // hs)
        features = MaskFeatures(causal=bool(np.any(items.kind == CAUSAL)), partial=pool is not None)
        summary = summary_of(items, grid, copies, self.nkvb)
        segments = segments_of(items, bs * hs * nqb)
        if self.backend is None:
            nb, idx, types, pidx = write_host(segments)
            pool = None if pool is None else np.asarray(arrays.to_numpy(pool))
            for a in (nb, idx, types, pidx, pool):
                if a is not None:
                    a.flags.writeable = False
        else:
            nb, idx, types, pidx = self.backend.layout(device_table(segments), segments.rows, segments.max_blocks,
                                                       len(segments.start), pool is not None)
            if pool is not None and not arrays.is_cupy(pool) and self.backend.xp is not np:
                pool = self.backend.upload(np.ascontiguousarray(pool))
        maxb = segments.max_blocks
        # Rows computed for one (b, h) stand for all of them: zero-stride views, no copies.
        xp = self.xp if self.backend is not None else np
        nb = xp.broadcast_to(nb.reshape(grid), self.batch_heads + (nqb,))
        idx, types, pidx = (None if a is None else xp.broadcast_to(a.reshape(grid + (maxb,)),
                                                                   self.batch_heads + (nqb, maxb))
                            for a in (idx, types, pidx))
        listed = items.kind != MASKED
        runs = RowRuns(grid, items.row[listed], items.kv[listed], items.length[listed], items.kind[listed])
        return BlockMask(nb, idx, types, q_len=self.q_len, kv_len=self.kv_len, q_block_size=self.qbs,
                         kv_block_size=self.kbs, partial_block_mask_indices=pidx, partial_block_masks=pool,
                         mask_mod=self.recorded, _features=features, _summary=summary, _runs=runs)


def _packed(allowed, k: int, qbs: int, kbs: int) -> np.ndarray:
    """Booleans ``[K, qbs, kbs]`` (host) -> bits ``[K, qbs, kbs / 32]`` uint32 (bit c of word w =
    column 32w + c: little bit order in little-endian words)."""
    return np.packbits(allowed, axis=-1, bitorder="little").view(np.uint32).reshape(k, qbs, kbs // PARTIAL_WORD_BITS)


def _dense_bits(mask: np.ndarray, coords: np.ndarray, q_len: int, kv_len: int, qbs: int, kbs: int) -> np.ndarray:
    """The packed blocks ``[K, qbs, W]`` of a host dense mask ``[B, H, Nq, Nkv]`` at ``coords``,
    positions past the ends 0: each block's rows are sliced and packed, no index arrays."""
    words = kbs // PARTIAL_WORD_BITS
    out = np.zeros((len(coords), qbs, words), dtype=np.uint32)
    # Blocks of one q block row share their rows: pack each (b, h, q block) row of blocks at once.
    keys = coords[:, 0] * (1 << 40) + coords[:, 1] * (1 << 32) + coords[:, 2]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    ends = np.r_[starts[1:], len(coords)]
    for s, e in zip(starts, ends):
        b, h, q0 = (int(v) for v in coords[s, :3])
        rows = mask[b, h, q0:min(q0 + qbs, q_len)]
        kv0, kv1 = int(coords[s, 3]), min(int(coords[e - 1, 3]) + kbs, kv_len)
        padded = np.zeros((qbs, int(coords[e - 1, 3]) + kbs - kv0), dtype=bool)
        padded[:rows.shape[0], :kv1 - kv0] = rows[:, kv0:kv1]
        packed = np.packbits(padded, axis=-1, bitorder="little").view(np.uint32)
        cols = (coords[s:e, 3] - kv0) // PARTIAL_WORD_BITS
        out[s:e] = packed[:, cols[:, None] + np.arange(words)].transpose(1, 0, 2)
    return out


__all__ = ["full", "causal", "reblocked", "from_mask_mod", "from_dense", "from_flex", "default_array_module", "precompile_specs",
           "CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS"]
