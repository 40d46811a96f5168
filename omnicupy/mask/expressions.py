"""CUDA C expressions that the forward template renders into the kernel (mask and score modifiers).

A ``CudaExpr`` is the expression text plus named compile-time constants and small lookup arrays the
expression may read. Its ``key`` (text, constants, array names and dtypes; not array contents) is
part of the kernel variant, so a different expression or constant compiles a different kernel.

    window = omnicupy.cuda_mask("q_idx >= kv_idx && q_idx - kv_idx < WINDOW", constants={"WINDOW": 256})
    docs = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": doc_ids})

Mask expressions see ``b, h, q_idx, kv_idx`` (int) and return a truth value; score expressions also
see ``score`` (float, after scale and bias) and return the new score. The text must pass the
allow-list grammar of ``expr_syntax`` (documented there: names, literals, operators, the functions
and casts an expression may use); anything else raises ``ExpressionError`` before anything is
rendered.

Constants must fit their C type (int: 32 bits; float: a finite, normal or zero float32). Lookup
arrays are 1-D and keep their values exactly: int32, float32, or another int/bool/float dtype whose
values convert losslessly (int64 ids beyond 32 bits, or float64 values that float32 would round,
are refused). They are copied when the expression is made, so later changes to the caller's array
are not seen. How many elements each array needs is known from its subscripts: ``doc[q_idx]``
needs ``q_len``, ``slope[h]`` the number of heads, and so on; an array indexed by anything else (a
computed index) needs ``max(q_len, kv_len, heads, batch)`` elements unless ``extents`` declares
what its computed index stays below (an index name, or a number of elements): that is a promise
the caller keeps, as the index's value cannot be checked. ``CudaExpr.check_lengths`` checks a call
(ops/inputs.py ``check_expression_arrays``). ``check_key`` re-checks a key (text, constants,
arrays) for whoever renders it, so that a key not made here cannot reach a kernel's source.

Knows expressions, their constants and arrays; knows nothing of kernels beyond the names they define.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ExpressionError
from . import expr_syntax, index_bounds
from .expr_syntax import CAST_TYPES, CPP_KEYWORDS, FUNCTIONS, INDEX_NAMES, SCORE_NAME

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Names the kernel already defines where expressions are evaluated.
RESERVED = frozenset(INDEX_NAMES) | {SCORE_NAME}
ARRAY_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.float32): "float"}
#: Expression kinds: a mask sees b, h, q_idx, kv_idx; a score modifier also sees score.
KINDS = ("mask", "score")
_FLOAT32_MAX, _FLOAT32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1
#: An extent: an index name (the array is read below that axis's size) or a number of elements.
Extent = Union[str, int]


def _check_name(name: str, what: str) -> str:
    taken = RESERVED | FUNCTIONS | CAST_TYPES | CPP_KEYWORDS | {"true", "false", "omni"}
    if not isinstance(name, str) or not _IDENT.match(name) or name in taken \
            or name.startswith("k") and name[1:2].isupper() or "__" in name or re.match(r"_[A-Z]", name):
        raise ExpressionError(f"{what} name {name!r} is not a usable C identifier (letters, digits, _; not one of "
                              f"{sorted(RESERVED)}, not a C++ keyword or an expression function, not kName-style, "
                              f"no __ and no leading _X)")
    return name


def _constant_literal(name: str, value: Any) -> tuple[str, str]:
    """(C type, literal) for a Python int/float/bool constant that fits its C type exactly."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if not _INT32_MIN <= value <= _INT32_MAX:
            raise ExpressionError(f"constant {name}={value} does not fit in a 32-bit int")
        return "int", str(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not np.isfinite(value) or abs(value) > _FLOAT32_MAX:
            raise ExpressionError(f"constant {name}={value!r} must be finite in float32 (|value| <= {_FLOAT32_MAX:g})")
        if value != 0 and abs(value) < _FLOAT32_TINY:
            raise ExpressionError(f"constant {name}={value!r} is below float32's normal range ({_FLOAT32_TINY:g}): "
                                  f"the kernel would flush it to 0")
        # The float32 value's shortest decimal form: the kernel reads exactly np.float32(value).
        return "float", np.format_float_scientific(np.float32(value), unique=True, trim="0") + "f"
    raise ExpressionError(f"constant {name} must be an int, float or bool, got {type(value).__name__}")


def _lookup_array(name: str, value: Any):
    """``value`` as a frozen 1-D int32 or float32 copy (NumPy or CuPy, where it lives), or refused."""
    try:
        arr = arrays.as_array(value, name)
    except (TypeError, ValueError) as exc:
        raise ExpressionError(f"array {name!r} is not an array: {exc}") from None
    if arr.ndim != 1:
        raise ExpressionError(f"array {name!r} must be 1-D (an expression reads name[index]), got shape "
                              f"{tuple(arr.shape)}; pass a flattened array and compute the index")
    if arr.size == 0 or arr.size > _INT32_MAX:
        raise ExpressionError(f"array {name!r} must have between 1 and 2**31 - 1 elements, got {arr.size}")
    dtype = np.dtype(arr.dtype)
    xp = arrays.array_namespace(arr)
    if dtype.kind == "b":
        target = np.dtype(np.int32)
    elif dtype.kind in "iu":
        target = np.dtype(np.int32)
        if dtype != target and not np.can_cast(dtype, target, "safe"):
            lo, hi = int(arr.min()), int(arr.max())
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise ExpressionError(f"array {name!r} ({dtype}) holds values in [{lo}, {hi}], outside int32: the "
                                      f"kernel reads int32 and would merge or wrap them; map them to int32 ids first")
    elif dtype.kind == "f" or dtype == arrays.BFLOAT16:
        target = np.dtype(np.float32)
        if dtype != target and not np.can_cast(dtype, target, "safe") and dtype != arrays.BFLOAT16:
            with np.errstate(over="ignore"):  # an overflow to inf is what the comparison finds
                narrowed = arr.astype(np.float32).astype(dtype)
            same = (narrowed == arr) | (xp.isnan(narrowed) & xp.isnan(arr))
            if not bool(same.all()):
                raise ExpressionError(f"array {name!r} ({dtype}) has values that float32 would round or overflow; "
                                      f"the kernel reads float32: cast it yourself (astype(float32)) if that is meant")
    else:
        raise ExpressionError(f"array {name!r} must hold ints, bools or floats (read as int32 / float32), got {dtype}")
    copy = xp.array(arr, dtype=target, copy=True, order="C")
    if xp is np:
        copy.setflags(write=False)
    return copy


def _array_needs(text: str, kind: str, syntax: expr_syntax.Syntax, consts: tuple, decls: list, values: list,
                 extents: Mapping[str, Extent], max_length: Optional[int] = None) -> tuple:
    """((array, index names whose sizes it must cover, fixed element count it needs), ...): each
    subscript's range comes from index_bounds (the one rule for indices); a subscript that may be
    negative, or that is bounded by neither one size nor a constant the array covers, is refused."""
    const_values = {n: (float(lit.rstrip("f")) if t == "float" else int(lit == "true") if t == "bool" else int(lit))
                    for n, t, lit in consts}
    bounds = {d[0]: (int(a.min()), int(a.max())) if d[1] == "int" else None for d, a in zip(decls, values)}
    lengths = {d[0]: int(a.size) for d, a in zip(decls, values)}
    # An array read at a bare index name bounds that axis for the whole expression (a call with a
    # larger axis is refused by the length check), so every other subscript is analysed with it.
    axis_limits: dict = {} if max_length is None else {"q_idx": max_length, "kv_idx": max_length}
    for name, rng in index_bounds.subscript_ranges(text, constants=const_values, arrays=bounds,
                                                   score=kind == "score"):
        for axis in INDEX_NAMES:
            if rng == index_bounds.index_range(axis):
                axis_limits[axis] = min(axis_limits.get(axis, lengths[name]), lengths[name])
    with index_bounds.size_limits(axis_limits):
        return _array_needs_within(text, kind, const_values, bounds, lengths, extents)


def _array_needs_within(text: str, kind: str, const_values: dict, bounds: dict, lengths: dict,
                        extents: Mapping[str, Extent]) -> tuple:
    found: dict = {}
    for name, rng in index_bounds.subscript_ranges(text, constants=const_values, arrays=bounds,
                                                   score=kind == "score"):
        axes, fixed = found.setdefault(name, (set(), [0]))
        where = f"CUDA expression {text!r}: the index of {name!r}"
        if not rng.is_int:
            raise ExpressionError(f"{where} is not an integer ({rng.why})")
        low = rng.low()
        if low is None or rng.high() is None:
            raise ExpressionError(f"{where} has no bound the rules can derive ({rng.why or 'unbounded'}): it could "
                                  f"read outside {name!r}; write it with constants and clamps (min/max)")
        if low < 0:
            raise ExpressionError(f"{where} may be negative (it is {rng.describe()}); clamp it with max(..., 0) "
                                  "or index differently")
        declared = extents.get(name)
        limits = [f.const for f in rng.highs if f.constant]
        below = [a for a in INDEX_NAMES if rng.below(a)]
        plain = next((a for a in INDEX_NAMES if rng == index_bounds.index_range(a)), None)
        if plain is not None:  # name[q_idx] (or name[(q_idx)]): below its own axis, whatever is declared
            axes.add(plain)
            continue
        if isinstance(declared, str) and not rng.below(declared):
            raise ExpressionError(f"{where} may reach or pass its declared extent {declared} (it is "
                                      f"{rng.describe()}); clamp it with min(..., N - 1)")
        if isinstance(declared, str):
            axes.add(declared)
        elif declared is not None:
            high = rng.high()  # constant clamps, and sizes bounded by the axis limits
            if high is None or high > declared - 1:
                raise ExpressionError(f"{where} may reach or pass its declared extent {declared} (it is "
                                      f"{rng.describe()}); clamp it with min(..., {declared - 1})")
            fixed[0] = max(fixed[0], declared)
        elif limits and min(limits) + 1 <= lengths[name]:
            fixed[0] = max(fixed[0], int(min(limits)) + 1)
        elif below:
            axes.add(below[0])
        elif rng.high() is not None and rng.high() + 1 <= lengths[name]:  # bounded through the axis limits
            fixed[0] = max(fixed[0], int(rng.high()) + 1)
        elif limits:
            raise ExpressionError(f"{where} reads up to {int(min(limits))} but {name!r} has {lengths[name]} elements")
        else:
            raise ExpressionError(f"{where} is below no size and no constant (it is {rng.describe()}): it could "
                                  f"read past the end of {name!r}; clamp it with min(..., N - 1) for a constant N")
    for name, (axes, fixed) in found.items():
        if fixed[0] > lengths[name]:
            raise ExpressionError(f"array {name!r} has {lengths[name]} elements but its declared extent is {fixed[0]}")
    return tuple((name, tuple(sorted(axes)), fixed[0]) for name, (axes, fixed) in sorted(found.items()))


def _check_extents(extents: Optional[Mapping[str, Any]], array_names) -> dict:
    out = {}
    for name, extent in (extents or {}).items():
        if name not in array_names:
            raise ExpressionError(f"extents names {name!r}, which is not one of the expression's arrays "
                                  f"{sorted(array_names)}")
        if isinstance(extent, str):
            if extent not in INDEX_NAMES:
                raise ExpressionError(f"extent of {name!r} must be one of {INDEX_NAMES} or a number of elements, "
                                      f"got {extent!r}")
        elif isinstance(extent, bool) or not isinstance(extent, (int, np.integer)) or extent < 1:
            raise ExpressionError(f"extent of {name!r} must be one of {INDEX_NAMES} or a positive int, got {extent!r}")
        out[name] = extent if isinstance(extent, str) else int(extent)
    return out


@dataclass(frozen=True)
class CudaExpr:
    """An expression with its constants ((name, C type, literal), ...) and arrays ((name, C type), ...)."""

    text: str
    constants: tuple = ()
    array_decls: tuple = ()
    #: frozen copies of the array values, same order as array_decls; not part of the key
    arrays: tuple = field(default=(), repr=False, compare=False)
    #: ((array, index names whose sizes it must cover, fixed element count), ...); not part of the key
    array_needs: tuple = ()
    #: the expression calls omni::tanh_fast (the elementwise kernels then define it)
    uses_tanh_fast: bool = False
    #: the longest q and kv length a call may have (its indices were proven in range, and its int
    #: arithmetic free of wraps, only up to there); None: the kernels' own limit
    max_length: Optional[int] = None

    @classmethod
    def make(cls, text: str, constants: Optional[Mapping[str, Any]] = None,
             arrays_: Optional[Mapping[str, Any]] = None, *, extents: Optional[Mapping[str, Extent]] = None,
             kind: str = "score", max_length: Optional[int] = None) -> "CudaExpr":
        """Check and build an expression (``kind``: "mask" has no ``score``; "score" has it).
        ``max_length``: calls are refused past that q/kv length, and the indices are proven for it."""
        if kind not in KINDS:
            raise ArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(text, str) or not text.strip():
            raise ExpressionError("a CUDA expression must be a non-empty string")
        for what, mapping in (("constants", constants), ("arrays", arrays_), ("extents", extents)):
            if mapping is not None and not isinstance(mapping, Mapping):
                raise ExpressionError(f"{what} must be a mapping of names, got {type(mapping).__name__}")
        consts = tuple((_check_name(n, "constant"), *_constant_literal(n, v))
                       for n, v in sorted((constants or {}).items(), key=lambda item: str(item[0])))
        decls, values = [], []
        for name, value in sorted((arrays_ or {}).items(), key=lambda item: str(item[0])):
            _check_name(name, "array")
            arr = _lookup_array(name, value)
            decls.append((name, ARRAY_CTYPES[np.dtype(arr.dtype)]))
            values.append(arr)
        names = [c[0] for c in consts] + [d[0] for d in decls]
        if len(set(names)) != len(names):
            raise ExpressionError(f"constant and array names must be distinct, got {names}")
        array_names = [d[0] for d in decls]
        declared = _check_extents(extents, array_names)
        text = text.strip()
        syntax = expr_syntax.check(text, constants=[c[0] for c in consts], arrays=array_names, score=kind == "score")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ExpressionError(f"max_length must be a positive int, got {max_length!r}")
        needs = _array_needs(text, kind, syntax, consts, decls, values, declared, max_length)
        uses_tanh = any(t.text == "omni::tanh_fast" for t in syntax.tokens)
        return cls(text, consts, tuple(decls), tuple(values), needs, uses_tanh, max_length)

    @property
    def key(self) -> tuple:
        return (self.text, self.constants, self.array_decls)

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self.key).encode()).hexdigest()[:8]

    def required_lengths(self, *, q_len: int, kv_len: int, heads: int, batch: int) -> dict[str, int]:
        """Elements each array needs for a call with these sizes (index ranges [0, size))."""
        sizes = {"b": batch, "h": heads, "q_idx": q_len, "kv_idx": kv_len}
        return {name: max([fixed] + [sizes[a] for a in axes]) for name, axes, fixed in self.array_needs}

    def check_lengths(self, *, q_len: int, kv_len: int, heads: int, batch: int) -> None:
        """Raise ExpressionError when an array is shorter than the indices the expression reads it at."""
        lengths = {d[0]: int(a.size) for d, a in zip(self.array_decls, self.arrays)}
        sizes = {"b": batch, "h": heads, "q_idx": q_len, "kv_idx": kv_len}
        if self.max_length is not None and max(q_len, kv_len) > self.max_length:
            raise ExpressionError(f"CUDA expression {self.text!r} is proven for sequences up to {self.max_length} "
                                  f"(its int arithmetic or indices could leave range past that), got q_len {q_len}, "
                                  f"kv_len {kv_len}")
        for name, axes, fixed in self.array_needs:
            need = max([fixed] + [sizes[a] for a in axes])
            if lengths[name] < need:
                why = ", ".join(f"{a} < {sizes[a]}" for a in axes) or f"a declared extent of {fixed}"
                raise ExpressionError(f"array {name!r} of CUDA expression {self.text!r} has {lengths[name]} elements "
                                      f"but is read at indices up to {need - 1} ({why}); pass a longer array, or "
                                      f"declare the extent of a computed index (extents={{{name!r}: ...}})")

    def device_arrays(self):
        """The arrays as CuPy arrays on the current device (cached per device)."""
        cp = arrays.cupy_module()
        dev = cp.cuda.runtime.getDevice()
        cache = self.__dict__.setdefault("_device", {})
        if dev not in cache:
            cache[dev] = tuple(cp.ascontiguousarray(cp.asarray(a)) for a in self.arrays)
        return cache[dev]


def check_key(key: tuple, *, kind: str = "score") -> tuple:
    """Re-check a ``CudaExpr.key`` (text, constants, array declarations) before it is rendered: the
    text against the grammar, every constant's name, C type and literal (the canonical form
    ``_constant_literal`` writes), every array's name and C type. A key that did not come from
    ``CudaExpr.make`` (built by hand, or read from elsewhere) is refused like a bad expression."""
    try:
        text, constants, array_decls = key
        constants, array_decls = tuple(constants), tuple(array_decls)
        for c in constants:
            name, ctype, literal = c
        for d in array_decls:
            name, ctype = d
    except (TypeError, ValueError):
        raise ExpressionError(f"not a CUDA expression key: {key!r:.200}") from None
    for name, ctype, literal in constants:
        _check_name(name, "constant")
        value = {"int": lambda: int(literal), "bool": lambda: {"true": True, "false": False}[literal],
                 "float": lambda: float(literal[:-1]) if literal.endswith("f") else None}.get(ctype, lambda: None)
        try:
            parsed = value()
        except (KeyError, ValueError, TypeError):
            parsed = None
        if parsed is None or _constant_literal(name, parsed) != (ctype, literal):
            raise ExpressionError(f"constant {name!r}: {ctype} {literal!r} is not a literal omnicupy writes")
    for name, ctype in array_decls:
        _check_name(name, "array")
        if ctype not in ARRAY_CTYPES.values():
            raise ExpressionError(f"array {name!r}: C type {ctype!r} is not one of {sorted(ARRAY_CTYPES.values())}")
    if kind not in KINDS:
        raise ArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
    expr_syntax.check(text, constants=[c[0] for c in constants], arrays=[d[0] for d in array_decls],
                      score=kind == "score")
    return key


def check_grad(grad: Optional[str], score_key: Optional[tuple]) -> Optional[str]:
    """A score modifier's derivative text, re-checked where it is rendered: the same grammar, over the
    score expression's constants and arrays (``check_key``), whoever built the CudaExpr it came from."""
    if grad is None:
        return None
    if score_key is None:
        raise ExpressionError("a score derivative without its score expression")
    return check_key((grad, score_key[1], score_key[2]), kind="score")[0]


def merge_names(*exprs: Optional[CudaExpr]) -> None:
    """Raise if two fused expressions define the same constant or array name differently."""
    seen: dict = {}
    for e in exprs:
        if e is None:
            continue
        for c in e.constants:
            if seen.setdefault(c[0], c) != c:
                raise ExpressionError(f"mask and score expressions both define {c[0]!r}, differently")
        for d in e.array_decls:
            if d[0] in seen:
                raise ExpressionError(f"mask and score expressions both define an array or constant {d[0]!r}")
            seen[d[0]] = d


class CudaMask:
    """A mask_mod written once as a CUDA expression: fused into the attention kernel, and evaluated
    on the GPU by a CuPy elementwise kernel of the same expression when building a BlockMask.

    ``numpy_fn(b, h, q_idx, kv_idx)`` optionally gives the same rule for NumPy index arrays (the host
    reference and GPU-less builds); without it, NumPy inputs are evaluated on the GPU and copied back.
    """

    def __init__(self, expr: CudaExpr, numpy_fn: Optional[Callable] = None, name: Optional[str] = None) -> None:
        self.cuda = expr
        self.numpy_fn = numpy_fn
        self.name = self.__name__ = name or f"cuda_mask_{expr.digest}"

    @property
    def cuda_expr(self) -> str:
        return self.cuda.text

    def __repr__(self) -> str:
        return f"CudaMask({self.cuda.text!r})"

    def __call__(self, b, h, q_idx, kv_idx):
        if not any(arrays.is_cupy(x) for x in (b, h, q_idx, kv_idx)):
            if self.numpy_fn is not None:
                return self.numpy_fn(b, h, q_idx, kv_idx)
            if not arrays.gpu_available():
                raise ArgumentError(f"{self!r} needs a GPU to evaluate on NumPy arrays, or a numpy_fn")
            cp = arrays.cupy_module()
            return self(*(cp.asarray(x) for x in (b, h, q_idx, kv_idx))).get()
        return _elementwise(self.cuda, "bool out", "out = (", ")")(b, h, q_idx, kv_idx)


#: omni::tanh_fast for the elementwise kernels, as kernels/ptx.cuh defines it for the attention kernels.
_TANH_FAST = """namespace omni {
__device__ __forceinline__ float tanh_fast(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(2.f * 1.4426950408889634f * x));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
  return fmaf(-2.f, r, 1.f);
}
}  // namespace omni"""


def check_index_ranges(expr: CudaExpr, b, h, q_idx, kv_idx) -> None:
    """Before an elementwise evaluation: every array is long enough for the indices it will be read
    at (one small reduction per index array, one transfer back)."""
    if not expr.array_needs:
        return
    xp = arrays.array_namespace(q_idx)
    index = dict(zip(INDEX_NAMES, (xp.asarray(x) for x in (b, h, q_idx, kv_idx))))
    lows_highs = xp.stack([xp.asarray(f(x), dtype=np.int64) for x in index.values() for f in (xp.min, xp.max)])
    lows_highs = arrays.to_numpy(lows_highs).tolist()
    sizes = {}
    for i, name in enumerate(INDEX_NAMES):
        low, high = lows_highs[2 * i], lows_highs[2 * i + 1]
        if low < 0 and any(name in axes for _, axes, _ in expr.array_needs):
            raise ExpressionError(f"CUDA expression {expr.text!r} reads its arrays at {name}, which is negative here "
                                  f"({low})")
        sizes[name] = high + 1
    expr.check_lengths(q_len=sizes["q_idx"], kv_len=sizes["kv_idx"], heads=sizes["h"], batch=sizes["b"])


def _elementwise(expr: CudaExpr, out_decl: str, before: str, after: str, with_score: bool = False):
    """A callable running ``expr`` as a CuPy elementwise kernel over broadcast index arrays."""
    cp = arrays.cupy_module()
    cache = expr.__dict__.setdefault("_elementwise", {})
    key = (out_decl, with_score)
    if key not in cache:
        preamble = "\n".join(([_TANH_FAST] if expr.uses_tanh_fast else [])
                             + [f"static constexpr {t} {n} = {v};" for n, t, v in expr.constants])
        ins = (["float32 score"] if with_score else []) + ["int32 b", "int32 h", "int32 q_idx", "int32 kv_idx"]
        ins += [f"raw {'int32' if t == 'int' else 'float32'} {n}" for n, t in expr.array_decls]
        cache[key] = cp.ElementwiseKernel(", ".join(ins), out_decl, f"{before}{expr.text}{after};",
                                          f"omnicupy_expr_{expr.digest}", preamble=preamble)
    kernel = cache[key]

    def run(*args):
        ints = [cp.asarray(a).astype(np.int32, copy=False) for a in args[-4:]]
        check_index_ranges(expr, *ints)
        head = [cp.asarray(args[0], dtype=np.float32)] if with_score else []
        return kernel(*head, *ints, *expr.device_arrays())

    return run


def cuda_mask(expr: str, constants: Optional[Mapping[str, Any]] = None, arrays: Optional[Mapping[str, Any]] = None,
              *, numpy_fn: Optional[Callable] = None, name: Optional[str] = None,
              extents: Optional[Mapping[str, Extent]] = None) -> CudaMask:
    """A mask_mod from a CUDA C expression over ``b, h, q_idx, kv_idx`` (see CudaMask; the grammar,
    constants, arrays and ``extents`` are in this module's docstring)."""
    return CudaMask(CudaExpr.make(expr, constants, arrays, extents=extents, kind="mask"), numpy_fn, name)


def fused_mask_expr(mask_mod: Any) -> Optional[CudaExpr]:
    """The CUDA expression a mask_mod carries (CudaMask, or a built-in with ``cuda_expr``), if any."""
    if mask_mod is None:
        return None
    expr = getattr(mask_mod, "cuda", None)
    if isinstance(expr, CudaExpr):
        return expr
    text = getattr(mask_mod, "cuda_expr", None)
    return CudaExpr.make(text, kind="mask") if isinstance(text, str) and text.strip() else None
