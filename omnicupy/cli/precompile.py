"""``omnicupy precompile``: render and compile kernel variants into the cache, in parallel worker
processes that die with their parent. Knows which archs a variant is built for; no GPU needed.

Archs: ``sm_80``-style archs get every variant that runs there (on sm_90 that includes the wgmma
family, built as sm_90a, because a Hopper device asks for sm_90 and selects wgmma kernels where a
tile fits); ``sm_90a`` means exactly the wgmma variants. Lines and labels name the arch a variant is
really built for.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from .. import arrays, jit
from ..dispatch.variant import ACCEPTED_HEAD_DIMS
from ..errors import OmnicupyError
from ..jit.compiler import arch_number, nvrtc_version, supported_archs
from .common import (MAX_DEFAULT_JOBS, NO_GPU_ARCHS, UsageError, brief, cache_dir_option, comma_list, default_jobs,
                     human_bytes, log, positive_int, verbose)
from .catalogue import (ARCH_SPECIFIC, OPERATIONS, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_STAGES, Variant,
                        arch_list, build_target, family, runs_on, shipped_variants)
from .progress import Progress


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
        entry, built = jit.build(variant, arch, must_store=True)
    except (OmnicupyError, OSError, ValueError) as exc:
        return Outcome(variant.name, arch, "failed", time.perf_counter() - start, error=str(exc))
    return Outcome(variant.name, arch, "built" if built else "cached", time.perf_counter() - start, entry.size)


# ----------------------------------------------------------------------------- what to build
def resolve_archs(archs: Optional[Sequence[str]]) -> tuple[tuple[str, ...], str]:
    """(archs to compile for, a phrase saying why)."""
    if archs:
        return tuple(archs), "as asked"
    if arrays.gpu_available():
        return (jit.device_arch(),), "this GPU's arch"
    return NO_GPU_ARCHS, "no GPU: the default set"


def check_nvrtc_archs(archs: Sequence[str]) -> None:
    known = supported_archs()
    for arch in archs:
        if arch_number(arch) not in known:
            version = ".".join(map(str, nvrtc_version()))
            raise UsageError(f"NVRTC {version} cannot compile for {arch} "
                             f"(it knows {', '.join(f'sm_{a}' for a in known if a >= jit.MIN_ARCH)})")


def targets(variant: Variant, arch: str) -> Optional[str]:
    """The arch ``variant`` is built as when asked for ``arch``, or None when it is not built for it
    (the architecture table: the wgmma families run on sm_90 only, built as sm_90a; an arch-specific
    name such as sm_90a asks for exactly the variants built as it)."""
    target = build_target(arch, family(variant))
    if arch in ARCH_SPECIFIC:
        return target if target == arch else None
    return target


def plan(variants: Sequence[Variant], archs: Sequence[str]) -> tuple[list[tuple[Variant, str]], int]:
    """(variant, target arch) pairs to build, largest head dim first so parallel workers finish
    together, each pair once; and how many were skipped because the variant's shared memory does not
    fit the arch."""
    tasks, skipped, seen = [], 0, set()
    for arch in archs:
        for variant in variants:
            target = targets(variant, arch)
            if target is None or (variant, target) in seen:
                continue
            seen.add((variant, target))
            if runs_on(variant, target):
                tasks.append((variant, target))
            else:
                skipped += 1
    tasks.sort(key=lambda t: -getattr(t[0], "head_dim", 0))  # stable: keeps the arch/variant order within a head dim
    return tasks, skipped


# ----------------------------------------------------------------------------- workers
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _ask_kernel_to_kill_us_with_parent() -> bool:
    """Linux: SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG). False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    """Where prctl is missing: a thread that ends the process once the parent is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="omnicupy-parent-watch", daemon=True).start()


def worker_init(parent_pid: int) -> None:
    """Worker initializer: die with the parent (a SIGKILLed ``precompile`` leaves no compile running),
    and leave Ctrl-C to the parent (it cancels what has not started)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _ask_kernel_to_kill_us_with_parent():
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """Processes, not threads: a crash or leak in NVRTC stays in its worker. "spawn" because the parent
    may have initialized CUDA (to ask the device its arch), which a forked child must not inherit."""
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=worker_init, initargs=(os.getpid(),))


def _outcomes(tasks: Sequence[tuple[Variant, str]], jobs: int) -> Iterator[Outcome]:
    if jobs <= 1 or len(tasks) <= 1:
        for variant, arch in tasks:
            yield build_one(variant, arch)
        return
    with worker_pool(min(jobs, len(tasks))) as pool:
        futures = [pool.submit(build_one, variant, arch) for variant, arch in tasks]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def run_builds(tasks: Sequence[tuple[Variant, str]], jobs: int, progress: Progress) -> list[Outcome]:
    outcomes = []
    for outcome in _outcomes(tasks, jobs):
        outcomes.append(outcome)
        if outcome.status == "failed":
            progress.note(f"failed: {outcome.name} for {outcome.arch}: "
                          + (outcome.error if verbose() else brief(outcome.error)))
        progress.update(outcome.status, f"{outcome.name} {outcome.arch}")
    return outcomes


def precompile(variants: Sequence[Variant], archs: Sequence[str], why: str, jobs: int, quiet: bool = False) -> int:
    check_nvrtc_archs(archs)
    tasks, skipped = plan(variants, archs)
    cache = jit.default_cache()
    cache.ensure_ready()  # an unusable cache folder fails once (CacheError), not once per variant
    print(f"precompiling {len(tasks)} variants for {', '.join(archs)} ({why}) into {cache.root} "
          f"with {min(jobs, max(len(tasks), 1))} job(s)", file=sys.stderr, flush=True)
    progress = Progress(len(tasks), enabled=not quiet)
    start = time.perf_counter()
    try:
        outcomes = run_builds(tasks, jobs, progress)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    count = {s: sum(o.status == s for o in outcomes) for s in Progress.STATUSES}
    size = sum(o.size for o in outcomes)
    skipped_text = f", {skipped} skipped (shared memory too large for the arch)" if skipped else ""
    print(f"{len(outcomes)} variants in {seconds:.1f} s: {count['built']} built, {count['cached']} already cached, "
          f"{count['failed']} failed{skipped_text}; {size:,} bytes ({human_bytes(size)}) of cubins in {cache.root}")
    if count["failed"] and not verbose():
        print("set OMNICUPY_VERBOSE=1 to see the full compiler logs", file=sys.stderr)
    log.debug("precompile: %s", count)
    return 1 if count["failed"] else 0


def run(args: argparse.Namespace) -> int:
    variants = shipped_variants(dtypes=args.dtypes, head_dims=args.head_dims, stages=args.stages, ops=args.ops)
    archs, why = resolve_archs(args.arch)
    if args.dry_run:
        tasks, skipped = plan(variants, archs)
        for variant, arch in tasks:
            print(f"{variant.name} {arch}")
        print(f"{len(tasks)} variants for {', '.join(archs)} ({why}); {skipped} skipped", file=sys.stderr)
        return 0
    return precompile(variants, archs, why, args.jobs, quiet=args.quiet)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "precompile", parents=[cache_dir_option()], help="render and compile kernel variants into the cache",
        description="Render and compile kernel variants into the cache, so that attention() never waits for NVRTC. "
                    "Needs no GPU.",
        epilog=f"Default selection: every shipped variant (tiles.shipped_variants(): head dims "
               f"{','.join(map(str, SUPPORTED_HEAD_DIMS))}, dtypes {','.join(SUPPORTED_DTYPES)}, stages 1,2, "
               f"each with and without causal and partial blocks) for this GPU's arch; with no GPU, for "
               f"{' and '.join(NO_GPU_ARCHS)} (A100 and H100 class). sm_90 includes the wgmma variants (built as "
               f"sm_90a, which is what an H100 runs); --arch sm_90a builds only those. The flags narrow it.")
    p.add_argument("--head-dims", type=comma_list(int, ACCEPTED_HEAD_DIMS, "head dim"),
                   default=SUPPORTED_HEAD_DIMS, metavar="64,128",
                   help=f"head dims (default: the tiles' {','.join(map(str, SUPPORTED_HEAD_DIMS))}); any multiple of "
                        f"8 up to 256 builds its padded kernels, e.g. 40,80,192")
    p.add_argument("--dtypes", type=comma_list(str, SUPPORTED_DTYPES, "dtype"), default=SUPPORTED_DTYPES,
                   metavar="fp16,bf16", help="input dtypes (default: both)")
    p.add_argument("--stages", type=comma_list(int, SUPPORTED_STAGES, "stages"), default=SUPPORTED_STAGES,
                   metavar="1,2", help="pipelines: 1 shared K/V buffer, 2 prefetch (default: both)")
    p.add_argument("--ops", type=comma_list(str, OPERATIONS, "operation"), default=OPERATIONS,
                   metavar="forward,backward,decode,mask",
                   help="kernel groups: the forward, the backward, split-KV decode, the mask builders' (default: all)")
    p.add_argument("--arch", type=arch_list, default=None, metavar="auto|sm_80,sm_90,sm_90a",
                   help=f"target archs, sm_{jit.MIN_ARCH} or newer; sm_90a = the wgmma variants only (default auto: "
                        f"this GPU's, or {','.join(NO_GPU_ARCHS)} without a GPU)")
    p.add_argument("--jobs", "-j", type=positive_int, default=default_jobs(), metavar="N",
                   help=f"parallel compiles, each in its own process (default: CPUs, at most {MAX_DEFAULT_JOBS}; "
                        f"here {default_jobs()})")
    p.add_argument("--dry-run", action="store_true", help="list the variants and the archs they are built as; "
                                                          "compile nothing")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line, only failures and the summary")
    p.set_defaults(func=run)
