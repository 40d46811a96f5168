"""One description of a kernel's parameters, from which both sides are made.

A kernel takes one ``Params`` struct by value (``const __grid_constant__ FwdParams p``). Its fields
are declared once, here in Python, as a ``ParamStruct``: ``cpp()`` renders the C++ struct (with a
static_assert of its size and alignment, so NVRTC refuses a kernel whose struct disagrees with
Python's), and ``pack(values)`` lays out the launch bytes by field name, following the same C
layout rules (each field at a multiple of its alignment, the size rounded up to the largest).
NVRTC has no offsetof; ``probe_kernel`` renders a kernel whose PTX shows every field's offset,
which tests/cpu/test_abi.py compares with Python's for every operation's struct.

This module knows C layout and nothing of attention; the structs themselves are in params.py.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import OmnicupyError


class AbiError(OmnicupyError, TypeError):
    """A parameter value that does not fit its declared field (a bug in omnicupy, not in the call)."""


#: Scalar kinds: (C spelling, struct format character, size = alignment in bytes).
KINDS = {
    "i32": ("int", "i", 4),
    "u32": ("unsigned int", "I", 4),
    "i64": ("long long", "q", 8),
    "f32": ("float", "f", 4),
    "ptr": (None, "Q", 8),  # the C type of a pointer field is given per field
    # An opaque 128-byte blob aligned to 64 bytes: a TMA tensor map (CUtensorMap), encoded by the
    # driver on the host and only ever read by TMA instructions. Packed from 128 bytes (or None: zeros).
    "tmap": ("TmaDesc", "128s", 128),
}
#: Alignment of kinds whose alignment is not their size.
ALIGNMENTS = {"tmap": 64}
#: The C declaration of opaque kinds, for code that has no kernels/ header (the ABI probe).
OPAQUE_DECLS = {"tmap": "struct __align__(64) TmaDesc { unsigned long long raw[16]; };"}


@dataclass(frozen=True)
class Param:
    """One field. ``kind`` is a key of KINDS; a ``ptr`` field names its C type (``"const u16*"``);
    ``count`` > 1 makes a fixed-size array."""

    name: str
    kind: str
    ctype: str = ""
    count: int = 1
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AbiError(f"{self.name}: kind {self.kind!r} is not one of {sorted(KINDS)}")
        if (self.kind == "ptr") != bool(self.ctype):
            raise AbiError(f"{self.name}: pointer fields (and only they) give their C type")
        if self.count < 1:
            raise AbiError(f"{self.name}: count must be >= 1")

    @property
    def size(self) -> int:
        return KINDS[self.kind][2]

    @property
    def align(self) -> int:
        return ALIGNMENTS.get(self.kind, self.size)

    @property
    def c_type(self) -> str:
        return self.ctype or KINDS[self.kind][0]


@dataclass(frozen=True)
class ParamStruct:
    """A kernel's parameter struct: its C++ name and fields in declaration order."""

    name: str
    params: tuple[Param, ...]
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _size: int = field(init=False, repr=False, compare=False)
    _packer: struct.Struct = field(init=False, repr=False, compare=False)
    _dtype: np.dtype = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise AbiError(f"{self.name}: duplicate field names")
        offsets, at, fmt = [], 0, ["<"]
        for p in self.params:
            pad = -at % p.align  # each field at a multiple of its own alignment
            fmt.append("x" * pad + KINDS[p.kind][1] * p.count)
            at += pad
            offsets.append(at)
            at += p.size * p.count
        align = max((p.align for p in self.params), default=1)
        size = at + (-at % align)
        fmt.append("x" * (size - at))
        object.__setattr__(self, "_offsets", tuple(offsets))
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_packer", struct.Struct("".join(fmt)))
        # An opaque record of the struct's bytes: what CuPy passes by value as one kernel argument.
        object.__setattr__(self, "_dtype", np.dtype((np.void, size)))

    # ------------------------------------------------------------------ layout
    @property
    def size(self) -> int:
        return self._size

    @property
    def record_dtype(self) -> np.dtype:
        """The opaque NumPy record (``V<size>``) CuPy passes by value as one kernel argument."""
        return self._dtype

    def offset(self, name: str) -> int:
        return self._offsets[[p.name for p in self.params].index(name)]

    def layout(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes) of every field, in order."""
        return [(p.name, off, p.size * p.count) for p, off in zip(self.params, self._offsets)]

    # -------------------------------------------------------------------- C++
    def cpp(self) -> str:
        """The struct declaration plus static_asserts of its layout."""
        width = max(len(f"{p.c_type} {p.name}" + (f"[{p.count}]" if p.count > 1 else "")) for p in self.params)
        lines = [f"// Rendered from {self.name} in omnicupy (dispatch/abi.py); edit it there, not here.",
                 f"struct {self.name} {{"]
        for p in self.params:
            decl = f"{p.c_type} {p.name}" + (f"[{p.count}]" if p.count > 1 else "") + ";"
            lines.append((f"  {decl.ljust(width + 1)}" + (f"  // {p.doc}" if p.doc else "")).rstrip())
        lines.append("};")
        align = max(p.align for p in self.params)
        lines.append(f"static_assert(sizeof({self.name}) == {self._size} && alignof({self.name}) == {align}, "
                     f'"{self.name}: size or alignment differs from Python\'s");')
        return "\n".join(lines)

    def probe_kernel(self, name: str) -> str:
        """CUDA source of a kernel that reads every field once, in order, into ``out``. NVRTC has no
        offsetof, so the field offsets are proved from the PTX of this kernel instead: each field
        is one ``ld.param`` at ``[<param>+offset]`` (tests/cpu/test_abi.py)."""
        reads = []
        for p in self.params:
            for i in range(p.count):
                field = f"p.{p.name}" + (f"[{i}]" if p.count > 1 else "")
                cast = "(unsigned long long)" if p.kind == "ptr" else "(unsigned long long)(long long)"
                if p.kind == "f32":
                    cast = "(unsigned long long)__float_as_uint"
                if p.kind == "tmap":  # the blob's first word: one 8-byte load at the field's offset
                    cast, field = "", f"{field}.raw[0]"
                reads.append(f"  out[{len(reads)}] = {cast}({field});")
        opaque = [OPAQUE_DECLS[k] for k in dict.fromkeys(p.kind for p in self.params) if k in OPAQUE_DECLS]
        return "\n".join([
            "typedef unsigned int u32;", "typedef unsigned short u16;", "typedef long long i64;", *opaque,
            self.cpp(),
            f'extern "C" __global__ void {name}(const __grid_constant__ {self.name} p, unsigned long long* out) {{',
            *reads, "}"])

    # ------------------------------------------------------------------- pack
    def values(self, given: Mapping[str, Any]) -> list:
        """The flat list of numbers, in layout order, for fields given by name (all of them)."""
        if len(given) != len(self.params) or not all(p.name in given for p in self.params):
            missing = [p.name for p in self.params if p.name not in given]
            extra = sorted(set(given) - {p.name for p in self.params})
            raise AbiError(f"{self.name}: missing fields {missing}, unknown fields {extra}")
        flat: list = []
        for p in self.params:
            value = given[p.name]
            if p.count == 1:
                flat.append(_scalar(p.kind, value))
                continue
            items = list(value)
            if len(items) > p.count:
                raise AbiError(f"{self.name}.{p.name}: {len(items)} values for {p.count} slots")
            flat.extend(_scalar(p.kind, v) for v in items)
            flat.extend([bytes(128) if p.kind == "tmap" else 0] * (p.count - len(items)))
        return flat

    def pack(self, given: Mapping[str, Any]) -> np.void:
        """The struct's bytes for the fields given by name, as one kernel argument for CuPy."""
        try:
            raw = self._packer.pack(*self.values(given))
        except struct.error as exc:
            raise AbiError(f"{self.name}: {exc}") from None
        return np.frombuffer(raw, dtype=self._dtype)[0]

    def unpack(self, packed: Any) -> dict[str, Any]:
        """Field values read back from packed bytes (tests, debugging)."""
        flat = list(self._packer.unpack(bytes(packed)))
        out: dict[str, Any] = {}
        for p in self.params:
            items, flat = flat[:p.count], flat[p.count:]
            out[p.name] = items if p.count > 1 else items[0]
        return out


def _scalar(kind: str, value: Any):
    """One slot's number: device pointers from arrays (CuPy, or anything with a data pointer)."""
    if kind == "ptr":
        if value is None:
            return 0
        data = getattr(value, "data", None)
        ptr = getattr(data, "ptr", None)
        return int(value) if ptr is None else int(ptr)
    if kind == "tmap":
        blob = bytes(128) if value is None else bytes(value)
        if len(blob) != 128:
            raise AbiError(f"a tensor map is 128 bytes, got {len(blob)}")
        return blob
    return float(value) if kind == "f32" else int(value)


def struct_of(name: str, params: Sequence[Param]) -> ParamStruct:
    return ParamStruct(name, tuple(params))


__all__ = ["AbiError", "ALIGNMENTS", "KINDS", "OPAQUE_DECLS", "Param", "ParamStruct", "struct_of"]
