"""render -> NVRTC compile -> on-disk cache -> loaded kernel.

``build(variant, arch)`` needs no GPU (CI compiles every shipped variant this way);
``get_kernel(variant)`` compiles or loads for the current device and keeps the loaded function. A
variant is any object with ``name``, ``template``, ``template_params()``, ``target_arch(arch)`` and
``smem_bytes``. Diagnostics go to the ``omnicupy.jit`` logger (``OMNICUPY_VERBOSE=1``: DEBUG on stderr).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from typing import Optional

from .._version import __version__
from ..errors import CacheError, CompileError, NoGPUError
from . import env
from .cache import CACHE_FORMAT, CacheEntry, DiskCache
from .compiler import CompileResult, arch_number, compile_cubin, normalize_arch, nvrtc_version, supported_archs
from .loader import LoadedKernel
from .render import headers_digest_material, render_source
from .spec import KernelSpec

__all__ = [
    "KernelSpec", "build", "get_kernel", "device_arch", "default_cache", "cache_stem", "CacheEntry", "DiskCache",
    "LoadedKernel", "MIN_ARCH", "DEFAULT_DYNAMIC_SMEM", "opt_in_shared_memory",
]

#: The kernels use cp.async, ldmatrix and mma.sync m16n8k16 with bf16: Ampere (sm_80) or newer.
MIN_ARCH = 80

_log = logging.getLogger(__name__)
env.configure_logging()


def default_cache() -> DiskCache:
    return DiskCache(env.cache_dir())


def _compile_options() -> tuple[str, ...]:
    return ("-lineinfo",) if env.lineinfo() else ()


def cache_stem(variant: KernelSpec, arch: str, source: Optional[str] = None) -> str:
    """``<variant name>-<arch>-<hash>``; the hash covers everything that changes the binary."""
    source = render_source(variant) if source is None else source
    material = "\n".join(
        [
            source,
            headers_digest_material(),
            normalize_arch(arch),
            " ".join(_compile_options()),
            ".".join(map(str, nvrtc_version())),
            __version__,
            str(CACHE_FORMAT),
        ]
    )
    digest = hashlib.sha256(material.encode()).hexdigest()[:16]
    return f"{variant.name}-{normalize_arch(arch)}-{digest}"


_padded_logged: set[tuple[int, int]] = set()


def _log_padded_once(variant: KernelSpec) -> None:
    """Padded head dims (Variant.head_dim_valid) are not precompiled by default: say once per head dim
    and process that their kernels compile on first use, and how to precompile them."""
    valid, tile = getattr(variant, "head_dim_valid", None), getattr(variant, "head_dim", None)
    if valid is None or (valid, tile) in _padded_logged:
        return
    _padded_logged.add((valid, tile))
    _log.info("omnicupy: head dim %d runs padded on the %d-column tile; its kernels compile on first use "
              "(omnicupy precompile --head-dims %d builds them ahead)", valid, tile, valid)


def build(variant: KernelSpec, arch: str, cache: Optional[DiskCache] = None, *,
          must_store: bool = False) -> tuple[CacheEntry, bool]:
    """Render and compile ``variant`` for ``arch`` into the cache (no GPU needed).

    Returns ``(entry, built)``; ``built`` is False on a cache hit. ``entry.data`` holds the verified
    cubin. When the cache cannot be written the entry lives in memory only (``entry.stored`` is False,
    one logged warning per process) unless ``must_store`` asks for a CacheError instead."""
    env.check_all()  # OMNICUPY_KEEP_SOURCE=maybe is refused on a cache hit too
    cache = cache or default_cache()
    arch = variant.target_arch(normalize_arch(arch))
    source = render_source(variant)
    stem = cache_stem(variant, arch, source)

    def compile_entry() -> tuple[bytes, dict]:
        start = time.perf_counter()
        result: CompileResult = compile_cubin(source, name=variant.name, arch=arch,
                                              include_dirs=[env.kernels_dir()], extra_options=_compile_options())
        seconds = time.perf_counter() - start
        _log.debug("compiled %s for %s in %.2f s (%s registers)", variant.name, arch, seconds, result.registers)
        meta = {
            "variant": variant.template_params(),
            "kernel": variant.name,
            "arch": arch,
            "nvrtc": ".".join(map(str, nvrtc_version())),
            "omnicupy": __version__,
            "compile_seconds": round(seconds, 3),
            "registers": result.registers,
            "spill_bytes": result.spill_bytes,
            "options": list(result.options),
        }
        return result.cubin, meta

    entry, built = cache.get_or_build(stem, compile_entry, must_store=must_store)
    if built:
        _log_padded_once(variant)
    if not built:
        _log.debug("cache hit %s", stem)
    elif env.keep_source() and entry.stored:
        try:
            cache.keep_source(stem, source)
        except (OSError, CacheError) as exc:  # a debugging aid: never a reason to fail
            _log.warning("could not keep the source of %s: %s", stem, exc)
    return entry, built


@functools.lru_cache(maxsize=None)
def _device_arch(device_id: int) -> str:
    import cupy

    device = cupy.cuda.Device(device_id)
    cc = int(device.compute_capability)
    if cc < MIN_ARCH:
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise NoGPUError(f"GPU {device_id} ({name}) has compute capability {cc // 10}.{cc % 10}; omnicupy's kernels "
                         f"need {MIN_ARCH // 10}.{MIN_ARCH % 10} (sm_{MIN_ARCH}, Ampere) or newer")
    # A cubin runs on its own major version only, on minors at or above its own.
    usable = [a for a in supported_archs() if a // 10 == cc // 10 and a <= cc]
    if not usable:
        raise CompileError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot compile for GPU {device_id} "
                           f"(compute capability {cc // 10}.{cc % 10}); install a CUDA toolkit wheel that knows "
                           f"sm_{cc}")
    return f"sm_{max(usable)}"


def device_arch(device_id: Optional[int] = None) -> str:
    """The arch to compile for on a CUDA device: its own, or the newest minor of its major that this
    NVRTC knows. NoGPUError for GPUs older than sm_80."""
    if device_id is None:
        import cupy

        device_id = cupy.cuda.runtime.getDevice()
    return _device_arch(int(device_id))


_loaded: dict = {}
_loaded_lock = threading.Lock()


#: Dynamic shared memory a kernel may use without opting in (CUDA's default limit).
DEFAULT_DYNAMIC_SMEM = 48 * 1024


def opt_in_shared_memory(kernel: LoadedKernel, smem_bytes: int) -> None:
    """Let ``kernel`` launch with ``smem_bytes`` of dynamic shared memory: above the default 48 KB
    the driver wants the kernel's limit raised first (per function, once)."""
    if smem_bytes > DEFAULT_DYNAMIC_SMEM:
        kernel.max_dynamic_shared_size_bytes = smem_bytes


def get_kernel(variant: KernelSpec) -> LoadedKernel:
    """A callable kernel for ``variant`` on the current device, compiled or loaded from the cache.
    The module is loaded from the bytes the cache verified, never from the file again."""
    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    key = (variant, device_id)
    kernel = _loaded.get(key)
    if kernel is not None:
        return kernel
    with _loaded_lock:
        kernel = _loaded.get(key)
        if kernel is None:
            entry, _ = build(variant, device_arch(device_id))
            kernel = LoadedKernel(entry.data, variant.name)
            opt_in_shared_memory(kernel, variant.smem_bytes)
            _loaded[key] = kernel
    return kernel
