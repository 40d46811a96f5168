"""Host time per call: omnicupy (CuPy and torch inputs, forward and backward, each launch route) next
to SDPA and FlexAttention, one process; CUDA-graph replay next to direct calls.

    PYTHONPATH=. python benchmarks/bench_overhead.py [--seq-lens 512,1024,2048,4096] [--calls 200] [--rounds 5]
    python benchmarks/bench_overhead.py --cpu     # no GPU: the host path's pieces without the launch (a report)

Host µs per call: the median of ``time.perf_counter`` around single calls (GPU drained before each
series, and few enough calls that the launch queue never fills, so the host never waits for the
device); the kernels run asynchronously. Every system's series runs once per round, the rounds
interleaved, and a system's figure is its best round (the lent machines' hosts are shared: the
same call drifts by a third from one minute to the next). Graph replay: 20 calls captured once in a CUDA graph on a
CuPy stream, replayed, timed with CUDA events, next to the same 20 direct calls (events): GPU µs
per call. Forward and backward results are checked against float64 references before timing.

``--cpu`` times what runs without a GPU: the first call's checks and plan, packing a struct by
name, and the steady state's pieces (the switch snapshot, the call's key, writing the pointers
into the recipe's buffer and handing it to a launch route that does nothing). It asserts nothing
about time: CI runs it as a report (tests/cpu/test_bench_overhead.py).
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
from omnicupy.jit import launch  # noqa: E402
from omnicupy.ops import backward as backward_op  # noqa: E402
from omnicupy.ops import recall  # noqa: E402


def per_call_us(fn, calls: int, sync=lambda: None, warmup: int = 3) -> float:
    """Median host µs of single calls of ``fn`` (the device drained first)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    clock = time.perf_counter
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    sync()
    return statistics.median(times) * 1e6


# ----------------------------------------------------------------------------------- CPU report
class _NullKernel:
    name, function_ptr = "null", 0


def _null_fire(launcher, item, slot, stream_ptr) -> None:
    """A launch route that launches nothing: what remains is omnicupy's own Python."""


def cpu_rows(calls: int) -> list[tuple[str, float]]:
    """(piece, host µs per call) of the host path without a GPU."""
    import os

    from omnicupy.dispatch.params import BACKWARD, FORWARD

    q = np.zeros((2, 16, 1024, 128), np.float16)
    rows = [("first call: checks + plan (omnicupy.plan, NumPy inputs)",
             per_call_us(lambda: omnicupy.plan(q, q, q, causal=True, arch="sm_90"), calls))]
    fields = {p.name: (0 if p.count == 1 else []) for p in FORWARD.params}
    rows.append(("first call: pack the forward struct by name", per_call_us(lambda: FORWARD.pack(fields), calls)))
    environ = os.environ
    rows.append(("switches by os.environ.get (before)",
                 per_call_us(lambda: tuple(environ.get(n) for n in recall.SWITCHES), calls)))
    rows.append(("switches from os.environ's mapping (recall.switches)", per_call_us(recall.switches, calls)))
    view = (0x7F0000000000, (2, 16, 1024, 128), (4194304, 262144, 256, 2), np.dtype(np.float16), 0)
    views = (view, view, view)
    scalars = (True, None, False, None, False)

    def key():
        return (*recall.signature(views, ()), True, 0, 0, *scalars, *map(type, scalars))

    rows.append(("forward key of a call (3 views, scalars, switches)", per_call_us(key, calls)))
    cache = {key(): 1}
    rows.append(("forward key + recipe lookup", per_call_us(lambda: cache.get(key()), calls)))
    saved = launch._ROUTE[0], launch._ROUTE_NAME[0], launch._current_stream_ptr, launch._ensure_context
    # No GPU: no route, no CuPy stream to ask for its pointer (about 0.2 us on a GPU machine), no context
    launch._ROUTE[0], launch._ROUTE_NAME[0], launch._current_stream_ptr = _null_fire, "null", lambda: 0
    launch._ensure_context = lambda: None
    try:
        plan = type("Plan", (), {"grid": (8, 16, 2), "block": (128, 1, 1), "smem_bytes": 0})()
        fwd = recall.Recipe.make(_NullKernel(), plan, fields)
        rows.append(("forward recipe.launch, null route (5 pointers, 1 kernel)",
                     per_call_us(lambda: fwd.launch(1 << 40, 2 << 40, 3 << 40, 4 << 40, 0), calls)))
        bfields = {p.name: (None if p.kind == "tmap" else 0) if p.count == 1 else [] for p in BACKWARD.params}
        items = [launch.KernelLaunch(_NullKernel(), (8, 16, 2), (256, 1, 1)) for _ in range(3)]
        bwd = recall.Recipe.make(None, plan, bfields, BACKWARD, pointer_fields=backward_op.POINTER_FIELDS,
                                 launches=items)
        pointers = [(i + 1) << 32 for i in range(len(backward_op.POINTER_FIELDS))]
        rows.append(("backward recipe.launch, null route (13 pointers, 3 kernels)",
                     per_call_us(lambda: bwd.launch(*pointers), calls)))
    finally:
        launch._ROUTE[0], launch._ROUTE_NAME[0], launch._current_stream_ptr, launch._ensure_context = saved
    return rows


def cpu_report(calls: int) -> None:
    print("| host path piece (CPU, no launch) | µs per call |\n| --- | ---: |")
    for label, us in cpu_rows(calls):
        print(f"| {label} | {us:.2f} |")


# ----------------------------------------------------------------------------------- GPU report
def _events(stream, fn, cp, reps: int = 10) -> float:
    """Median GPU µs of ``fn`` on ``stream`` between two events."""
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(times)


def _graph_vs_direct(call, cp, count: int = 20) -> tuple[float, float]:
    """(direct, replayed) GPU µs per call of ``call`` (which must write only preallocated buffers)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()  # recipes exist before the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(count):
            call()
        graph = stream.end_capture()

        def direct():
            for _ in range(count):
                call()

        graph.launch(stream)
        stream.synchronize()
        direct_us = _events(stream, direct, cp) / count
        graph_us = _events(stream, lambda: graph.launch(stream), cp) / count
    return direct_us, graph_us


def _kernel_alone(q, k, v, out, cp, count: int = 20) -> float:
    """GPU µs per launch of the forward's kernel alone: the recipe that ``attention(q, k, v,
    causal=True, out=out)`` keeps, launched ``count`` times back to back between two events with
    no Python of attention() in between (the reference for the graph-replay target)."""
    from omnicupy.ops import forward

    key, mask, *_ = forward._steady_key(q, k, v, out, None, None, True, None, None, None, False, None, False, None, cp)
    recipe = recall.recipe_for(mask, key)
    pointers = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0)

    def launches():
        for _ in range(count):
            recipe.launch(*pointers)

    stream = cp.cuda.get_current_stream()
    launches()
    stream.synchronize()
    return _events(stream, launches, cp) / count


def _check(cp, q, k, v, do) -> str:
    """Forward and backward of the timed configuration against float64 (two heads of batch 0)."""
    out, lse = omnicupy.attention(q, k, v, causal=True, return_lse=True)
    grads = omnicupy.attention_backward(do, q, k, v, out, lse, causal=True)
    again = omnicupy.attention_backward(do, q, k, v, out, lse, causal=True)  # the steady state
    sub = (slice(0, 1), slice(0, 2))
    host = [x[sub].get() for x in (q, k, v, do)]
    ref = omnicupy.reference.attention(*host[:3], omnicupy.masks.causal())
    err = omnicupy.reference.relative_error(out[sub], ref)
    ref_grads = omnicupy.reference.attention_backward(host[3], *host[:3], omnicupy.masks.causal())
    errs = [omnicupy.reference.relative_error(g[sub], r) for g, r in zip(again, ref_grads)]
    assert err < 3e-3 and max(errs) < 1e-2, (err, errs)
    assert all(cp.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(grads, again))
    return f"fwd {err:.1e}, bwd {max(errs):.1e}"


def interleaved(series: dict, rounds: int) -> dict:
    """name -> host µs per call: the lowest over ``rounds`` of each series' median. Every round runs
    every series once, in turn, so that a slow spell of the host (shared machines drift by 30 % from
    minute to minute) hits every system alike instead of whichever series it fell on."""
    best: dict = {}
    for _ in range(rounds):
        for name, (call, calls, drain, set_up) in series.items():
            set_up()
            best[name] = min(best.get(name, float("inf")), per_call_us(call, calls, drain))
    launch.use_route(None)
    return best


def gpu_report(seq_lens, calls: int, routes, flex_seq_lens=None, rounds: int = 5) -> list[dict]:
    import cupy as cp
    import torch
    import torch.nn.functional as F

    B, H, D = 2, 16, 128
    rows = []
    flex = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
    except Exception as exc:  # noqa: BLE001
        print(f"flex unavailable: {exc}", file=sys.stderr)
    sync = cp.cuda.get_current_stream().synchronize
    for n in seq_lens:
        rng = cp.random.default_rng(n)
        q, k, v, do = (rng.standard_normal((B, H, n, D), dtype=cp.float32).astype(cp.float16) for _ in range(4))
        r = {"N": n, "check": _check(cp, q, k, v, do)}
        tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
        out, lse = omnicupy.attention(q, k, v, causal=True, return_lse=True)
        tout, tlse = torch.from_dlpack(out), torch.from_dlpack(lse)
        torch_sync = torch.cuda.synchronize
        keep_route = lambda: launch.use_route(None)  # noqa: E731
        # name -> (call, calls per series, drain, set-up before each series)
        series = {f"fwd cupy [{name}]": (lambda: omnicupy.attention(q, k, v, causal=True), calls, sync,
                                         lambda name=name: launch.use_route(name)) for name in routes}
        series["fwd torch"] = (lambda: omnicupy.attention(tq, tk, tv, causal=True), calls, sync, keep_route)
        series["bwd cupy"] = (lambda: omnicupy.attention_backward(do, q, k, v, out, lse, causal=True),
                              max(calls // 3, 30), sync, keep_route)
        series["bwd torch"] = (lambda: omnicupy.attention_backward(tdo, tq, tk, tv, tout, tlse, causal=True),
                               max(calls // 3, 30), sync, keep_route)

        def omni_fb():
            o, s = omnicupy.attention(q, k, v, causal=True, return_lse=True)
            omnicupy.attention_backward(do, q, k, v, o, s, causal=True)

        series["fwd+bwd cupy"] = (omni_fb, max(calls // 4, 30), sync, keep_route)
        series["sdpa fwd"] = (lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True), calls, torch_sync,
                              keep_route)
        gq, gk, gv = (x.detach().clone().requires_grad_() for x in (tq, tk, tv))

        def sdpa_fb():
            F.scaled_dot_product_attention(gq, gk, gv, is_causal=True).backward(tdo)

        series["sdpa fwd+bwd"] = (sdpa_fb, max(calls // 4, 30), torch_sync, keep_route)
        if flex is not None and (flex_seq_lens is None or n in flex_seq_lens):  # each N compiles anew
            try:
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cuda")
                flex(tq, tk, tv, block_mask=bm)  # compiled here, not in the first timed series

                def flex_fb():
                    flex(gq, gk, gv, block_mask=bm).backward(tdo)

                flex_fb()
                series["flex fwd"] = (lambda: flex(tq, tk, tv, block_mask=bm), max(calls // 4, 30), torch_sync,
                                      keep_route)
                series["flex fwd+bwd"] = (flex_fb, max(calls // 4, 30), torch_sync, keep_route)
            except Exception as exc:  # noqa: BLE001
                print(f"flex failed at N={n}: {exc}", file=sys.stderr)
        # a decode step: one query per sequence, GQA 4, device lengths (the split-KV kernel)
        dq_ = rng.standard_normal((B, H, 1, D), dtype=cp.float32).astype(cp.float16)
        dk_, dv_ = (rng.standard_normal((B, H // 4, n, D), dtype=cp.float32).astype(cp.float16) for _ in range(2))
        lens = cp.full((B,), n - 1, dtype=cp.int32)
        tdq, tdk, tdv = (torch.from_dlpack(x) for x in (dq_, dk_, dv_))
        series["decode cupy"] = (lambda: omnicupy.attention(dq_, dk_, dv_, causal=True, kv_lens=lens), calls, sync,
                                 keep_route)
        pages = n // 16
        k_pages, v_pages = (rng.standard_normal((B * pages, 16, H // 4, D), dtype=cp.float32).astype(cp.float16)
                            for _ in range(2))
        table = cp.arange(B * pages, dtype=cp.int32).reshape(B, pages)
        series["paged cupy"] = (lambda: omnicupy.paged_attention(dq_, k_pages, v_pages, table, lens, validate=False),
                                calls, sync, keep_route)
        try:
            F.scaled_dot_product_attention(tdq, tdk, tdv, enable_gqa=True)
            series["decode sdpa"] = (lambda: F.scaled_dot_product_attention(tdq, tdk, tdv, enable_gqa=True), calls,
                                     torch_sync, keep_route)
        except Exception as exc:  # noqa: BLE001 - torch without enable_gqa
            print(f"sdpa decode unavailable: {exc}", file=sys.stderr)
        r.update(interleaved(series, rounds))
        o_buf = cp.empty_like(q)
        r["fwd direct GPU µs"], r["fwd graph GPU µs"] = _graph_vs_direct(
            lambda: omnicupy.attention(q, k, v, causal=True, out=o_buf), cp)
        r["fwd kernel alone GPU µs"] = _kernel_alone(q, k, v, o_buf, cp)
        grads = [cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)]
        r["bwd direct GPU µs"], r["bwd graph GPU µs"] = _graph_vs_direct(
            lambda: omnicupy.attention_backward(do, q, k, v, out, lse, causal=True, dq=grads[0], dk=grads[1],
                                                dv=grads[2]), cp, count=5)
        backward_op.release_captured()
        rows.append(r)
        print(f"N={n}: " + ", ".join(f"{key} {val:.1f}" if isinstance(val, float) else f"{key} {val}"
                                     for key, val in r.items()), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(key for r in rows for key in r))
    print("\nhost µs per call (B=2, H=16, D=128, causal, fp16; median of single calls, best of the interleaved rounds); "
          "'GPU µs' columns: per call, 20 (bwd 5) calls direct vs one replayed graph vs the forward's kernel "
          "launched alone")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        cells = [r.get(key, "") for key in keys]
        print("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="512,1024,2048,4096")
    parser.add_argument("--calls", type=int, default=200, help="timed single calls per series (forward)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every series; the best median counts")
    parser.add_argument("--routes", default=None, help="launch routes to time the forward with (default: all here)")
    parser.add_argument("--flex-seq-lens", default=None,
                        help="the N at which to time flex (each compiles; default: every N)")
    parser.add_argument("--cpu", action="store_true", help="only the CPU report (no GPU needed)")
    args = parser.parse_args()
    cpu_report(max(args.calls, 100))
    if not args.cpu:
        if not omnicupy.arrays.gpu_available():
            print("no GPU: the GPU table needs one")
            return 0
        routes = args.routes.split(",") if args.routes else launch.available_routes()
        flex_lens = None if args.flex_seq_lens is None else [int(n) for n in args.flex_seq_lens.split(",")]
        rows = gpu_report([int(n) for n in args.seq_lens.split(",")], args.calls, routes, flex_lens, args.rounds)
        print(f"launch route by default: {launch.use_route(None)}")
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
