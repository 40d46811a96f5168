"""Shared fixtures and the layout of tests/. GPU tests carry the `gpu` marker and skip cleanly without
a usable GPU.

Layout (where a new file goes):
- ``tests/cpu/test_*.py``: runs without a GPU (CI runs these); a few cases may still carry ``gpu``.
- ``tests/gpu/test_*_gpu.py``: needs an NVIDIA GPU; every test marked ``gpu`` (``pytest -m gpu``).
- ``tests/sanitize/sanitize_*.py``: scripts for compute-sanitizer, run by hand on a GPU (not collected).
- ``tests/support/*.py``: helpers and case tables shared by the above (``from helpers import ...``
  works everywhere: this file puts tests/support on the import path, and the scripts in sanitize/
  do the same).
Test files added at tests/ top level are collected too; move them into cpu/ or gpu/ by that rule.
Module basenames must stay unique across the folders (pytest's default import mode).

Which omnicupy is tested: the one these tests import. Once omnicupy is installed (not editable), that
must be the installed copy, so that a packaging mistake (a missing template, header or module) fails
here: the session stops with a usage error when the source tree shadows an installed omnicupy (run
pytest from the repository root as ``pytest``, not ``python -m pytest``, which puts the current folder
first on the import path; or install with ``pip install -e .`` to test the source tree itself).
Subprocesses (the ``omnicupy`` command, examples) run from a neutral folder and import the same copy.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

#: tests/support: the shared helpers and case tables, importable by bare name from every test folder.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

import omnicupy  # noqa: E402
from omnicupy import arrays  # noqa: E402

SOURCE_TREE = Path(__file__).resolve().parents[1]
#: The folder that holds the omnicupy package under test: site-packages, or the source tree.
PACKAGE_PARENT = Path(omnicupy.__file__).resolve().parents[1]


def _editable(dist: importlib.metadata.Distribution) -> bool:
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    return bool(direct.get("dir_info", {}).get("editable"))


def shadowed_installation() -> str:
    """A message when the tests imported the source tree although a regular install exists, else ''."""
    if PACKAGE_PARENT != SOURCE_TREE:
        return ""  # an installed copy: what the README's command tests
    for dist in importlib.metadata.distributions(name="omnicupy"):
        location = Path(str(dist.locate_file(""))).resolve()
        if location == SOURCE_TREE or _editable(dist):
            continue  # the source tree's own build metadata (omnicupy.egg-info), or an editable install
        return (f"omnicupy {dist.version} is installed in {location}, but these tests imported the source tree "
                f"{SOURCE_TREE / 'omnicupy'}: the installed package would go untested. Run `pytest` (not "
                f"`python -m pytest`, which puts the current folder on the import path) or `pip install -e .`.")
    return ""


def pytest_configure(config):
    problem = shadowed_installation()
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU, at most 8 (the workers share one GPU where there is one)."""
    return max(1, min(os.cpu_count() or 1, 8))


def session_folder(tmp_path_factory) -> Path:
    """A folder that every xdist worker of this session shares (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def shared_compiles(tmp_path_factory):
    """Every NVRTC compile of the session goes through one memo (tests/support/compile_memo.py): a
    kernel that several tests build is compiled once, by whichever worker asks first."""
    from compile_memo import CompileMemo

    from omnicupy import jit
    from omnicupy.jit import compiler

    memo = CompileMemo(session_folder(tmp_path_factory) / "nvrtc-memo", compiler.compile_cubin)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "compile_cubin", memo)
        patch.setattr(jit, "compile_cubin", memo)
        yield memo


def pytest_collection_modifyitems(config, items):
    if arrays.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none usable here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def subprocess_environment(**overrides: str) -> dict:
    """os.environ for a child that must import the omnicupy under test: PYTHONPATH gains the source
    tree only when that is what the tests import (an installed copy is found on its own)."""
    environ = dict(os.environ, **overrides)
    if PACKAGE_PARENT == SOURCE_TREE:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_TREE), environ.get("PYTHONPATH")]))
    return environ


@pytest.fixture(scope="session")
def neutral_cwd(tmp_path_factory) -> Path:
    """A working folder outside the source tree (``python -m`` puts the working folder on sys.path)."""
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="session")
def omnicupy_command(neutral_cwd) -> Callable[..., subprocess.CompletedProcess]:
    """``omnicupy_command(*args, cache=PATH, timeout=300, **env)``: ``python -m omnicupy ARGS`` in a
    subprocess against the cache folder ``cache``, with OMNICUPY_VERBOSE unset unless given."""

    def run(*args: str, cache: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        environ = subprocess_environment(OMNICUPY_CACHE_DIR=str(cache))
        environ.pop("OMNICUPY_VERBOSE", None)
        environ.update(env)
        return subprocess.run([sys.executable, "-m", "omnicupy", *args], capture_output=True, text=True,
                              env=environ, timeout=timeout, cwd=neutral_cwd)

    return run


@pytest.fixture(scope="session")
def child_environment() -> Callable[..., dict]:
    """``child_environment(**overrides)``: see ``subprocess_environment``."""
    return subprocess_environment


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty kernel cache for one test."""
    monkeypatch.setenv("OMNICUPY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fresh_memory_warning(monkeypatch):
    """Forget that this process already warned about an unusable cache (it warns once per process)."""
    from omnicupy.jit import cache

    monkeypatch.setattr(cache, "_memory_only_warned", False)
