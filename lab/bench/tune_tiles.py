"""Time candidate tiles per (head_dim, stages) on full and causal masks; print a table.

    PYTHONPATH=. python3 lab/bench/tune_tiles.py [--head-dims 64,128] [--n 8192] [--batch 2] [--heads 16]
                                                  [--mma sync|wgmma|tma]

Each candidate is checked against the reference on a subsample of rows before it is timed. SDPA's
flash backend (FlashAttention-2) is timed in the same process when torch is importable.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks, omnicupy
import omnicupy  # noqa: E402
from benchmarks import _systems  # noqa: E402
from omnicupy import reference  # noqa: E402
from omnicupy.dispatch import tiles  # noqa: E402
from omnicupy.dispatch.variant import Variant  # noqa: E402

CANDIDATES = [tiles.Tile(*t) for t in [(64, 64, 4), (128, 64, 4), (128, 32, 4), (128, 64, 8), (128, 128, 8),
                                        (64, 128, 4), (64, 32, 4), (128, 32, 8)]]
WGMMA_CANDIDATES = [tiles.Tile(*t) for t in [(128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4), (192, 128, 12),
                                              (128, 256, 8), (192, 64, 12)]]
#: The tma family (warps include the producer warpgroup's 4): the pipelines, poly_exp and kv widths
#: of lab/notes/forward.md#s24's sweeps.
TMA_CANDIDATES = [tiles.Tile.parse(t) for t in ("128:128:12", "128:128:12:o", "128:128:12:o:pp", "128:128:12:p8",
                                                "128:64:12", "128:64:12:o:pp", "128:256:12", "64:64:8:o")]


def tile_label(tile: tiles.Tile) -> str:
    """128x128w12, plus o (overlap), pp (ping-pong), pN (poly_exp)."""
    flags = ("o" if tile.overlap else "") + ("pp" if tile.pingpong else "") + (f"p{tile.poly_exp}" if tile.poly_exp else "")
    return f"{tile.br}x{tile.bc}w{tile.warps}{flags}"


time_ms = _systems.cupy_time_ms


def check_rows(q, k, v, out, causal, rows=48, seed=0):
    """Relative error of ``out`` on a random subsample of rows of (b=0, h=0)."""
    rng = np.random.default_rng(seed)
    n = q.shape[2]
    sel = np.sort(rng.choice(n, size=min(rows, n), replace=False))
    qs = q[:1, :1, sel].get()
    ks, vs = k[:1, :1].get(), v[:1, :1].get()
    mask = (sel[:, None] >= np.arange(n)[None, :]) if causal else None
    want = reference.attention(qs, ks, vs, mask)
    return reference.relative_error(out[:1, :1, sel].get(), want)


def main(argv=None):
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--tiles", default="", help="br:bc:warps[:o][:pN],... (default: built-in candidates)")
    ap.add_argument("--json", default="")
    ap.add_argument("--mma", choices=("sync", "wgmma", "tma"), default="sync", help="kernel family to tune")
    args = ap.parse_args(argv)
    os.environ["OMNICUPY_MMA"] = args.mma
    head_dims = [int(x) for x in args.head_dims.split(",")]
    stages_list = [int(x) for x in args.stages.split(",")]
    # tiles.Tile.parse specs: br:bc:warps[:o][:pN]
    candidates = ([tiles.Tile.parse(t) for t in args.tiles.split(",")]
                  if args.tiles
                  else {"wgmma": WGMMA_CANDIDATES, "tma": TMA_CANDIDATES}.get(args.mma, CANDIDATES))
    B, H, N = args.batch, args.heads, args.n
    dtype = np.float16 if args.dtype == "fp16" else omnicupy.arrays.BFLOAT16
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    rows = []
    for D in head_dims:
        rng = cp.random.default_rng(D)
        q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(dtype) for _ in range(3))
        for causal in (False, True):
            pairs = N * (N + 1) / 2 if causal else N * N
            flops = 4 * B * H * pairs * D
            if torch is not None and dtype == np.float16:
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                rows.append(dict(D=D, causal=causal, system="sdpa_flash", tile="", ms=ms, tflops=flops / ms / 1e9))
                print(f"D={D} causal={causal} sdpa_flash {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
            for st in stages_list:
                for tile in candidates:
                    try:
                        v_ = Variant(D, args.dtype, tile.br, tile.bc, tile.warps, st, causal, family=args.mma,
                                     **tile.options())
                    except ValueError:
                        continue
                    if v_.smem_bytes > 227 * 1024:
                        continue
                    # Blocks that the tile divides (a 192-row tile needs 384-row q blocks), so that
                    # the call runs this tile and not a fallback.
                    blocks = dict(q_block_size=math.lcm(128, tile.br), kv_block_size=math.lcm(128, tile.bc))
                    make = omnicupy.BlockMask.causal if causal else omnicupy.BlockMask.full
                    bm = make(N, N, **blocks)
                    with tiles.use_tiles({(D, st): tile}, family=args.mma):
                        chosen = tiles.select_variant(D, args.dtype, st, bm.q_block_size, bm.kv_block_size,
                                                      bm.features.causal, bm.features.partial,
                                                      arch=omnicupy.jit.device_arch())
                        if chosen != v_:
                            print(f"D={D} st={st} {tile}: selection gives {chosen.name}; skipped", file=sys.stderr)
                            continue
                        try:
                            out = omnicupy.attention(q, k, v, bm, stages=st)
                            err = check_rows(q, k, v, out, causal)
                            ms = time_ms(lambda: omnicupy.attention(q, k, v, bm, stages=st))
                        except Exception as exc:  # noqa: BLE001 - record and go on
                            print(f"D={D} st={st} {tile}: ERROR {exc}", file=sys.stderr, flush=True)
                            continue
                    kernel = omnicupy.jit.get_kernel(v_)
                    ok = err <= (3e-3 if args.dtype == "fp16" else 2e-2)
                    row = dict(D=D, causal=causal, system=f"omnicupy_{args.mma}_st{st}", tile=tile_label(tile),
                               ms=ms, tflops=flops / ms / 1e9 if ok else None, err=err, regs=kernel.num_regs,
                               local=kernel.local_size_bytes)
                    rows.append(row)
                    print(f"D={D} causal={causal} st={st} {row['tile']}: {ms:.3f} ms "
                          f"{(row['tflops'] or 0):.1f} TFLOP/s err={err:.1e} regs={row['regs']} local={row['local']}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'D':>4} {'mask':>6} {'system':>14} {'tile':>10} {'ms':>8} {'TFLOP/s':>8} {'regs':>5} {'local':>5}")
    for r in rows:
        tf = "WRONG" if r["tflops"] is None else f"{r['tflops']:.1f}"
        print(f"{r['D']:>4} {'causal' if r['causal'] else 'full':>6} {r['system']:>14} {r['tile']:>10} "
              f"{r['ms']:>8.3f} {tf:>8} {r.get('regs', ''):>5} {r.get('local', ''):>5}")


if __name__ == "__main__":
    main()
