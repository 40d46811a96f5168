"""NVRTC: CUDA source -> cubin for an explicit arch. Needs no GPU. Knows nothing of attention.

NVRTC is reached through CuPy's bindings, ``cupy_backends.cuda.libs.nvrtc``: CuPy ships and loads
the NVRTC library we compile with, and ``cupy.cuda.compiler`` cannot target an arch without asking
a driver. That module is not a public CuPy interface, so it is checked before use: the functions we
call must be there (checked against CuPy 13 and 14), otherwise a CompileError names the CuPy
version; a CuPy major outside the checked range is logged once at DEBUG.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

from ..errors import ArgumentError, CompileError

_log = logging.getLogger(__name__)

#: CuPy majors whose private NVRTC bindings were checked to offer what ``compile_cubin`` calls.
CHECKED_CUPY_MAJORS = (13, 14)
_NVRTC_FUNCTIONS = ("getVersion", "getSupportedArchs", "createProgram", "compileProgram", "getProgramLog",
                    "getCUBIN", "destroyProgram", "NVRTCError")
_INSTALL_HINT = "pip install 'omnicupy[cuda12]' (or 'omnicupy[cuda13]' on a CUDA 13 driver stack)"


def _cupy_version() -> str:
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable CuPy"
        raise CompileError(f"NVRTC is not available: CuPy does not import ({exc}); {_INSTALL_HINT}") from exc
    return str(getattr(cupy, "__version__", "unknown"))


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ModuleType:
    version = _cupy_version()
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # noqa: BLE001
        raise CompileError(
            f"CuPy {version} has no usable cupy_backends.cuda.libs.nvrtc, through which omnicupy reaches NVRTC "
            f"(checked with CuPy {', '.join(map(str, CHECKED_CUPY_MAJORS))}): {exc}; {_INSTALL_HINT}") from exc
    missing = [name for name in _NVRTC_FUNCTIONS if not hasattr(nvrtc, name)]
    if missing:
        raise CompileError(
            f"CuPy {version}'s NVRTC bindings (cupy_backends.cuda.libs.nvrtc) lack {', '.join(missing)}: this CuPy "
            f"changed a private interface omnicupy uses (checked with CuPy "
            f"{', '.join(map(str, CHECKED_CUPY_MAJORS))}); install a CuPy of those versions")
    major = re.match(r"\d+", version)
    if major is None or int(major.group()) not in CHECKED_CUPY_MAJORS:
        _log.debug("CuPy %s: NVRTC bindings not checked with this version (checked: %s)", version, CHECKED_CUPY_MAJORS)
    return nvrtc


def _call(what: str, function, *args):
    """Call a binding; a changed signature or a missing NVRTC library becomes a CompileError."""
    try:
        return function(*args)
    except (TypeError, AttributeError) as exc:
        raise CompileError(f"CuPy {_cupy_version()}'s NVRTC binding {what} did not accept omnicupy's call ({exc}); "
                           f"checked with CuPy {', '.join(map(str, CHECKED_CUPY_MAJORS))}") from exc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        return tuple(_call("getVersion", nvrtc.getVersion))
    except CompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - the NVRTC library itself could not be loaded
        raise CompileError(f"CuPy {_cupy_version()} could not load the NVRTC library ({exc}); {_INSTALL_HINT}") from exc


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    nvrtc_version()  # loads the library, with its error message
    return tuple(int(a) for a in _call("getSupportedArchs", _nvrtc().getSupportedArchs))


def normalize_arch(arch: str | int) -> str:
    """'sm_90', '90', 90 or 'sm_90a' -> 'sm_90' / 'sm_90a'."""
    text = str(arch).strip().lower()
    match = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})(a?)", text)
    if not match:
        raise ArgumentError(f"arch {arch!r} is not of the form sm_80, sm_90, sm_90a")
    return f"sm_{match.group(1)}{match.group(2)}"


def arch_number(arch: str) -> int:
    return int(re.sub(r"\D", "", normalize_arch(arch)))


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    registers: int | None
    spill_bytes: int | None  # spill stores + loads reported by ptxas
    options: tuple[str, ...]


#: ptxas -v's report of one entry function: its name, spills, then registers.
_ENTRY_RE = re.compile(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores, (\d+) bytes spill loads"
                       r"\n.*?Used (\d+) registers")


def entry_reports(log: str) -> dict[str, tuple[int, int]]:
    """{entry function: (registers, spill bytes)} from a ptxas -v log."""
    return {m.group(1): (int(m.group(4)), int(m.group(2)) + int(m.group(3))) for m in _ENTRY_RE.finditer(log)}


def _named_report(log: str, name: str) -> tuple[Optional[int], Optional[int]]:
    """(registers, spill bytes) of the entry ``name`` (the variant's kernel), else the most of any entry
    (a module whose entries all carry suffixes): a module of several entry points (the backward's
    preprocess, main and conversion) lists them in no fixed order, and the first one is not the one
    that matters."""
    reports = entry_reports(log)
    if name in reports:
        return reports[name]
    if not reports:
        return None, None
    return max(r for r, _ in reports.values()), max(s for _, s in reports.values())


def compile_cubin(
    source: str,
    *,
    name: str,
    arch: str,
    include_dirs: Sequence[Path] = (),
    extra_options: Sequence[str] = (),
) -> CompileResult:
    """Compile ``source`` to a cubin for ``arch``. Raises CompileError carrying the NVRTC log."""
    nvrtc = _nvrtc()
    arch = normalize_arch(arch)
    if arch_number(arch) not in supported_archs():
        raise CompileError(
            f"{name}: NVRTC {'.'.join(map(str, nvrtc_version()))} cannot compile for {arch} "
            f"(supported: {', '.join(f'sm_{a}' for a in supported_archs())})"
        )
    options = (
        f"-arch={arch}",
        "-std=c++17",
        "--ptxas-options=-v",  # registers and spills into the log, recorded with the cache entry
        *(f"-I{d}" for d in include_dirs),
        *extra_options,
    )
    prog = _call("createProgram", nvrtc.createProgram, source, f"{name}.cu", [], [])
    try:
        try:
            _call("compileProgram", nvrtc.compileProgram, prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed to compile {name} for {arch} ({exc}).\noptions: {' '.join(options)}\n{log}") from None
        log = _call("getProgramLog", nvrtc.getProgramLog, prog)
        cubin = _call("getCUBIN", nvrtc.getCUBIN, prog)
    finally:
        nvrtc.destroyProgram(prog)
    registers, spill_bytes = _named_report(log, name)
    return CompileResult(
        cubin=bytes(cubin),
        log=log,
        registers=registers,
        spill_bytes=spill_bytes,
        options=options,
    )
