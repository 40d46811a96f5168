"""``varlen_attention()``: ragged batches packed without padding (FlashAttention-2's varlen form).

q ``[total_q, Hq, D]`` and k/v ``[total_k, Hkv, D]`` hold the sequences back to back; sequence s owns
rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k/v.
The packed tensors are viewed (no copy) as one batch ``[1, H, total, D]`` and run through the
forward kernel under a document mask: a query sees the keys of its own sequence, and with
``causal`` only those up to its bottom-right diagonal (``i + len_k - len_q >= j`` inside the
sequence; the same as top-left when a sequence's q and k lengths agree).

When q and k share their sequence lengths (self-attention), the mask is ``omnicupy.masks.document``
of the sequence ids; otherwise it is the same rule written as one interval of keys per query. Both
carry their structure, so building the BlockMask evaluates only the blocks that cut a sequence
boundary; it is cached per (cu_seqlens, causal).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from .. import arrays
from ..errors import ArgumentError
from ..mask import BlockMask, zoo
from ..mask.mask_mod import LookupTable, MaskMod
from .arg_checks import check_outputs
from .inputs import as_array, dtype_name

#: BlockMasks kept per (cu_seqlens_q, cu_seqlens_k, causal, block sizes).
MASK_CACHE_SIZE = 32


def check_cu_seqlens(cu: Any, total: int, name: str) -> np.ndarray:
    """A host int64 copy of cumulative sequence starts: 1-D, starting at 0, non-decreasing, ending
    at ``total``. (Device arrays are copied to the host once: the mask is built from them.)"""
    c = arrays.to_numpy(as_array(cu, name))
    if c.ndim != 1 or c.shape[0] < 2:
        raise ArgumentError(f"{name} must be a 1-D integer array [num_seqs + 1], got shape {tuple(c.shape)}")
    if np.dtype(c.dtype).kind not in "iu":
        raise ArgumentError(f"{name} must be an integer array (int32), got dtype {c.dtype}")
    c = c.astype(np.int64)
    if c[0] != 0 or c[-1] != total or np.any(np.diff(c) < 0):
        raise ArgumentError(f"{name} must start at 0, never decrease and end at {total} (the packed length); "
                            f"got {c[:4].tolist()}...{c[-2:].tolist()}")
    return c


def _packed(x: Any, name: str):
    a = as_array(x, name)
    if a.ndim != 3:
        raise ArgumentError(f"{name} must be 3-D [total, H, D] (packed sequences), got shape {tuple(a.shape)}")
    dtype_name(a, name)
    return a


def sequence_ids(cu: np.ndarray) -> np.ndarray:
    """Position -> its sequence (int32), from cumulative starts."""
    return np.repeat(np.arange(len(cu) - 1, dtype=np.int32), np.diff(cu))


def ragged_mask(cu_q: np.ndarray, cu_k: np.ndarray, causal: bool) -> MaskMod:
    """The varlen rule as a mask_mod over packed positions (module docstring)."""
    if np.array_equal(cu_q, cu_k):
        return zoo.document(sequence_ids(cu_q), causal=causal)
    seq = sequence_ids(cu_q)
    lo = cu_k[:-1][seq]
    hi = cu_k[1:][seq]
    if causal:  # q position p of sequence s: its row i = p - cu_q[s] sees keys up to i + len_k - len_q
        hi = np.minimum(hi, np.arange(len(seq)) + (cu_k[1:] - cu_q[1:])[seq] + 1)
    hi = np.maximum(hi, lo)
    lo_t, hi_t = LookupTable(lo.astype(np.int64)), LookupTable(hi.astype(np.int64))

    def varlen(b, h, q_idx, kv_idx):
        """lo[q_idx] <= kv_idx < hi[q_idx] (the query's sequence, up to its diagonal when causal)"""
        return (kv_idx >= lo_t.lookup(b, q_idx)) & (kv_idx < hi_t.lookup(b, q_idx))

    return MaskMod(varlen, f"varlen_{'causal_' if causal else ''}{len(cu_q) - 1}seqs",
                   bounds=lambda b, h, q: (lo_t.lookup(b, q), hi_t.lookup(b, q)), length=max(len(seq), int(cu_k[-1])))


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def _cached_mask(cu_q: bytes, cu_k: bytes, causal: bool, q_len: int, kv_len: int) -> BlockMask:
    q_starts, k_starts = np.frombuffer(cu_q, dtype=np.int64), np.frombuffer(cu_k, dtype=np.int64)
    mod = ragged_mask(q_starts, k_starts, causal)
    return BlockMask.from_mask_mod(mod, None, None, q_len, kv_len)


def varlen_mask(cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int, causal: bool) -> BlockMask:
    """The BlockMask varlen_attention runs under (cached)."""
    cu_q = check_cu_seqlens(cu_seqlens_q, total_q, "cu_seqlens_q")
    cu_k = check_cu_seqlens(cu_seqlens_k, total_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ArgumentError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                            f"{len(cu_q) - 1} and {len(cu_k) - 1}")
    return _cached_mask(cu_q.tobytes(), cu_k.tobytes(), bool(causal), total_q, total_k)


def _bhnd(x: Any):
    """[total, H, D] -> a [1, H, total, D] view (no copy)."""
    return x.transpose(1, 0, 2)[None]


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
                     scale: Optional[float] = None, score_mod: Any = None, return_lse: bool = False, out: Any = None):
    """Attention over packed ragged sequences (module docstring): q ``[total_q, Hq, D]``, k/v
    ``[total_k, Hkv, D]``, ``cu_seqlens_q``/``cu_seqlens_k`` int ``[num_seqs + 1]``.

    ``causal=True`` is bottom-right inside each sequence (FlashAttention-2's varlen convention).
    ``score_mod`` sees packed positions as q_idx and kv_idx. Returns out ``[total_q, Hq, D]``, or
    ``(out, lse)`` with lse float32 ``[Hq, total_q]``; a query whose sequence has no key gets zeros
    and LSE -inf. NumPy q gives NumPy results, anything else CuPy."""
    from .forward import attention

    qa, ka, va = _packed(q, "q"), _packed(k, "k"), _packed(v, "v")
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentError(f"causal must be True or False, got {causal!r}")
    total_q, total_k = int(qa.shape[0]), int(ka.shape[0])
    if va.shape != ka.shape:
        raise ArgumentError(f"k and v must have the same shape, got {tuple(ka.shape)} and {tuple(va.shape)}")
    if out is not None:
        out = as_array(out, "out")
        if tuple(out.shape) != tuple(qa.shape) or np.dtype(out.dtype) != np.dtype(qa.dtype):
            raise ArgumentError(f"out must have shape {tuple(qa.shape)} and dtype {qa.dtype}, "
                                f"got {tuple(out.shape)} {out.dtype}")
        check_outputs({"out": out}, {"q": qa, "k": ka, "v": va})
    if total_q == 0 or total_k == 0:
        return _empty_result(qa, cu_seqlens_q, cu_seqlens_k, total_q, total_k, return_lse, out)
    bm = varlen_mask(cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal)
    result = attention(_bhnd(qa), _bhnd(ka), _bhnd(va), bm, scale=scale, score_mod=score_mod,
                       return_lse=return_lse, out=None if out is None else _bhnd(out))
    o, lse = result if return_lse else (result, None)
    o = out if out is not None else o[0].transpose(1, 0, 2)
    return (o, lse[0]) if return_lse else o


def _empty_result(qa, cu_q, cu_k, total_q, total_k, return_lse, out):
    """No query or no key at all: nothing to launch; the rows (if any) are zeros with LSE -inf."""
    check_cu_seqlens(cu_q, total_q, "cu_seqlens_q")
    check_cu_seqlens(cu_k, total_k, "cu_seqlens_k")
    xp = arrays.array_namespace(qa) if not arrays.is_numpy(qa) else np
    o = out if out is not None else xp.zeros(qa.shape, dtype=qa.dtype)
    o[...] = 0
    lse = xp.full((qa.shape[1], total_q), -np.inf, dtype=np.float32)
    return (o, lse) if return_lse else o


__all__ = ["varlen_attention", "varlen_mask", "ragged_mask", "sequence_ids", "check_cu_seqlens"]
