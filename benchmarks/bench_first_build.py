"""The first BlockMask builds of a new Python process: what a user waits for on a fresh machine.

    OMNICUPY_CACHE_DIR=/tmp/fresh CUPY_CACHE_DIR=/tmp/fresh_cupy python benchmarks/bench_first_build.py [--n 8192]

Run it in a NEW process (that is the point): it times ``import omnicupy``, then for each built-in
mask (causal, sliding window, document, interleaved) its first build through ``from_mask_mod`` on
the GPU (synchronized: until the metadata exists on the device) and a second build of the same
mask; with --attention also the first ``attention()`` on the first mask.
Point OMNICUPY_CACHE_DIR and CUPY_CACHE_DIR at empty folders for a fresh machine, after
``omnicupy precompile --ops mask`` (or not) into the same OMNICUPY_CACHE_DIR. Prints one table
and, with --json, one JSON line. The ``omnicupy`` logger's messages (a compile behind the user's
back is announced there) go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MASKS = ("causal", "sliding_window_1024", "document", "interleaved")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--label", default="", help="a name for this run in the table")
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    parser.add_argument("--attention", action="store_true",
                        help="also time the first attention() (compiles its kernel unless precompiled)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)

    t0 = time.perf_counter()
    import numpy as np

    import omnicupy
    from omnicupy.mask import builders
    import_s = time.perf_counter() - t0

    from benchmarks.bench_masks import workload  # the masks of bench_masks.py (after the timed import)
    t0 = time.perf_counter()
    cp = omnicupy.arrays.cupy_module()
    if cp is None or not omnicupy.arrays.gpu_available():
        print("no GPU")
        return 0
    cp.cuda.Device().synchronize()
    cuda_s = time.perf_counter() - t0
    sync = cp.cuda.Device().synchronize
    rows = []
    built = {}
    for name in MASKS:
        mod = workload(name, args.n)
        times = []
        for _ in range(2):
            sync()
            t = time.perf_counter()
            bm = builders.from_mask_mod(mod, None, None, args.n, args.n, xp=cp)
            bm.device_metadata()
            sync()
            times.append(time.perf_counter() - t)
        built[name] = bm
        rows.append({"mask": name, "first_s": times[0], "second_s": times[1]})
    first_attention_s = float("nan")
    if args.attention:
        q = cp.zeros((1, 2, args.n, 128), dtype=np.float16)
        sync()
        t = time.perf_counter()
        omnicupy.attention(q, q, q, built[MASKS[0]])
        sync()
        first_attention_s = time.perf_counter() - t
    total_s = time.perf_counter() - START
    label = args.label or os.environ.get("OMNICUPY_CACHE_DIR", "")
    print(f"\nfirst builds in a new process ({label}); N = {args.n}, CuPy on the GPU, synchronized")
    print("| mask | first build s | second build s |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['mask']} | {r['first_s']:.3f} | {r['second_s']:.4f} |")
    print(f"| (import omnicupy) | {import_s:.3f} | |")
    print(f"| (import CuPy, start CUDA) | {cuda_s:.3f} | |")
    if args.attention:
        print(f"| (first attention(), causal mask, D = 128) | {first_attention_s:.3f} | |")
    print(f"| (whole process so far) | {total_s:.3f} | |")
    if args.json:
        print(json.dumps({"label": label, "n": args.n, "import_s": import_s, "cuda_s": cuda_s, "rows": rows,
                          "first_attention_s": first_attention_s, "total_s": total_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
