"""Score modifiers fused into the kernel: ``score -> f(score, b, h, q_idx, kv_idx)``.

``score`` is the scaled q·k plus any additive bias; masking comes after the modifier. Each
modifier carries a CUDA expression (rendered into the kernel) and a NumPy form, so that
``omnicupy.reference.attention(..., score_mod=mod)`` checks it. For the backward pass a modifier
also carries its derivative ``d(new score)/d(score)`` as a CUDA expression over the same names
(``grad``) and, for the reference, as NumPy (``numpy_grad``); the built-ins know theirs:

    out = omnicupy.attention(q, k, v, causal=True, score_mod=score_mods.softcap(30.0))
    ref = omnicupy.reference.attention(q, k, v, mask, score_mod=score_mods.softcap(30.0))
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from . import arrays
from .checks import check_positive_float
from .errors import ArgumentError
from .mask import registry
from .mask.expressions import CudaExpr, _elementwise

#: Most heads an ALiBi modifier is made for (the kernels put heads on grid.y, at most 65535).
MAX_HEADS = 65535


#: The derivative of an additive modifier; the backward kernel recognises it and skips the product.
UNIT_GRAD = "1.0f"


class ScoreMod:
    """A score modifier: ``cuda`` (a CudaExpr over score, b, h, q_idx, kv_idx) and, when known, the
    same function for NumPy (``numpy_fn(score, b, h, q_idx, kv_idx)``). Calling it evaluates the NumPy
    form, or the CUDA expression on the GPU when there is no NumPy form.

    ``cuda_grad`` (a CudaExpr with the same constants and arrays) is the derivative of the new score
    with respect to ``score`` (the modifier's input), which the backward kernel multiplies into dS;
    ``numpy_grad`` is the same for NumPy (the reference backward). Without them the modifier works
    in the forward pass only. ``grad_at_most_one``: the derivative is known never to exceed 1 in size
    (the built-ins'), which the deterministic backward's fixed-point dQ relies on (ops/backward.py);
    other derivatives take the ordered fp32 sum."""

    def __init__(self, expr: CudaExpr, numpy_fn: Optional[Callable] = None, name: Optional[str] = None, *,
                 grad: Optional[CudaExpr] = None, numpy_grad: Optional[Callable] = None,
                 grad_at_most_one: bool = False) -> None:
        self.cuda = expr
        self.numpy_fn = numpy_fn
        self.cuda_grad = grad
        self.numpy_grad = numpy_grad
        self.grad_at_most_one = grad_at_most_one
        self.name = self.__name__ = name or f"cuda_score_{expr.digest}"
        #: Read-only: the process-unique serial (mask/registry.py) by which a compiled graph names it.
        self.serial: str = registry.enroll(self)

    def __repr__(self) -> str:
        return f"ScoreMod({self.name}: {self.cuda.text!r})"

    def __call__(self, score, b, h, q_idx, kv_idx):
        if self.numpy_fn is not None and not arrays.is_cupy(score):
            return self.numpy_fn(score, b, h, q_idx, kv_idx)
        if not arrays.gpu_available():
            raise ArgumentError(f"{self!r} has no NumPy form and needs a GPU to evaluate")
        cp = arrays.cupy_module()
        args = [cp.asarray(x) for x in (score, b, h, q_idx, kv_idx)]
        out = _elementwise(self.cuda, "float32 out", "out = (", ")", with_score=True)(*args)
        return out if arrays.is_cupy(score) else out.get()


def cuda_score(expr: str, constants: Optional[Mapping[str, Any]] = None, arrays: Optional[Mapping[str, Any]] = None,
               *, numpy_fn: Optional[Callable] = None, name: Optional[str] = None, grad: Optional[str] = None,
               numpy_grad: Optional[Callable] = None, extents: Optional[Mapping[str, Any]] = None) -> ScoreMod:
    """A score modifier from a CUDA C expression over ``score, b, h, q_idx, kv_idx`` (floats and ints).
    The grammar, constants, lookup arrays and ``extents`` are checked as omnicupy.mask.expressions
    documents (ExpressionError otherwise).

    ``grad``: a CUDA expression over the same names (and the same constants and arrays) giving
    ``d(new score) / d(score)``, needed by ``attention_backward``; ``numpy_grad`` is its NumPy form
    for ``reference.attention_backward``. E.g. ``cuda_score("score * S", {"S": 0.5}, grad="S")``."""
    grad_expr = None if grad is None else CudaExpr.make(grad, constants, arrays, extents=extents, kind="score")
    return ScoreMod(CudaExpr.make(expr, constants, arrays, extents=extents, kind="score"), numpy_fn, name,
                    grad=grad_expr, numpy_grad=numpy_grad)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes ``2^(-8 (h + 1) / H)`` (attention-gym's form, for any number of heads)."""
    return np.exp2(-8.0 * (np.arange(num_heads) + 1) / num_heads)


def alibi(num_heads: int) -> ScoreMod:
    """ALiBi: ``score + slope[h] * (kv_idx - q_idx)`` with ``slope[h] = 2^(-8 (h + 1) / H)``."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or not 1 <= num_heads <= MAX_HEADS:
        raise ArgumentError(f"alibi: num_heads must be a positive int <= {MAX_HEADS}, got {num_heads!r}")
    H = int(num_heads)
    slopes = alibi_slopes(H)

    def numpy_fn(score, b, h, q_idx, kv_idx):
        return score + slopes[np.asarray(h)] * (np.asarray(kv_idx) - np.asarray(q_idx))

    def numpy_grad(score, b, h, q_idx, kv_idx):
        return np.ones_like(np.asarray(score, dtype=np.float64))

    consts = {"ALIBI_HEADS": H}
    expr = CudaExpr.make("score + exp2f(-8.0f * (float)(h + 1) / (float)ALIBI_HEADS) * (float)(kv_idx - q_idx)", consts)
    # An additive term: the derivative is 1 (the backward kernel skips multiplying by it).
    return ScoreMod(expr, numpy_fn, f"alibi_{H}", grad=CudaExpr.make(UNIT_GRAD, consts), numpy_grad=numpy_grad,
                    grad_at_most_one=True)


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping (Gemma 2): ``cap * tanh(score / cap)``."""
    # The kernel multiplies by 1/cap in float32: both cap and 1/cap must be normal float32 numbers.
    cap = check_positive_float(cap, "softcap: cap", maximum=1.0 / float(np.finfo(np.float32).tiny))

    def numpy_fn(score, b, h, q_idx, kv_idx):
        return cap * np.tanh(score / cap)

    def numpy_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - np.tanh(score / cap) ** 2

    # tanh_fast (kernels/ptx.cuh): ex2 + rcp instead of tanhf, which cost 3-4x the whole kernel.
    consts = {"SOFTCAP": cap, "SOFTCAP_INV": 1.0 / cap}
    expr = CudaExpr.make("SOFTCAP * omni::tanh_fast(score * SOFTCAP_INV)", consts)
    # d/ds cap * tanh(s / cap) = 1 - tanh^2(s / cap)
    grad = CudaExpr.make("1.0f - omni::tanh_fast(score * SOFTCAP_INV) * omni::tanh_fast(score * SOFTCAP_INV)", consts)
    return ScoreMod(expr, numpy_fn, f"softcap_{cap:g}", grad=grad, numpy_grad=numpy_grad,
                    grad_at_most_one=True)  # 1 - tanh^2


__all__ = ["ScoreMod", "cuda_score", "alibi", "alibi_slopes", "softcap", "UNIT_GRAD"]
