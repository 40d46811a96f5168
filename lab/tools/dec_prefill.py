"""Reproducer of the ragged-prefill crash (issue 16): bench_decode.py --parts prefill died with
cudaErrorIllegalAddress, and at 32 query heads the padded batch (q of exactly 2**31 bytes) met an
illegal address in attention().

    PYTHONPATH=. python lab/tools/dec_prefill.py [--preset full|small] [--families auto,wgmma,sync]
        [--steps mask,varlen,varlen_recall,varlen_graph,padded,padded_recall,padded_graph]
        [--padded-heads 16,32]

Runs the bench's calls one step at a time and synchronizes after each: the last "STEP" line
printed before a crash names the call that faulted (run it with CUDA_LAUNCH_BLOCKING=1 so that
the fault is reported by the launch that caused it, or under compute-sanitizer --tool memcheck,
which names the kernel and the address). Every step also checks sampled rows against float64:
the rows at the highest addresses (end of the longest sequence, last batch and head of the padded
batch) are the ones a 32-bit offset would get wrong silently.

Steps:
  mask           the varlen BlockMask built on the GPU against the same mask built on the host
                 (kv_indices in range, counts, types): a bad device-built mask reads out of bounds;
  varlen         varlen_attention, first call (the general path: plan, pack, launch);
  varlen_recall  second call (ops/recall.py's steady-state path);
  varlen_graph   two calls captured in a CUDA graph and replayed (what the bench times);
  padded         attention(causal=True) on the batch padded to the longest sequence, for each of
                 --padded-heads (16: the bench; 32: q of 2**31 bytes, the first crash);
  padded_recall, padded_graph  as for varlen.

Presets: full = the bench (lengths 1k..32k, Hq 16, Hkv 4, D 128); small = every length / 8 and
Hq 4, Hkv 1, padded heads 4 (finishes under compute-sanitizer in about a minute).
Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

D = 128
FULL_LENGTHS = (1024, 2048, 3072, 4096, 8192, 12288, 16384, 32768)
PRESETS = {
    "full": dict(lengths=FULL_LENGTHS, heads=16, kv_heads=4, padded_heads=(16, 32)),
    "small": dict(lengths=tuple(n // 8 for n in FULL_LENGTHS), heads=4, kv_heads=1, padded_heads=(4,)),
    # sequence ends that are not block multiples (tails inside kv and q blocks)
    "odd": dict(lengths=(1000, 2049, 3071, 4097, 8191, 12289, 16383, 32769), heads=16, kv_heads=4,
                padded_heads=(16,)),
}
TOL = 3e-3
ALL_STEPS = ("mask", "varlen", "varlen_recall", "varlen_graph", "padded", "padded_recall", "padded_graph")


def log(text: str) -> None:
    print(text, flush=True)


def randn(cp, shape, seed):
    """fp16 unit normals drawn on the device in chunks (the decode benchmark's draw)."""
    from benchmarks import _systems  # run from the repository root with PYTHONPATH=. (dec.sh)

    return _systems.device_normal(cp, shape, np.float16, cp.random.default_rng(seed))


def rows_reference(q_rows, k, v, first_row, causal_shift=0):
    """float64 causal attention of query rows [first_row, first_row + len(q_rows)) against keys
    0..n-1 (query i sees keys j <= i + causal_shift)."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q_rows, k, v))
    s = q64 @ k64.T / math.sqrt(q64.shape[-1])
    rows = np.arange(first_row, first_row + len(q64))[:, None] + causal_shift
    s = np.where(np.arange(len(k64))[None, :] <= rows, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v64


def rel_err(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


class Steps:
    def __init__(self, cp, args):
        self.cp, self.args = cp, args
        self.failures = []
        self.summary = []

    def run(self, name: str, fn) -> None:
        log(f"STEP {name} ...")
        start = time.perf_counter()
        try:
            err = fn()
            self.cp.cuda.runtime.deviceSynchronize()
        except Exception as exc:  # noqa: BLE001 - report, and stop at a device fault (the context is gone)
            text = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"STEP {name} FAILED: {text}")
            self.failures.append(name)
            self.summary.append((name, "FAILED", text))
            if "IllegalAddress" in text or "illegal" in text.lower() or "cudaError" in text:
                self.report()
                sys.exit(2)
            return
        ms = (time.perf_counter() - start) * 1e3
        ok = err is None or err <= TOL
        note = "" if err is None else f"max rel err {err:.1e}"
        log(f"STEP {name} {'ok' if ok else 'WRONG'} ({ms:.0f} ms) {note}")
        self.summary.append((name, "ok" if ok else "WRONG", note))
        if not ok:
            self.failures.append(name)

    def report(self) -> None:
        log("\nprefill reproducer summary")
        for name, status, note in self.summary:
            log(f"  {name:32s} {status:7s} {note}")


def main(argv=None) -> int:
    import cupy as cp

    import omnicupy
    from omnicupy.ops import varlen

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="full", choices=tuple(PRESETS))
    ap.add_argument("--families", default="auto", help="OMNICUPY_MMA values to run the varlen/padded steps with")
    ap.add_argument("--steps", default=",".join(ALL_STEPS))
    ap.add_argument("--padded-heads", default="", help="override the preset's padded head counts, e.g. 16,32")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    lengths = np.array(cfg["lengths"], dtype=np.int64)
    Hq, Hkv = cfg["heads"], cfg["kv_heads"]
    padded_heads = tuple(int(h) for h in args.padded_heads.split(",")) if args.padded_heads else cfg["padded_heads"]
    steps = set(args.steps.split(","))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    group = Hq // Hkv
    log(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; preset {args.preset}: "
        f"lengths {lengths.tolist()} (total {total}), Hq {Hq}, Hkv {Hkv}, D {D}; padded heads {padded_heads}; "
        f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '0')}")
    run = Steps(cp, args)

    # ------------------------------------------------------------------ the varlen mask
    if "mask" in steps:
        def check_mask():
            dev = varlen.varlen_mask(cu, cu, total, total, True)
            host = omnicupy.BlockMask.from_mask_mod(varlen.ragged_mask(cu.astype(np.int64), cu.astype(np.int64), True),
                                                    None, None, total, total, xp=np)
            from omnicupy import arrays

            a = {n: arrays.to_numpy(getattr(dev, n)) for n in ("kv_num_blocks", "kv_indices", "block_mask_types")}
            b = {n: arrays.to_numpy(getattr(host, n)) for n in a}
            nb = a["kv_num_blocks"]
            listed = np.arange(a["kv_indices"].shape[-1]) < nb[..., None]
            bad = []
            if not np.array_equal(nb, b["kv_num_blocks"]):
                bad.append("kv_num_blocks differ from the host build")
            for n in ("kv_indices", "block_mask_types"):
                if not np.array_equal(np.where(listed, a[n], 0), np.where(listed, b[n], 0)):
                    bad.append(f"{n} differ from the host build")
            if np.any(a["kv_indices"][listed] < 0) or np.any(a["kv_indices"][listed] >= dev.num_kv_blocks):
                bad.append("kv_indices out of range")
            meta = dev.device_metadata()
            log(f"    mask {dev}; max_blocks {dev.max_blocks}; device rows {tuple(meta.kv_num_blocks.shape)}, "
                f"row strides ({meta.row_stride_batch}, {meta.row_stride_head})")
            if bad:
                raise AssertionError("; ".join(bad))
            return None

        run.run("mask", check_mask)

    families = args.families.split(",")
    q = k = v = None
    if steps & {"varlen", "varlen_recall", "varlen_graph"}:
        q = randn(cp, (total, Hq, D), 1)
        k = randn(cp, (total, Hkv, D), 2)
        v = randn(cp, (total, Hkv, D), 3)

    def check_varlen(out):
        """The last 128 rows of the first and of the longest sequence, first and last head."""
        errs = []
        for s in (0, int(np.argmax(lengths))):
            a, b = int(cu[s]), int(cu[s + 1])
            first = max(a, b - 128)
            for h in (0, Hq - 1):
                want = rows_reference(q[first:b, h].get(), k[a:b, h // group].get(), v[a:b, h // group].get(),
                                      first - a)
                errs.append(rel_err(out[first:b, h].get(), want))
        return max(errs)

    def call_varlen():
        return omnicupy.varlen_attention(q, k, v, cu, cu, causal=True)

    for family in families:
        os.environ["OMNICUPY_MMA"] = family
        tag = f"[{family}]"
        if "varlen" in steps:
            def first_call():
                qv = q.transpose(1, 0, 2)[None]
                kv = k.transpose(1, 0, 2)[None]
                bm = varlen.varlen_mask(cu, cu, total, total, True)
                log("    " + str(omnicupy.plan(qv, kv, kv, bm)).replace("\n", "\n    "))
                return check_varlen(call_varlen())

            run.run(f"varlen {tag}", first_call)
        if "varlen_recall" in steps:
            run.run(f"varlen_recall {tag}", lambda: (call_varlen(), check_varlen(call_varlen()))[1])
        if "varlen_graph" in steps:
            run.run(f"varlen_graph {tag}", lambda: graph_check(cp, call_varlen, check_varlen))
    q = k = v = None  # free the packed inputs before the padded batch
    cp.get_default_memory_pool().free_all_blocks()

    # ------------------------------------------------------------------ the padded batch
    B, n_max = len(lengths), int(lengths.max())
    for heads in padded_heads:
        if not steps & {"padded", "padded_recall", "padded_graph"}:
            break
        kv_heads = max(1, heads // group)
        qp = randn(cp, (B, heads, n_max, D), 4)
        kp = randn(cp, (B, kv_heads, n_max, D), 5)
        vp = randn(cp, (B, kv_heads, n_max, D), 6)
        log(f"    padded q [{B}, {heads}, {n_max}, {D}]: {qp.nbytes} bytes ({qp.nbytes / 2**31:.2f} x 2**31)")

        def check_padded(out, heads=heads, kv_heads=kv_heads, qp=qp, kp=kp, vp=vp):
            """First and last 64 rows of the first and the last (batch, head): the lowest and highest addresses."""
            errs = []
            for b, h in ((0, 0), (B - 1, heads - 1)):
                for first in (0, n_max - 64):
                    hk = h // (heads // kv_heads)
                    last = first + 64
                    want = rows_reference(qp[b, h, first:last].get(), kp[b, hk, :last].get(), vp[b, hk, :last].get(),
                                          first)
                    errs.append(rel_err(out[b, h, first:last].get(), want))
            return max(errs)

        def call_padded(qp=qp, kp=kp, vp=vp):
            return omnicupy.attention(qp, kp, vp, causal=True)

        for family in families:
            os.environ["OMNICUPY_MMA"] = family
            tag = f"[{family}] H{heads}"
            if "padded" in steps:
                def first_padded(qp=qp, kp=kp, vp=vp, call=call_padded, check=check_padded):
                    log("    " + str(omnicupy.plan(qp, kp, vp, causal=True)).replace("\n", "\n    "))
                    return check(call())

                run.run(f"padded {tag}", first_padded)
            if "padded_recall" in steps:
                run.run(f"padded_recall {tag}", lambda call=call_padded, check=check_padded: (call(), check(call()))[1])
            if "padded_graph" in steps:
                run.run(f"padded_graph {tag}",
                        lambda call=call_padded, check=check_padded: graph_check(cp, call, check))
        del qp, kp, vp
        cp.get_default_memory_pool().free_all_blocks()
    os.environ.pop("OMNICUPY_MMA", None)
    run.report()
    log(f"prefill reproducer: {len(run.failures)} failing step(s){': ' + ', '.join(run.failures) if run.failures else ''}")
    return 1 if run.failures else 0


def graph_check(cp, call, check, calls: int = 2):
    """``calls`` calls captured in a CUDA graph on a side stream (as bench_decode.time_cupy does),
    replayed twice; the last output is checked."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        keep = [call() for _ in range(calls)]
        graph = stream.end_capture()
        graph.launch(stream)
        graph.launch(stream)
        stream.synchronize()
    return check(keep[-1])


if __name__ == "__main__":
    sys.exit(main())
