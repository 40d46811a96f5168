"""The built-in masks' piecewise bounds (mask/pieces.py) and the builds that use them: the pieces
are the row bounds, and a build from the pieces lays out exactly what the row path, the generic
path (every block evaluated) and the element-level rule say."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from omnicupy import masks
from omnicupy.errors import MaskError
from omnicupy import BlockMask
from omnicupy.mask import build_pass, builders, kernels, layout, mask_mod, pieces, pieces_build
from omnicupy.reference import dense_mask_from_mod

from mask_cases import HOST_AS_DEVICE, MASK_CASES, alternating_segments, random_lengths

METADATA = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
WITH_PIECES = [pytest.param(f, id=i) for i, f in MASK_CASES if f(8, 8).pieces is not None]
SIZES = [(1, 1), (77, 300), (300, 77), (1000, 1000), (1000, 333), (1025, 1025)]
BLOCKS = [(64, 64), (128, 128), (64, 128), (128, 64), (16, 32)]

# Masks whose pieces meet many block edges: tiny documents (several per q block), segments that
# start inside blocks, windows wider than the rows, a bottom-right causal mask.
EXTRA = [
    pytest.param(lambda q, k: masks.document(masks.doc_ids_from_lengths(random_lengths(max(q, k), 1, 9, seed=5))),
                 id="document_tiny"),
    pytest.param(lambda q, k: masks.interleaved(alternating_segments(max(q, k), 3, 200)), id="interleaved_3_200"),
    pytest.param(lambda q, k: masks.sliding_window(5000), id="sliding_window_5000"),
    pytest.param(lambda q, k: masks.causal(k - q), id="causal_bottom_right"),
    pytest.param(lambda q, k: masks.local_window(0, 700), id="local_window_0_700"),
    pytest.param(lambda q, k: masks.prefix_lm(0), id="prefix_lm_0"),
    pytest.param(lambda q, k: masks.dilated_sliding_window(70, 1), id="dilated_sliding_window_70_1"),
]


PIECES_FROM_Q_BLOCKS = mask_mod.PIECES_FROM_Q_BLOCKS  # the default, before the fixture below sets 0


@pytest.fixture(autouse=True)
def always_grouped(monkeypatch):
    """Build from pieces and group cut blocks by key however few the q blocks and cut blocks (the
    other test files build with the defaults)."""
    monkeypatch.setattr(build_pass, "GROUP_CUT_BLOCKS_FROM", 0)  # read by the build pass (since the builders split)
    monkeypatch.setattr(mask_mod, "PIECES_FROM_Q_BLOCKS", 0)


def without_pieces(mod: masks.MaskMod) -> masks.MaskMod:
    """The same mask with its row bounds only: built by the row path."""
    return masks.MaskMod(mod.fn, mod.name, bounds=mod.bounds, bounds_exact=mod.bounds_exact, length=mod.length,
                         batch=mod.batch, pointwise=mod.pointwise)


def assert_same_metadata(got: BlockMask, want: BlockMask, what: str) -> None:
    for name in METADATA:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("q_len", [1, 100, 1000, 4097])
@pytest.mark.parametrize("factory", WITH_PIECES + EXTRA)
def test_pieces_are_the_row_bounds(factory, q_len):
    mod = factory(q_len, q_len)
    start, end = mod.pieces.rows(q_len)
    want_start, want_end = (np.broadcast_to(a, (q_len,)) for a in mod.bounds(0, 0, np.arange(q_len)))
    np.testing.assert_array_equal(start, want_start)
    np.testing.assert_array_equal(end, want_end)


@pytest.mark.parametrize("q_len, qbs", [(1, 16), (1000, 64), (1025, 128), (4097, 16)], ids=str)
@pytest.mark.parametrize("factory", WITH_PIECES + EXTRA)
def test_block_rows_are_the_rows_of_those_blocks(factory, q_len, qbs):
    """Rows of chosen q blocks (repeats, any order) from the sub-pieces equal the pieces' own rows;
    rows past q_len are left to the cut-block rules, so only real rows are compared."""
    mod = factory(q_len, q_len)
    start, end = mod.pieces.rows(q_len)
    nqb = -(-q_len // qbs)
    blocks = np.random.default_rng(q_len).integers(0, nqb, size=2 * nqb + 3)
    got_start, got_end = pieces.block_pieces(mod.pieces, q_len, qbs).block_rows(blocks)
    rows = blocks[:, None] * qbs + np.arange(qbs)
    real = rows < q_len
    for got, want in ((got_start, start), (got_end, end)):
        assert got.shape == (len(blocks), qbs) and got.dtype in (np.int32, np.int64)
        np.testing.assert_array_equal(got[real], want[rows[real]])


def test_block_rows_keep_int64_for_bounds_past_int32():
    far = pieces.Pieces.of([0, 10], [0, 2**31], [0, 0], [2**31 + 5, 2**31 + 9], [0, 1])
    start, end = pieces.block_pieces(far, 20, 16).block_rows(np.array([0, 1]))
    assert start.dtype == np.int64
    np.testing.assert_array_equal(end[0, 9:12], [2**31 + 5, 2**31 + 9, 2**31 + 10])


@pytest.mark.parametrize("qbs, kbs", BLOCKS, ids=str)
@pytest.mark.parametrize("q_len, kv_len", SIZES, ids=str)
@pytest.mark.parametrize("factory", WITH_PIECES + EXTRA)
def test_builds_from_pieces_equal_the_row_path_and_the_generic_path(factory, q_len, kv_len, qbs, kbs):
    mod = factory(q_len, kv_len)
    sizes = dict(q_block_size=qbs, kv_block_size=kbs, xp=np)
    got = builders.from_mask_mod(mod, None, None, q_len, kv_len, **sizes)
    assert_same_metadata(got, builders.from_mask_mod(without_pieces(mod), None, None, q_len, kv_len, **sizes),
                         "row path")
    assert_same_metadata(got, builders.from_mask_mod(mod, None, None, q_len, kv_len, use_structure=False, **sizes),
                         "generic path")
    assert got.summary.counts == builders.from_mask_mod(without_pieces(mod), None, None, q_len, kv_len,
                                                        **sizes).summary.counts


@pytest.mark.parametrize("factory", WITH_PIECES + EXTRA)
def test_builds_from_pieces_are_the_element_rule(factory):
    q_len, kv_len = 700, 1100
    mod = factory(q_len, kv_len)
    bm = builders.from_mask_mod(mod, None, 2, q_len, kv_len, q_block_size=64, kv_block_size=32, xp=np)
    np.testing.assert_array_equal(bm.to_dense()[0, 1], dense_mask_from_mod(mod, 1, 1, q_len, kv_len)[0, 0])


def test_a_key_collision_falls_back_to_one_group_per_block(monkeypatch):
    mod = masks.document(masks.doc_ids_from_lengths(random_lengths(3000, 20, 300, seed=2)))
    want = builders.from_mask_mod(mod, None, None, 3000, 3000, q_block_size=64, kv_block_size=64, xp=np)
    monkeypatch.setattr(pieces, "_mixed", lambda x: np.zeros_like(x))  # every block hashes alike
    got = builders.from_mask_mod(mod, None, None, 3000, 3000, q_block_size=64, kv_block_size=64, xp=np)
    assert_same_metadata(got, want, "collision")


def test_cut_blocks_are_grouped_by_pattern():
    """A sliding window's interior cut blocks all have one pattern: one representative."""
    bp = pieces.block_pieces(masks.sliding_window(1024).pieces, 8192, 128)
    q_block = np.arange(8, 64)
    reps, group = pieces.group_cut_blocks(bp, q_block, (q_block - 8) * 128, 8192, 128)
    assert len(reps) == 1 and np.all(group == 0)


@pytest.mark.parametrize("args", [dict(q=[1], start=0, start_slope=0, end=1, end_slope=1),
                                  dict(q=[0, 5, 5], start=0, start_slope=0, end=1, end_slope=1),
                                  dict(q=0, start=0, start_slope=2, end=1, end_slope=1)], ids=str)
def test_bad_pieces_are_refused(args):
    with pytest.raises(MaskError):
        pieces.Pieces.of(**args)


def test_pieces_need_exact_bounds():
    with pytest.raises(MaskError):
        masks.MaskMod(lambda b, h, q, kv: q >= kv, "m", pieces=pieces.Pieces.of(0, 0, 0, 1, 1))


@pytest.mark.parametrize("mod", [masks.or_masks(masks.sliding_window(40), lambda b, h, q_idx, kv_idx: kv_idx < 64),
                                 masks.not_mask(masks.sliding_window(150))], ids=["or", "not"])
def test_host_layout_of_rows_with_gaps(mod):
    """Rows whose blocks are not one run (the spread path of write_host) against the block grid,
    row by row."""
    bm = builders.from_mask_mod(mod, None, None, 1000, 1000, q_block_size=32, kv_block_size=32, xp=np)
    grid = bm.block_grid()[0, 0]
    idx, types, nb = bm.kv_indices[0, 0], bm.block_mask_types[0, 0], bm.kv_num_blocks[0, 0]
    for q, row in enumerate(grid):
        listed = np.flatnonzero(row)
        assert nb[q] == len(listed)
        np.testing.assert_array_equal(idx[q], np.pad(listed, (0, idx.shape[1] - len(listed))))
        np.testing.assert_array_equal(types[q], np.pad(row[listed], (0, idx.shape[1] - len(listed))))
    assert any(np.any(np.diff(np.flatnonzero(row)) > 1) for row in grid)  # some row does have a gap


def test_host_layout_spreads_pool_indices_of_long_segments():
    """write_host keeps every segment's pool index, also on segments longer than one block."""
    items = layout.Items(np.array([0, 0, 1]), np.array([0, 3, 1]), np.array([2, 1, 3]), np.array([2, 3, 1], np.int8),
                         np.array([5, 7, 9], np.int32))
    nb, idx, types, pidx = layout.write_host(layout.segments_of(items, 2))
    np.testing.assert_array_equal(nb, [3, 3])
    np.testing.assert_array_equal(idx, [[0, 1, 3], [1, 2, 3]])
    np.testing.assert_array_equal(types, [[2, 2, 3], [1, 1, 1]])
    np.testing.assert_array_equal(pidx, [[5, 5, 7], [9, 9, 9]])


@pytest.mark.parametrize("q_len, from_pieces", [
    pytest.param(128 * (PIECES_FROM_Q_BLOCKS - 1), False, id="below-the-threshold-rows"),
    pytest.param(128 * PIECES_FROM_Q_BLOCKS, True, id="at-the-threshold-pieces"),
])
def test_builds_take_pieces_from_the_threshold_on(monkeypatch, q_len, from_pieces):
    """Few q blocks take the row path (measured faster there), many the pieces."""
    monkeypatch.setattr(mask_mod, "PIECES_FROM_Q_BLOCKS", PIECES_FROM_Q_BLOCKS)
    chunks = list(masks.sliding_window(1024).windows(1, 1, q_len, q_len, 128, 128))
    assert (chunks[0].pieces is not None) is from_pieces


# ------------------------------------------------------------------ builds from pieces on a device
# pieces_build.py through kernels.EmulatedBackend (the kernels' contracts in NumPy): the host's part
# of a device build (the pool from the hashes, the summary from the counts, a second scan, the
# collision fallback) against the host path.
# The kernels themselves are compared with the same host builds in tests/gpu/test_mask_kernels_gpu.py.


def assert_same_build(got: BlockMask, want: BlockMask, what: str) -> None:
    assert_same_metadata(got, want, what)
    assert got.features == want.features and got.summary.counts == want.summary.counts, what
    np.testing.assert_array_equal(got.q_block_work, want.q_block_work, err_msg=what)


@pytest.mark.parametrize("qbs, kbs", BLOCKS + [(256, 32), (48, 256)], ids=str)
@pytest.mark.parametrize("q_len, kv_len", SIZES, ids=str)
@pytest.mark.parametrize("factory", WITH_PIECES + EXTRA)
def test_device_builds_from_pieces_equal_host_builds(factory, q_len, kv_len, qbs, kbs):
    mod = factory(q_len, kv_len)
    if mod.pieces is None:
        pytest.skip("no pieces")
    sizes = dict(q_block_size=qbs, kv_block_size=kbs)
    assert pieces_build.applies(mod, kernels.EmulatedBackend(), qbs)
    assert_same_build(builders.from_mask_mod(mod, None, 3, q_len, kv_len, xp=HOST_AS_DEVICE, **sizes),
                      builders.from_mask_mod(mod, None, 3, q_len, kv_len, xp=np, **sizes), "device build")


def test_a_scan_out_of_room_runs_again_with_room_for_every_record(monkeypatch):
    mod = masks.document(masks.doc_ids_from_lengths(random_lengths(3000, 20, 300, seed=2)))
    scans = []
    real_scan = kernels.EmulatedBackend.pieces_scan

    def scan(self, pieces_table, piece_count, sizes, capacity):
        scans.append(capacity)
        return real_scan(self, pieces_table, piece_count, sizes, capacity)

    monkeypatch.setattr(kernels.EmulatedBackend, "pieces_scan", scan)
    monkeypatch.setattr(pieces_build, "RECORDS_PER_Q_BLOCK", 0)
    monkeypatch.setattr(pieces_build, "MIN_RECORDS", 3)
    got = builders.from_mask_mod(mod, None, None, 3000, 3000, q_block_size=64, kv_block_size=64, xp=HOST_AS_DEVICE)
    assert scans[0] == 3 and len(scans) == 2 and scans[1] > 3
    assert_same_build(got, builders.from_mask_mod(mod, None, None, 3000, 3000, q_block_size=64, kv_block_size=64,
                                                  xp=np), "second scan")


def test_a_hash_collision_falls_back_to_the_host_path(monkeypatch, caplog):
    """The scan's flag (a PARTIAL block with another's hash but not its bits: simulated) -> the build
    is the host path's, and it says so."""
    mod = masks.interleaved(alternating_segments(2000, 100, 333))
    real_scan = kernels.EmulatedBackend.pieces_scan

    def colliding(*args):
        out = real_scan(*args)
        out[1] = 1
        return out

    monkeypatch.setattr(kernels.EmulatedBackend, "pieces_scan", colliding)
    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        got = builders.from_mask_mod(mod, None, None, 2000, 2000, xp=HOST_AS_DEVICE)
    assert "share a hash" in caplog.text
    assert_same_build(got, builders.from_mask_mod(mod, None, None, 2000, 2000, xp=np), "fallback")


def test_the_emulated_scan_flags_equal_hashes_of_other_bits(monkeypatch):
    """What the scan kernel's table check finds, the emulation finds too: every block hashing alike."""
    mod = masks.document(masks.doc_ids_from_lengths(random_lengths(1000, 20, 300, seed=4)))
    monkeypatch.setattr(kernels.blocks, "block_hashes", lambda bits: np.ones(len(bits), dtype=np.uint64))
    table = pieces_build.table(mod)
    scan = kernels.EmulatedBackend().pieces_scan(table, len(mod.pieces.q), (1000, 1000, 64, 64), 500)
    assert scan[0] > 1 and scan[1] == 1


@pytest.mark.parametrize("mod, backend, qbs, expected", [
    pytest.param(masks.sliding_window(9), kernels.EmulatedBackend(), 256, True, id="pieces-on-a-device"),
    pytest.param(masks.sliding_window(9), None, 128, False, id="on-the-host"),
    pytest.param(masks.sliding_window(9), kernels.EmulatedBackend(), 272, False, id="q-blocks-over-256"),
    pytest.param(masks.dilated_sliding_window(8, 3), kernels.EmulatedBackend(), 128, False, id="no-pieces"),
    pytest.param(lambda b, h, q, kv: q >= kv, kernels.EmulatedBackend(), 128, False, id="a-plain-function"),
])
def test_which_builds_take_the_device_pieces_path(mod, backend, qbs, expected):
    assert pieces_build.applies(mod, backend, qbs) is expected


def test_the_pieces_table_is_five_rows_of_int64():
    mod = masks.interleaved([("text", 10), ("image", 20), ("text", 5)])
    t = pieces_build.table(mod)
    assert t.dtype == np.int64 and t.shape == (5 * len(mod.pieces.q),)
    np.testing.assert_array_equal(t.reshape(5, -1), np.stack([mod.pieces.q, mod.pieces.start, mod.pieces.start_slope,
                                                              mod.pieces.end, mod.pieces.end_slope]))


def test_the_host_limit_on_q_blocks_is_the_kernels():
    """pieces_build sends q blocks of up to MAX_Q_BLOCK_SIZE rows, a thread each; the kernels are
    built for at most kMaxRows threads (their launch bounds and shared rows)."""
    from omnicupy.jit import env

    header = (env.kernels_dir() / "mask_pieces.cuh").read_text()
    assert f"constexpr int kMaxRows = {pieces_build.MAX_Q_BLOCK_SIZE};" in header
    assert kernels.pieces_threads(pieces_build.MAX_Q_BLOCK_SIZE) == pieces_build.MAX_Q_BLOCK_SIZE


# ------------------------------------------------------------------ and_masks of pieced masks
PAIRS = [f for f in WITH_PIECES + EXTRA if f.values[0](8, 8).pieces is not None]


@pytest.mark.parametrize("q_len", [77, 2049])
@pytest.mark.parametrize("second", PAIRS)
@pytest.mark.parametrize("first", PAIRS)
def test_intersected_pieces_are_the_intersected_rows(first, second, q_len):
    """and_masks of two pieced masks has pieces: each row's [max of the starts, min of the ends),
    lines cut where two of them cross."""
    a, b = first(q_len, q_len), second(q_len, q_len)
    both = masks.and_masks(a, b)
    start, end = both.pieces.rows(q_len)
    (sa, ea), (sb, eb) = a.pieces.rows(q_len), b.pieces.rows(q_len)
    np.testing.assert_array_equal(start, np.maximum(sa, sb))
    np.testing.assert_array_equal(end, np.minimum(ea, eb))
    assert len(both.pieces.q) <= 3 * (len(a.pieces.q) + len(b.pieces.q))


def test_and_masks_keep_pieces_only_when_every_mask_has_them():
    document = masks.document(masks.doc_ids_from_lengths([300, 500, 700]))
    assert masks.and_masks(masks.sliding_window(64), document, masks.prefix_lm(10)).pieces is not None
    assert masks.and_masks(masks.sliding_window(64), masks.dilated_sliding_window(8, 3)).pieces is None
    assert pieces_build.applies(masks.and_masks(masks.sliding_window(64), document), kernels.EmulatedBackend(), 128)
