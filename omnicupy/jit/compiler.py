"""NVRTC: CUDA source -> cubin for an explicit arch. Needs no GPU. Knows nothing of attention."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import CompileError


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # noqa: BLE001
        raise CompileError(
            "NVRTC is not available: install CuPy with its NVRTC wheel "
            "(pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]')"
        ) from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    return tuple(int(a) for a in _nvrtc().getSupportedArchs())


def normalize_arch(arch: str | int) -> str:
    """'sm_90', '90', 90 or 'sm_90a' -> 'sm_90' / 'sm_90a'."""
    text = str(arch).strip().lower()
    match = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})(a?)", text)
    if not match:
        raise ValueError(f"arch {arch!r} is not of the form sm_80, sm_90, sm_90a")
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


_REG_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


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
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed to compile {name} for {arch} ({exc}).\noptions: {' '.join(options)}\n{log}") from None
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    regs = _REG_RE.search(log)
    spills = _SPILL_RE.search(log)
    return CompileResult(
        cubin=bytes(cubin),
        log=log,
        registers=int(regs.group(1)) if regs else None,
        spill_bytes=(int(spills.group(1)) + int(spills.group(2))) if spills else None,
        options=options,
    )
