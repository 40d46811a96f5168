"""Builds from pieces on the GPU (omnicupy/mask/pieces_build.py): correctness, then time against the
path they replaced, in one process (lab/notes/masks.md#s36; issue 13).

    python3 lab/tools/pieces_check.py          (on a GPU; from anywhere in the checkout)

1. Every pieced mask case of tests/support/mask_cases.py (and a few more: tiny documents, windows wider
   than the rows, bottom-right causal, an interleaving with 3-token texts) at 7 (q_len, kv_len)
   pairs and 7 block shapes, and the benchmark masks (bench_masks.workload, a 16k-document mask, a
   1024 window within documents) at N = 8192 and 131072: the GPU build equals the host build, array
   for array (metadata, pool, summary, features, q-block work). Failures are listed.
2. Each benchmark mask built on the GPU with pieces_build and with it switched off (the structured
   path with the device layout kernel), alternating in rounds, each build synchronized: min and
   median ms. The table is printed last.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import cupy as cp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "tests" / "sanitize")]

from benchmarks import bench_masks  # noqa: E402
from mask_cases import MASK_CASES, alternating_segments, random_lengths  # noqa: E402
from sanitize_masks import differences  # noqa: E402
from omnicupy import BlockMask, masks  # noqa: E402
from omnicupy.mask import builders, pieces_build  # noqa: E402

EXTRA = [
    ("document_tiny", lambda q, k: masks.document(masks.doc_ids_from_lengths(random_lengths(max(q, k), 1, 9, seed=5)))),
    ("interleaved_3_200", lambda q, k: masks.interleaved(alternating_segments(max(q, k), 3, 200))),
    ("sliding_window_5000", lambda q, k: masks.sliding_window(5000)),
    ("causal_bottom_right", lambda q, k: masks.causal(k - q)),
    ("local_window_0_700", lambda q, k: masks.local_window(0, 700)),
    ("prefix_lm_0", lambda q, k: masks.prefix_lm(0)),
]
SIZES = [(1, 1), (77, 300), (300, 77), (1000, 1000), (1000, 333), (1025, 1025), (4097, 5000)]
BLOCKS = [(64, 64), (128, 128), (64, 128), (128, 64), (16, 32), (256, 32), (48, 256)]
LARGE = ("causal", "sliding_window_1024", "document", "interleaved", "document_16k", "sliding_document")


def large_mask(name: str, n: int) -> masks.MaskMod:
    if name == "document_16k":  # documents of 16384 positions
        return masks.document(masks.doc_ids_from_lengths([16384] * (n // 16384 + 1))[:n])
    if name == "sliding_document":  # a 1024 window within the benchmark's documents
        return masks.and_masks(masks.sliding_window(1024), bench_masks.workload("document", n))
    return bench_masks.workload(name, n)


def check() -> None:
    passed, failed = 0, []
    jobs = [(name, f(q, k), None, 2, q, k, qbs, kbs) for name, f in MASK_CASES + EXTRA if f(8, 8).pieces is not None
            for q, k in SIZES for qbs, kbs in BLOCKS]
    jobs += [(name, large_mask(name, n), None, None, n, n, 128, 128) for n in (8192, 131072) for name in LARGE]
    for name, mod, batch, heads, q, k, qbs, kbs in jobs:
        sizes = dict(q_block_size=qbs, kv_block_size=kbs)
        got = builders.from_mask_mod(mod, batch, heads, q, k, xp=cp, **sizes)
        wrong = differences(got, builders.from_mask_mod(mod, batch, heads, q, k, xp=np, **sizes))
        if wrong:
            failed.append(f"{name} {q}x{k} blocks {qbs}x{kbs}: {', '.join(wrong)}")
        else:
            passed += 1
    print(f"correctness: {passed} passed, {len(failed)} failed", flush=True)
    for line in failed[:30]:
        print("FAIL", line)


def timed(build: Callable[[], BlockMask], reps: int) -> list[float]:
    """ms of ``reps`` builds, each from an idle device until the device is idle again."""
    out = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        started = time.perf_counter()
        build()
        cp.cuda.Device().synchronize()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def compare(rounds: int = 4, reps: int = 15) -> None:
    """pieces_build against the structured path it replaced (``applies`` forced False), alternating."""
    real = pieces_build.applies
    print(f"\n{'mask':<22}{'N':>8}{'new min':>9}{'new med':>9}{'old min':>9}{'old med':>9}")
    try:
        for n in (8192, 131072):
            for name in LARGE:
                mod = large_mask(name, n)
                times: dict[str, list[float]] = {"new": [], "old": []}
                for _ in range(rounds):
                    for label in times:
                        pieces_build.applies = real if label == "new" else (lambda *args: False)
                        build = lambda: builders.from_mask_mod(mod, None, None, n, n, xp=cp)  # noqa: E731
                        build(), build()
                        times[label] += timed(build, reps)
                new, old = times["new"], times["old"]
                print(f"{name:<22}{n:>8}{min(new):>9.3f}{statistics.median(new):>9.3f}{min(old):>9.3f}"
                      f"{statistics.median(old):>9.3f}", flush=True)
    finally:
        pieces_build.applies = real


if __name__ == "__main__":
    check()
    compare()
