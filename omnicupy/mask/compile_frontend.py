"""From a mask_mod's Python source to the compiler's tree (compile_ir.py).

The body is read as FlexAttention's scalar semantics: each of ``b, h, q_idx, kv_idx`` one integer.
Statements: assignments (names, tuples), nested ``def``s and lambdas, ``return``, ``for`` over a
sequence known when compiling (a closure tuple of masks, ``range(3)``), and ``if``/``x if c else
y`` whose condition is known when compiling (a closure flag). Expressions: int and bool literals,
arithmetic, ``//`` and ``%`` (Python's floor), comparisons (chained), ``& | ^ ~`` and ``and or
not`` on booleans, calls of the array functions (``where, minimum, maximum, abs, clamp/clip,
logical_*, floor_divide, remainder, fmod``) under any module name (``torch.``, ``np.``, ``cp.``,
``xp.``), Python's ``min max abs len range``, indexing of closure tables (1-D and 2-D, also
``t[i][j]``), calls of other functions and mask_mods (inlined with their own closures), and the
zoo's tables (``LookupTable.lookup``) and helpers.

Every closure value the tree depends on is reached by a *path* from the mask_mod (``('free',
'window')``, ``('item', 1)``, ...) and recorded with its signature (type, code object, length, or
the value itself where it chose a branch), so that the tree can be reused for another mask_mod
with the same code whose values differ only where the tree reads them as data (``Template``).
Numbers and tables become slots; their values are fetched per instance.

Knows Python's ``ast`` and the zoo's objects; knows nothing of kernels.
"""
from __future__ import annotations

import ast
import builtins
import functools
import operator
import re
import types
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError
from . import compile_ir as ir
from .compile_source import function_node
from .mask_mod import LookupTable, MaskMod, array_module_of, as_bool_result

_MAX_DEPTH = 40
_NAMESPACES = {"numpy", "cupy", "torch", "jax.numpy", "math"}
_NAMESPACE_NAMES = {"np", "cp", "xp", "torch", "jnp", "numpy", "cupy"}
_PY_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.BitAnd: "&",
           ast.BitOr: "|", ast.BitXor: "^"}
_PY_CMP = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_FOLD = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod,
         "&": operator.and_, "|": operator.or_, "^": operator.xor}


@dataclass(frozen=True)
class Ref:
    """A Python value from the mask_mod's closure, globals or defaults, and its path."""
    value: Any
    path: tuple


@dataclass(frozen=True)
class Namespace:
    """An array module (``torch``, ``np``, a mask's ``xp``): its functions are the array functions."""


@dataclass(frozen=True)
class Row:
    """``t[i]`` of a 2-D table, waiting for its column."""
    ref: Ref
    index: ir.Node


class Local:
    """A ``def`` or ``lambda`` of the body, with the scope it closes over."""

    def __init__(self, node, scope: "Scope") -> None:
        self.node, self.scope = node, scope


class Scope:
    """Local names, then the enclosing scope, then (for a real function) its closure and globals."""

    def __init__(self, parent: Optional["Scope"], fn: Any = None, path: tuple = ()) -> None:
        self.names: dict = {}
        self.parent, self.fn, self.path = parent, fn, path


def scalar_signature(value: Any) -> tuple:
    """A closure number read as data: its type, and whether it is positive."""
    if isinstance(value, (bool, np.bool_)):
        return ("bool",)
    return ("int", "positive" if value > 0 else "any")


def signature(value: Any) -> tuple:
    """What of a closure value the tree depends on (values read as data are slots, not here)."""
    if isinstance(value, (bool, np.bool_)):
        return ("bool",)
    if isinstance(value, (int, np.integer)):
        return ("int",)
    if isinstance(value, types.FunctionType):
        return ("fn", value.__code__)
    if isinstance(value, (types.BuiltinFunctionType, np.ufunc)):
        return ("builtin", value)  # reduce, operator.and_, min: which one is the tree's choice
    if isinstance(value, MaskMod):
        return ("maskmod",)
    if isinstance(value, LookupTable):
        return ("table",)
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, (tuple, list)):
        return ("seq", len(value))
    if value is None or isinstance(value, (str, float)):
        return ("value", value)
    if _is_array(value):
        return ("array", len(value.shape), str(value.dtype))
    return ("object", type(value))


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and (
        isinstance(v, np.ndarray) or hasattr(v, "__dlpack__") or hasattr(v, "__cuda_array_interface__"))


def fetch(root: Any, path: tuple) -> Any:
    """The value at ``path`` from ``root`` (the steps ``Translator`` records)."""
    v = root
    for step in path:
        kind: str = step[0]
        arg: Any = step[1] if len(step) > 1 else None
        if kind == "free":
            v = v.__closure__[v.__code__.co_freevars.index(arg)].cell_contents
        elif kind == "global":
            v = v.__globals__[arg] if arg in v.__globals__ else getattr(builtins, arg)
        elif kind == "default":
            v = v.__defaults__[arg]
        elif kind == "kwdefault":
            v = v.__kwdefaults__[arg]
        elif kind == "item":
            v = v[arg]
        elif kind == "attr":
            v = getattr(v, arg)
        elif kind == "len":
            v = len(v)
        elif kind == "host":  # a LookupTable's values
            v = next(iter(v._copies.values()))
        else:
            raise AssertionError(step)
    return v


class Translator:
    """One translation: the tree, the slots it reads and the values it depends on."""

    def __init__(self, root: Any, what: str) -> None:
        self.root, self.what = root, what
        self.checks: dict = {}   # path -> signature
        self.slots: dict = {}    # path -> (slot name, "scalar" | "table", ndim)
        self.depth = 0

    # -------------------------------------------------------------- values and slots
    def refuse(self, node: Any, why: str) -> MaskError:
        line = getattr(node, "lineno", "?")
        return MaskError(f"{self.what}: cannot compile {why} (line {line})")

    def ref(self, value: Any, path: tuple, exact: bool = False) -> Ref:
        self.checks[path] = ("value", value) if exact else signature(value)
        return Ref(value, path)

    def slot(self, r: Ref, kind: str) -> str:
        if r.path not in self.slots:
            names = [s[1] for s in r.path if s[0] in ("free", "global", "attr", "kwdefault") and isinstance(s[1], str)]
            base = re.sub(r"[^A-Za-z0-9]+", "_", names[-1] if names else "v").strip("_").lower() or "v"
            taken = {s[0] for s in self.slots.values()}
            name, i = f"{'s' if kind == 'scalar' else 't'}_{base}", 1
            while name in taken:
                i += 1
                name = f"{'s' if kind == 'scalar' else 't'}_{base}{i}"
            ndim = len(r.value.shape) if kind == "table" else 0
            self.slots[r.path] = (name, kind, ndim)
        return self.slots[r.path][0]

    def node(self, v: Any, at: Any) -> ir.Node:
        """``v`` as a tree node (literals and closure numbers become constants and slots)."""
        line = getattr(at, "lineno", 0)
        if isinstance(v, ir.Node):
            return v
        raw = v.value if isinstance(v, Ref) else v
        if isinstance(v, Ref) and _is_array(raw) and tuple(raw.shape) == () and "float" not in str(raw.dtype):
            raw = raw.item()  # a 0-d int or bool array (torch.tensor(256)): a number like any other
        if isinstance(raw, (bool, np.bool_, int, np.integer)) and not isinstance(raw, type):
            value = int(raw) if not isinstance(raw, (bool, np.bool_)) else bool(raw)
            if not ir.INT32_MIN <= int(value) <= ir.INT32_MAX:
                raise self.refuse(at, f"the number {value}, which does not fit the kernels' 32-bit ints")
            kind = "bool" if isinstance(value, bool) else "int"
            if isinstance(v, Ref):
                sig = scalar_signature(raw)  # positive numbers divide with C's own / and %
                self.checks[v.path] = sig
                return ir.Scalar(kind, line, self.slot(v, "scalar"), sig == ("int", "positive"))
            return ir.Const(kind, line, value)
        if isinstance(raw, (float, np.floating)):
            raise self.refuse(at, f"the float {raw!r}: compiled masks compute in integers, exactly")
        raise self.refuse(at, f"a {type(raw).__name__} used as a value")

    # -------------------------------------------------------------- functions
    def call_function(self, fn: Any, path: tuple, args: list, kwargs: dict, at: Any) -> Any:
        """Inline a Python function (or a MaskMod's) with these argument values."""
        self.checks[path] = signature(fn)  # the tree is this function's: another code is another tree
        if isinstance(fn, MaskMod):
            return self.call_function(fn.fn, path + (("attr", "fn"),), args, kwargs, at)
        if isinstance(fn, functools.partial):
            return self.call_function(fn.func, path + (("attr", "func"),),
                                      [self.ref(a, path + (("attr", "args"), ("item", i)))
                                       for i, a in enumerate(fn.args)] + args, kwargs, at)
        if not isinstance(fn, types.FunctionType):
            raise self.refuse(at, f"a call of {getattr(fn, '__name__', type(fn).__name__)} (a "
                                  f"{type(fn).__name__}; only Python functions and mask_mods are inlined)")
        node = function_node(fn.__code__, f"{self.what}: {fn.__qualname__}")
        scope = Scope(None, fn, path)
        self.bind_args(node, scope, args, kwargs, at, fn, path)
        return self.run_function(node, scope, at)

    def bind_args(self, node, scope: Scope, args: list, kwargs: dict, at: Any, fn: Any = None, path: tuple = ()):
        a = node.args
        if a.vararg or a.kwarg or a.posonlyargs:
            raise self.refuse(node, "*args, **kwargs or positional-only parameters")
        params = [p.arg for p in a.args]
        if len(args) > len(params):
            raise self.refuse(at, f"a call with {len(args)} arguments of a function taking {len(params)}")
        bound = dict(zip(params, args))
        for k, v in kwargs.items():
            if k not in params and k not in [p.arg for p in a.kwonlyargs]:
                raise self.refuse(at, f"an unknown keyword argument {k!r}")
            bound[k] = v
        first_default = len(params) - len(a.defaults)
        for i, p in enumerate(params):
            if p not in bound:
                if i < first_default:
                    raise self.refuse(at, f"a call without the argument {p!r}")
                if fn is not None:
                    bound[p] = self.ref(fn.__defaults__[i - first_default], path + (("default", i - first_default),))
                else:
                    bound[p] = self.expr(a.defaults[i - first_default], scope.parent or scope)
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            if p.arg not in bound:
                if d is None:
                    raise self.refuse(at, f"a call without the keyword argument {p.arg!r}")
                bound[p.arg] = (self.ref(fn.__kwdefaults__[p.arg], path + (("kwdefault", p.arg),)) if fn is not None
                                else self.expr(d, scope.parent or scope))
        scope.names.update(bound)

    def run_function(self, node, scope: Scope, at: Any) -> Any:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.refuse(at, "calls nested this deep (recursion?)")
        try:
            if isinstance(node, ast.Lambda):
                return self.expr(node.body, scope)
            done, value = self.block(node.body, scope)
            if not done:
                raise self.refuse(node, f"function {node.name}, which ends without a return")
            return value
        finally:
            self.depth -= 1

    # -------------------------------------------------------------- statements
    def block(self, body: list, scope: Scope) -> tuple:
        """Run statements: (True, value) at a return, else (False, None)."""
        for st in body:
            if isinstance(st, ast.Return):
                if st.value is None:
                    raise self.refuse(st, "a return without a value")
                return True, self.expr(st.value, scope)
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str):
                continue  # a docstring
            if isinstance(st, ast.Pass):
                continue
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is None:
                    continue
                value = self.expr(st.value, scope)
                for target in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    self.assign(target, value, scope)
            elif isinstance(st, ast.AugAssign):
                if not isinstance(st.target, ast.Name):
                    raise self.refuse(st, "an augmented assignment to anything but a name")
                value = self.binop(_PY_BIN.get(type(st.op)), self.lookup(st.target.id, scope, st),
                                   self.expr(st.value, scope), st)
                scope.names[st.target.id] = value
            elif isinstance(st, ast.FunctionDef):
                if st.decorator_list:
                    raise self.refuse(st, "a decorated nested function")
                scope.names[st.name] = Local(st, scope)
            elif isinstance(st, ast.If):
                test = self.static(self.expr(st.test, scope), st.test, "an if statement on a traced value "
                                   "(data-dependent control flow); write it with where(cond, x, y) or & and |")
                done, value = self.block(st.body if test else st.orelse, scope)
                if done:
                    return done, value
            elif isinstance(st, ast.For):
                if st.orelse:
                    raise self.refuse(st, "for ... else")
                for item in self.sequence(self.expr(st.iter, scope), st.iter):
                    self.assign(st.target, item, scope)
                    done, value = self.block(st.body, scope)
                    if done:
                        raise self.refuse(st, "a return inside a for loop")
            else:
                raise self.refuse(st, f"the statement {type(st).__name__}")
        return False, None

    def assign(self, target: Any, value: Any, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            scope.names[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = self.sequence(value, target)
            if len(items) != len(target.elts):
                raise self.refuse(target, f"unpacking {len(items)} values into {len(target.elts)} names")
            for t, v in zip(target.elts, items):
                self.assign(t, v, scope)
        else:
            raise self.refuse(target, f"an assignment to a {type(target).__name__}")

    def static(self, v: Any, at: Any, why: str) -> Any:
        """A value known when compiling (a literal or a closure value, recorded by value)."""
        if isinstance(v, Ref):
            self.checks[v.path] = ("value", v.value) if not _is_array(v.value) else signature(v.value)
            return v.value
        if isinstance(v, (ir.Node, Row)):
            raise self.refuse(at, why)
        return v

    def sequence(self, v: Any, at: Any) -> list:
        if isinstance(v, (list, tuple)):
            return list(v)
        if isinstance(v, Ref) and isinstance(v.value, (tuple, list)):
            return [self.ref(x, v.path + (("item", i),)) for i, x in enumerate(v.value)]
        raise self.refuse(at, "iteration over something that is not a tuple or list known when compiling")

    def lookup(self, name: str, scope: Scope, at: Any) -> Any:
        s: Optional[Scope] = scope
        while s is not None:
            if name in s.names:
                return s.names[name]
            if s.fn is not None:
                fn, path = s.fn, s.path
                if name in fn.__code__.co_freevars:
                    try:
                        value = fetch(fn, (("free", name),))
                    except ValueError:
                        raise self.refuse(at, f"the name {name!r}, not yet assigned where it is used") from None
                    return self.ref(value, path + (("free", name),))
                if name in fn.__globals__ or hasattr(builtins, name):
                    value = fetch(fn, (("global", name),))
                    return self.ref(value, path + (("global", name),))
                break
            s = s.parent
        if name in _NAMESPACE_NAMES:
            return Namespace()
        raise self.refuse(at, f"the unknown name {name!r}")

    # -------------------------------------------------------------- expressions
    def expr(self, e: Any, scope: Scope) -> Any:
        if isinstance(e, ast.Constant):
            if isinstance(e.value, float):
                raise self.refuse(e, f"the float {e.value!r}: compiled masks compute in integers, exactly")
            return e.value
        if isinstance(e, ast.Name):
            return self.lookup(e.id, scope, e)
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, ast.Div):
                raise self.refuse(e, "true division '/' (it makes floats): use '//'")
            op = _PY_BIN.get(type(e.op))
            if op is None:
                raise self.refuse(e, f"the operator {type(e.op).__name__}")
            return self.binop(op, self.expr(e.left, scope), self.expr(e.right, scope), e)
        if isinstance(e, ast.UnaryOp):
            return self.unary(e, self.expr(e.operand, scope))
        if isinstance(e, ast.BoolOp):
            values = [self.expr(v, scope) for v in e.values]
            return functools.reduce(lambda x, y: self.logical("and" if isinstance(e.op, ast.And) else "or", x, y, e),
                                    values)
        if isinstance(e, ast.Compare):
            left, out = self.expr(e.left, scope), None
            for cmp, right_e in zip(e.ops, e.comparators):
                right = self.expr(right_e, scope)
                if type(cmp) not in _PY_CMP:
                    if isinstance(cmp, (ast.Is, ast.IsNot)):
                        same = self.static(left, e, "'is' on a traced value") is self.static(right, e, "'is'")
                        part = same if isinstance(cmp, ast.Is) else not same
                    else:
                        raise self.refuse(e, f"the comparison {type(cmp).__name__}")
                else:
                    part = self.compare(_PY_CMP[type(cmp)], left, right, e)
                out = part if out is None else self.logical("and", out, part, e)
                left = right
            return out
        if isinstance(e, ast.IfExp):
            test = self.static(self.expr(e.test, scope), e.test, "'x if cond else y' on a traced condition: use "
                               "where(cond, x, y)")
            return self.expr(e.body if test else e.orelse, scope)
        if isinstance(e, ast.Lambda):
            return Local(e, scope)
        if isinstance(e, (ast.Tuple, ast.List)):
            return tuple(self.expr(x, scope) for x in e.elts)
        if isinstance(e, (ast.GeneratorExp, ast.ListComp)):
            return self.comprehension(e, scope)
        if isinstance(e, ast.Attribute):
            return self.attribute(self.expr(e.value, scope), e)
        if isinstance(e, ast.Subscript):
            return self.subscript(self.expr(e.value, scope), e, scope)
        if isinstance(e, ast.Call):
            return self.call(e, scope)
        raise self.refuse(e, f"the expression {type(e).__name__}")

    # Calls, attributes and subscripts: compile_calls.MaskTranslator (this module's size).
    def attribute(self, base: Any, e: ast.Attribute) -> Any:
        raise NotImplementedError

    def subscript(self, base: Any, e: ast.Subscript, scope: Scope) -> Any:
        raise NotImplementedError

    def call(self, e: ast.Call, scope: Scope) -> Any:
        raise NotImplementedError

    def comprehension(self, e: Any, scope: Scope) -> tuple:
        if len(e.generators) != 1 or e.generators[0].ifs or e.generators[0].is_async:
            raise self.refuse(e, "a comprehension with more than one 'for' or with 'if'")
        gen = e.generators[0]
        out = []
        for item in self.sequence(self.expr(gen.iter, scope), gen.iter):
            inner = Scope(scope)
            self.assign(gen.target, item, inner)
            out.append(self.expr(e.elt, inner))
        return tuple(out)

    # -------------------------------------------------------------- operators
    def binop(self, op: Optional[str], x: Any, y: Any, at: Any) -> Any:
        if op is None:
            raise self.refuse(at, "this operator")
        if _is_python(x) and _is_python(y):
            if op in ("//", "%") and y == 0:
                raise self.refuse(at, "a division by zero")
            return _FOLD[op](x, y)
        nx, ny = self.node(x, at), self.node(y, at)
        line = getattr(at, "lineno", 0)
        if op in ("&", "|", "^"):
            if nx.kind == ny.kind == "bool":
                return ir.Binary("bool", line, {"&": "and", "|": "or", "^": "xor"}[op], nx, ny)
            return ir.Binary("int", line, op, nx, ny)
        if "bool" in (nx.kind, ny.kind):
            raise self.refuse(at, f"arithmetic '{op}' on a boolean (NumPy and torch disagree on it): use & | or "
                                  "where()")
        return ir.Binary("int", line, op, nx, ny)

    def logical(self, op: str, x: Any, y: Any, at: Any) -> Any:
        if _is_python(x) and _is_python(y):
            return (x and y) if op == "and" else (x or y)
        nx, ny = self.node(x, at), self.node(y, at)
        if nx.kind != "bool" or ny.kind != "bool":
            raise self.refuse(at, f"'{op}' of a non-boolean value")
        return ir.Binary("bool", getattr(at, "lineno", 0), op, nx, ny)

    def compare(self, op: str, x: Any, y: Any, at: Any) -> Any:
        if _is_python(x) and _is_python(y):
            return {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
                    "!=": operator.ne}[op](x, y)
        return ir.Compare("bool", getattr(at, "lineno", 0), op, self.node(x, at), self.node(y, at))

    def unary(self, e: Any, v: Any) -> Any:
        line = e.lineno
        if _is_python(v):
            fold: Any = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert,
                         ast.Not: operator.not_}[type(e.op)]
            return fold(v)
        n = self.node(v, e)
        if isinstance(e.op, ast.UAdd):
            return n
        if isinstance(e.op, ast.Invert) and n.kind == "bool" and not _traced(n):
            # Closure values are Python's: ~ of a Python bool is an int (~False == -1), unlike a mask's ~.
            raise self.refuse(e, "'~' of a boolean made of closure values only (in Python ~False is -1): use 'not'")
        if isinstance(e.op, ast.Not) or (isinstance(e.op, ast.Invert) and n.kind == "bool"):
            if n.kind != "bool":
                raise self.refuse(e, "'not' of a non-boolean value")
            return ir.Unary("bool", line, "not", n)
        if n.kind == "bool":
            raise self.refuse(e, "'-' of a boolean")
        return ir.Unary("int", line, "neg" if isinstance(e.op, ast.USub) else "invert", n)


def _traced(n: ir.Node) -> bool:
    """Whether a node reads an index name or a table (NumPy / torch values), not only closure numbers."""
    return isinstance(n, (ir.Axis, ir.Lookup)) or any(_traced(c) for c in ir.children(n))


def _is_python(v: Any) -> bool:
    """A literal known when compiling (closure values are ``Ref``s: data, not folded)."""
    return isinstance(v, (bool, int, np.integer, np.bool_)) and not isinstance(v, type)


HELPERS = {as_bool_result: "first", array_module_of: "namespace", arrays.array_namespace: "namespace"}

__all__ = ["Translator", "Scope", "Ref", "Row", "Local", "Namespace", "signature", "scalar_signature", "fetch", "HELPERS"]
