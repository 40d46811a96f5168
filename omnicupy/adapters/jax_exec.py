"""What the XLA FFI handlers (adapters/xla_ffi.py) do on the GPU: omnicupy's forward and backward
on XLA's buffers and stream, with XLA's allocator.

Each execution wraps the argument and result buffers as zero-copy CuPy views (q/k/v in the call's
layout: ``BNHD`` buffers are viewed as ``[B, H, N, D]`` by a transpose, no copy; leading axes a
``vmap`` added are folded into the batch), makes XLA's stream CuPy's current one and routes
CuPy's allocations to ``XLA_FFI_DeviceMemory_Allocate`` (which aligns to 16 bytes at most: each
block is over-allocated and its pointer aligned here to ALIGNMENT); omnicupy then writes ``out``
and ``dq/dk/dv`` in place. The forward's LSE is copied into its result buffer (``attention()`` takes no
LSE buffer; ``[B, H, N]`` fp32, a few µs). Allocations omnicupy drops during the call go back to XLA
at once (stream order keeps that safe: XLA runs its work on the same stream); the few it keeps in
its caches on a first call (a mask's launch order, the decode's counters) stay allocated for the
process, as they would in CuPy's pool.

Knows the handlers' argument order and omnicupy's public calls; nothing of the FFI ABI or of jax.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np

from .. import arrays
from ..errors import ArgumentError
from ..ops.backward import attention_backward
from ..ops.forward import attention as _attention
from . import glue, specs
from .xla_ffi import MAX_ALIGNMENT, BufferView, FfiError, Frame

#: The custom-call targets (jax.ffi.register_ffi_target names, platform CUDA).
FORWARD_TARGET = "omnicupy_attention_fwd"
BACKWARD_TARGET = "omnicupy_attention_bwd"
#: XLA's stream of the latest execution (what tests and a debugger can check; written, never read here).
last_stream: list[int] = [0]


def _device(frame: Frame, first: BufferView) -> int:
    ordinal = frame.device()
    if ordinal is not None:
        return ordinal
    cp = glue.cupy()
    return int(cp.cuda.runtime.pointerGetAttributes(first.ptr).device)


#: The alignment of every block omnicupy gets from XLA: 16 bytes for vector loads and stores, 128
#: for TMA tensor maps, 256 for the workspaces' sub-blocks (ops/backward.py, ops/recall.py), as
#: CuPy's pool would give. XLA's FFI allocator guarantees only MAX_ALIGNMENT.
ALIGNMENT = 256


def aligned_alloc(allocate: Callable[[int], int], free: Callable[[int, int], None]) -> Callable[[int], tuple[int, Any]]:
    """``alloc(size) -> (pointer, owner)`` for glue.allocating_with on top of XLA's allocator
    (``allocate(nbytes) -> pointer``, MAX_ALIGNMENT-aligned): each block is over-allocated by
    ``ALIGNMENT - MAX_ALIGNMENT`` bytes and its pointer rounded up to ALIGNMENT; the owner gives
    the whole block back (``free(raw pointer, raw size)``) when CuPy drops it."""
    def alloc(size: int) -> tuple[int, Any]:
        raw_size = size + ALIGNMENT - MAX_ALIGNMENT
        raw = allocate(raw_size)
        if raw % MAX_ALIGNMENT:
            free(raw, raw_size)
            raise FfiError(f"XLA's allocator returned {raw:#x}, not {MAX_ALIGNMENT}-byte aligned")
        return -(-raw // ALIGNMENT) * ALIGNMENT, glue.Block(raw, raw_size, free)
    return alloc


@contextlib.contextmanager
def xla_context(frame: Frame, device: int) -> Iterator[None]:
    """XLA's stream is CuPy's current one and CuPy allocates from XLA, inside the block."""
    live = [True]

    def free(ptr: int, size: int) -> None:
        if live[0]:  # after the call, XLA's context is gone: what omnicupy cached stays allocated
            frame.free(ptr, size)

    stream = last_stream[0] = frame.stream()
    try:
        with glue.on_stream(device, stream), glue.allocating_with(aligned_alloc(frame.allocate, free), device):
            yield
    finally:
        live[0] = False


def _dtype(view: BufferView) -> np.dtype:
    if view.dtype == "bfloat16":
        return arrays.BFLOAT16
    return np.dtype(view.dtype)


def _array(view: BufferView, device: int):
    """The buffer as a C-contiguous CuPy array of its own shape."""
    return glue.device_array(view.ptr, view.shape, _dtype(view), device)


def bhnd(view: BufferView, layout: str, device: int):
    """A ``[B, H, N, D]`` view of a q/k/v-like buffer: leading vmap axes folded into B; a BNHD
    buffer transposed (strided, last dim contiguous)."""
    if len(view.shape) < 4:
        raise ArgumentError(f"expected a buffer of rank >= 4, got {view}")
    x = _array(view, device)
    x = x.reshape((-1,) + view.shape[-3:])  # dense: folding leading axes is a view
    return x.transpose(0, 2, 1, 3) if layout == "BNHD" else x


def rows(view: BufferView, device: int):
    """An LSE buffer ``[..., B, H, N]`` as ``[B', H, N]``."""
    return _array(view, device).reshape((-1,) + view.shape[-2:])


def forward(frame: Frame) -> None:
    """args q, k, v; rets out, lse; attrs spec."""
    spec = specs.lookup(frame.attrs["spec"])
    device = _device(frame, frame.args[0])
    with xla_context(frame, device):
        q, k, v = (bhnd(x, spec.layout, device) for x in frame.args[:3])
        out, lse = bhnd(frame.rets[0], spec.layout, device), rows(frame.rets[1], device)
        _, got = _attention(q, k, v, spec.block_mask, causal=spec.causal, scale=spec.scale, return_lse=True, out=out,
                            score_mod=spec.score_mod, fuse_mask=spec.fuse_mask)
        # both dense [B, H, N] fp32: one copy on XLA's stream (CuPy's current one here)
        lse.data.copy_from_device_async(got.data, got.nbytes, glue.cupy().cuda.get_current_stream())
        del got, q, k, v, out, lse


def backward(frame: Frame) -> None:
    """args dout, q, k, v, out, lse; rets dq, dk, dv; attrs spec."""
    spec = specs.lookup(frame.attrs["spec"])
    device = _device(frame, frame.args[0])
    with xla_context(frame, device):
        dout, q, k, v, out = (bhnd(x, spec.layout, device) for x in frame.args[:5])
        lse = rows(frame.args[5], device)
        dq, dk, dv = (bhnd(x, spec.layout, device) for x in frame.rets)
        attention_backward(dout, q, k, v, out, lse, spec.block_mask, causal=spec.causal, scale=spec.scale,
                           score_mod=spec.score_mod, deterministic=spec.deterministic, dq=dq, dk=dk, dv=dv,
                           fuse_mask=spec.fuse_mask)
        del dout, q, k, v, out, lse, dq, dk, dv


__all__ = ["ALIGNMENT", "BACKWARD_TARGET", "FORWARD_TARGET", "aligned_alloc", "backward", "bhnd", "forward", "rows",
           "xla_context"]
