"""Packaging (CPU): pyproject ships every subpackage and data folder, the installed package carries
its templates, headers, benchmark harness and py.typed, and the version has one source."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import omnicupy
from omnicupy.cli import bench

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(omnicupy.__file__).resolve().parent
tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else None


@pytest.fixture(scope="module")
def pyproject() -> dict:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python 3.11 (tomllib)")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_subpackage_is_listed(pyproject):
    """A new folder under omnicupy/ that pyproject does not list would be missing from the install."""
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    source = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "omnicupy").rglob("__init__.py")}
    assert source <= listed, f"not in [tool.setuptools] packages: {sorted(source - listed)}"
    mapped = pyproject["tool"]["setuptools"]["package-dir"]
    assert {"omnicupy.kernels": "kernels", "omnicupy.templates": "templates",
            "omnicupy.benchmarks": "benchmarks"}.items() <= mapped.items()
    assert {"omnicupy.kernels", "omnicupy.templates", "omnicupy.benchmarks"} <= listed


def test_one_version_source(pyproject):
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "omnicupy._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", omnicupy.__version__)


def test_license_and_metadata(pyproject):
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # the SPDX field says it
    assert any(d.startswith("filelock") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert all("cu12" in d or "cuda12x" in d for d in extras["cuda12"])
    assert not any("cu12" in d or "cuda12x" in d for d in extras["cuda13"])
    assert project["scripts"]["omnicupy"] == "omnicupy.cli:main"


def test_the_package_carries_its_files():
    """What the imported package (the installed one, in CI) brings: templates, headers, py.typed and
    the benchmark harness (installed as omnicupy.benchmarks; a source checkout has benchmarks/)."""
    from omnicupy.jit import env

    assert (PACKAGE / "py.typed").is_file()
    assert list(env.templates_dir().glob("*.jinja")) and list(env.kernels_dir().glob("*.cuh"))
    target, harness = bench.find_harness()
    assert harness is not None and harness.is_file()
    if (REPO / "omnicupy") != PACKAGE:  # an installed copy
        assert target == "module:omnicupy.benchmarks.run" and harness.parent.parent == PACKAGE
