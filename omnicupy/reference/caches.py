"""float64 references of the KV-cache calls: contiguous decode with per-sequence lengths, paged caches
and packed (varlen) sequences, each computed sequence by sequence through ``dense.attention``.

Knows how each call lays out its keys and positions; the softmax lives in ``dense``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import ArgumentError
from .dense import attention
from .inputs import MaskLike, as_float64

def _score_mod_of_sequence(score_mod: Callable, b: int, q_offset: int) -> Callable:
    """``score_mod`` as ``attention`` calls it for one sequence (batch index 0): the real batch
    index b, query indices shifted by ``q_offset``."""
    def mod(s, _b, h, qi, kj):
        return score_mod(s, b, h, qi + q_offset, kj)

    return mod


def _cache_attention(q64: np.ndarray, keys: list, values: list, lens: np.ndarray, *, causal: bool, bottom_right: bool,
                     window: Optional[int], scale: Optional[float], score_mod: Optional[Callable], mask: MaskLike,
                     q_abs: bool, sinks: Any = None):
    """Sequence by sequence: b's keys ``keys[b]`` ([Hkv, L_b, D]) against its queries, with the rule
    ``j <= pos`` (causal) and ``j > pos - window`` at ``pos = i + (L_b - Nq if bottom_right else 0)``,
    and ``mask`` (dense [B|1, H|1, Nq, >= L_b] or mask_mod(b, h, i, j)) on top."""
    B, Hq, Nq, D = q64.shape
    out = np.zeros((B, Hq, Nq, D), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    if sinks is not None:  # a sequence with no keys still has its sink: output 0, LSE = sink
        lse[:] = np.asarray(arrays.to_numpy(sinks), dtype=np.float64)[None, :, None]
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
                         return_lse=True, sinks=sinks)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def decode_attention(q: Any, k: Any, v: Any, kv_lens: Any = None, *, causal: Any = False, window: Optional[int] = None,
                     scale: Optional[float] = None, score_mod: Optional[Callable] = None, mask: MaskLike = None,
                     return_lse: bool = False, sinks: Any = None):
    """What ``omnicupy.attention(q, k, v, ..., kv_lens=...)`` computes, in float64.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``; sequence b holds its first ``kv_lens[b]`` keys
    (all Nkv when None). ``causal``: False, True/'bottom_right' (query i sits at ``kv_lens[b] - Nq + i``
    and sees keys up to there) or 'top_left' (``kv_idx <= q_idx``, no shift). ``window`` W keeps the
    keys ``j > pos - W``. ``mask`` (dense or mask_mod over (b, h, q_idx, kv_idx)) applies on top.
    score_mod sees the row index as q_idx. ``sinks`` ``[Hq]`` as in ``dense.attention``. Returns out
    (float64) or (out, lse)."""
    q64, k64, v64 = as_float64(q, "q"), as_float64(k, "k"), as_float64(v, "v")
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
                                score_mod=score_mod, mask=mask, q_abs=False, sinks=sinks)
    return (out, lse) if return_lse else out


def paged_attention(q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lens: Any, *, causal: bool = True,
                    window: Optional[int] = None, scale: Optional[float] = None, score_mod: Optional[Callable] = None,
                    return_lse: bool = False, layout: str = "NHD", sinks: Any = None):
    """What ``omnicupy.paged_attention`` computes, in float64: each sequence's keys gathered from its
    pages (``page_table[b, j // page_size]``, slot ``j % page_size``), its Nq queries at positions
    ``kv_lens[b] - Nq + i`` (what score_mod sees as q_idx), causal and window relative to them."""
    q64 = as_float64(q, "q")
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
                                scale=scale, score_mod=score_mod, mask=None, q_abs=True, sinks=sinks)
    return (out, lse) if return_lse else out


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
                     scale: Optional[float] = None, return_lse: bool = False, sinks: Any = None):
    """What ``omnicupy.varlen_attention`` computes, in float64, sequence by sequence: q ``[total_q, Hq, D]``,
    k/v ``[total_k, Hkv, D]``; causal is bottom-right inside each sequence. Returns out
    ``[total_q, Hq, D]`` or (out, lse) with lse ``[Hq, total_q]``."""
    q64, k64, v64 = (arrays.to_numpy(x).astype(np.float64) for x in (q, k, v))
    cq = np.asarray(arrays.to_numpy(cu_seqlens_q), dtype=np.int64)
    ck = np.asarray(arrays.to_numpy(cu_seqlens_k), dtype=np.int64)
    out = np.zeros(q64.shape, dtype=np.float64)
    lse = np.full((q64.shape[1], q64.shape[0]), -np.inf, dtype=np.float64)
    if sinks is not None:
        lse[:] = np.asarray(arrays.to_numpy(sinks), dtype=np.float64)[:, None]
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
        o, l = attention(qs, ks, vs, allowed, scale=scale, return_lse=True, sinks=sinks)
        out[cq[s]:cq[s + 1]] = o[0].transpose(1, 0, 2)
        lse[:, cq[s]:cq[s + 1]] = l[0]
    return (out, lse) if return_lse else out
