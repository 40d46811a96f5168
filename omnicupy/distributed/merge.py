"""Exact merging of partial attention results through their log-sum-exps, in float32.

Knows: that a partial result over a subset of the keys is ``(o, lse)`` with ``o`` normalized over
that subset, so that over the union ``lse = log(exp(lse_a) + exp(lse_b))`` and ``o = (exp(lse_a -
lse) o_a + exp(lse_b - lse) o_b)``. Does not know where the partials came from. Works on NumPy
and CuPy arrays alike (the array module of the accumulator), on the current stream.

A partial with no allowed key in a row has ``lse = -inf`` and ``o = 0`` there; a row empty in
both stays ``lse = -inf``, ``o = 0``: the max used for stability is replaced by 0 where it is
-inf, so no ``-inf - (-inf)`` and no ``0 / 0`` is ever evaluated.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays


class PartialSum:
    """Accumulates partial results ``(o [B, H, L, D], lse [B, H, L])`` into float32 ``(o, lse)``."""

    def __init__(self) -> None:
        self.out: Any = None
        self.lse: Any = None

    def add(self, o: Any, lse: Any) -> None:
        xp = arrays.array_namespace(lse)
        if self.out is None:
            self.out = o.astype(np.float32, copy=True)
            self.lse = lse.astype(np.float32, copy=True)
            return
        merge_into(self.out, self.lse, o, lse, xp)

    def result(self, dtype: Any, shape: tuple, lse_shape: tuple, xp: Any) -> tuple[Any, Any]:
        """(out in ``dtype``, lse float32); zeros and -inf when nothing was added."""
        if self.out is None:
            return xp.zeros(shape, dtype=dtype), xp.full(lse_shape, -np.inf, dtype=np.float32)
        return self.out.astype(dtype), self.lse


def merge_into(out: Any, lse: Any, o_part: Any, lse_part: Any, xp: Any) -> None:
    """``(out, lse) <- merge((out, lse), (o_part, lse_part))`` in place; ``out``/``lse`` float32."""
    part = lse_part.astype(np.float32, copy=False)
    top = xp.maximum(lse, part)
    top = xp.where(top == -np.inf, np.float32(0), top)  # rows empty in both: weights exp(-inf) = 0
    w_acc = xp.exp(lse - top)
    w_part = xp.exp(part - top)
    total = w_acc + w_part
    empty = total == 0
    inv = 1 / xp.where(empty, np.float32(1), total)
    lse[...] = xp.where(empty, np.float32(-np.inf), top + xp.log(xp.where(empty, np.float32(1), total)))
    out *= (w_acc * inv)[..., None]
    # A float32 copy first: arithmetic between bfloat16 and float32 arrays is not promoted alike everywhere.
    scaled = o_part.astype(np.float32, copy=True)
    scaled *= (w_part * inv)[..., None]
    out += scaled


__all__ = ["PartialSum", "merge_into"]
