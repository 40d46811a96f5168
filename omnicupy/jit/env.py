"""Paths, environment switches and the package's logging setup, and nothing else.

Every variable starts with ``OMNICUPY_``; booleans are parsed by ``env_flag`` alone, choices by
``_choice``; ``check_environment`` reports every set variable that would be refused (``omnicupy
info`` prints it). A bad value raises ``ArgumentError`` naming the variable when it is read.

| variable | default | meaning |
| --- | --- | --- |
| OMNICUPY_CACHE_DIR | $XDG_CACHE_HOME/omnicupy or ~/.cache/omnicupy | where compiled kernels live |
| OMNICUPY_KEEP_SOURCE | 0 | keep each rendered .cu beside its cubin |
| OMNICUPY_LINEINFO | 0 | compile with -lineinfo (for ncu / compute-sanitizer source lines) |
| OMNICUPY_VERBOSE | 0 | log compiles, cache hits and cache problems (logger ``omnicupy`` at DEBUG, to stderr) |
| OMNICUPY_MMA | auto | kernel family: auto (on sm_90 tma or wgmma where a tile fits: dispatch/tiles.py auto_picks_tma), sync, wgmma, tma (sm_90: TMA producer + wgmma consumers) |
| OMNICUPY_BWD | auto | backward kernel family: auto (dispatch/tiles.py WGMMA_BWD_AUTO_HEAD_DIMS on sm_90, else mma.sync; OMNICUPY_MMA=sync forces mma.sync), sync, wgmma (sm_90, where a wgmma backward tile fits; mma.sync elsewhere) |
| OMNICUPY_SCHEDULE | lpt | q tile launch order: lpt (heaviest first, from the block mask), natural (last tile first) |
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

from ..errors import ArgumentError

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../omnicupy

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

#: The parent of every logger in the package (``omnicupy.jit``, ``omnicupy.jit.cache``, ``omnicupy.cli``...).
LOGGER_NAME = "omnicupy"


def env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ArgumentError(f"environment variable {name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _choice(name: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if raw not in choices:
        raise ArgumentError(f"environment variable {name}={raw!r} must be one of {choices}")
    return raw


def _bundled_dir(name: str) -> Path:
    """kernels/ and templates/ sit inside the installed package, or at the top of a source tree."""
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"omnicupy: cannot find its {name}/ folder next to {_PACKAGE_DIR}")


def kernels_dir() -> Path:
    return _bundled_dir("kernels")


def templates_dir() -> Path:
    return _bundled_dir("templates")


def cache_dir() -> Path:
    explicit = os.environ.get("OMNICUPY_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omnicupy"


def keep_source() -> bool:
    return env_flag("OMNICUPY_KEEP_SOURCE")


def lineinfo() -> bool:
    return env_flag("OMNICUPY_LINEINFO")


def verbose() -> bool:
    return env_flag("OMNICUPY_VERBOSE")


MMA_CHOICES = ("auto", "sync", "wgmma", "tma")


def mma_family() -> str:
    return _choice("OMNICUPY_MMA", MMA_CHOICES)


BWD_CHOICES = ("auto", "sync", "wgmma")


def backward_family() -> str:
    return _choice("OMNICUPY_BWD", BWD_CHOICES)


SCHEDULE_CHOICES = ("lpt", "natural")


def schedule() -> str:
    return _choice("OMNICUPY_SCHEDULE", SCHEDULE_CHOICES)


def _check_cache_dir() -> None:
    if not os.environ.get("OMNICUPY_CACHE_DIR", "x").strip():
        raise ArgumentError("environment variable OMNICUPY_CACHE_DIR is set but empty (unset it for the default)")


#: Every variable the package reads, with the reader that validates it.
VARIABLES: dict[str, Callable[[], object]] = {
    "OMNICUPY_CACHE_DIR": _check_cache_dir,
    "OMNICUPY_KEEP_SOURCE": keep_source,
    "OMNICUPY_LINEINFO": lineinfo,
    "OMNICUPY_VERBOSE": verbose,
    "OMNICUPY_MMA": mma_family,
    "OMNICUPY_BWD": backward_family,
    "OMNICUPY_SCHEDULE": schedule,
}


def check_all() -> None:
    """Raise ArgumentError for the first set ``OMNICUPY_*`` variable the package reads whose value it
    refuses, so that a bad value is refused wherever kernels are built or loaded, not only where
    that one variable happens to be read."""
    for name, reader in VARIABLES.items():
        if name in os.environ:
            reader()


def check_environment() -> list[tuple[str, str, Optional[str]]]:
    """``(name, value, problem or None)`` for every ``OMNICUPY_*`` variable that is set; a name the
    package does not read is a problem too (a typo would otherwise be silently ignored)."""
    rows = []
    for name, value in sorted(os.environ.items()):
        if not name.startswith("OMNICUPY_"):
            continue
        problem = None
        reader = VARIABLES.get(name)
        if reader is None:
            problem = f"unknown variable (omnicupy reads {', '.join(VARIABLES)})"
        else:
            try:
                reader()
            except ArgumentError as exc:
                problem = str(exc)
        rows.append((name, value, problem))
    return rows


_HANDLER_NAME = "omnicupy-verbose"


def configure_logging() -> None:
    """``OMNICUPY_VERBOSE=1``: the ``omnicupy`` logger logs at DEBUG, to stderr unless the application
    has configured logging itself. Otherwise nothing is configured: warnings reach stderr through
    Python's last-resort handler, and an application's own logging setup decides everything."""
    try:
        on = verbose()
    except ArgumentError:
        on = False  # an invalid value is reported by `omnicupy info`; importing must not fail over it
    logger = logging.getLogger(LOGGER_NAME)
    if not on:
        return
    logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers() and not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)
