"""One rule for array indices in expressions (issue 36): each subscript's range is derived by
interval arithmetic (omnicupy.mask.index_bounds); an index that could leave [0, len) of what it
reads is refused when the expression is made, clamps by the user count as bounds."""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import cuda_mask, cuda_score
from omnicupy.errors import ExpressionError
from omnicupy.mask.index_bounds import SIZE_LIMITS, index_range

N = 64
DOC = {"doc": np.ones(N, np.int32)}

REFUSED = [
    pytest.param("doc[q_idx + kv_idx] > 0", {}, "no bound", id="issue-sum-of-positions"),
    pytest.param("doc[q_idx - kv_idx] > 0", {}, "may be negative", id="issue-difference"),
    pytest.param("doc[q_idx + 1] > 0", {"extents": {"doc": "q_idx"}}, "declared extent q_idx", id="issue-plus-one"),
    pytest.param("doc[q_idx + 1] > 0", {}, "below no size", id="plus-one-undeclared"),
    pytest.param("doc[q_idx - 1] > 0", {}, "may be negative", id="minus-one"),
    pytest.param("doc[-q_idx] > 0", {}, "may be negative", id="negation"),
    pytest.param("doc[q_idx * kv_idx] > 0", {}, "no bound", id="product-of-indices"),
    pytest.param("doc[h * 4 + b] > 0", {}, "below no size", id="flattened-without-clamp"),
    pytest.param("doc[(q_idx * 2000000) % 7] > 0", {}, "no bound", id="wraps-before-the-remainder"),
    pytest.param("doc[64] > 0", {}, "reads up to 64", id="literal-past-the-end"),
    pytest.param("doc[q_idx / 0] > 0", {}, "no bound", id="division-by-zero"),
    pytest.param("doc[5u] > 0", {}, "no bound", id="unsigned-literal"),
    pytest.param("doc[(int)1.5f] > 0", {}, "no bound", id="cast-of-a-float"),
    pytest.param("doc[q_idx | 1] > 0", {}, "no bound", id="bitwise-or-of-an-index"),
    pytest.param("doc[doc[q_idx] - 2] > 0", {}, "may be negative", id="array-values-count"),
    pytest.param("doc[min(q_idx, 10)] > 0", {"extents": {"doc": 5}}, "declared extent 5", id="past-declared-count"),
]


@pytest.mark.parametrize("text,kwargs,message", REFUSED)
def test_out_of_range_indices_are_refused_when_made(text, kwargs, message):
    with pytest.raises(ExpressionError, match=message):
        cuda_mask(text, arrays=DOC, **kwargs)


ACCEPTED = [
    pytest.param("doc[min(q_idx + 1, N - 1)] > 0", {"constants": {"N": N}}, ((), N), id="issue-clamped"),
    pytest.param("doc[q_idx] == doc[kv_idx]", {}, (("kv_idx", "q_idx"), 0), id="bare-indices"),
    pytest.param("doc[max(q_idx - 1, 0)] > 0", {}, (("q_idx",), 0), id="clamped-below"),
    pytest.param("doc[q_idx / 64] > 0", {"extents": {"doc": "q_idx"}}, (("q_idx",), 0), id="quotient-declared"),
    pytest.param("doc[q_idx % 64] > 0", {}, ((), 64), id="remainder"),
    pytest.param("doc[q_idx > kv_idx ? 1 : 2] > 0", {}, ((), 3), id="ternary-of-literals"),
    pytest.param("doc[doc[q_idx]] > 0", {}, (("q_idx",), 2), id="nested-by-values"),
    pytest.param("doc[min(h * 4 + min(b, 3), N - 1)] > 0", {"constants": {"N": N}}, ((), N), id="flattened-clamped"),
    pytest.param("doc[(q_idx >> 3) & 15] > 0", {}, ((), 16), id="shift-and-mask"),
    pytest.param("doc[abs(h)] > 0", {}, (("h",), 0), id="abs-of-nonnegative"),
    # Past the array for some sizes only: checked per call against q_len (CudaExpr.check_lengths).
    pytest.param("doc[q_idx % 100] > 0", {}, (("q_idx",), 0), id="remainder-beyond-the-array-is-below-Nq"),
    pytest.param("doc[min(q_idx, N)] > 0", {"constants": {"N": N}}, (("q_idx",), 0), id="clamp-beyond-the-array"),
    pytest.param("doc[max(q_idx, -1)] > 0", {}, (("q_idx",), 0), id="max-with-a-negative"),
]


@pytest.mark.parametrize("text,kwargs,need", ACCEPTED)
def test_bounded_indices_are_accepted_with_their_need(text, kwargs, need):
    expr = cuda_mask(text, arrays=DOC, **kwargs).cuda
    assert expr.array_needs == (("doc", *need),)


def test_score_modifiers_follow_the_same_rule():
    with pytest.raises(ExpressionError, match="may be negative"):
        cuda_score("score + t[h - 1]", arrays={"t": np.ones(4, np.float32)})
    with pytest.raises(ExpressionError, match="not an integer"):
        cuda_score("score + t[(int)score + 0 * t[0] > 0.5f]", arrays={"t": np.ones(4, np.float32)})


@pytest.mark.parametrize("index,low,high", [
    pytest.param("q_idx", 0, SIZE_LIMITS["q_idx"] - 1, id="q_idx"),
    pytest.param("min(q_idx + 1, N - 1)", 1, N - 1, id="clamp"),
    pytest.param("h % 3", 0, 2, id="remainder"),
    pytest.param("b * 2 + 1", 1, 2 * SIZE_LIMITS["b"] - 1, id="affine"),
])
def test_index_range_is_importable_and_exact_on_simple_forms(index, low, high):
    r = index_range(index, constants={"N": N})
    assert (r.low(), r.high()) == (low, high)
