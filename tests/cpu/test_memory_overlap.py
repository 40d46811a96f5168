"""Output buffers against inputs and themselves (ops/inputs.py: memory_span, spans_overlap,
self_overlapping, check_out, check_lse_buffer), on the CPU.

Device arrays are modelled by Spans at made-up addresses: the arithmetic is the same one CuPy
arrays go through (tests/gpu/test_inputs_gpu.py runs it on real ones).
"""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy.errors import AliasError, ArgumentError
from omnicupy.ops.inputs import (Span, check_disjoint, check_lse_buffer, check_out, check_qkv, memory_span,
                                 self_overlapping, spans_overlap)

DEV0, DEV1 = ("cuda", 0), ("cuda", 1)


def span(address, shape, strides, itemsize=2, space=DEV0):
    """A Span as memory_span would compute it for an array at ``address``."""
    low = address + sum(min(0, s * (n - 1)) for n, s in zip(shape, strides))
    high = address + sum(max(0, s * (n - 1)) for n, s in zip(shape, strides)) + itemsize
    return Span(space, low, high, address, tuple(shape), tuple(strides), itemsize)


BASE = 1 << 40  # a made-up device address
ROW = 64 * 2    # one fp16 row of head_dim 64

OVERLAPS = [
    pytest.param(span(BASE, (4, 64), (ROW, 2)), span(BASE, (4, 64), (ROW, 2)), True, id="same"),
    pytest.param(span(BASE, (4, 64), (ROW, 2)), span(BASE + 3 * ROW, (4, 64), (ROW, 2)), True, id="last-row-shared"),
    pytest.param(span(BASE, (4, 64), (ROW, 2)), span(BASE + 4 * ROW, (4, 64), (ROW, 2)), False, id="adjacent"),
    pytest.param(span(BASE, (4, 64), (ROW, 2)), span(BASE, (4, 64), (ROW, 2), space=DEV1), False, id="other-device"),
    pytest.param(span(BASE, (4, 64), (ROW, 2)), span(BASE, (4, 64), (ROW, 2), space="host"), False,
                 id="host-vs-device"),
    # [N, 2, D] packed buffer: slot 0 and slot 1 interleave without sharing a byte
    pytest.param(span(BASE, (8, 64), (2 * ROW, 2)), span(BASE + ROW, (8, 64), (2 * ROW, 2)), False, id="interleaved"),
    pytest.param(span(BASE, (8, 64), (2 * ROW, 2)), span(BASE + ROW - 2, (8, 64), (2 * ROW, 2)), True,
                 id="interleaved-off-by-one-element"),
    # a reversed view (negative stride) of the same rows
    pytest.param(span(BASE + 3 * ROW, (4, 64), (-ROW, 2)), span(BASE, (1, 64), (ROW, 2)), True, id="reversed"),
    pytest.param(span(BASE + 3 * ROW, (4, 64), (-ROW, 2)), span(BASE + 4 * ROW, (1, 64), (ROW, 2)), False,
                 id="reversed-past-the-end"),
]


@pytest.mark.parametrize("a,b,want", OVERLAPS)
def test_spans_overlap(a, b, want):
    assert spans_overlap(a, b) is want
    assert spans_overlap(b, a) is want


SELF = [
    pytest.param((2, 4, 33, 64), (4 * 33 * ROW, 33 * ROW, ROW, 2), False, id="contiguous"),
    pytest.param((2, 4, 33, 64), (33 * 4 * ROW, ROW, 4 * ROW, 2), False, id="bnhd-view"),
    pytest.param((2, 4, 33, 64), (4 * 33 * ROW, 33 * ROW, -ROW, 2), False, id="reversed-rows"),
    pytest.param((2, 4, 33, 64), (4 * 33 * ROW, 33 * ROW, 0, 2), True, id="zero-stride"),
    pytest.param((2, 4, 1, 64), (4 * ROW, ROW, 0, 2), False, id="zero-stride-on-size-1"),
    pytest.param((2, 4, 33, 64), (4 * 33 * ROW, 33 * ROW, ROW // 2, 2), True, id="rows-overlap"),
    pytest.param((2, 4, 33, 64), (4 * 33 * ROW, 64, 4 * ROW, 2), True, id="heads-overlap"),
    pytest.param((2, 64), (ROW, 4), True, id="wider-items-than-stride"),
]


@pytest.mark.parametrize("shape,strides,want", SELF)
def test_self_overlapping(shape, strides, want):
    assert self_overlapping(span(BASE, shape, strides)) is want


def test_memory_span_of_numpy_views():
    buf = np.zeros((3, 10, 64), np.float16)
    s = memory_span(buf[1])
    start = buf.__array_interface__["data"][0]
    assert (s.space, s.low, s.high) == ("host", start + 10 * ROW, start + 20 * ROW)
    r = memory_span(buf[2, ::-1])
    assert (r.low, r.high) == (start + 20 * ROW, start + 30 * ROW)
    assert memory_span(buf[:0]) is None


def qkv():
    return check_qkv(*(np.zeros((1, 2, 16, 64), np.float16) for _ in range(3)))


def test_check_out_names_the_aliased_input():
    inp = qkv()
    with pytest.raises(AliasError, match="out shares memory with v"):
        check_out(inp.v, inp)
    with pytest.raises(AliasError, match="o shares memory with q"):
        check_out(inp.q[:, :, ::-1], inp, "o")
    assert check_out(np.zeros((1, 2, 16, 64), np.float16), inp) is not None
    bias = np.zeros((1, 2, 16, 64), np.float16)
    with pytest.raises(AliasError, match="out shares memory with bias"):
        check_out(bias, inp, inputs={"bias": bias, "lse": None})


@pytest.mark.parametrize("make,error,message", [
    pytest.param(lambda inp, out: np.zeros((1, 2, 16), np.float32), None, None, id="fine"),
    pytest.param(lambda inp, out: np.zeros((1, 2, 16), np.float64), ArgumentError, "float32", id="dtype"),
    pytest.param(lambda inp, out: np.zeros((1, 2, 15), np.float32), ArgumentError, "shape", id="shape"),
    pytest.param(lambda inp, out: np.zeros((1, 2, 32), np.float32)[:, :, ::2], ArgumentError, "contiguous",
                 id="strided"),
    pytest.param(lambda inp, out: _read_only(np.zeros((1, 2, 16), np.float32)), AliasError, "read-only",
                 id="read-only"),
    pytest.param(lambda inp, out: out.reshape(-1).view(np.float32)[:32].reshape(1, 2, 16), AliasError,
                 "lse shares memory with out", id="inside-out"),
    pytest.param(lambda inp, out: inp.k.reshape(-1).view(np.float32)[:32].reshape(1, 2, 16), AliasError,
                 "lse shares memory with k", id="inside-k"),
])
def test_check_lse_buffer(make, error, message):
    inp = qkv()
    out = np.zeros((1, 2, 16, 64), np.float16)
    lse = make(inp, out)
    if error is None:
        assert check_lse_buffer(lse, inp, out) is lse
    else:
        with pytest.raises(error, match=message):
            check_lse_buffer(lse, inp, out)


def _read_only(x):
    x.setflags(write=False)
    return x


def test_check_disjoint_between_outputs():
    a = np.zeros(100, np.float32)
    with pytest.raises(AliasError, match="x shares memory with y"):
        check_disjoint({"x": a[:60], "y": a[50:]}, {})
    check_disjoint({"x": a[:50], "y": a[50:], "z": None}, {"w": None})
