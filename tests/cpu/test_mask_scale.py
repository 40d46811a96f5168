"""Masks at scale (issue 13), on the CPU: the causal/full rules and inspection in memory that follows
the listed blocks, the summary (block counts, q-block work) the launch order reads without a
transfer, the builder kernels as omnicupy kernels (specs, NVRTC, a logged first compile), and the
device path's bookkeeping (what it sends, what it waits for) through the kernels' NumPy emulation."""
from __future__ import annotations

import contextlib

import logging
import time
import tracemalloc

import numpy as np
import pytest

from omnicupy import BlockMask, MaskError, masks
from omnicupy.dispatch import schedule
from omnicupy.mask import build_pass, builders, display, kernels, layout
from omnicupy.mask.types import BLOCK_CHARS, BlockType, cdiv

from helpers import random_block_mask, shuffled
from mask_cases import HOST_AS_DEVICE, MASK_CASES

CASE_PARAMS = [pytest.param(factory, id=case_id) for case_id, factory in MASK_CASES]


def measured(build):
    """(result, seconds, peak traced bytes) of ``build()``."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = build()
        return result, time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------- the rules at 2**20
@pytest.mark.parametrize("rule", ["causal", "full"])
def test_rules_at_a_million_positions_are_small_and_fast(rule):
    """The old builders made a dense [nQB, nKVB] grid and sorted it: 3.3 s and 2.3 GB for causal at 2**20."""
    n = 2**20
    getattr(BlockMask, rule)(1024, 1024)  # imports, caches
    bm, seconds, peak = measured(lambda: getattr(BlockMask, rule)(n, n))
    assert seconds < 0.5 and peak < (16 << 20), (seconds, peak)
    nqb = n // 128
    if rule == "causal":
        assert bm.summary.counts == (nqb * nqb - nqb * (nqb + 1) // 2, nqb, nqb * (nqb - 1) // 2, 0)
        np.testing.assert_array_equal(bm.q_block_work, 2 * np.arange(nqb) + 1)
    else:
        assert bm.summary.counts == (0, 0, nqb * nqb, 0) and bm.sparsity() == 0.0
    (text, seconds, peak) = measured(lambda: (repr(bm), bm.to_string()))
    assert seconds < 1.0 and peak < (64 << 20)
    picture = text[1].splitlines()
    assert len(picture) == 65 and all(len(line) == 64 for line in picture[:64])
    if rule == "causal":  # each diagonal square: half its blocks visited
        assert picture[0] == "5" + "." * 63 and picture[63] == "#" * 63 + "5"


def test_sliding_window_at_2_24_inspects_in_memory_of_its_listed_blocks():
    """The issue's case: a sliding window at N = 2**24 built, then repr, sparsity and to_string, which
    used to build the 131072 x 131072 block grid (16 GB) and raise MemoryError."""
    n = 2**24
    bm = builders.from_mask_mod(masks.sliding_window(1024), None, None, n, n, xp=np)
    assert bm.kv_indices.shape == (1, 1, n // 128, 9)
    (text, seconds, peak) = measured(lambda: (repr(bm), bm.sparsity(), bm.to_string()))
    assert peak < (128 << 20) and seconds < 5.0, (peak, seconds)
    nqb = n // 128
    assert "pool=1" in text[0] and f"causal={nqb}" in text[0]
    assert text[1] == pytest.approx(100 * (1 - (9 * nqb - 36) / nqb**2))
    lines = text[2].splitlines()
    assert lines[0] == "1" + "." * 63 and lines[1] == "11" + "." * 62 and "2048x2048 per character" in lines[-1]
    # The same picture from the metadata rows of a caller-made copy (no runs known): O(listed blocks) too.
    copy = BlockMask(bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, q_len=n, kv_len=n,
                     partial_block_mask_indices=bm.partial_block_mask_indices,
                     partial_block_masks=bm.partial_block_masks)
    assert copy._runs is None
    (picture, seconds, peak) = measured(copy.to_string)
    assert picture == text[2] and peak < (128 << 20)
    assert copy.summary.counts == bm.summary.counts


# ---------------------------------------------------------------------------------- pictures
def reference_picture(grid: np.ndarray, width: int) -> list[str]:
    """The documented rule, applied to the dense block grid [nQB, nKVB]."""
    nqb, nkvb = grid.shape
    side = max(1, cdiv(nkvb, width), cdiv(nqb, width))
    lines = []
    for i in range(0, nqb, side):
        chars = []
        for j in range(0, nkvb, side):
            square = grid[i:i + side, j:j + side]
            kinds = set(np.unique(square).tolist())
            if len(kinds) == 1:
                chars.append(BLOCK_CHARS[BlockType(kinds.pop())])
            elif BlockType.MASKED not in kinds:
                chars.append("*")
            else:
                chars.append(str(int(np.clip(np.rint(10 * np.count_nonzero(square) / square.size), 1, 9))))
        lines.append("".join(chars))
    return lines


@pytest.mark.parametrize("width", [1, 3, 8, 64])
@pytest.mark.parametrize("case", ["random", "shuffled", "builder"])
def test_pictures_follow_the_documented_rule(case, width):
    rng = np.random.default_rng(7)
    if case == "builder":
        bm = builders.from_mask_mod(masks.interleaved([("text", 300), ("image", 500), ("text", 200)]), None, None,
                                    1000, 1000, q_block_size=32, kv_block_size=32, xp=np)
    else:
        bm, _ = random_block_mask(rng, 2, 1, 700, 900, 32, 64)
        if case == "shuffled":
            bm = shuffled(bm, rng)
    for b in range(bm.shape[0]):
        lines = bm.to_string(batch=b, width=width).splitlines()
        expected = reference_picture(bm.block_grid()[b, 0], width)
        assert lines[:len(expected)] == expected
        assert len(lines) == len(expected) + (1 if "per character" in lines[-1] else 0)


def test_runs_and_slots_draw_the_same_picture():
    for factory in (f for _, f in MASK_CASES):
        bm = builders.from_mask_mod(factory(1000, 1000), 2, None, 1000, 1000, q_block_size=16, kv_block_size=32, xp=np)
        rows = [bm.kv_num_blocks[1, 0], bm.kv_indices[1, 0], bm.block_mask_types[1, 0], bm.num_kv_blocks]
        for width in (5, 64):
            assert bm.to_string(batch=1, width=width) == display.picture(*rows, width)


def test_dense_views_are_refused_past_their_limit():
    bm = BlockMask.causal(2**22, 2**22)  # 32768 x 32768 blocks
    with pytest.raises(MaskError, match=r"block_grid\(\) would hold 1073741824 entries"):
        bm.block_grid()
    with pytest.raises(MaskError, match=r"to_dense\(\) would hold"):
        bm.to_dense()


# ------------------------------------------------------------------------------------ summary
def counts_from_grid(bm: BlockMask) -> tuple[int, ...]:
    grid = bm.block_grid()
    return tuple(int(np.count_nonzero(grid == t)) for t in BlockType)


@pytest.mark.parametrize("xp", [np, HOST_AS_DEVICE], ids=["host", "device"])
@pytest.mark.parametrize("use_structure", [True, False], ids=["structured", "generic"])
@pytest.mark.parametrize("factory", CASE_PARAMS)
def test_builder_summaries_match_the_metadata(factory, use_structure, xp):
    bm = builders.from_mask_mod(factory(700, 500), 2, 3, 700, 500, q_block_size=64, kv_block_size=32, xp=xp,
                                use_structure=use_structure)
    assert bm.summary.counts == counts_from_grid(bm)
    np.testing.assert_array_equal(bm.q_block_work, schedule.q_block_work(bm))


@pytest.mark.parametrize("seed", range(4))
def test_validated_summaries_match_the_metadata(seed):
    rng = np.random.default_rng(seed)
    bm, _ = random_block_mask(rng, 2, 3, 500, 700, 64, 32, empty_q_blocks=1, shuffle=seed % 2 == 1)
    assert bm.summary.counts == counts_from_grid(bm)
    np.testing.assert_array_equal(bm.q_block_work, schedule.q_block_work(bm))
    for rule in (BlockMask.causal, BlockMask.full):
        made = rule(500, 700, q_block_size=64, kv_block_size=32)
        assert made.summary.counts == counts_from_grid(made)
        np.testing.assert_array_equal(made.q_block_work, schedule.q_block_work(made))


# --------------------------------------------------------------------------- exact structure
def test_exact_masks_never_call_their_mask_mod():
    def never(b, h, q_idx, kv_idx):
        raise AssertionError("evaluated")

    for window in (1, 100, 1024):
        real = masks.sliding_window(window)
        structure_only = masks.MaskMod(never, "never", bounds=real.bounds)
        for qbs, kbs in ((64, 64), (128, 32), (16, 256)):
            got = builders.from_mask_mod(structure_only, None, None, 1500, 1300, q_block_size=qbs, kv_block_size=kbs,
                                         xp=np)
            want = builders.from_mask_mod(real, None, None, 1500, 1300, q_block_size=qbs, kv_block_size=kbs, xp=np,
                                          use_structure=False)
            for name in ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices",
                         "partial_block_masks"):
                a, b = getattr(got, name), getattr(want, name)
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(a, b, err_msg=name)


def test_structure_is_computed_in_bounded_chunks(monkeypatch):
    from omnicupy.mask import mask_mod

    pieced = masks.document(masks.doc_ids_from_lengths([300, 1, 700, 500, 548]), causal=True)
    # Without its pieces (which need no chunks), so that the rows' bounds are computed chunk by chunk.
    mod = masks.MaskMod(pieced.fn, pieced.name, bounds=pieced.bounds, length=pieced.length)
    one = builders.from_mask_mod(mod, None, 2, 2049, 2049, q_block_size=64, kv_block_size=64, xp=np)
    monkeypatch.setattr(mask_mod, "BOUNDS_ELEMENTS_PER_CHUNK", 64 * 2 * 3)  # three q blocks of two heads
    chunked = builders.from_mask_mod(mod, None, 2, 2049, 2049, q_block_size=64, kv_block_size=64, xp=np)
    for name in ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices",
                 "partial_block_masks"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(one, name), err_msg=name)


# -------------------------------------------------------------------------------- device path
class RecordingBackend(kernels.EmulatedBackend):
    """The emulation, recording which device operations a build asks for."""

    def __init__(self, xp):
        super().__init__(xp)
        self.calls = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("upload", "download", "block_indices", "classify", "gather_blocks", "blocks_differ", "layout",
                    "pieces_scan", "pieces_layout"):
            self.calls.append(name)
        return attr

    @contextlib.contextmanager
    def stream(self):
        self.calls.append("own stream")
        yield
        self.calls.append("caller's stream")


@pytest.fixture
def recording(monkeypatch):
    made = []

    def backend_for(xp):
        if xp is np:
            return None
        made.append(RecordingBackend(xp))
        return made[-1]

    monkeypatch.setattr(build_pass, "backend_for", backend_for)  # where _Build asks for its backend
    return made


@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES
                                     if f(1, 1).bounds is not None and f(1, 1).bounds_exact])
def test_structured_device_builds_wait_only_on_their_own_stream(factory, recording):
    """An exact mask on a device. With pieces (pieces_build.py): one upload of them and the scan, whose
    read back is the build's one wait, on the build's own stream; then the layout on the caller's.
    Without: the layout kernel and at most one upload of the pool, nothing read back. Causal rows
    (written arithmetically) are one upload and no kernel."""
    mod = factory(1000, 1000)
    builders.from_mask_mod(mod, None, 2, 1000, 1000, q_block_size=64, kv_block_size=64, xp=HOST_AS_DEVICE)
    builders.from_mask_mod(mod, None, 2, 1000, 1000, q_block_size=64, kv_block_size=64, xp=HOST_AS_DEVICE)
    first, again = recording
    if mod.pieces is not None and not builders._is_causal(mod):  # (a small causal mask: causal rows)
        own = ["own stream", "pieces_scan", "caller's stream", "pieces_layout"]
        assert first.calls == own[:1] + ["upload"] + own[1:], first.calls  # the pieces uploaded once per device
        assert again.calls == own, again.calls
        return
    for backend in recording:
        assert backend.calls.count("layout") == (0 if builders._is_causal(mod) else 1), backend.calls
        assert set(backend.calls) <= {"layout", "upload"} and backend.calls.count("upload") <= 1, backend.calls


def test_evaluated_device_builds_wait_once_per_chunk(recording, monkeypatch):
    monkeypatch.setattr(build_pass, "DEVICE_CHUNK_ELEMENTS", 64 * 64 * 10)
    mod = masks.dilated_sliding_window(20, 3)
    bm = builders.from_mask_mod(mod, None, None, 1000, 1000, q_block_size=64, kv_block_size=64, xp=HOST_AS_DEVICE)
    (backend,) = recording
    evaluated = int(np.count_nonzero(mod.classify_blocks(1, 1, 1000, 1000, 64, 64) == masks.EVALUATE))
    chunks = cdiv(evaluated, 10)
    # One download of types and hashes per chunk; the compare of equal hashes is the only other wait.
    assert backend.calls.count("download") == chunks and backend.calls.count("blocks_differ") <= 1
    assert backend.calls.count("classify") == chunks and backend.calls.count("layout") == 1
    np.testing.assert_array_equal(bm.to_dense(), builders.from_mask_mod(mod, None, None, 1000, 1000,
                                                                        q_block_size=64, kv_block_size=64,
                                                                        xp=np).to_dense())


@pytest.mark.parametrize("seed", range(3))
def test_dense_masks_on_the_device_path(seed):
    """from_dense's device path (classify reading the mask in place) against its host path."""
    rng = np.random.default_rng(seed)
    mask = rng.random((2, 1, 300, 200)) < [[[[0.1]]], [[[0.9]]]]
    mask[:, :, :, :64] |= np.tri(300, 64, dtype=bool)  # some causal-looking blocks
    host = BlockMask.from_dense(mask, q_block_size=64, kv_block_size=64)
    build = builders._Build(host.mask_mod, (2, 1), 300, 200, 64, 64, HOST_AS_DEVICE, "broadcast")
    device = build.every_block((2, 1, build.nqb), dense=mask)
    for name in ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices",
                 "partial_block_masks"):
        np.testing.assert_array_equal(getattr(device, name), getattr(host, name), err_msg=f"{name} seed={seed}")
    np.testing.assert_array_equal(host.to_dense(), mask)


def test_emulated_layout_equals_the_host_layout():
    rng = np.random.default_rng(3)
    for mod in (masks.interleaved([("text", 100), ("image", 300), ("text", 600)]), masks.prefix_lm(333)):
        bm = builders.from_mask_mod(mod, None, 3, 1000, 1000, q_block_size=32, kv_block_size=32, xp=np)
        runs = bm._runs
        items = layout.Items(runs.row, runs.kv, runs.length, runs.kind.astype(np.int8),
                             rng.integers(0, 5, len(runs.row)).astype(np.int32))
        segments = layout.segments_of(items, int(np.prod(runs.grid)))
        host = layout.write_host(segments)
        device = kernels.EmulatedBackend().layout(layout.device_table(segments), segments.rows, segments.max_blocks,
                                                  len(segments.start), True)
        for a, b in zip(host, device):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- kernels as specs
def test_precompile_specs_name_every_kernel():
    specs = builders.precompile_specs()
    assert {s.name for s in specs} == {f"omni_mask_{op}" for op in kernels.TEMPLATES}
    for spec in specs:
        assert spec.template.startswith("mask_") and spec.smem_bytes == 0
        assert spec.target_arch("sm_90a") == "sm_90" and spec.target_arch("sm_80") == "sm_80"
        assert spec.template_params()["kernel_name"] == spec.name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_with_nvrtc(arch, tmp_cache):
    from omnicupy import jit

    for spec in builders.precompile_specs():
        entry, built = jit.build(spec, arch)
        assert built and entry.meta["kernel"] == spec.name and entry.meta["spill_bytes"] in (0, None)
        assert not jit.build(spec, arch)[1]  # cached: `omnicupy precompile` covers them


def test_a_compile_at_first_use_is_logged_once(monkeypatch, caplog):
    from omnicupy import jit

    monkeypatch.setattr(kernels, "_ready", set())
    monkeypatch.setattr(kernels, "_compiled_once", False)
    monkeypatch.setattr(jit, "device_arch", lambda device_id=None: "sm_90")
    monkeypatch.setattr(jit, "build", lambda spec, arch: (None, True))
    monkeypatch.setattr(jit, "get_kernel", lambda spec: spec.name)
    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        for op in ("layout", "classify", "layout"):
            assert kernels.load(kernels.MaskKernel(op)) == f"omni_mask_{op}"
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "omnicupy.mask"]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]
    assert "omnicupy precompile" in messages[0][1] and "omni_mask_layout" in messages[0][1]
