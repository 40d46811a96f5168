"""Calls, attributes and subscripts for the mask compiler's front end (compile_frontend.py): the
array functions under any module name, Python's builtins, ``functools.reduce``, table lookups
(closure arrays, the zoo's ``LookupTable``), inlined functions and mask_mods.

Knows the names FlexAttention users call; knows nothing of kernels.
"""
from __future__ import annotations

import ast
import builtins
import functools
import operator
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import compile_ir as ir
from .compile_frontend import _NAMESPACE_NAMES, HELPERS, Local, fetch, Namespace, Ref, Row, Scope, Translator, _is_array, _is_python
from .mask_mod import LookupTable, MaskMod

_ARRAY_MODULES = ("numpy", "cupy", "torch", "jax", "math")
_OPERATORS = {operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.add: "+", operator.sub: "-",
              operator.mul: "*", operator.floordiv: "//", operator.mod: "%"}
_COMPARE = {"less": "<", "lt": "<", "less_equal": "<=", "le": "<=", "greater": ">", "gt": ">",
            "greater_equal": ">=", "ge": ">=", "equal": "==", "eq": "==", "not_equal": "!=", "ne": "!="}


@dataclass(frozen=True)
class ArrayFunction:
    """``xp.name`` of an array module."""
    name: str


@dataclass(frozen=True)
class Method:
    """``obj.name`` of a table (``lookup``, ``on``) or of a traced value (``new_ones``, ``clamp``)."""
    obj: Any
    name: str


def attribute(tr: Translator, base: Any, e: ast.Attribute) -> Any:
    name = e.attr
    if isinstance(base, Namespace):
        return ArrayFunction(name)
    if isinstance(base, Ref):
        v = base.value
        if isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in _ARRAY_MODULES:
            return ArrayFunction(name)
        if base.path and base.path[-1][-1] in _NAMESPACE_NAMES and not _is_array(v):
            return ArrayFunction(name)  # an array module by its usual name (xp, np, torch, ...)
        if isinstance(v, LookupTable) and name in ("lookup", "on"):
            return Method(base, name)
        if _is_array(v) and name not in ("shape", "ndim", "size"):
            raise tr.refuse(e, f"the array attribute .{name}")
        try:
            value = getattr(v, name)
        except AttributeError:
            raise tr.refuse(e, f"the attribute .{name} of a {type(v).__name__}, which has none") from None
        return tr.ref(value, base.path + (("attr", name),))
    if isinstance(base, ir.Node) and name in ("new_ones", "new_zeros", "clamp", "clip", "abs", "logical_not"):
        return Method(base, name)
    raise tr.refuse(e, f"the attribute .{name} of a {type(base).__name__}")


def _table_kind(tr: Translator, r: Ref, at: Any) -> str:
    dtype = np.dtype(str(r.value.dtype).replace("torch.", "")) if not isinstance(r.value, np.ndarray) else r.value.dtype
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "iu":
        return "int"
    raise tr.refuse(at, f"a lookup in a table of {dtype} (tables hold ints or bools)")


def lookup(tr: Translator, r: Ref, index: tuple, at: Any) -> ir.Node:
    ndim = len(r.value.shape)
    if ndim != len(index) or ndim not in (1, 2):
        raise tr.refuse(at, f"an index of {len(index)} values into a {ndim}-D table (1-D and 2-D tables only)")
    kind = _table_kind(tr, r, at)
    nodes = tuple(tr.node(i, at) for i in index)
    if any(n.kind == "bool" for n in nodes):
        raise tr.refuse(at, "a boolean used as an index")
    cols = int(r.value.shape[1]) if ndim == 2 else 0
    if ndim == 2:  # the column count is part of the text
        tr.checks[r.path] = tr.checks.get(r.path, ()) + (("cols", cols),)
    return ir.Lookup(kind, getattr(at, "lineno", 0), tr.slot(r, "table"), nodes, cols)


def subscript(tr: Translator, base: Any, e: ast.Subscript, scope: Scope) -> Any:
    if isinstance(e.slice, ast.Slice) or (isinstance(e.slice, ast.Tuple) and any(isinstance(x, ast.Slice)
                                                                                for x in e.slice.elts)):
        raise tr.refuse(e, "a slice")
    index = tr.expr(e.slice, scope)
    parts = index if isinstance(index, tuple) else (index,)
    if isinstance(base, Row):
        return lookup(tr, base.ref, (base.index,) + parts, e)
    if isinstance(base, Ref) and _is_array(base.value):
        if len(base.value.shape) == 2 and len(parts) == 1:
            return Row(base, tr.node(parts[0], e))  # t[i][j]: FlexAttention's scalar reading of t[i, j]
        return lookup(tr, base, parts, e)
    if isinstance(base, Ref) and isinstance(base.value, (tuple, list)):
        i = tr.static(index, e, "an index into a Python sequence that is not known when compiling")
        try:
            return tr.ref(base.value[i], base.path + (("item", i),))
        except (IndexError, TypeError):
            raise tr.refuse(e, f"the index {i!r} of a sequence of {len(base.value)}") from None
    if isinstance(base, tuple) and _is_python(index):
        return base[index]
    raise tr.refuse(e, f"indexing a {type(base.value if isinstance(base, Ref) else base).__name__}")


def _bool_dtype(tr: Translator, v: Any) -> bool:
    raw = v.value if isinstance(v, Ref) else v
    return raw is bool or raw is np.bool_ or "bool" in str(raw)


def _where(tr: Translator, at, c, x, y) -> Any:
    nc, nx, ny = tr.node(c, at), tr.node(x, at), tr.node(y, at)
    if nc.kind != "bool":
        raise tr.refuse(at, "where() with a condition that is not boolean")
    kind = "bool" if nx.kind == ny.kind == "bool" else "int"
    return ir.Where(kind, at.lineno, nc, nx, ny)


def _minmax(tr: Translator, op: str, x: Any, y: Any, at: Any) -> Any:
    if _is_python(x) and _is_python(y):
        return min(x, y) if op == "min" else max(x, y)
    nx, ny = tr.node(x, at), tr.node(y, at)
    if nx.kind != ny.kind:
        raise tr.refuse(at, f"{op} of a boolean and an int")
    return ir.Binary(nx.kind, at.lineno, op, nx, ny)


def _clamp(tr: Translator, at, x, low=None, high=None) -> Any:
    if low is not None:
        x = _minmax(tr, "max", x, low, at)
    if high is not None:
        x = _minmax(tr, "min", x, high, at)
    return x


def _abs(tr: Translator, at, x) -> Any:
    if _is_python(x):
        return abs(x)
    n = tr.node(x, at)
    if n.kind == "bool":
        raise tr.refuse(at, "abs of a boolean")
    return ir.Abs("int", at.lineno, n)


def _not(tr: Translator, at, x) -> Any:
    n = tr.node(x, at)
    if n.kind != "bool":
        raise tr.refuse(at, "logical_not of a non-boolean value")
    return ir.Unary("bool", at.lineno, "not", n)


def array_function(tr: Translator, name: str, args: list, kwargs: dict, at: Any) -> Any:
    if name == "where" and len(args) == 3:
        return _where(tr, at, *args)
    if name in ("minimum", "maximum") and len(args) == 2:
        return _minmax(tr, name[:3], args[0], args[1], at)
    if name in ("abs", "absolute") and len(args) == 1:
        return _abs(tr, at, args[0])
    if name in ("logical_and", "logical_or") and len(args) == 2:
        return tr.logical(name[8:], args[0], args[1], at)
    if name == "logical_xor" and len(args) == 2:
        return tr.binop("^", tr.node(args[0], at), tr.node(args[1], at), at)
    if name == "logical_not" and len(args) == 1:
        return _not(tr, at, args[0])
    if name in ("bitwise_and", "bitwise_or", "bitwise_xor") and len(args) == 2:
        return tr.binop({"and": "&", "or": "|", "xor": "^"}[name[8:]], args[0], args[1], at)
    if name in ("bitwise_not", "invert") and len(args) == 1:
        n = tr.node(args[0], at)
        return ir.Unary(n.kind, at.lineno, "not" if n.kind == "bool" else "invert", n)
    if name == "floor_divide" and len(args) == 2:
        return tr.binop("//", args[0], args[1], at)
    if name in ("remainder", "mod") and len(args) == 2:
        return tr.binop("%", args[0], args[1], at)
    if name == "fmod" and len(args) == 2:
        nx, ny = tr.node(args[0], at), tr.node(args[1], at)
        return ir.Binary("int", at.lineno, "fmod", nx, ny)
    if name in ("clamp", "clip") and 1 <= len(args) <= 3:
        low = args[1] if len(args) > 1 else kwargs.get("min", kwargs.get("a_min"))
        high = args[2] if len(args) > 2 else kwargs.get("max", kwargs.get("a_max"))
        return _clamp(tr, at, args[0], low, high)
    if name in _COMPARE and len(args) == 2:
        return tr.compare(_COMPARE[name], args[0], args[1], at)
    if name in ("asarray", "array", "tensor", "as_tensor") and len(args) >= 1 and _is_python(args[0]):
        return args[0]
    if name in ("ones_like", "zeros_like", "full_like"):
        value = {"ones_like": 1, "zeros_like": 0}.get(name, args[1] if len(args) > 1 else kwargs.get("fill_value"))
        if not _is_python(value):
            raise tr.refuse(at, f"{name} with a fill value not known when compiling")
        return bool(value) if _bool_dtype(tr, kwargs.get("dtype")) else value
    raise tr.refuse(at, f"the array function {name}() with {len(args)} arguments")


def apply(tr: Translator, fn: Any, args: list, kwargs: dict, at: Any) -> Any:
    """Call the value ``fn`` (what a name or attribute gave) with these argument values."""
    if isinstance(fn, ArrayFunction):
        return array_function(tr, fn.name, args, kwargs, at)
    if isinstance(fn, Local):
        scope = Scope(fn.scope)
        tr.bind_args(fn.node, scope, args, kwargs, at)
        return tr.run_function(fn.node, scope, at)
    if isinstance(fn, Method):
        return _method(tr, fn, args, kwargs, at)
    if not isinstance(fn, Ref):
        raise tr.refuse(at, f"a call of a {type(fn).__name__}")
    f = fn.value
    if f in HELPERS:
        return args[0] if HELPERS[f] == "first" else Namespace()
    if f in _OPERATORS and len(args) == 2:
        return tr.binop(_OPERATORS[f], args[0], args[1], at)
    if f is functools.reduce and len(args) in (2, 3):
        items = tr.sequence(args[1], at)
        if len(args) == 3:
            items = [args[2]] + items
        if not items:
            raise tr.refuse(at, "reduce() of an empty sequence")
        return functools.reduce(lambda x, y: apply(tr, args[0], [x, y], {}, at), items)
    if f is builtins.min or f is builtins.max:
        if len(args) != 2:
            raise tr.refuse(at, f"{f.__name__}() of {len(args)} arguments (two: elementwise)")
        return _minmax(tr, f.__name__, args[0], args[1], at)
    if f is builtins.abs and len(args) == 1:
        return _abs(tr, at, args[0])
    if f is builtins.len and len(args) == 1 and isinstance(args[0], Ref):
        return tr.ref(len(args[0].value), args[0].path + (("len",),))
    if f is builtins.range:
        bounds = [tr.static(a, at, "range() of a traced value") for a in args]
        return tuple(range(*bounds))
    if f in (builtins.bool, builtins.int) and len(args) == 1 and _is_python(args[0]):
        return f(args[0])
    if isinstance(f, (types.FunctionType, MaskMod, functools.partial)):
        return tr.call_function(f, fn.path, args, kwargs, at)
    raise tr.refuse(at, f"a call of {getattr(f, '__name__', type(f).__name__)} (a {type(f).__name__}: C callables "
                        "and unknown functions have no source to compile)")


def _method(tr: Translator, m: Method, args: list, kwargs: dict, at: Any) -> Any:
    if isinstance(m.obj, Ref):  # a LookupTable
        host = tr.ref(fetch(m.obj.value, (("host",),)), m.obj.path + (("host",),))
        if m.name == "on":
            return host
        if len(args) != 2:
            raise tr.refuse(at, "LookupTable.lookup(b, idx) with other arguments")
        b, idx = args
        return lookup(tr, host, (idx,) if len(host.value.shape) == 1 else (b, idx), at)
    if m.name in ("new_ones", "new_zeros"):
        value = 1 if m.name == "new_ones" else 0
        return bool(value) if _bool_dtype(tr, kwargs.get("dtype")) else value
    if m.name in ("clamp", "clip"):
        return _clamp(tr, at, m.obj, args[0] if args else kwargs.get("min"), args[1] if len(args) > 1
                      else kwargs.get("max"))
    if m.name == "abs":
        return _abs(tr, at, m.obj)
    return _not(tr, at, m.obj)


def call(tr: Translator, e: ast.Call, scope: Scope) -> Any:
    if any(isinstance(a, ast.Starred) for a in e.args) or any(k.arg is None for k in e.keywords):
        raise tr.refuse(e, "*args or **kwargs in a call")
    fn = tr.expr(e.func, scope)
    args = [tr.expr(a, scope) for a in e.args]
    kwargs = {k.arg: tr.expr(k.value, scope) for k in e.keywords}
    return apply(tr, fn, args, kwargs, e)


class MaskTranslator(Translator):
    """The front end with this module's calls, attributes and subscripts."""

    def attribute(self, base: Any, e: ast.Attribute) -> Any:
        return attribute(self, base, e)

    def subscript(self, base: Any, e: ast.Subscript, scope: Scope) -> Any:
        return subscript(self, base, e, scope)

    def call(self, e: ast.Call, scope: Scope) -> Any:
        return call(self, e, scope)


__all__ = ["MaskTranslator", "attribute", "subscript", "call", "apply", "array_function", "lookup"]
