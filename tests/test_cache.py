"""The kernel cache: concurrent builds, corrupt entries, leftovers, and what the key depends on (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omnicupy import jit
from omnicupy.dispatch import tiles
from omnicupy.jit import DiskCache, cache_stem
from omnicupy.jit.render import render_source

REPO = Path(__file__).resolve().parents[1]
VARIANT = tiles.shipped_variants(dtypes=("fp16",), head_dims=(64,), stages=(2,))[0]
SMALL = ["--head-dims", "64", "--dtypes", "fp16", "--stages", "2"]  # 4 variants


def fake_builder(calls: list, data: bytes = b"cubin-bytes", delay: float = 0.0):
    def build():
        calls.append(1)
        time.sleep(delay)
        return data, {"kernel": "k", "arch": "sm_80"}

    return build


# ----------------------------------------------------------------------------- DiskCache, no NVRTC
def test_store_then_load_round_trip(tmp_path):
    cache = DiskCache(tmp_path)
    stored = cache.store("s", b"abc", {"kernel": "k"})
    loaded = cache.load("s")
    assert loaded is not None and loaded.binary_path.read_bytes() == b"abc"
    assert loaded.meta["sha256"] == stored.meta["sha256"] and loaded.size == 3
    assert not list(cache.dir.glob(".*.tmp"))  # the atomic writes left no temporaries


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage-json", "no-binary"])
def test_damaged_entry_is_dropped_and_rebuilt(tmp_path, damage):
    cache = DiskCache(tmp_path)
    calls = []
    entry, built = cache.get_or_build("s", fake_builder(calls, b"0123456789" * 100))
    assert built
    binary, meta = entry.binary_path, entry.binary_path.with_suffix(".json")
    if damage == "truncate":
        binary.write_bytes(binary.read_bytes()[:500])
    elif damage == "flip":
        data = bytearray(binary.read_bytes())
        data[123] ^= 0xFF
        binary.write_bytes(bytes(data))
    elif damage == "empty":
        binary.write_bytes(b"")
    elif damage == "garbage-json":
        meta.write_text("{not json")
    else:
        binary.unlink()
    assert cache.load("s") is None  # never loaded
    assert not meta.exists()  # and removed
    entry, built = cache.get_or_build("s", fake_builder(calls, b"0123456789" * 100))
    assert built and len(calls) == 2
    assert cache.load("s").binary_path.read_bytes() == b"0123456789" * 100


def test_lock_builds_once_across_threads(tmp_path):
    """Threads stand in for processes: each opens the lock file itself, so flock excludes them alike."""
    calls, results = [], []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append(DiskCache(tmp_path).get_or_build("s", fake_builder(calls, delay=0.2)))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(built for _, built in results) == [False, False, False, True]


def test_clear_older_than(tmp_path):
    cache = DiskCache(tmp_path)
    for stem in ("old", "new"):
        cache.store(stem, b"x", {})
    meta_path = cache.dir / "old.json"
    meta = json.loads(meta_path.read_text())
    meta["created"] -= 10 * 86400
    meta_path.write_text(json.dumps(meta))
    assert cache.clear(older_than_seconds=86400) == 1
    assert [e.stem for e in cache.entries()] == ["new"]


def test_remove_leftovers_keeps_entries_and_builds_in_progress(tmp_path):
    cache = DiskCache(tmp_path)
    cache.store("kept", b"x", {})
    (cache.dir / "kept.cu").write_text("// source of a live entry")
    (cache.dir / "gone.cu").write_text("// source of a removed entry")
    (cache.dir / "half.cubin").write_bytes(b"binary whose metadata never landed")
    (cache.dir / ".crashed.cubin.abc123.tmp").write_bytes(b"interrupted write")
    (cache.dir / ".busy.cubin.xyz789.tmp").write_bytes(b"write in progress")
    with cache.lock("busy"):
        assert cache.remove_leftovers() == 3
    left = sorted(p.name for p in cache.dir.iterdir() if p.is_file())
    assert left == [".busy.cubin.xyz789.tmp", "kept.cu", "kept.cubin", "kept.json"]
    assert sorted(p.name for p in (cache.dir / "locks").iterdir()) == ["busy.lock"]
    assert cache.remove_leftovers() == 1  # the build is over: its temporary goes


# ----------------------------------------------------------------------------- with NVRTC
def test_corrupt_cubin_is_rebuilt_by_build(tmp_cache):
    entry, built = jit.build(VARIANT, "sm_80")
    assert built
    good = entry.binary_path.read_bytes()
    entry.binary_path.write_bytes(good[: len(good) // 2])  # a truncated write
    entry2, built2 = jit.build(VARIANT, "sm_80")
    assert built2 and entry2.binary_path == entry.binary_path
    assert entry2.binary_path.read_bytes() == good  # NVRTC is deterministic: the same cubin again
    assert jit.build(VARIANT, "sm_80")[1] is False


def test_corrupt_entry_is_rebuilt_by_precompile(tmp_cache):
    run = [sys.executable, "-m", "omnicupy", "precompile", "--arch", "sm_80", *SMALL, "--jobs", "1", "--quiet"]
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(tmp_cache))
    first = subprocess.run(run, capture_output=True, text=True, env=environ, cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stderr
    victim = sorted((tmp_cache / "v1").glob("*.cubin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A  # flip bits in the middle: same size, wrong checksum
    victim.write_bytes(bytes(data))
    second = subprocess.run(run, capture_output=True, text=True, env=environ, cwd=REPO, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "1 built, 3 already cached, 0 failed" in second.stdout
    assert DiskCache(tmp_cache).load(victim.stem) is not None


def test_two_processes_precompiling_at_once_leave_one_valid_entry_each(tmp_cache):
    run = [sys.executable, "-m", "omnicupy", "precompile", "--arch", "sm_80", *SMALL, "--jobs", "1", "--quiet"]
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(tmp_cache))
    procs = [subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, cwd=REPO)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # Each variant was compiled exactly once between the two (lock + re-check), the other process loaded it.
    built = sum(int(out.split(" built")[0].rsplit(" ", 1)[-1]) for out, _ in outputs)
    assert built == 4, outputs
    cache = DiskCache(tmp_cache)
    entries = cache.entries()
    assert len(entries) == 4 and len({e.stem for e in entries}) == 4
    assert all(cache.load(e.stem) is not None for e in entries)
    assert not list(cache.dir.glob(".*.tmp"))


# ----------------------------------------------------------------------------- the key
def test_key_is_stable_and_readable():
    stem = cache_stem(VARIANT, "sm_80")
    assert stem == cache_stem(VARIANT, "sm_80")
    assert stem.startswith(f"{VARIANT.name}-sm_80-")


def test_key_changes_with_source_arch_and_variant():
    source = render_source(VARIANT)
    base = cache_stem(VARIANT, "sm_80", source)
    assert cache_stem(VARIANT, "sm_80", source + "\n// edited\n") != base
    assert cache_stem(VARIANT, "sm_90", source) != base
    assert cache_stem(VARIANT, "sm_90a", source) != cache_stem(VARIANT, "sm_90", source)
    other = tiles.shipped_variants(dtypes=("fp16",), head_dims=(64,), stages=(2,))[1]
    assert cache_stem(other, "sm_80") != cache_stem(VARIANT, "sm_80")


def test_key_changes_with_options(monkeypatch):
    base = cache_stem(VARIANT, "sm_80")
    monkeypatch.setenv("OMNICUPY_LINEINFO", "1")  # adds -lineinfo to the NVRTC options
    assert cache_stem(VARIANT, "sm_80") != base


@pytest.mark.parametrize("name, value", [
    ("headers_digest_material", lambda: "// a kernels/ header was edited"),
    ("nvrtc_version", lambda: (99, 0)),
    ("__version__", "9.9.9"),
    ("CACHE_FORMAT", 999),
], ids=["headers", "nvrtc", "package-version", "cache-format"])
def test_key_changes_with_toolchain(monkeypatch, name, value):
    base = cache_stem(VARIANT, "sm_80")
    monkeypatch.setattr(jit, name, value)
    assert cache_stem(VARIANT, "sm_80") != base
