"""The tma family against the wgmma family, one process (lab/notes/forward.md#s12).

    PYTHONPATH=. python benchmarks/bench_tma.py [--head-dims 64,128] [--seq-len 8192]
    PYTHONPATH=. python benchmarks/bench_tma.py --precompile   # build the kernels below and the GPU tests'

Times fp16 full and causal attention, B = 2, H = 16, for the wgmma family's tuned tile and the tma
family's three pipelines (plain, overlap, ping-pong) on the same inputs, interleaved over rounds
(best round kept), with CUDA events around a batch of calls; effective TFLOP/s = 4 B H pairs D / t.
Each configuration's output is first compared with the wgmma family's. --precompile builds every
kernel this script and tests/gpu/test_tma_gpu.py, tests/sanitize/sanitize_variants.py (--families tma) use,
in parallel processes, so that the timed and sanitized runs do not compile.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import omnicupy  # noqa: E402
from omnicupy.dispatch import tiles  # noqa: E402

PIPELINES = {
    "tma-plain": dict(overlap=False, pingpong=False),
    "tma-overlap": dict(overlap=True, pingpong=False),
    "tma-pingpong": dict(overlap=True, pingpong=True),
}


@contextlib.contextmanager
def family(name: str, head_dim: int):
    """OMNICUPY_MMA and, for a tma pipeline, its tile in place of the tuned one."""
    saved = os.environ.get("OMNICUPY_MMA")
    os.environ["OMNICUPY_MMA"] = "wgmma" if name == "wgmma" else "tma"
    try:
        if name not in PIPELINES:  # "wgmma", or "tma": the tuned tile
            yield
        else:
            tuned = tiles.TMA_TUNED[(head_dim, 2)]
            with tiles.use_tiles({(head_dim, 2): tiles.Tile(tuned.br, tuned.bc, tuned.warps, **PIPELINES[name])},
                                 family="tma"):
                yield
    finally:
        if saved is None:
            os.environ.pop("OMNICUPY_MMA", None)
        else:
            os.environ["OMNICUPY_MMA"] = saved


def planned(name, head_dim, arrays, **kw):
    with family(name, head_dim):
        return omnicupy.plan(*arrays, arch="sm_90", **kw).variant


def variants_to_build(head_dims) -> list:
    """Every kernel the timing, tests/gpu/test_tma_gpu.py and sanitize_variants.py --families tma run."""
    from omnicupy import BlockMask, score_mods

    out = set(tiles.shipped_variants(families=("tma",)))
    for hd in (64, 128, 256):
        qkv = [np.zeros((1, 2, 256, hd), np.float16)] * 3
        for name in ("wgmma", *PIPELINES):
            for causal in (False, True):
                if hd in head_dims or name != "wgmma":
                    out.add(planned(name, hd, qkv, causal=causal))
            out.add(planned(name, hd, qkv, block_mask=_mixed_mask(256)))
        bias = np.zeros((1, 2, 256, 256), np.float32)
        out.add(planned("tma", hd, qkv, causal=True, bias=bias, score_mod=score_mods.softcap(5.0)))
        n = 261  # sanitize_variants.py's feature cases
        qkv_n = [np.zeros((1, 2, n, hd), np.float16)] * 3
        kv_n = [np.zeros((1, 2, n + 5, hd), np.float16)] * 2
        out.add(planned("tma", hd, [qkv_n[0], *kv_n], causal=True,
                        bias=np.zeros((1, 2, n, n + 5), np.float32), score_mod=score_mods.softcap(5.0)))
        out.add(planned("tma", hd, [qkv_n[0], *kv_n], causal="bottom_right"))
        for n_doc, period in ((261, 37), (411, 53)):
            doc = (np.arange(n_doc) // period).astype(np.int32)
            fused = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", arrays={"doc": doc},
                                       numpy_fn=lambda b, h, qi, ki, doc=doc: (doc[qi] == doc[ki]) & (qi >= ki))
            bm = BlockMask.from_mask_mod(fused, None, None, n_doc, n_doc)
            q_doc = [np.zeros((1, 2, n_doc, hd), np.float16)] * 3
            out.add(planned("tma", hd, q_doc, block_mask=bm, fuse_mask=True))
    out.add(tiles.Variant(128, "fp16", 64, 64, 8, 2, True, True, family="tma", overlap=True))
    for hd in (64, 128, 256):  # test_tma_gpu.py's random block types on each pipeline
        tuned = tiles.TMA_TUNED[(hd, 2)]
        for overlap, pingpong in ((False, False), (True, False), (True, True)):
            out.add(tiles.Variant(hd, "fp16", tuned.br, tuned.bc, tuned.warps, 2, True, True, family="tma",
                                  overlap=overlap, pingpong=pingpong))
    return sorted(out, key=lambda v: v.name)


def _mixed_mask(n):
    from omnicupy import BlockMask

    return BlockMask.from_dense((np.tril(np.ones((n, n), bool)) | (np.arange(n)[None, :] % 3 == 0))[None, None],
                                q_block_size=128, kv_block_size=128)


def _build(variant) -> str:
    from omnicupy import jit

    start = time.perf_counter()
    entry, built = jit.build(variant, "sm_90")
    return f"{variant.name}: {'built' if built else 'cached'} in {time.perf_counter() - start:.1f} s, " \
           f"{entry.meta['registers']} registers, {entry.meta['spill_bytes']} spill bytes"


def precompile(head_dims, jobs: int) -> None:
    import multiprocessing

    todo = variants_to_build(head_dims)
    print(f"building {len(todo)} variants with {jobs} processes", flush=True)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_build, todo):
            print(line, flush=True)


def time_calls(fn, calls: int) -> float:
    import cupy as cp

    start, stop = cp.cuda.Event(), cp.cuda.Event()
    fn()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / calls


def bench(head_dims, n: int, rounds: int, calls: int) -> None:
    import cupy as cp

    B, H = 2, 16
    rng = np.random.default_rng(0)
    systems = ("wgmma", *PIPELINES)
    for hd in head_dims:
        q, k, v = (cp.asarray(rng.standard_normal((B, H, n, hd)).astype(np.float16)) for _ in range(3))
        for causal in (False, True):
            pairs = n * (n + 1) / 2 if causal else n * n
            flops = 4 * B * H * pairs * hd
            best = {s: float("inf") for s in systems}
            names = {}
            with family("wgmma", hd):
                want = omnicupy.attention(q, k, v, causal=causal)
            for s in systems:
                with family(s, hd):
                    names[s] = omnicupy.plan(q, k, v, causal=causal).kernel
                    got = omnicupy.attention(q, k, v, causal=causal)
                err = float(cp.abs(got.astype(cp.float32) - want.astype(cp.float32)).max())
                print(f"  check D={hd} {'causal' if causal else 'full'} {s} ({names[s]}): max |diff| vs wgmma "
                      f"{err:.1e}", flush=True)
            for _ in range(rounds):
                for s in systems:
                    with family(s, hd):
                        best[s] = min(best[s], time_calls(lambda: omnicupy.attention(q, k, v, causal=causal), calls))
            line = ", ".join(f"{s} {flops / best[s] / 1e12:.0f}" for s in systems)
            print(f"D={hd} {'causal' if causal else 'full'} N={n} TFLOP/s: {line}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    head_dims = tuple(int(h) for h in args.head_dims.split(","))
    if args.precompile:
        precompile(head_dims, args.jobs)
        return 0
    bench(head_dims, args.seq_len, args.rounds, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
