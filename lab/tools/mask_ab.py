"""Mask-build host time, this tree against an earlier commit, in one process (CPU; lab/notes/masks.md#s19).

    python lab/tools/mask_ab.py --base HEAD~3 [--sizes 8192 131072] [--xp numpy|stub|cupy] [--rounds 15]

The earlier commit's ``omnicupy`` package is extracted (``git archive``) into a temporary folder and
imported as ``omnicupy_base`` (``--base`` may also name a folder that holds an extracted ``omnicupy``,
for a machine without the repository's history, such as the lent GPU); both builders then build the same workloads (``bench_masks.workload``)
in alternating rounds, so that drift of the machine falls on both alike. Printed per mask and N:
minimum and median ms of single builds, and the median minor page faults per build (fresh pages of
large temporaries can cost more than the arithmetic: whether a build meets them depends on the
allocator's state, which is why the minimum is the number to compare).

``--xp stub`` (or ``--device``) times the CuPy path's host work without a GPU: the builders take
their device branch with a stub backend whose layout and uploads cost nothing (the stand-in for the
layout kernel's launch), so what is timed is everything the host does before it. ``--xp cupy`` builds
on the GPU, each build synchronized (what bench_masks.py times).
"""
from __future__ import annotations

import argparse
import importlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import bench_masks  # noqa: E402

MASKS = ("causal", "sliding_window_1024", "document", "interleaved")


def base_package(rev: str, folder: Path) -> str:
    """``omnicupy`` at ``rev`` (a git revision, or a folder holding an ``omnicupy`` package) as
    ``folder/omnicupy_base``; its module name."""
    if (Path(rev) / "omnicupy").is_dir():
        shutil.copytree(Path(rev) / "omnicupy", folder / "omnicupy_base")
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "omnicupy", "kernels", "templates"],
                                 check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
        (folder / "omnicupy").rename(folder / "omnicupy_base")
    for sources in ("kernels", "templates"):  # the mask kernels' sources, beside the package (jit/env.py)
        if not (folder / sources).is_dir():
            shutil.copytree(Path(rev) / sources if (Path(rev) / sources).is_dir() else REPO / sources, folder / sources)
    sys.path.insert(0, str(folder))
    return "omnicupy_base"


class _HostModule:
    """Behaves as NumPy but is not NumPy: the builders take their device branch."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def stub_device(package: str, xp: _HostModule) -> None:
    """Point ``package``'s builders at a backend whose layout and uploads cost nothing."""
    kernels = importlib.import_module(f"{package}.mask.kernels")
    builders = importlib.import_module(f"{package}.mask.builders")

    class Stub(kernels.EmulatedBackend):
        def __init__(self) -> None:
            super().__init__(np)
            self.outputs: dict = {}

        def upload(self, a):
            return a

        def layout(self, table, rows, max_blocks, segments, with_partial):
            if (rows, max_blocks) not in self.outputs:
                self.outputs[rows, max_blocks] = (np.zeros(rows, np.int32),) + tuple(
                    np.zeros((rows, max_blocks), np.int32) for _ in range(3))
            nb, idx, types, pidx = self.outputs[rows, max_blocks]
            return nb, idx, types, pidx if with_partial else None

        # Builds from pieces (pieces_build.py): the scan's read back emulated once per input and
        # then replayed, the layout kernel's outputs as above (what is timed is the host's part).
        def pieces_scan(self, pieces, piece_count, sizes, capacity):
            key = ("scan", pieces.tobytes(), sizes, capacity)
            if key not in self.outputs:
                self.outputs[key] = super().pieces_scan(pieces, piece_count, sizes, capacity)
            return self.outputs[key]

        def pieces_layout(self, pieces, piece_count, sizes, lookup, unique, max_blocks):
            rows = -(-sizes[0] // sizes[2])
            nb, idx, types, pidx = self.layout(None, rows, max_blocks, 0, True)
            if ("pool", unique, sizes) not in self.outputs:
                self.outputs["pool", unique, sizes] = np.zeros((unique, sizes[2], sizes[3] // 32), np.uint32)
            return nb, idx, types, pidx if unique else None, self.outputs["pool", unique, sizes] if unique else None

    from omnicupy.mask import build_pass  # where _Build asks for its backend (since the builders split)

    stub, real = Stub(), build_pass.backend_for
    build_pass.backend_for = lambda module: stub if module is xp else real(module)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def compare(builds: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, tuple[float, float, float]]:
    """{name: (min ms, median ms, median faults)} of builds timed in alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    faults: dict[str, list[int]] = {name: [] for name in builds}
    for build in builds.values():
        build()
    for _ in range(rounds):
        for name, build in builds.items():
            for _ in range(per_round):
                f0, t0 = minor_faults(), time.perf_counter()
                build()
                times[name].append((time.perf_counter() - t0) * 1e3)
                faults[name].append(minor_faults() - f0)
    return {name: (min(times[name]), statistics.median(times[name]), statistics.median(faults[name]))
            for name in builds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 131072])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--xp", choices=("numpy", "stub", "cupy"), default="numpy",
                        help="numpy: the host path; stub: the device branch's host work (no GPU); cupy: on the GPU")
    parser.add_argument("--device", action="store_true", help="the same as --xp stub")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        packages = {"base": base_package(args.base, Path(folder)), "tree": "omnicupy"}
        kind = "stub" if args.device else args.xp
        xp = {"numpy": np, "stub": _HostModule()}.get(kind)
        sync = lambda: None  # noqa: E731 - nothing to wait for on the host
        if kind == "stub":
            for package in packages.values():
                stub_device(package, xp)
        elif kind == "cupy":
            import cupy as xp

            sync = xp.cuda.Device().synchronize
        print(f"{'mask':<22} {'N':>7} {'base min':>9} {'tree min':>9} {'base med':>9} {'tree med':>9} "
              f"{'min ratio':>9} {'faults base/tree':>17}")
        for n in args.sizes:
            for name in args.masks:
                builds = {}
                for label, package in packages.items():
                    bench_masks.masks = importlib.import_module(f"{package}.masks")
                    mod = bench_masks.workload(name, n)
                    from_mask_mod = importlib.import_module(f"{package}.mask.builders").from_mask_mod
                    builds[label] = (lambda f=from_mask_mod, m=mod: (f(m, None, None, n, n, xp=xp), sync()))
                result = compare(builds, args.rounds if n < 100_000 else max(args.rounds // 3, 2), 5)
                (b_min, b_med, b_flt), (t_min, t_med, t_flt) = result["base"], result["tree"]
                print(f"{name:<22} {n:>7} {b_min:>9.3f} {t_min:>9.3f} {b_med:>9.3f} {t_med:>9.3f} "
                      f"{b_min / t_min:>8.2f}x {b_flt:>8.0f}/{t_flt:<8.0f}")


if __name__ == "__main__":
    main()
