"""Launching loaded kernels from a packed parameter struct with as little Python per call as possible.

A ``Launcher`` holds one struct's bytes and the kernels that read it (several entry points of one
module may share one struct, like the backward's three). The bytes live in a buffer per thread
that is filled from a template once; a call overwrites only what changes (data pointers, through
``args()``), then ``launch()`` hands the buffer to the driver's ``cuLaunchKernel``, which copies the
parameters before it returns, so the buffer may be rewritten right after. Two threads launching one
Launcher never share a buffer.

Routes to ``cuLaunchKernel`` (``ROUTES``; ``use_route`` picks one per process, the default is the
first available):

    driver     CuPy's own typed wrapper, ``cupy.cuda.driver.launchKernel``: integers in, no objects made
    bindings   NVIDIA's cuda-bindings, ``cuda.bindings.driver.cuLaunchKernel`` (an optional dependency)
    function   CuPy's ``Function.__call__`` with the struct as one NumPy record (the old route, always there)

The first two receive the address of a prebuilt ``void*[1]`` that points at the buffer (the
driver's ``kernelParams``); a non-zero status raises ``LaunchError``. The stream is CuPy's current
one, so CUDA-graph capture on a CuPy stream records the launches.

Knows the driver's launch call and the per-thread buffers; nothing of attention, of what the bytes
mean or of how kernels are compiled and loaded (jit/loader.py).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import ArgumentError, OmnicupyError


class LaunchError(OmnicupyError, RuntimeError):
    """The CUDA driver refused a launch (bad configuration, too much shared memory, a broken context)."""


ROUTES = ("driver", "bindings", "function")


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel of a Launcher and its launch geometry."""

    kernel: Any  # jit.LoadedKernel: ``.name``, called like a CuPy kernel, ``.function_ptr`` (the CUfunction)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
    #: (CUfunction, grid x, y, z, block x, y, z, shared memory): cuLaunchKernel's leading arguments
    head: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grid, block = tuple(int(n) for n in self.grid), tuple(int(n) for n in self.block)
        if len(grid) != 3 or len(block) != 3:
            raise LaunchError(f"grid and block must have 3 dimensions, got {self.grid} and {self.block}")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "head", (int(self.kernel.function_ptr), *grid, *block, int(self.shared_mem)))


class _Slot:
    """One thread's parameter buffer and the ``void*[1]`` that points at it."""

    __slots__ = ("bytes", "view", "argv", "argv_ptr")

    def __init__(self, template: bytes) -> None:
        # 64-byte aligned (the struct's strictest field): the driver copies from here.
        raw = np.zeros(len(template) + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64
        self.bytes = raw[start:start + len(template)]
        self.bytes[:] = np.frombuffer(template, dtype=np.uint8)
        self.view = memoryview(self.bytes)  # writable: struct.pack_into and slice assignment work on it
        self.argv = np.array([self.bytes.ctypes.data], dtype=np.uint64)
        self.argv_ptr = int(self.argv.ctypes.data)


class Launcher:
    """The kernels of one parameter struct, launched in order on CuPy's current stream."""

    __slots__ = ("template", "launches", "_local", "_record")

    def __init__(self, template: bytes, launches: Sequence[KernelLaunch]) -> None:
        self.template = bytes(template)
        self.launches = tuple(launches)
        self._local = threading.local()
        self._record = np.dtype((np.void, len(self.template)))

    def slot(self) -> _Slot:
        """This thread's parameter buffer (``.view``: its writable bytes; pass it to ``fire``)."""
        try:
            return self._local.slot
        except AttributeError:
            slot = self._local.slot = _Slot(self.template)
            return slot

    def args(self) -> memoryview:
        """This thread's parameter bytes (writable, the template's values until overwritten)."""
        return self.slot().view

    def launch(self, stream_ptr: Optional[int] = None) -> None:
        """Launches every kernel with this thread's parameter bytes on ``stream_ptr`` (default:
        CuPy's current stream)."""
        self.fire(self.slot(), stream_ptr)

    def fire(self, slot: _Slot, stream_ptr: Optional[int] = None) -> None:
        """``launch`` with the thread's ``slot()`` already in hand (the steady state writes its
        pointers there first: one lookup of the thread's buffer per call, not two)."""
        fire = _ROUTE[0]
        if fire is None:  # picked on the first launch, not at import: importing omnicupy imports no CuPy
            use_route()
            fire = _ROUTE[0]
        if fire is not _fire_function:
            _ensure_context()
            if stream_ptr is None:
                stream_ptr = _current_stream_ptr()
        for item in self.launches:
            fire(self, item, slot, stream_ptr)


_thread = threading.local()


def _ensure_context() -> None:
    """cuLaunchKernel launches into the calling thread's current CUDA context. CuPy's runtime calls
    make the device's primary context current, but a new thread that only reused pooled memory may
    have made none yet; CuPy's own launches check the same way (once per thread here)."""
    if getattr(_thread, "has_context", False):
        return
    from cupy.cuda import driver, runtime

    if driver.ctxGetCurrent() == 0:
        runtime.free(0)  # the runtime's documented way to initialise the primary context
    _thread.has_context = True


def _current_stream_ptr() -> int:
    return _get_current_stream()().ptr


@functools.lru_cache(maxsize=1)
def _get_current_stream() -> Callable:
    import cupy

    return cupy.cuda.get_current_stream


def _failed(item: KernelLaunch, why: Any) -> LaunchError:
    return LaunchError(f"launching {getattr(item.kernel, 'name', item.kernel)} (grid {item.grid}, block {item.block}, "
                       f"{item.shared_mem} bytes of dynamic shared memory) failed: {why}")


@functools.lru_cache(maxsize=1)
def _cupy_driver():
    from cupy.cuda import driver

    return driver


def _fire_driver(launcher: Launcher, item: KernelLaunch, slot: _Slot, stream_ptr: int) -> None:
    driver = _cupy_driver()
    try:
        driver.launchKernel(*item.head, stream_ptr, slot.argv_ptr, 0)
    except driver.CUDADriverError as exc:
        raise _failed(item, exc) from None


@functools.lru_cache(maxsize=1)
def _bindings() -> Optional[Any]:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


#: cuda-bindings handle objects, made once per function / stream pointer (constructing them per
#: call costs more than the launch's own Python).
_handles: dict = {}


def _handle(kind: Callable, ptr: int):
    key = (kind, ptr)
    found = _handles.get(key)
    if found is None:
        found = _handles[key] = kind(ptr)
    return found


def _fire_bindings(launcher: Launcher, item: KernelLaunch, slot: _Slot, stream_ptr: int) -> None:
    drv = _bindings()
    function, *geometry = item.head
    err, = drv.cuLaunchKernel(_handle(drv.CUfunction, function), *geometry, _handle(drv.CUstream, stream_ptr),
                              slot.argv_ptr, 0)
    if int(err) != 0:  # CUresult.CUDA_SUCCESS
        raise _failed(item, err)


def _fire_function(launcher: Launcher, item: KernelLaunch, slot: _Slot, stream_ptr: int) -> None:
    import cupy

    record = np.frombuffer(slot.bytes, dtype=launcher._record)[0]
    stream = None if stream_ptr is None else cupy.cuda.ExternalStream(stream_ptr)
    try:
        item.kernel(item.grid, item.block, (record,), shared_mem=item.shared_mem, stream=stream)
    except cupy.cuda.driver.CUDADriverError as exc:
        raise _failed(item, exc) from None


_FIRES = {"driver": _fire_driver, "bindings": _fire_bindings, "function": _fire_function}
#: The route every Launcher uses now (one-element lists: read per launch, set by use_route; None
#: until the first launch or use_route call).
_ROUTE: list = [None]
_ROUTE_NAME: list = [None]


def available_routes() -> list[str]:
    """The routes this process can use, best first."""
    routes = []
    try:
        if hasattr(_cupy_driver(), "launchKernel"):
            routes.append("driver")
    except ImportError:
        pass
    if _bindings() is not None:
        routes.append("bindings")
    routes.append("function")
    return routes


def use_route(name: Optional[str] = None) -> str:
    """Make every Launcher use ``name`` (one of ROUTES; None: the best available). Returns the name.
    Meant for benchmarks and tests comparing routes; the default needs no call."""
    name = available_routes()[0] if name is None else name
    if name not in ROUTES:
        raise ArgumentError(f"launch route {name!r} is not one of {ROUTES}")
    if name not in available_routes():
        raise ArgumentError(f"launch route {name!r} is not available in this process (have {available_routes()})")
    _ROUTE[0], _ROUTE_NAME[0] = _FIRES[name], name
    return name


def route() -> str:
    """The route launches take now."""
    if _ROUTE_NAME[0] is None:
        use_route()
    return _ROUTE_NAME[0]


__all__ = ["KernelLaunch", "LaunchError", "Launcher", "ROUTES", "available_routes", "route", "use_route"]
