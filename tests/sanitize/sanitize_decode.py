"""Run the split-KV decode paths once each on small shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 tests/sanitize/sanitize_decode.py [--head-dims 64,128]
    compute-sanitizer --tool racecheck python3 tests/sanitize/sanitize_decode.py --head-dims 128

Per head dim and dtype: a contiguous cache with ragged lengths (0 and 1 included) and several
splits, with the combine kernel and the fused combine; paged caches of page
sizes 16 and 64 (NHD and HND, a window); a shuffled block mask. Lengths are odd so that tails run.
Every output is checked against the float64 reference; exits 1 if one is wrong.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import omnicupy
from omnicupy import reference
from omnicupy.ops import decode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from decode_cases import TOLERANCE, host, paged_from_contiguous  # noqa: E402
from helpers import random_block_mask, random_qkv  # noqa: E402


def report(name: str, got, want, dtype: str) -> int:
    got = host(got)
    err = reference.relative_error(got, want) if np.all(np.isfinite(got)) else float("inf")
    ok = err <= TOLERANCE[dtype]
    print(f"{'ok   ' if ok else 'WRONG'} {name}: {err:.1e}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="fp16,bf16")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(16)
    failures = 0
    for D in (int(d) for d in args.head_dims.split(",")):
        for dtype in args.dtypes.split(","):
            B, Hq, Hkv, N = 3, 8, 2, 333
            lens = np.array([N, 1, 0], np.int32)
            q, k, v = random_qkv(rng, B, Hq, 2, D, dtype, Hkv=Hkv, Nkv=N)
            want = reference.decode_attention(q, k, v, lens, causal="bottom_right")
            qd, kd, vd, lens_d = (cp.asarray(x) for x in (q, k, v, lens))
            for fused in (False, True):
                decode.FUSED_COMBINE = fused
                got = decode.decode_attention(qd, kd, vd, kv_lens=lens_d, causal=True, num_splits=4)
                failures += report(f"contiguous D{D} {dtype} fused={fused}", got, want, dtype)
                for ps, layout in ((16, "NHD"), (64, "HND")):
                    kp, vp, table = paged_from_contiguous(rng, k, v, ps, layout, lens)
                    want_p = reference.paged_attention(q, kp, vp, table, lens, window=100, layout=layout)
                    got = omnicupy.paged_attention(*(cp.asarray(x) for x in (q, kp, vp, table)), lens_d, window=100,
                                                   layout=layout, num_splits=3, validate=False)
                    failures += report(f"paged ps{ps} {layout} D{D} {dtype} fused={fused}", got, want_p, dtype)
            decode.FUSED_COMBINE = False
            bm, dense = random_block_mask(rng, 1, 1, 2, N, 128, 64, probs=(0.2, 0.3, 0.2, 0.3), shuffle=True)
            want_m = reference.decode_attention(q, k, v, None, mask=dense)
            got = decode.decode_attention(qd, kd, vd, bm, num_splits=3)
            failures += report(f"block mask D{D} {dtype}", got, want_m, dtype)
    cp.cuda.runtime.deviceSynchronize()
    bits = decode.take_device_errors(raise_error=False)
    print(f"decode sanitize run: {failures} wrong, device error bits {bits}")
    return 1 if failures or bits else 0


if __name__ == "__main__":
    sys.exit(main())
