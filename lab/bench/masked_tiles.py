"""What masked tiles cost: one element mask with its blocks typed different ways, and sliding windows
by width with a straight-line fit (time = steps x per-step cost + a fixed cost per q tile).

    PYTHONPATH=. python3 lab/bench/masked_tiles.py [--pass fwd|bwd] [--head-dims 64,128] [--n 8192]
        [--batch 2] [--heads 16] [--windows 128,256,512,1024,2048,4096] [--rounds 2] [--dry-run]

The typed masks (``typed_mask``) list the same blocks with other BlockTypes: full attention as all
FULL or all PARTIAL with all-ones bits, causal attention with its lower blocks FULL or PARTIAL
(all ones) and CAUSAL diagonal blocks. Their element masks are equal, so any time difference is the
cost of the block type itself (lab/notes/backward.md#s32 measured a PARTIAL q tile at 1.35-1.49x a FULL one in
the backward before its bits were staged in shared memory). Before timing, every case is checked
against float64 at N = 1024 (one head, the same mask built at that length: the same kernels and
block types). ``--dry-run`` builds the masks and prints their block counts (no GPU needed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from lab.bench.tune_backward import time_ms  # noqa: E402  (CUDA events, median of 10 after 3 warm-ups)
from omnicupy import BlockMask, masks  # noqa: E402
from omnicupy.mask.types import BlockType  # noqa: E402

FULL, CAUSAL, PARTIAL = int(BlockType.FULL), int(BlockType.CAUSAL), int(BlockType.PARTIAL)
BLOCK = 128


def typed_mask(n: int, lower: int, diag: int, upper: Optional[int]) -> BlockMask:
    """Every q block row lists its kv blocks below the diagonal typed ``lower``, the diagonal one
    ``diag`` and those above it ``upper`` (None: not listed). PARTIAL blocks carry all-ones bits, so
    the element mask is full attention (``upper`` given) or causal attention (``diag`` CAUSAL)."""
    nb = -(-n // BLOCK)
    cols = np.arange(nb)[None, :]
    rows = np.arange(nb)[:, None]
    types = np.where(cols < rows, lower, np.where(cols == rows, diag, -1 if upper is None else upper))
    listed = types >= 0
    counts = listed.sum(1).astype(np.int32)
    width = int(counts.max())
    # Listed blocks first, in kv order: a stable sort on "not listed" keeps each row's order.
    order = np.argsort(~listed, axis=1, kind="stable")[:, :width]
    kv_indices = np.where(np.arange(width)[None, :] < counts[:, None], order, 0).astype(np.int32)
    block_types = np.where(np.arange(width)[None, :] < counts[:, None],
                           np.take_along_axis(types, order, axis=1), 0).astype(np.int32)
    pool = np.full((1, BLOCK, BLOCK // 32), 0xFFFFFFFF, np.uint32)
    return BlockMask(counts[None, None], kv_indices[None, None], block_types[None, None], q_len=n, kv_len=n,
                     q_block_size=BLOCK, kv_block_size=BLOCK,
                     partial_block_mask_indices=np.zeros_like(kv_indices)[None, None], partial_block_masks=pool)


def cases_at(n: int, windows: list[int], xp) -> dict[str, BlockMask]:
    """The typed masks and the sliding windows at length n."""
    return {
        "full, FULL blocks": typed_mask(n, FULL, FULL, FULL),
        "full, PARTIAL blocks": typed_mask(n, PARTIAL, PARTIAL, PARTIAL),
        "causal, FULL below": typed_mask(n, FULL, CAUSAL, None),
        "causal, PARTIAL below": typed_mask(n, PARTIAL, CAUSAL, None),
        **{f"sliding window {w}": BlockMask.from_mask_mod(masks.sliding_window(w), None, None, n, n, xp=xp)
           for w in windows},
    }


def listed_blocks(bm: BlockMask) -> int:
    counts = bm.kv_num_blocks
    return int((counts.get() if hasattr(counts, "get") else np.asarray(counts)).sum())


def check(pass_name: str, bm: BlockMask, head_dim: int, seed: int) -> float:
    """Relative error against float64 of one head under ``bm`` (built at a short length): the output,
    or the largest of the three gradients' errors."""
    import cupy as cp

    import omnicupy
    from omnicupy import reference

    n = bm.q_len
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, 1, n, head_dim)).astype(np.float16) for _ in range(4))
    dense = bm.to_dense()[0, 0]
    qd, kd, vd, dd = (cp.asarray(x) for x in (q, k, v, do))
    out, lse = omnicupy.attention(qd, kd, vd, bm, return_lse=True)
    if pass_name == "fwd":
        return float(reference.relative_error(out.get(), reference.attention(q, k, v, dense)))
    got = omnicupy.attention_backward(dd, qd, kd, vd, out, lse, bm)
    want = reference.attention_backward(do, q, k, v, dense)
    return max(float(reference.relative_error(g.get(), w)) for g, w in zip(got, want))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pass", dest="pass_name", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--windows", default="128,256,512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="build the masks and print their blocks; no GPU")
    args = ap.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    if args.dry_run:
        for name, bm in cases_at(args.n, windows, np).items():
            print(f"{name:24s} {listed_blocks(bm):7d} blocks  (masked, causal, full, partial) {bm.summary.counts}")
        return 0

    import cupy as cp

    import omnicupy
    from omnicupy.dispatch.arch import sm_count
    from omnicupy.ops import recall

    B, H, n, sms = args.batch, args.heads, args.n, sm_count()
    cases = cases_at(n, windows, cp)
    short = cases_at(min(n, 1024), [w for w in windows if w <= 1024], np)
    for hd in (int(h) for h in args.head_dims.split(",")):
        rng = np.random.default_rng([n, hd])
        q, k, v, do = (cp.asarray(rng.standard_normal((B, H, n, hd)).astype(np.float16)) for _ in range(4))
        tiles_per_sm = B * H * (-(-n // BLOCK)) / sms
        print(f"D = {hd}, {args.pass_name}: ms, then µs per (q block, kv block) step and SM")
        results: dict[str, list[float]] = {name: [] for name in cases}
        errors = {name: check(args.pass_name, bm, hd, seed=hd) for name, bm in short.items()}
        print("  float64 check at N = 1024: " + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
        for _ in range(args.rounds):
            for name, bm in cases.items():
                recall.store_of(bm).clear()
                if args.pass_name == "fwd":
                    fn = lambda bm=bm: omnicupy.attention(q, k, v, bm)  # noqa: E731
                else:
                    out, lse = omnicupy.attention(q, k, v, bm, return_lse=True)
                    fn = lambda bm=bm, out=out, lse=lse: omnicupy.attention_backward(do, q, k, v, out, lse, bm)  # noqa: E731
                results[name].append(time_ms(fn))
        steps = {}
        for name, bm in cases.items():
            ms = float(np.median(results[name]))
            steps[name] = listed_blocks(bm) * B * H / sms
            print(f"  {name:24s} {ms:8.3f} ms  {1e3 * ms / steps[name]:7.3f} µs/step  "
                  f"rounds {' '.join(f'{t:.3f}' for t in results[name])}", flush=True)
        names = [f"sliding window {w}" for w in windows]
        if len(names) >= 2:
            x = np.array([steps[m] for m in names])
            y = np.array([float(np.median(results[m])) * 1e3 for m in names])
            slope, intercept = np.polyfit(x, y, 1)
            print(f"  windows fit: {slope:.3f} µs per step and SM + {intercept / tiles_per_sm:.2f} µs per 128-row "
                  f"tile (a q tile forward, a kv tile backward; {tiles_per_sm:.1f} per SM)")
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
