"""What each GPU architecture can run: the wgmma rule, shared-memory limits, the current device's arch.

Knows compute capabilities and the families' hardware needs; nothing of masks or arrays.
"""
from __future__ import annotations

import functools

from ..jit import device_arch
from ..jit.compiler import arch_number, normalize_arch

#: Opt-in shared memory per block (bytes) by compute capability; others get the smallest.
SMEM_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DEFAULT_SMEM_LIMIT = 99 * 1024


def has_wgmma(arch: str) -> bool:
    """Whether code for ``arch`` ('sm_90', '90', 'sm_90a', ...) can use wgmma: sm_90 only (as sm_90a)."""
    return normalize_arch(arch).rstrip("a") == "sm_90"


def smem_limit(arch: str) -> int:
    return SMEM_LIMITS.get(arch_number(arch), DEFAULT_SMEM_LIMIT)


@functools.lru_cache(maxsize=None)
def arch_of_device(device_id: int) -> str:
    """The arch kernels are compiled for on CUDA device ``device_id`` (asked once per device)."""
    return device_arch(device_id)


#: Multiprocessors assumed when planning without a GPU (H100 SXM / H200; the others' counts differ
#: but a persistent launch of more CTAs than SMs is only a second, short wave).
DEFAULT_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    from .. import arrays

    cp = arrays.cupy_module()
    return int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def sm_count() -> int:
    """The current device's multiprocessors (asked once per device), or DEFAULT_SM_COUNT without one."""
    try:
        from .. import arrays

        return _sm_count(arrays.cupy_module().cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001 - no CuPy, driver or device: planning on the CPU
        return DEFAULT_SM_COUNT


def current_arch() -> str:
    from .. import arrays

    return arch_of_device(arrays.cupy_module().cuda.runtime.getDevice())


__all__ = ["has_wgmma", "smem_limit", "arch_of_device", "current_arch", "sm_count", "SMEM_LIMITS"]
