"""Decode tuning (issue 16): split-KV kernel candidates side by side, in one process.

    PYTHONPATH=. python lab/bench/tune_decode.py [--cells 1:8192,...] [--candidates base,fused,...]
                                                  [--nq 1|16] [--paged 16,64] [--paged-candidates base,...]
                                                  [--reps 5] [--json out.json]

Cases: fp16, D 128, Hq 32, Hkv 8, one query per sequence (bottom-right causal), batch x cache length
in {1, 8, 32} x {8k, 32k, 128k} on a contiguous cache, and the same cells on paged caches (page
sizes 16 and 64, pages in random order) for the paged candidates. Every candidate of a cell is
checked first against one float64 reference of that cell (two (batch, kv head) query groups:
the first and the last); a wrong candidate is reported and not timed. Times are GPU times per call
from CUDA graphs of 16 calls over rotating cache copies (benchmarks/bench_decode.py's timing: L2
holds none of the inputs), in K+V TB/s. The table comes last: one row per cell, one column per
candidate, the best marked.

Candidates (what changes against the shipped kernel; the split count always comes from the
heuristic, which counts CTAs per SM from the tile's shared memory, unless a candidate scales it):
  base          the shipped tile (D 128, 16-row m tile: 4 warps = 4 kv groups, 3-stage ring)
  fused         base, splits merged by the last CTA of each unit (no combine launch)
  w4s2          4 warps, 2 stages (one tile in flight per warp, 139 KB: still 1 CTA/SM)
  w2s3          2 warps, 3 stages (109 KB: 2 CTAs/SM, each CTA's prologue/merge under the other's loads)
  w3s2          3 warps, 2 stages (109 KB: 2 CTAs/SM)
  w1s4          1 warp, 4 stages (74 KB: 3 CTAs/SM, 3 tiles in flight per warp)
  w2s3_fused    w2s3 + fused
  splits_x2     base with twice the heuristic's splits (more waves)
  splits_half   base with half of them (fewer partials)
Paged candidates (--paged): base, fused and w2s3_fused (--nq 16: base and fused) on page sizes 16
and 64 (name/ps16, name/ps64).
With --nq 16 (GQA 4 x 16 positions: 64-row m tiles of 4 row warps per kv group; shipped 8 warps,
3 stages = 2 kv groups, 218 KB):
  w4s3          one kv group, 3 stages (70 KB: 3 CTAs/SM)
  w4s4          one kv group, 4 stages (87 KB: 2 CTAs/SM)
  w8s2          two kv groups, 2 stages (87 KB: 2 CTAs/SM)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0])  # the repository root, for `benchmarks`
from benchmarks import bench_decode as bd  # noqa: E402

HQ, HKV, D = bd.HQ, bd.HKV, bd.D
TOL = 3e-3


@dataclass(frozen=True)
class Candidate:
    name: str
    tile: Optional[tuple[int, int]] = None  # (warps, stages) of the cell's m tile; None: shipped
    fused: bool = False
    split_scale: float = 1.0


CANDIDATES = {c.name: c for c in (
    Candidate("base"),
    Candidate("fused", fused=True),
    Candidate("w4s2", tile=(4, 2)),
    Candidate("w2s3", tile=(2, 3)),
    Candidate("w3s2", tile=(3, 2)),
    Candidate("w1s4", tile=(1, 4)),
    Candidate("w2s3_fused", tile=(2, 3), fused=True),
    Candidate("splits_x2", split_scale=2.0),
    Candidate("splits_half", split_scale=0.5),
    # --nq 16 (64-row m tiles: 4 row warps per kv group)
    Candidate("w4s3", tile=(4, 3)),
    Candidate("w4s4", tile=(4, 4)),
    Candidate("w8s2", tile=(8, 2)),
)}
#: The default candidates per Nq (the 64-row ones make no 16-row tile and the reverse).
DEFAULT_CANDIDATES = {1: ("base", "fused", "w4s2", "w2s3", "w3s2", "w1s4", "w2s3_fused", "splits_x2", "splits_half"),
                      16: ("base", "fused", "w4s3", "w4s4", "w8s2", "splits_x2")}
#: The paged candidates per Nq (as DEFAULT_CANDIDATES: a 16-row tile's warp counts make no 64-row tile).
PAGED_CANDIDATES = {1: ("base", "fused", "w2s3_fused"), 16: ("base", "fused")}


class Setup:
    """Applies a candidate to the decode module (tile table, fused flag) and restores it."""

    def __init__(self, br: int = 16) -> None:
        from omnicupy.ops import decode

        self.decode = decode
        self.br = br
        self.shipped = decode.DECODE_TILES
        self.fused = decode.FUSED_COMBINE

    def apply(self, cand: Candidate) -> None:
        # Both are part of the decode's plan cache and steady-state keys (decode.settings()): a
        # candidate never replays another one's launch.
        d = self.decode
        d.DECODE_TILES = self.shipped if cand.tile is None else self.shipped.updated({(D, self.br): cand.tile})
        d.FUSED_COMBINE = cand.fused

    def restore(self) -> None:
        self.apply(Candidate("base"))
        self.decode.FUSED_COMBINE = self.fused

    def splits(self, cand: Candidate, cache: bd.Cache, page_size: Optional[int]) -> Optional[int]:
        """None (the heuristic), or the heuristic's count scaled by the candidate."""
        if cand.split_scale == 1.0:
            return None
        q, k, v = cache.contiguous(0)
        from omnicupy.ops.inputs import check_qkv

        plan = self.decode.decode_plan(check_qkv(q, k, v), None, None, None, causal="bottom_right", force=True)
        return max(1, min(self.decode.MAX_SPLITS, int(round(plan.num_splits * cand.split_scale))))

    def describe(self, cache: bd.Cache, splits: Optional[int]) -> str:
        from omnicupy.ops.inputs import check_qkv

        q, k, v = cache.contiguous(0)
        plan = self.decode.decode_plan(check_qkv(q, k, v), None, None, splits, causal="bottom_right", force=True)
        return f"{plan.split.variant.name} x {plan.num_splits}{' fused' if plan.fused else ''}"


def reference_rows(cache: bd.Cache, page_size: Optional[int]) -> dict:
    """float64 outputs of the query groups of (batch, kv head) in {(0, 0), (B-1, Hkv-1)}."""
    group = HQ // HKV
    q = cache.sets[0][0]
    want = {}
    for b, hk in sorted({(0, 0), (cache.B - 1, HKV - 1)}):
        k, v = cache.keys_of(b, hk, 0, page_size)
        L = int(cache.lens[b])
        qh = bd.host64(q[b, hk * group:(hk + 1) * group])  # [group, nq, D]
        s = qh @ k.T / math.sqrt(D)
        pos = np.arange(cache.nq)[:, None] + L - cache.nq
        s = np.where((np.arange(L)[None, :] <= pos)[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want[(b, hk)] = (p / p.sum(-1, keepdims=True)) @ v
    return want


def error(out, want: dict) -> float:
    group = HQ // HKV
    errs = []
    for (b, hk), w in want.items():
        got = bd.host64(out[b, hk * group:(hk + 1) * group])
        errs.append(np.linalg.norm(got - w) / np.linalg.norm(w) if np.all(np.isfinite(got)) else float("inf"))
    return float(max(errs))


def call_fn(setup: Setup, cand: Candidate, cache: bd.Cache, page_size: Optional[int], splits: Optional[int]):
    import omnicupy

    decode = setup.decode
    lens_d = None

    def contiguous(i):
        setup.apply(cand)
        q, k, v = cache.contiguous(i)
        return decode.decode_attention(q, k, v, num_splits=splits, causal="bottom_right")

    def paged(i):
        nonlocal lens_d
        setup.apply(cand)
        if lens_d is None:
            import cupy as cp

            lens_d = cp.asarray(cache.lens)
        q, kp, vp, table = cache.pages(i, page_size)
        return omnicupy.paged_attention(q, kp, vp, table, lens_d, causal=True, validate=False, num_splits=splits)

    return contiguous if page_size is None else paged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="", help="B:N list (default: {1, 8, 32} x {8k, 32k, 128k})")
    ap.add_argument("--candidates", default="", help="default: DEFAULT_CANDIDATES for --nq")
    ap.add_argument("--nq", type=int, default=1, help="queries per sequence (16: 64-row m tiles)")
    ap.add_argument("--paged", default="16,64", help="page sizes for the paged candidates ('' for none)")
    ap.add_argument("--paged-candidates", default="",
                    help="candidates run on the paged caches (default: PAGED_CANDIDATES for --nq)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    gpu = bd.Gpu()
    print(f"device {gpu.name}, L2 {gpu.l2 >> 20} MB", flush=True)
    cells = ([tuple(int(x) for x in c.split(":")) for c in args.cells.split(",") if c]
             or [(B, N) for B in bd.BATCHES for N in bd.LENGTHS])
    names = [n for n in args.candidates.split(",") if n] or list(DEFAULT_CANDIDATES.get(args.nq, ("base",)))
    paged_names = [n for n in args.paged_candidates.split(",") if n] or list(PAGED_CANDIDATES.get(args.nq, ("base",)))
    unknown = [n for n in names + paged_names if n not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidates {unknown}; have {list(CANDIDATES)}")
    page_sizes = [int(p) for p in args.paged.split(",") if p]
    from omnicupy.ops import decode

    setup = Setup(decode.pack_rows(HQ // HKV, args.nq).br)
    results: dict[tuple[int, int], dict[str, Any]] = {}
    columns: list[str] = []
    try:
        for B, N in cells:
            cache = bd.make_cache(gpu, B, N, args.nq, "fp16", seed=B * 1000 + N)
            nbytes = bd.kv_bytes(cache.lens)
            row = results.setdefault((B, N), {})
            runs = [(CANDIDATES[n], None) for n in names]
            runs += [(CANDIDATES[n], ps) for ps in page_sizes for n in paged_names]
            wants = {}
            for cand, ps in runs:
                label = cand.name if ps is None else f"{cand.name}/ps{ps}"
                if label not in columns:
                    columns.append(label)
                try:
                    if ps is not None:
                        cache.table(gpu, ps)
                    if ps not in wants:
                        wants[ps] = reference_rows(cache, ps)
                    setup.apply(cand)
                    splits = setup.splits(cand, cache, ps)
                    fn = call_fn(setup, cand, cache, ps, splits)
                    out = fn(0)
                    gpu.cp.cuda.runtime.deviceSynchronize()
                    err = error(out, wants[ps])
                    what = setup.describe(cache, splits) + ("" if ps is None else " (contiguous plan)")
                    if not err <= TOL:
                        row[label] = {"err": err, "tbs": None, "note": "WRONG: not timed", "kernel": what}
                    else:
                        ms, eager = bd.time_cupy(gpu, fn, len(cache.sets), args.reps)
                        tbs = nbytes / (ms * 1e-3) / 1e12
                        row[label] = {"err": err, "ms": ms, "eager_ms": eager, "tbs": tbs, "kernel": what}
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot run this cell
                    row[label] = {"tbs": None, "note": f"{type(exc).__name__}: {str(exc)[:160]}"}
                r = row[label]
                shown = f"{r['tbs']:6.2f} TB/s {r['ms'] * 1e3:9.1f} us" if r.get("tbs") else "   -   "
                print(f"  B{B:<3d} x {N // 1024:>3d}k  {label:18s} {shown}  err {r.get('err', float('nan')):.1e}  "
                      f"{r.get('kernel', '')} {r.get('note', '')}", flush=True)
            del cache
            gpu.cp.cuda.runtime.deviceSynchronize()
            gpu.cp.get_default_memory_pool().free_all_blocks()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": gpu.name, "cells": {f"{b}x{n}": r for (b, n), r in results.items()}},
                              f, indent=1, default=float)
    finally:
        setup.restore()
    print(table(results, columns, args.nq))
    return 0


def table(results: dict, columns: list[str], nq: int = 1) -> str:
    """One row per cell, K+V TB/s per candidate; * marks the best contiguous and the best paged."""
    head = "cell        " + "".join(f"{c:>14s}" for c in columns)
    lines = ["", f"decode tuning, fp16 D128 Hq32 Hkv8 Nq{nq}, K+V TB/s (* best of its kind)", head]
    for (B, N), row in results.items():
        best = {}
        for kind in ("contiguous", "paged16", "paged64"):
            vals = {c: row[c]["tbs"] for c in columns if c in row and row[c].get("tbs")
                    and (("/ps" not in c) if kind == "contiguous" else c.endswith(kind[5:]) and "/ps" in c)}
            if vals:
                best[max(vals, key=vals.get)] = True
        cells = []
        for c in columns:
            r = row.get(c)
            if r is None:
                cells.append(f"{'':>14s}")
            elif not r.get("tbs"):
                cells.append(f"{'WRONG' if 'WRONG' in r.get('note', '') else 'fail':>14s}")
            else:
                cells.append(f"{r['tbs']:13.2f}{'*' if c in best else ' '}")
        lines.append(f"B{B:<3d} x {N // 1024:>3d}k " + "".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
