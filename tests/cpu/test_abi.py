"""The parameter ABI: Python's layout of every operation's struct is the one NVRTC compiles.

NVRTC has no offsetof, so each struct's offsets are read from the PTX of a probe kernel that loads
every field once (one ``ld.param`` at ``[param+offset]`` per field, in order); its size and
alignment are static_asserts inside every rendered kernel (so every compile in test_compile.py
checks them too). Packing is checked by a round trip and by the bytes at each offset.
"""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from omnicupy.dispatch import params
from omnicupy.dispatch.abi import AbiError, Param, ParamStruct
from omnicupy.jit.compiler import compile_ptx
from omnicupy.mask.types import BlockType, cpp_enum
from omnicupy.jit import env

STRUCTS = sorted(params.STRUCTS.items())


def _ptx(source: str, name: str) -> str:
    return compile_ptx(source, name=name, arch="compute_80")


@pytest.mark.parametrize("operation, struct_", STRUCTS, ids=[op for op, _ in STRUCTS])
def test_struct_offsets_match_ptx(operation, struct_):
    ptx = _ptx(struct_.probe_kernel("abi_probe"), "abi_probe")
    size = int(re.search(r"\.param \.align \d+ \.b8 abi_probe_param_0\[(\d+)\]", ptx).group(1))
    assert size == struct_.size
    # Scalar and vector loads (ptxas may merge neighbouring 32-bit fields into ld.param.v2/v4).
    loads = []
    for m in re.finditer(r"ld\.param(?:\.v(\d))?\.[usfb](\d+)\s+(?:\{[^}]*\}|%\w+), \[abi_probe_param_0(?:\+(\d+))?\]", ptx):
        lanes, bits, base = int(m.group(1) or 1), int(m.group(2)), int(m.group(3) or 0)
        loads += [base + i * bits // 8 for i in range(lanes)]
    want = [off + i * p.size for p, off in zip(struct_.params, struct_._offsets) for i in range(p.count)]
    assert sorted(loads) == sorted(want), f"{operation}: PTX loads at {sorted(loads)}, Python says {sorted(want)}"


@pytest.mark.parametrize("operation, struct_", STRUCTS, ids=[op for op, _ in STRUCTS])
def test_pack_round_trip(operation, struct_):
    rng = np.random.default_rng(7)
    given = {}
    for p in struct_.params:
        draw = (lambda: float(np.float32(rng.standard_normal()))) if p.kind == "f32" else \
               (lambda: rng.bytes(128)) if p.kind == "tmap" else (lambda: int(rng.integers(0, 2**31)))
        given[p.name] = [draw() for _ in range(p.count)] if p.count > 1 else draw()
    packed = struct_.pack(given)
    assert packed.nbytes == struct_.size
    assert struct_.unpack(packed) == given
    raw = bytes(packed)
    for p, off in zip(struct_.params, struct_._offsets):  # each value sits at its offset
        fmt = {"i32": "<i", "u32": "<I", "i64": "<q", "f32": "<f", "ptr": "<Q", "tmap": "<128s"}[p.kind]
        first = given[p.name][0] if p.count > 1 else given[p.name]
        assert struct.unpack_from(fmt, raw, off)[0] == first


def test_pack_takes_device_pointers_and_none():
    s = ParamStruct("S", (Param("a", "ptr", "const int*"), Param("n", "i32")))

    class FakeArray:  # what CuPy arrays look like to the packer: .data.ptr
        class data:
            ptr = 0x7F0012345678

    assert s.unpack(s.pack({"a": FakeArray(), "n": 3})) == {"a": 0x7F0012345678, "n": 3}
    assert s.unpack(s.pack({"a": None, "n": 0}))["a"] == 0


@pytest.mark.parametrize("given, match", [
    pytest.param({"a": None}, "missing", id="missing-field"),
    pytest.param({"a": None, "n": 1, "zz": 2}, "unknown", id="unknown-field"),
    pytest.param({"a": None, "n": 2**40}, "S", id="overflow"),
])
def test_pack_refuses_bad_values(given, match):
    s = ParamStruct("S", (Param("a", "ptr", "const int*"), Param("n", "i32")))
    with pytest.raises(AbiError, match=match):
        s.pack(given)


def test_layout_follows_c_rules():
    s = ParamStruct("S", (Param("a", "i32"), Param("p", "ptr", "void*"), Param("f", "f32"), Param("x", "i32", count=3)))
    assert [(n, off) for n, off, _ in s.layout()] == [("a", 0), ("p", 8), ("f", 16), ("x", 20)]
    assert s.size == 32  # 32 bytes: rounded up to the 8-byte alignment


def test_block_type_enum_matches_the_kernels():
    """kernels/block_walk.cuh spells BlockType by hand; it must be mask/types.py's."""
    header = (env.kernels_dir() / "block_walk.cuh").read_text()
    assert cpp_enum() in header
    assert len(BlockType) == 4


def test_opaque_tensor_map_kind_is_128_bytes_aligned_to_64():
    """A CUtensorMap field: 128 opaque bytes at a 64-byte boundary; the struct aligns to 64."""
    s = ParamStruct("T", (Param("n", "i32"), Param("m", "tmap"), Param("x", "i64")))
    assert [(n, off, size) for n, off, size in s.layout()] == [("n", 0, 4), ("m", 64, 128), ("x", 192, 8)]
    assert s.size == 256  # rounded up to the 64-byte alignment
    assert "alignof(T) == 64" in s.cpp()
    blob = bytes(range(128))
    assert s.unpack(s.pack({"n": 1, "m": blob, "x": 2})) == {"n": 1, "m": blob, "x": 2}
    assert s.unpack(s.pack({"n": 1, "m": None, "x": 2}))["m"] == bytes(128)
    with pytest.raises(AbiError, match="128 bytes"):
        s.pack({"n": 1, "m": b"short", "x": 2})


def test_opaque_tensor_map_offsets_match_ptx():
    s = ParamStruct("T", (Param("n", "i32"), Param("m", "tmap"), Param("x", "i64")))
    ptx = _ptx(s.probe_kernel("abi_probe"), "abi_probe")
    assert re.search(r"\.param \.align 64 \.b8 abi_probe_param_0\[256\]", ptx), ptx[:2000]
    assert "[abi_probe_param_0+64]" in ptx and "[abi_probe_param_0+192]" in ptx
