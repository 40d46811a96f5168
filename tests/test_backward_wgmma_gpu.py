"""The wgmma backward (sm_90a) against the float64 reference: every case of test_backward_gpu.py, run
again with OMNICUPY_BWD=wgmma, plus checks that the wgmma kernels are what ran.

The case tables and test bodies are test_backward_gpu.py's, imported (pytest collects them here a
second time, under this module's fixtures): one place to add a backward case. Where the wgmma family
has no kernel (head dims 32, 96, 256; blocks that are not multiples of 64; not an sm_90 device) the
call runs mma.sync, as ``OMNICUPY_BWD=wgmma`` documents; every call's family is recorded and
printed, and ``test_wgmma_kernels_ran`` fails if the wgmma backward never ran in this module.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

import omnicupy
from omnicupy.dispatch.arch import current_arch, has_wgmma
from omnicupy.ops import backward as backward_op

from test_backward_gpu import *  # noqa: F401,F403  (the cases, re-collected under OMNICUPY_BWD=wgmma)
from test_backward_gpu import check_backward, mask_for, new_seed
from helpers import random_qkv

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

#: kernel family -> calls, over this module's tests
FAMILIES_RUN: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True)
def wgmma_backward(monkeypatch):
    """OMNICUPY_BWD=wgmma for every test here; records which family each backward call planned."""
    if not has_wgmma(current_arch()):
        pytest.skip("the wgmma backward needs an sm_90 device")
    monkeypatch.setenv("OMNICUPY_BWD", "wgmma")
    make_plan = backward_op.make_plan

    def recording(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        FAMILIES_RUN[plan.variant.family] += 1
        print(f"backward kernel: {plan.kernel}")
        return plan

    monkeypatch.setattr(backward_op, "make_plan", recording)
    yield


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_device_selects_wgmma(head_dim, dtype):
    q = np.zeros((1, 2, 300, head_dim), np.float16)
    plan = omnicupy.ops.backward.plan(q, q, q, causal=True)
    assert plan.variant.family == "wgmma", plan.describe()


@pytest.mark.parametrize("n", [64, 65, 191, 333])
@pytest.mark.parametrize("mask_kind", ["full", "causal", "mixed"])
@pytest.mark.parametrize("head_dim,dtype", [(64, "fp16"), (64, "bf16"), (128, "fp16"), (128, "bf16")])
def test_wgmma_tiles_and_tails(head_dim, dtype, mask_kind, n):
    """Lengths around the 64-row q and kv tiles, GQA 4/2, every mask path of the wgmma kernel."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 4, n, head_dim, dtype, Hkv=2)
    bm, causal, dense = mask_for(mask_kind, rng, 2, 4, n, n, qbs=64, kbs=64)
    check_backward(seed, q, k, v, dense, dtype, block_mask=bm, causal=causal)


@pytest.mark.parametrize("layout,by_tma", [("contiguous", True), ("bnhd", True), ("reversed", False)])
def test_ws_loads_q_and_dout_by_tma_where_it_can(monkeypatch, layout, by_tma):
    """The warp-specialized kernel (D = 128, kv blocks of 128) loads Q and dO through tensor maps
    where TMA can address them (positive strides, multiples of 16 bytes) and by cp.async otherwise
    (negative strides here): each path checked against float64."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 4, 333, 128, "fp16", Hkv=2)
    bm, causal, dense = mask_for("mixed", rng, 2, 4, 333, 333)
    chosen = []
    tensor_maps = backward_op._tensor_maps

    def recording(variant, *args):
        maps = tensor_maps(variant, *args)
        chosen.append((variant.warp_specialized, maps is not None))
        return maps

    monkeypatch.setattr(backward_op, "_tensor_maps", recording)
    check_backward(seed, q, k, v, dense, "fp16", block_mask=bm, causal=causal, layout=layout)
    assert chosen == [(True, by_tma)], f"(warp-specialized, tensor maps) per call: {chosen} (seed {seed})"


# ---------------------------------------------------------------- deterministic: int32 fixed-point dQ
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
    (128, "fp16", "causal", 2, True),  # bias + soft-cap: the plain kernel at D = 128 (per-warp reductions)
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
    """A derivative of 2 (beyond the fixed point's bound): the call plans mma.sync's ordered sum, which
    is reproducible and matches float64."""
    seed = new_seed()
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 300, 64, "fp16")
    mod = omnicupy.score_mods.cuda_score("score * S", {"S": 2.0}, grad="S", numpy_fn=lambda s, b, h, i, j: s * 2.0,
                                         numpy_grad=lambda s, b, h, i, j: np.full_like(s, 2.0))
    dense = np.tril(np.ones((300, 300), bool))[None, None]
    first = check_backward(seed, q, k, v, dense, "fp16", causal=True, score_mod=mod, deterministic=True)
    second = check_backward(seed, q, k, v, dense, "fp16", causal=True, score_mod=mod, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_wgmma_kernels_ran():
    """Runs last in this module (pytest keeps file order): the cases above did reach the wgmma kernels."""
    print(f"backward calls by family in this module: {dict(FAMILIES_RUN)}")
    if not FAMILIES_RUN:
        pytest.skip("no backward call ran before this test (a -k selection?)")
    assert FAMILIES_RUN["wgmma"] > 0
