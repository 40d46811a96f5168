"""The backward kernels against the float64 reference gradients on a GPU.

Every case draws fresh inputs from a logged seed (printed in every assertion message, so a failure
replays with the same numbers), poisons the dq/dk/dv buffers with NaN, and compares each gradient
with ``reference.attention_backward`` computed from the element-level mask. Gradients of rows that
no key reaches (dq) and of keys that no query sees (dk, dv) must be exactly zero. ``out`` and ``lse``
come from the float64 reference (rounded as the forward would return them), so that these tests
check the backward alone; the end-to-end tests take them from ``omnicupy.attention``.
"""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, reference, score_mods
from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS

from helpers import DOUBLED_SCORE, TOLERANCE, device_view, random_block_mask, random_qkv
from mask_cases import MASK_CASES

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

#: Relative Frobenius error of each gradient against float64: the forward's bounds (P and dS are
#: rounded to the input dtype for the tensor cores). Measured on the H200: fp16 about 3e-4, bf16 2.5e-3.
GRAD_TOLERANCE = TOLERANCE


def new_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def check_backward(seed, q, k, v, dense, dtype, *, block_mask=None, causal=False, scale=None, bias=None,
                   score_mod=None, layout="contiguous", deterministic=False, fuse_mask=False, from_forward=False):
    """Run attention_backward on device copies with NaN-poisoned gradient buffers; compare with the
    float64 reference. Returns (dq, dk, dv) as float64 NumPy arrays."""
    rng = np.random.default_rng(seed + 1)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    want_out, want_lse = reference.attention(q, k, v, dense, scale=scale, return_lse=True, bias=bias,
                                             score_mod=score_mod)
    qd, kd, vd, dod = (device_view(x, layout) for x in (q, k, v, dout))
    if from_forward:
        out, lse = omnicupy.attention(qd, kd, vd, block_mask, causal=causal, scale=scale, return_lse=True, bias=bias,
                                      score_mod=score_mod)
    else:
        out = device_view(want_out.astype(q.dtype), layout)
        lse = cp.asarray(want_lse.astype(np.float32))
    grads = {n: cp.full(x.shape, np.nan, dtype=x.dtype) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    got = omnicupy.attention_backward(dod, qd, kd, vd, out, lse, block_mask, causal=causal, scale=scale, bias=bias,
                                      score_mod=score_mod, deterministic=deterministic, fuse_mask=fuse_mask, **grads)
    for g, name in zip(got, ("dq", "dk", "dv")):
        assert g is grads[name], f"{name} was not written in place"
    want = reference.attention_backward(dout, q, k, v, dense, scale=scale, bias=bias, score_mod=score_mod)
    B, Hq, Nq, _ = q.shape
    Hkv, Nkv = k.shape[1], k.shape[2]
    allowed = np.broadcast_to(dense, (B, Hq, Nq, Nkv))
    no_key = ~allowed.any(axis=3)  # [B, Hq, Nq]
    unseen = ~allowed.reshape(B, Hkv, Hq // Hkv, Nq, Nkv).any(axis=(2, 3))  # [B, Hkv, Nkv]
    result = []
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = g.get().astype(np.float64)
        assert not np.isnan(g).any(), f"{name}: unwritten or NaN elements (seed {seed})"
        err = reference.relative_error(g, w)
        print(f"{name} relative error {err:.2e} (seed {seed})")
        assert err <= GRAD_TOLERANCE[dtype], f"{name}: relative error {err:.2e} > {GRAD_TOLERANCE[dtype]} (seed {seed})"
        empty = no_key if name == "dq" else unseen
        assert np.all(g[empty] == 0), f"{name}: rows with nothing to attend must be exactly 0 (seed {seed})"
        result.append(g)
    return tuple(result)


def mask_for(kind, rng, B, H, q_len, kv_len, qbs=128, kbs=128):
    """(block_mask, causal, dense element mask broadcastable to [B, H, Nq, Nkv])."""
    qi, ki = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if kind == "full":
        return None, False, np.ones((1, 1, q_len, kv_len), bool)
    if kind == "causal":
        return None, True, (qi >= ki)[None, None]
    if kind == "bottom_right":
        return None, "bottom_right", (qi + kv_len - q_len >= ki)[None, None]
    if kind == "mixed":  # a different random mix of all four block types per (b, h), shuffled, empty rows
        bm, dense = random_block_mask(rng, B, H, q_len, kv_len, qbs, kbs, empty_q_blocks=1, shuffle=True)
        return bm, False, dense
    raise ValueError(kind)


# ---------------------------------------------------------------- every shipped variant
@pytest.mark.parametrize("mask_kind", ["full", "causal", "mixed"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_variant(head_dim, dtype, mask_kind):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, H, N = 2, 2, 300
    q, k, v = random_qkv(rng, B, H, N, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, B, H, N, N)
    check_backward(seed, q, k, v, dense, dtype, block_mask=bm, causal=causal)


# ---------------------------------------------------------------- lengths, tails, cross lengths
@pytest.mark.parametrize("n", [1, 17, 127, 1000])
@pytest.mark.parametrize("mask_kind", ["causal", "mixed"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "fp16"), (128, "bf16")])
def test_sequence_lengths(n, mask_kind, head_dim, dtype):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 2, n, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, 2, 2, n, n)
    check_backward(seed, q, k, v, dense, dtype, block_mask=bm, causal=causal)


@pytest.mark.parametrize("q_len,kv_len", [(1, 300), (300, 1), (77, 1000), (1000, 77), (129, 2049)])
@pytest.mark.parametrize("mask_kind", ["full", "causal", "bottom_right", "mixed"])
def test_cross_lengths(q_len, kv_len, mask_kind):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 2, q_len, 64, "fp16", Nkv=kv_len)
    bm, causal, dense = mask_for(mask_kind, rng, 2, 2, q_len, kv_len)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, causal=causal)


# ---------------------------------------------------------------- masks
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_zoo_masks(factory):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    n = 333
    mask_mod = factory(n, n)
    bm = BlockMask.from_mask_mod(mask_mod, None, None, n, n)
    q, k, v = random_qkv(rng, 1, 2, n, 64, "fp16")
    dense = reference.dense_mask_from_mod(mask_mod, 1, 1, n, n)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm)


@pytest.mark.parametrize("qbs,kbs", [(64, 64), (128, 256), (256, 128), (16, 32), (64, 512), (48, 96)])
@pytest.mark.parametrize("head_dim", [64, 128])  # the fallback tiles below the two-part tuned tiles
def test_block_sizes(qbs, kbs, head_dim):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    n = 700
    q, k, v = random_qkv(rng, 1, 2, n, head_dim, "fp16")
    bm, dense = random_block_mask(rng, 1, 2, n, n, qbs, kbs, empty_q_blocks=1, shuffle=True)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm)


@pytest.mark.parametrize("bcast", ["both", "batch", "heads", "none"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_grouped_heads_and_broadcast_masks(hq, hkv, bcast):
    """dK/dV of a kv head sum over its query heads, with masks per head or broadcast."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, n = 2, 400
    Bm = 1 if bcast in ("both", "batch") else B
    Hm = 1 if bcast in ("both", "heads") else hq
    q, k, v = random_qkv(rng, B, hq, n, 64, "bf16", Hkv=hkv)
    bm, dense = random_block_mask(rng, Bm, Hm, n, n, 128, 128, empty_q_blocks=1)
    check_backward(seed, q, k, v, dense, "bf16", block_mask=bm)


def test_all_rows_empty():
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 200, 64, "fp16")
    bm = BlockMask.from_block_types(np.zeros((1, 1, 2, 2), np.int32), q_len=200, kv_len=200)
    dq, dk, dv = check_backward(seed, q, k, v, np.zeros((1, 1, 200, 200), bool), "fp16", block_mask=bm)
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES[:6]])
def test_fused_mask_equals_bits(factory):
    """PARTIAL blocks by the mask's CUDA expression give bit-identical gradients (deterministic dQ)."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    n = 500
    mask_mod = factory(n, n)
    bm = BlockMask.from_mask_mod(mask_mod, None, None, n, n)
    q, k, v = random_qkv(rng, 1, 2, n, 64, "fp16")
    dense = reference.dense_mask_from_mod(mask_mod, 1, 1, n, n)
    fused = check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, fuse_mask=True, deterministic=True)
    bits = check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, fuse_mask=False, deterministic=True)
    for a, b in zip(fused, bits):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")


# ---------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["bnhd", "reversed"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_strided_inputs(head_dim, layout):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 3, 333, head_dim, "fp16")
    bm, causal, dense = mask_for("mixed", rng, 2, 3, 333, 333)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, layout=layout)


# ---------------------------------------------------------------- bias and score modifiers
@pytest.mark.parametrize("kind", ["vector", "matrix-bcast", "matrix-strided"])
@pytest.mark.parametrize("bias_dtype", ["fp16", "fp32"])
def test_bias(kind, bias_dtype):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, H, Nq, Nkv = 2, 2, 300, 333
    q, k, v = random_qkv(rng, B, H, Nq, 64, "fp16", Nkv=Nkv)
    shape = {"vector": (B, H, Nkv), "matrix-bcast": (B, 1, Nq, Nkv), "matrix-strided": (B, H, Nkv, Nq)}[kind]
    bias = (rng.standard_normal(shape) * 2).astype(np.float32 if bias_dtype == "fp32" else np.float16)
    if kind == "matrix-strided":
        bias = cp.asarray(bias).transpose(0, 1, 3, 2)
    bm, causal, dense = mask_for("mixed", rng, B, H, Nq, Nkv)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, bias=bias)


SLOPES = np.linspace(-0.5, 0.5, 4).astype(np.float32)
SCORE_MODS = [
    pytest.param(lambda H: score_mods.alibi(H), id="alibi"),
    pytest.param(lambda H: score_mods.softcap(2.0), id="softcap"),
    pytest.param(lambda H: omnicupy.cuda_score(
        "score * (1.0f + slope[h]) - PENALTY * (float)(q_idx > kv_idx + GAP)", {"PENALTY": 0.75, "GAP": 20},
        {"slope": SLOPES}, numpy_fn=lambda s, b, h, q, k: s * (1 + SLOPES[h]) - 0.75 * (q > k + 20),
        grad="1.0f + slope[h]", numpy_grad=lambda s, b, h, q, k: np.broadcast_to(1 + SLOPES[h], np.shape(s))),
        id="user-expression-with-array"),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("factory", SCORE_MODS)
def test_score_mods(factory, head_dim):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, H, N = 2, 4, 300
    q, k, v = random_qkv(rng, B, H, N, head_dim, "fp16")
    qi, ki = np.arange(N)[:, None], np.arange(N)[None, :]
    check_backward(seed, q, k, v, (qi >= ki)[None, None], "fp16", causal=True, score_mod=factory(H))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_everything_combined(head_dim, dtype):
    """GQA + matrix bias + mixed blocks (partial, causal, empty rows) + softcap + odd lengths."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, Nq, Nkv = 2, 4, 2, 261, 389
    q, k, v = random_qkv(rng, B, Hq, Nq, head_dim, dtype, Hkv=Hkv, Nkv=Nkv)
    bm, dense = random_block_mask(rng, B, Hq, Nq, Nkv, 128, 128, empty_q_blocks=1, shuffle=True)
    bias = (rng.standard_normal((B, 1, Nq, Nkv)) * 2).astype(np.float32)
    check_backward(seed, q, k, v, dense, dtype, block_mask=bm, bias=bias, score_mod=score_mods.softcap(4.0))


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("case", ["causal-gqa", "mixed", "hd256"])
def test_deterministic_is_bitwise_reproducible(case):
    seed = new_seed()
    rng = np.random.default_rng(seed)
    head_dim, hq, hkv, n = {"causal-gqa": (64, 4, 2, 1500), "mixed": (128, 2, 2, 777), "hd256": (256, 2, 1, 400)}[case]
    q, k, v = random_qkv(rng, 2, hq, n, head_dim, "fp16", Hkv=hkv)
    kind = "causal" if case == "causal-gqa" else "mixed"
    bm, causal, dense = mask_for(kind, rng, 2, hq, n, n)
    first = check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, causal=causal, deterministic=True)
    second = check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, causal=causal, deterministic=True)
    for a, b, name in zip(first, second, ("dq", "dk", "dv")):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs between two deterministic runs (seed {seed})")


# ---------------------------------------------------------------- end to end and interop
@pytest.mark.parametrize("mask_kind", ["causal", "mixed"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "fp16"), (128, "bf16"), (256, "fp16")])
def test_from_the_forward(head_dim, dtype, mask_kind):
    """out and lse from omnicupy.attention, as in training."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 2, 555, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, 2, 2, 555, 555)
    check_backward(seed, q, k, v, dense, dtype, block_mask=bm, causal=causal, from_forward=True)


def test_numpy_in_numpy_out():
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 100, 64, "fp16")
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = omnicupy.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    dq, dk, dv = omnicupy.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, np.ndarray) and g.dtype == np.float16 for g in (dq, dk, dv))
    want = reference.attention_backward(dout, q, k, v, np.tril(np.ones((100, 100), bool)))
    for g, w in zip((dq, dk, dv), want):
        assert reference.relative_error(g, w) <= GRAD_TOLERANCE["fp16"], f"seed {seed}"


def test_unaligned_user_buffers_are_filled():
    """dq/dk/dv views that 16-byte stores cannot write directly are filled through a copy."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 64, 64, "fp16")
    dout = cp.asarray(rng.standard_normal(q.shape).astype(np.float16))
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out, lse = omnicupy.attention(qd, kd, vd, return_lse=True)
    base = cp.full((1, 2, 64, 72), np.nan, cp.float16)
    dq = base[..., 1:65]  # offset by one element: not 16-byte aligned
    got = omnicupy.attention_backward(dout, qd, kd, vd, out, lse, dq=dq)
    assert got[0] is dq and not cp.isnan(dq).any()
    want = reference.attention_backward(dout.get(), q, k, v)
    assert reference.relative_error(dq, want[0]) <= GRAD_TOLERANCE["fp16"], f"seed {seed}"


# ---------------------------------------------------------------- deterministic: int32 fixed-point dQ
# (both families: test_backward_wgmma_gpu.py collects these again under OMNICUPY_BWD=wgmma)
def _both_modes(seed, q, k, v, dout, bm, causal, score_mod=None, bias=None):
    """(atomic, deterministic) gradients as float64 NumPy, from the same device inputs."""
    qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
    bias_d = None if bias is None else cp.asarray(bias)
    out, lse = omnicupy.attention(qd, kd, vd, bm, causal=causal, return_lse=True, score_mod=score_mod, bias=bias_d)
    return [tuple(g.get().astype(np.float64) for g in omnicupy.attention_backward(
        dod, qd, kd, vd, out, lse, bm, causal=causal, score_mod=score_mod, bias=bias_d, deterministic=det))
        for det in (False, True)]


@pytest.mark.parametrize("head_dim,dtype,mask_kind,gqa,extras", [
    (64, "fp16", "causal", 2, False), (128, "bf16", "mixed", 1, False), (128, "fp16", "full", 4, False),
    (64, "bf16", "mixed", 1, False),
    (128, "fp16", "causal", 2, True),  # bias + soft-cap (wgmma: the plain kernel at D = 128; mma.sync: one q part)
])
def test_fixed_point_dq_keeps_every_row_accurate(head_dim, dtype, mask_kind, gqa, extras):
    """Rows of dO scaled by 2^-12 .. 2^12 (one unit per row must follow each row's size): every dq row
    of the deterministic kernel is as close to float64 as the fp32 sum's; dK and dV are the atomic
    kernel's bit for bit (the same walk; only dQ's sum differs)."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    B, Hkv, n = 2, 2, 333
    Hq = Hkv * gqa
    q, k, v = random_qkv(rng, B, Hq, n, head_dim, dtype, Hkv=Hkv)
    bm, causal, dense = mask_for(mask_kind, rng, B, Hq, n, n)
    row_scale = np.exp2(rng.integers(-12, 13, size=(B, Hq, n, 1))).astype(np.float32)
    dout = (rng.standard_normal(q.shape) * row_scale).astype(q.dtype)
    bias = (rng.standard_normal((B, 1, n, n)) * 2).astype(np.float32) if extras else None
    score_mod = omnicupy.score_mods.softcap(4.0) if extras else None
    (dq_a, dk_a, dv_a), (dq_d, dk_d, dv_d) = _both_modes(seed, q, k, v, dout, bm, causal, score_mod, bias)
    np.testing.assert_array_equal(dk_d, dk_a, err_msg=f"dk (seed {seed})")
    np.testing.assert_array_equal(dv_d, dv_a, err_msg=f"dv (seed {seed})")
    want = omnicupy.reference.attention_backward(dout, q, k, v, dense, bias=bias, score_mod=score_mod)[0]
    norm = np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    err_a = np.linalg.norm(dq_a - want, axis=-1) / norm
    err_d = np.linalg.norm(dq_d - want, axis=-1) / norm
    live = np.linalg.norm(want, axis=-1) > 0
    print(f"per-row dq error, atomic max {err_a[live].max():.2e}, deterministic max {err_d[live].max():.2e} (seed {seed})")
    assert np.all(err_d[live] <= 2 * err_a[live] + 2e-3), f"dq rows lost accuracy (seed {seed})"


def test_fixed_point_dq_turns_non_finite_inputs_into_nan():
    """An inf in K: the fp32 sum gives NaN there, and so must the fixed point (never finite garbage);
    heads of other kv heads are untouched."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 4, 200, 128, "fp16", Hkv=2)
    k[0, 1, 17, 5] = np.inf
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    (_, _, _), (dq_d, _, _) = _both_modes(seed, q, k, v, dout, None, True)
    assert np.isnan(dq_d[0, 2:]).all(), f"query heads of the kv head with inf (seed {seed})"
    assert np.isfinite(dq_d[0, :2]).all(), f"other query heads (seed {seed})"


def test_deterministic_with_an_unbounded_score_derivative_sums_in_order():
    """A derivative of 2 (beyond the fixed point's bound): the call plans mma.sync's ordered fp32 sum,
    which is reproducible and matches float64."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 300, 64, "fp16")
    dense = np.tril(np.ones((300, 300), bool))[None, None]
    first = check_backward(seed, q, k, v, dense, "fp16", causal=True, score_mod=DOUBLED_SCORE, deterministic=True)
    second = check_backward(seed, q, k, v, dense, "fp16", causal=True, score_mod=DOUBLED_SCORE, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
