"""Task hd: forward time of padded head dims beside their tile's, for lab/notes/head-dims.md#s13 (GPU only).

    PYTHONPATH=. python lab/tools/hd_time.py [--n 4096] [--rep 20]

For each (padded D, tile D) pair: causal fp16 forward, B = 2, H = 16, N = --n, the family
OMNICUPY_MMA picks (default auto), median of --rep CUDA-event timings after 3 warm-ups. Prints ms,
TFLOP/s counted on the real D (4 N^2 D H B / 2 for causal), and padded / tile time.
"""
from __future__ import annotations

import argparse

import numpy as np

import omnicupy

PAIRS = ((40, 64), (80, 96), (104, 128), (136, 256), (192, 256))


def time_forward(cp, D: int, n: int, rep: int) -> tuple[float, str]:
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, n, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    out = cp.empty_like(q)
    for _ in range(3):
        omnicupy.attention(q, k, v, causal=True, out=out)
    times = []
    for _ in range(rep):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        omnicupy.attention(q, k, v, causal=True, out=out)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times)), omnicupy.plan(q, k, v, causal=True).kernel


def main() -> None:
    import cupy as cp

    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rep", type=int, default=20)
    args = parser.parse_args()
    print(f"{'D':>4} {'tile':>4} {'ms':>8} {'tile ms':>8} {'ratio':>6} {'TFLOP/s':>8}  kernel")
    for d, tile in PAIRS:
        ms, kernel = time_forward(cp, d, args.n, args.rep)
        tile_ms, _ = time_forward(cp, tile, args.n, args.rep)
        flops = 4 * args.n * args.n * d * 16 * 2 / 2
        print(f"{d:>4} {tile:>4} {ms:8.3f} {tile_ms:8.3f} {ms / tile_ms:6.2f} {flops / ms / 1e9:8.1f}  {kernel}")


if __name__ == "__main__":
    main()
