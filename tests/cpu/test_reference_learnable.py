"""The float64 reference's learnable inputs: sink logits (forward, LSE, empty rows, the cache calls)
and the gradients of biases and sinks, each against central finite differences of reference.attention.
"""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import reference, score_mods
from omnicupy.errors import ArgumentError

STEP = 1e-6


def _qk(Nq, Nkv):
    return np.arange(Nq)[:, None], np.arange(Nkv)[None, :]


def numeric_grad(loss, x):
    """Central differences of loss() with respect to every element of x (changed in place, restored)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + STEP
        plus = loss()
        x[idx] = saved - STEP
        minus = loss()
        x[idx] = saved
        g[idx] = (plus - minus) / (2 * STEP)
    return g


MASKS = [
    pytest.param(lambda Nq, Nkv: None, id="full"),
    pytest.param(lambda Nq, Nkv: _qk(Nq, Nkv)[0] >= _qk(Nq, Nkv)[1], id="causal"),
    pytest.param(lambda Nq, Nkv: (_qk(Nq, Nkv)[0] % 3 == 0) & (_qk(Nq, Nkv)[1] <= _qk(Nq, Nkv)[0]), id="empty-rows"),
    pytest.param(lambda Nq, Nkv: np.zeros((Nq, Nkv), bool), id="all-empty"),
]

BIAS_SHAPES = [(1, 1, 7), (2, 1, 7), (2, 4, 7), (1, 4, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7)]


def _inputs(seed, B=2, Hq=4, Hkv=2, Nq=5, Nkv=7, D=3):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((B, Hq, Nq, D)), rng.standard_normal((B, Hkv, Nkv, D)), rng.standard_normal(
        (B, Hkv, Nkv, D))
    return rng, q, k, v, rng.standard_normal((B, Hq, Nq, D))


@pytest.mark.parametrize("make_mask", MASKS)
def test_sinks_join_every_rows_normalizer(make_mask):
    rng, q, k, v, _ = _inputs(1)
    sinks = rng.standard_normal(4) * 2
    mask = make_mask(5, 7)
    out, lse = reference.attention(q, k, v, mask, sinks=sinks, return_lse=True)
    plain, plain_lse = reference.attention(q, k, v, mask, return_lse=True)
    # the sink only adds to the normalizer: out = plain * exp(plain_lse - lse), lse = logaddexp(plain_lse, sink)
    want_lse = np.logaddexp(plain_lse, sinks[None, :, None])
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    scale = np.where(np.isfinite(plain_lse), np.exp(plain_lse - want_lse), 0.0)
    np.testing.assert_allclose(out, plain * scale[..., None], rtol=1e-12, atol=1e-12)
    empty = ~np.isfinite(plain_lse)
    assert np.all(out[empty] == 0) and np.allclose(lse[empty], np.broadcast_to(sinks[None, :, None], lse.shape)[empty])


@pytest.mark.parametrize("make_mask", MASKS)
@pytest.mark.parametrize("with_score_mod", [False, True], ids=["plain", "softcap"])
def test_dsinks_match_finite_differences(make_mask, with_score_mod):
    rng, q, k, v, dout = _inputs(2)
    sinks = rng.standard_normal(4)
    mask = make_mask(5, 7)
    mod = score_mods.softcap(1.5) if with_score_mod else None

    def loss():
        return float(np.sum(reference.attention(q, k, v, mask, sinks=sinks, score_mod=mod) * dout))

    dq, dk, dv, dsinks = reference.attention_backward(dout, q, k, v, mask, sinks=sinks, score_mod=mod,
                                                      return_grads=("dq", "dk", "dv", "dsinks"))
    np.testing.assert_allclose(dsinks, numeric_grad(loss, sinks), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dq, numeric_grad(loss, q), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dv, numeric_grad(loss, v), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("make_mask", MASKS[:3])
def test_dbias_matches_finite_differences_and_keeps_the_bias_shape(shape, make_mask):
    rng, q, k, v, dout = _inputs(3)
    bias = rng.standard_normal(shape)
    mask = make_mask(5, 7)
    mod = score_mods.alibi(4)

    def loss():
        return float(np.sum(reference.attention(q, k, v, mask, bias=bias, score_mod=mod) * dout))

    (dbias,) = reference.attention_backward(dout, q, k, v, mask, bias=bias, score_mod=mod, return_grads=("dbias",))
    assert dbias.shape == shape
    np.testing.assert_allclose(dbias, numeric_grad(loss, bias), rtol=1e-5, atol=1e-7)


def test_masked_positions_give_exact_zero_dbias():
    _, q, k, v, dout = _inputs(4)
    mask = _qk(5, 7)[0] >= _qk(5, 7)[1]
    (dbias,) = reference.attention_backward(dout, q, k, v, mask, bias=np.zeros((2, 4, 5, 7)), return_grads=("dbias",))
    assert np.all(dbias[..., ~mask] == 0)


def test_gradients_come_back_in_canonical_order():
    rng, q, k, v, dout = _inputs(5)
    sinks, bias = rng.standard_normal(4), rng.standard_normal((1, 4, 7))
    every = reference.attention_backward(dout, q, k, v, None, bias=bias, sinks=sinks,
                                         return_grads=("dsinks", "dbias", "dv", "dq", "dk"))
    assert [g.shape for g in every] == [q.shape, k.shape, v.shape, bias.shape, sinks.shape]
    default = reference.attention_backward(dout, q, k, v, None, bias=bias, sinks=sinks)
    for a, b in zip(default, every[:3]):
        np.testing.assert_array_equal(a, b)


BAD_REQUESTS = [
    ({"return_grads": ("dbias",)}, "no bias"),
    ({"return_grads": ("dsinks",)}, "no sinks"),
    ({"return_grads": ("dq", "dq")}, "at most once"),
    ({"return_grads": ("dx",)}, "at most once"),
    ({"return_grads": ()}, "at most once"),
    ({"return_grads": "dq"}, "tuple of names"),
    ({"return_grads": ("dscore",), "sinks": np.zeros(4)}, "not available"),
    ({"sinks": np.zeros(3)}, r"\[Hq\]"),
    ({"sinks": np.array([0, 0, np.inf, 0])}, "finite"),
    ({"sinks": np.zeros((4, 1))}, r"\[Hq\]"),
    ({"sinks": "zero"}, "sinks must be"),
]


@pytest.mark.parametrize("kwargs,message", BAD_REQUESTS)
def test_bad_requests_are_named_errors(kwargs, message):
    _, q, k, v, dout = _inputs(6)
    with pytest.raises(ArgumentError, match=message):
        reference.attention_backward(dout, q, k, v, None, **kwargs)


def test_cache_references_count_the_sink_once_per_row():
    rng, q, k, v, _ = _inputs(7, B=2, Hq=4, Hkv=2, Nq=1, Nkv=9)
    sinks = rng.standard_normal(4)
    lens = np.array([0, 6])
    out, lse = reference.decode_attention(q, k, v, lens, sinks=sinks, return_lse=True)
    assert np.all(out[0] == 0) and np.allclose(lse[0], sinks[:, None])
    want, want_lse = reference.attention(q[1:], k[1:, :, :6], v[1:, :, :6], sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out[1:], want, rtol=1e-12)
    np.testing.assert_allclose(lse[1:], want_lse, rtol=1e-12)
    # varlen: the same two sequences packed, causal off
    cu_k = np.array([0, 0, 6])
    packed_k, packed_v = (x[1, :, :6].transpose(1, 0, 2) for x in (k, v))
    packed_q = q[:, :, 0].reshape(2, 4, -1)
    vo, vl = reference.varlen_attention(packed_q, packed_k, packed_v, np.array([0, 1, 2]), cu_k, sinks=sinks,
                                        return_lse=True)
    np.testing.assert_allclose(vo[1], want[0, :, 0], rtol=1e-12)
    assert np.all(vo[0] == 0) and np.allclose(vl[:, 0], sinks)
