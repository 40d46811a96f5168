"""Host arrays that cannot change: NumPy arrays backed by an immutable ``bytes`` buffer.

NumPy lets anyone set ``flags.writeable = True`` again on a read-only array that owns its memory
(or on a view whose base does); it refuses only when the memory itself is not writable. So a
frozen array here is a view, with the same shape and strides, of a ``bytes`` copy of the memory it
views: zero strides and overlapping windows stay as compact as they were. CuPy has no read-only
arrays: callers hand out copies of device arrays instead. Knows NumPy's buffer rules only.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def is_frozen(a: np.ndarray) -> bool:
    """``a`` is read-only and its memory belongs to an immutable ``bytes`` object."""
    root = a
    while isinstance(root.base, np.ndarray):
        if root.flags.writeable:
            return False
        root = root.base
    return not a.flags.writeable and isinstance(root.base, bytes)


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or np.byte_bounds  # NumPy 2 / 1
    low, high = bounds(a)
    return int(low), int(high)


def freeze(a: Any) -> Any:
    """``a`` (NumPy) as an array that no one can make writable; other values are returned as they are.
    Copies exactly the bytes ``a`` can reach (``byte_bounds``), never what a broadcast or an
    overlapping window would span if written out: a causal mask's rows at 2**20 positions stay
    a few hundred KB."""
    if not isinstance(a, np.ndarray) or is_frozen(a):
        return a
    if a.size == 0:
        return np.ndarray(a.shape, a.dtype, buffer=b"", strides=a.strides if a.ndim else None)
    low, high = _byte_bounds(a)
    memory = ctypes.string_at(low, high - low)  # a copy of the reachable bytes, in memory order
    return np.ndarray(a.shape, a.dtype, buffer=memory, offset=a.__array_interface__["data"][0] - low,
                      strides=a.strides)


__all__ = ["freeze", "is_frozen"]
