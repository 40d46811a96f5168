"""The float64 reference against a naive per-element formula."""
from __future__ import annotations

import math

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, BlockMask, MaskError, OmnicupyError, reference


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


# ---------------------------------------------------------------- validation, as attention() does it
def _qkv(B=1, Hq=2, Hkv=1, Nq=5, Nkv=6, D=8):
    rng = np.random.default_rng(4)
    return rng.standard_normal((B, Hq, Nq, D)), rng.standard_normal((B, Hkv, Nkv, D)), \
        rng.standard_normal((B, Hkv, Nkv, D))


def _with(index, value):
    args = list(_qkv())
    args[index] = value
    return args


def _flamingo_style(b, h, q_idx, kv_idx):
    """A flex (vmap, scalar) style mask_mod: indexes a table with an index array as if it were a scalar."""
    intervals = np.array([[0, 3], [2, 6]])
    interval = intervals[kv_idx]
    return q_idx >= interval[0]


BAD_REFERENCE_CALLS = [
    pytest.param(_qkv(), dict(mask="causal"), MaskError, "mask must be a boolean array", id="mask-causal-string"),
    pytest.param(_qkv(), dict(mask=1), MaskError, "mask must be a boolean array", id="mask-int"),
    pytest.param(_qkv(), dict(mask=[[True]]), MaskError, "mask must be a boolean array", id="mask-list"),
    pytest.param(_qkv(), dict(mask=BlockMask.full(5, 6)), MaskError, r"bm.mask_mod or bm.to_dense\(\)",
                 id="mask-blockmask"),
    pytest.param(_qkv(), dict(mask=np.ones((5, 6), np.int8)), MaskError, "boolean array", id="mask-int-array"),
    pytest.param(_qkv(), dict(mask=np.ones((5, 6))), MaskError, "boolean array", id="mask-float-array"),
    pytest.param(_qkv(), dict(mask=np.ones((5, 7), bool)), MaskError, "does not broadcast", id="mask-shape"),
    pytest.param(_qkv(), dict(mask=np.ones((3, 2, 5, 6), bool)), MaskError, "does not broadcast", id="mask-batch"),
    pytest.param(_qkv(), dict(mask=lambda b, h, q: q >= 0), MaskError, "4 positional arguments", id="mask-mod-arity"),
    pytest.param(_qkv(), dict(mask=lambda b, h, q, k: (q >= k).astype(int)), MaskError, "not booleans",
                 id="mask-mod-ints"),
    pytest.param(_qkv(), dict(mask=lambda b, h, q, k: q * 1.0), MaskError, "not booleans", id="mask-mod-floats"),
    pytest.param(_qkv(), dict(mask=lambda b, h, q, k: np.ones((2, 2), bool)), MaskError, "does not broadcast",
                 id="mask-mod-shape"),
    pytest.param(_qkv(), dict(mask=lambda b, h, q, k: "yes"), MaskError, "returned str", id="mask-mod-str"),
    pytest.param(_qkv(), dict(mask=_flamingo_style), MaskError, "raised IndexError.*broadcast",
                 id="mask-mod-scalar-style"),
    pytest.param(_with(0, np.zeros((2, 5, 8))), {}, ArgumentError, "q must be 4-D", id="q-3d"),
    pytest.param(_with(0, [[[[1.0]]]]), {}, ArgumentError, "q must be a NumPy/CuPy array", id="q-list"),
    pytest.param(_with(1, None), {}, ArgumentError, "k is required", id="k-none"),
    pytest.param(_with(0, np.zeros((1, 2, 5, 8), complex)), {}, ArgumentError, "real numbers", id="q-complex"),
    pytest.param(_with(0, np.zeros((1, 2, 5, 8), bool)), {}, ArgumentError, "real numbers", id="q-bool"),
    pytest.param(_with(0, np.zeros((1, 2, 0, 8))), {}, ArgumentError, "zero-size", id="q-empty"),
    pytest.param(_with(2, np.zeros((1, 1, 7, 8))), {}, ArgumentError, "k and v must agree", id="kv-length"),
    pytest.param(_with(0, np.zeros((2, 2, 5, 8))), {}, ArgumentError, "batch", id="batch"),
    pytest.param(_with(0, np.zeros((1, 2, 5, 4))), {}, ArgumentError, "head_dim", id="head-dim"),
    pytest.param(_qkv(Hq=3, Hkv=2), {}, ArgumentError, "multiple of k/v heads", id="heads"),
    pytest.param(_qkv(), dict(scale="0.5"), ArgumentError, "scale must be a real number", id="scale-str"),
    pytest.param(_qkv(), dict(scale=True), ArgumentError, "scale must be a real number", id="scale-bool"),
    pytest.param(_qkv(), dict(scale=0.0), ArgumentError, "positive", id="scale-zero"),
    pytest.param(_qkv(), dict(scale=float("nan")), ArgumentError, "finite", id="scale-nan"),
    pytest.param(_qkv(), dict(return_lse="yes"), ArgumentError, "return_lse must be True or False", id="return-lse"),
    pytest.param(_qkv(), dict(bias=np.zeros((1, 2, 7))), ArgumentError, "does not broadcast", id="bias-shape"),
    pytest.param(_qkv(), dict(bias=np.zeros(6)), ArgumentError, r"\[B\|1, H\|1, Nkv\]", id="bias-1d"),
    pytest.param(_qkv(), dict(bias=np.zeros((1, 2, 6), complex)), ArgumentError, "real numbers", id="bias-complex"),
    pytest.param(_qkv(), dict(bias="zero"), ArgumentError, "bias must be a NumPy", id="bias-str"),
    pytest.param(_qkv(), dict(score_mod=2.0), ArgumentError, "score_mod must be callable", id="score-mod-number"),
    pytest.param(_qkv(), dict(score_mod=lambda s, b: s), ArgumentError, "5 positional arguments", id="score-mod-arity"),
    pytest.param(_qkv(), dict(score_mod=lambda s, b, h, q, k: s[:2]), ArgumentError, "does not broadcast",
                 id="score-mod-shape"),
    pytest.param(_qkv(), dict(score_mod=lambda s, b, h, q, k: s.astype(complex)), ArgumentError, "not real",
                 id="score-mod-complex"),
    pytest.param(_qkv(), dict(score_mod=lambda s, b, h, q, k: s[10**6]), ArgumentError, "raised IndexError",
                 id="score-mod-raises"),
]


@pytest.mark.parametrize("args,kwargs,error,message", BAD_REFERENCE_CALLS)
def test_reference_refuses_bad_input_with_library_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        reference.attention(*args, **kwargs)
    assert isinstance(info.value, OmnicupyError)


@pytest.mark.parametrize("mod,error,message", [
    pytest.param(lambda b, h, q, k: (q >= k) * 1, MaskError, "not booleans", id="ints"),
    pytest.param(lambda b, h, q: q >= 0, MaskError, "4 positional", id="arity"),
    pytest.param("causal", MaskError, "callable", id="not-callable"),
])
def test_dense_mask_from_mod_refuses_non_boolean_mask_mods(mod, error, message):
    with pytest.raises(error, match=message):
        reference.dense_mask_from_mod(mod, 1, 1, 4, 4)


@pytest.mark.parametrize("B,H,q_len,kv_len", [(0, 1, 4, 4), (1, True, 4, 4), (1, 1, 4.0, 4)])
def test_dense_mask_from_mod_sizes(B, H, q_len, kv_len):
    with pytest.raises(MaskError):
        reference.dense_mask_from_mod(lambda b, h, q, k: q >= k, B, H, q_len, kv_len)


def test_relative_error_refuses_mismatched_shapes():
    """Broadcasting would compare a slice with the whole and report a small error."""
    with pytest.raises(ArgumentError, match="same shape"):
        reference.relative_error(np.ones((1, 2, 3, 4)), np.ones((2, 2, 3, 4)))


def test_reference_accepts_what_it_documents():
    q, k, v = _qkv()
    qi, ki = np.arange(5)[:, None], np.arange(6)[None, :]
    dense = reference.attention(q, k, v, qi >= ki)
    np.testing.assert_array_equal(reference.attention(q, k, v, lambda b, h, i, j: i >= j), dense)
    np.testing.assert_array_equal(reference.attention(q, k, v, np.bool_(True) | (qi >= ki), scale=np.float64(0.3)),
                                  reference.attention(q, k, v, scale=0.3))
    reference.attention(q.astype(np.float16), k.astype(np.float32), v.astype(omnicupy.arrays.BFLOAT16), qi >= ki,
                        bias=np.zeros((1, 1, 5, 6), np.float16), score_mod=lambda s, b, h, i, j: s * 0.5)
