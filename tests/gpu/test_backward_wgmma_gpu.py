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


def test_wgmma_kernels_ran():
    """Runs last in this module (pytest keeps file order): the cases above did reach the wgmma kernels."""
    print(f"backward calls by family in this module: {dict(FAMILIES_RUN)}")
    if not FAMILIES_RUN:
        pytest.skip("no backward call ran before this test (a -k selection?)")
    assert FAMILIES_RUN["wgmma"] > 0
