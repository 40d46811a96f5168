"""One build of BlockMask metadata from evaluated or structured rows (the pass every builder of
builders.py but the rules runs): ``_Build`` turns a mask_mod's windows, pieces or evaluated blocks
into items, classifies and packs blocks in bounded chunks, and lays out the metadata; with the
chunk sizes, the array-module choice and the causal rows' arithmetic it shares with the rules.
Knows the build pass; the public builders and their arguments are builders.py's.
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
from . import blocks, evaluate, pieces_build, zoo
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


def _is_known_elementwise(mask_mod: Callable) -> bool:
    from .expressions import CudaExpr  # an expression runs as an elementwise kernel

    if getattr(mask_mod, "pointwise", False) or isinstance(getattr(mask_mod, "cuda", None), CudaExpr):
        return True
    with contextlib.suppress(TypeError):
        return mask_mod in _ELEMENTWISE
    return False


# ---------------------------------------------------------------------------------- the rules
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
