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
    tiles = -(-300 // plan.variant.br)
    expected = (min(tiles * 2, 132), 1, 1) if family == "tma" else (tiles, 2, 1)  # tma: flat tile index
    assert plan.grid == expected and plan.block == (plan.variant.threads, 1, 1)
    assert plan.smem_bytes == plan.variant.smem_bytes and plan.kernel in str(plan)
    assert {"wgmma": "wgmma", "tma": "tma", "sync": "mma.sync"}[family] in plan.reason


def test_plan_reports_the_launch_order_of_uneven_masks():
    ids = np.repeat(np.arange(5), [200, 900, 64, 700, 136])
    bm = BlockMask.from_mask_mod(masks.document(ids, causal=True), None, None, ids.size, ids.size)
    plan = omnicupy.plan(*qkv(n=ids.size), bm, arch="sm_90")
    assert plan.q_tile_order is not None and sorted(plan.q_tile_order) == list(range(plan.grid[0]))
    assert "heaviest" in str(plan)
    assert omnicupy.plan(*qkv(), causal=True, arch="sm_90").q_tile_order is None  # the kernel's own order


@pytest.mark.parametrize("head_dim, n, heads, persistent, grid_x, lists", [
    pytest.param(128, 8192, 16, True, 132, True, id="d128-causal-persistent-lpt"),
    pytest.param(64, 1024, 2, True, 16, False, id="d64-fewer-tiles-than-sms"),
    pytest.param(256, 8192, 4, False, 256, False, id="d256-no-room-one-cta-per-tile"),
])
def test_tma_plan_grid(monkeypatch, head_dim, n, heads, persistent, grid_x, lists):
    from omnicupy.dispatch import arch as arch_mod, plan as plan_mod

    monkeypatch.setattr(arch_mod, "_sm_count", lambda device: 132)
    monkeypatch.setattr(plan_mod, "sm_count", lambda: 132)
    plan = plan_mod.plan_forward(head_dim=head_dim, dtype="fp16", batch=1, heads=heads,
                                 block_mask=BlockMask.causal(n, n), stages=None, bias=None, mask_expr=None,
                                 score_expr=None, arch="sm_90", family="tma")
    assert plan.variant.family == "tma" and plan.variant.persistent == persistent
    assert plan.grid == (grid_x, 1, 1) and ("persistent CTAs, one per SM" in plan.reason) == persistent
    assert (plan.cta_tiles is not None) == lists
    if lists:
        offsets, tiles = plan.cta_tiles
        assert offsets.size == grid_x + 1 and tiles.size == (n // plan.variant.br) * heads


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
