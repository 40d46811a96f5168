"""CPU tests of the benchmark harness's backward passes (--pass bwd|fwdbwd): FLOP counting, the
plan, the extra deterministic system, and the command line. No torch and no GPU needed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import _cases, _report  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402


@pytest.mark.parametrize("pass_name,factor", [("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)])
def test_backward_flops_are_multiples_of_the_forward(pass_name, factor):
    case = _cases.Case("causal", 8192, 128, "fp16", 2, pass_name=pass_name)
    pairs = 8192 * 8193 // 2
    row = _report.make_row("omnicupy", case, 0.5, pairs, 2.0, True)
    assert row["tflops"] == pytest.approx(factor * 4 * 2 * 16 * pairs * 128 / 2e-3 / 1e12, abs=1e-3)
    assert row.get("pass", "fwd") == pass_name
    assert (pass_name in case.key) == (pass_name != "fwd")


def test_plan_carries_the_pass_and_det_runs_only_backward():
    cases = _cases.plan(("full", "causal"), (64,), (8192,), ("fp16",), "bwd")
    assert {c.pass_name for c in cases} == {"bwd"}
    assert _cases.skip_reason(_cases.OMNICUPY_DETERMINISTIC, cases[0]) is None
    fwd = _cases.plan(("full",), (64,), (8192,), ("fp16",))[0]
    assert _cases.skip_reason(_cases.OMNICUPY_DETERMINISTIC, fwd) is not None
    assert _cases.skip_reason("omnicupy_stage1", cases[0]) is not None  # the backward has no stages
    assert _cases.skip_reason("omnicupy_stage1", fwd) is None


def test_command_line_pass_and_systems():
    cfg = bench_run.parse_args(["--pass", "fwdbwd", "--systems", "omnicupy,omnicupy_det,flex"])
    assert cfg.pass_name == "fwdbwd" and cfg.systems == ("omnicupy", "omnicupy_det", "flex")
    assert bench_run.parse_args(["--systems", "all"]).systems == _cases.SYSTEMS  # extras only when named
    assert bench_run.parse_args([]).pass_name == "fwd"
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--pass", "sideways"])


def test_resume_keys_tell_passes_apart():
    case = _cases.Case("full", 8192, 64, "fp16", 2, pass_name="bwd")
    row = _report.make_row("omnicupy", case, 1.0, 8192 * 8192, 1.0, True)
    from dataclasses import asdict

    assert bench_run._row_key("omnicupy", row) == bench_run._row_key("omnicupy", asdict(case))
    fwd_row = _report.make_row("omnicupy", _cases.Case("full", 8192, 64, "fp16", 2), 1.0, 8192 * 8192, 1.0, True)
    assert bench_run._row_key("omnicupy", fwd_row) != bench_run._row_key("omnicupy", row)
