"""Paths and environment switches, and nothing else.

Every variable starts with ``OMNICUPY_``; booleans are parsed by ``env_flag`` alone.

| variable | default | meaning |
| --- | --- | --- |
| OMNICUPY_CACHE_DIR | $XDG_CACHE_HOME/omnicupy or ~/.cache/omnicupy | where compiled kernels live |
| OMNICUPY_KEEP_SOURCE | 0 | keep each rendered .cu beside its cubin |
| OMNICUPY_LINEINFO | 0 | compile with -lineinfo (for ncu / compute-sanitizer source lines) |
| OMNICUPY_VERBOSE | 0 | log compiles and cache hits to stderr |
| OMNICUPY_MMA | auto | kernel family: auto (wgmma on sm_90 where it applies), sync, wgmma, tma (sm_90: TMA producer + wgmma consumers) |
| OMNICUPY_SCHEDULE | lpt | q tile launch order: lpt (heaviest first, from the block mask), natural (last tile first) |
"""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../omnicupy

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


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
    raw = os.environ.get("OMNICUPY_MMA", "auto").strip().lower() or "auto"
    if raw not in MMA_CHOICES:
        raise ValueError(f"environment variable OMNICUPY_MMA={raw!r} must be one of {MMA_CHOICES}")
    return raw


SCHEDULE_CHOICES = ("lpt", "natural")


def schedule() -> str:
    raw = os.environ.get("OMNICUPY_SCHEDULE", "lpt").strip().lower() or "lpt"
    if raw not in SCHEDULE_CHOICES:
        raise ValueError(f"environment variable OMNICUPY_SCHEDULE={raw!r} must be one of {SCHEDULE_CHOICES}")
    return raw
