"""What the JIT needs to know of a kernel: a name, a template and its values, a target arch.

The JIT renders, compiles, caches and loads anything of this shape; what the kernel computes is
the business of ``omnicupy.dispatch`` (which defines the variants) and ``omnicupy.ops``.
"""
from __future__ import annotations

from typing import Any, Protocol


class KernelSpec(Protocol):
    @property
    def name(self) -> str:
        """The kernel's ``extern "C"`` symbol, the cache entry's stem and the log line."""

    @property
    def template(self) -> str:
        """The template file under templates/ that renders the kernel."""

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the kernel is launched with."""

    def template_params(self) -> dict[str, Any]:
        """Every value the template reads."""

    def target_arch(self, arch: str) -> str:
        """The arch to compile for on a device of ``arch`` (may raise when it cannot run there)."""
