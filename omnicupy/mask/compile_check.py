"""What a compiled mask may do, decided by interval analysis of its tree (compile_ir.py) with one
instance's values: every int intermediate stays in int32, no division or modulo by a value that can
be 0, and every table index stays in ``[0, len)``. Nothing is clamped or wrapped: an index that
could leave its table is a ``MaskError`` when the mask is compiled.

The index names range over ``b, h < 65535`` (the launch grid) and ``q_idx, kv_idx < L``. An index
is accepted when its interval (at the largest L) lies in ``[0, len)``, or when it is at least 0 and
at most one index name, pointwise (``q_idx``, ``q_idx // 4``, ``min(q_idx, n)``, ``q_idx % w``):
then the table must cover that axis, which is checked when the sizes are known (``Checked.limits``,
and ``extents`` of the CUDA expression). ``Checked.max_length`` is the largest L (a power of two, or
the kernels' own limit) for which no intermediate can overflow int32 (``q_idx * 4096`` compiles,
for sequences up to 2**19).

Knows intervals of the tree's nodes; knows nothing of Python source or of kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from ..errors import MaskError
from .compile_ir import (AXES, INT32_MAX, INT32_MIN, MAX_GRID_INDEX, Abs, Axis, Binary, Compare, Const, Lookup,
                         Node, Scalar, Unary, Where, children, emit)

#: The kernels' longest sequence (ops/inputs.py MAX_SEQ_LEN: 32-bit positions).
MAX_LENGTH = 2**31 - 2**16
#: A mask that overflows int32 below this length is refused rather than compiled for short sequences.
MIN_LENGTH = 1024


class _Overflow(Exception):
    """An intermediate can leave int32 at the sequence length tried."""

    def __init__(self, node: Node) -> None:
        super().__init__(emit(node))
        self.node = node


@dataclass
class Checked:
    """What the analysis of one instance found."""

    max_length: int
    #: axis -> the most positions (or batch rows, heads) the tables cover along it
    limits: dict = field(default_factory=dict)
    #: 1-D table -> declared extent for its computed subscripts: an index name, a count, or None (every axis)
    extents: dict = field(default_factory=dict)
    #: axis -> rows or columns of the 2-D tables it indexes (their flattened extent cannot say it):
    #: compile_mask adds a guard array of that length read at the axis, so that the expression's own
    #: length check (fused kernels included) refuses larger sizes
    guards: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Table:
    """One table's host values for the analysis: flattened size, rows and columns, value range."""

    size: int
    rows: int
    cols: int
    low: int
    high: int


def check(tree: Node, scalars: Mapping[str, int], tables: Mapping[str, Table], where: str) -> Checked:
    """Analyse ``tree`` with these values; raise MaskError naming the construct (``where``: the
    mask_mod, for messages) or return what the caller must check at build time."""
    try:
        found = _Pass(scalars, tables, MAX_LENGTH, where).run(tree)
        found.max_length = MAX_LENGTH
        return found
    except _Overflow:
        pass
    length = 1 << (MAX_LENGTH.bit_length() - 1)
    while length >= MIN_LENGTH:  # the longest power of two that cannot overflow
        try:
            found = _Pass(scalars, tables, length, where).run(tree)
            found.max_length = length
            return found
        except _Overflow as exc:
            node = exc.node
        length //= 2
    raise MaskError(f"{where}: {emit(node)!r} (line {node.line}) can leave int32 even for sequences of {MIN_LENGTH}; "
                    "the kernels compute in 32-bit ints")


class _Pass:
    def __init__(self, scalars, tables, length: int, where: str) -> None:
        self.scalars, self.tables, self.length, self.where = scalars, tables, length, where
        self.box = {"b": MAX_GRID_INDEX, "h": MAX_GRID_INDEX, "q_idx": length - 1, "kv_idx": length - 1}
        self.memo: dict = {}
        self.found = Checked(max_length=length)
        self.axes_of: dict = {}  # 1-D table -> set of extents its computed subscripts need

    def run(self, tree: Node) -> Checked:
        self.interval(tree)
        for name, needs in self.axes_of.items():
            axes = {n for n in needs if isinstance(n, str)}
            if not axes:
                self.found.extents[name] = self.tables[name].size
            elif len(axes) == 1:
                self.found.extents[name] = axes.pop()
            else:
                self.found.extents[name] = None
        return self.found

    def refuse(self, node: Node, why: str) -> MaskError:
        return MaskError(f"{self.where}: {emit(node)!r} (line {node.line}) {why}")

    def interval(self, n: Node) -> tuple[int, int]:
        key = id(n)
        if key not in self.memo:
            lo, hi = self._interval(n)
            if n.kind == "int" and (lo < INT32_MIN or hi > INT32_MAX):
                raise _Overflow(n)
            self.memo[key] = (lo, hi, n)  # keep n alive: ids stay unique during the pass
        return self.memo[key][:2]

    def _interval(self, n: Node) -> tuple[int, int]:
        if n.kind == "bool" and not isinstance(n, (Lookup, Scalar)):
            for c in children(n):
                self.interval(c)
            return 0, 1
        if isinstance(n, Const):
            return int(n.value), int(n.value)
        if isinstance(n, Axis):
            return 0, self.box[n.name]
        if isinstance(n, Scalar):
            v = int(self.scalars[n.slot])
            return (v, v) if n.kind == "int" else (0, 1)
        if isinstance(n, Lookup):
            self.check_index(n)
            t = self.tables[n.slot]
            return (t.low, t.high) if n.kind == "int" else (0, 1)
        if isinstance(n, Unary):
            lo, hi = self.interval(n.x)
            return (-hi, -lo) if n.op == "neg" else (-hi - 1, -lo - 1)
        if isinstance(n, Abs):
            lo, hi = self.interval(n.x)
            return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
        if isinstance(n, Where):
            self.interval(n.cond)
            (a, b), (c, d) = self.interval(n.x), self.interval(n.y)
            return min(a, c), max(b, d)
        if isinstance(n, Compare):
            self.interval(n.x), self.interval(n.y)
            return 0, 1
        assert isinstance(n, Binary)
        (a, b), (c, d) = self.interval(n.x), self.interval(n.y)
        if n.op == "+":
            return a + c, b + d
        if n.op == "-":
            return a - d, b - c
        if n.op == "*":
            corners = (a * c, a * d, b * c, b * d)
            return min(corners), max(corners)
        if n.op == "min":
            return min(a, c), min(b, d)
        if n.op == "max":
            return max(a, c), max(b, d)
        if n.op in ("//", "%", "fmod"):
            if c <= 0 <= d:
                raise self.refuse(n.y, f"may be 0 here (its values span [{c}, {d}]) and divides: the result "
                                       "would be undefined in the kernel")
            if n.op == "//":
                quotients = [x // y for x in (a, b) for y in (c, d)]
                return min(quotients), max(quotients)
            if n.op == "fmod":
                m = max(abs(c), abs(d)) - 1
                return (0 if a >= 0 else -m), (0 if b <= 0 else m)
            if c > 0:
                return 0, (min(b, d - 1) if a >= 0 else d - 1)
            return (max(a, c + 1) if b <= 0 else c + 1), 0
        # Bitwise ops of int32 values stay int32; bounds for the non-negative case only.
        if a >= 0 and c >= 0:
            if n.op == "&":
                return 0, min(b, d)
            return 0, (1 << max(b, d).bit_length()) - 1
        return INT32_MIN, INT32_MAX

    def dominating(self, n: Node) -> set:
        """Axes ``a`` with ``n <= a`` pointwise (given ``n >= 0``, which the caller checks)."""
        if isinstance(n, Axis):
            return {n.name}
        if isinstance(n, Binary):
            if n.op in ("//", "%") and self.interval(n.y)[0] >= 1 and self.interval(n.x)[0] >= 0:
                return self.dominating(n.x)
            if n.op == "min":
                return self.dominating(n.x) | self.dominating(n.y)
            if n.op == "max":
                return self.dominating(n.x) & self.dominating(n.y)
            if n.op == "-" and self.interval(n.y)[0] >= 0:
                return self.dominating(n.x)
        if isinstance(n, Where):
            return self.dominating(n.x) & self.dominating(n.y)
        return set()

    def bound(self, index: Node, count: int, what: str):
        """How ``index`` stays in ``[0, count)``: None (always, by its interval), an axis name (if that
        axis's size is at most ``count``), or MaskError."""
        lo, hi = self.interval(index)
        if lo < 0:
            raise self.refuse(index, f"may be negative (down to {lo}) as an index of {what}; indices are never "
                                     "wrapped: clamp it with max(..., 0) if that is meant")
        if hi < count:
            return None
        axes = self.dominating(index)
        for axis in AXES[::-1]:  # q_idx / kv_idx first: their sizes are what a table covers
            if axis in axes:
                return axis
        raise self.refuse(index, f"may reach {hi}, past the {count} elements of {what} (an index must stay below an "
                                 "index name's size or the table's length: min(..., n - 1) bounds it)")

    def check_index(self, n: Lookup) -> None:
        t = self.tables[n.slot]
        if len(n.index) == 1:
            (index,) = n.index
            need = self.bound(index, t.size, n.slot)
            if isinstance(index, Axis):
                return  # the expression's own subscript rule covers it (extents are for computed ones)
            self.axes_of.setdefault(n.slot, set()).add(need if need is not None else t.size)
            if need is not None:
                self._limit(need, t.size)
            return
        for index, count, what in ((n.index[0], t.rows, f"the rows of {n.slot}"),
                                   (n.index[1], t.cols, f"the columns of {n.slot}")):
            need = self.bound(index, count, what)
            if need is not None:
                self._limit(need, count)
                self.found.guards[need] = min(count, self.found.guards.get(need, count))
        self.axes_of.setdefault(n.slot, set()).add(t.size)

    def _limit(self, axis: str, count: int) -> None:
        self.found.limits[axis] = min(count, self.found.limits.get(axis, count))


def table_of(values: np.ndarray, rows: int, cols: int) -> Table:
    flat = np.asarray(values).reshape(-1)
    if flat.dtype == np.bool_:
        return Table(flat.size, rows, cols, 0, 1)
    return Table(flat.size, rows, cols, int(flat.min()), int(flat.max()))


def check_sizes(checked: Checked, where: str, *, batch: int, heads: int, q_len: int, kv_len: int) -> Optional[str]:
    """Why a build of these sizes cannot use the compiled mask (None: it can)."""
    sizes = {"b": batch, "h": heads, "q_idx": q_len, "kv_idx": kv_len}
    if max(q_len, kv_len) > checked.max_length:
        return (f"{where} is compiled for sequences up to {checked.max_length} (longer ones could overflow its "
                f"32-bit arithmetic), got q_len={q_len}, kv_len={kv_len}")
    for axis, count in checked.limits.items():
        if sizes[axis] > count:
            return f"{where} reads a table of {count} along {axis}, which has {sizes[axis]} values here"
    return None


__all__ = ["check", "Checked", "Table", "table_of", "check_sizes", "MAX_LENGTH", "MIN_LENGTH"]
