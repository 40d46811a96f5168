"""float64 attention and its gradients over whole [B, H, N, D] tensors, from the element-level mask.

    out[b,h,i] = sum_j softmax_j(scale * q[b,h,i]·k[b,hk,j] + bias | allowed(b,h,i,j)) v[b,hk,j]

With sink logits (``sinks[h]``, one per query head) each row's normalizer gains ``exp(sinks[h])``, a
term with no value row: ``P_ij = exp(s_ij - m) / (exp(sink_h - m) + sum_j exp(s_ij - m))``. The LSE
includes it, so a row with no allowed key has output 0 and LSE ``sinks[h]`` (-inf without sinks).

Knows the softmax, its gradients and the gradient names; argument checks live in ``inputs``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..errors import ArgumentError
from ..ops.inputs import check_bool
from .inputs import MaskLike, Prepared, as_float64, host_array, is_real

#: What ``attention_backward(return_grads=...)`` can return, in the order it returns them.
GRAD_NAMES = ("dq", "dk", "dv", "dbias", "dsinks", "dscore")
DEFAULT_GRADS = ("dq", "dk", "dv")


def _softmax(s: np.ndarray, sink: Optional[float] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row softmax of masked scores (-inf where disallowed), its natural-log LSE and the sink's share
    of each row (zeros without a sink). Without a sink a row with no allowed key gives probabilities 0
    and LSE -inf; with one, probabilities 0, LSE = sink and the sink's share 1."""
    row_max = s.max(axis=1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)  # finite: every row has the sink
    has_any = np.isfinite(row_max)
    shift = np.where(has_any, row_max, 0.0)
    p = np.exp(s - shift)
    sink_term = np.exp(sink - shift) if sink is not None else np.zeros_like(shift)
    denom = p.sum(axis=1, keepdims=True) + sink_term
    safe = np.where(denom > 0, denom, 1.0)
    lse = np.where(has_any[:, 0], np.log(safe[:, 0]) + shift[:, 0], -np.inf)
    return np.where(has_any, p / safe, 0.0), lse, (sink_term / safe)[:, 0]


def _sink_of(prep: Prepared, h: int) -> Optional[float]:
    return None if prep.sinks is None else float(prep.sinks[h])


def attention(
    q: Any,
    k: Any,
    v: Any,
    mask: MaskLike = None,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
    bias: Any = None,
    score_mod: Optional[Callable] = None,
    sinks: Any = None,
):
    """Exact attention in float64.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` with ``Hq % Hkv == 0`` (query head h reads kv head
    ``h // (Hq // Hkv)``). ``mask`` is a boolean array broadcastable to ``[B, Hq, Nq, Nkv]`` or a
    ``mask_mod(b, h, q_idx, kv_idx)`` callable; None means full attention. ``bias`` (``[B|1, H|1, Nkv]``
    or ``[B|1, H|1, Nq, Nkv]``) is added after scaling; ``score_mod(score, b, h, q_idx, kv_idx)`` (NumPy
    form) is applied after that. ``sinks`` ``[Hq]``: sink logits (module docstring), untouched by the
    score modifier. Returns ``out`` (float64) or ``(out, lse)`` with natural-log LSE.
    """
    prep = Prepared.make(q, k, v, mask, scale, bias, score_mod, sinks)
    return_lse = check_bool(return_lse, "return_lse")
    q64, v64, group = prep.q, prep.v, prep.group
    B, Hq, Nq, _ = q64.shape
    out = np.zeros((B, Hq, Nq, v64.shape[3]), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            _, s, _ = prep.scores(b, h, score_mod)
            p, lse[b, h], _ = _softmax(s, _sink_of(prep, h))
            out[b, h] = p @ v64[b, h // group]
    return (out, lse) if return_lse else out


def _check_return_grads(return_grads: Any, prep: Prepared) -> tuple:
    if isinstance(return_grads, str) or not isinstance(return_grads, (tuple, list)):
        raise ArgumentError(f"return_grads must be a tuple of names from {GRAD_NAMES}, got {return_grads!r}")
    unknown = [g for g in return_grads if g not in GRAD_NAMES]
    if unknown or len(set(return_grads)) != len(return_grads) or not return_grads:
        raise ArgumentError(f"return_grads must name each of {GRAD_NAMES} at most once, got {tuple(return_grads)}")
    if "dbias" in return_grads and prep.bias is None:
        raise ArgumentError("return_grads asks for 'dbias' but no bias was given")
    if "dsinks" in return_grads and prep.sinks is None:
        raise ArgumentError("return_grads asks for 'dsinks' but no sinks were given")
    if "dscore" in return_grads:
        raise ArgumentError("'dscore' (gradients of a score modifier's arrays) is not available yet")
    return tuple(g for g in GRAD_NAMES if g in return_grads)


def _reduce_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a [B, Hq, Nq, Nkv] gradient down to a bias's own shape (vector or matrix, size-1 dims
    broadcast): what the bias received from every position it was added at."""
    if len(shape) == 3:  # a vector bias [B|1, H|1, Nkv]: the same value for every query row
        grad = grad.sum(axis=2)
    for dim, size in enumerate(shape[:2]):
        if size == 1:
            grad = grad.sum(axis=dim, keepdims=True)
    return grad


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: MaskLike = None,
    *,
    scale: Optional[float] = None,
    bias: Any = None,
    score_mod: Optional[Callable] = None,
    sinks: Any = None,
    return_grads: Any = DEFAULT_GRADS,
):
    """Gradients of ``sum(attention(q, k, v, ...) * dout)`` in float64: ``(dq, dk, dv)`` by default.

    Same arguments and conventions as ``attention``; ``dout`` is ``[B, Hq, Nq, D]``. dk/dv of a kv
    head sum over the query heads that read it (GQA/MQA). Rows with no allowed key contribute
    nothing to dq/dk/dv (their output is the constant 0). A ``score_mod`` needs its derivative
    ``score_mod.numpy_grad(score, b, h, q_idx, kv_idx)`` (d new score / d score).
    ``return_grads``: any of ``GRAD_NAMES`` — ``dbias`` has the bias's own shape (summed over the
    dims it broadcasts over; masked positions contribute 0), ``dsinks`` is ``[Hq]``; they come back
    in ``GRAD_NAMES`` order.

        dS = P * (dP - rowsum(dO * O)) * score_mod'(score),  dP = dO Vᵀ
        dq = scale * dS K,  dk = scale * dSᵀ Q,  dv = Pᵀ dO,  dbias = dS (reduced)
        dsink_h = -sum_{b, i} P_sink[b, h, i] * rowsum(dO * O)[b, h, i]
    """
    grad_fn = None
    if score_mod is not None:
        grad_fn = getattr(score_mod, "numpy_grad", None)
        if grad_fn is None:
            raise ArgumentError(f"score_mod {score_mod!r} has no numpy_grad (its derivative), needed for gradients")
    prep = Prepared.make(q, k, v, mask, scale, bias, score_mod, sinks)
    wanted = _check_return_grads(return_grads, prep)
    do64 = as_float64(dout, "dout")
    q64, k64, v64, group = prep.q, prep.k, prep.v, prep.group
    B, Hq, Nq, _ = q64.shape
    if do64.shape[:3] != (B, Hq, Nq) or do64.shape[3] != v64.shape[3]:
        raise ArgumentError(f"dout must have shape {(B, Hq, Nq, v64.shape[3])}, got {do64.shape}")
    Nkv = k64.shape[2]
    qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
    dq, dk, dv = np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)
    dscores = np.zeros((B, Hq, Nq, Nkv)) if "dbias" in wanted else None
    dsinks = np.zeros(Hq)
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            pre, s, _ = prep.scores(b, h, score_mod)
            p, _, p_sink = _softmax(s, _sink_of(prep, h))
            dp = do64[b, h] @ v64[b, hk].T
            delta = (p * dp).sum(axis=1, keepdims=True)  # = rowsum(dO * O)
            ds = p * (dp - delta)
            if grad_fn is not None:
                ds = ds * np.where(p > 0, np.asarray(grad_fn(pre, b, h, qi, ki), dtype=np.float64), 0.0)
            dv[b, hk] += p.T @ do64[b, h]
            dq[b, h] = prep.scale * (ds @ k64[b, hk])
            dk[b, hk] += prep.scale * (ds.T @ q64[b, h])
            dsinks[h] -= float(np.dot(p_sink, delta[:, 0]))
            if dscores is not None:
                dscores[b, h] = ds
    every = {"dq": dq, "dk": dk, "dv": dv, "dsinks": dsinks,
             "dbias": None if dscores is None else _reduce_to(dscores, prep.bias_shape)}
    return tuple(every[g] for g in wanted)


def relative_error(actual: Any, expected: np.ndarray) -> float:
    """‖actual − expected‖_F / ‖expected‖_F in float64; inf when ``actual`` has NaN or inf.

    An all-zero ``expected`` (every row masked) compares by absolute norm instead."""
    a = host_array(actual, "actual")
    e = host_array(expected, "expected")
    if a.shape != e.shape:
        raise ArgumentError(f"relative_error: actual {a.shape} and expected {e.shape} must have the same shape")
    if not (is_real(np.dtype(a.dtype)) and is_real(np.dtype(e.dtype))):
        raise ArgumentError(f"relative_error compares real arrays, got {a.dtype} and {e.dtype}")
    a, expected = a.astype(np.float64), e.astype(np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(expected)
    diff = np.linalg.norm(a - expected)
    return float(diff / denom) if denom > 0 else float(diff)
