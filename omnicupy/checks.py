"""Scalar argument checks shared by the API, block masks, mask factories and score modifiers.

Numbers are checked as the kernels will hold them: a float argument must be a real number (not a
bool, not a string) that stays finite, positive and normal once converted to float32.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .errors import ArgumentError

_FLOAT32_MAX, _FLOAT32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def check_int(value: Any, name: str, *, minimum: int = 0, multiple: int = 1, error: type = ArgumentError,
              maximum: Optional[int] = None) -> int:
    """``value`` as an int >= ``minimum`` (and <= ``maximum``) divisible by ``multiple`` (bools are not ints here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value}")
    if value % multiple:
        raise error(f"{name} must be a multiple of {multiple}, got {value}")
    return value


def check_real(value: Any, name: str, *, error: type = ArgumentError) -> float:
    """``value`` as a Python float: a real number (int or float, Python or NumPy scalar); bools,
    strings, complex numbers and arrays are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float64
        raise error(f"{name} must be a finite number, got {value!r}") from None


def check_positive_float(value: Any, name: str, *, error: type = ArgumentError, float32: bool = True,
                         maximum: Optional[float] = None) -> float:
    """``value`` as a finite float > 0 (and <= ``maximum``); with ``float32`` (the default: what the
    kernels use) also a normal float32 number, so that the kernel sees neither inf nor 0."""
    result = check_real(value, name, error=error)
    if not math.isfinite(result) or result <= 0:
        raise error(f"{name} must be a positive finite number, got {value!r}")
    if float32 and not _FLOAT32_TINY <= result <= _FLOAT32_MAX:
        raise error(f"{name}={value!r} is outside float32's normal range [{_FLOAT32_TINY:g}, {_FLOAT32_MAX:g}]; "
                    f"the kernel computes in float32")
    if maximum is not None and result > maximum:
        raise error(f"{name} must be <= {maximum:g}, got {value!r}")
    return result
