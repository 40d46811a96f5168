"""Launch order of q tiles (omnicupy.dispatch.schedule): host-side parts, no GPU needed."""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import BlockMask, masks
from omnicupy.mask import builders
from omnicupy.dispatch import schedule
from omnicupy.mask.block_mask import BlockType


def test_work_weights_by_block_type():
    # one q block row: a FULL and a CAUSAL entry (which the diagonal cuts), then an entry past the row's count
    types = np.array([[[[BlockType.FULL, BlockType.CAUSAL, BlockType.MASKED]]]], dtype=np.int32)
    bm = BlockMask(np.array([[[2]]], dtype=np.int32), np.array([[[[0, 1, 0]]]], dtype=np.int32), types,
                   q_len=256, kv_len=256, q_block_size=256)
    assert schedule.q_block_work(bm).tolist() == [2 + 1]


@pytest.mark.parametrize("junk", [-1, 77])
def test_entries_past_the_count_are_ignored(junk):
    types = np.array([[[[BlockType.FULL, junk]]]], dtype=np.int32)
    bm = BlockMask(np.array([[[1]]], dtype=np.int32), np.array([[[[0, 1]]]], dtype=np.int32), types,
                   q_len=128, kv_len=256)
    assert schedule.q_block_work(bm).tolist() == [2]


@pytest.mark.parametrize("work,q_len,qbs,br,expected", [
    ([1, 5, 3], 384, 128, 128, [1, 2, 0]),                    # heaviest first
    ([2, 2, 2], 384, 128, 128, [2, 1, 0]),                    # ties: the later tile first (the kernel's default)
    ([1, 4], 256, 128, 64, [3, 2, 1, 0]),                     # tiles smaller than blocks share the block's work
    ([3, 1], 200, 128, 64, [1, 0, 3, 2]),                     # a partial last tile counts as one
])
def test_heaviest_first(work, q_len, qbs, br, expected):
    order = schedule.heaviest_first(np.array(work), q_len, qbs, br)
    assert order.tolist() == expected and order.dtype == np.int32
    assert sorted(order.tolist()) == list(range(len(expected)))  # a permutation: every tile runs once


def test_causal_order_is_the_default_order():
    """For causal masks heaviest first is last tile first, which the kernel does with no array."""
    bm = BlockMask.causal(1000, 1000)
    order = schedule.heaviest_first(schedule.q_block_work(bm), 1000, 128, 64)
    assert order.tolist() == list(range(len(order)))[::-1]


def test_document_order_puts_long_document_ends_first():
    ids = np.repeat(np.arange(3), [256, 1024, 256])
    bm = builders.from_mask_mod(masks.document(ids, causal=True), None, None, ids.size, ids.size, xp=np)
    order = schedule.heaviest_first(schedule.q_block_work(bm), ids.size, 128, 128)
    assert order[0] == 9  # the last q block of the 1024-token document (blocks 2..9)


def test_schedule_environment_value(monkeypatch):
    from omnicupy.jit import env

    monkeypatch.setenv("OMNICUPY_SCHEDULE", "random")
    with pytest.raises(ValueError, match="OMNICUPY_SCHEDULE"):
        env.schedule()
    monkeypatch.setenv("OMNICUPY_SCHEDULE", "natural")
    assert env.schedule() == "natural"


def _loads(work_by_rank: np.ndarray, flat_tiles: np.ndarray, q_tiles: int) -> np.ndarray:
    return work_by_rank[flat_tiles % q_tiles]


@pytest.mark.parametrize("n,batch,heads,ctas", [
    (8192, 1, 16, 132),    # causal, 128 tiles per head: 2048 tiles on 132 SMs
    (1000, 3, 5, 7),       # a partial last tile, odd counts
    (4096, 2, 1, 33),
])
def test_cta_tile_lists_partition_and_balance_causal(n, batch, heads, ctas):
    bm, br = BlockMask.causal(n, n), 128
    q_tiles = -(-n // br)
    offsets, tiles = schedule.cta_tile_lists(bm, br, batch, heads, ctas)
    total = q_tiles * batch * heads
    assert offsets.dtype == np.int32 and tiles.dtype == np.int32
    assert offsets[0] == 0 and offsets[-1] == total and offsets.size == ctas + 1 and np.all(np.diff(offsets) >= 0)
    assert sorted(tiles.tolist()) == list(range(total))  # every tile exactly once
    for c in range(ctas):  # each CTA walks its tiles in flat order (heads together, K/V shared in L2)
        own = tiles[offsets[c]:offsets[c + 1]]
        assert np.all(np.diff(own) > 0)
    # work by rank: rank r runs q tile q_tiles - 1 - r (the causal default order, heaviest first)
    ranked = np.arange(q_tiles - 1, -1, -1) * br // bm.q_block_size
    work = schedule.q_block_work(bm)[ranked]
    lpt = np.add.reduceat(_loads(work, tiles, q_tiles), offsets[:-1]) if total else None
    stride = np.bincount(np.arange(total) % ctas, weights=_loads(work, np.arange(total), q_tiles), minlength=ctas)
    assert lpt.max() <= stride.max() and lpt.max() <= lpt.mean() + work.max()  # LPT bound: mean + one tile


@pytest.mark.parametrize("make", [
    lambda: BlockMask.full(4096, 4096),                # every tile costs the same: grid stride is exact
    lambda: BlockMask.causal(256, 256),                # fewer tiles than CTAs
])
def test_cta_tile_lists_none_when_grid_stride_is_exact(make):
    assert schedule.cta_tile_lists(make(), 128, 1, 2, 4 if make().q_len == 256 else 132) is None


def test_cta_tile_lists_cached_and_capped(monkeypatch):
    bm = BlockMask.causal(4096, 4096)
    first = schedule.cta_tile_lists(bm, 128, 1, 8, 132)
    assert schedule.cta_tile_lists(bm, 128, 1, 8, 132) is first
    monkeypatch.setattr(schedule, "MAX_ASSIGNED_TILES", 100)
    assert schedule.cta_tile_lists(bm, 128, 1, 8, 131) is None  # 256 tiles > cap: grid stride


def test_schedule_arrays_go_to_the_device_once(monkeypatch):
    """ops/forward uploads a plan's q tile order and per-CTA tile lists once per device, cached on
    the mask; absent arrays stay null fields."""
    from types import SimpleNamespace

    from omnicupy import arrays
    from omnicupy.dispatch import plan as plan_module
    from omnicupy.ops import forward

    monkeypatch.setattr(plan_module, "sm_count", lambda: 132)
    planned = {}
    for name, bm in (("causal", BlockMask.causal(8192, 8192)), ("full", BlockMask.full(8192, 8192))):
        planned[name] = bm, plan_module.plan_forward(head_dim=128, dtype="fp16", batch=1, heads=16, block_mask=bm,
                                                     stages=None, bias=None, mask_expr=None, score_expr=None,
                                                     arch="sm_90", family="tma")
    device = [0]
    uploads = []
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: device[0])))
    monkeypatch.setattr(arrays, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(arrays, "upload", lambda host: uploads.append(host) or ("on", device[0], host))
    bm, plan = planned["causal"]
    first = forward._cta_tile_fields(bm, plan)
    assert first["cta_tiles"][:2] == ("on", 0) and first["cta_tiles"][2] is plan.cta_tiles[0]
    assert first["tile_list"][:2] == ("on", 0) and first["tile_list"][2] is plan.cta_tiles[1]
    again = forward._cta_tile_fields(bm, plan)
    assert again["cta_tiles"] is first["cta_tiles"] and again["tile_list"] is first["tile_list"] and len(uploads) == 2
    device[0] = 1
    assert forward._cta_tile_fields(bm, plan)["tile_list"][:2] == ("on", 1) and len(uploads) == 4
    full, plan_full = planned["full"]
    assert forward._cta_tile_fields(full, plan_full) == {"cta_tiles": None, "tile_list": None}
    assert forward._on_device(full, ("order", 128), plan_full.q_tile_order) is None and len(uploads) == 4
