"""``omnicupy info``: versions, GPUs and the arch kernels are built for, the cache, and every
``OMNICUPY_*`` variable with a verdict. Exit status 1 when something is misconfigured (an invalid
variable, a cache folder omnicupy refuses); no GPU is not a misconfiguration."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from .. import arrays, jit
from .._version import __version__
from ..errors import CacheError, OmnicupyError
from ..jit import env
from ..jit.compiler import nvrtc_version, supported_archs
from .common import cache_dir_option, first_line, human_bytes


def _package_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> list[tuple[str, str]]:
    import numpy

    rows = [("omnicupy", f"{__version__} ({Path(jit.__file__).resolve().parents[1]})"),
            ("python", sys.version.split()[0]), ("numpy", numpy.__version__)]
    cp = arrays.cupy_module()
    rows.append(("cupy", cp.__version__ if cp is not None else "not installed"))
    rows.append(("filelock", _package_version("filelock")))
    try:
        known = ", ".join(f"sm_{a}" for a in supported_archs() if a >= jit.MIN_ARCH)
        rows.append(("nvrtc", f"{'.'.join(map(str, nvrtc_version()))} (compiles for {known})"))
    except OmnicupyError as exc:
        rows.append(("nvrtc", f"not available: {first_line(exc)}"))
    driver = "none"
    if cp is not None:
        with contextlib.suppress(Exception):  # no libcuda, or a driver too old for this CuPy
            version = cp.cuda.runtime.driverGetVersion()
            driver = f"{version // 1000}.{version % 1000 // 10}" if version else "none"
    rows.append(("driver", driver))
    return rows


def _devices() -> list[tuple[str, str]]:
    if not arrays.gpu_available():
        return [("device", "none (no usable NVIDIA GPU)")]
    cp = arrays.cupy_module()
    rows = []
    for i in range(cp.cuda.runtime.getDeviceCount()):
        props = cp.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        try:
            arch = f"kernels for {jit.device_arch(i)}"
        except OmnicupyError as exc:
            arch = f"unsupported: {first_line(exc)}"
        rows.append((f"device {i}", f"{name}, compute capability {props['major']}.{props['minor']}, "
                                    f"{human_bytes(props['totalGlobalMem'])}, {arch}"))
    return rows


def _cache() -> tuple[tuple[str, str], bool]:
    """(row, usable)."""
    try:
        cache = jit.default_cache()
    except OmnicupyError as exc:  # OMNICUPY_CACHE_DIR itself is unreadable
        return ("cache", f"unusable: {first_line(exc)}"), False
    try:
        entries = cache.entries()
        old = cache.other_formats()
    except (CacheError, OSError) as exc:
        return ("cache", f"{cache.root} (refused: {first_line(exc)})"), False
    extra = f"; {len(old)} folder(s) of other cache formats" if old else ""
    size = human_bytes(sum(e.size for e in entries))
    return ("cache", f"{cache.root} ({len(entries)} variants, {size}{extra})"), True


def _environment() -> tuple[tuple[str, str], bool]:
    checked = env.check_environment()
    if not checked:
        return ("environment", "no OMNICUPY_ variables set"), True
    parts = [f"{name}={value}" + (f" (INVALID: {problem})" if problem else "") for name, value, problem in checked]
    return ("environment", "; ".join(parts)), not any(problem for _, _, problem in checked)


def run(args: argparse.Namespace) -> int:
    cache_row, cache_ok = _cache()
    env_row, env_ok = _environment()
    rows = _versions() + _devices() + [cache_row, env_row]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0 if cache_ok and env_ok else 1


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("info", parents=[cache_dir_option()], help="versions, GPU, arch, cache and settings",
                        description="Print the omnicupy, CuPy, NVRTC and driver versions, the GPUs and the arch "
                                    "kernels are compiled for, the cache folder with its number of variants, and "
                                    "the OMNICUPY_ variables (invalid values are flagged).",
                        epilog="Exit status 1 when a variable is invalid or the cache folder is refused."
                        ).set_defaults(func=run)
