"""docs/performance.md's standing tables are what tools/standing.py makes of benchmarks/results/, and
each canonical results file is the newest run of its benchmark (no older file can pass for it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

import standing  # noqa: E402

#: benchmark -> the lab/results files (glob) that are earlier runs of the same benchmark.
EARLIER = [("forward", "fwd*_h200_*.json"), ("backward", "bwd_h200_*.json")]


def test_performance_md_is_generated_from_the_results():
    assert standing.main(["--check"]) == 0


@pytest.mark.parametrize("name", [s[0] for s in standing.SECTIONS])
def test_canonical_file_is_dated(name):
    assert standing.load(name)["date"][:4] == "2026"


@pytest.mark.parametrize("name,pattern", EARLIER)
def test_canonical_file_is_the_newest(name, pattern):
    date = standing.load(name)["date"]
    older = {p.name: json.loads(p.read_text())["date"] for p in (REPO / "lab" / "results").glob(pattern)}
    assert older and all(d <= date for d in older.values()), {n: d for n, d in older.items() if d > date}


def test_stale_page_is_refused(tmp_path, monkeypatch):
    page = tmp_path / "performance.md"
    page.write_text(f"x\n{standing.BEGIN}\nold table\n{standing.END}\n")
    monkeypatch.setattr(standing, "DOC", page)
    assert standing.main(["--check"]) == 1
    assert standing.main([]) == 0 and standing.main(["--check"]) == 0
