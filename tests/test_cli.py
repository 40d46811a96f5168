"""The ``omnicupy`` command, each call in a subprocess against a temporary cache (CPU: no GPU needed).

Compiles stay few (one head dim, one dtype, one stage: 4 variants per arch, ~0.5 s each).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnicupy import arrays
from omnicupy.dispatch import tiles

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--head-dims", "64", "--dtypes", "fp16", "--stages", "2"]  # 4 variants per arch
no_gpu_only = pytest.mark.skipif(arrays.gpu_available(), reason="checks the behaviour without a GPU")


def omnicupy(*args: str, cache: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(cache), **env)
    environ.pop("OMNICUPY_VERBOSE", None)
    return subprocess.run([sys.executable, "-m", "omnicupy", *args], capture_output=True, text=True,
                          env=environ, timeout=timeout, cwd=REPO)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """A cache holding the 8 small variants for sm_80 and sm_90 (compiled once for the module)."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    result = omnicupy("precompile", "--arch", "sm_80,sm_90", *SMALL, "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    return cache


# ----------------------------------------------------------------------------- help and usage
@pytest.mark.parametrize("command", [[], ["precompile"], ["cache"], ["cache", "path"], ["cache", "list"],
                                     ["cache", "clear"], ["info"], ["demo"], ["bench"]],
                         ids=lambda c: "-".join(c) or "top")
def test_help(command, cache):
    result = omnicupy(*command, "--help", cache=cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: omnicupy")


def test_version(cache):
    result = omnicupy("--version", cache=cache)
    assert result.returncode == 0 and result.stdout.startswith("omnicupy ")


@pytest.mark.parametrize("args", [
    pytest.param([], id="no-command"),
    pytest.param(["bogus"], id="unknown-command"),
    pytest.param(["cache"], id="cache-without-action"),
    pytest.param(["precompile", "--head-dims", "65"], id="head-dim"),
    pytest.param(["precompile", "--dtypes", "fp32"], id="dtype"),
    pytest.param(["precompile", "--stages", "3"], id="stages"),
    pytest.param(["precompile", "--arch", "sm_75"], id="arch-too-old"),
    pytest.param(["precompile", "--arch", "volta"], id="arch-garbage"),
    pytest.param(["precompile", "--arch", "sm_990"], id="arch-unknown-to-nvrtc"),
    pytest.param(["precompile", "--jobs", "0"], id="jobs"),
    pytest.param(["cache", "clear", "--older-than", "-1"], id="older-than"),
    pytest.param(["demo", "--head-dim", "48"], id="demo-head-dim"),
])
def test_usage_errors_exit_2(args, cache):
    assert_one_line_error(omnicupy(*args, cache=cache), 2)
    assert not cache.exists() or not any(cache.rglob("*.cubin"))


# ----------------------------------------------------------------------------- precompile
def test_precompile_without_gpu_for_sm80_and_sm90(warm_cache):
    listing = omnicupy("cache", "list", cache=warm_cache)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines() if line.startswith("omni_fwd_")]
    assert len(rows) == 16  # 4 mma.sync variants for each arch, 4 wgmma and 4 tma ones for sm_90 (as sm_90a)
    assert sorted({row[1] for row in rows}) == ["sm_80", "sm_90", "sm_90a"]
    assert all(row[0].startswith("omni_fwd_fp16_hd64_") and "_st2" in row[0] for row in rows)
    assert all(("_wgmma" in row[0] or "_tma" in row[0]) == (row[1] == "sm_90a") for row in rows)
    assert "16 variants" in listing.stdout


def test_precompile_again_hits_the_cache(warm_cache):
    result = omnicupy("precompile", "--arch", "sm_80,sm_90", *SMALL, "--jobs", "1", cache=warm_cache)
    assert result.returncode == 0, result.stderr
    assert "0 built, 16 already cached, 0 failed" in result.stdout
    assert "bytes" in result.stdout


def test_precompile_progress_and_summary(cache):
    result = omnicupy("precompile", "--arch", "sm_90", "--head-dims", "32", "--dtypes", "bf16", "--stages", "1",
                      "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    assert "4/4" in result.stderr  # the progress line
    assert "4 built, 0 already cached, 0 failed" in result.stdout
    assert len(list((cache / "v1").glob("*.cubin"))) == 4


@no_gpu_only
def test_precompile_default_set_without_gpu(cache):
    result = omnicupy("precompile", "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    pairs = [line.split() for line in result.stdout.splitlines()]
    expected = {(v.name, arch) for v in tiles.shipped_variants() for arch in ("sm_80", "sm_90")
                if v.family == "sync" or arch == "sm_90"}
    assert {tuple(p) for p in pairs} == expected and len(pairs) == len(expected)
    assert "no GPU" in result.stderr
    assert not cache.exists() or not any(cache.rglob("*.cubin"))


def test_precompile_failure_is_one_line_exit_1(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = omnicupy("precompile", "--arch", "sm_80", *SMALL, cache=blocker / "cache")
    assert_one_line_error(result, 1)


# ----------------------------------------------------------------------------- cache
def test_cache_path(cache):
    result = omnicupy("cache", "path", cache=cache)
    assert result.returncode == 0
    assert result.stdout.strip() == str(cache)


def test_cache_dir_option(tmp_path, cache):
    other = tmp_path / "other"
    result = omnicupy("--cache-dir", str(other), "cache", "path", cache=cache)
    assert result.stdout.strip() == str(other)


def test_cache_list_empty(cache):
    result = omnicupy("cache", "list", cache=cache)
    assert result.returncode == 0
    assert "no compiled variants" in result.stdout


def test_cache_clear(tmp_path, warm_cache):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    (cache / "v0").mkdir()  # a folder of an older cache format
    (cache / "v0" / "old.cubin").write_bytes(b"old")
    result = omnicupy("cache", "clear", "--older-than", "1", cache=cache)
    assert result.returncode == 0 and "removed 0 entries" in result.stdout

    # Age one entry by three days: only it goes with --older-than 2.
    meta_path = sorted((cache / "v1").glob("*.json"))[0]
    meta = json.loads(meta_path.read_text())
    meta["created"] = time.time() - 3 * 86400
    meta_path.write_text(json.dumps(meta))
    result = omnicupy("cache", "clear", "--older-than", "2", cache=cache)
    assert result.returncode == 0 and "removed 1 entries" in result.stdout
    assert not meta_path.exists() and not meta_path.with_suffix(".cubin").exists()
    assert len(list((cache / "v1").glob("*.cubin"))) == 15

    result = omnicupy("cache", "clear", cache=cache)
    assert result.returncode == 0 and "removed 15 entries" in result.stdout
    assert "older cache formats" in result.stdout
    assert [p for p in cache.rglob("*") if p.is_file()] == []
    assert "no compiled variants" in omnicupy("cache", "list", cache=cache).stdout


# ----------------------------------------------------------------------------- info, demo, bench
def test_info_without_gpu(warm_cache):
    result = omnicupy("info", cache=warm_cache)
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert fields["omnicupy"].startswith("0.")
    assert fields["cupy"][0].isdigit()
    assert fields["nvrtc"][0].isdigit() and "sm_90" in fields["nvrtc"]
    assert fields["cache"].startswith(str(warm_cache)) and "(16 variants" in fields["cache"]
    if not arrays.gpu_available():
        assert fields["driver"] == "none"
        assert fields["device"].startswith("none")


@no_gpu_only
def test_demo_without_gpu_compiles_instead(cache):
    result = omnicupy("demo", "--head-dim", "64", "--dtype", "fp16", "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no GPU: compiling the default variants instead")
    # 8 hd64 fp16 mma.sync variants x (sm_80, sm_90) + 4 wgmma and 4 tma ones for sm_90
    assert "24 built, 0 already cached, 0 failed" in result.stdout


def test_bench_without_harness(tmp_path, cache):
    assert_one_line_error(omnicupy("bench", "--harness", str(tmp_path / "missing.py"), cache=cache), 1)


def test_bench_runs_the_harness_with_its_arguments(tmp_path, cache):
    harness = tmp_path / "fakebench" / "run.py"
    harness.parent.mkdir()
    harness.write_text("import sys\nprint('harness', __name__, sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    result = omnicupy("bench", "--harness", str(harness), cache=cache)
    assert result.returncode == 0, result.stderr
    assert "harness __main__ []" in result.stdout
    result = omnicupy("bench", "--harness", str(harness), "--", "--fail", "x", cache=cache)
    assert result.returncode == 3
    assert "['--fail', 'x']" in result.stdout


@pytest.mark.skipif(not (REPO / "benchmarks" / "run.py").is_file(), reason="no benchmark harness in this tree")
def test_bench_finds_the_repository_harness(tmp_path, cache):
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "omnicupy", "bench", "--", "--dry-run"], capture_output=True,
                            text=True, env=environ, cwd=tmp_path, timeout=300)  # from outside the repository
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- examples
@no_gpu_only
@pytest.mark.parametrize("script", ["interleaved_vlm.py", "packed_documents.py", "zero_copy_interop.py"])
def test_examples_say_they_need_a_gpu(script, cache):
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # as if installed
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(cache), PYTHONPATH=path)
    result = subprocess.run([sys.executable, str(REPO / "examples" / script)], capture_output=True, text=True,
                            env=environ, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs an NVIDIA GPU" in result.stdout


def test_examples_do_not_import_torch_at_top_level():
    for script in (REPO / "examples").glob("*.py"):
        top_level = [line for line in script.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert not any("torch" in line for line in top_level), script.name
