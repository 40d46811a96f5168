"""CUDA C expressions that the forward template renders into the kernel (mask and score modifiers).

A ``CudaExpr`` is the expression text plus named compile-time constants and small device arrays the
expression may read. Its ``key`` (text, constants, array names and dtypes; not array contents) is
part of the kernel variant, so a different expression or constant compiles a different kernel.

    window = omnicupy.cuda_mask("q_idx >= kv_idx && q_idx - kv_idx < WINDOW", constants={"WINDOW": 256})
    docs = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": doc_ids})

Mask expressions see ``b, h, q_idx, kv_idx`` (int) and return a truth value; score expressions also
see ``score`` (float, after scale and bias) and return the new score.
"""
from __future__ import annotations

import hashlib
import keyword
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from .. import arrays
from ..errors import ArgumentError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Names the kernel already defines where expressions are evaluated.
RESERVED = frozenset({"b", "h", "q_idx", "kv_idx", "score"})
ARRAY_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.float32): "float"}


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name) or name in RESERVED \
            or name.startswith("k") and name[1:2].isupper() or name.startswith("__"):
        raise ArgumentError(f"{what} name {name!r} is not a usable C identifier (letters, digits, _; not one of "
                            f"{sorted(RESERVED)}, not kName-style, no leading __)")
    return name


def _constant_literal(name: str, value: Any) -> tuple[str, str]:
    """(C type, literal) for a Python int/float/bool constant."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if not -2**31 <= value < 2**31:
            raise ArgumentError(f"constant {name}={value} does not fit in a 32-bit int")
        return "int", str(value)
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value):
            raise ArgumentError(f"constant {name}={value} must be finite")
        return "float", f"{float(value)!r}f"
    raise ArgumentError(f"constant {name} must be an int, float or bool, got {type(value).__name__}")


@dataclass(frozen=True)
class CudaExpr:
    """An expression with its constants ((name, C type, literal), ...) and arrays ((name, C type), ...)."""

    text: str
    constants: tuple = ()
    array_decls: tuple = ()
    arrays: tuple = ()  # the array values, same order as array_decls; not part of the key

    @classmethod
    def make(cls, text: str, constants: Optional[Mapping[str, Any]] = None,
             arrays_: Optional[Mapping[str, Any]] = None) -> "CudaExpr":
        if not isinstance(text, str) or not text.strip():
            raise ArgumentError("a CUDA expression must be a non-empty string")
        if any(c in text for c in ";{}#") or "//" in text or "/*" in text:
            raise ArgumentError(f"CUDA expression {text!r} must be a single expression (no ; {{ }} # or comments)")
        consts = tuple((_check_name(n, "constant"), *_constant_literal(n, v)) for n, v in sorted((constants or {}).items()))
        decls, values = [], []
        for name, value in sorted((arrays_ or {}).items()):
            _check_name(name, "array")
            arr = arrays.as_array(value, name)
            if arr.ndim != 1:
                arr = arr.reshape(-1)
            dtype = np.dtype(arr.dtype)
            if dtype.kind in "iu" and dtype != np.int32:
                arr = arr.astype(np.int32)
            elif dtype.kind == "f" and dtype != np.float32:
                arr = arr.astype(np.float32)
            elif dtype.kind == "b":
                arr = arr.astype(np.int32)
            decls.append((name, ARRAY_CTYPES[np.dtype(arr.dtype)]))
            values.append(arr)
        names = [c[0] for c in consts] + [d[0] for d in decls]
        if len(set(names)) != len(names):
            raise ArgumentError(f"constant and array names must be distinct, got {names}")
        return cls(text.strip(), consts, tuple(decls), tuple(values))

    @property
    def key(self) -> tuple:
        return (self.text, self.constants, self.array_decls)

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self.key).encode()).hexdigest()[:8]

    def device_arrays(self):
        """The arrays as CuPy arrays on the current device (cached per device)."""
        cp = arrays.cupy_module()
        dev = cp.cuda.runtime.getDevice()
        cache = self.__dict__.setdefault("_device", {})
        if dev not in cache:
            cache[dev] = tuple(cp.ascontiguousarray(cp.asarray(a)) for a in self.arrays)
        return cache[dev]


def merge_names(*exprs: Optional[CudaExpr]) -> None:
    """Raise if two fused expressions define the same constant or array name differently."""
    seen: dict = {}
    for e in exprs:
        if e is None:
            continue
        for c in e.constants:
            if seen.setdefault(c[0], c) != c:
                raise ArgumentError(f"mask and score expressions both define {c[0]!r}, differently")
        for d in e.array_decls:
            if d[0] in seen:
                raise ArgumentError(f"mask and score expressions both define an array or constant {d[0]!r}")
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


def _elementwise(expr: CudaExpr, out_decl: str, before: str, after: str, with_score: bool = False):
    """A callable running ``expr`` as a CuPy elementwise kernel over broadcast index arrays."""
    cp = arrays.cupy_module()
    cache = expr.__dict__.setdefault("_elementwise", {})
    key = (out_decl, with_score)
    if key not in cache:
        preamble = "\n".join(f"static constexpr {t} {n} = {v};" for n, t, v in expr.constants)
        ins = (["float32 score"] if with_score else []) + ["int32 b", "int32 h", "int32 q_idx", "int32 kv_idx"]
        ins += [f"raw {'int32' if t == 'int' else 'float32'} {n}" for n, t in expr.array_decls]
        cache[key] = cp.ElementwiseKernel(", ".join(ins), out_decl, f"{before}{expr.text}{after};",
                                          f"omnicupy_expr_{expr.digest}", preamble=preamble)
    kernel = cache[key]

    def run(*args):
        ints = [cp.asarray(a).astype(np.int32, copy=False) for a in args[-4:]]
        head = [cp.asarray(args[0], dtype=np.float32)] if with_score else []
        return kernel(*head, *ints, *expr.device_arrays())

    return run


def cuda_mask(expr: str, constants: Optional[Mapping[str, Any]] = None, arrays: Optional[Mapping[str, Any]] = None,
              *, numpy_fn: Optional[Callable] = None, name: Optional[str] = None) -> CudaMask:
    """A mask_mod from a CUDA C expression over ``b, h, q_idx, kv_idx`` (see CudaMask)."""
    return CudaMask(CudaExpr.make(expr, constants, arrays), numpy_fn, name)


def fused_mask_expr(mask_mod: Any) -> Optional[CudaExpr]:
    """The CUDA expression a mask_mod carries (CudaMask, or a built-in with ``cuda_expr``), if any."""
    if mask_mod is None:
        return None
    expr = getattr(mask_mod, "cuda", None)
    if isinstance(expr, CudaExpr):
        return expr
    text = getattr(mask_mod, "cuda_expr", None)
    return CudaExpr.make(text) if isinstance(text, str) and text.strip() else None
