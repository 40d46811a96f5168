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
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import MaskError
from .mask_mod import (EVALUATE, LookupTable, MaskMod, array_module_of, as_bool_result,
                       check_mask_mod)
from .pieces import Pieces, intersect

#: Largest argument a built-in mask takes: the kernels hold positions and these numbers in int32.
#: Expressions are written as differences of positions (``kv_idx - q_idx <= right``, never
#: ``q_idx + right``), which stay within int32 for every length the kernels take.
MAX_MASK_ARG = 2**31 - 1
#: Longest sequence a mask built from lengths may describe (ops/inputs.py MAX_SEQ_LEN).
MAX_TOTAL_LENGTH = 2**31 - 2**16


def _arg(value: Any, name: str, minimum: int) -> int:
    return check_int(value, name, minimum=minimum, maximum=MAX_MASK_ARG, error=MaskError)


def _total(lengths: Sequence[int], what: str) -> None:
    if sum(lengths) > MAX_TOTAL_LENGTH:
        raise MaskError(f"{what} add up to {sum(lengths)} positions, more than the kernels take ({MAX_TOTAL_LENGTH})")

# ------------------------------------------------------------------------------------- band masks
def causal(offset: int = 0) -> MaskMod:
    """``q_idx + offset >= kv_idx``: offset 0 is top-left aligned (flex-attention's convention);
    ``offset = kv_len - q_len`` aligns the last query with the last key (bottom-right)."""
    offset = _arg(offset, "offset", -MAX_MASK_ARG - 1)
    if offset == 0:
        def causal(b, h, q_idx, kv_idx):
            """q_idx >= kv_idx"""
            return q_idx >= kv_idx

        return MaskMod(causal, "causal", bounds=lambda b, h, q: (0, q + 1), cuda_expr="q_idx >= kv_idx",
                       pointwise=True, pieces=_band(0, 0, 1))

    def causal_offset(b, h, q_idx, kv_idx):
        """kv_idx - q_idx <= offset (q_idx + offset >= kv_idx, without overflow)"""
        return kv_idx - q_idx <= offset

    return MaskMod(causal_offset, f"causal_offset_{offset}", bounds=lambda b, h, q: (0, q + offset + 1),
                   cuda_expr=f"kv_idx - q_idx <= ({offset})", pointwise=True, pieces=_band(0, 0, offset + 1))


def sliding_window(window: int) -> MaskMod:
    """Causal sliding window: ``0 <= q_idx - kv_idx < window`` (each query sees ``window`` keys,
    itself included)."""
    window = _arg(window, "window", 1)

    def sliding_window(b, h, q_idx, kv_idx):
        """(q_idx >= kv_idx) & (q_idx - kv_idx < window)"""
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return MaskMod(sliding_window, f"sliding_window_{window}", bounds=lambda b, h, q: (q - window + 1, q + 1),
                   cuda_expr=f"q_idx >= kv_idx && q_idx - kv_idx < {window}", pointwise=True,
                   pieces=_band(1, 1 - window, 1))


def local_window(left: int, right: int) -> MaskMod:
    """Bidirectional window: ``q_idx - left <= kv_idx <= q_idx + right``."""
    left, right = _arg(left, "left", 0), _arg(right, "right", 0)

    def local_window(b, h, q_idx, kv_idx):
        """(q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)"""
        return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)

    return MaskMod(local_window, f"local_window_{left}_{right}", bounds=lambda b, h, q: (q - left, q + right + 1),
                   cuda_expr=f"q_idx - kv_idx <= {left} && kv_idx - q_idx <= {right}", pointwise=True,
                   pieces=_band(1, -left, right + 1))


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix LM: the first ``prefix_len`` keys are seen by every query, the rest causally:
    ``(kv_idx < prefix_len) | (q_idx >= kv_idx)``."""
    prefix_len = _arg(prefix_len, "prefix_len", 0)

    def prefix_lm(b, h, q_idx, kv_idx):
        """(kv_idx < prefix_len) | (q_idx >= kv_idx)"""
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    # end = max(prefix_len, q + 1): prefix_len on rows before it, then the diagonal.
    pieces = (_band(0, 0, 1) if prefix_len == 0 else
              Pieces.of([0, prefix_len], 0, 0, [prefix_len, prefix_len + 1], [0, 1]))
    return MaskMod(prefix_lm, f"prefix_lm_{prefix_len}", bounds=lambda b, h, q: (0, array_module_of(q).maximum(prefix_len, q + 1)),
                   cuda_expr=f"kv_idx < {prefix_len} || q_idx >= kv_idx", pointwise=True, pieces=pieces)


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    """Causal dilated window (Longformer's): ``window`` keys spaced ``dilation`` apart,
    ``d = q_idx - kv_idx``, ``0 <= d < window * dilation`` and ``d % dilation == 0``.
    ``dilation=1`` is ``sliding_window(window)``."""
    window, dilation = _arg(window, "window", 1), _arg(dilation, "dilation", 1)
    span = window * dilation
    if span > MAX_MASK_ARG:
        raise MaskError(f"window * dilation = {span} is more than the kernels represent ({MAX_MASK_ARG})")

    def dilated_sliding_window(b, h, q_idx, kv_idx):
        """d = q_idx - kv_idx; (d >= 0) & (d < window * dilation) & (d % dilation == 0)"""
        d = q_idx - kv_idx
        return (d >= 0) & (d < span) & (d % dilation == 0)

    # The band bounds the allowed keys; inside it the dilation leaves holes, so (unless
    # dilation == 1) the band rules blocks out but every block in it is evaluated.
    return MaskMod(dilated_sliding_window, f"dilated_sliding_window_{window}_dilation_{dilation}",
                   bounds=lambda b, h, q: (q - span + 1, q + 1), bounds_exact=dilation == 1,
                   cuda_expr=f"q_idx >= kv_idx && q_idx - kv_idx < {span} && (q_idx - kv_idx) % {dilation} == 0",
                   pointwise=True, pieces=_band(1, 1 - span, 1) if dilation == 1 else None)


def _band(start_slope: int, start: int, end: int) -> Pieces:
    """One piece for every row: ``start(q) = start + start_slope * q``, ``end(q) = end + q``."""
    return Pieces.of(0, start, start_slope, end, 1)


# ---------------------------------------------------------------------------------- segment masks
def doc_ids_from_lengths(lengths: Iterable[int]) -> np.ndarray:
    """Document ids ``[0]*l0 + [1]*l1 + ...`` (int32) for packed sequences of the given lengths."""
    lengths = [_arg(n, "lengths[i]", 1) for n in lengths]
    _total(lengths, "lengths")
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
    table = LookupTable(ids)

    def document(b, h, q_idx, kv_idx):
        """doc[q_idx] == doc[kv_idx] (& q_idx >= kv_idx when causal); doc[b, .] for per-batch ids"""
        same = table.lookup(b, q_idx) == table.lookup(b, kv_idx)
        return same & (q_idx >= kv_idx) if causal else same

    # Row bounds are the run of equal ids around q: exact only when every document is one
    # contiguous run (packed sequences); otherwise no structure and every block is evaluated.
    bounds, pieces = None, None
    n_runs = 1 + np.count_nonzero(np.diff(ids, axis=-1), axis=-1)
    n_docs = 1 + np.count_nonzero(np.diff(np.sort(ids, axis=-1), axis=-1), axis=-1)
    if np.array_equal(n_runs, n_docs):
        run_start, run_end = (LookupTable(a) for a in _run_bounds(ids))

        def bounds(b, h, q):
            return run_start.lookup(b, q), q + 1 if causal else run_end.lookup(b, q)

        if ids.ndim == 1:  # one piece per document (per-batch ids differ per b: their rows are computed)
            first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
            last = np.append(first[1:], len(ids))
            pieces = Pieces.of(first, first, 0, first + 1 if causal else last, 1 if causal else 0)

    return MaskMod(document, name, bounds=bounds, length=ids.shape[-1], batch=ids.shape[0] if ids.ndim == 2 else None,
                   pointwise=True, pieces=pieces)


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
        sizes.append(_arg(seg[1], f"segments[{i}] length", 1))
    if not sizes:
        raise MaskError("segments must not be empty")
    _total(sizes, "segments")
    ends = np.cumsum(sizes)
    pos = np.arange(int(ends[-1]))
    limit = LookupTable(np.where(np.repeat(kinds, sizes), np.repeat(ends, sizes), pos + 1))

    def interleaved(b, h, q_idx, kv_idx):
        """kv_idx < limit[q_idx] (text: q_idx + 1; image: the image's end)"""
        return kv_idx < limit.lookup(b, q_idx)

    n_image = sum(kinds)
    # One piece per segment: text rows end at their diagonal, image rows at the image's end.
    starts, image = ends - np.asarray(sizes), np.asarray(kinds)
    pieces = Pieces.of(starts, 0, 0, np.where(image, ends, starts + 1), np.where(image, 0, 1))
    return MaskMod(interleaved, f"interleaved_{len(sizes) - n_image}text_{n_image}image",
                   bounds=lambda b, h, q: (0, limit.lookup(b, q)), length=int(ends[-1]), pointwise=True,
                   pieces=pieces)


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
    table = LookupTable(mask)
    per_batch, per_head = mask.shape[0] > 1, mask.shape[1] > 1

    def dense(b, h, q_idx, kv_idx):
        """mask[b, h, q_idx, kv_idx]"""
        return table.on(q_idx)[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]

    return MaskMod(dense, f"dense_{mask.shape[2]}x{mask.shape[3]}", batch=mask.shape[0] if per_batch else None,
                   pointwise=True)


# ------------------------------------------------------------------------------------ combinators
def _as_mask_mods(mask_mods: Sequence[Callable], what: str) -> list[MaskMod]:
    if not mask_mods:
        raise MaskError(f"{what} needs at least one mask_mod")
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise MaskError(f"{what}: argument {i} is not callable ({type(m).__name__})")
        check_mask_mod(m, f"{what}: argument {i}")
    return [m if isinstance(m, MaskMod) else MaskMod(m) for m in mask_mods]


def _combined(fn: Callable, name: str, mods: list[MaskMod], **structure) -> MaskMod:
    """A MaskMod over ``mods``: defined where all of them are, for the batch rows they have data for."""
    lengths = [m.length for m in mods if m.length is not None]
    batches = {m.batch for m in mods if m.batch is not None}
    if len(batches) > 1:
        raise MaskError(f"{name}: the masks have per-batch data for different batch sizes {sorted(batches)}")
    return MaskMod(fn, name, length=min(lengths) if lengths else None, batch=batches.pop() if batches else None,
                   pointwise=all(m.pointwise for m in mods), **structure)


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
            xp = array_module_of(q)
            pairs = [m.bounds(b, h, q) for m in mods]
            start, end = pairs[0]
            for s, e in pairs[1:]:
                start, end = xp.maximum(start, s), xp.minimum(end, e)
            return start, end

    # Pieces (exact bounds, the same for every b and h) intersect into pieces.
    pieces = None
    if mods and all(m.pieces is not None for m in mods):
        pieces = functools.reduce(intersect, (m.pieces for m in mods))
    name = f"and_masks({', '.join(m.name for m in mods)})"
    return _combined(and_masks, name, mods, bounds=bounds, bounds_exact=all(m.bounds_exact for m in mods),
                     pieces=pieces)


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
        xp = array_module_of(q_idx)
        return ~as_bool_result(mod(b, h, q_idx, kv_idx), mod.name, xp)

    return _combined(not_mask, f"not_mask({mod.name})", [mod])


__all__ = [
    "MaskMod", "EVALUATE", "causal", "sliding_window", "local_window", "prefix_lm", "dilated_sliding_window",
    "document", "block_diagonal", "interleaved", "dense", "doc_ids_from_lengths", "and_masks", "or_masks", "not_mask",
]
