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


class VariantError(OmnicupyError, ValueError):
    """A kernel variant that cannot exist (inconsistent tile, unknown family) or cannot run on an arch."""


class ExpressionError(ArgumentError):
    """A CUDA expression (cuda_mask, cuda_score, a mask's cuda_expr), one of its constants or one of
    its lookup arrays is refused; the message names the offending token, constant or array."""


class SizeLimitError(ArgumentError):
    """An input larger than the kernels can index (32-bit positions, grid limits), refused before
    anything is copied to the device."""


class AliasError(ArgumentError):
    """An output buffer that shares memory with an input or another output, or whose own elements
    overlap (a zero or self-overlapping stride)."""


class KVCacheError(ArgumentError):
    """A KV cache's metadata that does not fit the cache: kv_lens beyond the cache or its page table,
    page ids outside the page pool (omnicupy.paged_attention, attention(kv_lens=...))."""


class CacheError(OmnicupyError):
    """The kernel cache folder cannot be used: not yours, writable by others, not a folder, not writable.
    attention() never fails over it (the kernel is kept in memory); ``omnicupy precompile`` and
    ``omnicupy cache`` report it."""


class HeadDimError(ArgumentError):
    """A head dim the kernels cannot take: not a multiple of 8 (rows must be whole 16-byte chunks)
    or outside 8..256."""


class MissingDependencyError(OmnicupyError, ImportError):
    """An optional dependency an omnicupy module needs is not installed (torch for omnicupy.torch,
    jax for omnicupy.jax); the message names the install extra."""


class InternalError(OmnicupyError, RuntimeError):
    """A state omnicupy's own code should never reach (a bug, not bad input): please report it."""
