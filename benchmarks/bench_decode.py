"""Decode benchmark (issue 16): KV-cache reads per second against SDPA (cuDNN, flash) and FlexAttention.

    PYTHONPATH=. python benchmarks/bench_decode.py [--dtypes fp16,bf16] [--parts table,nq,window,ragged,prefill]
                                                    [--json results.json] [--quick]

Parts (Hq 32, Hkv 8, D 128 unless said):
  table    one query per sequence, batch x cache length in {1, 8, 32} x {8k, 32k, 128k}: omnicupy
           (`attention()`) on a contiguous cache and on paged caches (page sizes 16 and 64, NHD, pages in random order),
           SDPA cuDNN and flash (enable_gqa), FlexAttention (torch.compile, enable_gqa);
  nq       Nq = 1, 4 and 16 queries per sequence (GQA 4:1), time relative to Nq = 1;
  window   paged, sliding window 4096 at kv_lens 128k against a 4096-long cache;
  ragged   batch 32 with cache lengths drawn from [1k, 128k] (contiguous kv_lens, paged 16);
  prefill  8 sequences of 1k-32k tokens, causal: varlen_attention against attention() on the batch
           padded to 32k, in useful TFLOP/s (4 * Hq * D * allowed pairs per second).

Every system is checked against a float64 reference (two batches, two kv heads' query groups)
before it is timed; a wrong system is reported and not timed. Times are GPU times per call from
CUDA graphs of back-to-back calls over rotating input copies (together over 4x the L2), so host
overhead does not count; omnicupy's eager time per call (host included) is reported beside it.
TB/s counts the K and V bytes a call must read (its sequences' lengths, not padding). The short
table of the targets comes last.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout: the root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _systems  # noqa: E402

HQ, HKV, D = 32, 8, 128
BATCHES = (1, 8, 32)
LENGTHS = (8192, 32768, 131072)
TOL = {"fp16": 3e-3, "bf16": 2e-2}
L2_MULTIPLE = 4
MAX_COPIES = 8
CALLS_PER_GRAPH = 16


# ------------------------------------------------------------------------------------ machine
class Gpu:
    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.l2 = int(props.get("l2CacheSize", 50 << 20))
        try:
            import torch

            self.torch = torch if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - torch is optional
            self.torch = None

    def np_dtype(self, dtype: str):
        from omnicupy.arrays import BFLOAT16

        return np.dtype(np.float16) if dtype == "fp16" else BFLOAT16

    def randn(self, shape, dtype: str, rng, chunk: int = 1 << 24):
        """Unit normal in chunks of ``chunk`` elements (no float32 copy of a whole cache, and no
        launch per row of a packed [total, H, D] array)."""
        return _systems.device_normal(self.cp, shape, self.np_dtype(dtype), rng, chunk)

    def torch_view(self, x):
        return self.torch.from_dlpack(x)


def host64(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(x.get() if hasattr(x, "get") else x).astype(np.float64)


# ------------------------------------------------------------------------------------ timing
def time_cupy(gpu: Gpu, fn: Callable[[int], Any], copies: int, reps: int,
              calls: int = CALLS_PER_GRAPH) -> tuple[float, float]:
    """(graph ms per call, eager ms per call) on a CuPy stream: ``calls`` calls per graph (rounded up to
    whole rotations of the ``copies`` input sets), ``reps`` graph launches."""
    cp = gpu.cp
    stream = cp.cuda.Stream(non_blocking=True)
    n = copies * math.ceil(calls / copies)
    with stream:
        keep = [fn(i % copies) for i in range(n)]  # warm up (compiles, pool blocks)
        stream.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        keep = [fn(i % copies) for i in range(n)]
        stop.record(stream)
        stop.synchronize()
        eager = cp.cuda.get_elapsed_time(start, stop) / n
        graph_ms = float("nan")
        try:
            stream.begin_capture()
            keep = [fn(i % copies) for i in range(n)]
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            start.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            graph_ms = cp.cuda.get_elapsed_time(start, stop) / (reps * n)
        except Exception as exc:  # noqa: BLE001 - report eager time then
            print(f"    (graph capture failed: {type(exc).__name__}: {exc}; eager time only)")
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001
                pass
        del keep
    return graph_ms, eager


def time_torch(gpu: Gpu, fn: Callable[[int], Any], copies: int, reps: int) -> tuple[float, float]:
    torch = gpu.torch
    n = copies * math.ceil(CALLS_PER_GRAPH / copies)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        keep = [fn(i % copies) for i in range(n)]
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        keep = [fn(i % copies) for i in range(n)]
        stop.record()
        torch.cuda.synchronize()
        eager = start.elapsed_time(stop) / n
    graph_ms = float("nan")
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            keep = [fn(i % copies) for i in range(n)]
        g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            g.replay()
        stop.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(stop) / (reps * n)
    except Exception as exc:  # noqa: BLE001
        print(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:200]}; eager time only)")
    del keep
    return graph_ms, eager


# ------------------------------------------------------------------------------------ caches
@dataclass
class Cache:
    """``copies`` sets of q [B, Hq, Nq, D] and K/V stored [B, N, Hkv, D] (contiguous views are
    strided BHND views of it; a paged view reshapes it into pages and maps them in random order)."""

    B: int
    N: int
    nq: int
    dtype: str
    sets: list  # (q, k_bnhd, v_bnhd)
    lens: np.ndarray
    tables: dict = field(default_factory=dict)  # page size -> (host table, device table)

    def contiguous(self, i):
        q, k, v = self.sets[i]
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def pages(self, i, page_size):
        q, k, v = self.sets[i]
        shape = (self.B * self.N // page_size, page_size, HKV, D)
        return q, k.reshape(shape), v.reshape(shape), self.tables[page_size][1]

    def table(self, gpu, page_size, seed=7):
        if page_size not in self.tables:
            pages = self.B * self.N // page_size
            host = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(self.B, -1)
            self.tables[page_size] = (host, gpu.cp.asarray(host))
        return self.tables[page_size]

    def keys_of(self, b, hk, i=0, page_size=None):
        """Host float64 K and V [L, D] of sequence b, kv head hk, through the pages when paged."""
        _, k, v = self.sets[i]
        L = int(self.lens[b])
        if page_size is None:
            return host64(k[b, :L, hk]), host64(v[b, :L, hk])
        table = self.tables[page_size][0]
        pages = table[b, :-(-L // page_size)]
        flat = (self.B * self.N // page_size, page_size, HKV, D)
        kp, vp = k.reshape(flat), v.reshape(flat)
        import cupy as cp

        idx = cp.asarray(pages)
        return (host64(kp[idx][:, :, hk].reshape(-1, D)[:L]), host64(vp[idx][:, :, hk].reshape(-1, D)[:L]))


def make_cache(gpu: Gpu, B: int, N: int, nq: int, dtype: str, seed: int, lens=None) -> Cache:
    cp = gpu.cp
    set_bytes = 2 * B * N * HKV * D * 2
    copies = max(1, min(MAX_COPIES, math.ceil(L2_MULTIPLE * gpu.l2 / set_bytes)))
    rng = cp.random.default_rng(seed)
    sets = [(gpu.randn((B, HQ, nq, D), dtype, rng), gpu.randn((B, N, HKV, D), dtype, rng),
             gpu.randn((B, N, HKV, D), dtype, rng)) for _ in range(copies)]
    return Cache(B, N, nq, dtype, sets, np.full(B, N, np.int32) if lens is None else np.asarray(lens, np.int32))


# ------------------------------------------------------------------------------------ reference
def check(cache: Cache, out, *, page_size=None, window=None, causal=True) -> float:
    """Max relative error over (b, kv head) in {0, B-1} x {0, Hkv-1}, each its query group's rows."""
    group = HQ // HKV
    q = cache.sets[0][0]
    o = out
    errs = []
    for b in sorted({0, cache.B - 1}):
        L = int(cache.lens[b])
        for hk in (0, HKV - 1):
            k, v = cache.keys_of(b, hk, 0, page_size)
            heads = slice(hk * group, (hk + 1) * group)
            qh = host64(q[b, heads])  # [group, nq, D]
            s = qh @ k.T / math.sqrt(D)  # [group, nq, L]
            pos = np.arange(cache.nq)[:, None] + L - cache.nq
            j = np.arange(L)[None, :]
            allowed = np.ones((cache.nq, L), bool)
            if causal:
                allowed &= j <= pos
            if window:
                allowed &= j > pos - window
            s = np.where(allowed[None], s, -np.inf)
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            want = (p / p.sum(-1, keepdims=True)) @ v
            got = host64(o[b, heads])
            errs.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    return float(max(errs))


# ------------------------------------------------------------------------------------ systems
def _configure(decode, br: int, variant: str) -> None:
    """Before an omnicupy call: the decode tile a system name asks for. ``omnicupy`` uses the
    shipped one; ``omnicupy@WxS`` W warps and S ring stages for this cell's m tile."""
    key = (D, br)
    want = DEFAULT_TILES[key]
    if "x" in variant:
        w, st = variant.split("x")
        want = (int(w), int(st))
    if decode.DECODE_TILES[key] != want:  # a read-only table, part of the plan cache's key: rebound
        decode.DECODE_TILES = decode.DECODE_TILES.updated({key: want})


DEFAULT_TILES: dict = {}


def omnicupy_systems(gpu: Gpu, cache: Cache, names, *, window=None, lens_device=None, causal=True):
    """name -> (fn(i), check kwargs)."""
    import omnicupy
    from omnicupy.ops import decode

    if not DEFAULT_TILES:
        DEFAULT_TILES.update(decode.DECODE_TILES)
    out = {}
    lens_d = lens_device if lens_device is not None else gpu.cp.asarray(cache.lens)
    ragged = not np.all(cache.lens == cache.N)
    br = decode.pack_rows(HQ // HKV, cache.nq).br
    for name in names:
        if window is not None or not (name == "omnicupy" or name.startswith("omnicupy@")):
            continue
        variant = name.partition("@")[2]

        def contiguous(i, variant=variant):
            _configure(decode, br, variant)
            q, k, v = cache.contiguous(i)
            # the public call (its steady state: the eager column is what a decode loop pays); it
            # takes the split-KV kernel for these few query rows per kv head (decode.DECODE_MAX_ROWS)
            return omnicupy.attention(q, k, v, kv_lens=lens_d if ragged else None,
                                      causal="bottom_right" if causal else False)
        out[name] = (contiguous, {})
    for ps in (16, 64):
        name = f"omnicupy_paged{ps}"
        if name in names:
            cache.table(gpu, ps)

            def paged(i, ps=ps):
                _configure(decode, br, "")
                q, k, v, table = cache.pages(i, ps)
                return omnicupy.paged_attention(q, k, v, table, lens_d, causal=causal, window=window, validate=False)
            out[name] = (paged, {"page_size": ps})
    return out


def torch_systems(gpu: Gpu, cache: Cache, names, state):
    torch = gpu.torch
    if torch is None:
        return {}
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sets = [tuple(gpu.torch_view(x) for x in cache.contiguous(i)) for i in range(len(cache.sets))]
    out = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        if name in names:
            def sdpa(i, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(*sets[i], enable_gqa=True)
            out[name] = (sdpa, {})
    if "flex" in names:
        if "flex" not in state:
            import torch._dynamo
            from torch.nn.attention.flex_attention import flex_attention

            for key in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, key):
                    setattr(torch._dynamo.config, key, 1000)
            state["flex"] = torch.compile(flex_attention, dynamic=False)
        flex = state["flex"]
        out["flex"] = (lambda i: flex(*sets[i], enable_gqa=True), {})
    return out


# ------------------------------------------------------------------------------------ runner
@dataclass
class Row:
    part: str
    case: str
    system: str
    dtype: str
    bytes: float
    ms: Optional[float]
    eager_ms: Optional[float]
    error: Optional[float]
    note: str = ""

    @property
    def tbs(self) -> Optional[float]:
        return None if not self.ms or math.isnan(self.ms) else self.bytes / (self.ms * 1e-3) / 1e12


class Runner:
    def __init__(self, gpu: Gpu, reps: int) -> None:
        self.gpu, self.reps = gpu, reps
        self.rows: list[Row] = []
        self.state: dict = {}

    def measure(self, part, case, cache, systems, nbytes, check_kw=None) -> dict:
        results = {}
        for name, (fn, kw) in systems.items():
            is_torch = not name.startswith("omnicupy")
            try:
                out = fn(0)
                (self.gpu.torch.cuda.synchronize() if is_torch else self.gpu.cp.cuda.runtime.deviceSynchronize())
                err = check(cache, out, **kw, **(check_kw or {}))
                if not err <= TOL[cache.dtype]:
                    row = Row(part, case, name, cache.dtype, nbytes, None, None, err, "WRONG: not timed")
                else:
                    timer = time_torch if is_torch else time_cupy
                    ms, eager = timer(self.gpu, fn, len(cache.sets), self.reps)
                    row = Row(part, case, name, cache.dtype, nbytes, ms, eager, err)
            except Exception as exc:  # noqa: BLE001 - a system that cannot run this case
                row = Row(part, case, name, cache.dtype, nbytes, None, None, None, f"{type(exc).__name__}: {str(exc)[:160]}")
            self.rows.append(row)
            results[name] = row
            tbs = f"{row.tbs:6.2f} TB/s" if row.tbs else "   -     "
            ms = f"{row.ms * 1e3:9.1f} us" if row.ms and not math.isnan(row.ms) else "    -    "
            eager = f"(eager {row.eager_ms * 1e3:8.1f} us)" if row.eager_ms else ""
            errs = f"err {row.error:.1e}" if row.error is not None else ""
            print(f"  {part:7s} {case:28s} {name:17s} {cache.dtype} {ms} {tbs} {eager} {errs} {row.note}", flush=True)
        return results

    def free(self):
        self.gpu.cp.cuda.runtime.deviceSynchronize()
        self.gpu.cp.get_default_memory_pool().free_all_blocks()
        if self.gpu.torch is not None:
            self.gpu.torch.cuda.empty_cache()


def kv_bytes(lens, dtype_bytes=2) -> float:
    return float(2 * HKV * D * dtype_bytes * np.sum(lens))


# ------------------------------------------------------------------------------------ parts
def part_table(run: Runner, dtypes, systems, cells):
    for dtype in dtypes:
        for B, N in cells:
            cache = make_cache(run.gpu, B, N, 1, dtype, seed=B * 1000 + N)
            sys_ = {**omnicupy_systems(run.gpu, cache, systems), **torch_systems(run.gpu, cache, systems, run.state)}
            run.measure("table", f"B{B} x {N // 1024}k", cache, sys_, kv_bytes(cache.lens))
            del cache, sys_
            run.free()


def part_nq(run: Runner, dtypes, cells, extra=None):
    """``extra``: Nq -> more omnicupy systems (tile variants) to time at that Nq."""
    extra = extra or {}
    for dtype in dtypes:
        for B, N in cells:
            for nq in (1, 4, 16):
                cache = make_cache(run.gpu, B, N, nq, dtype, seed=nq)
                sys_ = omnicupy_systems(run.gpu, cache, ("omnicupy", "omnicupy_paged16") + tuple(extra.get(nq, ())))
                # SDPA's is_causal is top-left: compare it without a mask (every query sees the whole cache)
                sys_.update({name: (fn, {"causal": False})
                             for name, (fn, _) in torch_systems(run.gpu, cache, ("sdpa_cudnn",), run.state).items()})
                run.measure("nq", f"B{B} x {N // 1024}k Nq{nq}", cache, sys_, kv_bytes(cache.lens))
                del cache, sys_
                run.free()


def part_window(run: Runner, dtypes, batches, window=4096, N=131072):
    for dtype in dtypes:
        for B in batches:
            cache = make_cache(run.gpu, B, N, 1, dtype, seed=B)
            sys_ = omnicupy_systems(run.gpu, cache, ("omnicupy_paged16", "omnicupy_paged64"), window=window)
            run.measure("window", f"B{B} 128k window {window}", cache, sys_, kv_bytes(np.full(B, window)),
                        {"window": window})
            short = Cache(B, N, 1, dtype, cache.sets, np.full(B, window, np.int32), cache.tables)
            sys_ = omnicupy_systems(run.gpu, short, ("omnicupy_paged16", "omnicupy_paged64"))
            run.measure("window", f"B{B} cache of {window}", short, sys_, kv_bytes(short.lens))
            del cache, short, sys_
            run.free()


def part_ragged(run: Runner, dtypes, B=32, N=131072):
    lens = np.random.default_rng(16).integers(1024, N + 1, size=B).astype(np.int32)
    lens[0] = N
    for dtype in dtypes:
        cache = make_cache(run.gpu, B, N, 1, dtype, seed=5, lens=lens)
        sys_ = omnicupy_systems(run.gpu, cache, ("omnicupy", "omnicupy_paged16"))
        run.measure("ragged", f"B{B} lens 1k-128k", cache, sys_, kv_bytes(lens))
        padded = Cache(B, N, 1, dtype, cache.sets, np.full(B, N, np.int32), cache.tables)
        sys_ = torch_systems(run.gpu, padded, ("sdpa_cudnn",), run.state)
        run.measure("ragged", f"B{B} padded to 128k (useful)", padded, sys_, kv_bytes(lens))
        del cache, padded, sys_
        run.free()


def _varlen_call(q, k, v, cu, i):
    import omnicupy

    return omnicupy.varlen_attention(q, k, v, cu, cu, causal=True)


def _padded_call(q, k, v, i):
    import omnicupy

    return omnicupy.attention(q, k, v, causal=True)


#: Prefill heads (the decode parts use HQ / HKV).
HQ_PREFILL, HKV_PREFILL = 16, 4


def part_prefill(run: Runner, dtypes, lengths=(1024, 2048, 3072, 4096, 8192, 12288, 16384, 32768)):
    import omnicupy

    HQ, HKV = HQ_PREFILL, HKV_PREFILL
    gpu, cp = run.gpu, run.gpu.cp
    lens = np.array(lengths)
    useful = float(sum(4 * HQ * D * L * (L + 1) / 2 for L in lens))
    n_max = int(lens.max())
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    for dtype in dtypes:
        rng = cp.random.default_rng(3)
        total = int(cu[-1])
        q = gpu.randn((total, HQ, D), dtype, rng)
        k = gpu.randn((total, HKV, D), dtype, rng)
        v = gpu.randn((total, HKV, D), dtype, rng)
        start = time.perf_counter()
        omnicupy.ops.varlen.varlen_mask(cu, cu, total, total, True)
        build_ms = (time.perf_counter() - start) * 1e3
        # correctness: the last 256 rows of the shortest and the longest sequence, two heads
        out = omnicupy.varlen_attention(q, k, v, cu, cu, causal=True)
        errs = []
        for s in (0, len(lens) - 1):
            a, b = int(cu[s]), int(cu[s + 1])
            first = max(a, b - 256)
            for h in (0, HQ - 1):
                qh, kh, vh = host64(q[first:b, h]), host64(k[a:b, h // (HQ // HKV)]), host64(v[a:b, h // (HQ // HKV)])
                sc = qh @ kh.T / math.sqrt(D)
                rows = np.arange(first - a, b - a)[:, None]
                sc = np.where(np.arange(b - a)[None, :] <= rows, sc, -np.inf)
                p = np.exp(sc - sc.max(-1, keepdims=True))
                want = (p / p.sum(-1, keepdims=True)) @ vh
                errs.append(np.linalg.norm(host64(out[first:b, h]) - want) / np.linalg.norm(want))
        err = max(errs)
        ms, eager = time_cupy(gpu, functools.partial(_varlen_call, q, k, v, cu), 1, 2, calls=2)
        run.rows.append(Row("prefill", "8 seqs 1k-32k varlen", "omnicupy_varlen", dtype, useful, ms, eager, err,
                            f"mask build {build_ms:.1f} ms once (cached)"))
        del q, k, v, out
        run.free()
        # padded batch through attention()
        qp = gpu.randn((len(lens), HQ, n_max, D), dtype, rng)
        kp = gpu.randn((len(lens), HKV, n_max, D), dtype, rng)
        vp = gpu.randn((len(lens), HKV, n_max, D), dtype, rng)
        omnicupy.attention(qp, kp, vp, causal=True)
        ms_p, eager_p = time_cupy(gpu, functools.partial(_padded_call, qp, kp, vp), 1, 2, calls=2)
        run.rows.append(Row("prefill", "8 seqs padded to 32k", "omnicupy_padded", dtype, useful, ms_p, eager_p, None,
                            "useful flops over the padded batch's time"))
        for r in run.rows[-2:]:
            print(f"  prefill {r.case:28s} {r.system:17s} {dtype} {r.ms:9.2f} ms {r.bytes / (r.ms * 1e-3) / 1e12:7.1f} "
                  f"useful TFLOP/s {r.note}", flush=True)
        del qp, kp, vp
        run.free()


# ------------------------------------------------------------------------------------ report
def summary(rows: list[Row]) -> str:
    """The short table: each target, what was measured, met or not."""
    lines = ["", "target                                              | measured                                | met"]

    def find(part, case, system, dtype):
        for r in rows:
            if (r.part, r.case, r.system, r.dtype) == (part, case, system, dtype):
                return r
        return None

    for dtype in sorted({r.dtype for r in rows}):
        for r in rows:
            if r.part != "table" or r.system != "omnicupy" or r.dtype != dtype or not r.tbs:
                continue
            cudnn = find("table", r.case, "sdpa_cudnn", dtype)
            if cudnn and cudnn.tbs:
                lines.append(f"{dtype} {r.case:12s} contiguous >= 1.0x cuDNN           | {r.tbs:.2f} vs {cudnn.tbs:.2f} TB/s "
                             f"({r.tbs / cudnn.tbs:.2f}x)            | {'yes' if r.tbs >= cudnn.tbs else 'NO'}")
            B, n = r.case.split(" x ")
            if int(B[1:]) * int(n[:-1]) * 1024 >= 256 * 1024:
                lines.append(f"{dtype} {r.case:12s} >= 4.3 TB/s                        | {r.tbs:.2f} TB/s"
                             f"                             | {'yes' if r.tbs >= 4.3 else 'NO'}")
            for ps in (16, 64):
                p = find("table", r.case, f"omnicupy_paged{ps}", dtype)
                if p and p.tbs:
                    lines.append(f"{dtype} {r.case:12s} paged {ps:3d} within 5% of contiguous  | {p.tbs:.2f} vs {r.tbs:.2f} TB/s "
                                 f"({p.tbs / r.tbs:.2f}x)          | {'yes' if p.tbs >= 0.95 * r.tbs else 'NO'}")
        for r in rows:
            if r.part == "nq" and r.dtype == dtype and r.system == "omnicupy" and not r.case.endswith("Nq1") and r.ms:
                base = find("nq", r.case.rsplit(" ", 1)[0] + " Nq1", "omnicupy", dtype)
                if base and base.ms:
                    limit = 1.10 if r.case.endswith("Nq4") else 1.25
                    lines.append(f"{dtype} {r.case:20s} time <= {limit:.2f}x Nq1       | {r.ms / base.ms:.2f}x"
                                 f"                                   | {'yes' if r.ms <= limit * base.ms else 'NO'}")
        for r in rows:
            if r.part == "window" and r.dtype == dtype and "window" in r.case and r.ms:
                short = find("window", r.case.replace("128k window 4096", "cache of 4096"), r.system, dtype)
                if short and short.ms:
                    lines.append(f"{dtype} {r.case:20s} {r.system[8:]:8s} <= 1.10x 4k cache | {r.ms / short.ms:.2f}x"
                                 f"                                   | {'yes' if r.ms <= 1.1 * short.ms else 'NO'}")
        var = find("prefill", "8 seqs 1k-32k varlen", "omnicupy_varlen", dtype)
        pad = find("prefill", "8 seqs padded to 32k", "omnicupy_padded", dtype)
        if var and pad and var.ms and pad.ms:
            lines.append(f"{dtype} ragged prefill >= 1.0x padded useful TFLOP/s    | {pad.ms / var.ms:.2f}x"
                         f"                                   | {'yes' if var.ms <= pad.ms else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--parts", default="table,nq,window,ragged,prefill")
    ap.add_argument("--systems", default="omnicupy,omnicupy_paged16,omnicupy_paged64,sdpa_cudnn,sdpa_flash,flex")
    ap.add_argument("--cells", default="", help="B:N list for the table, e.g. 1:8192,32:131072 (default: all 9)")
    ap.add_argument("--nq-cells", default="8:32768,32:32768")
    ap.add_argument("--nq-extra", default="", help="Nq=system+system;... more systems for the nq part, "
                                                    "e.g. 16=omnicupy@8x2+omnicupy@4x3")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    gpu = Gpu()
    print(f"device {gpu.name}, L2 {gpu.l2 >> 20} MB, torch {'yes' if gpu.torch else 'no'}", flush=True)
    dtypes = args.dtypes.split(",")
    parts = args.parts.split(",")
    systems = tuple(args.systems.split(","))

    def cells_of(text):
        return [tuple(int(x) for x in c.split(":")) for c in text.split(",") if c]

    run = Runner(gpu, args.reps)
    cells = cells_of(args.cells) or [(B, N) for B in BATCHES for N in LENGTHS]
    extra = {int(k): v.split("+") for k, v in (e.split("=") for e in args.nq_extra.split(";") if e)}
    steps = {"table": lambda: part_table(run, dtypes, systems, cells),
             "nq": lambda: part_nq(run, dtypes, cells_of(args.nq_cells), extra),
             "window": lambda: part_window(run, dtypes, (1, 8)),
             "ragged": lambda: part_ragged(run, dtypes),
             "prefill": lambda: part_prefill(run, dtypes)}
    for name, step in steps.items():
        if name not in parts:
            continue
        step()
        if args.json:  # after every part: a later failure keeps what was measured
            doc = {"device": gpu.name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # tools/standing.py
                   "rows": [{**r.__dict__, "tbs": r.tbs} for r in run.rows]}
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=float)
    print(summary(run.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
