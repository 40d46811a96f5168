"""The JAX handler's views of XLA buffers (adapters/jax_exec.py) and the CUDA stream wrapper
(adapters/glue.py), without a GPU: CuPy builds array views over an address and a foreign stream
object without touching the device, so shapes, strides and dtypes are checked here; what the
kernels then do with them is the GPU tests' business."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import omnicupy  # noqa: E402
from omnicupy import arrays  # noqa: E402
from omnicupy.adapters import glue, jax_exec, xla_ffi  # noqa: E402


def buffer(shape, dtype="float16", ptr=1 << 20) -> xla_ffi.BufferView:
    view = object.__new__(xla_ffi.BufferView)
    view.ptr, view.dtype, view.shape = ptr, dtype, tuple(shape)
    return view


@pytest.mark.parametrize("shape, layout, want_shape, want_strides", [
    pytest.param((2, 256, 4, 64), "BNHD", (2, 4, 256, 64), (2 * 256 * 4 * 64, 64 * 2, 4 * 64 * 2, 2), id="bnhd"),
    pytest.param((2, 4, 256, 64), "BHND", (2, 4, 256, 64), (4 * 256 * 64 * 2, 256 * 64 * 2, 64 * 2, 2), id="bhnd"),
    pytest.param((3, 2, 256, 4, 64), "BNHD", (6, 4, 256, 64), (256 * 4 * 64 * 2, 64 * 2, 4 * 64 * 2, 2),
                 id="vmapped-bnhd"),
    pytest.param((5, 3, 1, 4, 8, 32), "BHND", (15, 4, 8, 32), (4 * 8 * 32 * 2, 8 * 32 * 2, 32 * 2, 2),
                 id="two-vmaps-bhnd"),
])
def test_bhnd_views(shape, layout, want_shape, want_strides):
    x = jax_exec.bhnd(buffer(shape), layout, 0)
    assert (x.shape, x.strides, x.data.ptr) == (want_shape, want_strides, 1 << 20)


@pytest.mark.parametrize("shape, want", [((2, 4, 256), (2, 4, 256)), ((3, 2, 4, 256), (6, 4, 256))],
                         ids=["plain", "vmapped"])
def test_lse_rows(shape, want):
    x = jax_exec.rows(buffer(shape, "float32"), 0)
    assert x.shape == want and x.dtype == np.float32 and x.flags.c_contiguous


def test_bf16_buffers_are_ml_dtypes_bfloat16():
    assert jax_exec.bhnd(buffer((1, 8, 1, 64), "bfloat16"), "BNHD", 0).dtype == arrays.BFLOAT16


def test_buffers_below_rank_four_are_refused():
    with pytest.raises(omnicupy.ArgumentError, match="rank >= 4"):
        jax_exec.bhnd(buffer((8, 64)), "BNHD", 0)


@pytest.mark.parametrize("ptr", [0, 12345])
def test_external_stream_keeps_the_pointer(ptr):
    assert glue.external_stream(ptr, 0).ptr == ptr
