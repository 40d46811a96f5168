"""Exceptions raised by omnicupy. Each message names the argument or variant at fault."""
from __future__ import annotations


class OmnicupyError(Exception):
    """Base class of every omnicupy error."""


class ArgumentError(OmnicupyError, ValueError):
    """A bad argument to attention() or the low-level launch, caught before any launch."""


class MaskError(ArgumentError):
    """Block-mask metadata that is malformed or inconsistent with the inputs."""


class CompileError(OmnicupyError, RuntimeError):
    """NVRTC rejected a rendered kernel; the message carries the log and the variant."""


class NoGPUError(OmnicupyError, RuntimeError):
    """A GPU is needed and none is usable (no CuPy, no driver or no device)."""


class CacheError(OmnicupyError):
    """The kernel cache folder cannot be used: not yours, writable by others, not a folder, not writable.
    attention() never fails over it (the kernel is kept in memory); ``omnicupy precompile`` and
    ``omnicupy cache`` report it."""
