"""Block-mask build time and peak memory, per mask: omnicupy's builders next to torch's
create_block_mask (when torch imports and sees a GPU), and where the host's time goes.

    python benchmarks/bench_masks.py                          # N = 8192, 32768, 131072; table last
    python benchmarks/bench_masks.py --sizes 8192 131072 --steps --out bench_masks.json

Rows per mask and N:
- ``structured``: the built-in mask (its block structure known; the exact ones are built from their
  row bounds without evaluating an element; on a GPU, those with pieces by pieces_build.py's two
  kernels); for the random masks, ``from_dense`` on the dense
  mask (already on the device: the input, not timed).
- ``generic``: the same rule as an opaque function: every block evaluated (up to --generic-max-n).
- ``rule``: ``BlockMask.causal`` (host arrays) plus its first ``device_metadata()`` (causal only).
- ``torch create_block_mask``: the same rule (the random masks as ``dense[q, kv]``).

``ms`` is the median wall time from the call to the device being idle again (synchronized before
and after); ``call ms`` the median time until the call returned (without the final
synchronization): a build that never waits for the device returns before its kernels finish, so
``call ms`` is its host time; ``faults`` the median minor page faults of one build. With ``--steps``, one more build per omnicupy row runs with timers
around the builder's steps (inclusive host milliseconds of each; device calls are their launch or
transfer time, and ``download`` includes waiting for the device). The peak is CuPy's memory pool
(bytes handed out at once during a build, outputs included) on the GPU, tracemalloc's on the host;
torch's is torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

try:
    import resource  # POSIX: page-fault counts
except ImportError:  # pragma: no cover - Windows
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from benchmarks import _cases  # noqa: E402
from omnicupy import BlockMask, arrays, masks  # noqa: E402
from omnicupy.mask import builders, kernels, patterns, pieces, pieces_build  # noqa: E402
from omnicupy.mask.mask_mod import EVALUATE  # noqa: E402

MASKS = ("causal", "sliding_window_1024", "document", "interleaved", "random_50", "random_10")
DENSE_MASKS = ("random_50", "random_10")


def workload(name: str, n: int, seed: int = 0) -> masks.MaskMod:
    """The issue's built-in masks at length n: documents of random lengths 256-2048, 512 text / 576 image."""
    if name == "causal":
        return masks.causal()
    if name == "sliding_window_1024":
        return masks.sliding_window(1024)
    if name == "document":
        lengths = np.random.default_rng(seed).integers(256, 2049, size=n // 256 + 1)
        return masks.document(masks.doc_ids_from_lengths(lengths)[:n])
    if name == "interleaved":
        sizes = [512, 576] * (n // 1088 + 1)
        return masks.interleaved([("text" if i % 2 == 0 else "image", s) for i, s in enumerate(sizes)])
    raise ValueError(f"unknown mask {name!r}; choose from {MASKS}")


def torch_mask_mod(name: str, mod: Any, n: int, dense: Any = None):
    """The same rule as a torch mask_mod; lookup tables come from the omnicupy mask's row bounds."""
    import torch

    if dense is not None:
        table = torch.as_tensor(dense, device="cuda")
        return lambda b, h, q, kv: table[q, kv]
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "sliding_window_1024":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < 1024)
    start, end = (np.broadcast_to(a, (n,)) for a in mod.bounds(0, 0, np.arange(n)))
    if name == "document":  # a document's first position identifies it
        doc = torch.as_tensor(np.ascontiguousarray(start), device="cuda")
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    limit = torch.as_tensor(np.ascontiguousarray(end), device="cuda")
    return lambda b, h, q, kv: kv < limit[q]


# ------------------------------------------------------------------------------------ measuring
class _PoolPeak:
    """Peak bytes handed out by CuPy's memory pool while active (a CuPy memory hook)."""

    def __init__(self, cp) -> None:
        outer = self

        class Hook(cp.cuda.MemoryHook):
            name = "omnicupy_bench_peak"

            def malloc_postprocess(self, **kw):
                outer.live += kw["mem_size"]
                outer.peak = max(outer.peak, outer.live)

            def free_postprocess(self, **kw):
                outer.live -= kw["mem_size"]

        self.hook, self.live, self.peak = Hook(), 0, 0


def minor_faults() -> int:
    """This process's minor page faults so far (0 where the platform does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def measure(build: Callable[[], Any], *, sync: Callable[[], None], repeat: int,
            warmup: int) -> tuple[list[float], list[float], list[int]]:
    """Wall times in ms of ``build()``: until the device is idle, and until the call returned; and the
    minor page faults of each build. Fresh pages of large temporaries can cost more than the
    arithmetic done in them, and whether a build meets fresh pages depends on the allocator's state
    (lab/notes/masks.md#s19): the faults say which regime a row was timed in."""
    for _ in range(warmup):
        build()
    total, returned, faults = [], [], []
    for _ in range(repeat):
        sync()
        f0 = minor_faults()
        t0 = time.perf_counter()
        build()
        t1 = time.perf_counter()
        sync()
        total.append((time.perf_counter() - t0) * 1e3)
        returned.append((t1 - t0) * 1e3)
        faults.append(minor_faults() - f0)
    return total, returned, faults


def peak_memory(build: Callable[[], Any], cp) -> int:
    """Peak bytes allocated during one build: CuPy pool bytes on the GPU, tracemalloc on the host."""
    if cp is not None:
        probe = _PoolPeak(cp)
        with probe.hook:
            build()
            cp.cuda.Device().synchronize()
        return probe.peak
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


#: (owner, attribute, step name): the builder steps timed by --steps.
STEPS = [
    (pieces_build, "build", "build from pieces on the device (all of it)"),
    (kernels.KernelBackend, "pieces_scan", "  device: pieces scan kernel + read back (waits)"),
    (kernels.KernelBackend, "pieces_layout", "  device: pieces layout kernel + check (waits)"),
    (builders._Build, "from_windows", "rows from the structure (all of it)"),
    (masks.MaskMod, "_windows_from_pieces", "  windows from the pieces"),
    (builders._Build, "_cut_blocks_from_pieces", "  cut blocks from the pieces"),
    (builders, "group_cut_blocks", "    groups by pattern key"),
    (pieces.BlockPieces, "block_rows", "    rows of one block per group"),
    (builders._Build, "_cut_blocks", "  cut blocks from row bounds"),
    (builders, "cut_blocks", "    types and codes"),
    (patterns.PatternPool, "add", "    pattern dedup"),
    (patterns.PatternPool, "finish", "  pool bits and order"),
    (builders._Build, "finish", "evaluation (all of it)"),
    (builders._Build, "_evaluate_grid", "  mask_mod call"),
    (builders, "_dense_bits", "  dense blocks packed (host)"),
    (builders.blocks, "block_types", "  block types (host)"),
    (builders.blocks, "deduplicate", "  pool dedup"),
    (builders._Build, "_scalar", "  scalar mode"),
    (builders, "items_from_runs", "items from runs"),
    (builders._Build, "_assemble", "layout and BlockMask (all of it)"),
    (builders, "summary_of", "  summary"),
    (builders, "segments_of", "  segments"),
    (builders, "device_table", "  device table"),
    (builders, "write_host", "  host layout"),
    (BlockMask, "__init__", "  BlockMask()"),
    (kernels.KernelBackend, "upload", "device: upload"),
    (kernels.KernelBackend, "download", "device: download (waits)"),
    (kernels.KernelBackend, "block_indices", "device: indices kernel"),
    (kernels.KernelBackend, "classify", "device: classify kernel"),
    (kernels.KernelBackend, "gather_blocks", "device: gather kernel"),
    (kernels.KernelBackend, "blocks_differ", "device: compare kernel (waits)"),
    (kernels.KernelBackend, "layout", "device: layout kernel"),
    (builders, "_causal_rule", "causal rule"),
    (BlockMask, "device_metadata", "device_metadata()"),
]


@contextlib.contextmanager
def step_timers():
    """Time the builder's steps (inclusive host ms, summed over calls) while active."""
    spent: dict[str, float] = {}
    saved = []
    for owner, attr, label in STEPS:
        original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if original is None:
            continue
        func = original.__func__ if isinstance(original, staticmethod) else original

        def timed(*a, _f=func, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + (time.perf_counter() - t0) * 1e3

        functools.update_wrapper(timed, func)
        saved.append((owner, attr, original))
        setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)
    try:
        yield spent
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def same_metadata(a: BlockMask, b: BlockMask) -> bool:
    names = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
    pairs = [(getattr(a, n), getattr(b, n)) for n in names]
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and np.array_equal(arrays.to_numpy(x), arrays.to_numpy(y)))
               for x, y in pairs)


def omnicupy_paths(name: str, n: int, args, xp, dense) -> list[tuple[str, Callable[[], BlockMask], int]]:
    """(label, build, repeats) of the omnicupy rows of one mask."""
    bs = args.block_size
    if name in DENSE_MASKS:
        rule = _cases.make_mask(name, n).array_mod()
        paths = [("structured from_dense", lambda: BlockMask.from_dense(dense, q_block_size=bs, kv_block_size=bs),
                  args.repeat)]
    else:
        mod = workload(name, n)
        rule = lambda b, h, q_idx, kv_idx: mod(b, h, q_idx, kv_idx)  # noqa: E731 - no structure to use
        paths = [("structured", lambda: builders.from_mask_mod(mod, None, None, n, n, q_block_size=bs,
                                                               kv_block_size=bs, xp=xp), args.repeat)]
    if n <= args.generic_max_n:
        paths.append(("generic", lambda: builders.from_mask_mod(rule, None, None, n, n, q_block_size=bs,
                                                                kv_block_size=bs, xp=xp), args.generic_repeat))
    if name == "causal":
        def rule_build():
            bm = BlockMask.causal(n, n, q_block_size=bs, kv_block_size=bs)
            if xp is not np:
                bm.device_metadata()
            return bm
        paths.append(("rule (+device_metadata)" if xp is not np else "rule", rule_build, args.repeat))
    return paths


def bench_omnicupy(name, n, args, xp, cp, sync, dense) -> list[dict]:
    rows, built = [], {}
    for path, build, repeat in omnicupy_paths(name, n, args, xp, dense):
        def run(build=build, path=path):
            built[path] = build()
            return built[path]

        total, returned, faults = measure(run, sync=sync, repeat=repeat, warmup=args.warmup)
        bm = built[path]
        pool = 0 if bm.partial_block_masks is None else int(bm.partial_block_masks.shape[0])
        row = dict(mask=name, n=n, impl=f"omnicupy {path} [{xp.__name__}]", ms=statistics.median(total),
                   ms_min=min(total), call_ms=statistics.median(returned), faults=statistics.median(faults),
                   peak_mb=peak_memory(run, cp) / 2**20,
                   sparsity=bm.sparsity(), pool=pool, note="", steps={})
        if args.steps:
            sync()
            with step_timers() as spent:
                run()
                sync()
            row["steps"] = dict(spent)
        rows.append(row)
    structured = rows[0]
    if name not in DENSE_MASKS:
        grid = workload(name, n).classify_blocks(1, 1, n, n, args.block_size, args.block_size, xp=np)
        structured["note"] = f"{int(np.count_nonzero(grid == EVALUATE))} blocks cut"
    paths = list(built)
    if "generic" in built:
        rows[paths.index("generic")]["note"] = ("same metadata" if same_metadata(built[paths[0]], built["generic"])
                                                else "METADATA DIFFER")
    return rows


def bench_torch(name, n, args, dense) -> Optional[dict]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    fn = torch_mask_mod(name, None if name in DENSE_MASKS else workload(name, n), n, dense)
    row = dict(mask=name, n=n, impl="torch create_block_mask" + (" (_compile)" if args.torch_compile else ""),
               ms=float("nan"), ms_min=float("nan"), call_ms=float("nan"), faults=float("nan"), peak_mb=float("nan"),
               sparsity=float("nan"), pool=0, note="", steps={})
    built = {}

    def build():
        built["bm"] = create_block_mask(fn, None, None, n, n, device="cuda", BLOCK_SIZE=args.block_size,
                                        **({"_compile": True} if args.torch_compile else {}))

    try:
        total, returned, faults = measure(build, sync=torch.cuda.synchronize, repeat=args.repeat, warmup=args.warmup)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        build()
        torch.cuda.synchronize()
        row.update(ms=statistics.median(total), ms_min=min(total), call_ms=statistics.median(returned),
                   faults=statistics.median(faults),
                   peak_mb=(torch.cuda.max_memory_allocated() - base) / 2**20, sparsity=built["bm"].sparsity())
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    finally:
        built.clear()
        torch.cuda.empty_cache()
    return row


def torch_available(wanted: bool) -> bool:
    if not wanted:
        return False
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def print_table(rows: list[dict]) -> None:
    head = (f"{'mask':<20} {'N':>7}  {'implementation':<40} {'ms':>8} {'min ms':>8} {'call ms':>8} {'faults':>7} {'peak MB':>8} "
            f"{'sparsity %':>10} {'pool':>5}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mask']:<20} {r['n']:>7}  {r['impl']:<40} {r['ms']:>8.2f} {r['ms_min']:>8.2f} {r['call_ms']:>8.2f} "
              f"{r['faults']:>7.0f} {r['peak_mb']:>8.1f} {r['sparsity']:>10.2f} {r['pool']:>5}  {r['note']}")


def print_steps(rows: list[dict]) -> None:
    for r in rows:
        if not r.get("steps"):
            continue
        print(f"\n{r['mask']} N={r['n']} {r['impl']}: host ms per step (inclusive)")
        for label, ms in sorted(r["steps"].items(), key=lambda kv: [s[2] for s in STEPS].index(kv[0])):
            print(f"  {label:<42} {ms:8.3f}")


def main(argv=None) -> None:
    gpu = arrays.gpu_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--generic-repeat", type=int, default=3)
    parser.add_argument("--generic-max-n", type=int, default=131072 if gpu else 8192,
                        help="largest N for the generic path (it evaluates all N^2 elements)")
    parser.add_argument("--dense-max-n", type=int, default=16384,
                        help="largest N for the random masks (their input is a dense N x N mask)")
    parser.add_argument("--steps", action="store_true", help="time the builder's steps in one more build per row")
    parser.add_argument("--numpy", action="store_true", help="build with NumPy even when a GPU is usable")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-compile", action="store_true", help="create_block_mask(..., _compile=True)")
    parser.add_argument("--out", help="write the rows and the environment as JSON")
    args = parser.parse_args(argv)

    cp = arrays.cupy_module() if gpu and not args.numpy else None
    xp = cp if cp is not None else np
    sync = cp.cuda.Device().synchronize if cp is not None else (lambda: None)
    use_torch = torch_available(not args.no_torch)
    rows = []
    for n in args.sizes:
        for name in args.masks:
            if name in DENSE_MASKS and n > args.dense_max_n:
                continue
            dense = None
            if name in DENSE_MASKS:
                host = _cases.make_mask(name, n).dense()[:n, :n]
                dense = xp.asarray(host)[None, None]
            new = bench_omnicupy(name, n, args, xp, cp, sync, dense)
            if use_torch:
                if cp is not None:  # hand CuPy's cached blocks back so that torch can use them
                    cp.get_default_memory_pool().free_all_blocks()
                new.append(bench_torch(name, n, args, None if dense is None else arrays.to_numpy(dense)[0, 0]))
            for r in new:
                print(f"  {r['mask']} N={r['n']} {r['impl']}: {r['ms']:.2f} ms (call {r['call_ms']:.2f}) {r['note']}",
                      flush=True)
            rows += new

    env = dict(python=platform.python_version(), numpy=np.__version__, array_module=xp.__name__,
               chunk_elements=builders.CHUNK_ELEMENTS, device_chunk_elements=builders.DEVICE_CHUNK_ELEMENTS,
               block_size=args.block_size)
    if cp is not None:
        env.update(cupy=cp.__version__, device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    if use_torch:
        import torch

        env.update(torch=torch.__version__)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=env, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=rows), f,
                      indent=1)  # the date: tools/standing.py
    print()
    print(", ".join(f"{k}={v}" for k, v in env.items()))
    print_table(rows)
    print_steps(rows)


if __name__ == "__main__":
    main()
