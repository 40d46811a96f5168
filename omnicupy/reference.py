"""float64 NumPy reference attention, computed from the element-level mask (never block metadata).

    out[b,h,i] = sum_j softmax_j(scale * q[b,h,i]·k[b,hk,j] + bias | allowed(b,h,i,j)) v[b,hk,j]

Rows with no allowed key give 0 and LSE -inf. This is the oracle every kernel test compares with.
``attention_backward`` gives the gradients of the same function (bias a constant input), from the
same element-level mask.

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

from . import arrays
from .checks import check_int
from .errors import ArgumentError, MaskError, OmnicupyError
from .ops.inputs import check_bool, check_scale

MaskLike = Union[np.ndarray, Callable, None]

_CALL_CONTRACT = ("a mask_mod is called as f(b, h, q_idx, kv_idx) on broadcast NumPy index arrays (here b, h "
                  "ints, q_idx [Nq, 1], kv_idx [1, Nkv]) and returns booleans of their broadcast shape")


def _is_array(x: Any) -> bool:
    return arrays.is_numpy(x) or arrays.is_cupy(x) or hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")


def _host_array(x: Any, name: str, error: type = ArgumentError) -> np.ndarray:
    if x is None:
        raise error(f"{name} is required")
    if not _is_array(x):
        raise error(f"{name} must be a NumPy/CuPy array or a DLPack / CUDA-array-interface object, "
                    f"got {type(x).__name__}")
    try:
        return arrays.to_numpy(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as exc:
        raise error(f"{name} could not be read as an array: {exc}") from None


def _is_real(dtype: np.dtype) -> bool:
    return dtype.kind in "fiu" or dtype == arrays.BFLOAT16


def _as_float64(x: Any, name: str) -> np.ndarray:
    x = _host_array(x, name)
    if not _is_real(np.dtype(x.dtype)):
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
        if not _is_array(result):
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
    values = arrays.to_numpy(result) if _is_array(result) else np.asarray(result)
    if not _is_real(np.dtype(values.dtype)):
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
    values = _host_array(mask, "mask", MaskError)
    if values.dtype != np.bool_:
        raise MaskError(f"mask must be a boolean array (True = allowed), got dtype {values.dtype}")
    try:
        return np.broadcast_to(values, shape)
    except ValueError:
        raise MaskError(f"mask shape {values.shape} does not broadcast to [B, Hq, Nq, Nkv] = {shape}") from None


def _bias(bias: Any, B: int, Hq: int, Nq: int, Nkv: int) -> np.ndarray:
    """A vector [B|1, H|1, Nkv] or matrix [B|1, H|1, Nq, Nkv] bias, broadcast to [B, Hq, Nq, Nkv]."""
    values = _host_array(bias, "bias")
    if not _is_real(np.dtype(values.dtype)):
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


class _Prepared:
    """Checked float64 inputs, the dense mask or mask_mod, the bias, and the scores of one (b, h)."""

    def __init__(self, q64, k64, v64, group, scale, mask_mod, dense, bias64, score_mod):
        self.q, self.k, self.v, self.group, self.scale = q64, k64, v64, group, scale
        self.mask_mod, self.dense, self.bias, self.score_mod = mask_mod, dense, bias64, score_mod

    @classmethod
    def make(cls, q, k, v, mask, scale, bias, score_mod) -> "_Prepared":
        """Checks the arguments as ``attention()`` does (ArgumentError / MaskError naming them)."""
        q64, k64, v64 = _as_float64(q, "q"), _as_float64(k, "k"), _as_float64(v, "v")
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
        if callable(mask) and not _is_array(mask):
            _check_callable(mask, "mask", 4, MaskError)
            mask_mod = mask
        elif mask is not None:
            if isinstance(mask, str) or not _is_array(mask):
                hint = " (pass bm.mask_mod or bm.to_dense())" if hasattr(mask, "to_dense") else ""
                raise MaskError(f"mask must be a boolean array broadcastable to [B, Hq, Nq, Nkv] or a "
                                f"mask_mod(b, h, q_idx, kv_idx) callable, got {type(mask).__name__} {mask!r:.60}{hint}")
            dense = _dense_mask(mask, (B, Hq, Nq, Nkv))
        bias64 = None if bias is None else _bias(bias, B, Hq, Nq, Nkv)
        if score_mod is not None:
            if not callable(score_mod):
                raise ArgumentError(f"score_mod must be callable (its NumPy form), got {type(score_mod).__name__}")
            _check_callable(score_mod, "score_mod", 5, ArgumentError)
        return cls(q64, k64, v64, Hq // Hkv, scale, mask_mod, dense, bias64, score_mod)

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


def _softmax(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax of masked scores (-inf where disallowed) and its natural-log LSE; a row with no
    allowed key gives probabilities 0 and LSE -inf."""
    row_max = s.max(axis=1, keepdims=True)
    has_any = np.isfinite(row_max)
    shift = np.where(has_any, row_max, 0.0)
    p = np.exp(s - shift)
    denom = p.sum(axis=1, keepdims=True)
    safe = np.where(denom > 0, denom, 1.0)
    lse = np.where(has_any[:, 0], np.log(safe[:, 0]) + shift[:, 0], -np.inf)
    return np.where(has_any, p / safe, 0.0), lse


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
    prep = _Prepared.make(q, k, v, mask, scale, bias, score_mod)
    return_lse = check_bool(return_lse, "return_lse")
    q64, v64, group = prep.q, prep.v, prep.group
    B, Hq, Nq, _ = q64.shape
    out = np.zeros((B, Hq, Nq, v64.shape[3]), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            _, s, _ = prep.scores(b, h, score_mod)
            p, lse[b, h] = _softmax(s)
            out[b, h] = p @ v64[b, hk]
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
    prep = _Prepared.make(q, k, v, mask, scale, bias, score_mod)
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
            p, _ = _softmax(s)
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
    a = _host_array(actual, "actual")
    e = _host_array(expected, "expected")
    if a.shape != e.shape:
        raise ArgumentError(f"relative_error: actual {a.shape} and expected {e.shape} must have the same shape")
    if not (_is_real(np.dtype(a.dtype)) and _is_real(np.dtype(e.dtype))):
        raise ArgumentError(f"relative_error compares real arrays, got {a.dtype} and {e.dtype}")
    a, expected = a.astype(np.float64), e.astype(np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    denom = np.linalg.norm(expected)
    diff = np.linalg.norm(a - expected)
    return float(diff / denom) if denom > 0 else float(diff)


# ------------------------------------------------------------------------------- KV caches
def _score_mod_of_sequence(score_mod: Callable, b: int, q_offset: int) -> Callable:
    """``score_mod`` as ``attention`` calls it for one sequence (batch index 0): the real batch
    index b, query indices shifted by ``q_offset``."""
    def mod(s, _b, h, qi, kj):
        return score_mod(s, b, h, qi + q_offset, kj)

    return mod


def _cache_attention(q64: np.ndarray, keys: list, values: list, lens: np.ndarray, *, causal: bool, bottom_right: bool,
                     window: Optional[int], scale: Optional[float], score_mod: Optional[Callable], mask: MaskLike,
                     q_abs: bool):
    """Sequence by sequence: b's keys ``keys[b]`` ([Hkv, L_b, D]) against its queries, with the rule
    ``j <= pos`` (causal) and ``j > pos - window`` at ``pos = i + (L_b - Nq if bottom_right else 0)``,
    and ``mask`` (dense [B|1, H|1, Nq, >= L_b] or mask_mod(b, h, i, j)) on top."""
    B, Hq, Nq, D = q64.shape
    out = np.zeros((B, Hq, Nq, D), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    dense = None if mask is None or callable(mask) else np.asarray(arrays.to_numpy(mask), dtype=bool)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        shift = L - Nq if bottom_right else 0
        i = np.arange(Nq)[:, None]
        j = np.arange(L)[None, :]
        pos = i + shift
        allowed = np.ones((Hq, Nq, L), dtype=bool)
        if causal:
            allowed &= j <= pos
        if window:
            allowed &= j > pos - window
        if callable(mask):
            allowed &= np.broadcast_to(np.asarray(mask(b, np.arange(Hq)[:, None, None], i[None], j[None]), dtype=bool),
                                       allowed.shape)
        elif dense is not None:
            allowed &= np.broadcast_to(dense[min(b, dense.shape[0] - 1)], (Hq, Nq, dense.shape[-1]))[..., :L]
        mod = None if score_mod is None else _score_mod_of_sequence(score_mod, b, shift if q_abs else 0)
        o, l = attention(q64[b:b + 1], keys[b][None], values[b][None], allowed[None], scale=scale, score_mod=mod,
                         return_lse=True)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def decode_attention(q: Any, k: Any, v: Any, kv_lens: Any = None, *, causal: Any = False, window: Optional[int] = None,
                     scale: Optional[float] = None, score_mod: Optional[Callable] = None, mask: MaskLike = None,
                     return_lse: bool = False):
    """What ``omnicupy.attention(q, k, v, ..., kv_lens=...)`` computes, in float64.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``; sequence b holds its first ``kv_lens[b]`` keys
    (all Nkv when None). ``causal``: False, True/'bottom_right' (query i sits at ``kv_lens[b] - Nq + i``
    and sees keys up to there) or 'top_left' (``kv_idx <= q_idx``, no shift). ``window`` W keeps the
    keys ``j > pos - W``. ``mask`` (dense or mask_mod over (b, h, q_idx, kv_idx)) applies on top.
    score_mod sees the row index as q_idx. Returns out (float64) or (out, lse)."""
    q64, k64, v64 = _as_float64(q, "q"), _as_float64(k, "k"), _as_float64(v, "v")
    B, Nkv = q64.shape[0], k64.shape[2]
    lens = np.full(B, Nkv) if kv_lens is None else np.asarray(arrays.to_numpy(kv_lens), dtype=np.int64)
    if np.any(lens < 0) or np.any(lens > Nkv):
        raise ArgumentError(f"kv_lens must lie in [0, {Nkv}]")
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ArgumentError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    keys = [k64[b, :, :int(lens[b])] for b in range(B)]
    values = [v64[b, :, :int(lens[b])] for b in range(B)]
    out, lse = _cache_attention(q64, keys, values, lens, causal=causal is not False,
                                bottom_right=causal in (True, "bottom_right"), window=window, scale=scale,
                                score_mod=score_mod, mask=mask, q_abs=False)
    return (out, lse) if return_lse else out


def paged_attention(q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lens: Any, *, causal: bool = True,
                    window: Optional[int] = None, scale: Optional[float] = None, score_mod: Optional[Callable] = None,
                    return_lse: bool = False, layout: str = "NHD"):
    """What ``omnicupy.paged_attention`` computes, in float64: each sequence's keys gathered from its
    pages (``page_table[b, j // page_size]``, slot ``j % page_size``), its Nq queries at positions
    ``kv_lens[b] - Nq + i`` (what score_mod sees as q_idx), causal and window relative to them."""
    q64 = _as_float64(q, "q")
    kp, vp = (arrays.to_numpy(x).astype(np.float64) for x in (k_pages, v_pages))
    if layout == "HND":  # [P, Hkv, ps, D] -> [P, ps, Hkv, D]
        kp, vp = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
    elif layout != "NHD":
        raise ArgumentError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    table = np.asarray(arrays.to_numpy(page_table), dtype=np.int64)
    lens = np.asarray(arrays.to_numpy(kv_lens), dtype=np.int64)
    page_size = kp.shape[1]
    keys, values = [], []
    for b in range(q64.shape[0]):
        L = int(lens[b])
        pages = table[b, :-(-L // page_size)]
        if np.any(pages < 0) or np.any(pages >= kp.shape[0]):
            raise ArgumentError(f"sequence {b} uses pages outside the pool")
        # [n, ps, Hkv, D] -> [Hkv, n * ps, D], first L keys
        keys.append(kp[pages].reshape(-1, kp.shape[2], kp.shape[3]).transpose(1, 0, 2)[:, :L])
        values.append(vp[pages].reshape(-1, vp.shape[2], vp.shape[3]).transpose(1, 0, 2)[:, :L])
    out, lse = _cache_attention(q64, keys, values, lens, causal=bool(causal), bottom_right=True, window=window,
                                scale=scale, score_mod=score_mod, mask=None, q_abs=True)
    return (out, lse) if return_lse else out


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
                     scale: Optional[float] = None, return_lse: bool = False):
    """What ``omnicupy.varlen_attention`` computes, in float64, sequence by sequence: q ``[total_q, Hq, D]``,
    k/v ``[total_k, Hkv, D]``; causal is bottom-right inside each sequence. Returns out
    ``[total_q, Hq, D]`` or (out, lse) with lse ``[Hq, total_q]``."""
    q64, k64, v64 = (arrays.to_numpy(x).astype(np.float64) for x in (q, k, v))
    cq = np.asarray(arrays.to_numpy(cu_seqlens_q), dtype=np.int64)
    ck = np.asarray(arrays.to_numpy(cu_seqlens_k), dtype=np.int64)
    out = np.zeros(q64.shape, dtype=np.float64)
    lse = np.full((q64.shape[1], q64.shape[0]), -np.inf, dtype=np.float64)
    for s in range(len(cq) - 1):
        lq, lk = int(cq[s + 1] - cq[s]), int(ck[s + 1] - ck[s])
        if lq == 0 or lk == 0:
            continue
        qs = q64[cq[s]:cq[s + 1]].transpose(1, 0, 2)[None]
        ks = k64[ck[s]:ck[s + 1]].transpose(1, 0, 2)[None]
        vs = v64[ck[s]:ck[s + 1]].transpose(1, 0, 2)[None]
        allowed = None
        if causal:
            allowed = np.arange(lq)[:, None] + (lk - lq) >= np.arange(lk)[None, :]
        o, l = attention(qs, ks, vs, allowed, scale=scale, return_lse=True)
        out[cq[s]:cq[s + 1]] = o[0].transpose(1, 0, 2)
        lse[:, cq[s]:cq[s + 1]] = l[0]
    return (out, lse) if return_lse else out


__all__ = ["attention", "attention_backward", "dense_mask_from_mod", "relative_error", "decode_attention",
           "paged_attention", "varlen_attention"]
