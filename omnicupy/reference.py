"""float64 NumPy reference attention, computed from the element-level mask (never block metadata).

    out[b,h,i] = sum_j softmax_j(scale * q[b,h,i]·k[b,hk,j] + bias | allowed(b,h,i,j)) v[b,hk,j]

Rows with no allowed key give 0 and LSE -inf. This is the oracle every kernel test compares with.
``attention_backward`` gives the gradients of the same function (bias a constant input), from the
same element-level mask.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import numpy as np

from . import arrays
from .errors import ArgumentError

MaskLike = Union[np.ndarray, Callable, None]


def dense_mask_from_mod(mask_mod: Callable, B: int, H: int, q_len: int, kv_len: int) -> np.ndarray:
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` on broadcast NumPy index arrays -> bool [B, H, Nq, Nkv]."""
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    qi = np.arange(q_len).reshape(1, 1, q_len, 1)
    ki = np.arange(kv_len).reshape(1, 1, 1, kv_len)
    return np.broadcast_to(np.asarray(mask_mod(b, h, qi, ki), dtype=bool), (B, H, q_len, kv_len))


def _as_float64(x: Any, name: str) -> np.ndarray:
    x = arrays.to_numpy(x)
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D [B, H, N, D], got shape {x.shape}")
    return x.astype(np.float64)


class _Prepared:
    """float64 inputs, the dense mask or mask_mod, the bias, and the scores of one (b, h)."""

    def __init__(self, q64, k64, v64, group, scale, mask_mod, dense, bias64):
        self.q, self.k, self.v, self.group, self.scale = q64, k64, v64, group, scale
        self.mask_mod, self.dense, self.bias = mask_mod, dense, bias64

    @classmethod
    def make(cls, q, k, v, mask, scale, bias) -> "_Prepared":
        q64, k64, v64 = _as_float64(q, "q"), _as_float64(k, "k"), _as_float64(v, "v")
        B, Hq, Nq, D = q64.shape
        Hkv, Nkv = k64.shape[1], k64.shape[2]
        if Hq % Hkv:
            raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
        scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
        if callable(mask):
            mask_mod, dense = mask, None
        else:
            mask_mod = None
            dense = None if mask is None else np.broadcast_to(arrays.to_numpy(mask).astype(bool), (B, Hq, Nq, Nkv))
        bias64 = None
        if bias is not None:
            bias64 = arrays.to_numpy(bias).astype(np.float64)
            if bias64.ndim == 3:  # a vector bias [B|1, H|1, Nkv]: the same row for every query
                bias64 = bias64[:, :, None, :]
            bias64 = np.broadcast_to(bias64, (B, Hq, Nq, Nkv))
        return cls(q64, k64, v64, Hq // Hkv, scale, mask_mod, dense, bias64)

    def scores(self, b: int, h: int, score_mod: Optional[Callable]):
        """(score before the modifier, masked final score with -inf where disallowed, allowed)."""
        Nq, Nkv = self.q.shape[2], self.k.shape[2]
        qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
        s = (self.q[b, h] @ self.k[b, h // self.group].T) * self.scale
        if self.bias is not None:
            s = s + self.bias[b, h]
        pre = s
        if score_mod is not None:
            s = np.asarray(score_mod(s, b, h, qi, ki), dtype=np.float64)
        if self.mask_mod is not None:
            allowed = np.broadcast_to(np.asarray(self.mask_mod(b, h, qi, ki), dtype=bool), (Nq, Nkv))
        elif self.dense is not None:
            allowed = self.dense[b, h]
        else:
            allowed = np.ones((Nq, Nkv), dtype=bool)
        return pre, np.where(allowed, s, -np.inf), allowed


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
):
    """Exact attention in float64.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` with ``Hq % Hkv == 0`` (query head h reads kv head
    ``h // (Hq // Hkv)``). ``mask`` is a boolean array broadcastable to ``[B, Hq, Nq, Nkv]`` or a
    ``mask_mod(b, h, q_idx, kv_idx)`` callable; None means full attention. ``bias`` (``[B|1, H|1, Nkv]``
    or ``[B|1, H|1, Nq, Nkv]``) is added after scaling; ``score_mod(score, b, h, q_idx, kv_idx)`` (NumPy
    form) is applied after that. Returns ``out`` (float64) or ``(out, lse)`` with natural-log LSE.
    """
    prep = _Prepared.make(q, k, v, mask, scale, bias)
    q64, v64, group = prep.q, prep.v, prep.group
    B, Hq, Nq, _ = q64.shape
    out = np.zeros((B, Hq, Nq, v64.shape[3]), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            _, s, _ = prep.scores(b, h, score_mod)
            row_max = s.max(axis=1, keepdims=True)
            has_any = np.isfinite(row_max)
            p = np.exp(s - np.where(has_any, row_max, 0.0))
            denom = p.sum(axis=1, keepdims=True)
            safe = np.where(denom > 0, denom, 1.0)
            out[b, h] = np.where(has_any, (p / safe) @ v64[b, hk], 0.0)
            lse[b, h] = np.where(has_any[:, 0], np.log(safe[:, 0]) + np.where(has_any, row_max, 0.0)[:, 0], -np.inf)
    return (out, lse) if return_lse else out


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
):
    """Gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v, ...) * dout)`` in float64.

    Same arguments and conventions as ``attention``; ``dout`` is ``[B, Hq, Nq, D]``. dk/dv of a kv
    head sum over the query heads that read it (GQA/MQA). ``bias`` is a constant input (no dbias).
    Rows with no allowed key contribute nothing (their output is the constant 0). A ``score_mod``
    needs its derivative ``score_mod.numpy_grad(score, b, h, q_idx, kv_idx)`` (d new score / d score).

        dS = P * (dP - rowsum(dO * O)) * score_mod'(score),  dP = dO Vᵀ
        dq = scale * dS K,  dk = scale * dSᵀ Q,  dv = Pᵀ dO
    """
    grad_fn = None
    if score_mod is not None:
        grad_fn = getattr(score_mod, "numpy_grad", None)
        if grad_fn is None:
            raise ArgumentError(f"score_mod {score_mod!r} has no numpy_grad (its derivative), needed for gradients")
    prep = _Prepared.make(q, k, v, mask, scale, bias)
    do64 = _as_float64(dout, "dout")
    q64, k64, v64, group = prep.q, prep.k, prep.v, prep.group
    B, Hq, Nq, _ = q64.shape
    if do64.shape[:3] != (B, Hq, Nq) or do64.shape[3] != v64.shape[3]:
        raise ArgumentError(f"dout must have shape {(B, Hq, Nq, v64.shape[3])}, got {do64.shape}")
    Nkv = k64.shape[2]
    qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
    dq, dk, dv = np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            pre, s, _ = prep.scores(b, h, score_mod)
            row_max = s.max(axis=1, keepdims=True)
            has_any = np.isfinite(row_max)
            p = np.exp(s - np.where(has_any, row_max, 0.0))
            p = p / np.where(has_any, p.sum(axis=1, keepdims=True), 1.0)  # empty rows: p is all 0
            dp = do64[b, h] @ v64[b, hk].T
            delta = (p * dp).sum(axis=1, keepdims=True)  # = rowsum(dO * O)
            ds = p * (dp - delta)
            if grad_fn is not None:
                ds = ds * np.where(p > 0, np.asarray(grad_fn(pre, b, h, qi, ki), dtype=np.float64), 0.0)
            dv[b, hk] += p.T @ do64[b, h]
            dq[b, h] = prep.scale * (ds @ k64[b, hk])
            dk[b, hk] += prep.scale * (ds.T @ q64[b, h])
    return dq, dk, dv


def relative_error(actual: Any, expected: np.ndarray) -> float:
    """‖actual − expected‖_F / ‖expected‖_F in float64; inf when ``actual`` has NaN or inf.

    An all-zero ``expected`` (every row masked) compares by absolute norm instead."""
    a = arrays.to_numpy(actual).astype(np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(expected)
    diff = np.linalg.norm(a - expected)
    return float(diff / denom) if denom > 0 else float(diff)


__all__ = ["attention", "attention_backward", "dense_mask_from_mod", "relative_error"]
