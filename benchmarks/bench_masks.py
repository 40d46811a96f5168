"""Block-mask build time and peak memory: omnicupy's structured and generic paths next to torch's
create_block_mask (when torch imports and sees a GPU).

    python benchmarks/bench_masks.py                       # N = 8192, 32768, 131072; table last
    python benchmarks/bench_masks.py --sizes 8192 --out bench_masks.json

With CuPy and a GPU the builders run on the device and the peak is the CuPy memory pool's (bytes
handed out at once during a build, outputs included); with NumPy only, tracemalloc's host peak.
"structured" is a built-in mask (its block structure known), "generic" the same rule as an opaque
function, which evaluates every block. torch's peak is torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import tracemalloc
from typing import Any, Callable, Optional

from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from omnicupy import BlockMask, arrays, masks
from omnicupy.mask import builders
from omnicupy.mask.mask_mod import EVALUATE

MASKS = ("causal", "sliding_window_1024", "document", "interleaved")


def workload(name: str, n: int, seed: int = 0) -> masks.MaskMod:
    """The issue's masks at length n: documents of random lengths 256-2048, 512 text / 576 image."""
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


def torch_mask_mod(name: str, mod: masks.MaskMod, n: int):
    """The same rule as a torch mask_mod; lookup tables come from the omnicupy mask's row bounds."""
    import torch

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


def measure(build: Callable[[], Any], *, sync: Callable[[], None], repeat: int, warmup: int) -> list[float]:
    """Wall times in ms of ``build()``, synchronized before and after."""
    for _ in range(warmup):
        build()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        build()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def peak_memory(build: Callable[[], Any], cp) -> int:
    """Peak bytes allocated during one build: CuPy pool bytes on the GPU, tracemalloc on the host."""
    if cp is not None:
        probe = _PoolPeak(cp)
        with probe.hook:
            result = build()
            cp.cuda.Device().synchronize()
        del result
        return probe.peak
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def same_metadata(a: BlockMask, b: BlockMask) -> bool:
    names = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
    pairs = [(getattr(a, n), getattr(b, n)) for n in names]
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and np.array_equal(arrays.to_numpy(x), arrays.to_numpy(y)))
               for x, y in pairs)


def bench_omnicupy(name, n, mod, args, xp, cp, sync) -> list[dict]:
    rows, built = [], {}
    opaque = lambda b, h, q_idx, kv_idx: mod(b, h, q_idx, kv_idx)  # noqa: E731 - no structure to use
    paths = [("structured", mod, args.repeat)]
    if n <= args.generic_max_n:
        paths.append(("generic", opaque, args.generic_repeat))
    for path, fn, repeat in paths:
        def build():
            built[path] = builders.from_mask_mod(fn, None, None, n, n, q_block_size=args.block_size,
                                                 kv_block_size=args.block_size, xp=xp)
            return built[path]

        times = measure(build, sync=sync, repeat=repeat, warmup=args.warmup)
        bm = built[path]
        pool = 0 if bm.partial_block_masks is None else int(bm.partial_block_masks.shape[0])
        rows.append(dict(mask=name, n=n, impl=f"omnicupy {path} [{xp.__name__}]", ms=statistics.median(times),
                         ms_min=min(times), peak_mb=peak_memory(build, cp) / 2**20, sparsity=bm.sparsity(),
                         pool=pool, note=""))
    grid = mod.classify_blocks(1, 1, n, n, args.block_size, args.block_size, xp=np)
    rows[0]["note"] = f"{int(np.count_nonzero(grid == EVALUATE))} blocks evaluated"
    if "generic" in built:
        rows[1]["note"] = "same metadata" if same_metadata(built["structured"], built["generic"]) else "METADATA DIFFER"
    return rows


def bench_torch(name, n, mod, args) -> Optional[dict]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    fn = torch_mask_mod(name, mod, n)
    row = dict(mask=name, n=n, impl="torch create_block_mask" + (" (_compile)" if args.torch_compile else ""),
               ms=float("nan"), ms_min=float("nan"), peak_mb=float("nan"), sparsity=float("nan"), pool=0, note="")
    built = {}

    def build():
        built["bm"] = create_block_mask(fn, None, None, n, n, device="cuda", BLOCK_SIZE=args.block_size,
                                        **({"_compile": True} if args.torch_compile else {}))

    try:
        times = measure(build, sync=torch.cuda.synchronize, repeat=args.repeat, warmup=args.warmup)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        build()
        torch.cuda.synchronize()
        row.update(ms=statistics.median(times), ms_min=min(times),
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
    head = (f"{'mask':<20} {'N':>7}  {'implementation':<32} {'median ms':>10} {'min ms':>9} {'peak MB':>9} "
            f"{'sparsity %':>10} {'pool':>5}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mask']:<20} {r['n']:>7}  {r['impl']:<32} {r['ms']:>10.2f} {r['ms_min']:>9.2f} {r['peak_mb']:>9.1f} "
              f"{r['sparsity']:>10.2f} {r['pool']:>5}  {r['note']}")


def main(argv=None) -> None:
    gpu = arrays.gpu_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--generic-repeat", type=int, default=2)
    parser.add_argument("--generic-max-n", type=int, default=131072 if gpu else 8192,
                        help="largest N for the generic path (it evaluates all N^2 elements)")
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
            mod = workload(name, n)
            new = bench_omnicupy(name, n, mod, args, xp, cp, sync)
            if use_torch:
                if cp is not None:  # hand CuPy's cached blocks back so that torch can use them
                    cp.get_default_memory_pool().free_all_blocks()
                new.append(bench_torch(name, n, mod, args))
            for r in new:
                print(f"  {r['mask']} N={r['n']} {r['impl']}: {r['ms']:.2f} ms {r['note']}", flush=True)
            rows += new

    env = dict(python=platform.python_version(), numpy=np.__version__, array_module=xp.__name__,
               chunk_elements=builders.CHUNK_ELEMENTS, block_size=args.block_size)
    if cp is not None:
        env.update(cupy=cp.__version__, device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    if use_torch:
        import torch

        env.update(torch=torch.__version__)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
    print()
    print(", ".join(f"{k}={v}" for k, v in env.items()))
    print_table(rows)


if __name__ == "__main__":
    main()
