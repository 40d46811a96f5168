"""BlockMask builders: from_mask_mod (structured and generic paths), from_dense, from_flex, validation."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from omnicupy import BlockMask, arrays, masks
from omnicupy.mask import blocks, build_pass, builders
from omnicupy.mask.block_mask import BlockType, cdiv, validate_metadata
from omnicupy.mask.mask_mod import LookupTable
from omnicupy.errors import MaskError
from omnicupy.reference import dense_mask_from_mod

from mask_cases import HOST_AS_DEVICE, MASK_CASES

META = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
CASE_PARAMS = [pytest.param(factory, id=case_id) for case_id, factory in MASK_CASES]
SIZES = [(1, 1), (77, 300), (300, 77), (1000, 1000), (1000, 333)]
BLOCKS = [(64, 64), (128, 128), (64, 128)]


@pytest.fixture
def host_default(monkeypatch):
    """Builds without an ``xp`` on the host even where a GPU is usable: for tests that read the
    arrays with NumPy, count host chunks, patch a host hash or print ``arrays=numpy``."""
    monkeypatch.setattr(builders, "default_array_module", lambda: np)


def assert_same_metadata(a: BlockMask, b: BlockMask) -> None:
    assert a.shape == b.shape and a.block_size == b.block_size
    for name in META:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            np.testing.assert_array_equal(arrays.to_numpy(x), arrays.to_numpy(y), err_msg=name)
    assert a.features == b.features


def unpack_pool(bm: BlockMask) -> np.ndarray:
    pool = arrays.to_numpy(bm.partial_block_masks)
    bits = (pool[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(pool.shape[0], bm.q_block_size, bm.kv_block_size).astype(bool)


def assert_pool_is_clean(bm: BlockMask) -> None:
    """Pool entries are distinct, in the order of their hashes (of the bits as stored: every path
    orders them alike), and bits past the sequence end are 0."""
    if bm.partial_block_masks is None:
        return
    pool = arrays.to_numpy(bm.partial_block_masks)
    assert len(np.unique(pool.reshape(len(pool), -1), axis=0)) == len(pool)
    hashes = blocks.block_hashes(pool)
    assert np.all(hashes[1:] >= hashes[:-1])
    dense = unpack_pool(bm)
    nb, idx, types, pidx = (arrays.to_numpy(getattr(bm, n)) for n in META[:4])
    active = np.arange(idx.shape[3]) < nb[..., None]
    for b, h, q, e in zip(*np.nonzero(active & (types == BlockType.PARTIAL))):
        block = dense[pidx[b, h, q, e]]
        assert not block[bm.q_len - q * bm.q_block_size:].any()
        assert not block[:, bm.kv_len - idx[b, h, q, e] * bm.kv_block_size:].any()


def check_mask_mod(mod, B, H, q_len, kv_len, qbs, kbs) -> BlockMask:
    """Structured == generic exactly, and both encode the brute-force dense mask."""
    bm = BlockMask.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs)
    generic = builders.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs,
                                     use_structure=False)
    assert_same_metadata(bm, generic)
    for use_structure in (True, False):  # the device branches, on the host
        assert_same_metadata(bm, builders.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs,
                                                        xp=HOST_AS_DEVICE, use_structure=use_structure))
    np.testing.assert_array_equal(bm.to_dense(), dense_mask_from_mod(mod, B or 1, H or 1, q_len, kv_len))
    assert_pool_is_clean(bm)
    assert bm.mask_mod is mod
    return bm


# ------------------------------------------------------------------------------ from_mask_mod
@pytest.mark.parametrize("qbs, kbs", BLOCKS, ids=lambda b: str(b))
@pytest.mark.parametrize("q_len, kv_len", SIZES, ids=lambda s: str(s))
@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_builtin_mask(factory, q_len, kv_len, qbs, kbs):
    check_mask_mod(factory(q_len, kv_len), None, None, q_len, kv_len, qbs, kbs)


@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_same_layout_as_from_block_types(factory, host_default):
    bm = BlockMask.from_mask_mod(factory(300, 333), None, None, 300, 333, q_block_size=64, kv_block_size=64)
    partial = {}
    if bm.partial_block_masks is not None:
        nb, idx, pidx = bm.kv_num_blocks, bm.kv_indices, bm.partial_block_mask_indices
        grid = np.zeros(bm.block_grid().shape, dtype=np.int32)
        b, h, q, e = np.nonzero(np.arange(idx.shape[3]) < nb[..., None])
        grid[b, h, q, idx[b, h, q, e]] = pidx[b, h, q, e]
        partial = dict(partial_grid=grid, partial_block_masks=bm.partial_block_masks)
    reference_layout = BlockMask.from_block_types(bm.block_grid(), q_len=300, kv_len=333, q_block_size=64,
                                                  kv_block_size=64, **partial)
    assert_same_metadata(bm, reference_layout)


def test_broadcast_over_batch_and_heads_is_a_view():
    bm = check_mask_mod(masks.sliding_window(100), 2, 3, 500, 500, 64, 64)
    assert bm.shape == (2, 3, 500, 500)
    assert bm.kv_indices.strides[:2] == (0, 0)  # one grid stands for every (b, h): no copies


def test_mask_depending_on_batch_and_head():
    def stripes(b, h, q_idx, kv_idx):
        return (q_idx // 16 + kv_idx // 32 + h) % 3 != b

    check_mask_mod(stripes, 2, 3, 300, 200, 64, 64)


def test_per_batch_documents():
    lengths = [[50, 150, 100], [300], [1, 299]]
    ids = np.stack([masks.doc_ids_from_lengths(n) for n in lengths])
    bm = check_mask_mod(masks.document(ids), 3, None, 300, 300, 64, 64)
    assert bm.shape == (3, 1, 300, 300)


def test_structure_skips_evaluation_outside_cut_blocks():
    calls = []

    def never(b, h, q_idx, kv_idx):
        calls.append(1)
        raise AssertionError("evaluated")

    causal_structure = masks.MaskMod(never, "causal_structure", bounds=masks.causal().bounds)
    bm = BlockMask.from_mask_mod(causal_structure, None, None, 1024, 1024, q_block_size=64, kv_block_size=64)
    assert not calls
    np.testing.assert_array_equal(bm.to_dense()[0, 0], np.tri(1024, dtype=bool))


def per_block_rule(mod, q_len, kv_len, qbs, kbs) -> np.ndarray:
    """What the row bounds say about each block ([nQB, nKVB]), block by block: MASKED when every
    row's interval misses it, FULL when every one covers it, CAUSAL when every row starts before it
    and ends at its diagonal, else EVALUATE."""
    q = np.minimum(np.arange(cdiv(q_len, qbs) * qbs), q_len - 1)
    start, end = (np.broadcast_to(a, q.shape).reshape(-1, qbs) for a in mod.bounds(0, 0, q))
    kv_lo = np.arange(cdiv(kv_len, kbs)) * kbs
    kv_hi = np.minimum(kv_lo + kbs, kv_len) - 1
    masked = (start.min(1)[:, None] > kv_hi) | (end.max(1)[:, None] <= kv_lo)
    starts_before = start.max(1)[:, None] <= kv_lo
    full = starts_before & (end.min(1)[:, None] > kv_hi) & mod.bounds_exact
    causal = starts_before & (end == q.reshape(-1, qbs) + 1).all(1)[:, None] & mod.bounds_exact
    return np.select([masked, full, causal], [BlockType.MASKED, BlockType.FULL, BlockType.CAUSAL], masks.EVALUATE)


@pytest.mark.parametrize("qbs, kbs", BLOCKS + [(16, 32), (128, 32)], ids=lambda b: str(b))
@pytest.mark.parametrize("q_len, kv_len", SIZES + [(513, 1025)], ids=lambda s: str(s))
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES if f(1, 1).bounds is not None])
def test_block_rows_follow_the_per_block_rule(factory, q_len, kv_len, qbs, kbs):
    """The windows hold exactly the blocks the rule does not mask, with the rule's types: nothing
    FULL or CAUSAL is left to evaluate."""
    mod = factory(q_len, kv_len)
    grid = mod.classify_blocks(1, 1, q_len, kv_len, qbs, kbs)[0, 0]
    np.testing.assert_array_equal(grid, per_block_rule(mod, q_len, kv_len, qbs, kbs))


def test_evaluation_is_chunked(monkeypatch, host_default):
    monkeypatch.setattr(build_pass, "CHUNK_ELEMENTS", 64 * 64 * 3)
    sizes = []

    def recording(b, h, q_idx, kv_idx):
        sizes.append(np.broadcast_shapes(q_idx.shape, kv_idx.shape))
        return (q_idx + kv_idx) % 5 != 0

    small = builders.from_mask_mod(recording, None, None, 1000, 700, q_block_size=64, kv_block_size=64)
    assert max(int(np.prod(s)) for s in sizes) <= 64 * 64 * 3 and len(sizes) > 10
    monkeypatch.undo()
    assert_same_metadata(small, builders.from_mask_mod(recording, None, None, 1000, 700, q_block_size=64,
                                                       kv_block_size=64))


@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_device_chunks(factory, monkeypatch):
    """Several device chunks (each keeps only its partial blocks' bits) give the metadata of one."""
    mod = factory(1000, 700)
    one = builders.from_mask_mod(mod, None, 2, 1000, 700, q_block_size=64, kv_block_size=64, xp=HOST_AS_DEVICE)
    monkeypatch.setattr(build_pass, "DEVICE_CHUNK_ELEMENTS", 64 * 64 * 3)
    for use_structure in (True, False):
        assert_same_metadata(one, builders.from_mask_mod(mod, None, 2, 1000, 700, q_block_size=64, kv_block_size=64,
                                                         xp=HOST_AS_DEVICE, use_structure=use_structure))


@pytest.mark.parametrize("xp", [np, HOST_AS_DEVICE], ids=["host", "device"])
def test_nothing_allowed(xp):
    bm = builders.from_mask_mod(lambda b, h, q_idx, kv_idx: q_idx < 0, None, None, 300, 200, q_block_size=64,
                                kv_block_size=64, xp=xp)
    assert bm.kv_indices.shape == (1, 1, 5, 1) and not bm.kv_num_blocks.any() and not bm.kv_indices.any()
    assert bm.partial_block_masks is None and bm.features == builders.MaskFeatures(causal=False, partial=False)


def test_hash_collisions_fall_back_to_exact_dedup(monkeypatch, host_default):
    mod = masks.document(masks.doc_ids_from_lengths([37, 100, 3, 90, 70]), causal=False)
    expected = check_mask_mod(mod, None, None, 300, 300, 32, 32)
    monkeypatch.setattr(blocks, "block_hashes", lambda packed, xp=np: np.zeros(len(packed), dtype=np.uint64))
    got = check_mask_mod(mod, None, None, 300, 300, 32, 32)
    np.testing.assert_array_equal(got.to_dense(), expected.to_dense())
    assert got.partial_block_masks.shape == expected.partial_block_masks.shape


@pytest.mark.parametrize("qbs, kbs", [(64, 64), (128, 128), (64, 128), (128, 64), (16, 32), (256, 128)], ids=str)
@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (77, 300), (300, 77), (1025, 1025), (129, 1), (4096, 2048)], ids=str)
@pytest.mark.parametrize("B, H", [(None, None), (2, 3)], ids=str)
@pytest.mark.parametrize("xp", [np, HOST_AS_DEVICE], ids=["host", "device"])
def test_causal_rows_are_the_structured_layout(q_len, kv_len, qbs, kbs, B, H, xp, monkeypatch):
    """A causal MaskMod's rows written arithmetically equal, array for array, what the structured
    path lays out (with its summary and features), on the host and on the device path."""
    mod = masks.causal()
    assert builders._is_causal(mod) and not builders._is_causal(masks.causal(1))
    assert not builders._is_causal(masks.sliding_window(10 ** 9))  # the same rows only in effect
    got = builders.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs, xp=xp)
    monkeypatch.setattr(builders, "CAUSAL_ROWS_MAX_SLOTS", 0)
    want = builders.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs, xp=xp)
    assert_same_metadata(got, want)
    assert got.summary.counts == want.summary.counts and got.mask_mod is mod
    np.testing.assert_array_equal(got.q_block_work, want.q_block_work)
    assert got.to_string() == want.to_string()
    # Runs (host data) from the host's structured path: on a device that path is pieces_build, which keeps none.
    runs = builders.from_mask_mod(mod, B, H, q_len, kv_len, q_block_size=qbs, kv_block_size=kbs, xp=np)._runs
    for field in ("row", "kv", "length", "kind"):
        np.testing.assert_array_equal(getattr(got._runs, field), getattr(runs, field), err_msg=field)


@pytest.mark.parametrize("n_words", [1, 4, 16])
def test_block_hash_is_its_definition(n_words):
    """sum(word * multiplier) mod 2**64 over a block's words, in Python integers: the kernels hash the
    same way, and the pool's order follows the hashes on every path."""
    rng = np.random.default_rng(n_words)
    packed = rng.integers(0, 2**32, size=(5, 8, n_words), dtype=np.uint64).astype(np.uint32)
    packed[0] = 0xFFFFFFFF  # the largest products: the sum wraps many times
    multipliers = [int(m) for m in blocks.hash_multipliers(8 * n_words)]
    want = [sum(int(w) * m for w, m in zip(block.reshape(-1), multipliers)) % 2**64 for block in packed]
    got = blocks.block_hashes(packed)
    assert got.dtype == np.uint64 and [int(h) for h in got] == want


@pytest.mark.parametrize("kbs", [32, 64, 128, 256])
def test_packed_bits_are_the_runs(kbs):
    """A row code ``lo * (kbs + 1) + hi`` packs to columns lo .. hi - 1 set (the table up to 128, the
    prefix rows past it); code 0 is the empty row."""
    from omnicupy.mask import patterns

    rng = np.random.default_rng(kbs)
    lo, hi = np.sort(rng.integers(0, kbs + 1, size=(2, 3, 16)), axis=0)
    lo[0, 0], hi[0, 0] = 0, kbs  # a full row
    codes = np.where(hi > lo, lo * (kbs + 1) + hi, 0).astype(np.int32)
    columns = np.arange(kbs)
    want = np.packbits((columns >= lo[..., None]) & (columns < hi[..., None]), axis=-1, bitorder="little")
    got = patterns.packed_bits(codes, kbs)
    assert got.shape == (3, 16, kbs // 32) and got.dtype == np.uint32
    np.testing.assert_array_equal(got.view(np.uint8).reshape(want.shape), want)


class _NoHostArray:
    """Stands in for a CuPy array: NumPy refuses to convert it, as it refuses CuPy arrays."""

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


class _FakeDeviceModule:
    @staticmethod
    def zeros(shape, dtype):
        return _NoHostArray()


def test_numpy_only_mask_mod_falls_back_to_host_evaluation():
    table = np.arange(10)
    with pytest.warns(UserWarning, match="does not take CuPy arrays"):
        assert builders._evaluation_module(lambda b, h, q, kv: table[q] == table[kv], _FakeDeviceModule) is np
    assert builders._evaluation_module(lambda b, h, q, kv: True, _FakeDeviceModule) is _FakeDeviceModule
    assert builders._evaluation_module(lambda b, h, q, kv: table[q] == table[kv], np) is np


def test_device_probe_runs_once_per_mask_mod():
    calls = []

    def counting(b, h, q_idx, kv_idx):
        calls.append(1)
        return True

    for _ in range(3):
        assert builders._evaluation_module(counting, _FakeDeviceModule) is _FakeDeviceModule
    assert len(calls) == 1


# ---------------------------------------------------------------- property-based: random mask_mods
LEN = 300


def _named(fn, name):
    fn.__name__ = name
    return fn


def modular(a, c, m):
    return _named(lambda b, h, q_idx, kv_idx: (q_idx * a + kv_idx * c) % m != 0, f"modular_{a}_{c}_{m}")


def stripes(period):
    return _named(lambda b, h, q_idx, kv_idx: (q_idx // period + kv_idx // 32 + h) % 3 != b, f"stripes_{period}")


def to_length(lengths):
    """Lengths cut or extended to sum to LEN."""
    ends = np.minimum(np.cumsum(lengths + [LEN]), LEN)
    return np.diff(ends[: int(np.searchsorted(ends, LEN)) + 1], prepend=0).tolist()


segments = st.lists(st.tuples(st.sampled_from(["text", "image"]), st.integers(1, 120)), min_size=1, max_size=6)
leaves = st.one_of(
    st.just(masks.causal()),
    st.integers(1, 200).map(masks.sliding_window),
    st.builds(masks.local_window, st.integers(0, 150), st.integers(0, 150)),
    st.integers(0, LEN).map(masks.prefix_lm),
    st.builds(masks.dilated_sliding_window, st.integers(1, 20), st.integers(1, 5)),
    st.builds(lambda n, c: masks.document(masks.doc_ids_from_lengths(to_length(n)), causal=c),
              st.lists(st.integers(1, 150), min_size=1, max_size=8), st.booleans()),
    st.lists(st.integers(1, 150), min_size=1, max_size=8).map(lambda n: masks.block_diagonal(to_length(n))),
    segments.map(lambda s: masks.interleaved(list(zip([k for k, _ in s] + ["text"], to_length([n for _, n in s]))))),
    st.builds(modular, st.integers(1, 7), st.integers(0, 6), st.integers(2, 5)),
    st.integers(1, 40).map(stripes),
)
mask_trees = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, min_size=2, max_size=3).map(lambda ms: masks.and_masks(*ms)),
    st.lists(children, min_size=2, max_size=3).map(lambda ms: masks.or_masks(*ms)),
    children.map(masks.not_mask),
), max_leaves=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mod=mask_trees, q_len=st.integers(1, LEN), kv_len=st.integers(1, LEN),
       qbs=st.sampled_from([16, 64, 128]), kbs=st.sampled_from([32, 64, 128]),
       B=st.sampled_from([None, 2]), H=st.sampled_from([None, 3]))
def test_random_mask_mods(mod, q_len, kv_len, qbs, kbs, B, H):
    check_mask_mod(mod, B, H, q_len, kv_len, qbs, kbs)


def interval_rows(starts, ends, name):
    """An exact MaskMod from arbitrary per-row intervals [start, end) (empty where end <= start)."""
    start, end = LookupTable(np.asarray(starts)), LookupTable(np.asarray(ends))

    def rows(b, h, q_idx, kv_idx):
        return (kv_idx >= start.lookup(b, q_idx)) & (kv_idx < end.lookup(b, q_idx))

    return masks.MaskMod(rows, name, bounds=lambda b, h, q: (start.lookup(b, q), end.lookup(b, q)),
                         length=len(starts))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), q_len=st.integers(1, 300), kv_len=st.integers(1, 300),
       qbs=st.sampled_from([16, 32, 64]), kbs=st.sampled_from([32, 64, 128]),
       style=st.sampled_from(["random", "diagonal", "bands", "empty-rows"]))
def test_exact_row_intervals(seed, q_len, kv_len, qbs, kbs, style):
    """Cut blocks filled from the row bounds (no evaluation) equal the evaluated ones, whatever the
    intervals: random, ending at the diagonal (CAUSAL candidates), bands, rows with nothing."""
    rng = np.random.default_rng(seed)
    n = max(q_len, kv_len)
    q = np.arange(n)
    if style == "random":
        a, b = rng.integers(-5, n + 5, (2, n))
        starts, ends = np.minimum(a, b), np.maximum(a, b)
    elif style == "diagonal":
        starts, ends = np.where(rng.random(n) < 0.8, 0, rng.integers(0, n, n)), q + 1
    elif style == "bands":
        width = rng.integers(1, 100)
        starts, ends = q - width + 1 + rng.integers(-2, 3), q + rng.integers(-2, 40)
    else:
        starts, ends = rng.integers(0, n, n), rng.integers(0, n, n)  # often end <= start: nothing
    check_mask_mod(interval_rows(starts, ends, f"rows_{style}_{seed}"), None, None, q_len, kv_len, qbs, kbs)


# --------------------------------------------------------------------------------- from_dense
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bm=st.sampled_from([1, 2]), hm=st.sampled_from([1, 3]),
       q_len=st.integers(1, 200), kv_len=st.integers(1, 200), density=st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]),
       qbs=st.sampled_from([16, 64]), kbs=st.sampled_from([32, 64]))
def test_from_dense_round_trip(seed, bm, hm, q_len, kv_len, density, qbs, kbs):
    rng = np.random.default_rng(seed)
    # Mix random noise with whole causal / full / empty blocks so every block type shows up.
    blocky = np.tri(q_len, kv_len, dtype=bool) | (np.arange(kv_len) < kv_len // 3)
    mask = np.where(rng.random((bm, hm, 1, 1)) < 0.5, blocky, rng.random((bm, hm, q_len, kv_len)) < density)
    out = BlockMask.from_dense(mask, q_block_size=qbs, kv_block_size=kbs)
    assert out.shape == (bm, hm, q_len, kv_len)
    np.testing.assert_array_equal(out.to_dense(), mask)
    assert_pool_is_clean(out)


def test_from_dense_matches_from_mask_mod():
    mod = masks.and_masks(masks.sliding_window(60), masks.document(masks.doc_ids_from_lengths([90, 110, 100])))
    dense = dense_mask_from_mod(mod, 1, 1, 300, 300)
    assert_same_metadata(BlockMask.from_dense(dense, q_block_size=64, kv_block_size=64),
                         BlockMask.from_mask_mod(mod, None, None, 300, 300, q_block_size=64, kv_block_size=64))


# ---------------------------------------------------------------------------------- from_flex
class HostDLPack:
    """A host array seen only through DLPack (like a CPU torch tensor)."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def flex_arrays(kv_num, kv_idx, full_num=None, full_idx=None):
    """int32 arrays of a hand-made flex tuple (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)."""
    return [None if a is None else np.array(a, dtype=np.int32) for a in (kv_num, kv_idx, full_num, full_idx)]


# causal at 256 with 128-blocks is [[CAUSAL, -], [FULL, CAUSAL]]; kv_indices slots past the count are junk.
FLEX_CASES = [
    pytest.param(flex_arrays([[[1, 1]]], [[[[0, 7], [1, 7]]]], [[[0, 1]]], [[[[5, 5], [0, 5]]]]),
                 masks.causal(), 256, 256, "\\.\n#\\", id="partial+full"),
    pytest.param(flex_arrays([[[1, 2]]], [[[[0, 0], [1, 0]]]]), masks.causal(), 256, 256, "\\.\n#\\",
                 id="partial-only-unsorted"),
    pytest.param(flex_arrays([[[2, 2]]], [[[[0, 1], [0, 1]]]]), masks.causal(), 256, 256, "\\.\n#\\",
                 id="all-false-partial-dropped"),
    pytest.param(flex_arrays([[[0, 0]]], [[[[0, 0], [0, 0]]]], [[[2, 2]]], [[[[0, 1], [1, 0]]]]),
                 None, 256, 256, "##\n##", id="full-only-no-mask_mod"),
    pytest.param(flex_arrays([[[2, 2]]], [[[[0, 1], [0, 1]]]]), masks.prefix_lm(256), 256, 256, "##\n##",
                 id="all-true-partial-is-full"),
    pytest.param(flex_arrays([[[1, 2]]], [[[[0, 0], [0, 1]]]]), masks.sliding_window(100), 200, 150, "+.\n+\\",
                 id="tails"),
    pytest.param([HostDLPack(a) for a in flex_arrays([[[1, 1]]], [[[[0, 7], [1, 7]]]], [[[0, 1]]], [[[[5, 5], [0, 5]]]])],
                 masks.causal(), 256, 256, "\\.\n#\\", id="host-dlpack"),
]


@pytest.mark.parametrize("flex, mod, q_len, kv_len, grid", FLEX_CASES)
def test_from_flex_hand_made(flex, mod, q_len, kv_len, grid):
    bm = BlockMask.from_flex(*flex, q_len=q_len, kv_len=kv_len, mask_mod=mod)
    assert bm.to_string() == grid
    if mod is not None:
        np.testing.assert_array_equal(bm.to_dense(), dense_mask_from_mod(mod, 1, 1, q_len, kv_len))
    assert bm.mask_mod is mod


def as_flex_tuple(bm: BlockMask):
    """flex's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) for a BlockMask:
    CAUSAL and PARTIAL blocks are flex's partial blocks."""
    grid = bm.block_grid()
    pairs = []
    for listed in (np.isin(grid, [BlockType.CAUSAL, BlockType.PARTIAL]), grid == BlockType.FULL):
        order = np.argsort(~listed, axis=-1, kind="stable")
        pairs += [listed.sum(-1).astype(np.int32), order.astype(np.int32)]
    return pairs


@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_from_flex_round_trip(factory):
    mod = factory(300, 333)
    bm = BlockMask.from_mask_mod(mod, None, None, 300, 333, q_block_size=64, kv_block_size=64)
    again = BlockMask.from_flex(*as_flex_tuple(bm), q_len=300, kv_len=333, q_block_size=64, kv_block_size=64,
                                mask_mod=mod)
    assert_same_metadata(again, bm)


@pytest.mark.parametrize("factory", CASE_PARAMS)
@pytest.mark.parametrize("use_structure", [True, False], ids=["structured", "generic"])
def test_builders_emit_valid_metadata_and_features(factory, use_structure):
    """Builders skip BlockMask's value checks (their output is valid by construction): the full
    checks pass on it, and find the features the builder declared."""
    bm = builders.from_mask_mod(factory(300, 333), 2, None, 300, 333, q_block_size=64, kv_block_size=64,
                                use_structure=use_structure)
    again = BlockMask.from_flex(*as_flex_tuple(bm), q_len=300, kv_len=333, q_block_size=64, kv_block_size=64,
                                mask_mod=bm.mask_mod)
    for built in (bm, again):
        metadata = [getattr(built, name) for name in META]
        features, summary = validate_metadata(*metadata, q_len=300, kv_len=333, q_block_size=64, kv_block_size=64)
        assert features == built.features
        assert summary.counts == built.summary.counts
        np.testing.assert_array_equal(summary.q_block_work, built.q_block_work)
        assert built.features.partial == (built.partial_block_masks is not None)


# --------------------------------------------------------------------------------- inspection
def test_inspection_of_a_causal_mask(host_default):
    bm = BlockMask.from_mask_mod(masks.causal(), None, None, 256, 256)
    assert bm.shape == (1, 1, 256, 256)
    assert bm.sparsity() == pytest.approx(25.0)
    assert bm.to_string() == "\\.\n#\\"
    assert repr(bm) == ("BlockMask(shape=(1, 1, 256, 256), block_size=(128, 128), sparsity=25.00%, full=1, "
                        "causal=2, partial=0, pool=0, arrays=numpy)")


def test_inspection_of_an_interleaved_mask():
    # Image tokens 50..149 see everything before 150; text tokens are causal.
    bm = BlockMask.from_mask_mod(masks.interleaved([("text", 50), ("image", 100), ("text", 106)]), 2, None, 256, 256,
                                 q_block_size=32, kv_block_size=32)
    assert bm.shape == (2, 1, 256, 256)
    assert bm.to_string() == "\n".join(["\\.......", "#++++...", "####+...", "####+...", "####+...",
                                        "#####\\..", "######\\.", "#######\\"])
    assert bm.sparsity() == pytest.approx(100 * 22 / 64)
    assert "full=62, causal=8, partial=14, pool=5" in repr(bm)  # counts over both batch rows
    # Two characters wide: each one a square of 4x4 blocks (13, 3, 16 and 10 of 16 visited).
    picture = bm.to_string(width=2).splitlines()
    assert picture[:2] == ["82", "#6"] and picture[2].startswith("(8x8 blocks, 4x4 per character")


# --------------------------------------------------------------------------------- validation
PER_BATCH = masks.document(np.zeros((2, 8), dtype=np.int32))
GOOD_FLEX = flex_arrays([[[1, 1]]], [[[[0, 0], [1, 0]]]], [[[0, 1]]], [[[[0, 0], [0, 0]]]])


def flex_with(**changes):
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    kwargs = dict(zip(names, GOOD_FLEX), q_len=256, kv_len=256, mask_mod=masks.causal())
    kwargs.update(changes)
    return lambda: BlockMask.from_flex(**kwargs)


@pytest.mark.parametrize("build, match", [
    pytest.param(lambda: BlockMask.from_mask_mod(3, None, None, 8, 8), "mask_mod must be callable", id="mod-not-callable"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), 0, None, 8, 8), "B must be >= 1", id="B-zero"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, 2.0, 8, 8), "H must be an int", id="H-float"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 0, 8), "q_len must be >= 1", id="q_len-zero"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 8, "8"), "kv_len must be an int", id="kv_len-str"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 8, 8, q_block_size=24),
                 "q_block_size must be a multiple of 16", id="q_block_size"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 8, 8, kv_block_size=48),
                 "kv_block_size must be a multiple of 32", id="kv_block_size"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.block_diagonal([4, 4]), None, None, 8, 9),
                 "defined for 8 positions", id="mask-too-short"),
    pytest.param(lambda: BlockMask.from_mask_mod(PER_BATCH, None, None, 8, 8), "pass B=2", id="per-batch-without-B"),
    pytest.param(lambda: BlockMask.from_dense(np.ones((1, 8, 8), bool)), "mask must be 4-D", id="dense-3d"),
    pytest.param(lambda: BlockMask.from_dense(np.ones((1, 1, 8, 8), np.int32)), "boolean", id="dense-int"),
    pytest.param(lambda: BlockMask.from_dense(np.ones((1, 0, 8, 8), bool)), "zero-size", id="dense-empty"),
    pytest.param(lambda: BlockMask.from_dense(np.ones((1, 1, 8, 8), bool), kv_block_size=16),
                 "kv_block_size must be a multiple of 32", id="dense-block-size"),
    pytest.param(lambda: BlockMask.from_dense(None), "mask is required", id="dense-none"),
    pytest.param(flex_with(full_kv_indices=None), "given together", id="flex-half-full-pair"),
    pytest.param(flex_with(kv_num_blocks=np.zeros((1, 1, 3), np.int32)), r"kv_num_blocks must have shape \(1, 1, 2\)",
                 id="flex-num-q-blocks"),
    pytest.param(flex_with(kv_indices=np.zeros((1, 1, 2), np.int32)), "kv_indices must have 4 dimensions",
                 id="flex-indices-ndim"),
    pytest.param(flex_with(kv_indices=np.zeros((1, 2, 2, 2), np.int32)), "kv_indices shape .* must start with",
                 id="flex-indices-shape"),
    pytest.param(flex_with(full_kv_num_blocks=np.zeros((2, 1, 2), np.int32)),
                 "full_kv_num_blocks must have shape", id="flex-full-shape"),
    pytest.param(flex_with(kv_num_blocks=np.array([[[3, 1]]])), r"kv_num_blocks has entries outside \[0, 2\]",
                 id="flex-num-too-large"),
    pytest.param(flex_with(full_kv_num_blocks=np.array([[[-1, 1]]])), "full_kv_num_blocks has entries outside",
                 id="flex-num-negative"),
    pytest.param(flex_with(kv_indices=np.array([[[[2, 0], [1, 0]]]])), r"kv_indices has listed entries outside \[0, 2\)",
                 id="flex-index-range"),
    pytest.param(flex_with(full_kv_indices=np.array([[[[0, 0], [-1, 0]]]])), "full_kv_indices has listed entries",
                 id="flex-full-index-range"),
    pytest.param(flex_with(kv_num_blocks=np.array([[[2, 1]]]), kv_indices=np.array([[[[0, 0], [1, 0]]]])),
                 "listed twice", id="flex-duplicate-in-list"),
    pytest.param(flex_with(kv_indices=np.array([[[[0, 0], [0, 0]]]])), "listed twice", id="flex-duplicate-across-lists"),
    pytest.param(flex_with(kv_indices=np.zeros((1, 1, 2, 2))), "kv_indices must be an integer array", id="flex-float"),
    pytest.param(flex_with(mask_mod=None), "2 partial blocks, whose element masks need mask_mod=", id="flex-no-mask_mod"),
    pytest.param(flex_with(mask_mod="causal"), "mask_mod must be callable", id="flex-mask_mod-not-callable"),
    pytest.param(flex_with(q_block_size=100), "q_block_size must be a multiple of 16", id="flex-block-size"),
    pytest.param(flex_with(kv_indices=None, full_kv_num_blocks=None, full_kv_indices=None), "kv_indices is required",
                 id="flex-missing"),
])
def test_validation_errors(build, match):
    with pytest.raises(MaskError, match=match):
        build()


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_cupy_path_equals_numpy_path(factory):
    cp = arrays.cupy_module()
    mod = factory(1000, 777)
    on_gpu = builders.from_mask_mod(mod, None, 2, 1000, 777, q_block_size=64, kv_block_size=128, xp=cp)
    on_host = builders.from_mask_mod(mod, None, 2, 1000, 777, q_block_size=64, kv_block_size=128, xp=np)
    assert on_gpu.on_device and not on_host.on_device
    assert_same_metadata(on_gpu, on_host)
    generic = builders.from_mask_mod(mod, None, 2, 1000, 777, q_block_size=64, kv_block_size=128, xp=cp,
                                     use_structure=False)
    assert_same_metadata(generic, on_host)


@pytest.mark.gpu
def test_gpu_builds_a_mask_mod_that_indexes_numpy_tables():
    ids = masks.doc_ids_from_lengths([100, 50, 150])

    def numpy_documents(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    with pytest.warns(UserWarning, match="does not take CuPy arrays"):
        bm = BlockMask.from_mask_mod(numpy_documents, None, None, 300, 300, q_block_size=64, kv_block_size=64)
    # Evaluated on the host; where the metadata then lives is the builder's choice.
    assert_same_metadata(bm, BlockMask.from_mask_mod(masks.document(ids), None, None, 300, 300, q_block_size=64,
                                                     kv_block_size=64))
