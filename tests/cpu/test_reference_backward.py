"""reference.attention_backward against central finite differences of reference.attention.

The loss is ``sum(attention(q, k, v) * dout)``; its gradient with respect to every element of q, k
and v is estimated by central differences (float64, step 1e-6) on tiny shapes, for every kind of
mask (dense masks, every built-in mask_mod, empty rows), GQA/MQA, a bias, and the score modifiers
with their derivatives (softcap, ALiBi, a user cuda_score with numpy_grad).
"""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import reference, score_mods
from omnicupy.errors import ArgumentError

from mask_cases import MASK_CASES

STEP = 1e-6


def numeric_grads(dout, q, k, v, mask, **kw):
    """Central differences of sum(attention * dout) with respect to q, k and v."""
    def loss(qq, kk, vv):
        return float(np.sum(reference.attention(qq, kk, vv, mask, **kw) * dout))

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + STEP
            plus = loss(*args)
            x[idx] = saved - STEP
            minus = loss(*args)
            x[idx] = saved
            g[idx] = (plus - minus) / (2 * STEP)
        grads.append(g)
    return grads


def check(seed, B, Hq, Hkv, Nq, Nkv, D, mask, **kw):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D))
    k = rng.standard_normal((B, Hkv, Nkv, D))
    v = rng.standard_normal((B, Hkv, Nkv, D))
    dout = rng.standard_normal((B, Hq, Nq, D))
    got = reference.attention_backward(dout, q, k, v, mask, **kw)
    want = numeric_grads(dout, q, k, v, mask, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=f"{name} (seed {seed})")
    return got


def _qk(Nq, Nkv):
    return np.arange(Nq)[:, None], np.arange(Nkv)[None, :]


DENSE_CASES = [
    pytest.param(lambda Nq, Nkv, rng: None, id="full"),
    pytest.param(lambda Nq, Nkv, rng: (_qk(Nq, Nkv)[0] >= _qk(Nq, Nkv)[1]), id="causal"),
    pytest.param(lambda Nq, Nkv, rng: (_qk(Nq, Nkv)[0] + Nkv - Nq >= _qk(Nq, Nkv)[1]), id="causal-bottom-right"),
    pytest.param(lambda Nq, Nkv, rng: rng.random((1, 2, Nq, Nkv)) < 0.5, id="random-per-head"),
    pytest.param(lambda Nq, Nkv, rng: (_qk(Nq, Nkv)[0] % 3 == 0) & (_qk(Nq, Nkv)[1] <= _qk(Nq, Nkv)[0]),
                 id="empty-rows"),
    pytest.param(lambda Nq, Nkv, rng: np.zeros((Nq, Nkv), bool), id="all-empty"),
]


@pytest.mark.parametrize("make_mask", DENSE_CASES)
@pytest.mark.parametrize("Nq,Nkv", [(6, 6), (5, 8), (8, 3)])
def test_dense_masks(make_mask, Nq, Nkv):
    seed = 1000 * Nq + Nkv
    check(seed, 1, 2, 2, Nq, Nkv, 4, make_mask(Nq, Nkv, np.random.default_rng(seed)))


@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_mask_mods(factory):
    n = 9
    check(7, 1, 1, 1, n, n, 3, factory(n, n))


@pytest.mark.parametrize("Hq,Hkv", [pytest.param(4, 2, id="gqa"), pytest.param(3, 1, id="mqa")])
def test_grouped_heads(Hq, Hkv):
    rng = np.random.default_rng(3)
    mask = rng.random((2, Hq, 5, 7)) < 0.6
    check(3, 2, Hq, Hkv, 5, 7, 4, mask)


def test_bias_is_constant():
    rng = np.random.default_rng(5)
    bias = rng.standard_normal((1, 2, 6, 7))
    check(5, 2, 2, 1, 6, 7, 4, _qk(6, 7)[0] + 1 >= _qk(6, 7)[1], bias=bias)


SCORE_MODS = [
    pytest.param(lambda H: score_mods.softcap(0.8), id="softcap"),
    pytest.param(lambda H: score_mods.alibi(H), id="alibi"),
    pytest.param(lambda H: omnicupy.cuda_score(
        "score * score * C + slope[h] * score", {"C": 0.3}, {"slope": np.array([0.5, -1.0], np.float32)},
        numpy_fn=lambda s, b, h, q, k: s * s * 0.3 + np.array([0.5, -1.0])[h] * s,
        grad="2.0f * C * score + slope[h]",
        numpy_grad=lambda s, b, h, q, k: 0.6 * s + np.array([0.5, -1.0])[h]), id="user-cuda-score"),
]


@pytest.mark.parametrize("factory", SCORE_MODS)
@pytest.mark.parametrize("masked", [False, True], ids=["full", "causal"])
def test_score_mods(factory, masked):
    mask = (_qk(6, 6)[0] >= _qk(6, 6)[1]) if masked else None
    check(11, 1, 2, 1, 6, 6, 4, mask, score_mod=factory(2), bias=np.full((1, 1, 6), 0.25))


def test_softcap_derivative_is_applied():
    """Softcap with a small cap changes the gradients (the derivative is not silently 1)."""
    rng = np.random.default_rng(13)
    q, k, v, dout = (rng.standard_normal((1, 1, 5, 4)) * 3 for _ in range(4))
    plain = reference.attention_backward(dout, q, k, v)
    capped = reference.attention_backward(dout, q, k, v, score_mod=score_mods.softcap(0.5))
    assert not np.allclose(plain[0], capped[0])


def test_empty_rows_give_zero_gradients():
    rng = np.random.default_rng(17)
    q, k, v, dout = (rng.standard_normal((1, 1, 6, 4)) for _ in range(4))
    mask = np.zeros((6, 6), bool)
    mask[1:, :3] = True  # row 0 sees nothing; kv columns 3.. are seen by no row
    dq, dk, dv = reference.attention_backward(dout, q, k, v, mask)
    assert np.all(dq[0, 0, 0] == 0) and np.all(dk[0, 0, 3:] == 0) and np.all(dv[0, 0, 3:] == 0)
    assert np.all(np.isfinite(dq)) and np.any(dq[0, 0, 1:] != 0)


def test_score_mod_without_derivative_is_refused():
    mod = omnicupy.cuda_score("score * 2.0f", numpy_fn=lambda s, b, h, q, k: 2 * s)
    x = np.ones((1, 1, 2, 4))
    with pytest.raises(ArgumentError, match="numpy_grad"):
        reference.attention_backward(x, x, x, x, score_mod=mod)


def test_dout_shape_is_checked():
    x = np.ones((1, 1, 2, 4))
    with pytest.raises(ArgumentError, match="dout"):
        reference.attention_backward(np.ones((1, 1, 3, 4)), x, x, x)
