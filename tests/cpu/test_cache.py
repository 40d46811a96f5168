"""The kernel cache (CPU): trust checks, links, corrupt and malformed entries, the memory fallback,
concurrent builds, leftovers, what `clear` may remove, and what the key depends on."""
from __future__ import annotations

import errno
import json
import re
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from omnicupy import jit
from omnicupy.dispatch import tiles
from omnicupy.errors import CacheError
from omnicupy.jit import DiskCache, cache_stem, files
from omnicupy.jit import cache as cache_module
from omnicupy.jit.render import render_source

VARIANT = tiles.shipped_variants(dtypes=("fp16",), head_dims=(64,), stages=(2,))[0]
SMALL = ["--head-dims", "64", "--dtypes", "fp16", "--stages", "2", "--ops", "forward"]  # 4 forward variants
STEM = "kernel_a-sm_80-0123456789abcdef"
DATA = b"0123456789" * 100
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def fake_builder(calls: list, data: bytes = DATA, delay: float = 0.0):
    def build():
        calls.append(1)
        time.sleep(delay)
        return data, {"kernel": "k", "arch": "sm_80"}

    return build


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def cache_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omnicupy.jit.cache" and r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- entries
def test_store_then_load_round_trip(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    stored = cache.store(STEM, b"abc", {"kernel": "k"})
    loaded = cache.load(STEM)
    assert loaded is not None and loaded.data == b"abc" and loaded.stored
    assert loaded.meta["sha256"] == stored.meta["sha256"] and loaded.size == 3 and loaded.stem == STEM
    assert not [n for n in os.listdir(cache.dir) if n.endswith(".tmp")]  # the atomic writes left no temporaries


def test_folders_are_private_and_tagged(tmp_path):
    root = tmp_path / "new" / "deeper" / "cache"
    cache = DiskCache(root)
    entry = cache.store(STEM, DATA, {})
    for folder in (tmp_path / "new", tmp_path / "new" / "deeper", root, cache.dir, cache.lock_dir):
        assert mode(folder) == 0o700, folder
    assert mode(entry.binary_path) == 0o600 and mode(entry.binary_path.with_suffix(".json")) == 0o600
    assert (cache.dir / "CACHEDIR.TAG").read_bytes().startswith(b"Signature: 8a477f597d28d172789f06886806bc55")


def test_existing_root_keeps_its_mode(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # readable by others is the user's choice; writable by others is refused below
    DiskCache(root).store(STEM, DATA, {})
    assert mode(root) == 0o755


def _break_entry(cache: DiskCache, damage: str, victim: Path) -> None:
    binary, meta = cache.dir / f"{STEM}.cubin", cache.dir / f"{STEM}.json"
    good = json.loads(meta.read_text())
    if damage == "truncate":
        binary.write_bytes(binary.read_bytes()[:500])
    elif damage == "flip":
        data = bytearray(binary.read_bytes())
        data[123] ^= 0xFF
        binary.write_bytes(bytes(data))
    elif damage == "empty":
        binary.write_bytes(b"")
    elif damage == "no-binary":
        binary.unlink()
    elif damage == "garbage-json":
        meta.write_text("{not json")
    elif damage == "deep-json":
        meta.write_text("[" * 100000 + "]" * 100000)
    elif damage in ("json-list", "json-number", "json-string", "json-null"):
        meta.write_text({"json-list": "[1, 2]", "json-number": "42", "json-string": '"x"', "json-null": "null"}[damage])
    elif damage.startswith("json-without-"):
        del good[damage.removeprefix("json-without-")]
        meta.write_text(json.dumps(good))
    elif damage == "json-size-is-text":
        meta.write_text(json.dumps(dict(good, size=str(good["size"]))))
    elif damage == "json-other-stem":
        meta.write_text(json.dumps(dict(good, stem="other-stem")))
    elif damage == "json-other-format":
        meta.write_text(json.dumps(dict(good, cache_format=1)))
    elif damage == "binary-is-a-link":
        victim.write_bytes(binary.read_bytes())  # the same bytes: only the link gives it away
        binary.unlink()
        binary.symlink_to(victim)
    elif damage == "meta-is-a-link":
        victim.write_text(meta.read_text())
        meta.unlink()
        meta.symlink_to(victim)
    elif damage == "binary-is-a-fifo":
        binary.unlink()
        os.mkfifo(binary)
    else:
        raise AssertionError(damage)


DAMAGES = ["truncate", "flip", "empty", "no-binary", "garbage-json", "deep-json", "json-list", "json-number",
           "json-string", "json-null", "json-without-sha256", "json-without-size", "json-without-stem",
           "json-without-created", "json-without-cache_format", "json-size-is-text", "json-other-stem",
           "json-other-format", "binary-is-a-link", "meta-is-a-link", "binary-is-a-fifo"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_entry_is_dropped_and_rebuilt(tmp_path, damage):
    cache = DiskCache(tmp_path / "cache")
    victim = tmp_path / "victim"
    calls = []
    assert cache.get_or_build(STEM, fake_builder(calls))[1]
    _break_entry(cache, damage, victim)
    victim_before = victim.read_bytes() if victim.exists() else None
    assert cache.load(STEM) is None  # never loaded
    assert not os.path.lexists(cache.dir / f"{STEM}.json")  # and removed
    assert [e.stem for e in cache.entries()] == []  # a listing never fails on it
    entry, built = cache.get_or_build(STEM, fake_builder(calls))
    assert built and len(calls) == 2 and entry.data == DATA
    assert cache.load(STEM).data == DATA
    assert not os.path.islink(entry.binary_path)
    if victim_before is not None:
        assert victim.read_bytes() == victim_before  # a link's target is never written or removed


def test_load_reads_the_binary_once_and_returns_those_bytes(tmp_path, monkeypatch):
    """The bytes handed to the loader are the verified ones: the file is not opened again."""
    cache = DiskCache(tmp_path / "cache")
    cache.store(STEM, DATA, {})
    opened = []
    real = files.read_private
    monkeypatch.setattr(files, "read_private", lambda path, limit: opened.append(Path(path).name) or real(path, limit))
    entry = cache.load(STEM)
    assert entry.data == DATA
    assert opened.count(f"{STEM}.cubin") == 1


def test_get_kernel_loads_the_verified_bytes(tmp_cache, monkeypatch):
    """get_kernel hands the cache's verified bytes to the module loader (no GPU: the loader is faked)."""
    import cupy

    loaded = []

    class FakeKernel:
        def __init__(self, image, name):
            loaded.append((bytes(image), name))
            self.max_dynamic_shared_size_bytes = 0

    monkeypatch.setattr(jit, "LoadedKernel", FakeKernel)
    monkeypatch.setattr(jit, "device_arch", lambda device_id=None: "sm_80")
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(jit, "_loaded", {})
    kernel = jit.get_kernel(VARIANT)
    entry, built = jit.build(VARIANT, "sm_80")
    assert not built and loaded == [(entry.data, VARIANT.name)]
    assert entry.binary_path.read_bytes() == entry.data
    assert kernel.max_dynamic_shared_size_bytes == (VARIANT.smem_bytes if VARIANT.smem_bytes > 48 * 1024 else 0)
    assert jit.get_kernel(VARIANT) is kernel and len(loaded) == 1


def test_loaded_kernel_wiring_without_a_gpu(monkeypatch):
    """LoadedKernel loads the module from bytes and calls the function as cupy.RawKernel would
    (CuPy's module, function and driver calls faked: no GPU here)."""
    from cupy.cuda import driver, function

    from omnicupy.jit.loader import LoadedKernel

    calls = []

    class FakeFunction:
        ptr = 1234

        def __call__(self, *args):
            calls.append(("launch", args))

    class FakeModule:
        def load(self, image):
            assert type(image) is bytes
            calls.append(("load", image))

        def get_function(self, name):
            calls.append(("get_function", name))
            return FakeFunction()

    attributes = {}
    monkeypatch.setattr(function, "Module", FakeModule)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda ptr, attr, value: attributes.__setitem__((ptr, attr), value))
    monkeypatch.setattr(driver, "funcGetAttribute", lambda attr, ptr: attributes.get((ptr, attr), 7))
    kernel = LoadedKernel(bytearray(b"image"), "k")
    kernel.max_dynamic_shared_size_bytes = 100000
    assert kernel.max_dynamic_shared_size_bytes == 100000 and kernel.num_regs == 7
    kernel([3, 2, 1], (128,), ("a", "b"), shared_mem=100000)
    launch = ("launch", ((3, 2, 1), (128,), ("a", "b"), 100000, None))  # grid as a tuple, the current stream
    assert calls == [("load", b"image"), ("get_function", "k"), launch]


@pytest.mark.parametrize("stem", ["", "../x", "a/b", ".hidden", "a.b", "x" * 201, "spaced name"])
def test_stems_are_plain_names(tmp_path, stem):
    with pytest.raises(CacheError, match="stem"):
        DiskCache(tmp_path).store(stem, DATA, {})


# ----------------------------------------------------------------------------- trust
def _refuse(root: Path, how: str, monkeypatch) -> None:
    if how == "group-writable":
        root.mkdir()
        os.chmod(root, 0o770)
    elif how == "world-writable":
        root.mkdir()
        os.chmod(root, 0o757)
    elif how == "other-owner":  # as if another user owned it (the real chown is tested below, as root)
        root.mkdir()
        monkeypatch.setattr(files, "trusted_owners", lambda: frozenset({os.getuid() + 4242}))
    elif how == "format-folder-is-a-link":
        elsewhere = root.parent / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        root.mkdir(mode=0o700)
        (root / f"v{cache_module.CACHE_FORMAT}").symlink_to(elsewhere)
    elif how == "format-folder-not-ours":
        folder = root / f"v{cache_module.CACHE_FORMAT}"
        folder.mkdir(parents=True, mode=0o700)
        (folder / "thesis.tex").write_text("not a kernel")
    elif how == "format-folder-writable":
        DiskCache(root).ensure_ready()
        os.chmod(root / f"v{cache_module.CACHE_FORMAT}", 0o777)
    else:
        raise AssertionError(how)


REFUSALS = ["group-writable", "world-writable", "other-owner", "format-folder-is-a-link", "format-folder-not-ours",
            "format-folder-writable"]


@pytest.mark.parametrize("how", REFUSALS)
def test_untrusted_folder_is_refused(tmp_path, monkeypatch, how):
    root = tmp_path / "cache"
    _refuse(root, how, monkeypatch)
    for action in (lambda c: c.store(STEM, DATA, {}), lambda c: c.ensure_ready(),
                   lambda c: c.get_or_build(STEM, fake_builder([]), must_store=True)):
        with pytest.raises(CacheError):
            action(DiskCache(root))
    if how != "other-owner":  # listing reads only what may be read (the fake owner check refuses all)
        with pytest.raises(CacheError):
            DiskCache(root).entries()


@pytest.mark.skipif(not AS_ROOT, reason="needs root to give the folder to another user")
def test_folder_of_another_user_is_refused(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, 4242)
    with pytest.raises(CacheError, match="4242"):
        DiskCache(root).ensure_ready()


def test_planted_entry_in_a_refused_folder_is_never_loaded(tmp_path, monkeypatch, fresh_memory_warning):
    """A binary with a valid checksum beside it is still not loaded from a folder others can write."""
    root = tmp_path / "cache"
    DiskCache(root).store(STEM, b"planted", {})
    os.chmod(root, 0o777)
    calls = []
    entry, built = DiskCache(root).get_or_build(STEM, fake_builder(calls))
    assert built and calls and entry.data == DATA and not entry.stored


def test_lock_file_link_is_not_followed(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    cache.ensure_ready()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (cache.lock_dir / f"{STEM}.lock").symlink_to(victim)
    entry, built = cache.get_or_build(STEM, fake_builder([]))
    assert built and entry.stored
    assert victim.read_text() == "precious"
    assert not os.path.islink(cache.lock_dir / f"{STEM}.lock")


def test_kept_source_link_is_not_followed(tmp_cache, monkeypatch):
    monkeypatch.setenv("OMNICUPY_KEEP_SOURCE", "1")
    cache = jit.default_cache()
    cache.ensure_ready()
    stem = cache_stem(VARIANT, "sm_80")
    victim = tmp_cache.parent / "victim"
    victim.write_text("precious")
    (cache.dir / f"{stem}.cu").symlink_to(victim)
    entry, built = jit.build(VARIANT, "sm_80")
    assert built and entry.stored
    assert victim.read_text() == "precious"
    kept = cache.dir / f"{stem}.cu"
    assert not kept.is_symlink() and kept.read_text() == render_source(VARIANT) and mode(kept) == 0o600


def test_atomic_write_replaces_a_link_not_its_target(tmp_path):
    victim, path = tmp_path / "victim", tmp_path / "entry"
    victim.write_text("precious")
    path.symlink_to(victim)
    files.write_atomic(path, b"new")
    assert victim.read_text() == "precious" and not path.is_symlink() and path.read_bytes() == b"new"


# ----------------------------------------------------------------------------- unusable folders
def _break_folder(root: Path, how: str, monkeypatch) -> Path:
    """Make the cache at ``root`` unusable in the way ``how`` names; returns the root to use."""
    if how == "a-file-in-the-way":
        root.write_text("not a folder")
    elif how == "parent-is-a-file":
        (root.parent / "file").write_text("x")
        return root.parent / "file" / "cache"
    elif how == "no-space":
        def full(path, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(files, "write_atomic", full)
    elif how == "read-only":
        DiskCache(root).ensure_ready()
        if AS_ROOT:  # root writes through any mode: stand in for a read-only file system
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))

            monkeypatch.setattr(files, "write_atomic", read_only)
            monkeypatch.setattr(cache_module.filelock, "FileLock", read_only)
        else:
            for folder in (root / f"v{cache_module.CACHE_FORMAT}" / "locks", root / f"v{cache_module.CACHE_FORMAT}"):
                os.chmod(folder, 0o500)
    elif how in REFUSALS:
        _refuse(root, how, monkeypatch)
    else:
        raise AssertionError(how)
    return root


BREAKAGES = ["a-file-in-the-way", "parent-is-a-file", "no-space", "read-only", "group-writable", "other-owner",
             "format-folder-not-ours"]


@pytest.mark.parametrize("how", BREAKAGES)
def test_unusable_folder_builds_in_memory_with_one_warning(tmp_path, monkeypatch, caplog, fresh_memory_warning, how):
    root = _break_folder(tmp_path / "cache", how, monkeypatch)
    calls = []
    with caplog.at_level(logging.DEBUG, logger="omnicupy"):
        for attempt in range(3):
            entry, built = DiskCache(root).get_or_build(f"{STEM}{attempt}", fake_builder(calls))
            assert built and not entry.stored and entry.binary_path is None
            assert entry.data == DATA and entry.meta["sha256"] and entry.meta["kernel"] == "k"
    assert len(calls) == 3
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "kept in memory" in warnings[0].getMessage()
    with pytest.raises(CacheError):  # precompile must persist: it gets the named error instead
        DiskCache(root).get_or_build(STEM, fake_builder(calls), must_store=True)


def test_build_errors_are_not_taken_for_cache_errors(tmp_path, fresh_memory_warning):
    def failing():
        raise OSError(errno.EIO, "the builder's own failure")

    for root in (tmp_path / "good", tmp_path / "file"):
        if root.name == "file":
            root.write_text("in the way")
        with pytest.raises(OSError, match="builder's own"):
            DiskCache(root).get_or_build(STEM, failing)


def test_build_uses_a_fresh_kernel_from_memory_when_the_cache_is_broken(tmp_path, monkeypatch, caplog,
                                                                          fresh_memory_warning):
    good, _ = jit.build(VARIANT, "sm_80", cache=DiskCache(tmp_path / "good"))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("OMNICUPY_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="omnicupy"):
        entry, built = jit.build(VARIANT, "sm_80")
        again, _ = jit.build(VARIANT, "sm_80")
    assert built and not entry.stored and entry.data == good.data == again.data
    assert len(cache_warnings(caplog)) == 1
    with pytest.raises(CacheError, match="blocker"):
        jit.build(VARIANT, "sm_80", must_store=True)


# ----------------------------------------------------------------------------- concurrency and leftovers
def test_lock_builds_once_across_threads(tmp_path):
    """Threads stand in for processes: each has its own cache object and lock file descriptor."""
    calls, results = [], []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append(DiskCache(tmp_path / "cache").get_or_build(STEM, fake_builder(calls, delay=0.2)))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(built for _, built in results) == [False, False, False, True]
    assert all(entry.stored and entry.data == DATA for entry, _ in results)


def test_clear_older_than(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    for stem in ("old", "new"):
        cache.store(stem, b"x", {})
    meta_path = cache.dir / "old.json"
    meta = json.loads(meta_path.read_text())
    meta["created"] -= 10 * 86400
    meta_path.write_text(json.dumps(meta))
    assert cache.clear(older_than_seconds=86400) == 1
    assert [e.stem for e in cache.entries()] == ["new"]


def test_remove_leftovers_keeps_entries_and_builds_in_progress(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    cache.store("kept", b"x", {})
    (cache.dir / "kept.cu").write_text("// source of a live entry")
    (cache.dir / "gone.cu").write_text("// source of a removed entry")
    (cache.dir / "half.cubin").write_bytes(b"binary whose metadata never landed")
    (cache.dir / ".crashed.cubin.abc123.tmp").write_bytes(b"interrupted write")
    (cache.dir / ".busy.cubin.xyz789.tmp").write_bytes(b"write in progress")
    (cache.dir / "notes.txt").write_text("not a name omnicupy writes: left alone")
    with cache.lock("busy"):
        assert cache.remove_leftovers() == 3
    left = sorted(p.name for p in cache.dir.iterdir() if p.is_file())
    assert left == [".busy.cubin.xyz789.tmp", "CACHEDIR.TAG", "kept.cu", "kept.cubin", "kept.json", "notes.txt"]
    assert sorted(p.name for p in cache.lock_dir.iterdir()) == ["busy.lock"]
    assert cache.remove_leftovers() == 1  # the build is over: its temporary goes


# ----------------------------------------------------------------------------- what clear may remove
def _format1_entry(folder: Path, stem: str) -> None:
    """An entry as omnicupy's first cache format wrote it (no tag, no cache_format field)."""
    import hashlib

    (folder / "locks").mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.cubin").write_bytes(b"old")
    meta = {"stem": stem, "sha256": hashlib.sha256(b"old").hexdigest(), "size": 3, "created": 1.0}
    (folder / f"{stem}.json").write_text(json.dumps(meta))
    (folder / "locks" / f"{stem}.lock").write_bytes(b"")


def test_clear_removes_only_what_omnicupy_wrote(tmp_path):
    root = tmp_path / "cache"
    cache = DiskCache(root)
    assert cache_module.CACHE_FORMAT not in (1, 5, 7, 8, 9)  # the other folders below are not ours
    cache.store(STEM, DATA, {})
    (cache.dir / "notes.txt").write_text("mine")  # not a name of ours, even in our folder
    (root / "settings.json").write_text('{"mine": true}')  # the root's own files are never ours
    (root / "v1").mkdir()
    _format1_entry(root / "v1", "old_kernel-sm_80-0123456789abcdef")  # an older omnicupy's folder: goes
    (root / "v5").mkdir()
    _format1_entry(root / "v5", "old_kernel-sm_80-0123456789abcdef")
    (root / "v5" / "photo.jpg").write_bytes(b"mine")  # mixed: stays whole
    (root / "v7").mkdir()
    (root / "v7" / "data.json").write_text("[1, 2, 3]")  # somebody's v<digits> folder: stays
    (root / "v8").mkdir()
    (root / "v8" / "k-sm_80-0123456789abcdef.cubin").write_bytes(b"?")  # our name, but no metadata says so
    (root / "v9").symlink_to(root / "v7")

    assert cache.clear() == 1
    cache.remove_leftovers()
    assert cache.remove_other_formats() == 1
    assert not (root / "v1").exists()
    for survivor in ("settings.json", "v5/photo.jpg", "v5/old_kernel-sm_80-0123456789abcdef.json", "v7/data.json",
                     "v8/k-sm_80-0123456789abcdef.cubin", "v9"):
        assert os.path.lexists(root / survivor), survivor
    assert (cache.dir / "notes.txt").read_text() == "mine"
    assert [p.name for p in cache.other_formats()] == ["v5", "v7", "v8"]


@pytest.mark.parametrize("step", ["ensure_ready", "load"])
def test_a_tag_renamed_in_between_look_and_listing_is_accepted(tmp_path, monkeypatch, step):
    """The interleaving CI once hit with four threads: this process finds no tag, another process
    renames its tag into place, then this process lists the folder and sees the tag there."""
    root = tmp_path / "cache"
    DiskCache(root).store(STEM, DATA, {})  # the other process: folder, tag, one entry
    (root / f"v{cache_module.CACHE_FORMAT}" / STEM).with_suffix(".cubin").unlink()  # leave only tag + meta + locks
    cache = DiskCache(root)
    looks = []
    real = DiskCache._has_tag

    def first_look_misses(self, folder):
        looks.append(folder)
        return False if len(looks) == 1 else real(self, folder)

    monkeypatch.setattr(DiskCache, "_has_tag", first_look_misses)
    if step == "ensure_ready":
        cache.ensure_ready()
    else:
        assert cache.load(STEM) is None  # the entry is incomplete; what matters is no CacheError
    assert len(looks) == 2


def test_a_foreign_tag_is_still_refused(tmp_path):
    folder = tmp_path / "cache" / f"v{cache_module.CACHE_FORMAT}"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "cache", 0o700)
    (folder / "CACHEDIR.TAG").write_bytes(b"Signature: 8a477f597d28d172789f06886806bc55\n# some backup tool\n")
    with pytest.raises(CacheError, match="not made by omnicupy"):
        DiskCache(tmp_path / "cache").ensure_ready()


def test_clear_refuses_a_format_folder_it_did_not_make(tmp_path):
    root = tmp_path / "somebodys"
    folder = root / f"v{cache_module.CACHE_FORMAT}"
    folder.mkdir(parents=True)
    (folder / "paper.json").write_text("{}")
    with pytest.raises(CacheError, match="not made by omnicupy"):
        DiskCache(root).clear()
    assert (folder / "paper.json").exists()


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


@pytest.mark.parametrize("damage", ["flip", "json-list", "json-number", "json-without-sha256"])
def test_damaged_entry_is_rebuilt_by_precompile(tmp_cache, omnicupy_command, damage):
    args = ("precompile", "--arch", "sm_80", *SMALL, "--jobs", "1", "--quiet")
    first = omnicupy_command(*args, cache=tmp_cache)
    assert first.returncode == 0, first.stderr
    folder = tmp_cache / f"v{cache_module.CACHE_FORMAT}"
    victim = sorted(folder.glob("*.cubin"))[0]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x5A  # same size, wrong checksum
        victim.write_bytes(bytes(data))
    else:
        meta = victim.with_suffix(".json")
        good = json.loads(meta.read_text())
        meta.write_text({"json-list": "[1, 2]", "json-number": "42"}.get(damage)
                        or json.dumps({k: v for k, v in good.items() if k != "sha256"}))
    for command in (("cache", "list"), ("info",)):
        listing = omnicupy_command(*command, cache=tmp_cache)
        assert listing.returncode in (0, 1) and "Traceback" not in listing.stderr, listing.stderr
    second = omnicupy_command(*args, cache=tmp_cache)
    assert second.returncode == 0, second.stderr
    assert re.search(r"\b1 built, \d+ already cached, 0 failed", second.stdout), second.stdout
    assert DiskCache(tmp_cache).load(victim.stem) is not None


def test_two_processes_precompiling_at_once_leave_one_valid_entry_each(tmp_cache, omnicupy_command):
    args = ("precompile", "--arch", "sm_80", *SMALL, "--jobs", "1", "--quiet")
    outputs = []
    threads = [threading.Thread(target=lambda: outputs.append(omnicupy_command(*args, cache=tmp_cache)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in outputs] == [0, 0], [r.stderr for r in outputs]
    # Each variant was compiled exactly once between the two (lock + re-check), the other process loaded it.
    built = sum(int(r.stdout.split(" built")[0].rsplit(" ", 1)[-1]) for r in outputs)
    assert built == 4, [r.stdout for r in outputs]
    cache = DiskCache(tmp_cache)
    entries = cache.entries()
    assert len(entries) == 4 and len({e.stem for e in entries}) == 4
    assert all(cache.load(e.stem) is not None for e in entries)
    assert not [n for n in os.listdir(cache.dir) if n.endswith(".tmp")]


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
