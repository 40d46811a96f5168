"""A zoo of mask_mods in attention-gym's vocabulary, each also knowing its block structure.

A mask_mod is ``f(b, h, q_idx, kv_idx) -> bool array``, evaluated on broadcast integer arrays
(NumPy, or CuPy on the GPU), so a flex-attention mask_mod ports by swapping ``torch`` for ``xp``.
The masks here use operators only (``&``, ``|``, comparisons, arithmetic, indexing of small
lookup tables), so one function serves both array modules.

    bm = BlockMask.from_mask_mod(masks.sliding_window(1024), None, None, N, N)
    mod = masks.and_masks(masks.causal(), masks.document(doc_ids))

Structure: most built-in masks allow, in every query row, one interval of keys,
``start(q) <= kv_idx < end(q)`` ("row bounds"). From those intervals ``MaskMod.block_rows`` finds,
with NumPy in O(N) plus its output and without evaluating any element, the window of kv blocks each
q block can reach and which of them are FULL or CAUSAL; only the blocks cut by an interval end are
evaluated element by element (builders.py).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from . import arrays
from .block_mask import BlockType, cdiv
from .checks import check_int
from .errors import MaskError

#: In types from ``block_rows``, PARTIAL means "cut by an interval end: evaluate the
#: elements". Evaluation then turns each such block into its true type (which may be any).
EVALUATE = int(BlockType.PARTIAL)
MASKED, CAUSAL, FULL = int(BlockType.MASKED), int(BlockType.CAUSAL), int(BlockType.FULL)

BoundsFn = Callable[[Any, Any, Any], tuple]


class MaskMod:
    """A mask_mod ``fn(b, h, q_idx, kv_idx) -> bool`` with a name and, optionally, its structure.

    ``bounds(b, h, q_idx) -> (start, end)``: every allowed kv of row ``q_idx`` lies in
    ``[start, end)``; when ``bounds_exact``, every kv in that range is allowed too (with
    ``bounds_exact=False`` the interval only rules blocks out). The bounds must broadcast over every
    (b, h) the mask depends on; they are called with NumPy arrays (O(N) work, on the host). ``length`` is the number of positions the mask is defined for (its
    lookup tables' length; None: any), ``batch`` the number of batch rows it has data for (None: it
    does not depend on b). ``cuda_expr`` is the rule as a CUDA C expression, for later fusion into
    the kernel; nothing reads it yet.
    """

    def __init__(self, fn: Callable, name: Optional[str] = None, *, bounds: Optional[BoundsFn] = None,
                 bounds_exact: bool = True, length: Optional[int] = None, batch: Optional[int] = None,
                 cuda_expr: Optional[str] = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "mask_mod")
        self.__name__ = self.name  # flex-attention and attention-gym read __name__
        self.__doc__ = fn.__doc__
        self.bounds = bounds
        self.bounds_exact = bounds_exact
        self.length = length
        self.batch = batch
        self.cuda_expr = cuda_expr

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"MaskMod({self.name})"

    def check_extent(self, B: Optional[int], q_len: int, kv_len: int) -> None:
        """Raise MaskError when (B, q_len, kv_len) reach past the data this mask is defined for."""
        if self.length is not None and max(q_len, kv_len) > self.length:
            raise MaskError(f"mask_mod {self.name} is defined for {self.length} positions, "
                            f"but q_len={q_len} and kv_len={kv_len}")
        if self.batch is not None and (B or 1) != self.batch:
            raise MaskError(f"mask_mod {self.name} has per-batch data for {self.batch} rows; "
                            f"pass B={self.batch} (got B={B})")

    def block_rows(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int,
                   kv_block_size: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The block types from the row bounds, row by row, or None when the structure is unknown:
        ``(first, types)``, ``first`` ``[Bs, Hs, nQB]`` and ``types`` ``[Bs, Hs, nQB, C]`` (int8,
        Bs in {1, B}, Hs in {1, H}), where ``types[..., s]`` is the type of kv block ``first + s``
        and every block outside a row's window is MASKED. MASKED, FULL and CAUSAL are exact;
        EVALUATE (PARTIAL) blocks need their elements evaluated. Only real positions (< q_len,
        < kv_len) count, like the element-level classification. NumPy, O(N + the output)."""
        found = self.block_runs(B, H, q_len, kv_len, q_block_size, kv_block_size)
        if found is None:
            return None
        first, lengths, kinds = found
        types = np.repeat(kinds.reshape(-1), lengths.reshape(-1)).reshape(first.shape + (-1,))
        return first, types

    def block_runs(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int,
                   kv_block_size: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``block_rows`` before its rows are written out, O(N) (the builders' input): ``(first,
        lengths, kinds)``, ``lengths`` and ``kinds`` ``[Bs, Hs, nQB, 4]``: from kv block ``first`` on,
        each row is ``lengths[..., i]`` blocks of type ``kinds[..., i]``: EVALUATE, FULL, CAUSAL or
        EVALUATE, then MASKED up to the common width C (every row's lengths sum to C)."""
        if self.bounds is None:
            return None
        qbs, kbs = q_block_size, kv_block_size
        nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
        # Padding rows repeat the last real row, so per-block min / max / all see only real rows.
        q = np.arange(nqb * qbs).reshape(1, 1, -1)
        q[..., q_len:] = q_len - 1
        start, end = self.bounds(np.arange(B).reshape(-1, 1, 1), np.arange(H).reshape(1, -1, 1), q)
        start, end, q = np.broadcast_arrays(np.asarray(start), np.asarray(end), q)
        rows = start.shape[:2] + (nqb, qbs)
        start, end, q = (a.reshape(rows) for a in (start, end, q))
        lo_start, hi_start, lo_end, hi_end = start.min(-1), start.max(-1), end.min(-1), end.max(-1)
        # The window: the blocks with a column in [lo_start, hi_end), the hull of the rows'
        # intervals; the others are MASKED. Block k's columns are [k * kbs, min((k + 1) * kbs, kv_len)).
        first = np.where(lo_start < kv_len, np.maximum(lo_start // kbs, 0), nkvb)
        width = np.clip(-(-hi_end // kbs), first, nkvb) - first
        if self.bounds_exact:
            # In the window (offsets from `first`): blocks from `after` on begin at or after every
            # row's start, blocks before `before` end before every row's end, so those in between are
            # FULL. When every row ends at its diagonal (end = q + 1), the blocks from `before` on
            # allow exactly q_idx >= kv_idx: CAUSAL. The rest are cut by a start or an end: EVALUATE.
            after = np.clip(-(-hi_start // kbs) - first, 0, width)
            before = np.clip(np.where(lo_end >= kv_len, nkvb, lo_end // kbs) - first, after, width)
            tail = np.where((end == q + 1).all(-1), CAUSAL, EVALUATE)
        else:
            after = before = width
            tail = np.full(width.shape, EVALUATE)
        # Each row is four runs: EVALUATE, FULL, CAUSAL or EVALUATE, MASKED (to a common width).
        cols = max(int(width.max()), 1)
        runs = np.stack([after, before - after, width - before, cols - width], axis=-1)
        kinds = np.stack(np.broadcast_arrays(EVALUATE, FULL, tail, MASKED), axis=-1).astype(np.int8)
        return first, runs, kinds

    def classify_blocks(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int, kv_block_size: int,
                        xp: Any = np) -> Optional[Any]:
        """``block_rows`` as a dense grid ``[Bs, Hs, nQB, nKVB]`` (int8, in ``xp``), for inspection."""
        found = self.block_rows(B, H, q_len, kv_len, q_block_size, kv_block_size)
        if found is None:
            return None
        first, types = found
        grid = np.zeros(first.shape + (cdiv(kv_len, kv_block_size),), dtype=np.int8)
        b, h, q, s = np.nonzero(types)
        grid[b, h, q, first[b, h, q] + s] = types[b, h, q, s]
        return xp.asarray(grid)


class _Table:
    """A lookup table (doc ids, row bounds, a dense mask) that follows the index arrays: the same
    array when they live in the same module, else a copy made once per module and device, so one
    mask_mod serves NumPy and CuPy index arrays."""

    def __init__(self, values: Any) -> None:
        self._copies = {self._where(values): values}

    @staticmethod
    def _where(x: Any):
        return x.device.id if arrays.is_cupy(x) else "host"

    def on(self, like: Any):
        """The table in the module (and on the device) of the index array ``like``."""
        key = self._where(like)
        table = self._copies.get(key)
        if table is None:
            host = arrays.to_numpy(next(iter(self._copies.values())))
            if key == "host":
                table = host
            else:
                with like.device:
                    table = arrays.cupy_module().asarray(host)
            self._copies[key] = table
        return table

    def lookup(self, b, idx):
        """``table[idx]`` for a 1-D table, ``table[b, idx]`` for a per-batch 2-D one."""
        table = self.on(idx)
        return table[idx] if table.ndim == 1 else table[b, idx]


def _check_int(value: Any, name: str, minimum: int) -> int:
    return check_int(value, name, minimum=minimum, error=MaskError)


def _xp(x):
    return arrays.array_namespace(x)


# ------------------------------------------------------------------------------------- band masks
def causal(offset: int = 0) -> MaskMod:
    """``q_idx + offset >= kv_idx``: offset 0 is top-left aligned (flex-attention's convention);
    ``offset = kv_len - q_len`` aligns the last query with the last key (bottom-right)."""
    offset = _check_int(offset, "offset", -2**31)
    if offset == 0:
        def causal(b, h, q_idx, kv_idx):
            """q_idx >= kv_idx"""
            return q_idx >= kv_idx

        return MaskMod(causal, "causal", bounds=lambda b, h, q: (0, q + 1), cuda_expr="q_idx >= kv_idx")

    def causal_offset(b, h, q_idx, kv_idx):
        """q_idx + offset >= kv_idx"""
        return q_idx + offset >= kv_idx

    return MaskMod(causal_offset, f"causal_offset_{offset}", bounds=lambda b, h, q: (0, q + offset + 1),
                   cuda_expr=f"q_idx + ({offset}) >= kv_idx")


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: ``0 <= q_idx - kv_idx < window`` (each query sees ``window`` keys,
    itself included)."""
    window = _check_int(window, "window", 1)

    def sliding_window(b, h, q_idx, kv_idx):
        """(q_idx >= kv_idx) & (q_idx - kv_idx < window)"""
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return MaskMod(sliding_window, f"sliding_window_{window}", bounds=lambda b, h, q: (q - window + 1, q + 1),
                   cuda_expr=f"q_idx >= kv_idx && q_idx - kv_idx < {window}")


def local_window(left: int, right: int) -> MaskMod:
    """Bidirectional window: ``q_idx - left <= kv_idx <= q_idx + right``."""
    left, right = _check_int(left, "left", 0), _check_int(right, "right", 0)

    def local_window(b, h, q_idx, kv_idx):
        """(kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)"""
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return MaskMod(local_window, f"local_window_{left}_{right}", bounds=lambda b, h, q: (q - left, q + right + 1),
                   cuda_expr=f"kv_idx >= q_idx - {left} && kv_idx <= q_idx + {right}")


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix LM: the first ``prefix_len`` keys are seen by every query, the rest causally:
    ``(kv_idx < prefix_len) | (q_idx >= kv_idx)``."""
    prefix_len = _check_int(prefix_len, "prefix_len", 0)

    def prefix_lm(b, h, q_idx, kv_idx):
        """(kv_idx < prefix_len) | (q_idx >= kv_idx)"""
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return MaskMod(prefix_lm, f"prefix_lm_{prefix_len}", bounds=lambda b, h, q: (0, _xp(q).maximum(prefix_len, q + 1)),
                   cuda_expr=f"kv_idx < {prefix_len} || q_idx >= kv_idx")


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    """Causal dilated window (Longformer's): ``window`` keys spaced ``dilation`` apart,
    ``d = q_idx - kv_idx``, ``0 <= d < window * dilation`` and ``d % dilation == 0``.
    ``dilation=1`` is ``sliding_window(window)``."""
    window, dilation = _check_int(window, "window", 1), _check_int(dilation, "dilation", 1)
    span = window * dilation

    def dilated_sliding_window(b, h, q_idx, kv_idx):
        """d = q_idx - kv_idx; (d >= 0) & (d < window * dilation) & (d % dilation == 0)"""
        d = q_idx - kv_idx
        return (d >= 0) & (d < span) & (d % dilation == 0)

    # The band bounds the allowed keys; inside it the dilation leaves holes, so (unless
    # dilation == 1) the band rules blocks out but every block in it is evaluated.
    return MaskMod(dilated_sliding_window, f"dilated_sliding_window_{window}_dilation_{dilation}",
                   bounds=lambda b, h, q: (q - span + 1, q + 1), bounds_exact=dilation == 1,
                   cuda_expr=f"q_idx >= kv_idx && q_idx - kv_idx < {span} && (q_idx - kv_idx) % {dilation} == 0")


# ---------------------------------------------------------------------------------- segment masks
def doc_ids_from_lengths(lengths: Iterable[int]) -> np.ndarray:
    """Document ids ``[0]*l0 + [1]*l1 + ...`` (int32) for packed sequences of the given lengths."""
    lengths = [_check_int(n, "lengths[i]", 1) for n in lengths]
    if not lengths:
        raise MaskError("lengths must not be empty")
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


def _run_bounds(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every position, the start and the end (exclusive) of its run of equal ids (last axis)."""
    n = ids.shape[-1]
    pos = np.arange(n)
    new_run = np.ones(ids.shape, dtype=bool)
    new_run[..., 1:] = ids[..., 1:] != ids[..., :-1]
    run_ends = np.ones(ids.shape, dtype=bool)
    run_ends[..., :-1] = new_run[..., 1:]
    start = np.maximum.accumulate(np.where(new_run, pos, 0), axis=-1)
    end = np.minimum.accumulate(np.where(run_ends, pos + 1, n)[..., ::-1], axis=-1)[..., ::-1]
    return start, end


def _documents(ids: np.ndarray, causal: bool, name: str) -> MaskMod:
    """Tokens attend within their own document (id), causally or not; ids [N] or per-batch [B, N]."""
    table = _Table(ids)

    def document(b, h, q_idx, kv_idx):
        """doc[q_idx] == doc[kv_idx] (& q_idx >= kv_idx when causal); doc[b, .] for per-batch ids"""
        same = table.lookup(b, q_idx) == table.lookup(b, kv_idx)
        return same & (q_idx >= kv_idx) if causal else same

    # Row bounds are the run of equal ids around q: exact only when every document is one
    # contiguous run (packed sequences); otherwise no structure and every block is evaluated.
    bounds = None
    n_runs = 1 + np.count_nonzero(np.diff(ids, axis=-1), axis=-1)
    n_docs = 1 + np.count_nonzero(np.diff(np.sort(ids, axis=-1), axis=-1), axis=-1)
    if np.array_equal(n_runs, n_docs):
        run_start, run_end = (_Table(a) for a in _run_bounds(ids))

        def bounds(b, h, q):
            return run_start.lookup(b, q), q + 1 if causal else run_end.lookup(b, q)

    return MaskMod(document, name, bounds=bounds, length=ids.shape[-1], batch=ids.shape[0] if ids.ndim == 2 else None)


def document(doc_ids: Any, causal: bool = True) -> MaskMod:
    """Packed sequences: ``doc[q_idx] == doc[kv_idx]``, and ``q_idx >= kv_idx`` when ``causal``.

    ``doc_ids`` is an integer array ``[N]`` or per-batch ``[B, N]`` (then index ``doc[b, .]`` and
    build with that B); N must cover q_len and kv_len."""
    ids = arrays.to_numpy(doc_ids)
    if ids.ndim not in (1, 2) or ids.shape[-1] == 0 or ids.shape[0] == 0:
        raise MaskError(f"doc_ids must be a non-empty integer array [N] or [B, N], got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise MaskError(f"doc_ids must be an integer array, got dtype {ids.dtype}")
    n_docs = len(np.unique(ids))
    return _documents(ids, bool(causal), f"document_{'' if causal else 'noncausal_'}{n_docs}docs")


def block_diagonal(sizes: Sequence[int]) -> MaskMod:
    """Bidirectional blocks on the diagonal: tokens attend to every token of their own block
    (blocks of the given sizes, back to back): ``blk[q_idx] == blk[kv_idx]``."""
    ids = doc_ids_from_lengths(sizes)
    return _documents(ids, False, f"block_diagonal_{int(ids[-1]) + 1}blocks")


def interleaved(segments: Sequence[tuple[str, int]]) -> MaskMod:
    """Interleaved text and images (the VLM case), ``segments`` of ``("text", n)`` and ``("image", n)``:
    text tokens attend causally to everything before them, image tokens to everything before the
    image and to the whole image. Equivalently ``kv_idx < limit[q_idx]`` with ``limit = q_idx + 1``
    for text and the image's end for image tokens."""
    kinds, sizes = [], []
    for i, seg in enumerate(segments):
        if not (isinstance(seg, (tuple, list)) and len(seg) == 2 and seg[0] in ("text", "image")):
            raise MaskError(f"segments[{i}] must be ('text', n) or ('image', n), got {seg!r}")
        kinds.append(seg[0] == "image")
        sizes.append(_check_int(seg[1], f"segments[{i}] length", 1))
    if not sizes:
        raise MaskError("segments must not be empty")
    ends = np.cumsum(sizes)
    pos = np.arange(int(ends[-1]))
    limit = _Table(np.where(np.repeat(kinds, sizes), np.repeat(ends, sizes), pos + 1))

    def interleaved(b, h, q_idx, kv_idx):
        """kv_idx < limit[q_idx] (text: q_idx + 1; image: the image's end)"""
        return kv_idx < limit.lookup(b, q_idx)

    n_image = sum(kinds)
    return MaskMod(interleaved, f"interleaved_{len(sizes) - n_image}text_{n_image}image",
                   bounds=lambda b, h, q: (0, limit.lookup(b, q)), length=int(ends[-1]))


def dense(mask: Any) -> MaskMod:
    """A mask given element by element: a boolean array ``[B|1, H|1, Nq, Nkv]`` (NumPy or CuPy),
    ``mask[b, h, q_idx, kv_idx]``; size-1 batch and head dims broadcast."""
    if not arrays.is_cupy(mask):
        mask = np.asarray(mask)
    if mask.ndim != 4:
        raise MaskError(f"mask must be 4-D [B|1, H|1, Nq, Nkv], got shape {tuple(mask.shape)}")
    if mask.dtype != np.bool_:
        raise MaskError(f"mask must be a boolean array, got dtype {mask.dtype}")
    if 0 in mask.shape:
        raise MaskError(f"mask has a zero-size dimension: shape {tuple(mask.shape)}")
    table = _Table(mask)
    per_batch, per_head = mask.shape[0] > 1, mask.shape[1] > 1

    def dense(b, h, q_idx, kv_idx):
        """mask[b, h, q_idx, kv_idx]"""
        return table.on(q_idx)[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]

    return MaskMod(dense, f"dense_{mask.shape[2]}x{mask.shape[3]}", batch=mask.shape[0] if per_batch else None)


# ------------------------------------------------------------------------------------ combinators
def _as_mask_mods(mask_mods: Sequence[Callable], what: str) -> list[MaskMod]:
    if not mask_mods:
        raise MaskError(f"{what} needs at least one mask_mod")
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise MaskError(f"{what}: argument {i} is not callable ({type(m).__name__})")
    return [m if isinstance(m, MaskMod) else MaskMod(m) for m in mask_mods]


def _combined(fn: Callable, name: str, mods: list[MaskMod], **structure) -> MaskMod:
    """A MaskMod over ``mods``: defined where all of them are, for the batch rows they have data for."""
    lengths = [m.length for m in mods if m.length is not None]
    batches = {m.batch for m in mods if m.batch is not None}
    if len(batches) > 1:
        raise MaskError(f"{name}: the masks have per-batch data for different batch sizes {sorted(batches)}")
    return MaskMod(fn, name, length=min(lengths) if lengths else None, batch=batches.pop() if batches else None,
                   **structure)


def and_masks(*mask_mods: Callable) -> MaskMod:
    """Allowed where every mask allows: ``m1 & m2 & ...``."""
    mods = _as_mask_mods(mask_mods, "and_masks")

    def and_masks(b, h, q_idx, kv_idx):
        """m1 & m2 & ..."""
        return functools.reduce(operator.and_, (m(b, h, q_idx, kv_idx) for m in mods))

    # Intervals intersect into an interval: the structure survives when every mask has one.
    bounds = None
    if all(m.bounds is not None for m in mods):
        def bounds(b, h, q):
            xp = _xp(q)
            pairs = [m.bounds(b, h, q) for m in mods]
            start, end = pairs[0]
            for s, e in pairs[1:]:
                start, end = xp.maximum(start, s), xp.minimum(end, e)
            return start, end

    name = f"and_masks({', '.join(m.name for m in mods)})"
    return _combined(and_masks, name, mods, bounds=bounds, bounds_exact=all(m.bounds_exact for m in mods))


def or_masks(*mask_mods: Callable) -> MaskMod:
    """Allowed where any mask allows: ``m1 | m2 | ...`` (no block structure: evaluated)."""
    mods = _as_mask_mods(mask_mods, "or_masks")

    def or_masks(b, h, q_idx, kv_idx):
        """m1 | m2 | ..."""
        return functools.reduce(operator.or_, (m(b, h, q_idx, kv_idx) for m in mods))

    return _combined(or_masks, f"or_masks({', '.join(m.name for m in mods)})", mods)


def not_mask(mask_mod: Callable) -> MaskMod:
    """Allowed where the mask does not allow: ``~m`` (no block structure: evaluated)."""
    (mod,) = _as_mask_mods([mask_mod], "not_mask")

    def not_mask(b, h, q_idx, kv_idx):
        """~m"""
        return ~_xp(q_idx).asarray(mod(b, h, q_idx, kv_idx), dtype=bool)

    return _combined(not_mask, f"not_mask({mod.name})", [mod])


__all__ = [
    "MaskMod", "EVALUATE", "causal", "sliding_window", "local_window", "prefix_lm", "dilated_sliding_window",
    "document", "block_diagonal", "interleaved", "dense", "doc_ids_from_lengths", "and_masks", "or_masks", "not_mask",
]
