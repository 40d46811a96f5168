"""Host arrays that cannot change: NumPy arrays backed by an immutable ``bytes`` buffer.

NumPy lets anyone set ``flags.writeable = True`` again on a read-only array that owns its memory
(or on a view whose base does); it refuses only when the memory itself is not writable. So a
frozen array here is a view, with the same shape and strides, of a ``bytes`` copy of the memory it
views: zero strides and overlapping windows stay as compact as they were. CuPy has no read-only
arrays: callers hand out copies of device arrays instead. Knows NumPy's buffer rules only.
"""
from __future__ import annotations

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


def freeze(a: Any) -> Any:
    """``a`` (NumPy) as an array that no one can make writable; other values are returned as they are.
    Copies the memory ``a`` views (its root array's), never the broadcast or window ``a`` spans."""
    if not isinstance(a, np.ndarray) or is_frozen(a):
        return a
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not (root.flags.c_contiguous or root.flags.f_contiguous) or root.nbytes > 4 * max(a.nbytes, 1 << 20):
        # A view into a large or strided buffer: copy only what ``a`` shows.
        a = np.array(a, copy=True)
        root = a
    memory = root.tobytes(order="A")  # the root's own memory order, byte for byte
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return np.ndarray(a.shape, a.dtype, buffer=memory, offset=offset, strides=a.strides)


__all__ = ["freeze", "is_frozen"]
