"""Run every shipped backward variant once on a small shape, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 tests/sanitize/sanitize_backward.py [--head-dims 64] [--dtypes fp16]
    compute-sanitizer --tool racecheck python3 tests/sanitize/sanitize_backward.py
    ... tests/sanitize/sanitize_backward.py --family wgmma --head-dims 64,128   (the wgmma backward, sm_90)

Each variant gets a mask with exactly its features (plain: full; causal: causal; partial: random
full/partial blocks with empty rows; both: a random mix) at odd lengths with GQA, so tails, every
mask path and the group walk run; deterministic=True runs as well on every variant (the fixed-point
dQ entry and its K/V bounds kernel; on wgmma at D = 128 its two dQ writers). Then, per head dim, the
feature variants (bias + softcap; softcap alone, which takes the warp-specialized kernel at D = 128
on sm_90) and, deterministic, a score modifier whose derivative is 2 (the mma.sync kernel's ordered
fp32 dQ and its turns). Exits 1 if any gradient is wrong.
CuPy's memory pool is switched off, so that every buffer is its own allocation for memcheck.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import omnicupy
from omnicupy import BlockMask, reference, score_mods
from omnicupy.dispatch import tiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helpers import DOUBLED_SCORE, TOLERANCE, random_block_mask, random_qkv  # noqa: E402


def mask_with(features, rng, n):
    causal, partial = features
    if not partial:
        bm = BlockMask.causal(n, n) if causal else BlockMask.full(n, n)
        return bm, bm.to_dense()
    probs = (0.2, 0.3, 0.2, 0.3) if causal else (0.2, 0.0, 0.4, 0.4)
    return random_block_mask(rng, 1, 4, n, n, 128, 128, probs=probs, empty_q_blocks=1)


def run(label, rng, q, k, v, bm, dense, dtype, **kw) -> int:
    import cupy as cp

    dout = rng.standard_normal(q.shape).astype(q.dtype)
    ref_kw = {n: kw[n] for n in ("bias", "score_mod") if n in kw}
    out, lse = reference.attention(q, k, v, dense, return_lse=True, **ref_kw)
    got = omnicupy.attention_backward(cp.asarray(dout), cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                      cp.asarray(out.astype(q.dtype)), cp.asarray(lse.astype(np.float32)), bm, **kw)
    cp.cuda.runtime.deviceSynchronize()
    want = reference.attention_backward(dout, q, k, v, dense, **ref_kw)
    errs = [reference.relative_error(g.get(), w) for g, w in zip(got, want)]
    ok = max(errs) <= TOLERANCE[dtype]
    plan_kw = {n: kw[n] for n in ("bias", "score_mod", "causal") if n in kw}
    ran = omnicupy.ops.backward.plan(q, k, v, bm, **plan_kw).kernel  # the kernel the call selected
    print(f"{label} [{ran}]: errors dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    import cupy as cp

    # Plain cudaMalloc per array instead of CuPy's pool, so that memcheck sees each buffer's bounds.
    cp.cuda.set_allocator(None)
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="32,64,96,128,256")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--n", type=int, default=261)
    ap.add_argument("--family", choices=("sync", "wgmma"), default="sync",
                    help="backward family to run (sets OMNICUPY_BWD; wgmma needs sm_90)")
    args = ap.parse_args(argv)
    os.environ["OMNICUPY_BWD"] = args.family
    head_dims = tuple(int(h) for h in args.head_dims.split(","))
    rng = np.random.default_rng(0)
    failures = 0
    n = args.n
    for variant in tiles.shipped_backward_variants(dtypes=tuple(args.dtypes.split(",")), head_dims=head_dims,
                                                   families=(args.family,)):
        bm, dense = mask_with((variant.causal, variant.partial), rng, n)
        if (bm.features.causal, bm.features.partial) != (variant.causal, variant.partial):
            bm, dense = mask_with((variant.causal, variant.partial), rng, n)  # resample a degenerate draw
        q, k, v = random_qkv(rng, 1, 4, n, variant.head_dim, variant.dtype, Hkv=2)
        failures += run(variant.name, rng, q, k, v, bm, dense, variant.dtype)
        failures += run(f"{variant.name} deterministic", rng, q, k, v, bm, dense, variant.dtype, deterministic=True)
    for hd in head_dims:
        q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16", Nkv=n + 5)
        dense = np.arange(n)[:, None] >= np.arange(n + 5)[None, :]
        bias = rng.standard_normal((1, 2, n, n + 5)).astype(np.float32)
        failures += run(f"hd{hd} bias+softcap", rng, q, k, v, None, dense, "fp16", causal=True, bias=bias,
                        score_mod=score_mods.softcap(5.0))
        # a score modifier alone (at D = 128 on sm_90 the warp-specialized kernel, which a bias avoids)
        failures += run(f"hd{hd} softcap", rng, q, k, v, None, dense, "fp16", causal=True,
                        score_mod=score_mods.softcap(5.0))
        failures += run(f"hd{hd} ordered (derivative 2)", rng, q, k, v, None, dense, "fp16", causal=True,
                        score_mod=DOUBLED_SCORE, deterministic=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
