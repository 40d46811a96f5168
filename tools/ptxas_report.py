"""Registers and spills of kernel variants, from ptxas via NVRTC (no GPU needed).

    python tools/ptxas_report.py [--arch sm_90] [--tiles 128:64:4,...] [--head-dims 64,128]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from omnicupy.jit import build
from omnicupy.jit.cache import DiskCache
from omnicupy.dispatch.variant import Variant


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--tiles", default="64:64:4,128:64:4,128:32:4,128:128:8,64:32:4")
    ap.add_argument("--head-dims", default="32,64,96,128,256")
    ap.add_argument("--dtype", default="fp16")
    args = ap.parse_args(argv)
    cache = DiskCache(Path(tempfile.mkdtemp()))
    print(f"{'variant':58} {'regs':>5} {'spill':>6}")
    for hd in map(int, args.head_dims.split(",")):
        for tile in args.tiles.split(","):
            br, bc, w = map(int, tile.split(":"))
            for st in (1, 2):
                for causal, partial in ((False, False), (True, True)):
                    v = Variant(hd, args.dtype, br, bc, w, st, causal, partial)
                    entry, _ = build(v, args.arch, cache=cache)
                    print(f"{v.name:58} {entry.meta['registers']:>5} {entry.meta['spill_bytes']:>6}")


if __name__ == "__main__":
    main()
