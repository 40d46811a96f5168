"""Time omnicupy's backward kernels: candidate tiles per head dim on the benchmark's masks, the
deterministic mode, bf16, and the sparse-vs-dense ratio. Prints one line per measurement.

    PYTHONPATH=. python3 lab/bench/tune_backward.py [--head-dims 64,128] [--masks full,causal]
        [--tiles 64:64:4,32:64:4:1] [--n 8192] [--batch 2] [--heads 16] [--dtypes fp16] [--det]
        [--precompile 16] [--family sync|wgmma]

A tile is br:bc:warps[:stages] (tiles.BwdTile). Each candidate's gradients of one head are checked
against a float64 reference on the GPU (benchmarks/_systems.GradReference) before it is timed.
Backward TFLOP/s = 2.5 x 4·B·H·pairs·D / time (pairs counted from the element mask).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks import _cases, _systems  # noqa: E402
from omnicupy.dispatch import tiles  # noqa: E402
from omnicupy.ops import recall  # noqa: E402


def parse_tile(text: str) -> tiles.BwdTile:
    parts = [int(p) for p in text.split(":")]
    return tiles.BwdTile(*parts)


time_ms = _systems.cupy_time_ms  # masked_tiles.py imports it from here


def precompile(head_dims, dtypes, candidates, jobs: int, family: str = "sync") -> None:
    """Build every (tile, head dim, dtype, mask feature) variant in parallel first (the precompile command's builder)."""
    from omnicupy import jit
    from omnicupy.cli.precompile import precompile as build_variants

    variants = []
    for hd in head_dims:
        for tile in candidates.get(hd, [tiles.BACKWARD_TILES[hd]]):
            for dt in dtypes:
                for causal in (False, True):
                    for partial in (False, True):
                        variants.append(tiles.backward_variant(tile, hd, dt, causal, partial, family=family))
    build_variants(variants, [jit.device_arch()], "tune_backward", jobs, quiet=True)


def main(argv=None) -> int:
    import cupy as cp

    import omnicupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--tiles", default="", help="comma list of br:bc:warps[:stages[:parts]]; default: the tuned tile")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--det", action="store_true", help="also time deterministic=True")
    ap.add_argument("--fwd", action="store_true", help="also time omnicupy's forward (for the ratio)")
    ap.add_argument("--precompile", type=int, default=0, help="jobs for a parallel precompile first (0: none)")
    ap.add_argument("--family", choices=("sync", "wgmma"), default="sync",
                    help="backward family (sets OMNICUPY_BWD; tiles are then WGMMA_BACKWARD_TILES candidates)")
    args = ap.parse_args(argv)
    os.environ["OMNICUPY_BWD"] = args.family
    table = tiles.WGMMA_BACKWARD_TILES if args.family == "wgmma" else tiles.BACKWARD_TILES
    head_dims = [int(h) for h in args.head_dims.split(",")]
    dtypes = args.dtypes.split(",")
    given = [parse_tile(t) for t in args.tiles.split(",") if t]
    fits = (lambda t, hd: wgmma_fits(t, hd)) if args.family == "wgmma" else (lambda t, hd: t.fits(hd))
    candidates = {hd: [t for t in given if fits(t, hd)] or [table[hd]] for hd in head_dims}
    if args.precompile:
        precompile(head_dims, dtypes, candidates, args.precompile, args.family)
    gpu = _systems.Gpu(want_torch=False)
    bench = _systems.Bench(gpu, warmup=3, rep=10, check=True, mask_repeats=0, cache_label="", log=lambda m: None)
    n = args.n
    for dtype in dtypes:
        for hd in head_dims:
            case0 = _cases.Case("full", n, hd, dtype, args.batch, heads=args.heads, pass_name="bwd")
            bench.inputs = _systems.make_inputs(gpu, case0, seed=_cases.SEED + hd)
            q, k, v = bench.inputs.cupy_sets[0]
            dout = bench.inputs.douts(bench.seed)[0][0]
            for mask_name in args.masks.split(","):
                mask = _cases.make_mask(mask_name, n)
                case = _cases.Case(mask_name, n, hd, dtype, args.batch, heads=args.heads, pass_name="bwd")
                pairs = bench.pairs(mask)
                flops = _cases.attention_flops(args.batch, args.heads, pairs, hd)
                bm = bench.omnicupy_mask(mask)
                out, lse = omnicupy.attention(q, k, v, bm, return_lse=True)
                ref = _systems.GradReference(mask, case, bench.inputs, bench.seed)
                label = f"{mask_name:14s} D={hd:3d} {dtype} N={n} density {_cases.density(pairs, n):.3f}"
                if args.fwd:
                    ms = time_ms(lambda: omnicupy.attention(q, k, v, bm))
                    print(f"{label}  forward {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
                for tile in candidates[hd]:
                    # The steady state keeps each call's launch on the mask (ops/recall.py), keyed
                    # by the call, not by the tile tables: without this every tile after the first
                    # would time the first one's kernel.
                    recall.store_of(bm).clear()
                    with tiles_override(hd, tile, args.family):
                        for det in ([False, True] if args.det else [False]):
                            def run():
                                return omnicupy.attention_backward(dout, q, k, v, out, lse, bm, deterministic=det)
                            try:
                                err = ref.error(run())
                                ms = time_ms(run)
                            except Exception as exc:  # noqa: BLE001 - report and go on
                                print(f"{label}  tile {tile}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                                continue
                            plan = omnicupy.ops.backward.plan(q, k, v, bm)
                            print(f"{label}  {plan.kernel:44s} det={int(det)} {ms:8.3f} ms "
                                  f"{2.5 * flops / ms / 1e9:7.1f} TFLOP/s  err {err:.1e}", flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    return 0


def wgmma_fits(tile: tiles.BwdTile, head_dim: int) -> bool:
    """Whether the wgmma backward has a kernel for ``tile`` at ``head_dim`` (Variant's rules)."""
    from omnicupy.errors import VariantError

    try:
        tiles.backward_variant(tile, head_dim, "fp16", False, False, family="wgmma")
    except VariantError:
        return False
    return True


class tiles_override:
    """Temporarily make ``tile`` the backward tile of ``head_dim`` (both mma.sync tables, or the wgmma one)."""

    def __init__(self, head_dim: int, tile: tiles.BwdTile, family: str = "sync") -> None:
        self.head_dim, self.tile = head_dim, tile
        self.tables = (tiles.WGMMA_BACKWARD_TILES,) if family == "wgmma" else (tiles.BACKWARD_TILES,
                                                                             tiles.BACKWARD_FEATURE_TILES)

    def __enter__(self):
        self.saved = [table[self.head_dim] for table in self.tables]
        for table in self.tables:
            table[self.head_dim] = self.tile

    def __exit__(self, *exc):
        for table, tile in zip(self.tables, self.saved):
            table[self.head_dim] = tile


if __name__ == "__main__":
    sys.exit(main())
