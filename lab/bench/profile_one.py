"""A few omnicupy calls (and SDPA flash on full/causal) on one benchmark mask, for ncu.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:'omni_fwd|flash' -c 4 python3 lab/bench/profile_one.py --head-dim 64 --mask sliding_window

``--tile br:bc:warps[:o][:pN]`` (tiles.Tile.parse) overrides the tile of the chosen family (``--mma``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402

from omnicupy.dispatch.arch import has_wgmma
import omnicupy  # noqa: E402
from benchmarks import _cases  # noqa: E402
from omnicupy import BlockMask, jit  # noqa: E402
from omnicupy.dispatch import tiles  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--mask", default="causal", help=f"one of {', '.join(_cases.MASK_NAMES)}")
    ap.add_argument("--mma", default="auto", choices=("auto", "sync", "wgmma"))
    ap.add_argument("--tile", default="")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    os.environ["OMNICUPY_MMA"] = args.mma
    D, N, B, H = args.head_dim, args.n, _cases.batch_for(args.n), _cases.HEADS
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    if args.mask in ("full", "causal"):
        bm = BlockMask.full(N, N) if args.mask == "full" else BlockMask.causal(N, N)
    else:
        mod, _, _ = _cases.resolve_product_mod(_cases.make_mask(args.mask, N), _cases.masks_module())
        bm = BlockMask.from_mask_mod(mod, None, None, N, N)
    overrides = {}
    if args.tile:
        overrides = {(D, 2): tiles.Tile.parse(args.tile)}
    family = "wgmma" if args.mma == "wgmma" or (args.mma == "auto" and has_wgmma(jit.device_arch())) else "sync"
    with tiles.use_tiles(overrides, family=family):
        for _ in range(args.calls):
            omnicupy.attention(q, k, v, bm, stages=2)
    cp.cuda.Device().synchronize()
    if args.mask not in ("full", "causal"):
        return
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(args.calls):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.mask == "causal")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
