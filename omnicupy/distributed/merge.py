"""Exact merging of partial attention results through their log-sum-exps, in float32.

Knows: that a partial result over a subset of the keys is ``(o, lse)`` with ``o`` normalized over
that subset, so that over the union ``lse = log(exp(lse_a) + exp(lse_b))`` and ``o = exp(lse_a -
lse) o_a + exp(lse_b - lse) o_b``. Does not know where the partials came from. Works on NumPy and
CuPy arrays alike (``xp``, the accumulator's module), on the current stream.

A partial with no allowed key in a row has ``lse = -inf`` and ``o = 0`` there; a row empty in
both stays ``lse = -inf``, ``o = 0``: the max used for stability is replaced by 0 where it is
-inf, so no ``-inf - (-inf)`` and no ``0 / 0`` is ever evaluated.

On CuPy the output update is one fused elementwise kernel (read the sum and the part, write the
sum: one pass instead of about eight); if CuPy cannot build it (a dtype it does not know, say),
the same arithmetic runs as array expressions, with a warning, from then on.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import arrays

#: out (float32) <- out * w_acc / (w_acc + w_part) + o_part * w_part / (w_acc + w_part); rows whose
#: LSEs are both -inf keep out (0). ``top`` is never +inf: LSEs are finite or -inf.
_FUSED_SOURCE = """
    float top = fmaxf(lse_acc, lse_part);
    if (!isinf(top)) {
        float w_acc = expf(lse_acc - top);
        float w_part = expf(lse_part - top);
        float inv = 1.0f / (w_acc + w_part);
        out = out * (w_acc * inv) + static_cast<float>(o_part) * (w_part * inv);
    }
"""
_fused = {"kernel": None, "failed": False}


def _fused_kernel():
    if _fused["kernel"] is None:
        cp = arrays.cupy_module()
        _fused["kernel"] = cp.ElementwiseKernel("T o_part, float32 lse_part, float32 lse_acc", "float32 out",
                                                _FUSED_SOURCE, "omnicupy_distributed_merge")
    return _fused["kernel"]


def _merge_out_fused(out: Any, lse: Any, o_part: Any, lse_part: Any) -> bool:
    """The output update as one kernel; False when the kernel cannot be built or run here."""
    if _fused["failed"]:
        return False
    try:
        _fused_kernel()(o_part, lse_part[..., None], lse[..., None], out)
    except Exception as exc:  # noqa: BLE001 - any build failure: the array expressions below are exact too
        _fused["failed"] = True
        warnings.warn(f"omnicupy.distributed: the fused merge kernel is unavailable ({exc}); merging with array "
                      "expressions instead (slower, same result)", RuntimeWarning, stacklevel=3)
        return False
    return True


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
    """``(out, lse) <- merge((out, lse), (o_part, lse_part))`` in place; ``out``/``lse`` float32
    (views are fine), ``o_part`` any float dtype."""
    part = lse_part.astype(np.float32, copy=False)
    fused = xp is not np and arrays.is_cupy(out) and _merge_out_fused(out, lse, o_part, part)
    top = xp.maximum(lse, part)
    top = xp.where(top == -np.inf, np.float32(0), top)  # rows empty in both: weights exp(-inf) = 0
    w_acc = xp.exp(lse - top)
    w_part = xp.exp(part - top)
    total = w_acc + w_part
    empty = total == 0
    if not fused:
        inv = 1 / xp.where(empty, np.float32(1), total)
        out *= (w_acc * inv)[..., None]
        # A float32 copy first: arithmetic between bfloat16 and float32 arrays is not promoted alike everywhere.
        scaled = o_part.astype(np.float32, copy=True)
        scaled *= (w_part * inv)[..., None]
        out += scaled
    # The LSE last: the output's weights above read the old one.
    lse[...] = xp.where(empty, np.float32(-np.inf), top + xp.log(xp.where(empty, np.float32(1), total)))


def add_sink(out: Any, lse: Any, sinks: Any, xp: Any) -> None:
    """Join each head's sink logit to the normalizer of every row, once, in place: ``lse <-
    log(exp(lse) + exp(sink_h))`` and ``out <- out * exp(lse_old - lse)`` (a sink has no value
    row). Partials are merged without sinks and the owner of a row calls this once, so a sink is
    never counted once per rank. ``out`` [B, H, L, D] (any float dtype), ``lse`` float32 [B, H, L],
    ``sinks`` float32 [H]. A row with no key keeps output 0 and gets LSE = its sink."""
    sink = xp.asarray(sinks, dtype=np.float32)[None, :, None]
    new = xp.logaddexp(lse, sink)
    weight = xp.exp(lse - new)  # exp(-inf) = 0 for empty rows; new is finite wherever a sink is
    out[...] = (out.astype(np.float32) * weight[..., None]).astype(out.dtype)
    lse[...] = new


def sink_gradient(dout: Any, out: Any, lse: Any, sinks: Any, xp: Any) -> Any:
    """This rank's part of d loss / d sinks, float32 [H]: ``-sum_{b, i} exp(sink_h - lse) *
    rowsum(dO * O)`` over its rows (``lse`` includes the sink); ranks sum their parts."""
    sink = xp.asarray(sinks, dtype=np.float32)[None, :, None]
    delta = (dout.astype(np.float32) * out.astype(np.float32)).sum(axis=-1)
    p_sink = xp.exp(sink - lse)
    return -(p_sink * delta).sum(axis=(0, 2)).astype(np.float32)


__all__ = ["PartialSum", "merge_into", "add_sink", "sink_gradient"]
