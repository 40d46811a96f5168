"""NVRTC: CUDA source -> cubin for an explicit arch. Needs no GPU. Knows nothing of attention.

NVRTC is reached through NVIDIA's supported Python interface, ``cuda.bindings.nvrtc`` (the
cuda-bindings package, in both install extras), which loads the NVRTC library of the installed
CUDA toolkit wheels. CuPy's own elementwise kernels (mask builds) still compile through CuPy; the
cache key records the NVRTC version that compiled each entry (jit/__init__.py ``cache_stem``).
Every NVRTC status other than success becomes a CompileError naming the call.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

from ..errors import ArgumentError, CompileError

_log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'omnicupy[cuda12]' (or 'omnicupy[cuda13]' on a CUDA 13 driver stack)"


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ModuleType:
    try:
        from cuda.bindings import nvrtc
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable bindings"
        raise CompileError(f"NVRTC is not available: cuda.bindings.nvrtc (the cuda-bindings package) does not "
                           f"import ({exc}); {_INSTALL_HINT}") from exc
    return nvrtc


def _call(what: str, function, *args) -> list:
    """Call an NVRTC binding; returns what it returns after its status. A status other than success,
    or a library that cannot be loaded, becomes a CompileError."""
    nvrtc = _nvrtc()
    try:
        status, *rest = function(*args)
    except CompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - the NVRTC library itself could not be loaded or called
        raise CompileError(f"NVRTC call {what} failed ({exc}); {_INSTALL_HINT}") from exc
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise _NvrtcStatus(what, status)
    return rest


class _NvrtcStatus(CompileError):
    """An NVRTC call returned a status other than success (``status``: the nvrtcResult)."""

    def __init__(self, what: str, status: Any) -> None:
        super().__init__(f"NVRTC call {what} returned {getattr(status, 'name', status)}")
        self.status = status


def _bytes_out(what: str, size_function, get_function, prog) -> bytes:
    """A buffer NVRTC fills (log, cubin): ask its size, then let NVRTC write it."""
    (size,) = _call(f"{what}Size", size_function, prog)
    # A bytearray of its own: never ``b" " * size``, which for size 1 (an empty log) is CPython's
    # shared one-byte object, and NVRTC's write would then change every b" " in the process.
    buffer = bytearray(int(size))
    _call(what, get_function, prog, buffer)
    return bytes(buffer)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    major, minor = _call("nvrtcVersion", _nvrtc().nvrtcVersion)
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    nvrtc_version()  # loads the library, with its error message
    (archs,) = _call("nvrtcGetSupportedArchs", _nvrtc().nvrtcGetSupportedArchs)
    return tuple(int(a) for a in archs)


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


def _text(log: bytes) -> str:
    """NVRTC's log: NUL-terminated bytes, as text."""
    return log.rstrip(b"\0").decode("utf-8", errors="replace")


def compile_ptx(source: str, *, name: str, arch: str = "compute_80", options: Sequence[str] = ("-std=c++17",)) -> str:
    """Compile ``source`` to PTX text for a virtual ``arch`` (the parameter-struct probes read their
    offsets from it). Raises CompileError carrying the NVRTC log."""
    nvrtc = _nvrtc()
    (prog,) = _call("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram, source.encode(), f"{name}.cu".encode(), 0, [],
                    [])
    try:
        encoded = [o.encode() for o in (f"-arch={arch}", *options)]
        try:
            _call("nvrtcCompileProgram", nvrtc.nvrtcCompileProgram, prog, len(encoded), encoded)
        except _NvrtcStatus as exc:
            log = _bytes_out("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog)
            raise CompileError(f"NVRTC failed to compile {name} to PTX ({exc.status.name}).\n{_text(log)}") from None
        return _text(_bytes_out("nvrtcGetPTX", nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, prog))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


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
    (prog,) = _call("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram, source.encode(), f"{name}.cu".encode(), 0, [],
                    [])
    try:
        encoded = [o.encode() for o in options]
        try:
            _call("nvrtcCompileProgram", nvrtc.nvrtcCompileProgram, prog, len(encoded), encoded)
        except _NvrtcStatus as exc:
            log = _bytes_out("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog)
            raise CompileError(f"NVRTC failed to compile {name} for {arch} ({exc.status.name}).\noptions: "
                               f"{' '.join(options)}\n{_text(log)}") from None
        log = _text(_bytes_out("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog))
        cubin = _bytes_out("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    registers, spill_bytes = _named_report(log, name)
    return CompileResult(
        cubin=bytes(cubin),
        log=log,
        registers=registers,
        spill_bytes=spill_bytes,
        options=options,
    )
