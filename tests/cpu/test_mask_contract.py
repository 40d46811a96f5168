"""What a BlockMask and its builders refuse or guarantee (issue 17): the mask owns what it validated,
CAUSAL only where the diagonal cuts a block, mask_mod results boolean and of the grid's shape, four
arguments, mask_mods written for flex's scalar (vmap) semantics, sizes the int32 metadata can hold."""
from __future__ import annotations

import logging
import time
import tracemalloc

import numpy as np
import pytest

from omnicupy import BlockMask, MaskError, masks
from omnicupy.mask import builders, compile_mask, evaluate
from omnicupy.mask.block_mask import causal_band, check_sizes
from omnicupy.mask.types import BlockType, cdiv, max_length


@pytest.fixture(autouse=True)
def python_evaluation(monkeypatch):
    """These tests are about how Python mask_mods are evaluated: the mask compiler is off."""
    monkeypatch.setattr(compile_mask, "ENABLED", False)


# ------------------------------------------------------------------------------------ ownership
def test_mask_owns_the_arrays_it_validated():
    nb = np.array([[[1, 2]]], np.int32)
    idx = np.array([[[[0, 0], [0, 1]]]], np.int32)
    types = np.array([[[[BlockType.CAUSAL, 0], [BlockType.FULL, BlockType.CAUSAL]]]], np.int32)
    bm = BlockMask(nb, idx, types, q_len=256, kv_len=256)
    before = bm.to_dense().copy()
    idx[0, 0, 1, 1] = 99  # the caller changes its arrays afterwards
    types[0, 0, 0, 0] = BlockType.PARTIAL
    nb[0, 0, 0] = 2
    np.testing.assert_array_equal(bm.to_dense(), before)
    assert int(bm.kv_indices[0, 0, 1, 1]) == 1 and int(bm.kv_num_blocks[0, 0, 0]) == 1
    for a in (bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types):
        assert not a.flags.writeable  # and nobody changes them through the mask either
        with pytest.raises(ValueError):
            a[(0,) * a.ndim] = 0


def test_owned_copy_keeps_broadcast_dims_broadcast():
    row = np.array([[[[BlockType.FULL]]]], np.int32)
    types = np.broadcast_to(row, (4, 8, 1, 1))
    bm = BlockMask(np.broadcast_to(np.int32(1), (4, 8, 1)), np.zeros((4, 8, 1, 1), np.int32), types,
                   q_len=100, kv_len=100)
    assert bm.block_mask_types.strides[:2] == (0, 0) and bm.kv_num_blocks.strides[:2] == (0, 0)
    row[...] = BlockType.CAUSAL  # the broadcast view's base belongs to the caller
    assert int(bm.block_mask_types[3, 7, 0, 0]) == BlockType.FULL


def test_builder_arrays_are_read_only():
    bm = builders.from_mask_mod(masks.sliding_window(100), 2, None, 500, 500, q_block_size=64, kv_block_size=64, xp=np)
    for a in (bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, bm.partial_block_mask_indices,
              bm.partial_block_masks, bm.q_block_work):
        assert not a.flags.writeable


# ----------------------------------------------------------------------------- the causal band
def brute_force_band(q_len, kv_len, qbs, kbs):
    """[nQB, nKVB]: blocks with a real element at or below the diagonal and one above it."""
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
    out = np.zeros((nqb, nkvb), bool)
    for i in range(nqb):
        for j in range(nkvb):
            below = q[i * qbs:(i + 1) * qbs] >= kv[:, j * kbs:(j + 1) * kbs]
            out[i, j] = below.any() and not below.all()
    return out


@pytest.mark.parametrize("q_len,kv_len,qbs,kbs", [
    pytest.param(256, 256, 128, 128, id="square"),
    pytest.param(100, 200, 128, 128, id="q-shorter"),
    pytest.param(300, 129, 128, 128, id="one-column-last-kv-block"),
    pytest.param(129, 300, 128, 64, id="one-row-last-q-block"),
    pytest.param(1000, 333, 64, 32, id="small-kv-blocks"),
    pytest.param(333, 1000, 16, 256, id="wide-kv-blocks"),
    pytest.param(1, 1, 16, 32, id="one-element"),
])
def test_causal_band_is_where_the_diagonal_cuts_real_positions(q_len, kv_len, qbs, kbs):
    nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
    got = causal_band(np.arange(nqb)[:, None], np.arange(nkvb)[None, :], q_len, kv_len, qbs, kbs)
    np.testing.assert_array_equal(got, brute_force_band(q_len, kv_len, qbs, kbs))
    # Every block off the band is refused as CAUSAL, every block on it accepted.
    for (i, j), on_band in np.ndenumerate(got):
        grid = np.zeros((1, 1, nqb, nkvb), np.int32)
        grid[0, 0, i, j] = BlockType.CAUSAL
        if on_band:
            BlockMask.from_block_types(grid, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs)
        else:
            with pytest.raises(MaskError, match="CAUSAL blocks that the diagonal"):
                BlockMask.from_block_types(grid, q_len=q_len, kv_len=kv_len, q_block_size=qbs, kv_block_size=kbs)


@pytest.mark.parametrize("q_len,kv_len", [(256, 256), (100, 200), (300, 129), (1000, 1000), (129, 4097), (5000, 77)])
@pytest.mark.parametrize("qbs,kbs", [(128, 128), (128, 64), (64, 128), (256, 32), (16, 32)])
def test_causal_rule_is_valid_metadata(q_len, kv_len, qbs, kbs):
    """The compact causal rows (strided or written out) pass the full checks, band included."""
    bm = BlockMask.causal(q_len, kv_len, q_block_size=qbs, kv_block_size=kbs)
    again = BlockMask(bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, q_len=q_len, kv_len=kv_len,
                      q_block_size=qbs, kv_block_size=kbs)
    assert again.features == bm.features and again.summary.counts == bm.summary.counts
    np.testing.assert_array_equal(again.q_block_work, bm.q_block_work)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], np.tri(q_len, kv_len, dtype=bool))


# ---------------------------------------------------------------------------- mask_mod results
def kv_only(b, h, q_idx, kv_idx):
    return kv_idx % 3 == 0  # shape [K, 1, kbs]: broadcasts to the grid


@pytest.mark.parametrize("mod, match", [
    pytest.param(lambda b, h, q, kv: (q >= kv).astype(np.int64), "returned int64 values", id="int"),
    pytest.param(lambda b, h, q, kv: (q - kv) * 0.5, "returned float64 values", id="float"),
    pytest.param(lambda b, h, q, kv: 1, "returned a int", id="python-int"),
    pytest.param(lambda b, h, q, kv: (q >= kv)[..., None], "returned shape", id="extra-dim"),
    pytest.param(lambda b, h, q, kv: (q >= kv)[:, :, :2], "returned shape", id="cut-grid"),
    pytest.param(lambda b, h, q, kv: np.ones((1, 2, 1), bool), "returned shape", id="wrong-broadcast"),
])
def test_bad_results_are_refused(mod, match):
    with pytest.raises(MaskError, match=match):
        builders.from_mask_mod(mod, None, None, 100, 100, q_block_size=64, kv_block_size=64, xp=np,
                               mode="broadcast")


@pytest.mark.parametrize("mod, expected", [
    pytest.param(lambda b, h, q, kv: True, np.ones((100, 90), bool), id="python-bool"),
    pytest.param(lambda b, h, q, kv: np.bool_(False), np.zeros((100, 90), bool), id="numpy-bool"),
    pytest.param(kv_only, np.broadcast_to(np.arange(90) % 3 == 0, (100, 90)), id="kv-only"),
])
def test_boolean_results_of_any_broadcast_shape_are_used(mod, expected):
    bm = builders.from_mask_mod(mod, None, None, 100, 90, q_block_size=64, kv_block_size=64, xp=np, mode="broadcast")
    np.testing.assert_array_equal(bm.to_dense()[0, 0], expected)


def test_not_mask_refuses_non_boolean_masks():
    with pytest.raises(MaskError, match="returned int64 values"):
        builders.from_mask_mod(masks.not_mask(lambda b, h, q, kv: (q - kv).astype(np.int64)), None, None, 64, 64,
                               xp=np)


@pytest.mark.parametrize("build", [
    pytest.param(lambda f: BlockMask.from_mask_mod(f, None, None, 64, 64), id="from_mask_mod"),
    pytest.param(lambda f: masks.and_masks(masks.causal(), f), id="and_masks"),
    pytest.param(lambda f: masks.MaskMod(f), id="MaskMod"),
    pytest.param(lambda f: BlockMask.from_flex(np.zeros((1, 1, 1), np.int32), np.zeros((1, 1, 1, 1), np.int32),
                                               q_len=64, kv_len=64, mask_mod=f), id="from_flex"),
])
@pytest.mark.parametrize("fn", [
    pytest.param(lambda q_idx, kv_idx: q_idx >= kv_idx, id="two-args"),
    pytest.param(lambda b, h, q_idx, kv_idx, extra: q_idx >= kv_idx, id="five-args"),
])
def test_wrong_arity_is_named(build, fn):
    with pytest.raises(MaskError, match=r"must take four positional arguments \(b, h, q_idx, kv_idx\)"):
        build(fn)


def test_unknown_mode():
    with pytest.raises(MaskError, match="mode must be one of"):
        BlockMask.from_mask_mod(masks.causal(), None, None, 64, 64, mode="fast")


# ---------------------------------------------------------------- flex's scalar (vmap) semantics
def flamingo(intervals: np.ndarray, image_token_length: int):
    """attention-gym's Flamingo vision cross-attention mask_mod, ported by swapping torch for NumPy:
    written for flex's scalar semantics (each index one number), it breaks on index arrays."""
    image_boundaries = np.repeat(np.arange(intervals.shape[0]), image_token_length)

    def vision_cross_attention(b, h, q_idx, kv_idx):
        image_idx = image_boundaries[kv_idx]
        interval = intervals[image_idx]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return vision_cross_attention


INTERVALS = np.array([[0, 70], [50, 180], [180, 250]])  # text rows attending to each image, 3 images
IMAGE_TOKENS = 40  # kv_len = 120


def flamingo_reference(q_len: int) -> np.ndarray:
    """The mask by four-scalar calls, as flex's vmap would evaluate it."""
    fn = flamingo(INTERVALS, IMAGE_TOKENS)
    kv_len = INTERVALS.shape[0] * IMAGE_TOKENS
    return np.array([[bool(fn(0, 0, q, kv)) for kv in range(kv_len)] for q in range(q_len)])


@pytest.mark.parametrize("qbs,kbs", [(64, 64), (16, 32), (128, 32)])
def test_flamingo_mask_in_scalar_mode(qbs, kbs):
    q_len, kv_len = 250, INTERVALS.shape[0] * IMAGE_TOKENS
    bm = builders.from_mask_mod(flamingo(INTERVALS, IMAGE_TOKENS), None, None, q_len, kv_len, q_block_size=qbs,
                                kv_block_size=kbs, xp=np, mode="scalar")
    np.testing.assert_array_equal(bm.to_dense()[0, 0], flamingo_reference(q_len))


def test_flamingo_mask_falls_back_to_scalar_mode_once_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="omnicupy.mask"):
        bm = builders.from_mask_mod(flamingo(INTERVALS, IMAGE_TOKENS), None, None, 250, 120, q_block_size=64,
                                    kv_block_size=32, xp=np)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], flamingo_reference(250))
    assert any("scalar mode" in r.getMessage() and r.name == "omnicupy.mask" for r in caplog.records)


def test_flamingo_mask_from_flex_arrays():
    """flex's partial blocks classified through the scalar mode (mode='auto')."""
    full = builders.from_mask_mod(flamingo(INTERVALS, IMAGE_TOKENS), None, None, 250, 120, q_block_size=64,
                                  kv_block_size=32, xp=np, mode="scalar")
    nqb, nkvb = full.num_q_blocks, full.num_kv_blocks
    listed = np.broadcast_to(np.arange(nkvb, dtype=np.int32), (1, 1, nqb, nkvb))  # every block "partial"
    again = BlockMask.from_flex(np.full((1, 1, nqb), nkvb, np.int32), listed, q_len=250, kv_len=120,
                                q_block_size=64, kv_block_size=32, mask_mod=flamingo(INTERVALS, IMAGE_TOKENS))
    np.testing.assert_array_equal(again.to_dense(), full.to_dense())


def test_flamingo_mask_in_broadcast_mode_names_the_contract():
    with pytest.raises(MaskError, match="broadcast index arrays.*mode='scalar'"):
        builders.from_mask_mod(flamingo(INTERVALS, IMAGE_TOKENS), None, None, 250, 120, q_block_size=64,
                               kv_block_size=32, xp=np, mode="broadcast")


def silently_wrong(b, h, q_idx, kv_idx):
    """Right with scalars (q_idx >= kv_idx); on arrays it compares with the smallest kv of the chunk,
    a result of a legal shape and wrong values."""
    return q_idx >= np.min(kv_idx)


def test_a_silently_wrong_broadcast_is_caught():
    with pytest.raises(MaskError, match="different answer on broadcast index arrays"):
        builders.from_mask_mod(silently_wrong, None, None, 200, 200, q_block_size=64, kv_block_size=64, xp=np,
                               mode="broadcast")
    bm = builders.from_mask_mod(silently_wrong, None, None, 200, 200, q_block_size=64, kv_block_size=64, xp=np)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], np.tri(200, dtype=bool))  # the scalar mode's answer


def test_automatic_scalar_mode_has_a_limit(monkeypatch):
    monkeypatch.setattr(evaluate, "AUTO_SCALAR_CALL_LIMIT", 10)
    with pytest.raises(MaskError, match="pass mode='scalar' to wait for them"):
        builders.from_mask_mod(flamingo(INTERVALS, IMAGE_TOKENS), None, None, 250, 120, q_block_size=64,
                               kv_block_size=32, xp=np)


def test_scalar_mode_refuses_a_mask_mod_that_works_neither_way():
    def broken(b, h, q_idx, kv_idx):
        raise KeyError("no such table")

    with pytest.raises(MaskError, match="cannot be evaluated in the scalar mode either"):
        builders.from_mask_mod(broken, None, None, 64, 64, xp=np, mode="scalar")


def test_broadcast_mask_mods_in_scalar_mode_give_the_same_metadata():
    for mod in (masks.document(masks.doc_ids_from_lengths([30, 70, 100])), masks.dilated_sliding_window(9, 4)):
        broadcast = builders.from_mask_mod(mod, None, None, 200, 200, q_block_size=64, kv_block_size=32, xp=np,
                                           use_structure=False)
        scalar = builders.from_mask_mod(mod, None, None, 200, 200, q_block_size=64, kv_block_size=32, xp=np,
                                        use_structure=False, mode="scalar")
        np.testing.assert_array_equal(scalar.to_dense(), broadcast.to_dense())
        np.testing.assert_array_equal(scalar.partial_block_masks, broadcast.partial_block_masks)


# ------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("build", [
    pytest.param(lambda: BlockMask.causal(2**31, 2**31), id="causal"),
    pytest.param(lambda: BlockMask.full(2**40, 8), id="full"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 2**31, 2**31), id="from_mask_mod"),
    pytest.param(lambda: BlockMask.causal(2**31 - 1, 2**31 - 1, bottom_right=True), id="bottom-right"),
    pytest.param(lambda: BlockMask.from_flex(np.zeros((1, 1, 2**24), np.int32), np.zeros((1, 1, 2**24, 1), np.int32),
                                             q_len=2**31, kv_len=128), id="from_flex"),
])
def test_sizes_past_int32_are_refused_before_any_allocation(build):
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(MaskError, match=r"is too long: positions are 32-bit ints .* can be at most"):
            build()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - started < 1.0
    assert peak < (300 << 20)  # only from_flex's own (caller-made) arrays are that big


@pytest.mark.parametrize("qbs,kbs", [(16, 32), (128, 128), (64, 256), (256, 512)])
def test_the_longest_accepted_lengths(qbs, kbs):
    """The longest lengths: whole blocks up to them plus one more block stay below 2**31."""
    for block, args in ((qbs, lambda n: (n, 8, qbs, kbs)), (kbs, lambda n: (8, n, qbs, kbs))):
        longest = max_length(block)
        assert (cdiv(longest, block) + 1) * block <= 2**31 - 1
        assert max(check_sizes(*args(longest))[:2]) == longest
        with pytest.raises(MaskError, match="too long"):
            check_sizes(*args(longest + 1))
