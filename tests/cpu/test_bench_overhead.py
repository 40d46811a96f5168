"""The CPU report of benchmarks/bench_overhead.py runs in CI as a plain report: every piece is timed
and printed; nothing is asserted about the times themselves (they depend on the machine)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from omnicupy.jit import launch

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_report_times_every_piece_and_restores_the_route():
    from benchmarks import bench_overhead

    before = (launch._ROUTE[0], launch._ROUTE_NAME[0])
    rows = bench_overhead.cpu_rows(calls=20)
    assert (launch._ROUTE[0], launch._ROUTE_NAME[0]) == before
    labels = [label for label, _ in rows]
    assert len(labels) == len(set(labels)) >= 8
    assert any("backward recipe.launch" in label for label in labels)
    assert all(math.isfinite(us) and us > 0 for _, us in rows), rows


def test_cpu_report_runs_as_a_script():
    done = subprocess.run([sys.executable, "benchmarks/bench_overhead.py", "--cpu", "--calls", "100"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    print(done.stdout)  # the report itself (pytest -s shows it)
    assert "| host path piece (CPU, no launch) | µs per call |" in done.stdout
    assert "forward recipe.launch, null route" in done.stdout
