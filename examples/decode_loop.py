"""A toy decode loop on a paged KV cache: prefill a few prompts, then generate token by token.

Serving stacks keep each sequence's keys and values in fixed-size pages from one shared pool and
give every sequence a row of page ids (vLLM, FlashInfer). This script does the same with CuPy:

1. prefill: the prompts (different lengths) go through ``omnicupy.varlen_attention`` packed
   without padding, and their keys/values are written into pages;
2. decode: each step makes one query per sequence, appends the step's key/value to its page
   (taking a fresh page from the pool when the last one is full) and calls
   ``omnicupy.paged_attention`` with the updated ``kv_lens``.

The "model" is a fixed random projection (no weights to download): the point is the cache
bookkeeping and the calls. The last step is checked against the float64 reference.

    python examples/decode_loop.py

Needs an NVIDIA GPU; without one it says so and exits. Runs in a few seconds.
"""
from __future__ import annotations

import sys

import numpy as np

import omnicupy
from omnicupy import arrays, reference

HQ, HKV, D = 8, 2, 64
PAGE_SIZE, POOL_PAGES, MAX_PAGES = 16, 256, 32
PROMPTS = (37, 5, 120)
STEPS = 24


class PagedCache:
    """A page pool [POOL_PAGES, PAGE_SIZE, HKV, D] (NHD) for K and V, one page-table row per sequence."""

    def __init__(self, cp, batch: int) -> None:
        self.cp = cp
        self.k = cp.zeros((POOL_PAGES, PAGE_SIZE, HKV, D), dtype=cp.float16)
        self.v = cp.zeros_like(self.k)
        self.free = list(range(POOL_PAGES))[::-1]
        self.table = np.full((batch, MAX_PAGES), -1, np.int32)  # -1: no page yet (never read)
        self.lens = np.zeros(batch, np.int32)

    def append(self, b: int, k, v) -> None:
        """Write keys/values [n, HKV, D] at the end of sequence b, taking pages as needed."""
        for j in range(k.shape[0]):
            pos = int(self.lens[b])
            page_index, slot = divmod(pos, PAGE_SIZE)
            if self.table[b, page_index] < 0:
                self.table[b, page_index] = self.free.pop()
            page = int(self.table[b, page_index])
            self.k[page, slot] = k[j]
            self.v[page, slot] = v[j]
            self.lens[b] += 1


def main() -> int:
    if not arrays.gpu_available():
        # Which kernel one decode step would run, on an H100/H200 (the plan needs no GPU).
        print("decode_loop.py needs an NVIDIA GPU to run; none is usable here. One decode step's plan on sm_90:")
        longest = max(PROMPTS) + STEPS
        q = np.zeros((len(PROMPTS), HQ, 1, D), np.float16)
        kv = np.broadcast_to(np.zeros(D, np.float16), (len(PROMPTS), HKV, MAX_PAGES * PAGE_SIZE, D))
        lens = np.array([min(p + STEPS, longest) for p in PROMPTS], np.int32)
        print(omnicupy.plan(q, kv, kv, causal=True, kv_lens=lens, arch="sm_90"))
        return 0
    import cupy as cp

    rng = cp.random.default_rng(0)
    batch = len(PROMPTS)
    proj = rng.standard_normal((3, D, D), dtype=cp.float32) / np.sqrt(D)  # toy q/k/v "weights"

    def qkv(x, heads_q=HQ):
        """Hidden states [n, D] -> q [n, HQ, D], k and v [n, HKV, D] (fp16)."""
        q = (x @ proj[0])[:, None, :] * cp.ones((1, heads_q, 1), cp.float32)
        k = (x @ proj[1])[:, None, :] * cp.linspace(0.5, 1.5, HKV, dtype=cp.float32)[None, :, None]
        v = (x @ proj[2])[:, None, :] * cp.ones((1, HKV, 1), cp.float32)
        return q.astype(cp.float16), k.astype(cp.float16), v.astype(cp.float16)

    # ---- prefill: all prompts packed, causal inside each
    cache = PagedCache(cp, batch)
    cu = np.concatenate([[0], np.cumsum(PROMPTS)]).astype(np.int32)
    hidden = rng.standard_normal((int(cu[-1]), D), dtype=cp.float32)
    q, k, v = qkv(hidden)
    prefill_out = omnicupy.varlen_attention(q, k, v, cu, cu, causal=True)
    for b in range(batch):
        cache.append(b, k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]])
    last = prefill_out[cu[1:] - 1].astype(cp.float32).mean(axis=1)  # one hidden state per sequence
    print(f"prefill: {batch} prompts of {list(PROMPTS)} tokens, {sum(PROMPTS)} packed rows, "
          f"{int((cache.table >= 0).sum())} pages in use")

    # ---- decode: one query per sequence per step
    for step in range(STEPS):
        q, k, v = qkv(last)
        for b in range(batch):
            cache.append(b, k[b:b + 1], v[b:b + 1])
        # [B, HQ, 1, D] queries; the new token is the last key of each sequence (bottom-right causal)
        out = omnicupy.paged_attention(q[:, :, None, :], cache.k, cache.v, cache.table, cache.lens)
        last = out[:, :, 0].astype(cp.float32).mean(axis=1)
    print(f"decode: {STEPS} steps, kv_lens now {cache.lens.tolist()}, "
          f"{int((cache.table >= 0).sum())} of {POOL_PAGES} pages in use")

    # ---- check the last step against the float64 reference
    want = reference.paged_attention(q[:, :, None, :].get(), cache.k.get(), cache.v.get(), cache.table, cache.lens)
    err = reference.relative_error(out.get(), want)
    print(f"last step vs float64 reference: relative error {err:.1e}")
    return 0 if err < 3e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
