"""float64 NumPy reference attention, computed from the element-level mask (never block metadata).

    out[b,h,i] = sum_j softmax_j(scale * q[b,h,i]·k[b,hk,j] + bias | allowed(b,h,i,j)) v[b,hk,j]

Rows with no allowed key give 0 and LSE -inf. This is the oracle every kernel test compares with.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import numpy as np

from . import arrays

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
    q64, k64, v64 = _as_float64(q, "q"), _as_float64(k, "k"), _as_float64(v, "v")
    B, Hq, Nq, D = q64.shape
    Hkv, Nkv = k64.shape[1], k64.shape[2]
    if Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
    group = Hq // Hkv
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

    out = np.zeros((B, Hq, Nq, v64.shape[3]), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    qi = np.arange(Nq)[:, None]
    ki = np.arange(Nkv)[None, :]
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            s = (q64[b, h] @ k64[b, hk].T) * scale
            if bias64 is not None:
                s = s + bias64[b, h]
            if score_mod is not None:
                s = np.asarray(score_mod(s, b, h, qi, ki), dtype=np.float64)
            if mask_mod is not None:
                allowed = np.broadcast_to(np.asarray(mask_mod(b, h, qi, ki), dtype=bool), (Nq, Nkv))
            elif dense is not None:
                allowed = dense[b, h]
            else:
                allowed = np.ones((Nq, Nkv), dtype=bool)
            s = np.where(allowed, s, -np.inf)
            row_max = s.max(axis=1, keepdims=True)
            has_any = np.isfinite(row_max)
            p = np.exp(s - np.where(has_any, row_max, 0.0))
            denom = p.sum(axis=1, keepdims=True)
            safe = np.where(denom > 0, denom, 1.0)
            out[b, h] = np.where(has_any, (p / safe) @ v64[b, hk], 0.0)
            lse[b, h] = np.where(has_any[:, 0], np.log(safe[:, 0]) + np.where(has_any, row_max, 0.0)[:, 0], -np.inf)
    return (out, lse) if return_lse else out


def relative_error(actual: Any, expected: np.ndarray) -> float:
    """‖actual − expected‖_F / ‖expected‖_F in float64; inf when ``actual`` has NaN or inf.

    An all-zero ``expected`` (every row masked) compares by absolute norm instead."""
    a = arrays.to_numpy(actual).astype(np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(expected)
    diff = np.linalg.norm(a - expected)
    return float(diff / denom) if denom > 0 else float(diff)


__all__ = ["attention", "dense_mask_from_mod", "relative_error"]
