"""The registry of call options: what a framework operator needs besides its tensors.

torch's custom operators and XLA's custom calls take tensors and a few scalar types, not Python
objects such as a ``BlockMask`` or a score modifier. The adapters therefore register the call's
non-tensor options once (``register``) and hand the operator a small integer key; the operator
looks the options up (``lookup``) when it runs. The key is a constant of the traced graph (torch)
or an attribute of the custom call (XLA), so a compiled graph holds no Python object.

Why a registry and not torch's opaque objects: those live in a private module
(``torch._library.opaque_object``) whose API changed between torch 2.10, 2.11 and 2.13, and XLA has
no equivalent; one mechanism serves both frameworks with public APIs only.

Equal options get the same key (the mask and the score modifier are compared by identity, i.e.
their serials of omnicupy/mask/registry.py; the rest by value), so re-tracing a model does not
grow the registry; the registry keeps what it holds alive for the life of the process (a compiled
graph may replay any time).
A mask's metadata is immutable (a BlockMask owns copies of its arrays), so the key alone names it.

Knows omnicupy's call options; nothing of torch, JAX or kernels.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ArgumentError
from ..mask import BlockMask


@dataclass(frozen=True, eq=False)
class CallSpec:
    """The non-tensor options of one attention call (forward and backward read the same spec)."""

    block_mask: Optional[BlockMask] = None
    causal: Any = False
    scale: Optional[float] = None
    score_mod: Any = None
    deterministic: bool = False
    fuse_mask: bool = False
    #: decode: a split count (None: the heuristic); paged: also the cache layout and window
    num_splits: Optional[int] = None
    layout: str = "NHD"
    window: Optional[int] = None
    validate: bool = False

    def identity(self) -> tuple:
        """What makes two specs the same: mask and score modifier by identity (their serial,
        mask/registry.py; a foreign object's id, which the registry's reference keeps its own), the
        rest by value and type (True and 1 are equal keys in a dict, not equal options)."""
        values = (self.causal, self.scale, self.deterministic, self.fuse_mask, self.num_splits, self.layout,
                  self.window, self.validate)
        return (_name(self.block_mask), _name(self.score_mod), values, tuple(type(x) for x in values))


def _name(obj: Any) -> Any:
    if obj is None:
        return None
    serial = getattr(obj, "serial", None)
    return ("serial", serial) if type(serial) is str else ("id", id(obj))


_lock = threading.Lock()
_by_identity: dict[tuple, int] = {}
_specs: list[CallSpec] = []


def register(spec: CallSpec) -> int:
    """The key of ``spec`` (a new one the first time these options are seen)."""
    if spec.block_mask is not None and not isinstance(spec.block_mask, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(spec.block_mask).__name__}")
    ident = spec.identity()
    with _lock:
        key = _by_identity.get(ident)
        if key is None:
            key = _by_identity[ident] = len(_specs)
            _specs.append(spec)  # holds the mask and modifier: their ids stay theirs
    return key


def lookup(key: int) -> CallSpec:
    """The spec registered under ``key``."""
    try:
        return _specs[int(key)]
    except (IndexError, ValueError, TypeError):
        raise ArgumentError(f"no omnicupy call spec has key {key!r} (keys come from adapters.specs.register)") from None


__all__ = ["CallSpec", "lookup", "register"]
