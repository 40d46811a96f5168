"""Checked float64 inputs of the reference: arrays, masks (dense or mask_mod), biases, sink logits and
the scores of one (batch, head).

Arguments are checked as ``attention()`` checks them (ArgumentError / MaskError naming the
argument, never a raw NumPy error), except that any real dtype and head dim are accepted: q/k/v are
4-D arrays (NumPy, CuPy, DLPack), the mask is a boolean array or a mask_mod callable (a string
such as "causal" or a BlockMask is refused: pass ``bm.mask_mod`` or ``bm.to_dense()``), and what a
mask_mod or score_mod returns must be boolean / real and broadcast to ``[Nq, Nkv]``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import ArgumentError, MaskError, OmnicupyError
from ..ops.inputs import check_scale

MaskLike = Union[np.ndarray, Callable, None]

_CALL_CONTRACT = ("a mask_mod is called as f(b, h, q_idx, kv_idx) on broadcast NumPy index arrays (here b, h "
                  "ints, q_idx [Nq, 1], kv_idx [1, Nkv]) and returns booleans of their broadcast shape")


def is_array(x: Any) -> bool:
    return arrays.is_numpy(x) or arrays.is_cupy(x) or hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")


def host_array(x: Any, name: str, error: type = ArgumentError) -> np.ndarray:
    if x is None:
        raise error(f"{name} is required")
    if not is_array(x):
        raise error(f"{name} must be a NumPy/CuPy array or a DLPack / CUDA-array-interface object, "
                    f"got {type(x).__name__}")
    try:
        return arrays.to_numpy(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as exc:
        raise error(f"{name} could not be read as an array: {exc}") from None


def is_real(dtype: np.dtype) -> bool:
    return dtype.kind in "fiu" or dtype == arrays.BFLOAT16


def as_float64(x: Any, name: str) -> np.ndarray:
    x = host_array(x, name)
    if not is_real(np.dtype(x.dtype)):
        raise ArgumentError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if x.ndim != 4:
        raise ArgumentError(f"{name} must be 4-D [B, H, N, D], got shape {x.shape}")
    if x.size == 0:
        raise ArgumentError(f"{name} has a zero-size dimension: shape {x.shape}")
    return x.astype(np.float64)


def _check_callable(fn: Callable, name: str, nargs: int, error: type) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: the call will tell
        return
    try:
        signature.bind(*range(nargs))
    except TypeError:
        raise error(f"{name} must take {nargs} positional arguments, its signature is {signature}") from None


def _call(fn: Callable, args: tuple, name: str, error: type):
    try:
        return fn(*args)
    except OmnicupyError:
        raise
    except Exception as exc:  # noqa: BLE001 - the caller's function: report it as an argument error
        contract = _CALL_CONTRACT if error is MaskError else "a score_mod is f(score, b, h, q_idx, kv_idx)"
        raise error(f"{name} raised {type(exc).__name__}: {exc} ({contract})") from exc


def _mask_values(result: Any, shape: tuple, name: str) -> np.ndarray:
    """A mask_mod's result as a bool array broadcast to ``shape``, or MaskError."""
    values = result if isinstance(result, (bool, np.bool_)) else None
    if values is None:
        if not is_array(result):
            raise MaskError(f"{name} returned {type(result).__name__}, not a boolean array ({_CALL_CONTRACT})")
        values = arrays.to_numpy(result)
    values = np.asarray(values)
    if values.dtype != np.bool_:
        raise MaskError(f"{name} returned {values.dtype} values, not booleans: use comparisons and & | ~ "
                        f"({_CALL_CONTRACT})")
    try:
        return np.broadcast_to(values, shape)
    except ValueError:
        raise MaskError(f"{name} returned shape {values.shape}, which does not broadcast to {shape} "
                        f"({_CALL_CONTRACT})") from None


def _score_values(result: Any, shape: tuple) -> np.ndarray:
    """A score_mod's result as float64 broadcast to ``shape``, or ArgumentError."""
    values = arrays.to_numpy(result) if is_array(result) else np.asarray(result)
    if not is_real(np.dtype(values.dtype)):
        raise ArgumentError(f"score_mod returned {values.dtype} values, not real numbers")
    try:
        return np.broadcast_to(values.astype(np.float64), shape)
    except ValueError:
        raise ArgumentError(f"score_mod returned shape {values.shape}, which does not broadcast to {shape}") from None


def dense_mask_from_mod(mask_mod: Callable, B: int, H: int, q_len: int, kv_len: int) -> np.ndarray:
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` on broadcast NumPy index arrays -> bool [B, H, Nq, Nkv]."""
    if not callable(mask_mod):
        raise MaskError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    B, H, q_len, kv_len = (check_int(n, name, minimum=1, error=MaskError)
                           for n, name in ((B, "B"), (H, "H"), (q_len, "q_len"), (kv_len, "kv_len")))
    _check_callable(mask_mod, "mask_mod", 4, MaskError)
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    qi = np.arange(q_len).reshape(1, 1, q_len, 1)
    ki = np.arange(kv_len).reshape(1, 1, 1, kv_len)
    return _mask_values(_call(mask_mod, (b, h, qi, ki), "mask_mod", MaskError), (B, H, q_len, kv_len), "mask_mod")


def _dense_mask(mask: Any, shape: tuple) -> np.ndarray:
    values = host_array(mask, "mask", MaskError)
    if values.dtype != np.bool_:
        raise MaskError(f"mask must be a boolean array (True = allowed), got dtype {values.dtype}")
    try:
        return np.broadcast_to(values, shape)
    except ValueError:
        raise MaskError(f"mask shape {values.shape} does not broadcast to [B, Hq, Nq, Nkv] = {shape}") from None


def _bias(bias: Any, B: int, Hq: int, Nq: int, Nkv: int) -> np.ndarray:
    """A vector [B|1, H|1, Nkv] or matrix [B|1, H|1, Nq, Nkv] bias, broadcast to [B, Hq, Nq, Nkv]."""
    values = host_array(bias, "bias")
    if not is_real(np.dtype(values.dtype)):
        raise ArgumentError(f"bias must hold real numbers, got dtype {values.dtype}")
    if values.ndim not in (3, 4):
        raise ArgumentError(f"bias must be [B|1, H|1, Nkv] or [B|1, H|1, Nq, Nkv], got shape {values.shape}")
    want = (B, Hq) + ((Nq,) if values.ndim == 4 else ()) + (Nkv,)
    for dim, (got, full) in enumerate(zip(values.shape, want)):
        if got != full and not (got == 1 and dim < len(want) - 1):
            raise ArgumentError(f"bias shape {values.shape} does not broadcast to {want} (dim {dim})")
    values = values.astype(np.float64)
    if values.ndim == 3:  # a vector bias: the same row for every query
        values = values[:, :, None, :]
    return np.broadcast_to(values, (B, Hq, Nq, Nkv))


def sink_logits(sinks: Any, heads: int) -> Optional[np.ndarray]:
    """Sink logits ``[Hq]`` as float64 (any real dtype here; the kernels take float32), or None."""
    if sinks is None:
        return None
    values = host_array(sinks, "sinks")
    if not is_real(np.dtype(values.dtype)) or values.shape != (heads,):
        raise ArgumentError(f"sinks must be a real array [Hq] = [{heads}], got {values.dtype} {values.shape}")
    values = values.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ArgumentError("sinks must be finite")
    return values


class Prepared:
    """Checked float64 inputs, the dense mask or mask_mod, the bias, and the scores of one (b, h)."""

    def __init__(self, q64, k64, v64, group, scale, mask_mod, dense, bias64, score_mod, bias_shape=None, sinks=None):
        self.q, self.k, self.v, self.group, self.scale = q64, k64, v64, group, scale
        self.mask_mod, self.dense, self.bias, self.score_mod = mask_mod, dense, bias64, score_mod
        self.bias_shape = bias_shape  # the bias as the caller gave it (its gradient has this shape)
        self.sinks = sinks  # float64 [Hq] or None

    @classmethod
    def make(cls, q, k, v, mask, scale, bias, score_mod, sinks=None) -> "Prepared":
        """Checks the arguments as ``attention()`` does (ArgumentError / MaskError naming them)."""
        q64, k64, v64 = as_float64(q, "q"), as_float64(k, "k"), as_float64(v, "v")
        B, Hq, Nq, D = q64.shape
        Bk, Hkv, Nkv, Dk = k64.shape
        if v64.shape[:3] != k64.shape[:3]:
            raise ArgumentError(f"k and v must agree in batch, heads and length, got k {k64.shape} and v {v64.shape}")
        if Bk != B:
            raise ArgumentError(f"k/v batch ({Bk}) must equal q batch ({B})")
        if Dk != D:
            raise ArgumentError(f"k/v head_dim ({Dk}) must equal q head_dim ({D})")
        if Hq % Hkv:
            raise ArgumentError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) (GQA/MQA)")
        scale = check_scale(scale, D)
        mask_mod, dense = None, None
        if callable(mask) and not is_array(mask):
            _check_callable(mask, "mask", 4, MaskError)
            mask_mod = mask
        elif mask is not None:
            if isinstance(mask, str) or not is_array(mask):
                hint = " (pass bm.mask_mod or bm.to_dense())" if hasattr(mask, "to_dense") else ""
                raise MaskError(f"mask must be a boolean array broadcastable to [B, Hq, Nq, Nkv] or a "
                                f"mask_mod(b, h, q_idx, kv_idx) callable, got {type(mask).__name__} {mask!r:.60}{hint}")
            dense = _dense_mask(mask, (B, Hq, Nq, Nkv))
        bias64 = None if bias is None else _bias(bias, B, Hq, Nq, Nkv)
        if score_mod is not None:
            if not callable(score_mod):
                raise ArgumentError(f"score_mod must be callable (its NumPy form), got {type(score_mod).__name__}")
            _check_callable(score_mod, "score_mod", 5, ArgumentError)
        bias_shape = None if bias is None else tuple(host_array(bias, "bias").shape)
        return cls(q64, k64, v64, Hq // Hkv, scale, mask_mod, dense, bias64, score_mod, bias_shape,
                   sink_logits(sinks, Hq))

    def scores(self, b: int, h: int, score_mod: Optional[Callable] = None):
        """(score before the modifier, masked final score with -inf where disallowed, allowed)."""
        score_mod = score_mod if score_mod is not None else self.score_mod
        Nq, Nkv = self.q.shape[2], self.k.shape[2]
        qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
        s = (self.q[b, h] @ self.k[b, h // self.group].T) * self.scale
        if self.bias is not None:
            s = s + self.bias[b, h]
        pre = s
        if score_mod is not None:
            s = _score_values(_call(score_mod, (s, b, h, qi, ki), "score_mod", ArgumentError), (Nq, Nkv))
        if self.mask_mod is not None:
            allowed = _mask_values(_call(self.mask_mod, (b, h, qi, ki), "mask", MaskError), (Nq, Nkv), "mask")
        elif self.dense is not None:
            allowed = self.dense[b, h]
        else:
            allowed = np.ones((Nq, Nkv), dtype=bool)
        return pre, np.where(allowed, s, -np.inf), allowed
