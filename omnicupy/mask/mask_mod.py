"""MaskMod: a mask function ``f(b, h, q_idx, kv_idx) -> bool`` with a name and, optionally, its
block structure (the interval of allowed keys of every query row).

A mask_mod is evaluated on broadcast integer arrays (NumPy, or CuPy on the GPU). From its row
intervals, ``MaskMod.block_runs`` finds with NumPy in O(N), without evaluating any element, the
window of kv blocks each q block can reach and which of them are FULL or CAUSAL; only the blocks
cut by an interval end are evaluated element by element (builders.py). This module knows masks
as functions and intervals; it knows nothing of BlockMask metadata or kernels.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import MaskError
from .pieces import BlockPieces, Pieces, block_pieces
from .types import BlockType, cdiv

#: In types from ``block_rows``, PARTIAL means "cut by an interval end: evaluate the
#: elements". Evaluation then turns each such block into its true type (which may be any).
EVALUATE = int(BlockType.PARTIAL)
MASKED, CAUSAL, FULL = int(BlockType.MASKED), int(BlockType.CAUSAL), int(BlockType.FULL)

BoundsFn = Callable[[Any, Any, Any], tuple]

#: Rows (times batch rows, times heads) whose bounds are computed at once: bounds the structure's
#: working memory (a few int64 arrays of this many elements) whatever N is.
BOUNDS_ELEMENTS_PER_CHUNK = 1 << 21
#: Builds take a MaskMod's pieces from this many q blocks on; below it the row path. On the lent
#: H200 (lab/notes/masks.md#s17) pieces were 1.4-1.9x faster at 1024 q blocks (N = 131072) and 1.3-1.8x
#: slower at 64 (N = 8192), where the rows are few and the pieces' extra NumPy calls dominate.
PIECES_FROM_Q_BLOCKS = 256


def check_mask_mod(fn: Any, what: str = "mask_mod") -> Callable:
    """``fn`` if it is callable with the four arguments ``(b, h, q_idx, kv_idx)``, else MaskError."""
    if not callable(fn):
        raise MaskError(f"{what} must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have none: called as they are
        return fn
    try:
        signature.bind(0, 0, 0, 0)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise MaskError(f"{what} {name}{signature} must take four positional arguments (b, h, q_idx, kv_idx), "
                        "as flex-attention's mask_mods do") from None
    return fn


def name_of(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


@dataclass(frozen=True)
class Windows:
    """The row windows of q blocks ``q_start .. q_start + n - 1`` (arrays ``[Bs, Hs, n]``, int64):
    every allowed kv of the q block lies in kv blocks ``[first, first + width)``; of those (offsets
    from ``first``) blocks ``[0, after)`` and, when ``tail`` is EVALUATE, ``[before, width)`` are cut by
    an interval end (EVALUATE), ``[after, before)`` are FULL and, when ``tail`` is CAUSAL,
    ``[before, width)`` are CAUSAL. For exact bounds either ``start`` and ``end`` (``[Bs, Hs, n, qbs]``)
    are the rows' intervals (rows past q_len repeat the last real row's), or ``pieces`` holds them
    piecewise (pieces.py; then one chunk holds every q block)."""

    q_start: int
    first: np.ndarray
    after: np.ndarray
    before: np.ndarray
    width: np.ndarray
    tail: np.ndarray
    start: Optional[np.ndarray] = None
    end: Optional[np.ndarray] = None
    pieces: Optional[BlockPieces] = None

    @property
    def exact(self) -> bool:
        """Whether the rows' bounds are known exactly (so cut blocks need no evaluation)."""
        return self.start is not None or self.pieces is not None


class MaskMod:
    """A mask_mod ``fn(b, h, q_idx, kv_idx) -> bool`` with a name and, optionally, its structure.

    ``bounds(b, h, q_idx) -> (start, end)``: every allowed kv of row ``q_idx`` lies in
    ``[start, end)``; when ``bounds_exact``, every kv in that range is allowed too (with
    ``bounds_exact=False`` the interval only rules blocks out). The bounds must broadcast over every
    (b, h) the mask depends on; they are called with NumPy arrays (O(N) work, on the host). With
    exact bounds the builders never call ``fn`` at all: the bounds are the mask. ``length`` is the
    number of positions the mask is defined for (its lookup tables' length; None: any), ``batch``
    the number of batch rows it has data for (None: it does not depend on b). ``cuda_expr`` is the
    rule as a CUDA C expression, for fusion into the kernel. ``pointwise`` says that ``fn`` is known
    to be elementwise over broadcast index arrays (the built-in masks are), which spares the
    builders their check of that. ``pieces`` (pieces.py, exact bounds only, the same for every b
    and h) are the bounds again, by runs of rows: with them a build never computes the bounds row
    by row.
    """

    def __init__(self, fn: Callable, name: Optional[str] = None, *, bounds: Optional[BoundsFn] = None,
                 bounds_exact: bool = True, length: Optional[int] = None, batch: Optional[int] = None,
                 cuda_expr: Optional[str] = None, pointwise: bool = False, pieces: Optional[Pieces] = None) -> None:
        self.fn = check_mask_mod(fn)
        self.name = name or getattr(fn, "__name__", "mask_mod")
        self.__name__ = self.name  # flex-attention and attention-gym read __name__
        self.__doc__ = fn.__doc__
        self.bounds = bounds
        self.bounds_exact = bounds_exact
        self.length = length
        self.batch = batch
        self.cuda_expr = cuda_expr
        self.pointwise = pointwise
        if pieces is not None and (bounds is None or not bounds_exact):
            raise MaskError(f"mask_mod {self.name}: pieces stand for exact bounds, and it has none")
        self.pieces = pieces

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

    def windows(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int,
                kv_block_size: int) -> Optional[Iterator[Windows]]:
        """The row windows (``Windows``) of every q block, a chunk of q blocks at a time (so the
        working memory stays bounded whatever N is), or None when the structure is unknown. Only
        real positions (< q_len, < kv_len) count, like the element-level classification. NumPy,
        O(N) in all."""
        if self.bounds is None:
            return None
        if self.pieces is not None and cdiv(q_len, q_block_size) >= PIECES_FROM_Q_BLOCKS:
            return iter([self._windows_from_pieces(q_len, kv_len, q_block_size, kv_block_size)])
        return self._windows(B, H, q_len, kv_len, q_block_size, kv_block_size)

    def _windows_from_pieces(self, q_len, kv_len, qbs, kbs) -> Windows:
        """Every q block's window from the pieces (O(pieces + q blocks), no row arrays)."""
        rows = block_pieces(self.pieces, q_len, qbs)
        lo_start, hi_start, lo_end, hi_end, diagonal = (a.reshape(1, 1, -1) for a in rows.extremes())
        first, after, before, width = _window(lo_start, hi_start, lo_end, hi_end, kv_len, kbs)
        tail = np.where(diagonal, CAUSAL, EVALUATE).astype(np.int8)
        return Windows(0, first, after, before, width, tail, pieces=rows)

    def _windows(self, B, H, q_len, kv_len, qbs, kbs) -> Iterator[Windows]:
        nqb = cdiv(q_len, qbs)
        blocks_per_chunk = max(1, BOUNDS_ELEMENTS_PER_CHUNK // (qbs * B * H))
        b, h = np.arange(B).reshape(-1, 1, 1), np.arange(H).reshape(1, -1, 1)
        for q_start in range(0, nqb, blocks_per_chunk):
            n = min(blocks_per_chunk, nqb - q_start)
            # Padding rows repeat the last real row, so per-block min / max / all see only real rows.
            q = np.minimum(np.arange(q_start * qbs, (q_start + n) * qbs), q_len - 1).reshape(1, 1, -1)
            start, end = (np.asarray(a) for a in self.bounds(b, h, q))
            shape = np.broadcast_shapes(start.shape, end.shape, q.shape)
            rows = shape[:2] + (n, qbs)
            # Reduced over each bound's own shape (a scalar start is not n * qbs copies of itself).
            lo_start, hi_start, lo_end, hi_end = (np.broadcast_to(r, rows[:3]) for r in _row_extremes(start, end, n, qbs))
            start, end, q = (np.broadcast_to(a, shape).reshape(rows) for a in (start, end, q))
            first, after, before, width = _window(lo_start, hi_start, lo_end, hi_end, kv_len, kbs)
            if self.bounds_exact:
                # When every row ends at its diagonal (end = q + 1), the blocks from `before` on
                # allow exactly q_idx >= kv_idx: CAUSAL.
                tail = np.where((end == q + 1).all(-1), CAUSAL, EVALUATE).astype(np.int8)
                yield Windows(q_start, first, after, before, width, tail, start, end)
            else:
                yield Windows(q_start, first, width, width, width, np.full(width.shape, EVALUATE, dtype=np.int8))

    def block_runs(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int,
                   kv_block_size: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``block_rows`` before its rows are written out, O(N): ``(first, lengths, kinds)``,
        ``lengths`` and ``kinds`` ``[Bs, Hs, nQB, 4]``: from kv block ``first`` on, each row is
        ``lengths[..., i]`` blocks of type ``kinds[..., i]``: EVALUATE, FULL, CAUSAL or EVALUATE, then
        MASKED up to the common width C (every row's lengths sum to C)."""
        found = self.windows(B, H, q_len, kv_len, q_block_size, kv_block_size)
        return None if found is None else runs_of(list(found))

    def block_rows(self, B: int, H: int, q_len: int, kv_len: int, q_block_size: int,
                   kv_block_size: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The block types from the row bounds, row by row, or None when the structure is unknown:
        ``(first, types)``, ``first`` ``[Bs, Hs, nQB]`` and ``types`` ``[Bs, Hs, nQB, C]`` (int8,
        Bs in {1, B}, Hs in {1, H}), where ``types[..., s]`` is the type of kv block ``first + s``
        and every block outside a row's window is MASKED. MASKED, FULL and CAUSAL are exact;
        EVALUATE (PARTIAL) blocks need their elements evaluated. NumPy, O(N + the output)."""
        found = self.block_runs(B, H, q_len, kv_len, q_block_size, kv_block_size)
        if found is None:
            return None
        first, lengths, kinds = found
        types = np.repeat(kinds.reshape(-1), lengths.reshape(-1)).reshape(first.shape + (-1,))
        return first, types

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


def _window(lo_start, hi_start, lo_end, hi_end, kv_len: int, kbs: int):
    """``first``, ``after``, ``before``, ``width`` (see ``Windows``) of q blocks from their rows'
    least and greatest start and end."""
    nkvb = cdiv(kv_len, kbs)
    # The window: the blocks with a column in [lo_start, hi_end), the hull of the rows'
    # intervals; the others are MASKED. Block k's columns are [k * kbs, min((k + 1) * kbs, kv_len)).
    first = np.where(lo_start < kv_len, np.maximum(lo_start // kbs, 0), nkvb)
    width = np.clip(-(-hi_end // kbs), first, nkvb) - first
    # In the window (offsets from `first`): blocks from `after` on begin at or after every row's
    # start, blocks before `before` end before every row's end, so those in between are FULL (with
    # exact bounds; inexact ones use the width only). The rest are cut by a start or an end, or
    # CAUSAL (see the callers).
    after = np.clip(-(-hi_start // kbs) - first, 0, width)
    before = np.clip(np.where(lo_end >= kv_len, nkvb, lo_end // kbs) - first, after, width)
    return first, after, before, width


def _row_extremes(start: np.ndarray, end: np.ndarray, n: int, qbs: int):
    """Per q block: the least and greatest start, the least and greatest end, from bounds of any
    shape that broadcasts to ``[Bs, Hs, n * qbs]``."""
    out = []
    for a in (start, end):
        if a.ndim == 0 or a.shape[-1] == 1:  # the same for every row
            a = a.reshape(a.shape[:-1] + (1,)) if a.ndim else a.reshape(1, 1, 1)
            out += [a, a]
        else:
            a = a.reshape(a.shape[:-1] + (n, qbs))
            out += [a.min(-1), a.max(-1)]
    return out


def runs_of(chunks: list[Windows]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windows of consecutive chunks -> ``(first, lengths, kinds)`` (see ``MaskMod.block_runs``):
    each row is four runs: EVALUATE, FULL, CAUSAL or EVALUATE, MASKED (to the common width)."""
    bs = max(c.first.shape[0] for c in chunks)
    hs = max(c.first.shape[1] for c in chunks)

    def joined(name):
        return np.concatenate([np.broadcast_to(getattr(c, name), (bs, hs) + c.first.shape[2:]) for c in chunks], axis=2)

    first, after, before, width, tail = (joined(n) for n in ("first", "after", "before", "width", "tail"))
    cols = max(int(width.max()), 1)
    lengths = np.stack([after, before - after, width - before, cols - width], axis=-1)
    kinds = np.stack(np.broadcast_arrays(EVALUATE, FULL, tail, MASKED), axis=-1).astype(np.int8)
    return first, lengths, kinds


class LookupTable:
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


def as_bool_result(value: Any, name: str, xp: Any):
    """A mask_mod's result as a boolean array of ``xp`` (a Python or NumPy bool becomes a 0-d array).
    Anything not boolean is refused, not cast: 2 or 0.5 would silently mean True."""
    if isinstance(value, (bool, np.bool_)):
        return xp.asarray(bool(value))
    if not (isinstance(value, np.ndarray) or arrays.is_cupy(value)):
        raise MaskError(f"mask_mod {name} returned a {type(value).__name__}; it must return a boolean array (or "
                        "bool) over its broadcast index arguments")
    if value.dtype != np.bool_:
        raise MaskError(f"mask_mod {name} returned {value.dtype} values; a mask_mod must return booleans "
                        "(comparisons combined with & | ~). Non-boolean results are refused rather than cast to bool")
    return value


def check_mask_int(value: Any, name: str, minimum: int) -> int:
    return check_int(value, name, minimum=minimum, error=MaskError)


def array_module_of(x):
    return arrays.array_namespace(x)


__all__ = ["MaskMod", "Windows", "EVALUATE", "MASKED", "CAUSAL", "FULL", "BoundsFn", "check_mask_mod", "name_of",
           "as_bool_result", "runs_of", "BOUNDS_ELEMENTS_PER_CHUNK"]
