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
