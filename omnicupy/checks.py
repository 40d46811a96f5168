"""Scalar argument checks shared by the API, block masks, mask factories and score modifiers."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import ArgumentError


def check_int(value: Any, name: str, *, minimum: int = 0, multiple: int = 1, error: type = ArgumentError) -> int:
    """``value`` as an int >= ``minimum`` and divisible by ``multiple`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if value % multiple:
        raise error(f"{name} must be a multiple of {multiple}, got {value}")
    return value


def check_positive_float(value: Any, name: str, *, error: type = ArgumentError) -> float:
    """``value`` as a finite float > 0."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise error(f"{name} must be a positive float, got {value!r}") from None
    if not math.isfinite(result) or result <= 0:
        raise error(f"{name} must be a positive finite float, got {value!r}")
    return result
