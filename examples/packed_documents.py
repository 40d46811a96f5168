"""Packed documents: several documents of random lengths share one sequence, one packing per batch element.

Training on packed sequences wastes nothing on padding, but a token must only see earlier tokens of
its own document. Each batch element has its own packing, so the mask differs per batch element:
build it with B = batch size and a mask_mod that looks up the document of each position in a
per-batch ``doc_ids`` array. Heads share the mask (H = None broadcasts).

    python examples/packed_documents.py

Needs an NVIDIA GPU; without one it says so and exits. Runs in a few seconds.
"""
from __future__ import annotations

import sys

import numpy as np

import omnicupy
from omnicupy import arrays, masks, reference

BATCH, HEADS, N, HEAD_DIM = 4, 4, 2048, 64


def random_packing(rng: np.random.Generator, n: int) -> np.ndarray:
    """Document id of every position: documents of 32 to 800 tokens until ``n`` is filled."""
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(min(rng.integers(32, 800), n - sum(lengths))))
    return np.repeat(np.arange(len(lengths)), lengths)


def gpu_ms(fn) -> float:
    """Median GPU time of ``fn()`` in milliseconds (CuPy's benchmark helper times it with CUDA events)."""
    from cupyx.profiler import benchmark

    return 1e3 * float(np.median(benchmark(fn, n_repeat=20, n_warmup=3).gpu_times))


def main() -> int:
    if not arrays.gpu_available():
        # The mask and the plan need no GPU (the mask's blocks are evaluated with NumPy here).
        print("packed_documents.py needs an NVIDIA GPU to run; none is usable here. Its mask and plan on sm_90:")
        ids = np.stack([random_packing(np.random.default_rng(0), N) for _ in range(BATCH)])
        bm = omnicupy.BlockMask.from_mask_mod(masks.document(ids, causal=True), BATCH, None, N, N)
        print(f"{bm!r}\nbatch 0:\n{bm.to_string(batch=0)}")
        q = np.broadcast_to(np.zeros(HEAD_DIM, np.float16), (BATCH, HEADS, N, HEAD_DIM))
        print(omnicupy.plan(q, q, q, bm, arch="sm_90"))
        return 0
    import cupy as cp

    rng = np.random.default_rng(0)
    doc_ids = np.stack([random_packing(rng, N) for _ in range(BATCH)])  # [B, N] int

    # The rule: same document, and causal. masks.document takes per-batch ids [B, N], knows where
    # each document starts (so only blocks that cut a document boundary are evaluated element by
    # element), and evaluates those on the GPU. A hand-written rule such as
    #     lambda b, h, q, kv: (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)
    # gives the same mask, but indexes a NumPy table, so it is evaluated on the host, more slowly.
    document_causal = masks.document(doc_ids, causal=True)
    bm = omnicupy.BlockMask.from_mask_mod(document_causal, BATCH, None, N, N)
    for b in range(BATCH):
        lengths = np.bincount(doc_ids[b])
        print(f"batch {b}: {len(lengths)} documents, lengths {lengths.tolist()}")
    print("block grid of batch 0 ('#' full, '\\' causal, '+' partial, '.' skipped):")
    print(bm.to_string(batch=0))
    print(f"{bm.sparsity():.1f}% of the blocks are skipped (all batch elements together)")

    q, k, v = (cp.asarray(rng.standard_normal((BATCH, HEADS, N, HEAD_DIM)), dtype=cp.float16) for _ in range(3))
    out = omnicupy.attention(q, k, v, bm)

    # The reference evaluates document_causal itself, position by position.
    expected = reference.attention(q.get(), k.get(), v.get(), mask=document_causal)
    error = reference.relative_error(out, expected)
    print(f"relative error vs the float64 reference: {error:.2e} (fp16 tolerance 3e-3)")

    # What skipping other documents' blocks buys over plain causal attention on the same inputs.
    packed = gpu_ms(lambda: omnicupy.attention(q, k, v, bm, out=out))
    causal = gpu_ms(lambda: omnicupy.attention(q, k, v, causal=True, out=out))
    print(f"document mask {packed:.3f} ms, plain causal {causal:.3f} ms per call ({causal / packed:.1f}x)")
    return 0 if error <= 3e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
