"""One decode cell in one layout, called a few times, for ncu (GPU).

    ncu --clock-control none -k regex:omni_decode -s 2 -c 1 --section SpeedOfLight ... \\
        python3 lab/tools/prof_decode.py --layout paged16 --batch 1 --length 32768

Layouts: ``contiguous`` (the public ``attention()`` on the [B, N, Hkv, D] cache seen as BHND, as
bench_decode.py times it), ``paged16`` / ``paged64`` (``paged_attention``, NHD pages in random
order). fp16, Hq 32, Hkv 8, D 128, ``--nq`` queries per sequence. lab/notes/sessions.md#s41 reads its profiles.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy as cp  # noqa: E402

import omnicupy  # noqa: E402
from benchmarks import bench_decode as bd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="contiguous", choices=("contiguous", "paged16", "paged64"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    gpu = bd.Gpu()
    cache = bd.make_cache(gpu, args.batch, args.length, args.nq, "fp16", seed=1)
    lens = cp.asarray(cache.lens)
    for i in range(args.calls):
        if args.layout == "contiguous":
            q, k, v = cache.contiguous(i % len(cache.sets))
            omnicupy.attention(q, k, v, causal="bottom_right")
        else:
            page_size = int(args.layout[len("paged"):])
            cache.table(gpu, page_size)
            q, k, v, table = cache.pages(i % len(cache.sets), page_size)
            omnicupy.paged_attention(q, k, v, table, lens, causal=True, validate=False)
    cp.cuda.Device().synchronize()
    print(f"{args.layout} B {args.batch} N {args.length} Nq {args.nq}: {args.calls} calls")


if __name__ == "__main__":
    main()
