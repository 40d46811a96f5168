"""Packaging (CPU): pyproject ships every subpackage and data folder, the installed package carries
its templates, headers, benchmark harness and py.typed, and the version has one source."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import omnicupy
from omnicupy.cli import bench

REPO = Path(__file__).resolve().parents[2]
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
    assert {"omnicupy.kernels", "omnicupy.templates"} <= listed


def test_only_the_benchmark_harness_ships(pyproject):
    """benchmarks/ ships as omnicupy.benchmarks for `omnicupy bench`, but only run.py and the modules it
    imports (relative imports, followed): no bench scripts, no tuning scripts, no results."""
    shipped = {m.rsplit(".", 1)[1] for m in pyproject["tool"]["setuptools"]["py-modules"]
               if m.startswith("omnicupy.benchmarks.")}
    needed, todo = set(), ["run"]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        text = (REPO / "benchmarks" / f"{name}.py").read_text()
        for group in re.findall(r"^\s*from \. import ([\w, ]+)", text, re.M):
            todo += [n.strip() for n in group.split(",")]
        todo += re.findall(r"^\s*from \.(\w+) import", text, re.M)
    assert shipped == needed, f"ship exactly the harness: {sorted(needed)}, pyproject lists {sorted(shipped)}"
    assert "omnicupy.benchmarks" not in pyproject["tool"]["setuptools"]["packages"]  # that would ship every .py


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
    assert all("cu12" in d or "cuda12x" in d or d.startswith("cuda-bindings>=12") for d in extras["cuda12"])
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


def _regular_install_elsewhere() -> bool:
    import importlib.metadata
    import json

    for dist in importlib.metadata.distributions(name="omnicupy"):
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if Path(str(dist.locate_file(""))).resolve() != REPO and not direct.get("dir_info", {}).get("editable"):
            return True
    return False


@pytest.mark.parametrize("editable", [pytest.param(False, id="regular-install-shadowed"),
                                      pytest.param(True, id="editable-install")])
def test_tests_refuse_the_source_tree_when_omnicupy_is_installed(tmp_path, child_environment, editable):
    """`python -m pytest` from the repository imports the source tree; with a regular install present
    that would leave the install untested, so the session stops (exit 4, a usage error). An editable
    install is the source tree: accepted (unless a regular install exists too, as in CI)."""
    import json
    import subprocess

    status = 0 if editable and not _regular_install_elsewhere() else 4

    site = tmp_path / "site"
    info = site / "omnicupy-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnicupy\nVersion: 9.9.9\n")
    (info / "direct_url.json").write_text(json.dumps({"url": "file:///elsewhere", "dir_info": {"editable": editable}}))
    environ = child_environment()
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/cpu/test_packaging.py::test_one_version_source"], capture_output=True, text=True,
                            env=environ, cwd=REPO, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == status, output
    if status:
        assert "is installed in" in output and "python -m pytest" in output
