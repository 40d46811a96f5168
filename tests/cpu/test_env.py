"""Environment switches and logging (CPU): validation of every OMNICUPY_ variable, OMNICUPY_VERBOSE
turning on DEBUG logs, and the single warning of a process whose cache cannot be written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omnicupy.errors import ArgumentError
from omnicupy.jit import env

BUILD_TWO = """
from omnicupy import jit
from omnicupy.cli.catalogue import shipped_variants
for variant in shipped_variants(dtypes=("fp16",), head_dims=(64,), stages=(2,))[:2]:
    entry, built = jit.build(variant, "sm_80")
    print(variant.name, built, entry.stored, len(entry.data))
"""


@pytest.mark.parametrize("name, value, reader", [
    pytest.param("OMNICUPY_MMA", "bogus", env.mma_family, id="mma"),
    pytest.param("OMNICUPY_SCHEDULE", "fifo", env.schedule, id="schedule"),
    pytest.param("OMNICUPY_VERBOSE", "maybe", env.verbose, id="verbose"),
    pytest.param("OMNICUPY_LINEINFO", "2", env.lineinfo, id="lineinfo"),
])
def test_invalid_values_are_named_errors(monkeypatch, name, value, reader):
    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=name):
        reader()
    assert any(row == (name, value, row[2]) and row[2] for row in env.check_environment())


def test_check_environment_lists_set_variables_with_verdicts(monkeypatch):
    for name in [n for n in os.environ if n.startswith("OMNICUPY_")]:
        monkeypatch.delenv(name)
    assert env.check_environment() == []
    monkeypatch.setenv("OMNICUPY_MMA", "sync")
    monkeypatch.setenv("OMNICUPY_MAA", "sync")  # a typo
    rows = {name: problem for name, _, problem in env.check_environment()}
    assert rows["OMNICUPY_MMA"] is None and "unknown variable" in rows["OMNICUPY_MAA"]


def _run(code: str, child_environment, neutral_cwd, **overrides: str) -> subprocess.CompletedProcess:
    environ = child_environment(**overrides)
    for name in ("OMNICUPY_VERBOSE", "OMNICUPY_KEEP_SOURCE", "OMNICUPY_LINEINFO"):
        if name not in overrides:
            environ.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ,
                          cwd=neutral_cwd, timeout=300)


def test_quiet_by_default(tmp_path, child_environment, neutral_cwd):
    result = _run(BUILD_TWO, child_environment, neutral_cwd, OMNICUPY_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_verbose_logs_compiles_and_hits_at_debug(tmp_path, child_environment, neutral_cwd):
    cache = str(tmp_path / "cache")
    first = _run(BUILD_TWO, child_environment, neutral_cwd, OMNICUPY_CACHE_DIR=cache, OMNICUPY_VERBOSE="1")
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("[omnicupy.jit] compiled omni_fwd_") == 2, first.stderr
    second = _run(BUILD_TWO, child_environment, neutral_cwd, OMNICUPY_CACHE_DIR=cache, OMNICUPY_VERBOSE="1")
    assert second.stderr.count("[omnicupy.jit] cache hit omni_fwd_") == 2, second.stderr


def test_unwritable_cache_warns_once_per_process(tmp_path, child_environment, neutral_cwd):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    result = _run(BUILD_TWO, child_environment, neutral_cwd, OMNICUPY_CACHE_DIR=str(blocker / "cache"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.split()[1:3] == ["True", "False"] for line in lines)  # built, in memory
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "kept in memory" in warnings[0], result.stderr
