"""The ``omnicupy`` command (also ``python -m omnicupy``).

    omnicupy precompile [--head-dims 64,128] [--dtypes fp16,bf16] [--stages 1,2] [--arch auto|sm_80,sm_90] [--jobs N]
    omnicupy cache path | list | clear [--older-than DAYS]
    omnicupy info
    omnicupy demo
    omnicupy bench [--harness PATH] [-- HARNESS ARGS]

Exit status: 0 success, 1 failure, 2 usage. An error is one line on stderr, never a traceback
(``OMNICUPY_VERBOSE=1`` adds the full message or traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from . import arrays, jit
from .dispatch import tiles
from .dispatch.arch import has_wgmma
from .dispatch.variant import HOPPER_FAMILIES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_STAGES, Variant
from ._version import __version__
from .errors import OmnicupyError
from .jit import env
from .jit.compiler import arch_number, normalize_arch, nvrtc_version, supported_archs

#: The kernels use cp.async, ldmatrix and mma.sync m16n8k16 with bf16: Ampere or newer.
MIN_ARCH = 80
#: What ``precompile`` builds for when there is no GPU to ask (a build box, a container image).
NO_GPU_ARCHS = ("sm_80", "sm_90")
#: Parallel compiles by default: one per CPU, at most this many (polite on shared login nodes; a
#: compile peaks near 150 MB).
MAX_DEFAULT_JOBS = 8
#: Relative Frobenius error allowed against the float64 reference (DESIGN.md §1).
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}


class UsageError(Exception):
    """Arguments that parse but make no sense here (exit status 2)."""


# ----------------------------------------------------------------------------- argument types
def _comma_list(convert, allowed: Sequence, what: str):
    def parse(text: str) -> tuple:
        values = []
        for item in (t.strip() for t in text.split(",")):
            try:
                value = convert(item)
            except ValueError:
                value = None
            if value not in allowed:
                choices = ", ".join(map(str, allowed))
                raise argparse.ArgumentTypeError(f"{what} {item!r} is not supported (choose from {choices})")
            if value not in values:
                values.append(value)
        return tuple(values)

    return parse


def _arch_list(text: str) -> Optional[tuple[str, ...]]:
    """'auto' -> None (decide at run time); 'sm_80,90' -> ('sm_80', 'sm_90')."""
    if text.strip().lower() == "auto":
        return None
    archs = []
    for item in (t.strip() for t in text.split(",")):
        try:
            arch = normalize_arch(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"arch {item!r} is not 'auto' or of the form sm_80, sm_90, sm_90a") from None
        if arch_number(arch) < MIN_ARCH:
            raise argparse.ArgumentTypeError(f"arch {arch}: the kernels need sm_{MIN_ARCH} or newer (mma.sync, cp.async)")
        if arch not in archs:
            archs.append(arch)
    return tuple(archs)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return value


def default_jobs() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_JOBS))


# ----------------------------------------------------------------------------- formatting
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def brief(error: str) -> str:
    """The first line of an error, plus the compiler's first error line when it carries a log."""
    lines = error.strip().splitlines() or ["unknown error"]
    detail = next((line.strip() for line in lines[1:] if "error" in line.lower()), "")
    return f"{lines[0]} {detail}".strip()


def _verbose() -> bool:
    try:
        return env.verbose()
    except ValueError:
        return False


# ----------------------------------------------------------------------------- precompile
@dataclass(frozen=True)
class Outcome:
    """What happened to one (variant, arch) compile."""

    name: str
    arch: str
    status: str  # "built", "cached" or "failed"
    seconds: float
    size: int = 0
    error: str = ""


def build_one(variant: Variant, arch: str) -> Outcome:
    """Render, compile and store one variant (runs in a worker process when --jobs > 1)."""
    start = time.perf_counter()
    try:
        entry, built = jit.build(variant, arch)
    except (OmnicupyError, OSError, ValueError) as exc:
        return Outcome(variant.name, arch, "failed", time.perf_counter() - start, error=str(exc))
    return Outcome(variant.name, arch, "built" if built else "cached", time.perf_counter() - start, entry.size)


class Progress:
    """One line on stderr: rewritten in place on a terminal, every tenth of the way otherwise."""

    WIDTH = 24

    def __init__(self, total: int, stream=None, enabled: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream or sys.stderr, enabled and total > 0
        self.tty = self.enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self.counts = {"built": 0, "cached": 0, "failed": 0}
        self.done = 0
        self._shown_tenths = -1
        self._width = 0

    def _line(self, last: Outcome) -> str:
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        c = self.counts
        return (f"[{bar}] {self.done:{len(str(self.total))}d}/{self.total}  built {c['built']}  cached {c['cached']}  "
                f"failed {c['failed']}  {time.perf_counter() - self.start:.0f} s  {last.name} {last.arch}")

    def update(self, outcome: Outcome) -> None:
        self.done += 1
        self.counts[outcome.status] += 1
        if outcome.status == "failed":
            self.note(f"failed: {outcome.name} for {outcome.arch}: "
                      + (outcome.error if _verbose() else brief(outcome.error)))
        if not self.enabled:
            return
        line = self._line(outcome)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif self.done * 10 // self.total > self._shown_tenths:
            self._shown_tenths = self.done * 10 // self.total
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A line of its own (a failure), above the progress line."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def resolve_archs(archs: Optional[Sequence[str]]) -> tuple[tuple[str, ...], str]:
    """(archs to compile for, a phrase saying why)."""
    if archs:
        return tuple(archs), "as asked"
    if arrays.gpu_available():
        arch = jit.device_arch()
        return (arch,), "this GPU's arch"
    return NO_GPU_ARCHS, "no GPU: the default set"


def check_nvrtc_archs(archs: Iterable[str]) -> None:
    known = supported_archs()
    for arch in archs:
        if arch_number(arch) not in known:
            version = ".".join(map(str, nvrtc_version()))
            raise UsageError(f"NVRTC {version} cannot compile for {arch} "
                             f"(it knows {', '.join(f'sm_{a}' for a in known if a >= MIN_ARCH)})")


def plan(variants: Sequence[Variant], archs: Sequence[str]) -> tuple[list[tuple[Variant, str]], int]:
    """(variant, arch) pairs to build, largest head dim first so parallel workers finish together;
    and how many pairs were skipped because the variant's shared memory does not fit the arch.
    wgmma variants exist for sm_90 only and are not planned (nor counted) for other archs."""
    tasks, skipped = [], 0
    for arch in archs:
        for variant in variants:
            if variant.family in HOPPER_FAMILIES and not has_wgmma(arch):
                continue
            if variant.runs_on(arch):
                tasks.append((variant, arch))
            else:
                skipped += 1
    tasks.sort(key=lambda t: -t[0].head_dim)  # stable: keeps the arch/variant order within a head dim
    return tasks, skipped


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C is the parent's to handle (it cancels what has not started)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_builds(tasks: Sequence[tuple[Variant, str]], jobs: int, progress: Progress) -> list[Outcome]:
    if jobs <= 1 or len(tasks) <= 1:
        outcomes = []
        for variant, arch in tasks:
            outcomes.append(build_one(variant, arch))
            progress.update(outcomes[-1])
        return outcomes
    # Processes, not threads: a crash or leak in NVRTC stays in its worker. "spawn" because the parent
    # may have initialized CUDA (to ask the device its arch), which a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    outcomes = []
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context,
                             initializer=_ignore_sigint) as pool:
        futures = [pool.submit(build_one, variant, arch) for variant, arch in tasks]
        try:
            for future in as_completed(futures):
                outcomes.append(future.result())
                progress.update(outcomes[-1])
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return outcomes


def precompile(variants: Sequence[Variant], archs: Sequence[str], why: str, jobs: int, quiet: bool = False) -> int:
    check_nvrtc_archs(archs)
    tasks, skipped = plan(variants, archs)
    cache = jit.default_cache()
    cache.dir.mkdir(parents=True, exist_ok=True)  # an unusable cache folder fails once, not once per variant
    print(f"precompiling {len(tasks)} variants for {', '.join(archs)} ({why}) into {cache.dir} "
          f"with {min(jobs, max(len(tasks), 1))} job(s)", file=sys.stderr)
    progress = Progress(len(tasks), enabled=not quiet)
    start = time.perf_counter()
    try:
        outcomes = run_builds(tasks, jobs, progress)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    count = {s: sum(o.status == s for o in outcomes) for s in ("built", "cached", "failed")}
    size = sum(o.size for o in outcomes)
    skipped_text = f", {skipped} skipped (shared memory too large for the arch)" if skipped else ""
    print(f"{len(outcomes)} variants in {seconds:.1f} s: {count['built']} built, {count['cached']} already cached, "
          f"{count['failed']} failed{skipped_text}; {size:,} bytes ({human_bytes(size)}) of cubins in {cache.dir}")
    if count["failed"] and not _verbose():
        print("set OMNICUPY_VERBOSE=1 to see the full compiler logs", file=sys.stderr)
    return 1 if count["failed"] else 0


def cmd_precompile(args) -> int:
    variants = tiles.shipped_variants(dtypes=args.dtypes, head_dims=args.head_dims, stages=args.stages)
    archs, why = resolve_archs(args.arch)
    if args.dry_run:
        tasks, skipped = plan(variants, archs)
        for variant, arch in tasks:
            print(f"{variant.name} {arch}")
        print(f"{len(tasks)} variants for {', '.join(archs)} ({why}); {skipped} skipped", file=sys.stderr)
        return 0
    return precompile(variants, archs, why, args.jobs, quiet=args.quiet)


# ----------------------------------------------------------------------------- cache
def cmd_cache_path(args) -> int:
    print(env.cache_dir())
    return 0


def cmd_cache_list(args) -> int:
    cache = jit.default_cache()
    entries = sorted(cache.entries(), key=lambda e: (e.meta.get("kernel", e.stem), e.meta.get("arch", "")))
    if not entries:
        print(f"no compiled variants in {cache.dir}")
        return 0
    now = time.time()
    rows = [(e.meta.get("kernel", e.stem), e.meta.get("arch", "?"), human_bytes(e.size), human_age(now - e.created),
             str(e.meta.get("registers", "?"))) for e in entries]
    header = ("variant", "arch", "size", "age", "regs")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    total = sum(e.size for e in entries)
    print(f"{len(entries)} variants, {human_bytes(total)} in {cache.dir}")
    return 0


def cmd_cache_clear(args) -> int:
    cache = jit.default_cache()
    if args.older_than is None:
        removed = cache.clear()
        cache.remove_leftovers()
        old = cache.remove_other_formats()
        extra = f" and {old} folder(s) of older cache formats" if old else ""
        print(f"removed {removed} entries{extra} from {cache.root}")
    else:
        removed = cache.clear(older_than_seconds=args.older_than * 86400)
        cache.remove_leftovers()
        print(f"removed {removed} entries older than {args.older_than:g} days from {cache.root}")
    return 0


# ----------------------------------------------------------------------------- info
def _versions() -> list[tuple[str, str]]:
    import numpy

    rows = [("omnicupy", f"{__version__} ({Path(__file__).resolve().parent})"),
            ("python", sys.version.split()[0]), ("numpy", numpy.__version__)]
    cp = arrays.cupy_module()
    rows.append(("cupy", cp.__version__ if cp is not None else "not installed"))
    try:
        known = ", ".join(f"sm_{a}" for a in supported_archs() if a >= MIN_ARCH)
        rows.append(("nvrtc", f"{'.'.join(map(str, nvrtc_version()))} (compiles for {known})"))
    except OmnicupyError as exc:
        rows.append(("nvrtc", f"not available: {_first_line(exc)}"))
    driver = "none"
    if cp is not None:
        with contextlib.suppress(Exception):  # no libcuda, or a driver too old for this CuPy
            version = cp.cuda.runtime.driverGetVersion()
            driver = f"{version // 1000}.{version % 1000 // 10}" if version else "none"
    rows.append(("driver", driver))
    return rows


def _devices() -> list[tuple[str, str]]:
    if not arrays.gpu_available():
        return [("device", "none (no usable NVIDIA GPU)")]
    cp = arrays.cupy_module()
    rows = []
    for i in range(cp.cuda.runtime.getDeviceCount()):
        props = cp.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        try:
            arch = jit.device_arch(i)
        except RuntimeError as exc:
            arch = _first_line(exc)
        rows.append((f"device {i}", f"{name}, compute capability {props['major']}.{props['minor']}, "
                                    f"{human_bytes(props['totalGlobalMem'])}, kernels for {arch}"))
    return rows


def cmd_info(args) -> int:
    cache = jit.default_cache()
    entries = cache.entries()
    rows = _versions() + _devices()
    rows.append(("cache", f"{env.cache_dir()} ({len(entries)} variants, {human_bytes(sum(e.size for e in entries))})"))
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OMNICUPY_")}
    rows.append(("environment", " ".join(f"{k}={v}" for k, v in switches.items()) or "no OMNICUPY_ variables set"))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


# ----------------------------------------------------------------------------- demo
def demo_segments(n: int) -> list[tuple[str, int]]:
    """An interleaved text/image sequence of ``n`` tokens: ("text", length) and ("image", length) spans,
    lengths chosen so that spans straddle block boundaries (partial blocks)."""
    pattern = (("text", 300), ("image", 576), ("text", 700), ("image", 1024))
    segments, used = [], 0
    while used < n:
        kind, length = pattern[len(segments) % len(pattern)]
        length = min(length, n - used)
        segments.append((kind, length))
        used += length
    return segments


def _reference_rows(q, k, v, bm, rows):
    """float64 reference for the query rows ``rows`` only (the full reference at N=8192 is slow)."""
    import numpy as np

    from . import reference

    B, H, N, _ = q.shape
    if bm.mask_mod is not None:
        b = np.arange(B).reshape(B, 1, 1, 1)
        h = np.arange(H).reshape(1, H, 1, 1)
        allowed = bm.mask_mod(b, h, rows.reshape(1, 1, -1, 1), np.arange(N).reshape(1, 1, 1, N))
    else:
        allowed = bm.to_dense()[:, :, rows]
    allowed = np.broadcast_to(np.asarray(allowed, dtype=bool), (B, H, len(rows), N))
    return reference.attention(q[:, :, rows], k, v, mask=allowed)


def run_demo(args) -> int:
    """The README's main job on a GPU: interleaved text/image attention, checked and timed."""
    import cupy as cp
    import numpy as np

    import omnicupy
    from . import masks, reference

    B, H, N, D = args.batch, args.heads, args.seq_len, args.head_dim or 128
    dtype = args.dtype or "fp16"
    segments = demo_segments(N)
    start = time.perf_counter()
    bm = omnicupy.BlockMask.from_mask_mod(masks.interleaved(segments), None, None, N, N)
    mask_ms = 1e3 * (time.perf_counter() - start)
    print("interleaved text/image mask: " + ", ".join(f"{kind} {length}" for kind, length in segments))
    print(bm.to_string())
    print(f"{bm!r}\nsparsity {bm.sparsity():.1f}% of blocks skipped (built in {mask_ms:.0f} ms)")

    rng = cp.random.default_rng(0)
    np_dtype = np.dtype(np.float16) if dtype == "fp16" else arrays.BFLOAT16
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(np_dtype) for _ in range(3))
    plan = omnicupy.plan(q, k, v, bm)
    print(plan)
    start = time.perf_counter()
    out = omnicupy.attention(q, k, v, bm)
    cp.cuda.get_current_stream().synchronize()
    print(f"kernel {plan.kernel}: first call {time.perf_counter() - start:.2f} s (compile or cache load)")

    rows = np.sort(np.random.default_rng(0).choice(N, size=min(N, args.check_rows), replace=False))
    expected = _reference_rows(q.get(), k.get(), v.get(), bm, rows)
    error = reference.relative_error(out[:, :, cp.asarray(rows)], expected)

    times = []
    for _ in range(args.iters):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record()
        omnicupy.attention(q, k, v, bm, out=out)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end))
    ms = float(np.median(times))
    pairs = int(np.count_nonzero(bm.to_dense())) * (B // bm.shape[0]) * (H // bm.shape[1])
    tflops = 4 * pairs * D / (ms * 1e-3) / 1e12
    print(f"B={B} H={H} N={N} D={D} {dtype}: relative error {error:.2e} vs the float64 reference "
          f"({len(rows)} rows, tolerance {TOLERANCE[dtype]:.0e}); {ms:.3f} ms per call "
          f"(median of {args.iters}), {tflops:.0f} TFLOP/s effective")
    if not error <= TOLERANCE[dtype]:
        print(f"error {error:.2e} is above the tolerance {TOLERANCE[dtype]:.0e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    if arrays.gpu_available():
        return run_demo(args)
    print("no GPU: compiling the default variants instead", flush=True)
    head_dims = (args.head_dim,) if args.head_dim else SUPPORTED_HEAD_DIMS
    dtypes = (args.dtype,) if args.dtype else SUPPORTED_DTYPES
    variants = tiles.shipped_variants(dtypes=dtypes, head_dims=head_dims)
    return precompile(variants, NO_GPU_ARCHS, "no GPU: the default set", args.jobs)


# ----------------------------------------------------------------------------- bench
def harness_path() -> Path:
    """benchmarks/run.py of the source tree this package was imported from."""
    return Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


#: Runs a harness file as ``python -m <folder>.<name>`` would from the folder's parent.
_HARNESS_BOOT = """\
import runpy, sys
from pathlib import Path
path = Path(sys.argv[1]).resolve()
sys.argv = [str(path), *sys.argv[2:]]
if path.parent.name.isidentifier() and path.stem.isidentifier():
    sys.path.insert(0, str(path.parent.parent))
    runpy.run_module(f"{path.parent.name}.{path.stem}", run_name="__main__", alter_sys=True)
else:
    runpy.run_path(str(path), run_name="__main__")
"""


def cmd_bench(args) -> int:
    path = Path(args.harness).expanduser() if args.harness else harness_path()
    if not path.is_file():
        where = ": it ships with the source tree, not with the installed package (clone the repository)"
        raise OmnicupyError(f"cannot find the benchmark harness {path}{'' if args.harness else where}")
    extra = list(args.harness_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    print(f"running {path} {' '.join(extra)}".rstrip(), file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-c", _HARNESS_BOOT, str(path), *extra])


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnicupy",
        description="Exact block-sparse attention for NumPy/CuPy: precompile kernels, manage their cache, check "
                    "the setup.",
        epilog="Exit status: 0 success, 1 failure, 2 usage error. The cache lives in $OMNICUPY_CACHE_DIR, else "
               "$XDG_CACHE_HOME/omnicupy or ~/.cache/omnicupy.")
    parser.add_argument("--version", action="version", version=f"omnicupy {__version__}")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="use this cache folder (sets OMNICUPY_CACHE_DIR for this command)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "precompile", help="render and compile kernel variants into the cache",
        description="Render and compile kernel variants into the cache, so that attention() never waits for NVRTC. "
                    "Needs no GPU.",
        epilog=f"Default selection: every shipped variant (tiles.shipped_variants(): head dims "
               f"{','.join(map(str, SUPPORTED_HEAD_DIMS))}, dtypes {','.join(SUPPORTED_DTYPES)}, stages 1,2, "
               f"each with and without causal and partial blocks) for this GPU's arch; with no GPU, for "
               f"{' and '.join(NO_GPU_ARCHS)} (A100 and H100 class). The flags narrow it.")
    p.add_argument("--head-dims", type=_comma_list(int, SUPPORTED_HEAD_DIMS, "head dim"),
                   default=SUPPORTED_HEAD_DIMS, metavar="64,128", help="head dims (default: all)")
    p.add_argument("--dtypes", type=_comma_list(str, SUPPORTED_DTYPES, "dtype"), default=SUPPORTED_DTYPES,
                   metavar="fp16,bf16", help="input dtypes (default: both)")
    p.add_argument("--stages", type=_comma_list(int, SUPPORTED_STAGES, "stages"), default=SUPPORTED_STAGES,
                   metavar="1,2", help="pipelines: 1 shared K/V buffer, 2 prefetch (default: both)")
    p.add_argument("--arch", type=_arch_list, default=None, metavar="auto|sm_80,sm_90",
                   help=f"target archs, sm_{MIN_ARCH} or newer (default auto: this GPU's, or "
                        f"{','.join(NO_GPU_ARCHS)} without a GPU)")
    p.add_argument("--jobs", "-j", type=_positive_int, default=default_jobs(), metavar="N",
                   help=f"parallel compiles, each in its own process (default: CPUs, at most {MAX_DEFAULT_JOBS}; "
                        f"here {default_jobs()})")
    p.add_argument("--dry-run", action="store_true", help="list the variants and archs, compile nothing")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line, only failures and the summary")
    p.set_defaults(func=cmd_precompile)

    c = commands.add_parser("cache", help="show or clear the kernel cache",
                            description="Show or clear the compiled-kernel cache.")
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("path", help="print the cache folder",
                       description="Print the cache folder ($OMNICUPY_CACHE_DIR or the per-user cache)."
                       ).set_defaults(func=cmd_cache_path)
    actions.add_parser("list", help="list compiled variants: variant, arch, size, age",
                       description="List the compiled variants (checksums verified; corrupt entries are dropped)."
                       ).set_defaults(func=cmd_cache_list)
    clear = actions.add_parser("clear", help="remove compiled variants",
                               description="Remove compiled variants (all, or those older than DAYS).")
    clear.add_argument("--older-than", type=_days, metavar="DAYS", help="only entries compiled more than DAYS ago")
    clear.set_defaults(func=cmd_cache_clear)

    commands.add_parser("info", help="versions, GPU, arch and cache",
                        description="Print the omnicupy, CuPy, NVRTC and driver versions, the GPUs and the arch "
                                    "kernels are compiled for, and the cache folder with its number of variants."
                        ).set_defaults(func=cmd_info)

    d = commands.add_parser(
        "demo", help="interleaved text/image attention, checked and timed",
        description="On a GPU: build an interleaved text/image mask (text causal, image spans full), print its "
                    "block grid and sparsity, run attention, compare a sample of rows with the float64 reference "
                    "and time the call. Without a GPU: precompile the default variants instead (as precompile "
                    "does with no GPU).")
    d.add_argument("--batch", type=_positive_int, default=2, metavar="B", help="batch size (default 2)")
    d.add_argument("--heads", type=_positive_int, default=16, metavar="H", help="heads (default 16)")
    d.add_argument("--seq-len", type=_positive_int, default=8192, metavar="N", help="sequence length (default 8192)")
    d.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=None, metavar="D",
                   help="head dim (default 128); without a GPU, compile only this head dim")
    d.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=None,
                   help="input dtype (default fp16); without a GPU, compile only this dtype")
    d.add_argument("--iters", type=_positive_int, default=20, help="timed calls (default 20)")
    d.add_argument("--check-rows", type=_positive_int, default=256, metavar="R",
                   help="query rows compared with the reference (default 256)")
    d.add_argument("--jobs", "-j", type=_positive_int, default=default_jobs(), metavar="N",
                   help="parallel compiles without a GPU")
    d.set_defaults(func=cmd_demo)

    b = commands.add_parser(
        "bench", help="run the benchmark harness with its defaults",
        description="Run the benchmark harness (benchmarks/run.py of a source checkout) with its defaults; "
                    "arguments after -- go to the harness.",
        epilog="example: omnicupy bench -- --help")
    b.add_argument("--harness", metavar="PATH", help="the harness script (default: benchmarks/run.py of the source "
                                                     "tree omnicupy was imported from)")
    b.add_argument("harness_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="passed to the harness")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 here
    if args.cache_dir:
        os.environ["OMNICUPY_CACHE_DIR"] = args.cache_dir  # worker processes inherit it
    name = f"omnicupy {args.command}"
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (OMNICUPY_VERBOSE=1 shows it)
        if _verbose():
            import traceback

            traceback.print_exc()
        kind = "" if isinstance(exc, (OmnicupyError, OSError, ValueError, ImportError)) else f"{type(exc).__name__}: "
        print(f"{name}: error: {kind}{_first_line(exc)}", file=sys.stderr)
        return 1
