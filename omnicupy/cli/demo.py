"""``omnicupy demo``: the main job, interleaved text/image attention.

Everywhere: the mask (its block grid from ``to_string``, sparsity) and a float64 check on tiny
shapes that the block metadata the kernels read reproduces the mask rule element by element,
through ``omnicupy.reference``. On a GPU: attention at full size, checked against the float64
reference on sampled rows and timed. Without a GPU: the default kernel variants are precompiled.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .. import arrays
from .catalogue import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, kernel_for
from .common import NO_GPU_ARCHS, cache_dir_option, default_jobs, positive_int
from .precompile import precompile

#: The architecture the demo compiles for without a GPU (the first of the no-GPU defaults).
DEMO_ARCH = NO_GPU_ARCHS[0]
#: Relative Frobenius error allowed against the float64 reference (README, "Using it").
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}
#: The tiny CPU check: a sequence that cuts blocks in every way, small blocks, float64.
CHECK_SEGMENTS = (("text", 40), ("image", 72), ("text", 90), ("image", 64), ("text", 54))
CHECK_BLOCK = 64
CHECK_SHAPE = {"batch": 1, "heads": 2, "head_dim": 32}


def demo_segments(n: int) -> list[tuple[str, int]]:
    """An interleaved text/image sequence of ``n`` tokens: ("text", length) and ("image", length) spans,
    lengths chosen so that spans straddle block boundaries (partial blocks)."""
    pattern = (("text", 300), ("image", 576), ("text", 700), ("image", 1024))
    segments, used = [], 0
    while used < n:
        kind, length = pattern[len(segments) % len(pattern)]
        length = min(length, n - used)
        segments.append((kind, length))
        used += length
    return segments


def show_mask(n: int):
    """Build and print the interleaved mask at ``n`` tokens (on the GPU when there is one)."""
    from .. import BlockMask, masks

    segments = demo_segments(n)
    start = time.perf_counter()
    bm = BlockMask.from_mask_mod(masks.interleaved(segments), None, None, n, n)
    mask_ms = 1e3 * (time.perf_counter() - start)
    print("interleaved text/image mask: " + ", ".join(f"{kind} {length}" for kind, length in segments))
    print(bm.to_string())
    print(f"{bm!r}\nsparsity {bm.sparsity():.1f}% of blocks skipped (built in {mask_ms:.0f} ms)", flush=True)
    return bm


def reference_check(seed: int = 0) -> bool:
    """float64, tiny shapes, no GPU: the block metadata the kernels read (``BlockMask.to_dense``) must
    give the same mask and the same attention as the mask rule, and the reference must agree with a
    softmax written out here."""
    from .. import BlockMask, masks, reference

    n = sum(length for _, length in CHECK_SEGMENTS)
    b, h, d = CHECK_SHAPE["batch"], CHECK_SHAPE["heads"], CHECK_SHAPE["head_dim"]
    rule = masks.interleaved(CHECK_SEGMENTS)
    bm = BlockMask.from_mask_mod(rule, None, None, n, n, q_block_size=CHECK_BLOCK, kv_block_size=CHECK_BLOCK)
    from_metadata = np.broadcast_to(bm.to_dense(), (b, h, n, n))
    from_rule = reference.dense_mask_from_mod(rule, b, h, n, n)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    out_blocks = reference.attention(q, k, v, from_metadata)
    out_rule = reference.attention(q, k, v, rule)
    scores = np.where(from_rule, q @ k.transpose(0, 1, 3, 2) / np.sqrt(d), -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    written_out = (weights / weights.sum(axis=-1, keepdims=True)) @ v  # every row has a key here (causal text)
    same_mask = bool(np.array_equal(from_metadata, from_rule))
    blocks_vs_rule = float(np.max(np.abs(out_blocks - out_rule)))
    rule_vs_formula = reference.relative_error(out_rule, written_out)
    ok = same_mask and blocks_vs_rule == 0.0 and rule_vs_formula <= 1e-12
    print(f"float64 check on the CPU (B={b} H={h} N={n} D={d}, {CHECK_BLOCK}-token blocks, seed {seed}): block "
          f"metadata {'reproduces' if same_mask else 'DOES NOT reproduce'} the mask rule on all {n * n} pairs "
          f"({bm.sparsity():.0f}% of blocks skipped); attention from the metadata vs the rule: max |diff| "
          f"{blocks_vs_rule:.1e}; reference vs a written-out softmax: relative error {rule_vs_formula:.1e}"
          + ("" if ok else "  FAILED"), flush=True)
    return ok


def _reference_rows(q, k, v, bm, rows):
    """float64 reference for the query rows ``rows`` only (the full reference at N=8192 is slow)."""
    from .. import reference

    B, H, N, _ = q.shape
    if bm.mask_mod is not None:
        b = np.arange(B).reshape(B, 1, 1, 1)
        h = np.arange(H).reshape(1, H, 1, 1)
        allowed = bm.mask_mod(b, h, rows.reshape(1, 1, -1, 1), np.arange(N).reshape(1, 1, 1, N))
    else:
        allowed = bm.to_dense()[:, :, rows]
    allowed = np.broadcast_to(np.asarray(allowed, dtype=bool), (B, H, len(rows), N))
    return reference.attention(q[:, :, rows], k, v, mask=allowed)


def run_gpu(args: argparse.Namespace, bm) -> int:
    """Attention at full size on the GPU, checked against the float64 reference on sampled rows, timed."""
    import cupy as cp

    from .. import attention, jit, reference

    B, H, N, D = args.batch, args.heads, args.seq_len, args.head_dim or 128
    dtype = args.dtype or "fp16"
    rng = cp.random.default_rng(0)
    np_dtype = np.dtype(np.float16) if dtype == "fp16" else arrays.BFLOAT16
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(np_dtype) for _ in range(3))
    variant = kernel_for(D, dtype, bm, jit.device_arch())
    start = time.perf_counter()
    out = attention(q, k, v, bm)
    cp.cuda.get_current_stream().synchronize()
    print(f"kernel {variant.name}: first call {time.perf_counter() - start:.2f} s (compile or cache load)")

    rows = np.sort(np.random.default_rng(0).choice(N, size=min(N, args.check_rows), replace=False))
    expected = _reference_rows(q.get(), k.get(), v.get(), bm, rows)
    error = reference.relative_error(out[:, :, cp.asarray(rows)], expected)

    times = []
    for _ in range(args.iters):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record()
        attention(q, k, v, bm, out=out)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end))
    ms = float(np.median(times))
    pairs = int(np.count_nonzero(bm.to_dense())) * (B // bm.shape[0]) * (H // bm.shape[1])
    tflops = 4 * pairs * D / (ms * 1e-3) / 1e12
    print(f"B={B} H={H} N={N} D={D} {dtype}: relative error {error:.2e} vs the float64 reference "
          f"({len(rows)} rows, tolerance {TOLERANCE[dtype]:.0e}); {ms:.3f} ms per call "
          f"(median of {args.iters}), {tflops:.0f} TFLOP/s effective")
    if not error <= TOLERANCE[dtype]:
        print(f"error {error:.2e} is above the tolerance {TOLERANCE[dtype]:.0e}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    bm = show_mask(args.seq_len)
    checked = reference_check()
    if arrays.gpu_available():
        return run_gpu(args, bm) or (0 if checked else 1)
    # Only what this demo's own call needs, for the default architecture: a newcomer sees the
    # compiler work in seconds; every shipped variant stays ``omnicupy precompile``'s job.
    arch = DEMO_ARCH
    variant = kernel_for(args.head_dim or 128, args.dtype or "fp16", bm, arch)
    print(f"no GPU: compiling the kernel this demo's call needs on {arch} ({variant.name}); "
          f"`omnicupy precompile` builds every shipped variant", flush=True)
    return precompile([variant], (arch,), "no GPU: the demo's kernel", args.jobs) or (0 if checked else 1)


def add_parser(commands: argparse._SubParsersAction) -> None:
    d = commands.add_parser(
        "demo", parents=[cache_dir_option()], help="interleaved text/image attention, checked and timed",
        description="Build an interleaved text/image mask (text causal, image spans full), print its block grid "
                    "and sparsity, and check in float64 on tiny shapes that its block metadata reproduces the mask "
                    "rule. Then, on a GPU: run attention, compare a sample of rows with the float64 reference and "
                    "time the call; without a GPU: precompile the default variants (as precompile does with no GPU).")
    d.add_argument("--batch", type=positive_int, default=2, metavar="B", help="batch size (default 2)")
    d.add_argument("--heads", type=positive_int, default=16, metavar="H", help="heads (default 16)")
    d.add_argument("--seq-len", type=positive_int, default=8192, metavar="N", help="sequence length (default 8192)")
    d.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=None, metavar="D",
                   help="head dim (default 128); without a GPU, compile only this head dim")
    d.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=None,
                   help="input dtype (default fp16); without a GPU, compile only this dtype")
    d.add_argument("--iters", type=positive_int, default=20, help="timed calls (default 20)")
    d.add_argument("--check-rows", type=positive_int, default=256, metavar="R",
                   help="query rows compared with the reference (default 256)")
    d.add_argument("--jobs", "-j", type=positive_int, default=default_jobs(), metavar="N",
                   help="parallel compiles without a GPU")
    d.set_defaults(func=run)
