"""``compile_mask(mask_mod)``: a Python mask_mod translated from its source into a CUDA expression,
returned as a ``CudaMask`` (a ``CompiledMask``) that builds, evaluates and fuses like a
``cuda_mask``, with a ``numpy_fn`` that evaluates the same expression with C's semantics on the host.

    def sliding_with_globals(b, h, q_idx, kv_idx):
        return (kv_idx < n_global) | ((q_idx >= kv_idx) & (q_idx - kv_idx < window))
    mask = omnicupy.compile_mask(sliding_with_globals)
    bm = omnicupy.BlockMask.from_mask_mod(sliding_with_globals, None, None, N, N)  # compiles it too

What translates is listed in compile_frontend.py and compile_calls.py; what is refused (a construct,
a function without source, control flow on traced values, an index that could leave its table, a
possible int32 overflow or division by zero) raises ``MaskError`` naming the construct and line.

Closure numbers are kernel arguments (one-element arrays ``s_name[0]``), not compile-time
constants, and tables are runtime arrays: two mask_mods of the same code that differ only in their
closure values have the same ``CudaExpr.key``, hence one kernel. The translation is cached per code
object and the *signature* of what it read (types, code objects, lengths; the value only of a flag
that chose a branch): another instance reuses the tree and only reads its values.

``for_build`` is what ``BlockMask.from_mask_mod`` calls on a plain function: the compiled mask when
it applies to the build's sizes, else None, with the reason logged once per code object.

Knows the compiler's parts; knows nothing of kernels beyond ``CudaExpr``.
"""
from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError, OmnicupyError
from . import compile_check
from . import compile_ir as ir
from .compile_calls import MaskTranslator
from .compile_frontend import fetch, scalar_signature, signature
from .expressions import CudaExpr, CudaMask
from .mask_mod import MaskMod, name_of

logger = logging.getLogger("omnicupy.mask")


@dataclass(frozen=True)
class Template:
    """A translated code object: what it depends on, its slots, tree and text."""

    checks: tuple  # ((path, recorded signature), ...), in the order they were read
    slots: tuple   # ((path, slot name, "scalar" | "table"), ...)
    tree: ir.Node
    text: str


#: ``for_build`` compiles plain functions (tests of the Python evaluation path turn it off).
ENABLED = True
_templates: dict = {}   # root code object -> [Template, ...]
_logged: set = set()    # code objects whose fallback was logged


def _root_code(mask_mod: Any, what: str) -> types.CodeType:
    fn = mask_mod.fn if isinstance(mask_mod, MaskMod) else mask_mod
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.FunctionType):
        return fn.__code__
    kind = "a C callable (builtin or extension)" if callable(fn) and not hasattr(fn, "__dict__") else \
        f"a {type(fn).__name__}"
    raise MaskError(f"{what}: cannot compile {kind}; compile_mask takes a Python function (def or lambda) of "
                    "(b, h, q_idx, kv_idx), or a MaskMod made of one")


def _current(value: Any, recorded: tuple) -> tuple:
    if recorded and recorded[0] == "value":
        return ("value", value)
    if recorded[:1] == ("int",) and len(recorded) == 2 or recorded == ("bool",):
        if hasattr(value, "shape") and tuple(value.shape) == () and hasattr(value, "item"):
            value = value.item()  # a 0-d array read as a number
        return scalar_signature(value) if isinstance(value, (int, np.integer, bool, np.bool_)) else signature(value)
    sig = signature(value)
    cols = [r for r in recorded if isinstance(r, tuple) and r and r[0] == "cols"]
    if cols and hasattr(value, "shape") and len(value.shape) == 2:
        sig = sig + (("cols", int(value.shape[1])),) * len(cols)
    return sig


def _matches(template: Template, root: Any) -> bool:
    for path, recorded in template.checks:
        try:
            value = fetch(root, path)
        except Exception:  # noqa: BLE001 - a path this instance lacks: another structure
            return False
        try:
            if _current(value, recorded) != recorded:
                return False
        except Exception:  # noqa: BLE001 - values that do not compare
            return False
    return True


def _translate(root: Any, what: str) -> Template:
    tr = MaskTranslator(root, what)
    axes = [ir.Axis("int", 0, a) for a in ir.AXES]
    result = tr.call_function(root, (), list(axes), {}, None)
    if isinstance(result, (bool, np.bool_)):
        result = ir.Const("bool", 0, bool(result))
    if not isinstance(result, ir.Node) or result.kind != "bool":
        raise MaskError(f"{what}: cannot compile a mask_mod that returns "
                        f"{'ints' if isinstance(result, ir.Node) else type(result).__name__}: it must return "
                        "booleans (comparisons combined with & | ~)")
    slots = tuple((path, name, kind) for path, (name, kind, _) in tr.slots.items())
    return Template(tuple(tr.checks.items()), slots, result, ir.emit(result))


def template_for(mask_mod: Any) -> Template:
    """The cached translation that fits ``mask_mod`` (translated now if none does)."""
    what = f"mask_mod {name_of(mask_mod)}"
    code = _root_code(mask_mod, what)
    for template in _templates.get(code, ()):
        if _matches(template, mask_mod):
            return template
    template = _translate(mask_mod, what)
    _templates.setdefault(code, []).append(template)
    return template


class CompiledMask(CudaMask):
    """A ``CudaMask`` compiled from a Python mask_mod (``source``). ``max_length`` and ``limits``
    are what its 32-bit arithmetic and its tables allow (``why_not`` says if a build's sizes fit)."""

    def __init__(self, expr: CudaExpr, numpy_fn: Callable, name: str, source: Any,
                 checked: compile_check.Checked) -> None:
        super().__init__(expr, numpy_fn, name)
        self.source = source
        self.max_length = checked.max_length
        self.limits = dict(checked.limits)
        self._checked = checked

    def __repr__(self) -> str:
        return f"CompiledMask({self.name}: {self.cuda.text!r})"

    def why_not(self, *, batch: int, heads: int, q_len: int, kv_len: int) -> Optional[str]:
        """Why these sizes cannot use this mask (None: they can): the expression's arrays too short,
        a table along an axis too short, sequences past ``max_length``."""
        why = compile_check.check_sizes(self._checked, self.name, batch=batch, heads=heads, q_len=q_len,
                                        kv_len=kv_len)
        if why is None:
            try:
                self.cuda.check_lengths(q_len=q_len, kv_len=kv_len, heads=heads, batch=batch)
            except OmnicupyError as exc:
                why = str(exc)
        return why

    def check_sizes(self, *, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Raise MaskError when a call of these sizes would read past a table or overflow."""
        why = self.why_not(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
        if why is not None:
            raise MaskError(why)

    def __call__(self, b, h, q_idx, kv_idx):
        if self.limits or self.max_length < compile_check.MAX_LENGTH:
            sizes = [int(arrays.to_numpy(arrays.array_namespace(x).max(x))) + 1 for x in (b, h, q_idx, kv_idx)]
            self.check_sizes(batch=sizes[0], heads=sizes[1], q_len=sizes[2], kv_len=sizes[3])
        return super().__call__(b, h, q_idx, kv_idx)


def _table(value: Any, what: str):
    arr = arrays.as_array(value, what)
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise MaskError(f"{what}: a table must be a non-empty 1-D or 2-D array, got shape {tuple(arr.shape)}")
    xp = arrays.array_namespace(arr)
    flat = xp.ascontiguousarray(arr).reshape(-1)
    if flat.dtype == np.bool_:
        low, high = 0, 1
    else:
        low, high = (int(v) for v in arrays.to_numpy(xp.stack([flat.min(), flat.max()])))
    rows, cols = (arr.shape[0], arr.shape[1]) if arr.ndim == 2 else (1, arr.shape[0])
    return flat, compile_check.Table(int(flat.size), int(rows), int(cols), low, high)


def compile_mask(mask_mod: Callable) -> CompiledMask:
    """Translate ``mask_mod(b, h, q_idx, kv_idx)`` (a Python function, or a MaskMod made of one)
    into a CUDA expression; MaskError says what cannot be translated, and where."""
    if isinstance(mask_mod, CompiledMask):
        return mask_mod
    what = f"mask_mod {name_of(mask_mod)}"
    template = template_for(mask_mod)
    scalars, tables, stats = {}, {}, {}
    for path, name, kind in template.slots:
        value = fetch(mask_mod, path)
        if kind == "scalar":
            v = int(value.item() if hasattr(value, "item") else value)
            if not ir.INT32_MIN <= v <= ir.INT32_MAX:
                raise MaskError(f"{what}: the closure number {name[2:]} = {v} does not fit a 32-bit int")
            scalars[name] = v
        else:
            tables[name], stats[name] = _table(value, f"{what}: table {name[2:]}")
    checked = compile_check.check(template.tree, scalars, stats, what)
    given = {n: np.array([v], dtype=np.int32) for n, v in scalars.items()}
    given.update(tables)
    extents = {n: 1 for n in scalars}
    extents.update({n: e for n, e in checked.extents.items() if e is not None})
    text = template.text
    if checked.guards:
        # Guards: read in dead code (never loaded), seen by the expression's length check.
        given.update({f"g_{a}": np.zeros(c, dtype=np.int32) for a, c in checked.guards.items()})
        reads = " || ".join(f"g_{a}[{a}] != 0" for a in sorted(checked.guards))
        text = f"({text} || (false && ({reads})))"
    try:
        expr = CudaExpr.make(text, None, given, extents=extents, kind="mask",
                             max_length=None if checked.max_length >= compile_check.MAX_LENGTH else checked.max_length)
    except OmnicupyError as exc:
        raise MaskError(f"{what}: its translation {text!r} is refused: {exc}") from exc
    tree = template.tree
    host: dict = {}

    def numpy_fn(b, h, q_idx, kv_idx):
        if not host:
            values = {d[0]: arrays.to_numpy(a) for d, a in zip(expr.array_decls, expr.arrays)}
            host["values"] = ir.Values({n: int(values[n][0]) for n in scalars},
                                       {n: values[n] for n in tables})
        env = {a: np.asarray(x).astype(np.int32) for a, x in zip(ir.AXES, (b, h, q_idx, kv_idx))}
        return np.asarray(ir.evaluate(tree, env, host["values"]), dtype=bool)

    return CompiledMask(expr, numpy_fn, name_of(mask_mod), mask_mod, checked)


def for_build(mask_mod: Any, batch: int, heads: int, q_len: int, kv_len: int) -> Optional[CompiledMask]:
    """For ``BlockMask.from_mask_mod``: the compiled form of a plain Python function, or of a MaskMod
    whose blocks are evaluated (no row bounds: ``or_masks``, ``not_mask``, ``MaskMod(fn)``; inexact
    ones: dilated windows), when it applies to these sizes, else None (the reason logged once per code
    object). MaskMods with exact bounds (built without evaluating) and CudaMasks are left as they are."""
    if not ENABLED:
        return None
    evaluated = isinstance(mask_mod, MaskMod) and (mask_mod.bounds is None or not mask_mod.bounds_exact)
    if not isinstance(mask_mod, types.FunctionType) and not evaluated:
        return None
    try:
        compiled = compile_mask(mask_mod)
        why = compiled.why_not(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
        if why is None:
            return compiled
    except MaskError as exc:
        why = str(exc)
    except Exception as exc:  # noqa: BLE001 - the compiler never breaks a build the Python path can do
        why = f"the mask compiler failed ({type(exc).__name__}: {exc})"
    code = _root_code(mask_mod, "")
    if code not in _logged:
        _logged.add(code)
        logger.info("mask_mod %s is evaluated in Python, not compiled to CUDA: %s", name_of(mask_mod), why)
    return None


__all__ = ["compile_mask", "CompiledMask", "for_build", "template_for", "Template"]
