"""Array interop: NumPy, CuPy, DLPack and ``__cuda_array_interface__`` objects.

Everything the kernels touch is a CuPy array on the current device. This module turns what a user
hands us into that (without copying when the data already lives on the GPU) and knows which kind
of array to hand back.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .errors import NoGPUError

try:  # NumPy has no bfloat16; ml_dtypes provides the dtype CuPy 14 understands.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    BFLOAT16 = None

FLOAT16 = np.dtype(np.float16)

#: dtype -> the short name used in variant keys and kernel names.
DTYPE_NAMES = {FLOAT16: "fp16"}
if BFLOAT16 is not None:
    DTYPE_NAMES[BFLOAT16] = "bf16"


@functools.lru_cache(maxsize=None)
def cupy_module():
    """CuPy if it imports, else None. Importing CuPy needs no GPU."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means "no CuPy"
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, insufficient driver, no device
        return False


def is_cupy(x: Any) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def array_namespace(x: Any):
    """numpy or cupy, whichever owns ``x``."""
    return cupy_module() if is_cupy(x) else np


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy view or copy of any supported array."""
    if is_numpy(x):
        return x
    if is_cupy(x):
        return x.get()
    if hasattr(x, "__cuda_array_interface__") or is_cuda_dlpack(x):
        return to_cupy(x, "x").get()
    return np.asarray(x)


def is_cuda_dlpack(x: Any) -> bool:
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        return False
    try:
        device_type, _ = x.__dlpack_device__()
    except Exception:  # noqa: BLE001
        return False
    # DLPack device types: 2 = CUDA, 13 = CUDA managed.
    return int(device_type) in (2, 13)


def to_cupy(x: Any, name: str):
    """A CuPy array for ``x``: zero-copy for CuPy, CUDA DLPack and CUDA-array-interface objects;
    a host-to-device copy for NumPy (and anything ``numpy.asarray`` accepts)."""
    cp = cupy_module()
    if cp is None:
        raise NoGPUError(f"{name}: CuPy is not installed; install omnicupy[cuda12] or omnicupy[cuda13]")
    if isinstance(x, cp.ndarray):
        return x
    if is_cuda_dlpack(x):
        return cp.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        # A host DLPack producer (e.g. a CPU torch tensor): go through NumPy.
        x = np.from_dlpack(x)
    return cp.asarray(np.asarray(x))


def upload(host: np.ndarray):
    """A device copy of a host array that never synchronizes with work already queued: an
    asynchronous copy through pinned memory on the current stream; while that stream is being
    captured into a CUDA graph, a copy on a side stream that is waited for (the data must exist
    now, not when the graph is replayed)."""
    cp = cupy_module()
    if not cp.cuda.get_current_stream().is_capturing():
        return cp.asarray(host, blocking=False)
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        device = cp.asarray(host, blocking=False)
    side.synchronize()
    return device


def as_array(x: Any, name: str):
    """A NumPy or CuPy array for ``x`` without moving data between host and device: CUDA DLPack and
    CUDA-array-interface objects become zero-copy CuPy views, host DLPack objects (a CPU torch
    tensor) NumPy views, anything else goes through ``numpy.asarray``."""
    if is_numpy(x) or is_cupy(x):
        return x
    if hasattr(x, "__cuda_array_interface__") or is_cuda_dlpack(x):
        return to_cupy(x, name)
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)
