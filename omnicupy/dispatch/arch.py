"""What each GPU architecture offers: the one table of architecture capabilities, the one check of
an architecture name, and the current device's arch and multiprocessors.

``ARCHS`` lists every architecture omnicupy plans and builds for, with what the kernel families
need of it (mma.sync, wgmma, TMA), its opt-in shared memory per block and the multiprocessors of
its largest common part (the SM count assumed when planning without a device). A family names
the capabilities it needs (``FAMILY_NEEDS``); nothing else in the package tests architecture
names. ``check_arch`` is the one validation of a user's architecture name (``plan(arch=...)``,
``omnicupy precompile --arch``).

Input names are exactly the table's keys (``sm_80`` ... ``sm_120``) plus ``sm_90a``: the name of
the arch-specific target an H100/H200 runs, accepted as the sm_90 device (``plan``) or, for
``precompile``, as "only the variants built as sm_90a". ``SM_80``, ``compute_80``, ``80``,
``sm_75`` are refused with an ArchError that lists the supported names.

Knows compute capabilities and the families' hardware needs; nothing of masks or arrays.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from ..errors import ArgumentError
from ..jit import device_arch


class ArchError(ArgumentError):
    """An architecture name omnicupy does not plan or build for (or an NVRTC that cannot build it)."""


@dataclass(frozen=True)
class ArchCaps:
    """One architecture: its instructions, its shared memory, its usual SM count."""

    name: str  # "sm_90": what a device of this compute capability asks for
    number: int  # 90
    gpus: str  # for messages: the parts of this arch
    mma_sync: bool  # warp-level mma.sync m16n8k16 with cp.async and ldmatrix (sm_80+)
    wgmma: bool  # Hopper's warpgroup MMA (compiled for the arch-specific target only)
    tma: bool  # tensor memory accelerator loads through driver-encoded tensor maps
    smem_optin: int  # bytes of dynamic shared memory one block may opt in to
    sm_count: int  # multiprocessors of the largest common part (planning without a device)
    #: The arch-specific target code using wgmma is compiled for (None: no such code here).
    specific: Optional[str] = None


KB = 1024
#: The architectures omnicupy plans and builds for. Opt-in shared memory per block from the CUDA
#: C++ Programming Guide's table of compute capabilities (8.0/8.7: 163 KB; 8.6/8.9/12.0: 99 KB;
#: 9.0/10.0: 227 KB). Blackwell (sm_100, sm_120) has TMA but no wgmma: it runs the mma.sync
#: family until a kernel of its own lands (a new family is a spec module and a FAMILY_NEEDS line).
ARCHS: dict[str, ArchCaps] = {a.name: a for a in (
    ArchCaps("sm_80", 80, "A100, A30", True, False, False, 163 * KB, 108),
    ArchCaps("sm_86", 86, "RTX 30xx, A10, A40", True, False, False, 99 * KB, 84),
    ArchCaps("sm_87", 87, "Jetson Orin", True, False, False, 163 * KB, 16),
    ArchCaps("sm_89", 89, "L4, L40S, RTX 40xx", True, False, False, 99 * KB, 142),
    ArchCaps("sm_90", 90, "H100, H200, GH200", True, True, True, 227 * KB, 132, specific="sm_90a"),
    ArchCaps("sm_100", 100, "B200, GB200", True, False, True, 227 * KB, 148),
    ArchCaps("sm_120", 120, "RTX 50xx, RTX PRO 6000", True, False, True, 99 * KB, 170),
)}
#: Arch-specific target name -> the arch whose devices run it.
SPECIFIC = {a.specific: a.name for a in ARCHS.values() if a.specific}
#: What each kernel family needs of the arch (ArchCaps attribute names).
FAMILY_NEEDS: dict[str, tuple[str, ...]] = {"sync": ("mma_sync",), "wgmma": ("wgmma",), "tma": ("wgmma", "tma")}
#: Assumed for an architecture the table does not list (a newer device asking for its own name):
#: the mma.sync family and the smallest shared memory of the table.
_UNLISTED = dict(mma_sync=True, wgmma=False, tma=False, smem_optin=99 * KB, sm_count=132)


def supported_names() -> tuple[str, ...]:
    """Every name ``check_arch`` accepts, in table order."""
    return (*ARCHS, *SPECIFIC)


def check_arch(arch: object, name: str = "arch") -> str:
    """A user's architecture name, checked: one of ARCHS or an arch-specific target (``sm_90a``),
    returned as given; else ArchError naming the supported ones."""
    if isinstance(arch, str) and (arch in ARCHS or arch in SPECIFIC):
        return arch
    raise ArchError(f"{name} {arch!r} is not supported; omnicupy plans and builds for {', '.join(supported_names())} "
                    f"(exact names, lower case; sm_90a is the target an H100/H200 runs)")


def caps(arch: str) -> ArchCaps:
    """The capabilities of ``arch`` (a table name, an arch-specific target, or a device's own name
    the table does not list: then the conservative _UNLISTED row)."""
    arch = SPECIFIC.get(arch, arch)
    found = ARCHS.get(arch)
    if found is not None:
        return found
    digits = arch[3:] if arch.startswith("sm_") else ""
    number = int(digits) if digits.isdigit() else 0
    return ArchCaps(arch, number, "unlisted", **_UNLISTED)  # type: ignore[arg-type]


def runs_family(arch: Optional[str], family: str) -> bool:
    """Whether ``family``'s kernels run on ``arch`` (None: unknown, nothing beyond mma.sync assumed)."""
    if arch is None:
        return family == "sync"
    c = caps(arch)
    return all(getattr(c, need) for need in FAMILY_NEEDS[family])


def build_target(arch: str, family: str) -> Optional[str]:
    """The arch ``family``'s code is compiled as for a device of ``arch``: the arch-specific target
    for wgmma code, the arch itself otherwise; None when the family does not run there."""
    if not runs_family(arch, family):
        return None
    c = caps(arch)
    return c.specific if "wgmma" in FAMILY_NEEDS[family] and c.specific else SPECIFIC.get(arch, arch)


def has_wgmma(arch: str) -> bool:
    """Whether ``arch`` runs wgmma code (tests and tools ask this; dispatch asks ``runs_family``)."""
    return caps(arch).wgmma


def smem_limit(arch: str) -> int:
    """Opt-in shared memory per block on ``arch``, bytes."""
    return caps(arch).smem_optin


#: The shared memory the Hopper families' tile formulas are fitted to (their only arch).
HOPPER_SMEM = ARCHS["sm_90"].smem_optin


@functools.lru_cache(maxsize=None)
def arch_of_device(device_id: int) -> str:
    """The arch kernels are compiled for on CUDA device ``device_id`` (asked once per device)."""
    return device_arch(device_id)


#: Multiprocessors assumed when planning without a GPU or an arch (H100 SXM / H200; the others'
#: counts differ but a persistent launch of more CTAs than SMs is only a second, short wave).
DEFAULT_SM_COUNT = ARCHS["sm_90"].sm_count


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


__all__ = ["ARCHS", "ArchCaps", "ArchError", "FAMILY_NEEDS", "SPECIFIC", "build_target", "caps", "check_arch",
           "current_arch", "has_wgmma", "runs_family", "sm_count", "smem_limit", "supported_names",
           "arch_of_device", "DEFAULT_SM_COUNT", "HOPPER_SMEM"]
