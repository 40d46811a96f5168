"""The framework adapters' imports: ``import omnicupy`` imports neither torch nor jax, both adapters
are lazy submodules, and importing one without its framework raises MissingDependencyError naming
the install extra. Runs in subprocesses (a framework blocked with ``sys.modules[name] = None``), so
it needs neither torch nor jax."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import PACKAGE_PARENT, SOURCE_TREE


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE_PARENT, timeout=300)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_import_omnicupy_imports_no_framework(framework):
    code = f"import sys, omnicupy; omnicupy.attention_backward; omnicupy.BlockMask; print({framework!r} in sys.modules)"
    got = run(code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "False"


@pytest.mark.parametrize("adapter, framework, extra", [
    pytest.param("omnicupy.torch", "torch", "omnicupy[torch]", id="torch"),
    pytest.param("omnicupy.jax", "jax", "omnicupy[jax]", id="jax"),
    pytest.param("omnicupy.torch_autograd", "torch", "omnicupy[torch]", id="torch-autograd-alias"),
])
def test_adapter_without_its_framework_names_the_extra(adapter, framework, extra):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            "import omnicupy\n"
            "from omnicupy.errors import MissingDependencyError\n"
            "try:\n"
            f"    import {adapter}\n"
            "except MissingDependencyError as exc:\n"
            "    print('refused:', exc, isinstance(exc, ImportError))\n"
            "else:\n"
            "    print('imported')\n")
    got = run(code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("refused:"), got.stdout
    assert extra in got.stdout and got.stdout.strip().endswith("True")


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_adapters_are_lazy_attributes(name):
    pytest.importorskip(name)
    code = f"import sys, omnicupy; m = omnicupy.{name}; print(m.__name__, {name!r} in sys.modules)"
    got = run(code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [f"omnicupy.{name}", "True"]


@pytest.mark.parametrize("script", ["train_torch_compile.py", "train_jax.py"])
def test_adapter_examples_exit_cleanly_without_a_gpu(script):
    from omnicupy import arrays

    if arrays.gpu_available():
        pytest.skip("a GPU is here: the example would train (the GPU run checks it)")
    got = subprocess.run([sys.executable, str(SOURCE_TREE / "examples" / script)], capture_output=True, text=True,
                         cwd=PACKAGE_PARENT, timeout=300)
    assert got.returncode == 0, got.stderr
    assert "needs an NVIDIA GPU" in got.stdout
