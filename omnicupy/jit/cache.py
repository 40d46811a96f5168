"""On-disk cache of compiled binaries. Knows files, locks and checksums; nothing of CUDA.

Layout: ``<root>/v<FORMAT>/<stem>.cubin`` with ``<stem>.json`` beside it (metadata and the
cubin's sha256). Writes go to a temporary file and are renamed into place, the binary before the
metadata, so a reader sees a complete entry or none. A per-stem lock with a re-check after it is
taken keeps two processes from compiling the same entry twice. An entry whose checksum does not
match is deleted and rebuilt, never loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

CACHE_FORMAT = 1
BINARY_SUFFIX = ".cubin"
_TEMPORARY_RE = re.compile(r"^\.(?P<stem>.+)\.(?:cubin|json)\.[^.]+\.tmp$")  # names made by _atomic_write


@dataclass(frozen=True)
class CacheEntry:
    binary_path: Path
    meta: dict

    @property
    def stem(self) -> str:
        return self.binary_path.stem

    @property
    def size(self) -> int:
        return int(self.meta.get("size", 0))

    @property
    def created(self) -> float:
        return float(self.meta.get("created", 0.0))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class DiskCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.dir = self.root / f"v{CACHE_FORMAT}"

    def _paths(self, stem: str) -> tuple[Path, Path]:
        return self.dir / f"{stem}{BINARY_SUFFIX}", self.dir / f"{stem}.json"

    def _lock_path(self, stem: str) -> Path:
        lock_dir = self.dir / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        return lock_dir / f"{stem}.lock"

    @contextlib.contextmanager
    def lock(self, stem: str) -> Iterator[None]:
        with open(self._lock_path(stem), "a+") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def load(self, stem: str) -> Optional[CacheEntry]:
        """The verified entry, or None (absent, incomplete or corrupt; corrupt entries are removed)."""
        binary, meta_path = self._paths(stem)
        try:
            meta = json.loads(meta_path.read_text())
            data = binary.read_bytes()
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            if meta_path.exists():
                self.remove(stem)
            return None
        if meta.get("sha256") != _sha256(data) or meta.get("size") != len(data):
            self.remove(stem)
            return None
        return CacheEntry(binary, meta)

    def store(self, stem: str, data: bytes, meta: dict) -> CacheEntry:
        self.dir.mkdir(parents=True, exist_ok=True)
        binary, meta_path = self._paths(stem)
        meta = dict(meta, sha256=_sha256(data), size=len(data), created=time.time(), stem=stem)
        _atomic_write(binary, data)
        _atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        return CacheEntry(binary, meta)

    @contextlib.contextmanager
    def try_lock(self, stem: str) -> Iterator[bool]:
        """Like ``lock`` but never waits: yields False when another process holds the stem's lock."""
        with open(self._lock_path(stem), "a+") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def get_or_build(self, stem: str, build: Callable[[], tuple[bytes, dict]]) -> tuple[CacheEntry, bool]:
        """(entry, built): load the entry or build it once across processes."""
        entry = self.load(stem)
        if entry is not None:
            return entry, False
        with self.lock(stem):
            entry = self.load(stem)  # another process may have built it while we waited
            if entry is not None:
                return entry, False
            data, meta = build()
            return self.store(stem, data, meta), True

    def remove(self, stem: str) -> None:
        for path in self._paths(stem):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def entries(self) -> list[CacheEntry]:
        found = []
        if not self.dir.is_dir():
            return found
        for meta_path in sorted(self.dir.glob("*.json")):
            entry = self.load(meta_path.stem)
            if entry is not None:
                found.append(entry)
        return found

    def clear(self, older_than_seconds: Optional[float] = None) -> int:
        """Remove entries (all, or those created more than ``older_than_seconds`` ago). Returns the count."""
        now = time.time()
        removed = 0
        if not self.dir.is_dir():
            return 0
        stems = {p.stem for p in self.dir.glob(f"*{BINARY_SUFFIX}")} | {p.stem for p in self.dir.glob("*.json")}
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
        metadata never landed, files kept beside removed entries (rendered sources), unused lock files.
        A stem whose lock is held (a build in progress) is left alone. Returns how many files were removed
        (lock files not counted)."""
        if not self.dir.is_dir():
            return 0
        complete = {p.stem for p in self.dir.glob(f"*{BINARY_SUFFIX}")} & {p.stem for p in self.dir.glob("*.json")}
        orphans: dict[str, list[Path]] = {}
        for path in self.dir.iterdir():
            if not path.is_file():
                continue
            temporary = _TEMPORARY_RE.match(path.name)
            stem = temporary.group("stem") if temporary else path.name.split(".", 1)[0]
            if temporary or stem not in complete:
                orphans.setdefault(stem, []).append(path)
        lock_dir = self.dir / "locks"
        if lock_dir.is_dir():
            for lock_path in lock_dir.glob("*.lock"):
                if lock_path.stem not in complete:
                    orphans.setdefault(lock_path.stem, [])
        removed = 0
        for stem, paths in sorted(orphans.items()):
            with self.try_lock(stem) as free:
                if not free:
                    continue
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        removed += 1
                with contextlib.suppress(FileNotFoundError):
                    self._lock_path(stem).unlink()  # unlinked while held: a waiter still holds the old file
        return removed

    def other_formats(self) -> list[Path]:
        """Folders of other cache formats under the root (left by other omnicupy versions)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name) and p != self.dir)

    def remove_other_formats(self) -> int:
        """Delete the folders ``other_formats`` lists. Returns how many."""
        folders = self.other_formats()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        return len(folders)
