"""The mask compiler's intermediate form: typed expression nodes over ``b, h, q_idx, kv_idx``, closure
scalars and lookup tables, with the three things done to them: the CUDA C text (``emit``), the same
C semantics in NumPy (``evaluate``: int32 arithmetic, C's truncating ``/`` and ``%`` inside the
floor forms), and interval analysis (``Analysis``: int32 overflow, division by zero, array indices).

Nodes know nothing of Python functions (compile_mask.py builds them from a mask_mod's source). A
node's ``kind`` is "int" or "bool". Leaves that hold values (``Scalar``, ``Lookup``) refer to a slot
by name; the values come with each instance (``Values``), so one tree and one text serve every
closure value: the text never depends on a value, only on the tree.

Floor division and modulo (Python's semantics) are written with C's truncating operators:
``x // y`` is ``x / y - (x % y != 0 && (x % y < 0) != (y < 0))`` and ``x % y`` is
``x % y + (x % y != 0 && (x % y < 0) != (y < 0) ? y : 0)``; when ``x`` is non-negative by its form
(axis names, non-negative literals, sums and products of those) and ``y`` a positive literal or a
closure number the translation was made positive for, the two agree with plain ``/`` and ``%``,
which are emitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np

from ..errors import MaskError

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
#: Largest batch and head index the kernels launch (grid y and z).
MAX_GRID_INDEX = 65534
AXES = ("b", "h", "q_idx", "kv_idx")


@dataclass(frozen=True)
class Node:
    kind: str  # "int" or "bool"
    line: int  # source line, for messages


@dataclass(frozen=True)
class Const(Node):
    value: Union[int, bool]


@dataclass(frozen=True)
class Axis(Node):
    name: str


@dataclass(frozen=True)
class Scalar(Node):
    """A closure number, read from a one-element kernel argument array ``slot[0]``; ``positive``:
    the translation was made for positive values of it (part of its signature)."""
    slot: str
    positive: bool = False


@dataclass(frozen=True)
class Lookup(Node):
    """``slot[i]`` of a 1-D table, or ``slot[i * cols + j]`` of a 2-D one (stored flattened)."""
    slot: str
    index: tuple
    cols: int = 0  # columns of a 2-D table (part of the text)


@dataclass(frozen=True)
class Unary(Node):
    op: str  # "neg", "invert" (int ~), "not"
    x: Node


@dataclass(frozen=True)
class Binary(Node):
    op: str  # + - * // % & | ^ (ints); and or xor (bools); min max (same kind); fmod (C %)
    x: Node
    y: Node


@dataclass(frozen=True)
class Compare(Node):
    op: str  # < <= > >= == !=
    x: Node
    y: Node


@dataclass(frozen=True)
class Where(Node):
    cond: Node
    x: Node
    y: Node


@dataclass(frozen=True)
class Abs(Node):
    x: Node


_C_OPS = {"+": "+", "-": "-", "*": "*", "&": "&", "|": "|", "^": "^", "and": "&&", "or": "||", "xor": "!=",
          "fmod": "%"}


def nonnegative_form(n: Node) -> bool:
    """Non-negative whatever the values: decided from the tree alone, so that the text stays the
    same for every closure value."""
    if isinstance(n, Axis):
        return True
    if isinstance(n, Const):
        return n.kind == "int" and n.value >= 0
    if isinstance(n, Scalar):
        return n.positive
    if isinstance(n, Abs):
        return True
    if isinstance(n, Binary):
        if n.op in ("+", "*", "min"):
            return nonnegative_form(n.x) and nonnegative_form(n.y)
        if n.op == "max":
            return nonnegative_form(n.x) or nonnegative_form(n.y)
        if n.op in ("//", "%"):
            return nonnegative_form(n.x) and _positive_literal(n.y)
    return False


def _positive_literal(n: Node) -> bool:
    return (isinstance(n, Const) and n.kind == "int" and n.value > 0) or (isinstance(n, Scalar) and n.positive)


def _simple_division(n: Binary) -> bool:
    return nonnegative_form(n.x) and _positive_literal(n.y)


def emit(n: Node) -> str:
    """The node as a CUDA C expression (fully parenthesized)."""
    if isinstance(n, Const):
        if n.kind == "bool":
            return "true" if n.value else "false"
        return str(n.value) if n.value >= 0 else f"({n.value})"
    if isinstance(n, Axis):
        return n.name
    if isinstance(n, Scalar):
        return f"{n.slot}[0]" if n.kind == "int" else f"({n.slot}[0] != 0)"
    if isinstance(n, Lookup):
        if len(n.index) == 1:
            at = emit(n.index[0])
        else:
            at = f"{emit(n.index[0])} * {n.cols} + {emit(n.index[1])}"
        return f"{n.slot}[{at}]" if n.kind == "int" else f"({n.slot}[{at}] != 0)"
    if isinstance(n, Unary):
        return {"neg": "(-{})", "invert": "(~{})", "not": "(!{})"}[n.op].format(emit(n.x))
    if isinstance(n, Compare):
        return f"({emit(n.x)} {n.op} {emit(n.y)})"
    if isinstance(n, Where):
        return f"({emit(n.cond)} ? {emit(n.x)} : {emit(n.y)})"
    if isinstance(n, Abs):
        return f"abs({emit(n.x)})"
    assert isinstance(n, Binary)
    x, y = emit(n.x), emit(n.y)
    if n.op in ("min", "max"):
        if n.kind == "bool":  # min / max of booleans are and / or
            return f"({x} {'&&' if n.op == 'min' else '||'} {y})"
        return f"{n.op}({x}, {y})"
    if n.op in ("//", "%"):
        if _simple_division(n):
            return f"({x} {'/' if n.op == '//' else '%'} {y})"
        off = f"({x} % {y} != 0 && ({x} % {y} < 0) != ({y} < 0))"
        return f"({x} / {y} - {off})" if n.op == "//" else f"({x} % {y} + ({off} ? {y} : 0))"
    return f"({x} {_C_OPS[n.op]} {y})"


# ----------------------------------------------------------------------------------- NumPy, as C
def _c_div(x, y):
    """C's truncating int32 division (y never 0: the analysis refuses it)."""
    q = np.abs(x) // np.abs(y)
    return np.where((x < 0) != (y < 0), -q, q).astype(np.int32)


def _c_mod(x, y):
    return (x - _c_div(x, y) * y).astype(np.int32)


def _as_int(v):
    return v.astype(np.int32) if v.dtype == np.bool_ else v


class Values:
    """One instance's slot values on the host: scalars (int) and tables (flat NumPy arrays)."""

    def __init__(self, scalars: Mapping[str, int], tables: Mapping[str, np.ndarray]) -> None:
        self.scalars, self.tables = dict(scalars), dict(tables)


def evaluate(n: Node, env: Mapping[str, Any], values: Values):
    """The node on broadcast int32 index arrays ``env`` with the C semantics of ``emit``'s text."""
    ev = lambda m: evaluate(m, env, values)  # noqa: E731
    if isinstance(n, Const):
        return np.asarray(n.value, dtype=np.bool_ if n.kind == "bool" else np.int32)
    if isinstance(n, Axis):
        return env[n.name]
    if isinstance(n, Scalar):
        v = np.asarray(values.scalars[n.slot], dtype=np.int32)
        return v if n.kind == "int" else v != 0
    if isinstance(n, Lookup):
        idx = [ev(i).astype(np.int64) for i in n.index]
        at = idx[0] if len(idx) == 1 else idx[0] * n.cols + idx[1]
        table = values.tables[n.slot]
        if np.any(at < 0) or np.any(at >= table.size):  # the analysis proves this never happens in a build
            raise MaskError(f"compiled mask reads {n.slot} outside its {table.size} elements")
        v = table[at]
        return v.astype(np.int32) if n.kind == "int" else v != 0
    if isinstance(n, Unary):
        x = ev(n.x)
        return {"neg": lambda: (-_as_int(x)).astype(np.int32), "invert": lambda: ~_as_int(x),
                "not": lambda: ~x.astype(bool)}[n.op]()
    if isinstance(n, Compare):
        x, y = _as_int(ev(n.x)), _as_int(ev(n.y))
        return {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                "!=": np.not_equal}[n.op](x, y)
    if isinstance(n, Where):
        x, y = ev(n.x), ev(n.y)
        if n.kind == "int":
            x, y = _as_int(x), _as_int(y)
        return np.where(ev(n.cond), x, y)
    if isinstance(n, Abs):
        return np.abs(_as_int(ev(n.x))).astype(np.int32)
    assert isinstance(n, Binary)
    x, y = ev(n.x), ev(n.y)
    if n.kind == "bool":
        fn = {"and": np.logical_and, "min": np.logical_and, "or": np.logical_or, "max": np.logical_or,
              "xor": np.not_equal}[n.op]
        return fn(x, y)
    x, y = _as_int(x), _as_int(y)
    if n.op in ("//", "%"):
        q, r = _c_div(x, y), _c_mod(x, y)
        if _simple_division(n):
            return q if n.op == "//" else r
        off = (r != 0) & ((r < 0) != (y < 0))
        return (q - off).astype(np.int32) if n.op == "//" else np.where(off, r + y, r).astype(np.int32)
    with np.errstate(over="ignore"):
        arith: Any = {"+": np.add, "-": np.subtract, "*": np.multiply, "&": np.bitwise_and, "|": np.bitwise_or,
              "^": np.bitwise_xor, "min": np.minimum, "max": np.maximum, "fmod": _c_mod}[n.op]
        return np.asarray(arith(x, y)).astype(np.int32)


def children(n: Node) -> tuple:
    if isinstance(n, Lookup):
        return n.index
    if isinstance(n, (Unary, Abs)):
        return (n.x,)
    if isinstance(n, (Binary, Compare)):
        return (n.x, n.y)
    if isinstance(n, Where):
        return (n.cond, n.x, n.y)
    return ()


__all__ = ["Node", "Const", "Axis", "Scalar", "Lookup", "Unary", "Binary", "Compare", "Where", "Abs", "Values",
           "emit", "evaluate", "children", "nonnegative_form", "INT32_MIN", "INT32_MAX", "MAX_GRID_INDEX", "AXES"]
