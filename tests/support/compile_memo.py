"""One NVRTC compile per distinct input in a test session, shared by every test and xdist worker.

NVRTC is deterministic: the same source, kernel name, arch, options and header bytes give the same
cubin and ptxas log. Several test modules compile the same kernels (the shipped forward variants in
test_compile and test_tma, the backward ones in test_backward_host and test_backward_wgmma), each
into a kernel cache of its own so that the cache itself stays under test; with this memo the later
requests read the first one's CompileResult instead of compiling again. Every check still runs on a
real NVRTC result. The key covers everything that reaches NVRTC, the headers' bytes included (a test
that edits a copy of kernels/ gets its own compile); failures are never kept. Entries are pickles
in a folder that all workers of one session share, written atomically under a per-key file lock,
so two workers asking for the same kernel compile it once.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Sequence

from filelock import FileLock


def _headers_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*")):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class CompileMemo:
    """A drop-in for ``omnicupy.jit.compiler.compile_cubin`` that compiles each distinct input once."""

    def __init__(self, folder: Path, compile_fn: Callable[..., Any]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.compile_fn = compile_fn
        self.hits = 0
        self.compiles = 0

    def key(self, source: str, name: str, arch: str, include_dirs: Sequence[Path], extra_options: Sequence[str]) -> str:
        parts = [source, name, str(arch), *map(str, include_dirs), *map(_headers_digest, include_dirs),
                 "\0".join(extra_options)]
        return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:32]

    def __call__(self, source: str, *, name: str, arch: str, include_dirs: Sequence[Path] = (),
                 extra_options: Sequence[str] = ()) -> Any:
        path = self.folder / f"{self.key(source, name, arch, include_dirs, extra_options)}.pickle"
        with FileLock(str(path) + ".lock"):
            if path.exists():
                self.hits += 1
                return pickle.loads(path.read_bytes())
            result = self.compile_fn(source, name=name, arch=arch, include_dirs=include_dirs,
                                     extra_options=extra_options)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_bytes(pickle.dumps(result))
            os.replace(partial, path)
            self.compiles += 1
            return result
