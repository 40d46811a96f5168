"""Argument checks called in one line at the top of the public operations, so that everything that
can be judged without a GPU is judged before one is needed: output buffers against every input and
each other (one shared rule for every output of every operation: attention's out and lse, the
backward's dq/dk/dv, decode, paged, varlen, distributed results, and later ones such as dbias,
dsinks or KV-cache appends), flags that must be booleans, the decode's lengths and split counts,
and the no-GPU message naming the function that was called.

Raises named omnicupy errors only (AliasError, ArgumentError, KVCacheError, NoGPUError). Knows
argument contracts, nothing of kernels.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from .. import arrays
from ..errors import ArgumentError, NoGPUError
from .inputs import check_disjoint, check_writable_buffer


def check_outputs(outputs: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Every output (None entries skipped) is writable, has each element at its own address and
    shares no memory with any input or any other output. Arrays must already be NumPy or CuPy."""
    for name, x in outputs.items():
        if x is not None:
            check_writable_buffer(x, name)
    check_disjoint(outputs, inputs)


def check_flag(value: Any, name: str) -> bool:
    """A True/False argument (NumPy bools too); 0, 1, strings and None are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_flags(**flags: Any) -> None:
    """``check_flag`` for each keyword (e.g. ``check_flags(fuse_mask=fuse_mask, validate=validate)``)."""
    for name, value in flags.items():
        check_flag(value, name)


def check_decode_args(kv_lens: Any, num_splits: Any, batch: int, kv_len: int) -> None:
    """kv_lens (int [B] within [0, kv_len] for host arrays) and num_splits (int >= 1, bounded), before
    any GPU query (the decode plan checks them again on its own path)."""
    from . import decode  # decode imports this package's inputs; imported here to keep the graph simple

    decode.check_num_splits(num_splits)
    on_device = not arrays.is_numpy(kv_lens) and (arrays.is_cupy(kv_lens) or hasattr(kv_lens, "__dlpack__")
                                                  or hasattr(kv_lens, "__cuda_array_interface__"))
    if kv_lens is not None and not on_device:  # device lengths: checked on the device, or clamped by the kernel
        decode.check_lengths(kv_lens, batch, kv_len)


def require_gpu_for(function: str) -> None:
    """NoGPUError naming ``function`` (e.g. "omnicupy.paged_attention") when CuPy or a GPU is missing."""
    if arrays.cupy_module() is None:
        raise NoGPUError(f"{function} needs CuPy: pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]'")
    if not arrays.gpu_available():
        raise NoGPUError(f"{function} needs an NVIDIA GPU and driver; none is usable on this machine")


def steady_state_possible() -> Optional[Any]:
    """CuPy when a GPU is usable (the steady-state fast paths may then read array pointers), else None:
    without a driver they would ask CUDA about pointers and fail with a raw CUDA error."""
    cp = arrays.cupy_module()
    return cp if cp is not None and arrays.gpu_available() else None


__all__ = ["check_outputs", "check_flag", "check_flags", "check_decode_args", "require_gpu_for",
           "steady_state_possible"]
