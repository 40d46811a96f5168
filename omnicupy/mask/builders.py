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

from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError
from . import blocks, compile_mask, evaluate, pieces_build, zoo  # noqa: F401 - blocks: read as builders.blocks
from .block_mask import BlockMask, MaskSummary, RowRuns, _as_index_array, _check_positive_int, check_sizes
from .kernels import backend_for, precompile_specs  # noqa: F401 - read as builders.* by tests and tools
from .layout import items_from_runs
from .mask_mod import EVALUATE, FULL, MaskMod, check_mask_mod, name_of
from .types import BlockType, MaskFeatures, cdiv

from .build_pass import (CHUNK_ELEMENTS, DEVICE_CHUNK_ELEMENTS,  # noqa: F401 - read by benchmarks/bench_masks.py
                         _Build, _causal_counts, _causal_summary, _evaluation_module,  # noqa: F401
                         default_array_module, logger)

#: Causal rows (a MaskMod whose exact bounds are ``[0, q_idx + 1)``) are written arithmetically, as
#: ``BlockMask.causal`` computes them, with the layout of the structured path, up to this many
#: slots of the [nQB, nKVB] grid (N = 16384 at blocks of 128). Past it the arrays themselves cost
#: more than the structured path's work: fresh pages on the host, the upload on a device, where
#: the layout kernel writes them instead (lab/notes/masks.md#s19).
CAUSAL_ROWS_MAX_SLOTS = 1 << 14

def _is_causal(mask_mod: MaskMod) -> bool:
    """Whether a MaskMod's exact bounds are the causal ones, ``[0, q_idx + 1)`` on every row (its
    pieces say so: one piece, start 0, end q + 1). Exact bounds are the mask, whatever its function."""
    p = mask_mod.pieces
    return (p is not None and len(p.q) == 1 and int(p.start[0]) == 0 and int(p.start_slope[0]) == 0
            and int(p.end[0]) == 1 and int(p.end_slope[0]) == 1)


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
