"""omnicupy.plan(): the kernel a call would run, decided without a GPU when the arch is given."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, masks
from omnicupy.dispatch.plan import Plan
from omnicupy.ops import tma

#: D = 128 on Hopper plans the tma family where tensor maps can be encoded (cuda-bindings and a
#: driver), else the wgmma family.
HOPPER_D128 = "tma" if tma.available() else "wgmma"


def qkv(n=300, d=64, heads=2, dtype=np.float16):
    x = np.zeros((1, heads, n, d), dtype=dtype)
    return x, x, x


@pytest.mark.parametrize("arch, head_dim, family", [
    pytest.param("sm_90", 64, "wgmma", id="hopper-d64"),
    pytest.param("sm_90", 128, HOPPER_D128, id="hopper-d128"),
    pytest.param("sm_90", 96, "sync", id="hopper-d96-no-wgmma-tile"),
    pytest.param("sm_80", 128, "sync", id="ampere"),
])
def test_plan_names_family_tile_and_why(arch, head_dim, family):
    plan = omnicupy.plan(*qkv(d=head_dim), causal=True, arch=arch)
    assert isinstance(plan, Plan) and plan.operation == "forward"
    assert plan.variant.family == family and plan.variant.head_dim == head_dim
    assert plan.grid == (-(-300 // plan.variant.br), 2, 1) and plan.block == (plan.variant.threads, 1, 1)
    assert plan.smem_bytes == plan.variant.smem_bytes and plan.kernel in str(plan)
    assert {"wgmma": "wgmma", "tma": "tma", "sync": "mma.sync"}[family] in plan.reason


def test_plan_reports_the_launch_order_of_uneven_masks():
    ids = np.repeat(np.arange(5), [200, 900, 64, 700, 136])
    bm = BlockMask.from_mask_mod(masks.document(ids, causal=True), None, None, ids.size, ids.size)
    plan = omnicupy.plan(*qkv(n=ids.size), bm, arch="sm_90")
    assert plan.q_tile_order is not None and sorted(plan.q_tile_order) == list(range(plan.grid[0]))
    assert "heaviest" in str(plan)
    assert omnicupy.plan(*qkv(), causal=True, arch="sm_90").q_tile_order is None  # the kernel's own order


def test_plan_follows_mma_override(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "sync")
    plan = omnicupy.plan(*qkv(d=128), arch="sm_90")
    assert plan.variant.family == "sync" and "OMNICUPY_MMA=sync" in plan.reason


def test_plan_checks_arguments_like_attention():
    q, k, v = qkv()
    with pytest.raises(omnicupy.ArgumentError, match="stages"):
        omnicupy.plan(q, k, v, stages=3, arch="sm_90")
    with pytest.raises(omnicupy.MaskError):
        omnicupy.plan(q, k, v, BlockMask.causal(128, 128), arch="sm_90")
