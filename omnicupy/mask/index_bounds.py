"""The range of every array index in a CUDA expression, derived from the grammar by interval arithmetic.

One rule for array indices (docs/design.md, "Expressions"): an index is an integer expression over
``b, h, q_idx, kv_idx``, the expression's constants, literals and integer lookup arrays (their
values' min and max, known when the expression is made). Its range is derived operator by operator
with the index names in ``[0, size)``, the sizes themselves unknown until a call (``q_idx < Nq``,
``kv_idx < Nkv``, ``h < H``, ``b < B``). A bound is a linear form in the sizes (``Nq - 1``,
``(Nq - 1) / 2``, ``N - 1``); ``min``/``max`` clamps by the user keep every bound they are given, so
``doc[min(q_idx + 1, N - 1)]`` is below the constant ``N``. An index is accepted only when its lower
bound is provably >= 0 and its upper bound provably below one size or a constant, for every size
the kernels allow (positions < 2**31 - 2**16, heads and batch <= 65535), with no intermediate value
able to leave int32 (a wrap). Anything the rules cannot bound (a product of two indices, floats,
unsigned literals, bit tricks on signed values) has no bound and is refused where it is used as
an index; nothing is ever clamped or wrapped for the user.

``index_range`` gives the range of one index expression; ``subscript_ranges`` gives every
subscript of a checked expression. Knows the expression grammar's operators; nothing of kernels.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence

from ..errors import ExpressionError
from . import expr_syntax
from .expr_syntax import INDEX_NAMES, Token

#: Largest size of each index name's axis that any call may have (inputs.py MAX_SEQ_LEN, MAX_GRID_YZ).
SIZE_LIMITS = {"b": 65535, "h": 65535, "q_idx": 2**31 - 2**16, "kv_idx": 2**31 - 2**16}
_AXES = INDEX_NAMES  # form coefficient order: sizes of b, h, q_idx, kv_idx
#: The size limits in force (``size_limits`` tightens them while one expression is analysed).
_LIMITS: contextvars.ContextVar = contextvars.ContextVar("omnicupy_index_size_limits", default=SIZE_LIMITS)


@contextlib.contextmanager
def size_limits(limits: Mapping[str, int]):
    """Analyse with tighter axis sizes (never looser than SIZE_LIMITS): an expression that reads an
    array of L elements at a bare ``q_idx`` can only be called with ``Nq <= L`` (the call's length
    check refuses more), so inside that expression ``q_idx <= L - 1`` holds for every other index too."""
    merged = {a: max(1, min(SIZE_LIMITS[a], int(limits.get(a, SIZE_LIMITS[a])))) for a in _AXES}
    token = _LIMITS.set(merged)
    try:
        yield
    finally:
        _LIMITS.reset(token)
_INT32 = (-2**31, 2**31 - 1)
_MAX_BOUNDS = 8  # bounds kept per side; dropping one only weakens the range (still sound)


@dataclass(frozen=True)
class Form:
    """``const + sum(coef[i] * size[i])`` over the sizes of ``b, h, q_idx, kv_idx`` (exact fractions)."""

    const: Fraction
    coef: tuple = (Fraction(0),) * 4

    @classmethod
    def of(cls, value) -> "Form":
        return cls(Fraction(value))

    def __add__(self, other: "Form") -> "Form":
        return Form(self.const + other.const, tuple(a + b for a, b in zip(self.coef, other.coef)))

    def scale(self, k: Fraction) -> "Form":
        return Form(self.const * k, tuple(c * k for c in self.coef))

    def extreme(self, largest: bool) -> Fraction:
        """The form's max (or min) over every allowed size (each size in [1, SIZE_LIMITS])."""
        total, limits = self.const, _LIMITS.get()
        for c, axis in zip(self.coef, _AXES):
            total += c * (limits[axis] if (c > 0) == largest else 1)
        return total

    @property
    def constant(self) -> bool:
        return not any(self.coef)

    def __str__(self) -> str:
        names = {"b": "B", "h": "H", "q_idx": "Nq", "kv_idx": "Nkv"}
        parts = [f"{c}*{names[a]}" if c != 1 else names[a] for c, a in zip(self.coef, _AXES) if c]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")


def _pairwise(xs, ys, pick) -> tuple:
    """Bounds of ``pick(x, y)`` (pick: min for lower bounds, max for upper bounds) for every pair: the
    coefficient-wise pick, and each form moved by the most the other can pass it over all sizes."""
    sign = Fraction(1) if pick is max else Fraction(-1)
    out = []
    for x, y in itertools.product(xs, ys):
        out.append(Form(pick(x.const, y.const), tuple(pick(a, b) for a, b in zip(x.coef, y.coef))))
        for first, second in ((x, y), (y, x)):
            excess = (second + first.scale(Fraction(-1))).scale(sign).extreme(True)
            out.append(first + Form.of(sign * max(excess, Fraction(0))))
    return tuple(out)


@dataclass(frozen=True)
class Range:
    """Bounds of an int expression: the value is >= every form in ``lows`` and <= every form in
    ``highs`` (an empty side is unbounded); ``is_int`` is False for a float value (no bound)."""

    lows: tuple = ()
    highs: tuple = ()
    is_int: bool = True
    why: str = ""  # why a side is unbounded, for the error message

    @classmethod
    def point(cls, value) -> "Range":
        return cls((Form.of(value),), (Form.of(value),))

    @classmethod
    def unbounded(cls, why: str, is_int: bool = True) -> "Range":
        return cls((), (), is_int, why)

    def low(self) -> Optional[Fraction]:
        """The least value the lower bounds allow over every size (None: unbounded)."""
        return max((f.extreme(False) for f in self.lows), default=None)

    def high(self) -> Optional[Fraction]:
        return min((f.extreme(True) for f in self.highs), default=None)

    def nonneg(self) -> bool:
        low = self.low()
        return low is not None and low >= 0

    def nonpos(self) -> bool:
        high = self.high()
        return high is not None and high <= 0

    def concrete(self) -> Optional[tuple]:
        """(low, high) as numbers when some bound on each side uses no size."""
        lo = [f.const for f in self.lows if f.constant]
        hi = [f.const for f in self.highs if f.constant]
        return (max(lo), min(hi)) if lo and hi else None

    def below(self, axis: str) -> bool:
        """Provably ``< size(axis)`` for every allowed size."""
        limit = Form(Fraction(-1), tuple(Fraction(a == axis) for a in _AXES))
        return any((h + limit.scale(Fraction(-1))).extreme(True) <= 0 for h in self.highs)

    def describe(self) -> str:
        lo = " and >= ".join(str(f) for f in self.lows) or "unbounded"
        hi = " and <= ".join(str(f) for f in self.highs) or "unbounded"
        return f">= {lo}, <= {hi}" + (f" ({self.why})" if self.why else "")


def _checked(r: Range, why: str) -> Range:
    """``r``, or unbounded when some value it allows may leave int32 (the kernel would wrap)."""
    lows = tuple(sorted(set(r.lows), key=str))[:_MAX_BOUNDS]
    highs = tuple(sorted(set(r.highs), key=str))[:_MAX_BOUNDS]
    low, high = Range(lows, highs).low(), Range(lows, highs).high()
    if low is None or high is None or low < _INT32[0] or high > _INT32[1]:
        return Range.unbounded(r.why or why)
    return Range(lows, highs, True, r.why)


def _neg(r: Range) -> Range:
    return Range(tuple(h.scale(Fraction(-1)) for h in r.highs), tuple(lo.scale(Fraction(-1)) for lo in r.lows))


def _hull(a: Range, b: Range) -> Range:
    """Either ``a`` or ``b`` (a ternary's arms)."""
    return Range(_pairwise(a.lows, b.lows, min), _pairwise(a.highs, b.highs, max))


def _binary(op: str, a: Range, b: Range) -> Range:
    if not (a.is_int and b.is_int):
        return Range.unbounded("a float value", is_int=False)
    if op in ("==", "!=", "<", ">", "<=", ">=", "&&", "||"):
        return Range(*((Form.of(0),), (Form.of(1),)))
    if op == "+":
        return _checked(Range(tuple(x + y for x, y in itertools.product(a.lows, b.lows)),
                              tuple(x + y for x, y in itertools.product(a.highs, b.highs))), "a sum")
    if op == "-":
        return _binary("+", a, _neg(b))
    ca, cb = a.concrete(), b.concrete()
    if op == "*":
        if ca and cb:
            products = [x * y for x in ca for y in cb]
            return _checked(Range((Form.of(min(products)),), (Form.of(max(products)),)), "a product")
        for (k, other) in ((ca, b), (cb, a)):
            if k and k[0] == k[1]:
                scaled = Range(tuple(f.scale(k[0]) for f in other.lows), tuple(f.scale(k[0]) for f in other.highs))
                return _checked(scaled if k[0] >= 0 else Range(scaled.highs, scaled.lows), "a product")
        return Range.unbounded("a product of two values that are not constants")
    if op in ("/", "%"):
        if not cb or cb[0] < 1:
            return Range.unbounded(f"'{op}' by a value not provably >= 1")
        if not a.nonneg():
            return Range.unbounded(f"'{op}' of a value not provably >= 0 (C rounds toward zero)")
        if op == "/":
            return _checked(Range((Form.of(0),), tuple(f.scale(1 / cb[0]) for f in a.highs)), "a quotient")
        return _checked(Range((Form.of(0),), a.highs + (Form.of(cb[1] - 1),)), "a remainder")
    if op == "&":
        sides = [r for r in (a, b) if r.nonneg()]
        if sides:
            return _checked(Range((Form.of(0),), tuple(h for r in sides for h in r.highs)), "a bitwise and")
        return Range.unbounded("'&' of two values not provably >= 0")
    if op == ">>" and cb and cb[0] >= 0 and cb[1] < 31 and a.nonneg():
        return _checked(Range((Form.of(0),), tuple(f.scale(Fraction(1, 2**int(cb[0]))) for f in a.highs)), "a shift")
    if op == "<<" and cb and cb[0] == cb[1] and 0 <= cb[0] < 31:
        return _binary("*", a, Range.point(2**int(cb[0])))
    if op in ("|", "^") and ca and cb and ca[0] >= 0 and cb[0] >= 0:
        top = 2**int(max(ca[1], cb[1])).bit_length() - 1
        return Range((Form.of(0),), (Form.of(top),))
    return Range.unbounded(f"'{op}' on these values")


def _call(name: str, args: list) -> Range:
    if name not in ("min", "max", "abs") or not all(a.is_int for a in args):
        return Range.unbounded(f"{name}() gives a float", is_int=False)
    if name == "abs":
        if len(args) != 1:
            raise ExpressionError("abs takes one argument")
        a = args[0]
        if a.nonneg():
            return a
        if a.nonpos():
            return _neg(a)
        return _checked(Range((Form.of(0),), _pairwise(a.highs, _neg(a).highs, max)), "abs")
    if len(args) != 2:
        raise ExpressionError(f"{name} takes two arguments")
    a, b = args
    if name == "min":  # below both; above the smaller of the two lower bounds
        return Range(_pairwise(a.lows, b.lows, min), a.highs + b.highs, True, a.why or b.why)
    return Range(a.lows + b.lows, _pairwise(a.highs, b.highs, max), True, a.why or b.why)


_BINARY_PRECEDENCE = {"||": 2, "&&": 3, "|": 4, "^": 5, "&": 6, "==": 7, "!=": 7, "<": 8, ">": 8, "<=": 8,
                      ">=": 8, "<<": 9, ">>": 9, "+": 10, "-": 10, "*": 11, "/": 11, "%": 11}


class _Parser:
    """Precedence climbing over checked tokens; each rule returns the Range of what it read, and
    records ``(array, Range of its subscript)`` for every array read."""

    def __init__(self, tokens: Sequence[Token], constants: Mapping[str, Range], arrays: Mapping[str, Range]):
        self.tokens, self.at = list(tokens), 0
        self.constants, self.arrays = constants, arrays
        self.subscripts: list = []

    def peek(self, ahead: int = 0) -> Optional[str]:
        i = self.at + ahead
        return self.tokens[i].text if i < len(self.tokens) else None

    def take(self, expected: Optional[str] = None) -> Token:
        tok = self.tokens[self.at]
        if expected is not None and tok.text != expected:
            raise ExpressionError(f"expected {expected!r} at offset {tok.at}, got {tok.text!r}")
        self.at += 1
        return tok

    def expression(self, min_prec: int = 1) -> Range:
        left = self.unary()
        while True:
            op = self.peek()
            if op == "?" and min_prec <= 1:
                self.take()
                yes = self.expression(1)
                self.take(":")
                no = self.expression(1)
                left = _hull(yes, no) if yes.is_int and no.is_int else Range.unbounded("a float", False)
                continue
            prec = _BINARY_PRECEDENCE.get(op or "")
            if op is None or prec is None or prec < min_prec:
                return left
            self.take()
            left = _binary(op, left, self.expression(prec + 1))

    def unary(self) -> Range:
        t = self.peek()
        if t in ("-", "+", "!", "~"):
            self.take()
            a = self.unary()
            if not a.is_int:
                return a
            if t == "-":
                return _checked(_neg(a), "a negation")
            if t == "~":
                return _checked(_binary("-", _neg(a), Range.point(1)), "a bitwise not")
            return a if t == "+" else Range((Form.of(0),), (Form.of(1),))
        if t == "(" and self.peek(1) in expr_syntax.CAST_TYPES and self.peek(2) == ")":
            self.take(), self.take(), self.take()
            kind, a = self.tokens[self.at - 2].text, self.unary()
            if kind == "float":
                return Range.unbounded("a float cast", is_int=False)
            if kind == "bool":
                return Range((Form.of(0),), (Form.of(1),))
            return a if a.is_int else Range.unbounded("an int cast of a float")
        return self.primary()

    def primary(self) -> Range:
        tok = self.take()
        t = tok.text
        if t == "(":
            r = self.expression()
            self.take(")")
            return r
        if tok.kind == "number":
            if t[-1] in "uU":
                return Range.unbounded("an unsigned literal (unsigned arithmetic wraps)")
            return Range.point(int(t)) if t.isdigit() else Range.unbounded("a float literal", is_int=False)
        if t in ("true", "false"):
            return Range.point(int(t == "true"))
        if t in INDEX_NAMES:
            return Range((Form.of(0),), (Form(Fraction(-1), tuple(Fraction(a == t) for a in _AXES)),))
        if t in self.constants:
            return self.constants[t]
        if t in self.arrays:
            self.take("[")
            index = self.expression()
            self.take("]")
            self.subscripts.append((t, index))
            return self.arrays[t]
        if self.peek() == "(":  # a function call
            self.take("(")
            args = [self.expression()]
            while self.peek() == ",":
                self.take()
                args.append(self.expression())
            self.take(")")
            return _call(t, args)
        return Range.unbounded(f"{t} is a float", is_int=False)  # score


def _value_ranges(constants: Optional[Mapping[str, Any]],
                  arrays: Optional[Mapping[str, Any]]) -> tuple[dict[str, Range], dict[str, Range]]:
    consts: dict[str, Range] = {}
    for name, value in (constants or {}).items():
        is_int = isinstance(value, (bool, int)) or getattr(getattr(value, "dtype", None), "kind", "f") in "biu"
        consts[name] = Range.point(int(value)) if is_int else Range.unbounded(f"{name} is a float", False)
    values: dict[str, Range] = {}
    for name, bounds in (arrays or {}).items():
        values[name] = Range.unbounded(f"{name} holds floats", False) if bounds is None else \
            Range((Form.of(bounds[0]),), (Form.of(bounds[1]),))
    return consts, values


def subscript_ranges(text: str, *, constants: Optional[Mapping[str, object]] = None,
                     arrays: Optional[Mapping[str, Optional[tuple]]] = None, score: bool = True) -> tuple:
    """``((array name, Range of its subscript), ...)`` for every array read in ``text``, in text order.
    ``constants``: name -> int/bool/float value; ``arrays``: name -> (min, max) of an int array's
    values, or None for a float array. ``text`` is checked against the grammar first."""
    syntax = expr_syntax.check(text, constants=list(constants or {}), arrays=list(arrays or {}), score=score)
    parser = _Parser(syntax.tokens, *_value_ranges(constants, arrays))
    parser.expression()
    if parser.at != len(parser.tokens):
        raise ExpressionError(f"CUDA expression {text!r}: unexpected {parser.peek()!r}")
    return tuple(parser.subscripts)


def index_range(index: str, *, constants: Optional[Mapping[str, object]] = None,
                arrays: Optional[Mapping[str, Optional[tuple]]] = None) -> Range:
    """The Range of one index expression (the text between an array's brackets), e.g.
    ``index_range("min(q_idx + 1, N - 1)", constants={"N": 64})``: >= 0, <= 63 (and <= Nq)."""
    syntax = expr_syntax.check(index, constants=list(constants or {}), arrays=list(arrays or {}), score=True)
    parser = _Parser(syntax.tokens, *_value_ranges(constants, arrays))
    result = parser.expression()
    if parser.at != len(parser.tokens):
        raise ExpressionError(f"index {index!r}: unexpected {parser.peek()!r}")
    return result


__all__ = ["Form", "Range", "SIZE_LIMITS", "index_range", "size_limits", "subscript_ranges"]
