"""Calling a mask_mod on the elements of blocks, and checking what it returns.

The broadcast contract: a mask_mod is called once per chunk of K blocks with index arrays
``b, h`` of shape ``[K, 1, 1]``, ``q_idx`` ``[K, qbs, 1]`` and ``kv_idx`` ``[K, 1, kbs]`` (NumPy or
CuPy), and returns booleans whose shape broadcasts to the grid ``[K, qbs, kbs]`` without changing
it. Anything else is refused with a MaskError, never cast or broadcast into use.

Mask_mods written for flex-attention's scalar (vmap) semantics index with their arguments as if
each were one number (``intervals[image_boundaries[kv_idx]][0]``), which breaks on arrays. For those
the scalar mode calls the mask_mod with one index a scalar and the other an array, row by row or
column by column of each evaluated block, checks each result's shape, and checks the chosen form
against calls with four scalars on sampled elements. ``mode="auto"`` (the builders' default)
tries the broadcast contract and falls back to the scalar mode, once logged, when the mask_mod
fails on arrays (or, for a mask_mod not known to be elementwise, disagrees with per-element calls
on sampled elements). This module knows mask_mods and index arrays, not block metadata.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError, OmnicupyError
from .mask_mod import as_bool_result, name_of

logger = logging.getLogger("omnicupy.mask")

MODES = ("auto", "broadcast", "scalar")
#: ``mode="auto"`` falls back to the scalar mode only when that takes at most this many calls.
AUTO_SCALAR_CALL_LIMIT = 1 << 18
#: Elements per block compared with four-scalar calls (the probe, and the scalar mode's check).
PROBE_SAMPLES = 12

CONTRACT = ("omnicupy calls a mask_mod once per chunk of blocks with broadcast index arrays (b, h: [K, 1, 1], "
            "q_idx: [K, qbs, 1], kv_idx: [K, 1, kbs]) and needs a boolean array that broadcasts to [K, qbs, kbs]: "
            "write it with elementwise operations (comparisons, & | ~, arithmetic, table[idx] lookups), as for "
            "NumPy; or build with mode='scalar', which calls it with one index a scalar at a time (slow: one call "
            "per row or column of each evaluated block), as flex-attention's vmap does")


class BroadcastFailure(MaskError):
    """The mask_mod did not keep the broadcast contract (raised, failed shape, or disagreed with
    per-element calls): the scalar mode may still evaluate it."""


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise MaskError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def evaluate_grid(mask_mod: Callable, b, h, q, kv, grid: tuple[int, int, int], xp: Any):
    """The mask_mod on broadcast index arrays, as booleans broadcast to ``grid`` (a view; no cast)."""
    name = name_of(mask_mod)
    try:
        out = mask_mod(b, h, q, kv)
    except OmnicupyError:  # omnicupy's own refusals (a short lookup array, ...) say what is wrong
        raise
    except Exception as exc:  # noqa: BLE001 - any failure on arrays is the contract's to report
        raise BroadcastFailure(f"mask_mod {name} failed on broadcast index arrays ({type(exc).__name__}: {exc}). "
                               f"{CONTRACT}") from exc
    out = as_bool_result(out, name, xp)
    shape = tuple(int(n) for n in out.shape)
    fits = len(shape) <= 3 and all(n in (1, g) for n, g in zip(shape[::-1], grid[::-1]))
    if not fits:
        raise BroadcastFailure(f"mask_mod {name} returned shape {shape} on index arrays of the grid {grid}; a result "
                               f"must broadcast to the grid without changing it. {CONTRACT}")
    return xp.broadcast_to(out, grid)


def _scalar(x: int):
    return np.int64(x)


def _call_row(mask_mod: Callable, b: int, h: int, q, kv, name: str, along: str) -> np.ndarray:
    """One call with one index a scalar, the other a 1-D array; its result must be () or the array's."""
    n = len(kv) if along == "rows" else len(q)
    out = as_bool_result(mask_mod(_scalar(b), _scalar(h), q, kv), name, np)
    shape = tuple(int(s) for s in out.shape)
    if shape not in ((), (n,)):
        raise BroadcastFailure(f"mask_mod {name} returned shape {shape} with "
                               f"{'q_idx a scalar and kv_idx' if along == 'rows' else 'kv_idx a scalar and q_idx'} "
                               f"an array of {n}; expected () or ({n},)")
    return np.broadcast_to(arrays.to_numpy(out), (n,))


def scalar_block(mask_mod: Callable, b: int, h: int, q0: int, kv0: int, real_rows: int, real_cols: int,
                 qbs: int, kbs: int, along: str, xp: Any = np) -> np.ndarray:
    """One block's element mask ``[qbs, kbs]`` (host bool; positions past the ends False), by rows
    (``q_idx`` a scalar, ``kv_idx`` the block's real columns, an array of ``xp``) or by columns."""
    name = name_of(mask_mod)
    out = np.zeros((qbs, kbs), dtype=bool)
    cols = xp.asarray(np.arange(kv0, kv0 + real_cols, dtype=np.int64))
    rows = xp.asarray(np.arange(q0, q0 + real_rows, dtype=np.int64))
    if along == "rows":
        for r in range(real_rows):
            out[r, :real_cols] = _call_row(mask_mod, b, h, _scalar(q0 + r), cols, name, along)
    else:
        for c in range(real_cols):
            out[:real_rows, c] = _call_row(mask_mod, b, h, rows, _scalar(kv0 + c), name, along)
    return out


def sample_positions(real_rows: int, real_cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Local (row, column) positions to compare: the four corners and some seeded random ones."""
    rng = np.random.default_rng(seed)
    r = np.concatenate([[0, 0, real_rows - 1, real_rows - 1], rng.integers(0, real_rows, PROBE_SAMPLES - 4)])
    c = np.concatenate([[0, real_cols - 1, 0, real_cols - 1], rng.integers(0, real_cols, PROBE_SAMPLES - 4)])
    return r, c


def scalar_values(mask_mod: Callable, b: int, h: int, q: np.ndarray, kv: np.ndarray) -> Optional[np.ndarray]:
    """The mask_mod called with four scalars at each (q, kv), flex's own semantics; None when it
    cannot be called that way (then there is nothing to compare with)."""
    name = name_of(mask_mod)
    values = []
    try:
        for qi, ki in zip(q, kv):
            out = as_bool_result(mask_mod(_scalar(b), _scalar(h), _scalar(qi), _scalar(ki)), name, np)
            if tuple(out.shape) != ():
                return None
            values.append(bool(arrays.to_numpy(out)))
    except OmnicupyError:  # omnicupy's own refusals (a short lookup array, ...) say what is wrong
        raise
    except Exception:  # noqa: BLE001 - a broadcast-only mask_mod need not take scalars
        return None
    return np.array(values, dtype=bool)


class ScalarEvaluator:
    """The scalar mode for one build: picks the call form (rows or columns) on the first block that
    has real positions, checked against four-scalar calls, then evaluates blocks one by one. Index
    arrays are of ``xp`` (CuPy for a mask_mod whose tables are CuPy arrays), scalars NumPy ints."""

    def __init__(self, mask_mod: Callable, q_len: int, kv_len: int, qbs: int, kbs: int, xp: Any = np) -> None:
        self.mask_mod, self.q_len, self.kv_len, self.qbs, self.kbs = mask_mod, q_len, kv_len, qbs, kbs
        self.xp = xp
        self.along: Optional[str] = None

    def block(self, b: int, h: int, q0: int, kv0: int) -> np.ndarray:
        real_rows, real_cols = min(self.qbs, self.q_len - q0), min(self.kbs, self.kv_len - kv0)
        if self.along is None:
            return self._choose(b, h, q0, kv0, real_rows, real_cols)
        return scalar_block(self.mask_mod, b, h, q0, kv0, real_rows, real_cols, self.qbs, self.kbs, self.along,
                            self.xp)

    def _choose(self, b, h, q0, kv0, real_rows, real_cols) -> np.ndarray:
        name = name_of(self.mask_mod)
        found, errors = {}, {}
        for along in ("rows", "columns"):
            try:
                found[along] = scalar_block(self.mask_mod, b, h, q0, kv0, real_rows, real_cols, self.qbs, self.kbs,
                                            along, self.xp)
            except OmnicupyError as exc:
                if not isinstance(exc, BroadcastFailure):
                    raise
                errors[along] = exc
            except Exception as exc:  # noqa: BLE001
                errors[along] = exc
        r, c = sample_positions(real_rows, real_cols, seed=q0 * 7919 + kv0)
        truth = scalar_values(self.mask_mod, b, h, q0 + r, kv0 + c)
        agreeing = {a: v for a, v in found.items() if truth is None or np.array_equal(v[r, c], truth)}
        if not agreeing:
            detail = "; ".join(f"{a}: {type(e).__name__}: {e}" for a, e in errors.items())
            if found:
                detail += "; " + ", ".join(f"{a}: disagrees with calls on four scalars" for a in found)
            raise MaskError(f"mask_mod {name} cannot be evaluated in the scalar mode either ({detail}). {CONTRACT}")
        if len(agreeing) == 2 and not np.array_equal(agreeing["rows"], agreeing["columns"]):
            raise MaskError(f"mask_mod {name} gives different masks when called row by row and column by column; "
                            f"it is neither elementwise nor scalar-safe. {CONTRACT}")
        self.along = "rows" if "rows" in agreeing else "columns"
        return agreeing[self.along]


def scalar_calls(num_blocks: int, qbs: int, kbs: int) -> int:
    """Calls the scalar mode makes for ``num_blocks`` blocks (the cheaper form of each)."""
    return num_blocks * min(qbs, kbs)


def announce_fallback(mask_mod: Callable, reason: BaseException) -> None:
    logger.warning("mask_mod %s does not keep the broadcast contract (%s); evaluating it in the scalar mode, one "
                   "call per row or column of each evaluated block. Pass mode='scalar' to choose that mode "
                   "without this message.", name_of(mask_mod), str(reason).split(". omnicupy calls")[0])


__all__ = ["evaluate_grid", "ScalarEvaluator", "BroadcastFailure", "scalar_values", "sample_positions",
           "scalar_calls", "check_mode", "announce_fallback", "MODES", "AUTO_SCALAR_CALL_LIMIT", "CONTRACT", "logger"]
