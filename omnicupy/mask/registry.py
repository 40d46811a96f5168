"""Serial numbers for the objects a compiled framework graph must name by a plain value.

Every ``BlockMask`` and score modifier (``omnicupy.score_mods.ScoreMod``) takes a serial at
construction (``enroll``): a short string such as ``"BlockMask#17"``, unique for the life of the
process and never reused, so it names its object as ``id()`` cannot (an id comes back after the
object dies). A tracer such as torch's dynamo reads the attribute, guards on its value and hands
only plain values to the code that must run at trace time (omnicupy/torch.py), which finds the
object again (``find``). A string, not an int: dynamo makes an int read from a compiled
function's argument symbolic once it has seen two values (automatic dynamic shapes), and a
symbolic int is no longer a constant; a string always is.

The registry holds its objects weakly: enrolling keeps nothing alive. Whoever needs an object to
outlive its creator (adapters/specs.py, for graphs that may replay) keeps its own reference.

Knows serials and weak references; nothing of masks, modifiers or frameworks.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

from ..errors import ArgumentError

_lock = threading.Lock()
_serials = itertools.count(1)
_objects: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def enroll(obj: Any) -> str:
    """A new serial for ``obj`` (weakly referenced under it)."""
    with _lock:
        serial = f"{type(obj).__name__}#{next(_serials)}"
        _objects[serial] = obj
    return serial


def find(serial: str, kind: type) -> Any:
    """The live ``kind`` enrolled under ``serial``; ArgumentError when there is none (never
    enrolled, or collected since)."""
    obj = _objects.get(serial) if type(serial) is str else None
    if not isinstance(obj, kind):
        raise ArgumentError(f"no live {kind.__name__} has serial {serial!r} (serials come from "
                            f"omnicupy.mask.registry.enroll, at construction)")
    return obj


__all__ = ["enroll", "find"]
