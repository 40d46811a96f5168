"""A cubin image in memory -> a callable kernel in the current CUDA context (CuPy's driver API).

Knows how to load a module from bytes and read or set a function's attributes; nothing of caches or
attention. Loading from bytes (``cupy.cuda.function.Module.load``, the driver's ``cuModuleLoadData``)
means the image that runs is the one the caller verified, never a file read a second time.
"""
from __future__ import annotations

from typing import Any, Optional


class LoadedKernel:
    """One ``extern "C"`` function of a loaded module, called like ``cupy.RawKernel``:
    ``kernel(grid, block, args, shared_mem=..., stream=...)``. The module stays loaded while the
    kernel lives."""

    def __init__(self, image: bytes, name: str, *, _module: Any = None) -> None:
        from cupy.cuda import function

        self.name = name
        if _module is None:
            _module = function.Module()
            _module.load(bytes(image))
        self._module = _module
        self._function = self._module.get_function(name)

    def sibling(self, name: str) -> "LoadedKernel":
        """Another ``extern "C"`` function of the same loaded module (an operation with several
        entry points, like the backward's preprocess / main / conversion)."""
        return LoadedKernel(b"", name, _module=self._module)

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0,
                 stream: Optional[Any] = None) -> None:
        self._function(tuple(grid), tuple(block), args, shared_mem, stream)

    @property
    def function_ptr(self) -> int:
        """The driver's CUfunction handle, for launching without CuPy's argument packing (jit/launch.py)."""
        return int(self._function.ptr)

    def _attribute(self, which: str) -> int:
        from cupy.cuda import driver

        return driver.funcGetAttribute(getattr(driver, which), self._function.ptr)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attribute("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES")

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, size: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self._function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(size))

    @property
    def num_regs(self) -> int:
        return self._attribute("CU_FUNC_ATTRIBUTE_NUM_REGS")

    @property
    def local_size_bytes(self) -> int:
        return self._attribute("CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES")

    @property
    def shared_size_bytes(self) -> int:
        return self._attribute("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")

    @property
    def max_threads_per_block(self) -> int:
        return self._attribute("CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK")

    def __repr__(self) -> str:
        return f"LoadedKernel({self.name!r})"
