"""What every command shares: argument types, the usage error, human-readable sizes, ages and
durations, and the ``--cache-dir`` option. Knows argparse and formatting; no command logic."""
from __future__ import annotations

import argparse
import logging
import os
from typing import Callable, Sequence

from ..jit import env
from ..errors import ArgumentError, InternalError

log = logging.getLogger("omnicupy.cli")

#: What ``precompile`` builds for when there is no GPU to ask (a build box, a container image).
NO_GPU_ARCHS = ("sm_80", "sm_90")
#: Parallel compiles by default: one per CPU, at most this many (polite on shared login nodes; a
#: compile peaks near 150 MB).
MAX_DEFAULT_JOBS = 8


class UsageError(ArgumentError):
    """Arguments that parse but make no sense here (exit status 2)."""


# ----------------------------------------------------------------------------- argument types
def comma_list(convert: Callable, allowed: Sequence, what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        values = []
        for item in (t.strip() for t in text.split(",")):
            try:
                value = convert(item)
            except ValueError:
                value = None
            if value not in allowed:
                choices = ", ".join(map(str, allowed))
                raise argparse.ArgumentTypeError(f"{what} {item!r} is not supported (choose from {choices})")
            if value not in values:
                values.append(value)
        return tuple(values)

    return parse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return value


def default_jobs() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_JOBS))


def cache_dir_option() -> argparse.ArgumentParser:
    """``--cache-dir``, accepted before and after the command (a parent parser for every command)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--cache-dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="use this cache folder (sets OMNICUPY_CACHE_DIR for this command)")
    return parent


# ----------------------------------------------------------------------------- formatting
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise InternalError("human_bytes: unreachable")


def human_age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def human_duration(seconds: float) -> str:
    """'8 s', '2 min 05 s', '1 h 02 min'."""
    seconds = int(round(max(seconds, 0.0)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def brief(error: str) -> str:
    """The first line of an error, plus the compiler's first error line when it carries a log."""
    lines = error.strip().splitlines() or ["unknown error"]
    detail = next((line.strip() for line in lines[1:] if "error" in line.lower()), "")
    return f"{lines[0]} {detail}".strip()


def verbose() -> bool:
    try:
        return env.verbose()
    except ValueError:
        return False
