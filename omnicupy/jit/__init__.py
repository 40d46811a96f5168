"""render -> NVRTC compile -> on-disk cache -> loaded kernel.

``build(variant, arch)`` needs no GPU (CI compiles every shipped variant this way);
``get_kernel(variant)`` compiles or loads for the current device and keeps the loaded function.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import time
from typing import Optional

from .._version import __version__
from . import env
from .cache import CACHE_FORMAT, CacheEntry, DiskCache
from .compiler import CompileResult, arch_number, compile_cubin, normalize_arch, nvrtc_version, supported_archs
from .render import headers_digest_material, render_source
from .spec import KernelSpec

__all__ = [
    "KernelSpec", "build", "get_kernel", "device_arch", "default_cache", "cache_stem", "CacheEntry", "DiskCache",
]


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


def _log(message: str) -> None:
    if env.verbose():
        print(f"[omnicupy] {message}", file=sys.stderr)


def build(variant: KernelSpec, arch: str, cache: Optional[DiskCache] = None) -> tuple[CacheEntry, bool]:
    """Render and compile ``variant`` for ``arch`` into the cache (no GPU needed).

    Returns ``(entry, built)``; ``built`` is False on a cache hit."""
    cache = cache or default_cache()
    arch = variant.target_arch(normalize_arch(arch))
    source = render_source(variant)
    stem = cache_stem(variant, arch, source)

    def compile_entry() -> tuple[bytes, dict]:
        start = time.perf_counter()
        result: CompileResult = compile_cubin(source, name=variant.name, arch=arch,
                                              include_dirs=[env.kernels_dir()], extra_options=_compile_options())
        seconds = time.perf_counter() - start
        _log(f"compiled {variant.name} for {arch} in {seconds:.2f} s ({result.registers} registers)")
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
        if env.keep_source():
            cache.dir.mkdir(parents=True, exist_ok=True)
            (cache.dir / f"{stem}.cu").write_text(source)
        return result.cubin, meta

    entry, built = cache.get_or_build(stem, compile_entry)
    if not built:
        _log(f"cache hit {stem}")
    return entry, built


def device_arch(device_id: Optional[int] = None) -> str:
    """The arch to compile for on a CUDA device: its own, capped at what this NVRTC knows."""
    import cupy

    device = cupy.cuda.Device(device_id)
    cc = int(device.compute_capability)
    usable = [a for a in supported_archs() if a <= cc]
    if not usable:
        raise RuntimeError(f"NVRTC cannot compile for this device (compute capability {cc})")
    return f"sm_{max(usable)}"


_loaded: dict = {}
_loaded_lock = threading.Lock()


def get_kernel(variant: KernelSpec):
    """A ``cupy.RawKernel`` for ``variant`` on the current device, compiled or loaded from the cache."""
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
            module = cupy.RawModule(path=str(entry.binary_path))
            kernel = module.get_function(variant.name)
            if variant.smem_bytes > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = variant.smem_bytes
            _loaded[key] = kernel
    return kernel
