"""Host time per call: omnicupy (CuPy and torch inputs) next to SDPA and FlexAttention, one process.

    PYTHONPATH=. python benchmarks/bench_overhead.py [--seq-lens 512,1024,2048,4096] [--calls 2000]
    python benchmarks/bench_overhead.py --cpu     # no GPU: the host path up to the launch (a report)

Host µs per call: time.perf_counter around a loop of calls (GPU kept idle between timings, the
queue drained first), divided by the count; the kernel itself runs asynchronously. Graph replay:
attention() captured once in a CUDA graph, replayed, timed with CUDA events, next to the kernel's
own time (events around direct calls). Correctness is checked against float64 before timing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import omnicupy  # noqa: E402


def host_us(fn, calls: int, sync) -> float:
    fn()
    sync()
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(best)


def cpu_report(calls: int) -> None:
    """What runs without a GPU: argument checks + plan on NumPy inputs, and packing the struct."""
    from omnicupy.dispatch.params import FORWARD

    q = np.zeros((2, 16, 1024, 128), np.float16)
    t_plan = host_us(lambda: omnicupy.plan(q, q, q, causal=True, arch="sm_90"), calls, lambda: None)
    fields = {p.name: (0 if p.count == 1 else []) for p in FORWARD.params}
    t_pack = host_us(lambda: FORWARD.pack(fields), calls, lambda: None)
    print("| host path piece (CPU, no launch) | µs per call |\n| --- | ---: |")
    print(f"| checks + plan (omnicupy.plan, NumPy inputs) | {t_plan:.1f} |")
    print(f"| pack the forward struct by name | {t_pack:.1f} |")


def gpu_report(seq_lens, calls: int) -> None:
    import cupy as cp
    import torch
    import torch.nn.functional as F

    B, H, D = 2, 16, 128
    rows = []
    for n in seq_lens:
        rng = cp.random.default_rng(n)
        q, k, v = (rng.standard_normal((B, H, n, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        ref = omnicupy.reference.attention(q[:1, :2].get(), k[:1, :2].get(), v[:1, :2].get(), omnicupy.masks.causal())
        out = omnicupy.attention(q, k, v, causal=True)
        err = omnicupy.reference.relative_error(out[:1, :2], ref)
        assert err < 3e-3, err
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        sync = cp.cuda.get_current_stream().synchronize
        r = {"N": n}
        r["omnicupy cupy"] = host_us(lambda: omnicupy.attention(q, k, v, causal=True), calls, sync)
        r["omnicupy torch"] = host_us(lambda: omnicupy.attention(tq, tk, tv, causal=True), calls, sync)
        r["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True), calls,
                            torch.cuda.synchronize)
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention)
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cuda")
            r["flex"] = host_us(lambda: flex(tq, tk, tv, block_mask=bm), max(calls // 4, 50), torch.cuda.synchronize)
        except Exception as exc:  # noqa: BLE001
            r["flex"] = float("nan")
            print(f"flex unavailable: {exc}", file=sys.stderr)
        # the kernel's own time vs a replayed graph of attention()
        o = cp.empty_like(q)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            omnicupy.attention(q, k, v, causal=True, out=o)
            stream.begin_capture()
            for _ in range(20):
                omnicupy.attention(q, k, v, causal=True, out=o)
            graph = stream.end_capture()

            def events(fn, reps=10):
                times = []
                for _ in range(reps):
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record(stream)
                    fn()
                    b.record(stream)
                    b.synchronize()
                    times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
                return statistics.median(times)

            def direct():
                for _ in range(20):
                    omnicupy.attention(q, k, v, causal=True, out=o)

            graph.launch(stream)
            stream.synchronize()
            r["direct µs/call"] = events(direct) / 20
            r["graph µs/call"] = events(lambda: graph.launch(stream)) / 20
        rows.append(r)
    keys = list(rows[0])
    print("\nhost µs per call (B=2, H=16, D=128, causal, fp16); graph vs direct: GPU µs per call")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="512,1024,2048,4096")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--cpu", action="store_true", help="only the CPU report (no GPU needed)")
    args = parser.parse_args()
    cpu_report(max(args.calls // 10, 100))
    if not args.cpu:
        if not omnicupy.arrays.gpu_available():
            print("no GPU: the GPU table needs one")
            return 0
        gpu_report([int(n) for n in args.seq_lens.split(",")], args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
