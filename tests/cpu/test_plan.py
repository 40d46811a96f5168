"""omnicupy.plan(): the kernel a call would run, decided without a GPU when the arch is given."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, masks
from omnicupy.dispatch.plan import Plan

#: A plan for a named arch describes the target (an H100/H200 with its driver and cuda-bindings):
#: the tma family on sm_90 at D = 128, and at D = 64 for masks with CAUSAL blocks, on any machine.
HOPPER_D128 = "tma"


def qkv(n=300, d=64, heads=2, dtype=np.float16):
    x = np.zeros((1, heads, n, d), dtype=dtype)
    return x, x, x


@pytest.mark.parametrize("arch, head_dim, family", [
    pytest.param("sm_90", 64, "tma", id="hopper-d64"),
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
    plan = omnicupy.plan(*qkv(n=ids.size), bm, arch="sm_80")  # one CTA per q tile (tma's grid is flat)
    assert plan.q_tile_order is not None and sorted(plan.q_tile_order) == list(range(plan.grid[0]))
    assert "heaviest" in str(plan)
    assert omnicupy.plan(*qkv(), causal=True, arch="sm_90").q_tile_order is None  # the kernel's own order


def built_causal(q_len, kv_len=None):
    """A causal mask built from its mask_mod: not a rule mask, so never re-blocked."""
    return BlockMask.from_mask_mod(masks.causal(), None, None, q_len, q_len if kv_len is None else kv_len)


@pytest.mark.parametrize("head_dim, n, heads, make, br, persistent, grid_x, lists", [
    pytest.param(128, 8192, 16, built_causal, 128, True, 132, True, id="d128-causal-persistent-lpt"),
    pytest.param(64, 1024, 2, built_causal, 128, True, 16, False, id="d64-fewer-tiles-than-sms"),
    pytest.param(256, 8192, 4, BlockMask.causal, 128, False, 256, False, id="d256-no-room-one-cta-per-tile"),
    pytest.param(64, 8192, 16, BlockMask.causal, 192, True, 132, True, id="d64-rule-tile-persistent"),
    pytest.param(128, 8192, 2, BlockMask.full, 192, True, 86, False, id="d128-rule-tile-persistent-swizzled-staging"),
])
def test_tma_plan_grid(monkeypatch, head_dim, n, heads, make, br, persistent, grid_x, lists):
    from omnicupy.dispatch import arch as arch_mod, plan as plan_mod

    monkeypatch.setattr(arch_mod, "_sm_count", lambda device: 132)
    monkeypatch.setattr(plan_mod, "sm_count", lambda: 132)
    plan = plan_mod.plan_forward(head_dim=head_dim, dtype="fp16", batch=1, heads=heads,
                                 block_mask=make(n, n), stages=None, bias=None, mask_expr=None,
                                 score_expr=None, arch="sm_90", family="tma")
    assert plan.variant.family == "tma" and plan.variant.persistent == persistent and plan.variant.br == br
    assert plan.grid == (grid_x, 1, 1) and ("persistent CTAs, one per SM" in plan.reason) == persistent
    assert (plan.cta_tiles is not None) == lists
    if lists:
        offsets, tiles = plan.cta_tiles
        assert offsets.size == grid_x + 1 and tiles.size == -(-n // plan.variant.br) * heads


# (mask, n, head dim, family override, extras) -> whether the plan re-blocks the mask for the 192-row
# tile (tiles.TMA_RULE_TILES: D 64 full from any length, D 64 causal and D 128 full from 2048 keys,
# D 128 causal from 8192)
RULE_CASES = [
    pytest.param(BlockMask.full, 1000, 64, None, {}, True, id="full-d64"),
    pytest.param(BlockMask.full, 2100, 128, None, {}, True, id="full-d128"),
    pytest.param(BlockMask.full, 1000, 128, None, {}, False, id="full-d128-short"),
    pytest.param(BlockMask.causal, 2100, 64, None, {}, True, id="causal-d64"),
    pytest.param(BlockMask.causal, 1000, 64, None, {}, False, id="causal-d64-short"),
    pytest.param(BlockMask.causal, 2100, 64, "tma", {}, True, id="causal-d64-forced-tma"),
    pytest.param(BlockMask.causal, 4000, 128, None, {}, False, id="causal-d128-short"),
    pytest.param(BlockMask.causal, 8200, 128, None, {}, True, id="causal-d128-from-8k"),
    pytest.param(BlockMask.full, 2100, 64, "wgmma", {}, False, id="wgmma-forced"),
    pytest.param(BlockMask.full, 2100, 96, None, {}, False, id="no-rule-tile-d96"),
    pytest.param(BlockMask.full, 2100, 256, None, {}, False, id="no-rule-tile-d256"),
    pytest.param(BlockMask.full, 2100, 64, None, {"bias": "fp32"}, False, id="bias"),
    pytest.param(built_causal, 2100, 64, None, {}, False, id="built-not-rule"),
    pytest.param(lambda q, k: BlockMask.full(q, k, q_block_size=384), 2100, 64, None, {}, False, id="already-divides"),
]


@pytest.mark.parametrize("make, n, head_dim, family, extras, reblocks", RULE_CASES)
def test_rule_masks_reblock_for_the_rule_tile(make, n, head_dim, family, extras, reblocks):
    from omnicupy.dispatch import plan as plan_mod

    bm = make(n, n)

    def planned():
        return plan_mod.plan_forward(head_dim=head_dim, dtype="fp16", batch=1, heads=2, block_mask=bm, stages=None,
                                     bias=extras.get("bias"), mask_expr=None, score_expr=None, arch="sm_90",
                                     family=family)

    plan = planned()
    assert (plan.block_mask is not None) == reblocks
    if reblocks:
        assert plan.variant.br == 192 and plan.block_mask.q_block_size == 192 and "re-blocked" in plan.reason
        assert plan.block_mask.kv_block_size == bm.kv_block_size and plan.block_mask.rule == bm.rule
        assert np.array_equal(plan.block_mask.to_dense(), bm.to_dense())  # the same element mask
        assert planned().block_mask is plan.block_mask  # kept on the caller's mask
    elif bm.q_block_size % 192 == 0:
        assert plan.variant.br == 192  # a rule mask whose blocks already fit takes the tile as it is
    else:
        assert plan.variant.br != 192


@pytest.mark.parametrize("head_dim, family, extras, br", [
    pytest.param(64, None, {}, 192, id="d64"),
    pytest.param(128, None, {}, 192, id="d128"),
    pytest.param(64, "wgmma", {}, 64, id="wgmma-forced"),
    pytest.param(64, None, {"bias": "fp32"}, 64, id="bias"),
])
def test_masks_built_at_192_row_blocks_take_the_block_tile(head_dim, family, extras, br):
    """Any mask with 192-row q blocks (tiles.TMA_BLOCK_TILES), PARTIAL blocks included; never re-blocked."""
    from omnicupy.dispatch import plan as plan_mod

    bm = BlockMask.from_mask_mod(masks.sliding_window(300), None, None, 2000, 2000, q_block_size=192)
    assert bm.features.partial and bm.rule is None
    plan = plan_mod.plan_forward(head_dim=head_dim, dtype="fp16", batch=1, heads=2, block_mask=bm, stages=None,
                                 bias=extras.get("bias"), mask_expr=None, score_expr=None, arch="sm_90", family=family)
    assert plan.variant.br == br and plan.block_mask is None
    assert (plan.variant.family == "tma") == (br == 192)


def test_only_rule_masks_reblock():
    from omnicupy.mask.builders import reblocked

    with pytest.raises(omnicupy.MaskError, match="rule"):
        reblocked(built_causal(300), 192)
    bm = BlockMask.causal(300, 500)
    assert reblocked(bm, 128) is bm and reblocked(bm, 192) is reblocked(bm, 192)


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
