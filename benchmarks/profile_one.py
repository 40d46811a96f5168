"""One omnicupy call and one SDPA-flash call with the same inputs, for ncu side by side.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:'omni_fwd|flash' -c 4 python3 benchmarks/profile_one.py --head-dim 64 --tile 128:64:4
"""
from __future__ import annotations

import argparse

import cupy as cp

import omnicupy
from omnicupy import tiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--tile", default="")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    D, N, B, H = args.head_dim, args.n, 2, 16
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    overrides = {}
    if args.tile:
        overrides = {(D, 2): tiles.Tile(*map(int, args.tile.split(":")))}
    with tiles.use_tiles(overrides):
        for _ in range(2):
            omnicupy.attention(q, k, v, causal=args.causal, stages=2)
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
