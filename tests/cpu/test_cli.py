"""The ``omnicupy`` command, each call in a subprocess against a temporary cache (CPU: no GPU needed),
plus in-process checks of its planning and progress pieces.

Compiles stay few (one head dim, one dtype, one stage: 4 variants per arch, ~0.5 s each).
"""
from __future__ import annotations

import io
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnicupy import arrays
from omnicupy.dispatch import tiles
from omnicupy.cli import bench, catalogue, precompile
from omnicupy.cli.progress import Progress
from omnicupy.jit.cache import CACHE_FORMAT

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--head-dims", "64", "--dtypes", "fp16", "--stages", "2", "--ops", "forward"]  # 4 per family, 4 on the 192-row tma tile
FORMAT_DIR = f"v{CACHE_FORMAT}"
no_gpu_only = pytest.mark.skipif(arrays.gpu_available(), reason="checks the behaviour without a GPU")
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def assert_one_line_error(result: subprocess.CompletedProcess, code: int) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, omnicupy_command) -> Path:
    """A cache holding the 16 small variants for sm_80 and sm_90 (compiled once for the module)."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    result = omnicupy_command("precompile", "--arch", "sm_80,sm_90", *SMALL, "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    return cache


# ----------------------------------------------------------------------------- help and usage
@pytest.mark.parametrize("command", [[], ["precompile"], ["cache"], ["cache", "path"], ["cache", "list"],
                                     ["cache", "clear"], ["info"], ["demo"], ["plan"], ["bench"]],
                         ids=lambda c: "-".join(c) or "top")
def test_help(command, cache, omnicupy_command):
    result = omnicupy_command(*command, "--help", cache=cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: omnicupy")


def test_version(cache, omnicupy_command):
    result = omnicupy_command("--version", cache=cache)
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
    pytest.param(["precompile", "--arch", "sm_80a"], id="arch-specific-other-than-sm90a"),
    pytest.param(["precompile", "--arch", "sm_990"], id="arch-unknown-to-nvrtc"),
    pytest.param(["precompile", "--jobs", "0"], id="jobs"),
    pytest.param(["cache", "clear", "--older-than", "-1"], id="older-than"),
    pytest.param(["demo", "--head-dim", "48"], id="demo-head-dim"),
])
def test_usage_errors_exit_2(args, cache, omnicupy_command):
    assert_one_line_error(omnicupy_command(*args, cache=cache), 2)
    assert not cache.exists() or not any(cache.rglob("*.cubin"))


def test_closed_pipe_is_not_an_error(cache, child_environment, neutral_cwd):
    """`omnicupy precompile --dry-run | head -1`: the reader leaves early; no 'Broken pipe', exit 0."""
    environ = child_environment(OMNICUPY_CACHE_DIR=str(cache))
    proc = subprocess.Popen([sys.executable, "-m", "omnicupy", "precompile", "--dry-run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=environ, cwd=neutral_cwd)
    proc.stdout.close()  # before the command writes its first line
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    assert "Broken pipe" not in stderr and "Exception ignored" not in stderr and "Traceback" not in stderr


def test_dry_run_piped_into_head(cache, child_environment, neutral_cwd):
    environ = child_environment(OMNICUPY_CACHE_DIR=str(cache))
    script = f"set -o pipefail; {sys.executable} -m omnicupy precompile --dry-run | head -1"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=environ, cwd=neutral_cwd,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and result.stdout.startswith("omni_fwd_")
    assert "Broken pipe" not in result.stderr and "Exception ignored" not in result.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_cache_dir_option_before_or_after_the_command(tmp_path, cache, omnicupy_command, where):
    other = tmp_path / "other"
    for command in (["cache", "path"], ["cache", "list"], ["info"]):
        args = ["--cache-dir", str(other), *command] if where == "before" else [*command, "--cache-dir", str(other)]
        result = omnicupy_command(*args, cache=cache)
        assert result.returncode == 0, result.stderr
        assert str(other) in result.stdout and str(cache) not in result.stdout


# ----------------------------------------------------------------------------- precompile: what is built
SHIPPED = catalogue.shipped_variants(ops=("forward",))
EVERYTHING = catalogue.shipped_variants()
WGMMA = [v for v in SHIPPED if catalogue.family(v) in catalogue.HOPPER_FAMILIES]  # wgmma and tma
#: every operation's sm_90a kernels (the forward's wgmma and tma, the wgmma backward)
HOPPER = [v for v in EVERYTHING if catalogue.family(v) in catalogue.HOPPER_FAMILIES]


@pytest.mark.parametrize("archs, expected", [
    pytest.param(["sm_90a"], {(v.name, "sm_90a") for v in WGMMA}, id="sm90a-is-the-wgmma-variants"),
    pytest.param(["sm_90", "sm_90a"], {(v.name, "sm_90a" if catalogue.family(v) in catalogue.HOPPER_FAMILIES else "sm_90")
                                       for v in SHIPPED}, id="sm90-and-sm90a-once-each"),
    pytest.param(["sm_80"], {(v.name, "sm_80") for v in SHIPPED if catalogue.family(v) == "sync"}, id="sm80"),
])
def test_plan_builds_each_variant_as_its_real_arch(archs, expected):
    tasks, skipped = precompile.plan(SHIPPED, archs)
    assert {(v.name, arch) for v, arch in tasks} == expected and len(tasks) == len(expected)
    assert skipped == 0 and WGMMA


@no_gpu_only
def test_precompile_default_set_without_gpu(cache, omnicupy_command):
    result = omnicupy_command("precompile", "--dry-run", cache=cache)
    assert result.returncode == 0, result.stderr
    pairs = [tuple(line.split()) for line in result.stdout.splitlines()]
    expected = {(v.name, "sm_90a") for v in HOPPER} | {(v.name, arch) for v in EVERYTHING for arch in ("sm_80", "sm_90")
                                                     if catalogue.family(v) == "sync" and catalogue.runs_on(v, arch)}
    assert set(pairs) == expected and len(pairs) == len(expected)
    assert "no GPU" in result.stderr
    assert not cache.exists() or not any(cache.rglob("*.cubin"))


def test_dry_run_sm90a_lists_the_wgmma_variants_as_sm90a(cache, omnicupy_command):
    result = omnicupy_command("precompile", "--dry-run", "--arch", "sm_90a", cache=cache)
    assert result.returncode == 0, result.stderr
    pairs = [tuple(line.split()) for line in result.stdout.splitlines()]
    assert sorted(pairs) == sorted((v.name, "sm_90a") for v in HOPPER)


def test_precompile_sm90a_builds_only_wgmma(cache, omnicupy_command):
    result = omnicupy_command("precompile", "--arch", "sm_90a", *SMALL, "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    assert "12 built, 0 already cached, 0 failed" in result.stdout  # 4 wgmma, 4 tma, 4 on the 192-row tma tile
    rows = [line.split() for line in omnicupy_command("cache", "list", cache=cache).stdout.splitlines()
            if line.startswith("omni_fwd_")]
    assert len(rows) == 12 and all(("_wgmma" in row[0] or "_tma" in row[0]) and row[1] == "sm_90a" for row in rows)


# ----------------------------------------------------------------------------- precompile: running
def test_precompile_without_gpu_for_sm80_and_sm90(warm_cache, omnicupy_command):
    listing = omnicupy_command("cache", "list", cache=warm_cache)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines() if line.startswith("omni_fwd_")]
    assert len(rows) == 20  # 4 mma.sync variants for each arch; 4 wgmma, 4 + 4 tma ones for sm_90 (as sm_90a)
    assert sorted({row[1] for row in rows}) == ["sm_80", "sm_90", "sm_90a"]
    assert all(row[0].startswith("omni_fwd_fp16_hd64_") and "_st2" in row[0] for row in rows)
    assert all(("_wgmma" in row[0] or "_tma" in row[0]) == (row[1] == "sm_90a") for row in rows)
    assert "20 variants" in listing.stdout


def test_precompile_again_hits_the_cache(warm_cache, omnicupy_command):
    result = omnicupy_command("precompile", "--arch", "sm_80,sm_90", *SMALL, "--jobs", "1", cache=warm_cache)
    assert result.returncode == 0, result.stderr
    assert "0 built, 20 already cached, 0 failed" in result.stdout
    assert "bytes" in result.stdout


def test_precompile_progress_eta_and_summary(cache, omnicupy_command):
    result = omnicupy_command("precompile", "--arch", "sm_90", "--head-dims", "32", "--dtypes", "bf16",
                              "--stages", "1", "--ops", "forward", "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert "4/4" in progress[-1] and "done" in progress[-1]
    assert any("eta " in line for line in progress[:-1]), result.stderr
    assert "4 built, 0 already cached, 0 failed" in result.stdout
    assert len(list((cache / FORMAT_DIR).glob("*.cubin"))) == 4


def test_progress_eta_is_the_average_pace():
    progress = Progress(10, stream=io.StringIO(), enabled=True)
    assert progress.eta() is None
    progress.start -= 8.0  # as if 8 s had passed
    for _ in range(4):
        progress.update("built", "x")
    assert progress.eta() == pytest.approx(12.0, abs=0.5)  # 2 s per item, 6 left
    assert "eta 12 s" in progress.line("x") or "eta 11 s" in progress.line("x")


def test_precompile_failure_is_one_line_exit_1(tmp_path, omnicupy_command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = omnicupy_command("precompile", "--arch", "sm_80", *SMALL, cache=blocker / "cache")
    assert_one_line_error(result, 1)


def test_precompile_refuses_a_cache_others_can_write(tmp_path, omnicupy_command):
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    result = omnicupy_command("precompile", "--arch", "sm_80", *SMALL, cache=cache)
    assert_one_line_error(result, 1)
    assert "writable by group or others" in result.stderr


def _children(pid: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its exit status is left


@linux_only
def test_precompile_workers_die_with_their_parent(cache, child_environment, neutral_cwd):
    environ = child_environment(OMNICUPY_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "omnicupy", "precompile", "--arch", "sm_80", "--jobs", "2", "--quiet"]
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environ,
                              cwd=neutral_cwd)
    everything: list[int] = []
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            workers = [pid for pid in _children(parent.pid)
                       if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) >= 2, "the compile workers never started"
        time.sleep(1.0)  # let them get into NVRTC
        everything = _children(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(map(_alive, everything)) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in everything if _alive(pid)]
        assert not survivors, f"processes outlived their SIGKILLed parent: {survivors}"
    finally:  # never leave a process behind, whatever failed above
        if parent.poll() is None:
            everything += _children(parent.pid)
            parent.kill()
            parent.wait(timeout=30)
        for pid in everything:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- cache
def test_cache_path_and_list_name_the_same_folder(warm_cache, tmp_path, omnicupy_command):
    path = omnicupy_command("cache", "path", cache=warm_cache).stdout.strip()
    assert path == str(warm_cache)
    listing = omnicupy_command("cache", "list", cache=warm_cache).stdout.splitlines()
    assert listing[-1].endswith(f" in {path}")
    empty = omnicupy_command("cache", "list", cache=tmp_path / "empty").stdout.strip()
    assert empty == f"no compiled variants in {tmp_path / 'empty'}"


def _format1_folder(folder: Path) -> None:
    """A folder as omnicupy's first cache format wrote it (no tag; entries known by their metadata)."""
    import hashlib

    (folder / "locks").mkdir(parents=True)
    stem = "omni_fwd_fp16_hd64_br128_bc128_w4_st2-sm_80-0123456789abcdef"
    (folder / f"{stem}.cubin").write_bytes(b"old")
    (folder / f"{stem}.json").write_text(json.dumps({"stem": stem, "sha256": hashlib.sha256(b"old").hexdigest(),
                                                     "size": 3, "created": 1.0}))
    (folder / "locks" / f"{stem}.lock").write_bytes(b"")


def test_cache_clear(tmp_path, warm_cache, omnicupy_command):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    _format1_folder(cache / "v1")  # an older omnicupy's folder: cleared
    (cache / "v0").mkdir()  # a v<digits> folder with files nobody can tell are ours: kept
    (cache / "v0" / "old.cubin").write_bytes(b"old")
    (cache / "notes.json").write_text("{}")  # not ours either
    result = omnicupy_command("cache", "clear", "--older-than", "1", cache=cache)
    assert result.returncode == 0 and "removed 0 entries" in result.stdout

    # Age one entry by three days: only it goes with --older-than 2.
    meta_path = sorted((cache / FORMAT_DIR).glob("*.json"))[0]
    meta = json.loads(meta_path.read_text())
    meta["created"] = time.time() - 3 * 86400
    meta_path.write_text(json.dumps(meta))
    result = omnicupy_command("cache", "clear", "--older-than", "2", cache=cache)
    assert result.returncode == 0 and "removed 1 entries" in result.stdout
    assert not meta_path.exists() and not meta_path.with_suffix(".cubin").exists()
    assert len(list((cache / FORMAT_DIR).glob("*.cubin"))) == 19

    result = omnicupy_command("cache", "clear", cache=cache)
    assert result.returncode == 0 and "removed 19 entries and 1 folder(s) of older cache formats" in result.stdout
    assert f"left 1 folder(s) holding files omnicupy did not write: {cache / 'v0'}" in result.stdout
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) == [
        "notes.json", "v0/old.cubin", f"{FORMAT_DIR}/CACHEDIR.TAG"]
    assert "no compiled variants" in omnicupy_command("cache", "list", cache=cache).stdout


# ----------------------------------------------------------------------------- info
def test_info_without_gpu(warm_cache, omnicupy_command):
    result = omnicupy_command("info", cache=warm_cache)
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert fields["omnicupy"].startswith("0.")
    assert fields["cupy"][0].isdigit() and fields["filelock"][0].isdigit()
    assert fields["nvrtc"][0].isdigit() and "sm_90" in fields["nvrtc"]
    assert fields["cache"].startswith(str(warm_cache)) and "(20 variants" in fields["cache"]
    assert fields["environment"] == f"OMNICUPY_CACHE_DIR={warm_cache}"
    if not arrays.gpu_available():
        assert fields["driver"] == "none"
        assert fields["device"].startswith("none")


@pytest.mark.parametrize("name, value, complaint", [
    pytest.param("OMNICUPY_MMA", "bogus", "must be one of", id="mma"),
    pytest.param("OMNICUPY_SCHEDULE", "random", "must be one of", id="schedule"),
    pytest.param("OMNICUPY_VERBOSE", "maybe", "not a boolean", id="verbose"),
    pytest.param("OMNICUPY_KEEP_SOURCE", "2", "not a boolean", id="keep-source"),
    pytest.param("OMNICUPY_LINEINFOO", "1", "unknown variable", id="typo"),
])
def test_info_flags_invalid_settings(cache, omnicupy_command, name, value, complaint):
    result = omnicupy_command("info", cache=cache, **{name: value})
    assert result.returncode == 1, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("environment"))
    assert f"{name}={value} (INVALID: " in line and complaint in line


@pytest.mark.parametrize("name, value", [("OMNICUPY_MMA", "sync"), ("OMNICUPY_VERBOSE", "1"),
                                         ("OMNICUPY_SCHEDULE", "natural")])
def test_info_accepts_valid_settings(cache, omnicupy_command, name, value):
    result = omnicupy_command("info", cache=cache, **{name: value})
    assert result.returncode == 0, result.stderr
    assert "INVALID" not in result.stdout and f"{name}={value}" in result.stdout


def test_info_reports_a_refused_cache(tmp_path, omnicupy_command):
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    result = omnicupy_command("info", cache=cache)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "refused: " in next(line for line in result.stdout.splitlines() if line.startswith("cache"))


# ----------------------------------------------------------------------------- plan
@pytest.mark.parametrize("args,expect", [
    pytest.param(["--arch", "sm_80"], "forward: omni_fwd_fp16_hd128", id="forward-sm80"),
    pytest.param(["--arch", "sm_90", "--backward", "--mask", "sliding_window:1024"], "backward: omni_bwd", id="bwd"),
    pytest.param(["--arch", "sm_80", "--mask", "full", "--head-dim", "64", "--dtype", "fp16"], "hd64", id="full"),
])
def test_plan_prints_the_kernel_without_a_gpu(args, expect, capsys):
    from omnicupy.cli.main import main

    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert expect in out and "why:" in out, out


@pytest.mark.parametrize("args", [["--mask", "bogus"], ["--mask", "sliding_window:x"], ["--q-len", "0"],
                                  ["--dtype", "fp64"]])
def test_plan_usage_errors(args):
    from omnicupy.cli.main import main

    try:
        status = main(["plan", "--arch", "sm_80", *args])
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code
    assert status == 2


# ----------------------------------------------------------------------------- demo
@no_gpu_only
def test_demo_without_gpu_shows_the_mask_and_checks_it_before_compiling(cache, omnicupy_command):
    result = omnicupy_command("demo", "--head-dim", "64", "--dtype", "fp16", "--jobs", "2", cache=cache)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    order = [out.index(marker) for marker in ("interleaved text/image mask:", "\\", "sparsity", "float64 check",
                                              "no GPU: compiling the kernel this demo's call needs on sm_80")]
    assert order == sorted(order), out
    check = next(line for line in out.splitlines() if line.startswith("float64 check"))
    assert "reproduces the mask rule" in check and "max |diff| 0.0e+00" in check and "FAILED" not in check
    # only the demo's own kernel (issue 36: the newcomer's demo stays under a minute on 2 cores)
    assert re.search(r"1 variants in [0-9.]+ s: 1 built, 0 already cached, 0 failed", out), out
    assert "omni_fwd_fp16_hd64" in out, out


def test_demo_reference_check_catches_a_wrong_mask(monkeypatch, capsys):
    """The CPU check fails when the block metadata disagrees with the rule."""
    from omnicupy import BlockMask
    from omnicupy.cli import demo

    real = BlockMask.to_dense

    def one_element_off(self):
        dense = real(self).copy()
        dense[..., 100, 3] = ~dense[..., 100, 3]
        return dense

    monkeypatch.setattr(BlockMask, "to_dense", one_element_off)
    assert demo.reference_check() is False
    assert "DOES NOT reproduce" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bench
def test_bench_without_harness(tmp_path, cache, omnicupy_command):
    assert_one_line_error(omnicupy_command("bench", "--harness", str(tmp_path / "missing.py"), cache=cache), 1)


def test_bench_runs_the_harness_with_its_arguments(tmp_path, cache, omnicupy_command):
    harness = tmp_path / "fakebench" / "run.py"
    harness.parent.mkdir()
    harness.write_text("import sys\nprint('harness', __name__, sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    result = omnicupy_command("bench", "--harness", str(harness), cache=cache)
    assert result.returncode == 0, result.stderr
    assert "harness __main__ []" in result.stdout
    result = omnicupy_command("bench", "--harness", str(harness), "--", "--fail", "x", cache=cache)
    assert result.returncode == 3
    assert "['--fail', 'x']" in result.stdout


def test_bench_finds_the_harness_that_ships_with_omnicupy(cache, omnicupy_command):
    """From outside the repository: the installed package's harness, or the source tree's when the tests
    import the source tree."""
    target, path = bench.find_harness()
    assert path is not None and path.is_file()
    result = omnicupy_command("bench", "--", "--dry-run", "--masks", "causal", "--seq-lens", "1024", cache=cache)
    assert result.returncode == 0, result.stderr
    assert "omnicupy benchmark plan" in result.stdout and "causal" in result.stdout
    help_text = omnicupy_command("bench", "--", "--help", cache=cache)
    assert help_text.returncode == 0 and "--quick" in help_text.stdout


@pytest.mark.parametrize("args, added", [
    pytest.param([], True, id="none"),
    pytest.param(["--quick"], True, id="quick"),
    pytest.param(["--out", "x"], False, id="out"),
    pytest.param(["--out=x"], False, id="out-equals"),
    pytest.param(["--dry-run"], False, id="dry-run"),
    pytest.param(["--report", "r.json"], False, id="report"),
    pytest.param(["-h"], False, id="help"),
])
def test_installed_bench_writes_results_here_unless_told(args, added):
    result = bench._with_default_out(list(args))
    assert (result[len(args):len(args) + 1] == ["--out"]) == added
    if added:
        assert result[-1].startswith("omnicupy-bench")


# ----------------------------------------------------------------------------- examples
@no_gpu_only
@pytest.mark.parametrize("script", ["interleaved_vlm.py", "packed_documents.py", "zero_copy_interop.py"])
def test_examples_say_they_need_a_gpu(script, cache, child_environment, neutral_cwd):
    environ = child_environment(OMNICUPY_CACHE_DIR=str(cache))
    result = subprocess.run([sys.executable, str(REPO / "examples" / script)], capture_output=True, text=True,
                            env=environ, timeout=120, cwd=neutral_cwd)
    assert result.returncode == 0, result.stderr
    assert "needs an NVIDIA GPU" in result.stdout


def test_examples_do_not_import_torch_at_top_level():
    for script in (REPO / "examples").glob("*.py"):
        top_level = [line for line in script.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert not any("torch" in line for line in top_level), script.name
