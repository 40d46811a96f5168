"""Speed A/B of two omnicupy trees in one process: the tree under test (`omnicupy`, from the import
path) against an older tree copied in as the package `omnicupy_base` (its kernels/ and templates/
inside the package folder), each with its own kernel cache.

    PYTHONPATH=.:<dir holding omnicupy_base> python lab/ab/ab_trees.py --rounds 5 --out ab.json

Each case is checked first (the two trees' outputs compared element for element), then timed in
alternating order (old/new, new/old, ...) for --rounds rounds with triton's do_bench (CUDA events,
L2 flushed); the table gives medians and new/old per case, flagged where outside +-3 %.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path


def _load(name: str, cache: Path):
    pkg = importlib.import_module(name)
    jit = importlib.import_module(f"{name}.jit")
    cache_mod = importlib.import_module(f"{name}.jit.cache")
    jit.default_cache = lambda: cache_mod.DiskCache(cache)  # separate caches per tree
    return pkg


def _cases(cp):
    """(name, maker): maker(pkg) -> zero-argument callable running one call of that tree."""
    import numpy as np

    rng = cp.random.default_rng(1234)

    def t(*shape, dtype=cp.float16):
        return rng.standard_normal(shape, dtype=cp.float32).astype(dtype)

    cases = []

    def fwd(name, B, H, N, D, dtype, mask):
        q, k, v = t(B, H, N, D, dtype=dtype), t(B, H, N, D, dtype=dtype), t(B, H, N, D, dtype=dtype)

        def make(pkg):
            bm, causal = mask(pkg, N)
            return lambda: pkg.attention(q, k, v, bm, causal=causal)
        cases.append((f"fwd {name} D{D} N{N} {dtype.__name__}", make))

    def bwd(name, B, H, N, D, mask, deterministic=False):
        q, k, v, do = (t(B, H, N, D) for _ in range(4))

        def make(pkg):
            bm, causal = mask(pkg, N)
            out, lse = pkg.attention(q, k, v, bm, causal=causal, return_lse=True)
            kw = {"deterministic": True} if deterministic else {}
            return lambda: pkg.attention_backward(do, q, k, v, out, lse, bm, causal=causal, **kw)
        cases.append((f"bwd {name} D{D} N{N}{' det' if deterministic else ''}", make))

    full = lambda pkg, N: (None, False)
    causal = lambda pkg, N: (None, True)
    docs = lambda pkg, N: (pkg.BlockMask.from_mask_mod(pkg.masks.document(np.repeat(np.arange(8), N // 8)),
                                                       None, None, N, N), False)
    window = lambda pkg, N: (pkg.BlockMask.from_mask_mod(pkg.masks.sliding_window(1024), None, None, N, N), False)
    for D in (64, 128):
        for name, m in (("full", full), ("causal", causal), ("docs", docs), ("window", window)):
            fwd(name, 2, 16, 8192, D, cp.float16, m)
    fwd("causal", 2, 16, 8192, 32, cp.float16, causal)
    fwd("causal", 2, 16, 8192, 256, cp.float16, causal)
    fwd("causal", 2, 16, 8192, 96, cp.float16, causal)
    for D in (64, 128):
        for name, m in (("full", full), ("causal", causal), ("docs", docs)):
            bwd(name, 2, 16, 8192, D, m)
        bwd("causal", 2, 16, 8192, D, causal, deterministic=True)
    bwd("causal", 2, 16, 4096, 96, causal)

    for B, L in ((8, 32768), (32, 8192)):
        q = t(B, 32, 1, 128)
        k, v = t(B, 8, L, 128), t(B, 8, L, 128)

        def make(pkg, q=q, k=k, v=v):
            return lambda: pkg.attention(q, k, v)
        cases.append((f"decode B{B} L{L}", make))
        for page in (16, 64):
            n_pages = L // page
            kp = k.transpose(0, 2, 1, 3).reshape(B * n_pages, page, 8, 128).copy()
            vp = v.transpose(0, 2, 1, 3).reshape(B * n_pages, page, 8, 128).copy()
            table = cp.arange(B * n_pages, dtype=cp.int32).reshape(B, n_pages)
            lens = cp.full((B,), L, dtype=cp.int32)

            def make_p(pkg, q=q, kp=kp, vp=vp, table=table, lens=lens):
                return lambda: pkg.paged_attention(q, kp, vp, table, lens, validate=False)
            cases.append((f"paged{page} B{B} L{L}", make_p))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--cache-new", default="", help="kernel cache of the tree under test (default: a new folder)")
    ap.add_argument("--cache-old", default="", help="kernel cache of omnicupy_base (default: a new folder)")
    args = ap.parse_args()
    import cupy as cp
    from triton.testing import do_bench

    root = Path(tempfile.mkdtemp(prefix="ab_"))
    new = _load("omnicupy", Path(args.cache_new) if args.cache_new else root / "new")
    old = _load("omnicupy_base", Path(args.cache_old) if args.cache_old else root / "old")
    cases = [c for c in _cases(cp) if not args.only or any(s in c[0] for s in args.only.split(","))]
    rows = []
    for name, make in cases:
        try:
            fn_old, fn_new = make(old), make(new)
            a, b = fn_old(), fn_new()
            a = a if isinstance(a, tuple) else (a,)
            b = b if isinstance(b, tuple) else (b,)
            diff = max(float(cp.abs(x.astype(cp.float32) - y.astype(cp.float32)).max()) for x, y in zip(a, b))
        except Exception as exc:  # report and go on: one broken case must not hide the others
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{name}: ERROR {exc}", flush=True)
            continue
        rows.append({"case": name, "maxdiff": diff, "old": [], "new": [], "fns": (fn_old, fn_new)})
    for r in range(args.rounds):
        for row in rows:
            if "fns" not in row:
                continue
            fn_old, fn_new = row["fns"]
            order = (("old", fn_old), ("new", fn_new)) if r % 2 == 0 else (("new", fn_new), ("old", fn_old))
            for which, fn in order:
                row[which].append(do_bench(fn, warmup=10, rep=40))
    print(f"\n{'case':34s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'maxdiff':>9s}")
    worst = 0.0
    for row in rows:
        row.pop("fns", None)
        if "error" in row:
            print(f"{row['case']:34s} ERROR {row['error']}")
            continue
        mo, mn = statistics.median(row["old"]), statistics.median(row["new"])
        row.update(median_old=mo, median_new=mn, ratio=mn / mo)
        worst = max(worst, abs(mn / mo - 1))
        flag = "" if abs(mn / mo - 1) <= 0.03 else "  <-- outside 3 %"
        print(f"{row['case']:34s} {mo:9.4f} {mn:9.4f} {mn / mo:8.3f} {row['maxdiff']:9.2e}{flag}")
    print(f"{len([r for r in rows if 'ratio' in r])} cases, {args.rounds} alternating rounds; worst |new/old - 1| = {worst:.3%}")
    Path(args.out).write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
