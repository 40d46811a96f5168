"""CPU tests of the benchmark harness (benchmarks/): FLOP and pair counting, the benchmark masks
against independently built dense masks, the JSON rows, the table, the CLI and the dry run.
No torch and no GPU needed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not installed; `pytest` alone does not put the root on the path
    sys.path.insert(0, str(REPO))

from benchmarks import _cases, _report, _systems  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402
from omnicupy import arrays  # noqa: E402


def dense(mask: _cases.MaskCase) -> np.ndarray:
    n = mask.seq_len
    return mask.rows(np.arange(n))


# --------------------------------------------------------------------------- arithmetic
def test_attention_flops_counts_four_per_pair_and_dim():
    assert _cases.attention_flops(2, 16, 8192 * 8192, 128) == 4 * 2 * 16 * 8192 * 8192 * 128
    assert _cases.attention_flops(1, 1, 10, 64) == 2560


def test_tflops_from_ms():
    assert _cases.tflops(2 * 10**12, 1000.0) == pytest.approx(2.0)
    assert _cases.tflops(10**12, 2.0) == pytest.approx(500.0)
    assert _cases.tflops(10**12, None) is None
    assert _cases.tflops(10**12, 0.0) is None


def test_batch_keeps_tokens_near_16k():
    assert [_cases.batch_for(n) for n in (1024, 4096, 8192, 16384, 32768)] == [16, 4, 2, 1, 1]


@pytest.mark.parametrize("n", [128, 384, 1024])
def test_full_and_causal_pairs(n):
    assert _cases.count_pairs(_cases.make_mask("full", n).array_mod(), n) == n * n
    assert _cases.count_pairs(_cases.make_mask("causal", n).array_mod(), n) == n * (n + 1) // 2


def test_sliding_window_pairs_match_formula():
    n = 4096
    expected = sum(min(q + 1, _cases.WINDOW) for q in range(n))
    assert _cases.count_pairs(_cases.make_mask("sliding_window", n).array_mod(), n) == expected


def test_prefix_lm_pairs_match_formula():
    n = 2048
    prefix = n // 4
    expected = sum(max(q + 1, prefix) for q in range(n))
    assert _cases.count_pairs(_cases.make_mask("prefix_lm", n).array_mod(), n) == expected


@pytest.mark.parametrize("name", _cases.MASK_NAMES)
def test_pair_count_is_exact_and_chunk_independent(name):
    n = 640
    mask = _cases.make_mask(name, n)
    want = int(dense(mask).sum())
    assert _cases.count_pairs(mask.array_mod(), n) == want
    assert _cases.count_pairs(mask.array_mod(), n, chunk_elems=1) == want  # one row at a time
    assert _cases.count_pairs(mask.array_mod(), n, chunk_elems=3 * n + 1) == want  # ragged last chunk
    assert _cases.density(want, n) == pytest.approx(want / n**2)


def test_default_densities_are_near_design_bar():
    """The densities of the original brief's benchmark masks at N=8192 (the document mask is random: a wider band)."""
    n = 8192
    near = {"full": 1.0, "causal": 0.5, "sliding_window": 0.12, "prefix_lm": 0.53, "interleaved": 0.52}
    for name, want in near.items():
        got = _cases.density(_cases.count_pairs(_cases.make_mask(name, n).array_mod(), n), n)
        assert got == pytest.approx(want, abs=0.01), name
    doc = _cases.density(_cases.count_pairs(_cases.make_mask("document", n).array_mod(), n), n)
    assert 0.04 < doc < 0.15
    for name, block_density in (("random_50", 0.5), ("random_10", 0.1)):
        got = _cases.density(_cases.count_pairs(_cases.make_mask(name, n).array_mod(), n), n)
        partial = _cases.RANDOM_PARTIAL_FRACTION
        assert got == pytest.approx(block_density * (1 - partial / 2), rel=0.1), name


# --------------------------------------------------------------------------- masks vs independent dense builds
def test_document_mask_matches_loop_construction():
    n = 3000 // 128 * 128
    mask = _cases.make_mask("document", n)
    ids = _cases.document_ids(n)
    lengths = np.bincount(ids)
    assert lengths[:-1].min() >= _cases.DOC_MIN and lengths.max() <= _cases.DOC_MAX
    want = np.zeros((n, n), dtype=bool)
    start = 0
    for length in lengths:
        want[start:start + length, start:start + length] = np.tril(np.ones((length, length), dtype=bool))
        start += length
    np.testing.assert_array_equal(dense(mask), want)
    np.testing.assert_array_equal(_cases.document_ids(n), ids)  # seeded: the same docs every time


def test_interleaved_mask_matches_segment_construction():
    n = 2560
    segments = _cases.interleaved_segments(n)
    assert sum(length for _, length in segments) == n
    assert segments[:2] == [("text", _cases.TEXT_LEN), ("image", _cases.IMAGE_LEN)]
    want = np.tril(np.ones((n, n), dtype=bool))
    start = 0
    for kind, length in segments:
        if kind == "image":
            want[start:start + length, :start + length] = True
        start += length
    np.testing.assert_array_equal(dense(_cases.make_mask("interleaved", n)), want)


@pytest.mark.parametrize("name,density", [("random_50", 0.5), ("random_10", 0.1)])
def test_random_block_mask_matches_its_table(name, density):
    n = 2048
    nb = n // _cases.BLOCK
    kinds, seeds = (t.reshape(nb, nb) for t in _cases.random_block_tables(n, density))
    keep = max(1, round(density * nb))
    assert ((kinds != 0).sum(axis=1) == keep).all()
    assert (np.diag(kinds) == 1).all()  # diagonal kept FULL: no empty row
    m = dense(_cases.make_mask(name, n))
    fractions = []
    for qb in range(nb):
        for kb in range(nb):
            block = m[qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128]
            if kinds[qb, kb] == 0:
                assert not block.any()
            elif kinds[qb, kb] == 1:
                assert block.all()
            else:
                q = np.arange(qb * 128, (qb + 1) * 128)[:, None]
                kv = np.arange(kb * 128, (kb + 1) * 128)[None, :]
                np.testing.assert_array_equal(block, _cases.hash_bit(q, kv, seeds[qb, kb]) == 1)
                fractions.append(block.mean())
    if fractions:
        assert 0.35 < np.mean(fractions) < 0.65
    assert m.any(axis=1).all()


@pytest.mark.parametrize("name", _cases.MASK_NAMES)
def test_rules_agree_in_int32_and_int64(name):
    """flex evaluates mask_mods on int32 indices: no intermediate may overflow."""
    n = 16384
    mask = _cases.make_mask(name, n)
    rows = _cases.sample_rows(n, count=24)
    kv = np.arange(n)
    got32 = mask.rule(rows.astype(np.int32)[:, None], kv.astype(np.int32)[None, :],
                      *(t.astype(np.int32) for t in mask.tables))
    got64 = mask.rule(rows.astype(np.int64)[:, None], kv.astype(np.int64)[None, :],
                      *(t.astype(np.int64) for t in mask.tables))
    np.testing.assert_array_equal(np.broadcast_to(got32, (rows.size, n)), np.broadcast_to(got64, (rows.size, n)))


def test_hash_stays_below_int32():
    q = np.arange(128, dtype=np.int64)[:, None]
    kv = np.arange(128, dtype=np.int64)[None, :]
    x = (q % 128) * 151 + (kv % 128) * 2753 + 4095 * 977
    assert int(((x ^ (x >> 7)) * 37).max()) < 2**31


def test_unknown_mask_raises():
    with pytest.raises(ValueError, match="unknown mask"):
        _cases.make_mask("nope", 1024)


@pytest.mark.parametrize("name", _cases.MASK_NAMES)
def test_torch_mask_mods_match_when_torch_is_here(name):
    """flex gets the same mask: torch's own element-wise evaluation (vmap) of the torch mask_mod."""
    pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    n = 1152
    mask = _cases.make_mask(name, n)
    got = flex.create_mask(mask.torch_mod("cpu"), 1, 1, n, n, device="cpu")[0, 0].numpy()
    np.testing.assert_array_equal(got, dense(mask))


@pytest.mark.parametrize("n", [1024, 1152, 1000])
@pytest.mark.parametrize("name", _cases.MASK_NAMES)
def test_dense_table_equals_the_rule(name, n):
    """flex gets the random masks as ``dense[q, kv]``: that table must be the rule, element for element
    (int32 chunks vs int64 rows), padded with False to whole blocks."""
    mask = _cases.make_mask(name, n)
    table = mask.dense(chunk_elems=3 * n + 5)  # uneven row chunks
    padded = -(-n // _cases.BLOCK) * _cases.BLOCK
    assert table.dtype == np.bool_ and table.shape == (padded, padded)
    np.testing.assert_array_equal(table[:n, :n], dense(mask))
    assert not table[n:].any() and not table[:, n:].any()
    mod = _cases.dense_mod(table)
    q, kv = np.arange(n)[:, None], np.arange(n)[None, :]
    np.testing.assert_array_equal(mod(0, 0, q, kv), dense(mask))
    assert _cases.count_pairs(mod, n) == _cases.count_pairs(mask.array_mod(), n)


def test_only_the_random_masks_go_to_flex_as_a_dense_table():
    assert {m for m in _cases.MASK_NAMES if _cases.make_mask(m, 1024).flex_dense} == {"random_50", "random_10"}


@pytest.mark.parametrize("name", ["random_50", "random_10"])
def test_torch_dense_mask_mod_matches_when_torch_is_here(name):
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    n = 1152
    mask = _cases.make_mask(name, n)
    mod = _cases.dense_mod(torch.from_numpy(mask.dense()))
    got = flex.create_mask(mod, 1, 1, n, n, device="cpu")[0, 0].numpy()
    np.testing.assert_array_equal(got, dense(mask))


# --------------------------------------------------------------------------- omnicupy's own masks
class _FakeMasks:
    """Stands in for omnicupy.masks: ``wrong=True`` gives a sliding window one key too wide."""

    def __init__(self, wrong=False):
        self.wrong = wrong

    def sliding_window(self, window):
        w = window + 1 if self.wrong else window
        return lambda b, h, q, kv: (q >= kv) & (q - kv < w)


def test_resolve_prefers_omnicupy_masks_when_they_agree():
    mask = _cases.make_mask("sliding_window", 2048)
    mod, source, note = _cases.resolve_product_mod(mask, _FakeMasks())
    assert note is None and source == "masks.sliding_window(1024)"
    assert _cases.count_pairs(mod, 2048) == _cases.count_pairs(mask.array_mod(), 2048)


def test_resolve_falls_back_to_the_benchmark_rule():
    mask = _cases.make_mask("sliding_window", 2048)
    _, source, note = _cases.resolve_product_mod(mask, _FakeMasks(wrong=True))
    assert source == "benchmark rule" and "disagrees" in note
    _, source, note = _cases.resolve_product_mod(mask, None)
    assert source == "benchmark rule" and "not importable" in note
    _, source, note = _cases.resolve_product_mod(_cases.make_mask("document", 1024), _FakeMasks())
    assert source == "benchmark rule" and "failed" in note  # the fake has no document()
    _, source, note = _cases.resolve_product_mod(_cases.make_mask("random_10", 1024), _FakeMasks())
    assert source == "benchmark rule" and note is None


@pytest.mark.parametrize("name", ["sliding_window", "document", "prefix_lm", "interleaved", "random_50"])
def test_omnicupy_block_mask_encodes_the_benchmark_mask(name):
    """The BlockMask omnicupy times with has exactly the benchmark's allowed pairs."""
    from omnicupy import BlockMask
    n = 1024
    mask = _cases.make_mask(name, n)
    mod, _, _ = _cases.resolve_product_mod(mask, _cases.masks_module())
    bm = BlockMask.from_mask_mod(mod, None, None, n, n)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], dense(mask))


# --------------------------------------------------------------------------- plan
def test_skip_reasons():
    flex256 = _cases.Case("causal", 8192, 256, "fp16", 2)
    assert _cases.skip_reason("flex", flex256)
    assert _cases.skip_reason("sdpa_flash", flex256) is None
    doc = _cases.Case("document", 8192, 128, "fp16", 2)
    assert _cases.skip_reason("sdpa_cudnn", doc) and _cases.skip_reason("sdpa_flash", doc)
    assert _cases.skip_reason("flex", doc) is None and _cases.skip_reason("omnicupy", doc) is None


def test_plan_order_groups_shapes():
    cases = _cases.plan(("full", "causal"), (64, 128), (1024, 8192), ("fp16",))
    assert len(cases) == 8
    shapes = [(c.dtype, c.head_dim, c.seq_len) for c in cases]
    assert shapes == sorted(shapes, key=shapes.index)  # each shape's cases are contiguous
    assert cases[0].batch == 16 and cases[-1].batch == 2


# --------------------------------------------------------------------------- rows, JSON, table
def _case(mask="causal", d=128, n=8192, dtype="fp16"):
    return _cases.Case(mask, n, d, dtype, _cases.batch_for(n))


def test_row_has_exact_keys_and_tflops():
    case = _case()
    pairs = n_pairs = 8192 * 8193 // 2
    row = _report.make_row("omnicupy", case, n_pairs / 8192**2, pairs, 2.0, True)
    assert tuple(row) == _report.ROW_KEYS
    assert row["tflops"] == pytest.approx(4 * 2 * 16 * pairs * 128 / 2e-3 / 1e12, abs=1e-3)
    assert row["batch"] == 2 and row["heads"] == 16 and row["correct"] is True


def test_wrong_row_has_no_time():
    row = _report.make_row("flex", _case(), 0.5, 10, 1.5, False)
    assert row["ms"] is None and row["tflops"] is None and row["correct"] is False


def test_json_document_shape(tmp_path):
    meta = {"device": "NVIDIA H200", "driver": "580.1", "versions": {"torch": "2.11"}, "date": "2026-11-22T00:00:00Z"}
    rows = [_report.make_row(s, _case(), 0.5, 100, 1.0, True) for s in _cases.SYSTEMS]
    doc = _report.document(meta, rows, errors=[], mask_build=[{"mask": "causal"}], **{"device": "not this"})
    assert list(doc)[:5] == ["device", "driver", "versions", "date", "rows"]
    assert doc["mask_build"] == [{"mask": "causal"}] and doc["device"] == "NVIDIA H200"
    path = tmp_path / "out" / "results.json"
    _report.write_json(path, doc)
    loaded = json.loads(path.read_text())
    assert {r["system"] for r in loaded["rows"]} == set(_cases.SYSTEMS)
    assert all(set(r) == set(_report.ROW_KEYS) for r in loaded["rows"])
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # no temporary left behind


def test_table_cells():
    case = _case("causal")
    rows = [
        _report.make_row("omnicupy", case, 0.5, 8192 * 8192 // 2, 2.0, True),
        _report.make_row("omnicupy_stage1", case, 0.5, 8192 * 8192 // 2, 4.0, True),
        _report.make_row("omnicupy_stage2", case, 0.5, 8192 * 8192 // 2, 2.0, True),
        _report.make_row("flex", case, 0.5, 8192 * 8192 // 2, 1.0, True),
        _report.make_row("sdpa_flash", case, 0.5, 8192 * 8192 // 2, None, False),
        _report.make_row("omnicupy", _case("document"), 0.07, 1000, 1.0, True),
    ]
    errors = [{"system": "sdpa_cudnn", "mask": "causal", "head_dim": 128, "seq_len": 8192, "dtype": "fp16",
               "error": "RuntimeError: no kernel"}]
    text = _report.format_table(rows, errors)
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "mask" and "omnicupy/flex" in lines[0]
    assert "FA2" in lines[0] and "cuDNN" in lines[0] and "density" in lines[0]
    causal = next(line for line in lines if line.startswith("| causal"))
    cells = [c.strip() for c in causal.strip("|").split("|")]
    assert cells[:5] == ["causal", "128", "8192", "fp16", "0.500"]
    assert cells[5] == "275" and cells[6] == "137/275" and cells[7] == "550"
    assert cells[8] == "WRONG" and cells[9] == "err" and cells[10] == "0.50"
    doc_line = next(line for line in lines if line.startswith("| document"))
    assert [c.strip() for c in doc_line.strip("|").split("|")][7:] == ["-", "-", "-", "-"]
    assert lines.index(causal) < lines.index(doc_line)  # masks in the benchmark's order
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_chart_draws_or_explains(tmp_path, capsys):
    rows = [_report.make_row(s, _case(m, d), 0.5, 10**8, 1.0, True)
            for s in ("omnicupy", "flex") for m in ("full", "causal") for d in (64, 128)]
    path = _report.write_chart(rows, tmp_path / "chart.png", title="test")
    if path is None:
        assert "matplotlib" in capsys.readouterr().out
    else:
        assert path.exists() and path.stat().st_size > 1000
    assert _report.write_chart([], tmp_path / "empty.png") is None


# --------------------------------------------------------------------------- GPU-side logic with fakes
class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.t
        return Event()

    def elapsed_ms(self, start, stop):
        return stop.t - start.t

    def sync(self):
        pass


def test_time_ms_rotates_inputs_and_takes_median():
    clock = _FakeClock()
    calls = []

    def fn(i):
        calls.append(i)
        clock.t += 1.0 + i  # set i costs 1 + i ms

    ms = _systems.time_ms(fn, copies=3, clock=clock, warmup=4, rep=7)
    assert calls == [i % 3 for i in range(11)]
    timed = [1.0 + (4 + r) % 3 for r in range(7)]
    assert ms == pytest.approx(float(np.median(timed)))


def test_copies_exceed_l2():
    l2 = 50 * 2**20
    for set_bytes in (3 * 2 * 2 * 16 * 1024 * 64, 3 * 2 * 2 * 16 * 8192 * 128):
        copies = _systems.copies_for(set_bytes, l2)
        assert copies >= 2 and (copies * set_bytes >= 4 * l2 or copies == _systems.MAX_COPIES)


def _inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    return _systems.Inputs([tuple(rng.standard_normal(shape).astype(np.float16) for _ in range(3))], None)


def test_reference_rows_judge_outputs():
    from omnicupy import reference

    case = _cases.Case("document", 512, 32, "fp16", 2, heads=2)
    mask = _cases.make_mask("document", 512)
    inputs = _inputs(case)
    ref = _systems.Reference(mask, case, inputs, seed=1)
    assert ref.heads == [(0, 0), (1, 1)] and ref.rows[0] == 0 and ref.rows[-1] == 511
    q, k, v = inputs.native(0)
    exact = reference.attention(q, k, v, dense(mask))
    assert ref.error(exact.astype(np.float16)) < 1e-3
    causal_only = reference.attention(q, k, v, np.tril(np.ones((512, 512), dtype=bool)))
    assert ref.error(causal_only) > 1e-2  # the wrong mask is caught
    nan = exact.copy()
    nan[0, 0, 0, 0] = np.nan
    assert ref.error(nan) == float("inf")


class _FakeSystem(_systems.System):
    name = "omnicupy"

    def __init__(self, result, clock):
        self.result, self._clock, self.calls = result, clock, 0

    def clock(self, gpu):
        return self._clock

    def prepare(self, case, mask, bench):
        def fn(i):
            self.calls += 1
            self._clock.t += 2.0
            return self.result
        return fn


class _FakeGpu:
    cp = np


@pytest.mark.parametrize("wrong", [False, True])
def test_bench_run_checks_before_timing(wrong):
    from omnicupy import reference

    case = _cases.Case("causal", 256, 32, "bf16", 1, heads=1)
    mask = _cases.make_mask("causal", 256)
    inputs = _inputs(case)
    q, k, v = inputs.native(0)
    out = reference.attention(q, k, v, dense(mask))
    if wrong:
        out = out[:, :, ::-1].copy()
    bench = _systems.Bench(_FakeGpu(), warmup=2, rep=5, check=True, mask_repeats=0, cache_label="test",
                           log=lambda s: None)
    bench.inputs = inputs
    system = _FakeSystem(out, _FakeClock())
    row = bench.run(system, case, mask, lambda: _systems.Reference(mask, case, inputs, seed=0))
    assert tuple(row) == _report.ROW_KEYS
    assert row["density"] == pytest.approx(256 * 257 / 2 / 256**2, rel=1e-5)
    if wrong:
        assert row["correct"] is False and row["ms"] is None and system.calls == 1  # not timed
    else:
        assert row["correct"] is True and row["ms"] == pytest.approx(2.0) and system.calls == 1 + 2 + 5
    assert bench.first_call[0]["system"] == "omnicupy" and bench.first_call[0]["cache"] == "test"


# --------------------------------------------------------------------------- CLI
def test_default_config_covers_8192_everything():
    cfg = bench_run.parse_args([])
    assert cfg.seq_lens == (8192,)
    assert cfg.masks == _cases.MASK_NAMES and len(cfg.masks) == 8
    assert cfg.head_dims == (64, 128, 256) and cfg.dtypes == ("fp16", "bf16")
    assert cfg.systems == _cases.SYSTEMS
    assert (cfg.warmup, cfg.rep, cfg.check, cfg.dry_run, cfg.cold_compile) == (10, 30, True, False, False)


def test_flags_pick_subsets():
    cfg = bench_run.parse_args(["--masks", "causal, document", "--head-dims", "64", "--seq-lens", "1024,16384",
                                "--dtypes", "bfloat16", "--systems", "omnicupy,flex", "--no-check", "--out", "x",
                                "--budget", "500", "--cold-compile", "--rep", "5"])
    assert cfg.masks == ("causal", "document") and cfg.head_dims == (64,) and cfg.seq_lens == (1024, 16384)
    assert cfg.dtypes == ("bf16",) and cfg.systems == ("omnicupy", "flex")
    assert not cfg.check and cfg.out == "x" and cfg.budget == 500 and cfg.cold_compile and cfg.rep == 5


def test_quick_and_explicit_flags():
    cfg = bench_run.parse_args(["--quick"])
    assert cfg.seq_lens == (4096,) and cfg.head_dims == (128,) and cfg.dtypes == ("fp16",) and cfg.rep == 10
    assert cfg.masks == _cases.MASK_NAMES
    cfg = bench_run.parse_args(["--quick", "--head-dims", "64", "--rep", "20"])
    assert cfg.head_dims == (64,) and cfg.rep == 20 and cfg.seq_lens == (4096,)
    assert bench_run.parse_args(["--masks", "all"]).masks == _cases.MASK_NAMES


@pytest.mark.parametrize("argv", [["--masks", "nope"], ["--head-dims", "48"], ["--seq-lens", "1000"],
                                  ["--dtypes", "fp8"], ["--systems", "xformers"], ["--rep", "0"], ["--masks", ","]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench_run.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_dry_run_prints_plan(capsys):
    rc = bench_run.main(["--dry-run", "--seq-lens", "1024", "--head-dims", "64,256", "--dtypes", "fp16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "cases: 16" in out
    assert "sliding_window" in out and "random_10" in out
    full = next(line for line in out.splitlines() if line.startswith("full "))
    assert "1.0000" in full and str(1024 * 1024) in full
    line256 = next(line for line in out.splitlines() if "causal D=256" in line)
    assert "sdpa_flash" in line256 and " flex" not in line256.split(":")[1].split("(")[0]


@pytest.mark.parametrize("how", [["-m", "benchmarks.run"], ["benchmarks/run.py"]])
def test_dry_run_as_a_command(how):
    proc = subprocess.run([sys.executable, *how, "--dry-run", "--seq-lens", "512", "--masks", "causal,document",
                           "--head-dims", "128", "--dtypes", "bf16"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "cases: 2" in proc.stdout and "document" in proc.stdout


@pytest.mark.skipif(arrays.gpu_available(), reason="on a GPU this would run the benchmark")
def test_run_without_gpu_says_so(capsys):
    assert bench_run.main(["--masks", "causal", "--seq-lens", "1024"]) == 1
    assert "--dry-run" in capsys.readouterr().err


# --------------------------------------------------------------------------- the whole run, with fakes
class _RunGpu:
    """The Gpu interface on NumPy: lets the orchestration run on the CPU."""

    cp = np
    l2_bytes = 50 * 2**20
    torch = None
    torch_problem = ""

    def __init__(self, want_torch):
        pass

    def sync(self):
        pass

    def free(self):
        pass

    def meta(self):
        return {"device": "FakeGPU", "driver": "0", "versions": {"fake": "1"}, "date": "2026-11-22T00:00:00Z"}


class _RunSystem(_systems.System):
    """'good' computes the exact answer on the checked heads, 'wrong' a causal one, 'broken' raises."""

    def __init__(self, name, behaviour):
        self.name, self.behaviour, self.needs_torch = name, behaviour, False

    def clock(self, gpu):
        self._clock = _FakeClock()
        return self._clock

    def prepare(self, case, mask, bench):
        from omnicupy import reference

        if self.behaviour == "broken":
            raise RuntimeError("no kernel for this case")
        q, k, v = bench.inputs.native(0)
        rule = np.ones((case.seq_len,) * 2, dtype=bool) if self.behaviour == "wrong" else dense(mask)
        out = np.zeros(q.shape)
        for b, h in {(0, 0), (case.batch - 1, case.heads - 1)}:
            out[b, h] = reference.attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], rule)[0, 0]
        def fn(i):
            self._clock.t += 0.5
            return out
        return fn


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Runs main() on the CPU: fake GPU, NumPy inputs (their masks listed in ``made``), _RunSystems
    whose behaviour per name is ``behaviour`` (default 'good'); latest.json goes under tmp_path."""
    state = {"behaviour": {}, "made": []}

    def make_inputs(gpu, case, seed):
        state["made"].append(case.mask)
        return _inputs(case, seed)

    monkeypatch.setattr(arrays, "gpu_available", lambda: True)
    monkeypatch.setattr(_systems, "Gpu", _RunGpu)
    monkeypatch.setattr(_systems, "make_inputs", make_inputs)
    monkeypatch.setattr(_systems, "make_systems",
                        lambda names: [_RunSystem(n, state["behaviour"].get(n, "good")) for n in names])
    monkeypatch.setattr(bench_run, "RESULTS_DIR", tmp_path / "results")
    return state


def test_whole_run_with_fakes(tmp_path, fake_gpu, capsys):
    fake_gpu["behaviour"] = {"flex": "broken", "sdpa_flash": "wrong"}
    out = tmp_path / "run"
    rc = bench_run.main(["--masks", "causal,random_10", "--seq-lens", "256", "--head-dims", "32", "--dtypes", "fp16",
                         "--systems", "omnicupy,flex,sdpa_flash", "--out", str(out), "--warmup", "1", "--rep", "3",
                         "--no-chart"])
    assert rc == 0
    stdout = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    assert doc == json.loads((tmp_path / "results" / "latest.json").read_text())
    assert doc["device"] == "FakeGPU" and doc["finished"] is True
    got = {(r["system"], r["mask"]): r for r in doc["rows"]}
    assert set(got) == {("omnicupy", "causal"), ("omnicupy", "random_10"), ("sdpa_flash", "causal")}
    assert got[("omnicupy", "causal")]["correct"] is True and got[("omnicupy", "causal")]["ms"] == pytest.approx(0.5)
    assert got[("sdpa_flash", "causal")]["correct"] is False and got[("sdpa_flash", "causal")]["tflops"] is None
    assert {(e["system"], e["mask"]) for e in doc["errors"]} == {("flex", "causal"), ("flex", "random_10")}
    assert "no kernel" in doc["errors"][0]["error"]
    assert len(doc["first_call"]) == 3 and doc["masks"][0]["pairs"] == 256 * 257 // 2
    last = stdout.strip().splitlines()
    assert last[-1].startswith("| random_10") and "WRONG" in last[-2] and "err" in last[-2]
    assert (out / "results.md").read_text().count("| causal") == 1


def test_budget_stops_before_the_next_case(tmp_path, fake_gpu, monkeypatch, capsys):
    monkeypatch.setattr(bench_run.time, "perf_counter", iter(float(i) for i in range(10**6)).__next__)
    rc = bench_run.main(["--masks", "causal,document,random_10", "--seq-lens", "256", "--head-dims", "32",
                         "--dtypes", "fp16", "--systems", "omnicupy", "--out", str(tmp_path / "o"), "--budget", "1",
                         "--no-chart"])
    assert rc == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["finished"] is False and 1 <= len(doc["rows"]) < 3
    assert "budget" in capsys.readouterr().out


def test_resume_runs_only_missing_cases(tmp_path, fake_gpu):
    common = ["--seq-lens", "256", "--head-dims", "32", "--dtypes", "fp16", "--systems", "omnicupy", "--no-chart",
              "--rep", "2", "--warmup", "0"]
    assert bench_run.main(["--masks", "causal", "--out", str(tmp_path / "a"), *common]) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    assert bench_run.main(["--masks", "causal,document", "--out", str(tmp_path / "b"),
                           "--resume", str(tmp_path / "a" / "results.json"), *common]) == 0
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    assert second["rows"][0] == first["rows"][0]
    assert [r["mask"] for r in second["rows"]] == ["causal", "document"]
    assert fake_gpu["made"] == ["causal", "document"]  # the second run built inputs for document only
    assert second["config"]["resumed_from"].endswith("results.json")
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit):
        bench_run.main(["--masks", "causal", "--out", str(tmp_path / "c"), "--resume", str(tmp_path / "bad.json"),
                        *common])


def test_report_from_results_json(tmp_path, capsys):
    meta = {"device": "NVIDIA H200", "driver": "580", "versions": {}, "date": "2026-11-22T00:00:00Z"}
    rows = [_report.make_row(s, _case(), 0.5, 10**8, 1.0, True) for s in ("omnicupy", "flex")]
    _report.write_json(tmp_path / "results.json", _report.document(meta, rows, errors=[]))
    assert bench_run.main(["--report", str(tmp_path / "results.json"), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("| causal") and out[-1].rstrip(" |").endswith("1.00")
    assert "| causal" in (tmp_path / "o" / "results.md").read_text()
    assert bench_run.main(["--report", str(tmp_path / "results.json")]) == 0  # print only


def test_omnicupy_mask_build_is_timed_and_recorded(monkeypatch):
    from omnicupy import BlockMask

    monkeypatch.setattr(BlockMask, "device_metadata", lambda self: None)  # no GPU here
    logs = []
    bench = _systems.Bench(_FakeGpu(), warmup=0, rep=1, check=False, mask_repeats=2, cache_label="x",
                           log=logs.append)
    bench.gpu.sync = lambda: None
    for name in ("causal", "prefix_lm", "random_10"):
        bm = bench.omnicupy_mask(_cases.make_mask(name, 512))
        assert bench.omnicupy_mask(_cases.make_mask(name, 512)) is not None
        assert bm.to_dense()[0, 0].sum() == _cases.count_pairs(_cases.make_mask(name, 512).array_mod(), 512)
    assert [e["mask"] for e in bench.mask_build] == ["causal", "prefix_lm", "random_10"]  # built once each
    assert bench.mask_build[0]["builder"] == "BlockMask.causal"
    for i, e in enumerate(bench.mask_build):  # first and steady state both kept, labelled
        assert e["first_ms"] >= 0 and e["steady_ms"] >= 0 and e["repeats"] == 2
        assert e["first_in_process"] is (i == 0)
    json.dumps(bench.mask_build)
    assert "first build in this process" in logs[0] and "median of 2" in logs[0]
    assert "from_mask_mod" in bench.mask_build[2]["builder"] and "benchmark rule" in bench.mask_build[2]["builder"]
    broken = _cases.make_mask("sliding_window", 512)
    broken.product, broken.product_call = None, ""
    monkeypatch.setattr(BlockMask, "from_mask_mod", classmethod(lambda cls, *a, **k: 1 / 0))
    for _ in range(2):
        with pytest.raises((ZeroDivisionError, RuntimeError)):
            bench.omnicupy_mask(broken)
    with pytest.raises(RuntimeError, match="failed earlier"):
        bench.omnicupy_mask(broken)


def test_mask_build_without_repeats_has_no_steady_time():
    bench = _systems.Bench(_FakeGpu(), warmup=0, rep=1, check=False, mask_repeats=0, cache_label="x",
                           log=lambda s: None)
    _, first, steady = bench._timed_build(lambda: 1, lambda: None)
    assert first >= 0 and steady is None


def _fake_torch(monkeypatch, calls):
    """torch.from_numpy / .to and create_block_mask on NumPy: enough for Bench.flex_mask on the CPU."""
    import types

    class _Host:
        def __init__(self, a):
            self.a = a

        def to(self, device):
            calls.append(("to", device, self.a.shape))
            return self.a

    def create_block_mask(mod, B, H, q_len, kv_len, device):
        calls.append(("create_block_mask", B, H, q_len, kv_len, device))
        q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        return np.broadcast_to(np.asarray(mod(0, 0, q, kv), dtype=bool), (q_len, kv_len))

    flex_attention = types.ModuleType("torch.nn.attention.flex_attention")
    flex_attention.create_block_mask = create_block_mask
    for name in ("torch", "torch.nn", "torch.nn.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", flex_attention)
    return types.SimpleNamespace(from_numpy=_Host)


@pytest.mark.parametrize("name", ["random_50", "causal"])
def test_flex_mask_build_uses_the_dense_table_for_random_masks(monkeypatch, name):
    calls = []
    gpu = _FakeGpu()
    gpu.torch = _fake_torch(monkeypatch, calls)
    gpu.sync = lambda: None
    logs = []
    bench = _systems.Bench(gpu, warmup=0, rep=1, check=False, mask_repeats=1, cache_label="x", log=logs.append)
    mask = _cases.make_mask(name, 512)
    got = bench.flex_mask(mask)
    np.testing.assert_array_equal(got, dense(mask))  # what create_block_mask saw is the benchmark's mask
    (entry,) = bench.mask_build
    assert entry["system"] == "flex" and entry["repeats"] == 1 and entry["first_in_process"] is True
    if mask.flex_dense:
        assert ("to", "cuda", (512, 512)) in calls and "dense[q, kv]" in entry["builder"] and entry["dense_ms"] >= 0
        assert "dense [N, N] table" in logs[0]
    else:
        assert not any(c[0] == "to" for c in calls) and entry["builder"] == "create_block_mask"
        assert "dense_ms" not in entry
    assert sum(c[0] == "create_block_mask" for c in calls) == 2  # first + 1 repeat


def test_build_table_shows_first_and_steady():
    entries = [{"system": "omnicupy", "mask": "causal", "seq_len": 1024, "first_ms": 3800.0, "steady_ms": 1.5,
                "repeats": 3, "first_in_process": True},
               {"system": "flex", "mask": "causal", "seq_len": 1024, "first_ms": 9.0, "steady_ms": 2.25,
                "repeats": 3, "first_in_process": False},
               {"system": "omnicupy", "mask": "document", "seq_len": 1024, "first_ms": 4.0, "ms": 3.0}]  # older file
    lines = bench_run._build_table(entries).splitlines()
    assert "steady" in lines[0] and "first" in lines[0]
    assert lines[2] == "| causal | 1024 | 1.50 | 3800.00* | 2.25 | 9.00 |"
    assert lines[3] == "| document | 1024 | 3.00 | 4.00 | - | - |"


@pytest.mark.parametrize("shape, chunk", [((3, 5, 7), 4), ((2, 9), 18), ((11,), 1 << 24)])
def test_device_normal_draws_in_chunks_what_one_draw_gives(shape, chunk):
    """The chunked draw (run here with NumPy in CuPy's place) is the generator's stream in order."""
    got = _systems.device_normal(np, shape, np.float16, np.random.default_rng(5), chunk)
    want = np.random.default_rng(5).standard_normal(int(np.prod(shape)), dtype=np.float32).astype(np.float16)
    assert got.shape == shape and got.dtype == np.float16
    np.testing.assert_array_equal(got.reshape(-1), want)
