"""The builders' GPU kernels (omnicupy/mask/kernels.py) against their NumPy emulation, GPU builds
against host builds, and the properties of GPU builds: no wait behind running work for structured
masks, the caller's CuPy arrays not reaching the mask, compiles said once. Every random input is
seeded and the seed is in the failure message."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from omnicupy import BlockMask, arrays, masks
from omnicupy.dispatch import schedule
from omnicupy.mask import blocks, build_pass, builders, compile_mask, kernels, layout, pieces_build

from mask_cases import MASK_CASES, random_lengths

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

META = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
SEEDS = [11, 12, 13]


def assert_same_metadata(a: BlockMask, b: BlockMask, note: str = "") -> None:
    assert a.shape == b.shape and a.block_size == b.block_size, note
    for name in META:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), f"{name} {note}"
        if x is not None:
            np.testing.assert_array_equal(arrays.to_numpy(x), arrays.to_numpy(y), err_msg=f"{name} {note}")
    assert a.features == b.features and a.summary.counts == b.summary.counts, note


# ------------------------------------------------------------------------------ kernel by kernel
def random_coords(rng, k, bs, hs, q_len, kv_len, qbs, kbs):
    """[k, 4] int64 block coordinates (b, h, q0, kv0), tails included."""
    return np.stack([rng.integers(0, bs, k), rng.integers(0, hs, k), rng.integers(0, -(-q_len // qbs), k) * qbs,
                     rng.integers(0, -(-kv_len // kbs), k) * kbs], axis=1).astype(np.int64)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("qbs,kbs,q_len,kv_len", [(128, 128, 1000, 777), (64, 32, 300, 301), (16, 256, 50, 700)])
@pytest.mark.parametrize("source", ["grid", "grid-broadcast", "grid-transposed", "dense", "dense-strided"])
def test_classify_kernel(source, qbs, kbs, q_len, kv_len, seed):
    rng = np.random.default_rng(seed)
    note = f"seed={seed} source={source}"
    k = 37
    coords = random_coords(rng, k, 2, 3, q_len, kv_len, qbs, kbs)
    # Mix dense, sparse, all-true, all-false and causal-like blocks.
    density = rng.choice([0.0, 0.03, 0.5, 0.97, 1.0], size=(k, 1, 1))
    if source.startswith("grid"):
        host = rng.random((k, qbs, kbs)) < density
        causal = rng.random(k) < 0.3
        diagonal = (coords[:, 2, None, None] + np.arange(qbs)[:, None]) >= (coords[:, 3, None, None] + np.arange(kbs))
        host[causal] = diagonal[causal]
        if source == "grid-broadcast":
            host = np.broadcast_to(host[:, :1, :], host.shape)
        device = cp.asarray(np.ascontiguousarray(host))
        if source == "grid-broadcast":
            device = cp.broadcast_to(cp.asarray(np.ascontiguousarray(host[:, :1, :])), host.shape)
        if source == "grid-transposed":
            device = cp.asarray(np.ascontiguousarray(host.transpose(0, 2, 1))).transpose(0, 2, 1)
        positional = False
    else:
        host = rng.random((2, 3, q_len, kv_len)) < rng.choice([0.02, 0.5, 0.98])
        host |= np.tri(q_len, kv_len, dtype=bool) & (rng.random((2, 3, 1, 1)) < 0.5)
        device = cp.asarray(host)
        if source == "dense-strided":
            wide = np.zeros((2, 3, q_len, 2 * kv_len), bool)
            wide[..., ::2] = host
            device = cp.asarray(wide)[..., ::2]
        positional = True
    want_bits, want_summary = kernels.EmulatedBackend().classify(host, positional, coords, qbs, kbs, q_len, kv_len)
    bits, summary = kernels.KernelBackend(cp).classify(device, positional, cp.asarray(coords), qbs, kbs, q_len,
                                                       kv_len)
    np.testing.assert_array_equal(bits.get(), want_bits, err_msg=note)
    np.testing.assert_array_equal(summary.get(), want_summary, err_msg=note)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_layout_kernel(factory, seed):
    rng = np.random.default_rng(seed)
    bm = builders.from_mask_mod(factory(900, 700), None, 2, 900, 700, q_block_size=32, kv_block_size=64, xp=np)
    runs = bm._runs
    items = layout.Items(runs.row, runs.kv, runs.length, runs.kind.astype(np.int8),
                         rng.integers(0, 1000, len(runs.row)).astype(np.int32))
    segments = layout.segments_of(items, int(np.prod(runs.grid)))
    args = (layout.device_table(segments), segments.rows, segments.max_blocks, len(segments.start))
    for with_partial in (True, False):
        want = kernels.EmulatedBackend().layout(*args, with_partial)
        got = kernels.KernelBackend(cp).layout(*args, with_partial)
        for w, g in zip(want, got):
            assert (w is None) == (g is None)
            if w is not None:
                np.testing.assert_array_equal(g.get(), w, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_compare_and_indices_kernels(seed):
    rng = np.random.default_rng(seed)
    note = f"seed={seed}"
    src = rng.integers(0, 2**32, (50, 64, 2), dtype=np.uint32)
    src[10] = src[3]
    pick = rng.integers(0, 50, 20)
    device = kernels.KernelBackend(cp)
    np.testing.assert_array_equal(device.gather_blocks(cp.asarray(src), pick).get(), src[pick], err_msg=note)
    into = cp.zeros((30, 64, 2), np.uint32)
    device.gather_blocks(cp.asarray(src), pick[:5], into, np.array([29, 0, 7, 8, 1]))
    want = np.zeros((30, 64, 2), np.uint32)
    want[[29, 0, 7, 8, 1]] = src[pick[:5]]
    np.testing.assert_array_equal(into.get(), want, err_msg=note)
    assert not device.blocks_differ(cp.asarray(src), np.array([3, 10, 4]), cp.asarray(src), np.array([10, 3, 4]))
    assert device.blocks_differ(cp.asarray(src), np.array([3, 10]), cp.asarray(src), np.array([10, 4]))
    coords = random_coords(rng, 40, 1, 1, 1000, 333, 128, 64)
    for a, b in zip(device.block_indices(cp.asarray(coords), 128, 64, 1000, 333),
                    kernels.EmulatedBackend().block_indices(coords, 128, 64, 1000, 333)):
        np.testing.assert_array_equal(a.get(), b, err_msg=note)


# ------------------------------------------------------------------------------ whole builds
@pytest.mark.parametrize("use_structure", [True, False], ids=["structured", "generic"])
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_gpu_builds_equal_host_builds(factory, use_structure):
    mod = factory(1000, 777)
    on_gpu = builders.from_mask_mod(mod, 2, None, 1000, 777, q_block_size=64, kv_block_size=128, xp=cp,
                                    use_structure=use_structure)
    on_host = builders.from_mask_mod(mod, 2, None, 1000, 777, q_block_size=64, kv_block_size=128, xp=np,
                                     use_structure=use_structure)
    assert on_gpu.on_device and not on_host.on_device
    assert_same_metadata(on_gpu, on_host)
    np.testing.assert_array_equal(on_gpu.q_block_work, schedule.q_block_work(on_gpu))


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_from_dense_equals_host(seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((2, 2, 1000, 900)) < rng.choice([0.01, 0.5, 0.99])
    mask[:, 0] |= np.tri(1000, 900, dtype=bool)
    on_gpu = BlockMask.from_dense(cp.asarray(mask), q_block_size=128, kv_block_size=64)
    on_host = BlockMask.from_dense(mask, q_block_size=128, kv_block_size=64)
    assert on_gpu.on_device
    assert_same_metadata(on_gpu, on_host, note=f"seed={seed}")


def test_gpu_scalar_mode_and_flex_arrays():
    intervals = cp.asarray(np.array([[0, 70], [50, 180], [180, 250]]))
    boundaries = cp.repeat(cp.arange(3), 40)

    def vision_cross_attention(b, h, q_idx, kv_idx):  # attention-gym's Flamingo mask, CuPy tables
        interval = intervals[boundaries[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    bm = builders.from_mask_mod(vision_cross_attention, None, None, 250, 120, q_block_size=64, kv_block_size=32,
                                xp=cp)
    q, kv = np.arange(250)[:, None], np.arange(120)[None, :]
    iv = np.array([[0, 70], [50, 180], [180, 250]])[kv // 40]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (q >= iv[..., 0]) & (q < iv[..., 1]))


# --------------------------------------------------------------------------------- properties
def spin(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds``."""
    kernel = cp.RawKernel(r'''extern "C" __global__ void omnicupy_test_spin(long long cycles) {
        const long long start = clock64(); while (clock64() - start < cycles) {} }''', "omnicupy_test_spin")
    rate_khz = cp.cuda.Device().attributes["ClockRate"]
    kernel((1,), (1,), (np.int64(seconds * rate_khz * 1e3),))


@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES
                                     if f(1, 1).bounds is not None and f(1, 1).bounds_exact])
def test_structured_gpu_builds_and_first_use_do_not_wait(factory):
    """Built on the GPU while the stream is busy: the build, the first device_metadata() and the
    launch order's input (q_block_work) return before the busy work ends."""
    mod = factory(4096, 4096)
    builders.from_mask_mod(mod, None, None, 4096, 4096, xp=cp).device_metadata()  # kernels loaded, pools warm
    cp.cuda.Device().synchronize()
    spin(0.5)
    started = time.perf_counter()
    bm = builders.from_mask_mod(mod, None, None, 4096, 4096, xp=cp)
    bm.device_metadata()
    work = bm.q_block_work
    rule = BlockMask.causal(4096, 4096)
    rule.device_metadata()
    elapsed = time.perf_counter() - started
    cp.cuda.Device().synchronize()
    assert elapsed < 0.25, f"waited {elapsed:.3f} s behind the busy stream"
    assert_same_metadata(bm, builders.from_mask_mod(mod, None, None, 4096, 4096, xp=np))
    np.testing.assert_array_equal(work, schedule.q_block_work(bm))


def test_caller_cupy_arrays_do_not_reach_the_mask():
    bm = BlockMask.causal(300, 300)
    nb, idx, types = (cp.asarray(np.ascontiguousarray(a)) for a in (bm.kv_num_blocks, bm.kv_indices,
                                                                      bm.block_mask_types))
    owned = BlockMask(nb, idx, types, q_len=300, kv_len=300)
    meta = owned.device_metadata()
    idx[0, 0, 1, 0] = 99  # out of range: it must not reach a kernel
    nb[0, 0, 0] = 3
    assert int(owned.kv_indices[0, 0, 1, 0]) == 0 and int(meta.kv_indices[0, 0, 1, 0]) == 0
    assert int(owned.kv_num_blocks[0, 0, 0]) == 1 and int(meta.kv_num_blocks[0, 0, 0]) == 1


def test_compiles_at_first_use_are_said_once(tmp_cache, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_ready", set())
    monkeypatch.setattr(kernels, "_compiled_once", False)
    monkeypatch.setattr(build_pass, "_said_cupy_compiles", False)  # where the evaluating build pass says it
    monkeypatch.setattr(compile_mask, "ENABLED", False)  # the lambdas evaluated with CuPy, not translated
    from omnicupy import jit

    monkeypatch.setattr(jit, "_loaded", {})
    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        builders.from_mask_mod(masks.sliding_window(100), None, None, 1000, 1000, xp=cp)  # layout only
        builders.from_mask_mod(lambda b, h, q, kv: (q + kv) % 3 != 0, None, None, 1000, 1000, xp=cp)
    warnings_ = [r.getMessage() for r in caplog.records if r.name == "omnicupy.mask" and r.levelno == logging.WARNING]
    assert sum("compiled the block-mask kernel" in m for m in warnings_) == 1, warnings_
    assert sum("CuPy compiles the kernels" in m for m in warnings_) == 1, warnings_
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        builders.from_mask_mod(lambda b, h, q, kv: (q + kv) % 5 != 0, None, None, 1000, 1000, xp=cp)
    assert not [r for r in caplog.records if r.name == "omnicupy.mask"]


def test_pool_hashes_are_the_host_hashes():
    mod = masks.document(masks.doc_ids_from_lengths([100, 37, 500, 363]), causal=False)
    bm = builders.from_mask_mod(mod, None, None, 1000, 1000, q_block_size=64, kv_block_size=64, xp=cp,
                                use_structure=False)
    pool = bm.partial_block_masks.get()
    hashes = blocks.block_hashes(pool)
    assert np.all(np.diff(hashes.astype(np.uint64)) > 0)


# ----------------------------------------------------------------------- builds from pieces (pieces_build.py)
PIECED = [pytest.param(f, id=i) for i, f in MASK_CASES if f(8, 8).pieces is not None]


@pytest.mark.parametrize("qbs,kbs,q_len,kv_len", [(64, 64, 1000, 777), (16, 32, 300, 301), (256, 32, 1025, 1025),
                                                  (48, 256, 777, 1000)], ids=str)
@pytest.mark.parametrize("factory", PIECED)
def test_pieces_kernels_equal_their_emulation(factory, qbs, kbs, q_len, kv_len):
    """The scan's counts, flag and records (as a set: atomics order them) and the layout's arrays and
    pool, kernel against kernels.EmulatedBackend, from the same pieces and the same lookup."""
    mod = factory(q_len, kv_len)
    table = pieces_build.table(mod)
    sizes, count = (q_len, kv_len, qbs, kbs), len(mod.pieces.q)
    capacity = 4 * -(-q_len // qbs) + 64
    emulated = kernels.EmulatedBackend()
    want = emulated.pieces_scan(table, count, sizes, capacity)
    device = kernels.KernelBackend(cp)
    got = device.pieces_scan(cp.asarray(table), count, sizes, capacity)
    n = 2 + 4 * -(-q_len // qbs)
    np.testing.assert_array_equal(got[:n], want[:n])
    records = lambda out: sorted(map(tuple, out[n:n + 2 * int(out[0])].reshape(-1, 2).tolist()))  # noqa: E731
    assert records(got) == records(want)
    # The layout, from the emulated scan's pool (pieces_build's own steps).
    rec = want[n:n + 2 * int(want[0])].reshape(-1, 2)
    hashes, first = np.unique(rec[:, 1].view(np.uint64), return_index=True)
    lookup = np.concatenate([hashes.view(np.int64), rec[first, 0]])
    max_blocks = max(int(want[2:n].reshape(-1, 4)[:, 0].max()), 1)
    expected = emulated.pieces_layout(table, count, sizes, lookup, len(hashes), max_blocks)
    result = device.pieces_layout(cp.asarray(table), count, sizes, lookup, len(hashes), max_blocks)
    for name, a, b in zip(("counts", "indices", "types", "pool indices", "pool"), result, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a.get(), b, err_msg=name)


@pytest.mark.parametrize("name", ["causal", "sliding_window_1024", "document", "interleaved"])
def test_gpu_builds_from_pieces_at_131072(name):
    """The issue's masks at their benchmark length: the device build equals the host path's."""
    from benchmarks import bench_masks

    mod = bench_masks.workload(name, 131072)
    on_gpu = builders.from_mask_mod(mod, None, None, 131072, 131072, xp=cp)
    assert on_gpu._runs is None  # made by pieces_build
    assert_same_metadata(on_gpu, builders.from_mask_mod(mod, None, None, 131072, 131072, xp=np), name)


@pytest.mark.parametrize("mod, qbs", [
    pytest.param(masks.block_diagonal([64] + [128] * 20), 128, id="block_diagonal_64_128"),
    pytest.param(masks.document(masks.doc_ids_from_lengths(random_lengths(2000, 1, 120, seed=2000 * 7919 + 2000)),
                                causal=False), 64, id="document_noncausal"),
])
def test_a_collision_in_the_scan_kernel_falls_back_to_the_host_path(mod, qbs, monkeypatch, caplog):
    """With every hash multiplier 1 (a block's hash is the sum of its words) some distinct patterns
    share a hash: the scan kernel's table check finds them, like its emulation, and the build is the
    host path's."""
    monkeypatch.setattr(kernels, "_device_multipliers", lambda cp_, n_words: cp_.ones(n_words, dtype=np.uint64))
    monkeypatch.setattr(kernels.blocks, "block_hashes",
                        lambda bits: bits.reshape(len(bits), -1).astype(np.uint64).sum(axis=1))
    sizes, count = (2000, 2000, qbs, qbs), len(mod.pieces.q)
    want = kernels.EmulatedBackend().pieces_scan(pieces_build.table(mod), count, sizes, 4096)
    got = kernels.KernelBackend(cp).pieces_scan(cp.asarray(pieces_build.table(mod)), count, sizes, 4096)
    assert want[1] == 1 and got[1] == 1
    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        on_gpu = builders.from_mask_mod(mod, None, None, 2000, 2000, q_block_size=qbs, kv_block_size=qbs, xp=cp)
    assert "share a hash" in caplog.text
    # Against the host path under the same hashes (they also order the pool).
    assert_same_metadata(on_gpu, builders.from_mask_mod(mod, None, None, 2000, 2000, q_block_size=qbs,
                                                        kv_block_size=qbs, xp=np))


def test_gpu_build_from_pieces_at_2_24():
    """Issue 13's largest case on the device path: a sliding window at N = 2**24 (131072 q blocks:
    the scan's list and hash table at their largest) equals the host build, picture included."""
    n = 2**24
    on_gpu = builders.from_mask_mod(masks.sliding_window(1024), None, None, n, n, xp=cp)
    on_host = builders.from_mask_mod(masks.sliding_window(1024), None, None, n, n, xp=np)
    assert on_gpu._runs is None and on_gpu.kv_indices.shape == (1, 1, n // 128, 9)
    assert_same_metadata(on_gpu, on_host, "2**24")
    np.testing.assert_array_equal(on_gpu.q_block_work, on_host.q_block_work)
    assert on_gpu.to_string() == on_host.to_string()
