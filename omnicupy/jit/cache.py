"""On-disk cache of compiled binaries. Knows files, locks and checksums; nothing of CUDA or attention.

Layout (``FORMAT`` is ``CACHE_FORMAT``)::

    <root>/v<FORMAT>/CACHEDIR.TAG          marks the folder as omnicupy's (backup tools skip it too)
    <root>/v<FORMAT>/<stem>.cubin          a binary
    <root>/v<FORMAT>/<stem>.json           its metadata: the caller's fields + stem, size, sha256, created
    <root>/v<FORMAT>/<stem>.cu             the source it was built from, when the caller keeps it
    <root>/v<FORMAT>/locks/<stem>.lock     the stem's lock (the ``filelock`` package)

Trust. Whoever can write the cache folder can make omnicupy run code of their choosing: a checksum
stored beside a binary cannot stop them, since they can rewrite the checksum too (and a key would
have to be stored where the same people can read it). The checksum only catches accidents: torn
writes, a full disk, bit rot. The trust anchor is the folder itself: the root and the folders below
it must belong to the current user (or to root, who can replace any file anyway) and be writable by
nobody else. The cache creates its folders 0700 and its files 0600, refuses with ``CacheError`` a
folder that fails those checks, opens every entry, temporary, lock and kept source without following
symbolic links (``files.py``), and hands the caller the very bytes it verified (``CacheEntry.data``),
so that nothing reads the path again after the check. Folders above the root are the operating
system's business, as for any other file of the user's.

Writes go to a temporary file and are renamed into place, the binary before the metadata, so a
reader sees a complete entry or none. A per-stem lock with a re-check after it is taken keeps two
processes from building the same entry twice. An entry whose metadata is not a well-formed object of
this format, or whose checksum does not match, is removed and rebuilt, never loaded.

When the folder cannot be used (refused, read-only, full, a file where a folder should be),
``get_or_build`` still builds and returns the entry from memory, with one logged warning per process;
a caller that must persist (``must_store=True``, as ``omnicupy precompile``) gets a CacheError.

Removal touches only what this module wrote: files named like its own in a folder that carries its
tag. A folder of another format is deleted only when every file in it is recognisably an omnicupy
cache file (format 1 had no tag: there each entry is recognised by its metadata).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import filelock

from ..errors import CacheError
from . import files

#: Bumped on purpose when the kernels' headers or the compile path change as a whole (3: the kernel
#: slots and NVRTC through cuda.bindings, 0.2.0): old entries are left in v<old>/ and recompiled once.
CACHE_FORMAT = 3
BINARY_SUFFIX = ".cubin"
META_SUFFIX = ".json"
SOURCE_SUFFIX = ".cu"
LOCK_SUFFIX = ".lock"
TAG_NAME = "CACHEDIR.TAG"
_TAG_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"  # the cache directory tag convention
_TAG_TEXT = _TAG_SIGNATURE + b"\n# omnicupy kernel cache: compiled kernels, rebuilt on demand. Safe to delete.\n"
META_LIMIT = 1 << 20  # bytes; metadata is a few hundred
BINARY_LIMIT = 256 << 20

_STEM = r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}"
_STEM_RE = re.compile(_STEM)
_OWN_FILE_RE = re.compile(rf"(?P<stem>{_STEM})(?P<suffix>\.cubin|\.json|\.cu)")
_LOCK_RE = re.compile(rf"(?P<stem>{_STEM})\.lock")
#: files.temporary_name of one of our files (format 1 used tempfile's random letters: [^.]+ takes both).
_TEMPORARY_RE = re.compile(rf"\.(?P<stem>{_STEM}|CACHEDIR)\.(?:cubin|json|cu|TAG)\.[^.]+\.tmp")

_log = logging.getLogger(__name__)
_memory_only_lock = threading.Lock()
_memory_only_warned = False


def _warn_memory_only(folder: Path, reason: BaseException) -> None:
    """One warning per process, however many kernels end up in memory; the rest at DEBUG."""
    global _memory_only_warned
    with _memory_only_lock:
        first, _memory_only_warned = not _memory_only_warned, True
    message = "kernel cache %s is not usable (%s): compiled kernels are kept in memory for this process only"
    (_log.warning if first else _log.debug)(message, folder, reason)


@dataclass(frozen=True)
class CacheEntry:
    """A verified entry. ``binary_path`` is None for an entry kept in memory only; ``data`` holds the
    bytes that were verified (None in listings, which do not keep them)."""

    binary_path: Optional[Path]
    meta: dict
    data: Optional[bytes] = field(default=None, repr=False, compare=False)

    @property
    def stem(self) -> str:
        return str(self.meta.get("stem") or (self.binary_path.stem if self.binary_path else ""))

    @property
    def stored(self) -> bool:
        return self.binary_path is not None

    @property
    def size(self) -> int:
        return int(self.meta.get("size", 0))

    @property
    def created(self) -> float:
        return float(self.meta.get("created", 0.0))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_stem(stem: str) -> None:
    if not isinstance(stem, str) or not _STEM_RE.fullmatch(stem):
        raise CacheError(f"cache stem {stem!r}: want letters, digits, '_' and '-' (at most 200)")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _valid_meta(meta: object, stem: str) -> bool:
    """Metadata this format writes: an object naming the stem, with the binary's size and checksum."""
    if not isinstance(meta, dict):
        return False
    digest, size = meta.get("sha256"), meta.get("size")
    return (meta.get("cache_format") == CACHE_FORMAT and meta.get("stem") == stem
            and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None
            and isinstance(size, int) and not isinstance(size, bool) and size >= 0
            and _is_number(meta.get("created")))


def _parse_json(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def _as_cache_error(folder: Path, exc: BaseException) -> CacheError:
    if isinstance(exc, CacheError):
        return exc
    detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return CacheError(f"cannot write to the kernel cache {folder}: {detail}")


class DiskCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.dir = self.root / f"v{CACHE_FORMAT}"
        self.lock_dir = self.dir / "locks"
        self._ready = False  # folders made and checked for writing
        self._checked = False  # folders checked for reading

    # ------------------------------------------------------------------ folders
    def ensure_ready(self) -> None:
        """Create (0700) and check the root, this format's folder (with its tag) and the lock folder.
        Raises CacheError when any of them cannot be used."""
        if self._ready:
            return
        try:
            files.make_private_folders(self.root)
        except OSError as exc:
            raise CacheError(f"cannot create the kernel cache folder {self.root}: {exc.strerror or exc}") from exc
        files.check_folder(self.root, follow=True)
        for folder in (self.dir, self.lock_dir):
            try:
                os.mkdir(folder, files.PRIVATE_DIR_MODE)
            except FileExistsError:
                pass
            except OSError as exc:
                raise CacheError(f"cannot create the kernel cache folder {folder}: {exc.strerror or exc}") from exc
            files.check_folder(folder, follow=False)
            if folder == self.dir and not self._has_tag(folder):
                self._claim(folder)
        self._ready = self._checked = True

    def _has_tag(self, folder: Path) -> bool:
        try:
            data = files.read_private(folder / TAG_NAME, 4096)
        except (FileNotFoundError, files.UntrustedFile):
            return False
        return data.startswith(_TAG_SIGNATURE) and b"omnicupy" in data

    def _only_our_tag_in_progress(self, folder: Path) -> bool:
        """Empty, but for a concurrent process writing the tag (its temporary, or the lock folder)."""
        return all(_TEMPORARY_RE.fullmatch(n) or n == "locks" for n in os.listdir(folder))

    def _claim(self, folder: Path) -> None:
        """Tag a folder this cache just made (empty); refuse one that holds somebody else's files."""
        if not self._only_our_tag_in_progress(folder):
            # The listing may have caught another process renaming its tag into place (a look at the
            # tag, then the rename, then the listing): read the tag once more before refusing.
            if self._has_tag(folder):
                return
            raise CacheError(f"{folder} exists and was not made by omnicupy (it has no {TAG_NAME}): omnicupy does not "
                             f"write into it; choose another cache folder with OMNICUPY_CACHE_DIR")
        try:
            files.write_atomic(folder / TAG_NAME, _TAG_TEXT)
        except OSError as exc:
            raise CacheError(f"cannot write to the kernel cache folder {folder}: {exc.strerror or exc}") from exc

    def _readable(self) -> bool:
        """Whether this format's folder exists and may be read (CacheError when it must not be)."""
        if self._checked:
            return True
        if not os.path.lexists(self.root):
            return False
        files.check_folder(self.root, follow=True)
        if not os.path.lexists(self.dir):
            return False
        files.check_folder(self.dir, follow=False)
        if not self._has_tag(self.dir):
            if self._only_our_tag_in_progress(self.dir):
                return False
            if not self._has_tag(self.dir):  # renamed into place since the first look (see _claim)
                raise CacheError(f"{self.dir} was not made by omnicupy (it has no {TAG_NAME}): omnicupy does not read it")
        self._checked = True
        return True

    def _paths(self, stem: str) -> tuple[Path, Path]:
        return self.dir / f"{stem}{BINARY_SUFFIX}", self.dir / f"{stem}{META_SUFFIX}"

    def _lock_path(self, stem: str) -> Path:
        return self.lock_dir / f"{stem}{LOCK_SUFFIX}"

    # ------------------------------------------------------------------ entries
    def load(self, stem: str) -> Optional[CacheEntry]:
        """The verified entry with its bytes, or None (absent, incomplete or corrupt; corrupt entries
        are removed). CacheError when the folder must not be read."""
        _check_stem(stem)
        if not self._readable():
            return None
        binary, meta_path = self._paths(stem)
        try:
            meta = _parse_json(files.read_private(meta_path, META_LIMIT))
        except FileNotFoundError:
            return None
        except (files.UntrustedFile, OSError) as exc:
            return self._drop(stem, f"metadata unusable: {exc}")
        if not _valid_meta(meta, stem):
            return self._drop(stem, "metadata is not an entry of this format")
        try:
            data = files.read_private(binary, BINARY_LIMIT)
        except FileNotFoundError:
            return self._drop(stem, "binary missing")
        except (files.UntrustedFile, OSError) as exc:
            return self._drop(stem, f"binary unusable: {exc}")
        if len(data) != meta["size"] or _sha256(data) != meta["sha256"]:
            return self._drop(stem, "checksum mismatch")
        return CacheEntry(binary, meta, data)

    def _drop(self, stem: str, why: str) -> None:
        _log.debug("dropping cache entry %s in %s: %s", stem, self.dir, why)
        with contextlib.suppress(OSError):
            self.remove(stem)
        return None

    def _complete_meta(self, stem: str, data: bytes, meta: dict) -> dict:
        return dict(meta, cache_format=CACHE_FORMAT, stem=stem, sha256=_sha256(data), size=len(data),
                    created=time.time())

    def store(self, stem: str, data: bytes, meta: dict) -> CacheEntry:
        """Write an entry (CacheError or OSError when the folder cannot take it)."""
        _check_stem(stem)
        self.ensure_ready()
        meta = self._complete_meta(stem, data, meta)
        binary, meta_path = self._paths(stem)
        files.write_atomic(binary, data)
        files.write_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(binary, meta, data)

    def keep_source(self, stem: str, text: str) -> Path:
        """Write ``<stem>.cu`` beside the entry (atomically, never through a link)."""
        _check_stem(stem)
        self.ensure_ready()
        path = self.dir / f"{stem}{SOURCE_SUFFIX}"
        files.write_atomic(path, text.encode())
        return path

    # ------------------------------------------------------------------ locks
    def _file_lock(self, stem: str) -> filelock.FileLock:
        _check_stem(stem)
        self.ensure_ready()
        path = self._lock_path(stem)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.lstat(path).st_mode):  # never ours: filelock would refuse it (O_NOFOLLOW)
                files.unlink_quietly(path)
        return filelock.FileLock(str(path), mode=files.PRIVATE_FILE_MODE)

    @contextlib.contextmanager
    def lock(self, stem: str) -> Iterator[None]:
        with self._file_lock(stem):
            yield

    @contextlib.contextmanager
    def try_lock(self, stem: str) -> Iterator[bool]:
        """Like ``lock`` but never waits: yields False when another process holds the stem's lock."""
        lock = self._file_lock(stem)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def get_or_build(self, stem: str, build: Callable[[], tuple[bytes, dict]], *,
                     must_store: bool = False) -> tuple[CacheEntry, bool]:
        """(entry, built): load the entry or build it once across processes. When the folder cannot be
        used, the built entry is returned from memory (one warning per process), or, with ``must_store``,
        a CacheError is raised. Errors of ``build`` itself propagate unchanged."""
        with contextlib.ExitStack() as held:
            try:
                entry = self.load(stem)
                if entry is None:
                    held.enter_context(self.lock(stem))
                    entry = self.load(stem)  # another process may have built it while we waited
            except (CacheError, OSError) as exc:
                if must_store:
                    raise _as_cache_error(self.root, exc) from exc
                return self._in_memory(stem, *build(), exc), True
            if entry is not None:
                return entry, False
            data, meta = build()
            try:
                return self.store(stem, data, meta), True
            except (CacheError, OSError) as exc:
                if must_store:
                    raise _as_cache_error(self.root, exc) from exc
                return self._in_memory(stem, data, meta, exc), True

    def _in_memory(self, stem: str, data: bytes, meta: dict, reason: BaseException) -> CacheEntry:
        _warn_memory_only(self.root, reason)
        return CacheEntry(None, self._complete_meta(stem, data, meta), data)

    # ------------------------------------------------------------------ listing and removal
    def _own_names(self) -> list[str]:
        return sorted(os.listdir(self.dir)) if self._readable() else []

    def remove(self, stem: str) -> None:
        _check_stem(stem)
        for path in self._paths(stem):
            files.unlink_quietly(path)

    def entries(self) -> list[CacheEntry]:
        """Every verified entry (without its bytes). Corrupt entries are removed on the way."""
        found = []
        for name in self._own_names():
            match = _OWN_FILE_RE.fullmatch(name)
            # Only metadata omnicupy wrote: load() removes what it cannot use, and a user's notes.json stays.
            if match and match.group("suffix") == META_SUFFIX and _looks_like_our_meta(self.dir / name,
                                                                                        match.group("stem")):
                entry = self.load(match.group("stem"))
                if entry is not None:
                    found.append(dataclasses.replace(entry, data=None))
        return found

    def clear(self, older_than_seconds: Optional[float] = None) -> int:
        """Remove entries (all, or those created more than ``older_than_seconds`` ago). Returns the count."""
        now = time.time()
        removed = 0
        # Only stems whose metadata omnicupy wrote: a user's notes.json in the folder stays.
        stems = {m.group("stem") for m in map(_OWN_FILE_RE.fullmatch, self._own_names())
                 if m and m.group("suffix") == META_SUFFIX and _looks_like_our_meta(self.dir / m.group(0), m.group("stem"))}
        for stem in sorted(stems):
            if older_than_seconds is not None:
                entry = self.load(stem)
                if entry is not None and now - entry.created <= older_than_seconds:
                    continue
            self.remove(stem)
            removed += 1
        return removed

    def remove_leftovers(self) -> int:
        """Remove what belongs to no complete entry: temporaries of interrupted writes, a binary whose
        metadata never landed, kept sources of removed entries, unused lock files. A stem whose lock is
        held (a build in progress) is left alone. Returns how many files were removed (locks not counted)."""
        names = self._own_names()
        if not names:
            return 0
        owned = [(n, _OWN_FILE_RE.fullmatch(n)) for n in names]
        complete = ({m.group("stem") for n, m in owned if m and m.group("suffix") == BINARY_SUFFIX}
                    & {m.group("stem") for n, m in owned if m and m.group("suffix") == META_SUFFIX})
        orphans: dict[str, list[Path]] = {}
        for name, match in owned:
            temporary = _TEMPORARY_RE.fullmatch(name)
            if temporary and temporary.group("stem") != "CACHEDIR":
                orphans.setdefault(temporary.group("stem"), []).append(self.dir / name)
            elif match and match.group("stem") not in complete:
                orphans.setdefault(match.group("stem"), []).append(self.dir / name)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.lock_dir):
                match = _LOCK_RE.fullmatch(name)
                if match and match.group("stem") not in complete:
                    orphans.setdefault(match.group("stem"), [])
        removed = 0
        for stem, paths in sorted(orphans.items()):
            with self.try_lock(stem) as free:
                if not free:
                    continue
                removed += sum(files.unlink_quietly(path) for path in paths)
                files.unlink_quietly(self._lock_path(stem))  # a waiter holding the old file retries (filelock)
        return removed

    def other_formats(self) -> list[Path]:
        """Folders named like other cache formats under the root (``v<digits>``, not links)."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for entry in os.scandir(self.root):
            other = re.fullmatch(r"v\d+", entry.name) and entry.name != self.dir.name
            if other and entry.is_dir(follow_symlinks=False):
                found.append(Path(entry.path))
        return sorted(found)

    def remove_other_formats(self) -> int:
        """Delete the ``other_formats`` folders that hold nothing but omnicupy cache files. Returns how
        many; the others stay (``other_formats`` still lists them)."""
        removed = 0
        for folder in self.other_formats():
            if _written_by_omnicupy(folder):
                shutil.rmtree(folder, ignore_errors=True)  # never follows links inside the folder
                removed += not os.path.lexists(folder)
        return removed


def _looks_like_our_meta(path: Path, stem: str) -> bool:
    """Metadata of any format: an object naming the stem, with a sha256."""
    try:
        meta = _parse_json(files.read_private(path, META_LIMIT))
    except (FileNotFoundError, files.UntrustedFile, OSError):
        return False
    return isinstance(meta, dict) and meta.get("stem") == stem and isinstance(meta.get("sha256"), str)


def _written_by_omnicupy(folder: Path) -> bool:
    """Whether every file in ``folder`` is recognisably an omnicupy cache file: in a tagged folder,
    names of ours; in an untagged one (format 1), entries whose metadata names them, their binaries
    and sources, temporaries and empty lock files."""
    try:
        files.check_folder(folder, follow=False)
    except CacheError:
        return False
    try:
        tag = files.read_private(folder / TAG_NAME, 4096)
        tagged = tag.startswith(_TAG_SIGNATURE) and b"omnicupy" in tag
    except (FileNotFoundError, files.UntrustedFile):
        tagged = False
    for entry in os.scandir(folder):
        if entry.name == "locks" and entry.is_dir(follow_symlinks=False):
            for lock in os.scandir(entry.path):
                st = lock.stat(follow_symlinks=False)
                if not (_LOCK_RE.fullmatch(lock.name) and stat.S_ISREG(st.st_mode) and (tagged or st.st_size == 0)):
                    return False
            continue
        if not entry.is_file(follow_symlinks=False):
            return False
        if (entry.name == TAG_NAME and tagged) or _TEMPORARY_RE.fullmatch(entry.name):
            continue
        match = _OWN_FILE_RE.fullmatch(entry.name)
        if match is None:
            return False
        if not tagged and not _looks_like_our_meta(folder / f"{match.group('stem')}{META_SUFFIX}", match.group("stem")):
            return False
    return True
