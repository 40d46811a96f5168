"""Compile and cache timings, CPU only (no GPU needed):

1. cold compile of every variant of the default precompile set (tiles.shipped_variants() for sm_80 and
   sm_90), one at a time in this process against an empty cache: median, spread, total;
2. a cache hit in a new process: ``import omnicupy.jit; build(variant, arch)`` in a fresh interpreter
   against the warm cache: the build() call alone; build() after ``import cupy`` (as in any process
   that calls attention()); build() with NVRTC already loaded; and the whole process;
3. ``omnicupy precompile`` of the default set with ``--jobs 2`` into an empty cache (wall time).

    python benchmarks/bench_compile.py [--archs sm_80,sm_90] [--jobs 2] [--hits 9] [--json out.json]

Goals (issue "CLI, variant cache"): cache hit <= 20 ms; the default set precompiles in <= 2 minutes
on the 2-core CI machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from omnicupy import jit  # noqa: E402
from omnicupy.dispatch import tiles  # noqa: E402
from omnicupy.errors import CompileError  # noqa: E402
from omnicupy.jit import DiskCache  # noqa: E402
from omnicupy.jit.compiler import nvrtc_version  # noqa: E402

#: Run in a fresh interpreter against a warm cache; prints the in-process timings as JSON.
HIT_SCRIPT = """\
import json, sys, time
t0 = time.perf_counter()
import omnicupy.jit as jit
from omnicupy.dispatch.variant import Variant
t1 = time.perf_counter()
if sys.argv[3] == "cupy":
    import cupy  # a process that calls attention() has imported CuPy already
elif sys.argv[3] == "preload":
    jit.nvrtc_version()  # what the key needs; loading NVRTC is most of a cold hit
t2 = time.perf_counter()
entry, built = jit.build(Variant(**json.loads(sys.argv[1])), sys.argv[2])
t3 = time.perf_counter()
assert not built, "expected a cache hit"
print(json.dumps({"import": t1 - t0, "preload": t2 - t1, "build": t3 - t2}))
"""


def child_env(cache_dir: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    environ = dict(os.environ, OMNICUPY_CACHE_DIR=str(cache_dir), PYTHONPATH=path)
    environ.pop("OMNICUPY_VERBOSE", None)
    return environ


def cold_compiles(variants, archs, cache_dir: Path) -> list[dict]:
    os.environ["OMNICUPY_CACHE_DIR"] = str(cache_dir)
    nvrtc_version()  # load NVRTC before the clock starts
    cache = DiskCache(cache_dir)
    rows = []
    for i, (variant, arch) in enumerate((v, a) for a in archs for v in variants):
        start = time.perf_counter()
        try:
            entry, built = jit.build(variant, arch, cache)
        except CompileError as exc:
            rows.append({"variant": variant.name, "arch": arch, "failed": str(exc).splitlines()[0]})
            print(f"\n  failed: {rows[-1]['failed']}", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        assert built
        rows.append({"variant": variant.name, "arch": arch, "head_dim": variant.head_dim, "seconds": seconds,
                     "bytes": entry.size, "registers": entry.meta.get("registers")})
        print(f"\r  cold compile {i + 1}/{len(variants) * len(archs)}  {variant.name} {arch}  {seconds:.2f} s ",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows


def cache_hits(variant, arch, cache_dir: Path, repeats: int, mode: str) -> dict:
    params = {k: v for k, v in variant.template_params().items() if k != "variant_name"}
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", HIT_SCRIPT, json.dumps(params), arch, mode],
                                capture_output=True, text=True, env=child_env(cache_dir), check=True)
        whole = time.perf_counter() - start
        runs.append(dict(json.loads(result.stdout), process=whole))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def precompile_wall(archs, jobs: int, cache_dir: Path) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "omnicupy", "precompile", "--arch", ",".join(archs),
                             "--jobs", str(jobs), "--quiet"], capture_output=True, text=True,
                            env=child_env(cache_dir), cwd=REPO)
    seconds = time.perf_counter() - start
    failures = [line for line in result.stderr.splitlines() if line.startswith("failed:")]
    if result.returncode != 0 and not failures:
        raise SystemExit(f"omnicupy precompile failed:\n{result.stderr}")
    return seconds, result.stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="sm_80,sm_90", help="archs of the default set (default sm_80,sm_90)")
    parser.add_argument("--jobs", type=int, default=2, help="--jobs for the precompile run (default 2)")
    parser.add_argument("--hits", type=int, default=9, help="fresh processes per cache-hit timing (default 9)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",")]
    variants = tiles.shipped_variants()
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"NVRTC {'.'.join(map(str, nvrtc_version()))}; default set: {len(variants)} variants x {len(archs)} archs; "
          f"load average {os.getloadavg()[0]:.2f} (other work on the machine skews the timings)")

    with tempfile.TemporaryDirectory(prefix="omnicupy-bench-") as tmp:
        warm = Path(tmp) / "serial"
        cold = cold_compiles(variants, archs, warm)
        failed = [r for r in cold if "failed" in r]
        cold = [r for r in cold if "failed" not in r]
        if failed:
            print(f"{len(failed)} variants failed to compile and are left out: "
                  + ", ".join(f"{r['variant']} {r['arch']}" for r in failed))
        times = [r["seconds"] for r in cold]
        by_hd = {hd: statistics.median(r["seconds"] for r in cold if r["head_dim"] == hd)
                 for hd in sorted({r["head_dim"] for r in cold})}
        print(f"cold compile per variant: median {statistics.median(times):.2f} s, min {min(times):.2f} s, "
              f"max {max(times):.2f} s, total {sum(times):.1f} s for {len(times)} (one at a time)")
        print("  median by head dim: " + ", ".join(f"hd{hd} {s:.2f} s" for hd, s in by_hd.items()))
        print(f"  cubin size: median {statistics.median(r['bytes'] for r in cold) / 1024:.0f} KiB, "
              f"total {sum(r['bytes'] for r in cold) / 2**20:.1f} MiB")

        hit_variant = tiles.select_variant(128, "fp16", None, 128, 128, False, False)
        hits = {mode: cache_hits(hit_variant, archs[0], warm, args.hits, mode) for mode in ("plain", "cupy", "preload")}
        plain, after_cupy, preload = hits["plain"], hits["cupy"], hits["preload"]
        print(f"cache hit in a new process ({hit_variant.name} {archs[0]}, median of {args.hits}):")
        print(f"  build() {1e3 * plain['build']:.1f} ms as the first thing; {1e3 * after_cupy['build']:.1f} ms after "
              f"import cupy ({1e3 * after_cupy['preload']:.0f} ms); {1e3 * preload['build']:.1f} ms after loading "
              f"NVRTC ({1e3 * preload['preload']:.1f} ms)")
        print(f"  import omnicupy.jit {1e3 * plain['import']:.0f} ms; whole process {1e3 * plain['process']:.0f} ms")

        wall, summary = precompile_wall(archs, args.jobs, Path(tmp) / "parallel")
        print(f"omnicupy precompile --jobs {args.jobs} of the default set: {wall:.1f} s wall\n  {summary}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")

    if args.json:
        Path(args.json).write_text(json.dumps({"cold": cold, "failed": failed, "hits": hits, "precompile_seconds": wall,
                                               "jobs": args.jobs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
