"""File operations the kernel cache trusts: owned private folders, reads that never follow a link,
atomic writes. Knows POSIX ownership and modes; nothing of caches, CUDA or attention.

A folder is trusted when it is owned by the current user (or by root, who can replace any file on
the machine anyway) and nobody else can write to it. Files are opened with ``O_NOFOLLOW`` and checked
on the open descriptor (a regular file, trusted owner), so what is read is what was checked. On a
platform without ``os.geteuid`` (Windows) ownership and modes are not checked.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from ..errors import CacheError

#: open() flags that refuse to follow a symbolic link in the last path component (0 where unknown).
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted under a file's name must not block the open

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def checks_ownership() -> bool:
    return hasattr(os, "geteuid")


def trusted_owners() -> frozenset[int]:
    return frozenset({os.geteuid(), 0}) if checks_ownership() else frozenset()


def _describe_owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_folder(path: Path, *, follow: bool, what: str = "kernel cache folder") -> None:
    """Raise CacheError unless ``path`` is a folder owned by a trusted user and writable by nobody else.
    ``follow=False`` also refuses a symbolic link (folders the cache made itself are never links)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        raise CacheError(f"cannot use the {what} {path}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise CacheError(f"{what} {path} is a symbolic link; omnicupy makes its own folders and refuses links")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{what} {path} exists and is not a folder")
    if not checks_ownership():
        return
    if st.st_uid not in trusted_owners():
        raise CacheError(f"{what} {path} belongs to {_describe_owner(st.st_uid)}, not to you: omnicupy does not load "
                         f"kernels that another user can replace (choose your own folder with OMNICUPY_CACHE_DIR)")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise CacheError(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                         f"omnicupy does not load kernels that another user can replace (chmod go-w {path})")


def make_private_folders(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0700 (set exactly, whatever the umask).
    Existing folders are left as they are."""
    missing = []
    current = Path(os.path.abspath(path))
    while not os.path.lexists(current):
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made by a concurrent process: check_folder decides whether it is usable
        with contextlib.suppress(OSError):
            os.chmod(folder, PRIVATE_DIR_MODE)


def read_private(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, opened without following links, after checking on the open descriptor
    that it is a regular file of a trusted owner and at most ``limit`` bytes. FileNotFoundError when
    absent; UntrustedFile for anything else that makes it unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | _CLOEXEC | _NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link; EACCES...
        raise UntrustedFile(f"{path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{path} is not a regular file")
        if checks_ownership() and st.st_uid not in trusted_owners():
            raise UntrustedFile(f"{path} belongs to {_describe_owner(st.st_uid)}")
        if checks_ownership() and st.st_mode & _WRITABLE_BY_OTHERS:  # another user could have replaced its bytes
            raise UntrustedFile(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_size > limit:
            raise UntrustedFile(f"{path} is larger than {limit} bytes")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UntrustedFile(f"{path} is larger than {limit} bytes")
    return data


class UntrustedFile(Exception):
    """A file that exists but must not be used (a link, not a regular file, another owner, too large)."""


def temporary_name(name: str) -> str:
    """``.<name>.<random hex>.tmp``: where ``write_atomic`` stages ``name`` (``is_temporary`` knows it)."""
    return f".{name}.{secrets.token_hex(6)}.tmp"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a new private temporary file beside ``path`` (created exclusively, never through
    a link), flush it to disk and rename it over ``path``. A reader sees the old file or the new one."""
    tmp = path.parent / temporary_name(path.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | _CLOEXEC, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def unlink_quietly(path: Path) -> bool:
    """Remove a file (or a link, never its target). True when something was removed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
