"""BlockMask core: constructor validation, the element mask it encodes, the causal/full builders."""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import BlockMask, BlockType, MaskError

from helpers import random_block_mask, shuffled


def meta(nb, idx, types):
    return np.asarray(nb, np.int32), np.asarray(idx, np.int32), np.asarray(types, np.int32)


# One q block and two kv blocks of 128 each: q_len 100, kv_len 200. The diagonal cuts kv block 0
# (CAUSAL there is valid); kv block 1 lies wholly above it.
GOOD = dict(q_len=100, kv_len=200)
NB, IDX, TYPES = [[[2]]], [[[[0, 1]]]], [[[[1, 2]]]]

BAD = [
    pytest.param(meta([[[-1]]], IDX, TYPES), GOOD, "negative", id="nb-negative"),
    pytest.param(meta([[[3]]], IDX, TYPES), GOOD, "larger than", id="nb-too-big"),
    pytest.param(meta(NB, [[[[0, 2]]]], TYPES), GOOD, "outside", id="index-out-of-range"),
    pytest.param(meta(NB, [[[[-1, 1]]]], TYPES), GOOD, "outside", id="index-negative"),
    pytest.param(meta(NB, [[[[1, 1]]]], TYPES), GOOD, "twice", id="index-repeated"),
    pytest.param(meta(NB, IDX, [[[[2, 7]]]]), GOOD, "block_mask_types", id="type-unknown"),
    pytest.param(meta(NB, IDX, [[[[3, 2]]]]), GOOD, "PARTIAL", id="partial-without-pool"),
    pytest.param(meta(NB, IDX, [[[[2, 1]]]]), GOOD, "CAUSAL blocks that the diagonal", id="causal-above-diagonal"),
    pytest.param(meta([[[1, 2]]], [[[[0, 0], [0, 1]]]], [[[[2, 0], [1, 2]]]]), dict(q_len=256, kv_len=256),
                 "CAUSAL blocks that the diagonal", id="causal-below-diagonal"),
    pytest.param(meta(NB, IDX, TYPES), dict(q_len=2**31, kv_len=200), "q_len=2147483648 is too long",
                 id="q-len-past-int32"),
    pytest.param(meta(NB, IDX, TYPES), dict(q_len=100, kv_len=2**31 - 129), "kv_len=2147483519 is too long",
                 id="kv-len-past-last-block"),
    pytest.param(meta([[2]], IDX, TYPES), GOOD, "kv_num_blocks must have 3", id="nb-ndim"),
    pytest.param(meta(NB, [[[0, 1]]], TYPES), GOOD, "kv_indices must have 4", id="idx-ndim"),
    pytest.param(meta(NB, IDX, [[[[2, 1, 0]]]]), GOOD, "block_mask_types shape", id="types-shape"),
    pytest.param(meta([[[2, 2]]], IDX, TYPES), GOOD, "q blocks", id="nqb-mismatch"),
    pytest.param((np.float32([[[2]]]), *meta(NB, IDX, TYPES)[1:]), GOOD, "integer", id="nb-float"),
    pytest.param(meta(NB, IDX, TYPES), dict(q_len=0, kv_len=200), "q_len", id="q-len-zero"),
    pytest.param(meta(NB, IDX, TYPES), dict(GOOD, kv_block_size=48), "multiple of 32", id="kv-block-size"),
    pytest.param(meta(NB, IDX, TYPES), dict(GOOD, q_block_size=100), "multiple of 16", id="q-block-size"),
]


@pytest.mark.parametrize("arrays,kwargs,message", BAD)
def test_constructor_rejects(arrays, kwargs, message):
    with pytest.raises(MaskError, match=message):
        BlockMask(*arrays, **kwargs)


def test_partial_index_out_of_pool():
    nb, idx, _ = meta(NB, IDX, TYPES)
    pool = np.zeros((1, 128, 4), np.uint32)
    with pytest.raises(MaskError, match="pool"):
        BlockMask(nb, idx, np.int32([[[[3, 3]]]]), **GOOD, partial_block_mask_indices=np.int32([[[[0, 1]]]]),
                  partial_block_masks=pool)
    with pytest.raises(MaskError, match="partial_block_masks must have shape"):
        BlockMask(nb, idx, np.int32([[[[3, 2]]]]), **GOOD, partial_block_mask_indices=np.int32([[[[0, 0]]]]),
                  partial_block_masks=np.zeros((1, 64, 4), np.uint32))


@pytest.mark.parametrize("q_len,kv_len,qbs,kbs", [(1, 1, 128, 128), (77, 300, 64, 128), (300, 77, 128, 64),
                                                  (1000, 1000, 128, 256), (513, 1025, 256, 32)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_builtin_builders_encode_their_rule(q_len, kv_len, qbs, kbs, causal):
    build = BlockMask.causal if causal else BlockMask.full
    bm = build(q_len, kv_len, q_block_size=qbs, kv_block_size=kbs)
    qi, ki = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    want = (qi >= ki) if causal else np.ones((q_len, kv_len), bool)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], want)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("q_len,kv_len,qbs,kbs", [(300, 300, 64, 64), (77, 1000, 128, 256), (1000, 77, 64, 32)])
def test_to_dense_matches_independent_mask(q_len, kv_len, qbs, kbs, shuffle):
    rng = np.random.default_rng(q_len + kv_len)
    bm, dense = random_block_mask(rng, 2, 3, q_len, kv_len, qbs, kbs, empty_q_blocks=1, shuffle=shuffle)
    np.testing.assert_array_equal(bm.to_dense(), dense)


def test_inspection():
    bm = BlockMask.causal(256, 256, q_block_size=64, kv_block_size=64)
    assert bm.shape == (1, 1, 256, 256)
    assert bm.sparsity() == pytest.approx(100 * 6 / 16)
    assert bm.to_string().splitlines() == ["\\...", "#\\..", "##\\.", "###\\"]
    assert "sparsity=37.50%" in repr(bm) and "causal=4" in repr(bm)
    assert bm.features.causal and not bm.features.partial


def test_shuffled_masked_entries_do_not_count():
    rng = np.random.default_rng(5)
    bm, dense = random_block_mask(rng, 1, 1, 256, 512, 64, 64)
    np.testing.assert_array_equal(shuffled(bm, rng).to_dense(), dense)
    grid = bm.block_grid()
    assert set(np.unique(grid)) <= {int(t) for t in BlockType}


@pytest.mark.parametrize("q_len,kv_len", [(1, 300), (7, 1000), (300, 77), (129, 4097), (300, 300)])
def test_bottom_right_causal_encodes_its_rule(q_len, kv_len):
    bm = BlockMask.causal(q_len, kv_len, bottom_right=True, q_block_size=64, kv_block_size=64)
    qi, ki = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], qi + kv_len - q_len >= ki)
