"""The float64 reference against a naive per-element formula."""
from __future__ import annotations

import math

import numpy as np
import pytest

from omnicupy import reference


def naive_attention(q, k, v, allowed, scale):
    """Textbook softmax attention, one query row at a time, in Python floats."""
    B, Hq, Nq, D = q.shape
    Hkv, Nkv = k.shape[1], k.shape[2]
    out = np.zeros((B, Hq, Nq, v.shape[3]))
    lse = np.full((B, Hq, Nq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Nq):
                js = [j for j in range(Nkv) if allowed[b, h, i, j]]
                if not js:
                    continue
                scores = [scale * float(np.dot(q[b, h, i], k[b, hk, j])) for j in js]
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                total = sum(weights)
                out[b, h, i] = sum(w * v[b, hk, j] for w, j in zip(weights, js)) / total
                lse[b, h, i] = m + math.log(total)
    return out, lse


CASES = [
    pytest.param(dict(B=1, Hq=1, Hkv=1, Nq=5, Nkv=5), "full", id="full-5"),
    pytest.param(dict(B=2, Hq=2, Hkv=2, Nq=7, Nkv=9), "causal", id="causal-7x9"),
    pytest.param(dict(B=1, Hq=4, Hkv=2, Nq=6, Nkv=6), "random", id="gqa-random"),
    pytest.param(dict(B=1, Hq=2, Hkv=1, Nq=8, Nkv=3), "empty-rows", id="mqa-empty-rows"),
]


@pytest.mark.parametrize("shape,mask_kind", CASES)
def test_reference_matches_naive(shape, mask_kind):
    rng = np.random.default_rng(0)
    B, Hq, Hkv, Nq, Nkv = (shape[k] for k in ("B", "Hq", "Hkv", "Nq", "Nkv"))
    D = 8
    q = rng.standard_normal((B, Hq, Nq, D))
    k = rng.standard_normal((B, Hkv, Nkv, D))
    v = rng.standard_normal((B, Hkv, Nkv, D))
    qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
    allowed = {
        "full": np.ones((B, Hq, Nq, Nkv), bool),
        "causal": np.broadcast_to(qi >= ki, (B, Hq, Nq, Nkv)),
        "random": rng.random((B, Hq, Nq, Nkv)) < 0.5,
        "empty-rows": np.broadcast_to((qi % 3 == 0) & (ki <= qi), (B, Hq, Nq, Nkv)),
    }[mask_kind]
    scale = 0.37
    out, lse = reference.attention(q, k, v, allowed, scale=scale, return_lse=True)
    want_out, want_lse = naive_attention(q, k, v, allowed, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)
    assert not np.isnan(out).any()


def test_reference_mask_mod_equals_dense():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 11, 16)) for _ in range(3))
    mod = lambda b, h, qi, ki: (qi >= ki) & ((ki + b + h) % 3 != 0)  # noqa: E731
    dense = reference.dense_mask_from_mod(mod, 2, 3, 11, 11)
    np.testing.assert_array_equal(reference.attention(q, k, v, mod), reference.attention(q, k, v, dense))


def test_reference_default_scale_and_empty_rows():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, 4, 16)) for _ in range(3))
    allowed = np.zeros((4, 4), bool)
    allowed[1, :2] = True
    out, lse = reference.attention(q, k, v, allowed, return_lse=True)
    want, want_lse = naive_attention(q, k, v, np.broadcast_to(allowed, (1, 1, 4, 4)), 1 / 4)
    np.testing.assert_allclose(out, want)
    assert np.all(out[0, 0, [0, 2, 3]] == 0) and np.all(np.isneginf(lse[0, 0, [0, 2, 3]]))


def test_relative_error_rejects_nan():
    expected = np.ones((2, 2))
    assert reference.relative_error(np.full((2, 2), np.nan), expected) == float("inf")
    assert reference.relative_error(expected * 1.001, expected) == pytest.approx(1e-3)


def test_reference_bias_and_score_mod():
    """Vector and matrix bias, then a score modifier, against the naive formula on modified scores."""
    from omnicupy import score_mods

    rng = np.random.default_rng(3)
    B, Hq, Hkv, Nq, Nkv, D = 2, 4, 2, 5, 7, 8
    q = rng.standard_normal((B, Hq, Nq, D))
    k, v = rng.standard_normal((B, Hkv, Nkv, D)), rng.standard_normal((B, Hkv, Nkv, D))
    vector = rng.standard_normal((1, Hq, Nkv))
    matrix = rng.standard_normal((B, 1, Nq, Nkv))
    mod = score_mods.softcap(2.0)
    qi, ki = np.arange(Nq)[:, None], np.arange(Nkv)[None, :]
    for bias, full in ((vector, np.broadcast_to(vector[:, :, None], (B, Hq, Nq, Nkv))),
                       (matrix, np.broadcast_to(matrix, (B, Hq, Nq, Nkv)))):
        out = reference.attention(q, k, v, qi + 2 >= ki, scale=0.5, bias=bias, score_mod=mod)
        want = np.zeros_like(out)
        for b in range(B):
            for h in range(Hq):
                s = 0.5 * q[b, h] @ k[b, h // 2].T + full[b, h]
                s = np.where(qi + 2 >= ki, 2.0 * np.tanh(s / 2.0), -np.inf)
                p = np.exp(s - s.max(axis=1, keepdims=True))
                want[b, h] = (p / p.sum(axis=1, keepdims=True)) @ v[b, h // 2]
        np.testing.assert_allclose(out, want, rtol=1e-12)


def test_alibi_numpy_form():
    from omnicupy import score_mods

    mod = score_mods.alibi(8)
    s = np.zeros((3, 4))
    got = mod(s, 0, 5, np.arange(3)[:, None], np.arange(4)[None, :])
    np.testing.assert_allclose(got, 2.0 ** (-8 * 6 / 8) * (np.arange(4)[None, :] - np.arange(3)[:, None]))
