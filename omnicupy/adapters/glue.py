"""Running omnicupy inside a framework's operator: on the framework's stream, with its memory.

- ``on_stream(device, stream_ptr)``: CuPy's current device and stream become the framework's, so
  every omnicupy launch (jit/launch.py launches on CuPy's current stream) is ordered with the
  framework's work without any synchronization. CuPy 14 names a foreign stream
  ``cupy.cuda.Stream.from_external``; CuPy 13 ``cupy.cuda.ExternalStream`` (deprecated in 14).
- ``allocating_with(alloc, free)``: every CuPy allocation inside the block (omnicupy's outputs it
  makes itself, its workspaces, caches it fills on a first call) comes from the framework's
  allocator instead of CuPy's pool: torch's caching allocator (so that CUDA-graph capture sees
  only torch memory) or XLA's (``XLA_FFI_DeviceMemory_Allocate``).
- ``device_array(ptr, shape, dtype, device)``: a zero-copy CuPy view of a framework buffer.

Knows CuPy's stream and allocator hooks; nothing of torch, JAX or attention.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .. import arrays
from ..errors import NoGPUError


def cupy():
    cp = arrays.cupy_module()
    if cp is None:
        raise NoGPUError("omnicupy needs CuPy: pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]'")
    return cp


class _StreamHandle:
    """A raw stream pointer dressed in the CUDA stream protocol (``__cuda_stream__``), which CuPy
    14's ``Stream.from_external`` takes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr  # (protocol version, cudaStream_t)


def external_stream(stream_ptr: int, device_id: int):
    """A CuPy stream object for a stream another library owns (CuPy never destroys it)."""
    cp = cupy()
    if hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14: ExternalStream is deprecated there
        return cp.cuda.Stream.from_external(_StreamHandle(int(stream_ptr)))
    return cp.cuda.ExternalStream(int(stream_ptr), device_id)


@contextlib.contextmanager
def on_stream(device_id: int, stream_ptr: int) -> Iterator[None]:
    """CuPy's current device and stream are ``device_id`` and ``stream_ptr`` inside the block."""
    cp = cupy()
    with cp.cuda.Device(device_id), external_stream(stream_ptr, device_id):
        yield


class Block:
    """Owner of one allocation lent to CuPy: gives it back when CuPy drops its last view."""

    __slots__ = ("ptr", "size", "free")

    def __init__(self, ptr: int, size: int, free: Optional[Callable[[int, int], None]]) -> None:
        self.ptr, self.size, self.free = ptr, size, free

    def __del__(self) -> None:
        if self.free is not None:
            self.free(self.ptr, self.size)


def lend(ptr: int, size: int, owner: Any, device_id: int):
    """A CuPy MemoryPointer over ``size`` bytes at ``ptr`` that keeps ``owner`` alive."""
    cp = cupy()
    return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, size, owner, device_id), 0)


@contextlib.contextmanager
def allocating_with(alloc: Callable[[int], tuple[int, Any]], device_id: int,
                    free: Optional[Callable[[int, int], None]] = None) -> Iterator[None]:
    """CuPy allocations inside the block call ``alloc(nbytes) -> (pointer, owner)``. The memory
    lives while a CuPy array uses it and ``owner`` lives; ``free(ptr, size)`` (if given) is called
    when CuPy drops it."""
    cp = cupy()

    def allocator(size: int):
        size = max(int(size), 1)
        ptr, owner = alloc(size)
        block = Block(ptr, size, free) if owner is None else owner
        return lend(ptr, size, block, device_id)

    with cp.cuda.using_allocator(allocator):
        yield


def device_array(ptr: int, shape: tuple[int, ...], dtype: Any, device_id: int, owner: Any = None):
    """A C-contiguous CuPy array over a framework buffer at ``ptr`` (no copy)."""
    cp = cupy()
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return cp.ndarray(shape, dtype, lend(ptr, max(nbytes, 1), owner, device_id))


__all__ = ["Block", "allocating_with", "device_array", "external_stream", "lend", "on_stream"]
