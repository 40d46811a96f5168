"""Build every pieced mask case on the GPU on small shapes (mask/pieces_build.py's two kernels), for
compute-sanitizer; each build is compared with the host path's, array for array.

    compute-sanitizer --tool memcheck  --report-api-errors no python3 tests/sanitize/sanitize_masks.py
    compute-sanitizer --tool racecheck --report-api-errors no python3 tests/sanitize/sanitize_masks.py
    compute-sanitizer --tool synccheck --report-api-errors no python3 tests/sanitize/sanitize_masks.py

Sizes with tails both ways (300 x 77, 77 x 300, 1025 x 1025) and block shapes from 16 x 32 to
48 x 256 (one warp to eight). Exits 1 if a build differs (``differences``: also used by lab/tools/pieces_check.py).
"""
from __future__ import annotations

import os
import sys

import cupy as cp
import numpy as np

from omnicupy import BlockMask, arrays
from omnicupy.mask import builders

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from mask_cases import MASK_CASES  # noqa: E402

METADATA = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")
SIZES = [(300, 77), (77, 300), (1025, 1025)]
BLOCKS = [(64, 64), (16, 32), (48, 256), (128, 128)]


def differences(got: BlockMask, want: BlockMask) -> list[str]:
    """What differs between two builds of one mask (empty when they are equal): the metadata arrays,
    the summary and features, the q blocks' work."""
    found = []
    for field in METADATA:
        a, b = getattr(got, field), getattr(want, field)
        if (a is None) != (b is None) or (a is not None and not np.array_equal(arrays.to_numpy(a), arrays.to_numpy(b))):
            found.append(field)
    if got.summary.counts != want.summary.counts or got.features != want.features:
        found.append("summary or features")
    if not np.array_equal(got.q_block_work, want.q_block_work):
        found.append("q_block_work")
    return found


def main() -> int:
    built = wrong = 0
    for name, factory in MASK_CASES:
        for q_len, kv_len in SIZES:
            mod = factory(q_len, kv_len)
            if mod.pieces is None:
                continue
            for qbs, kbs in BLOCKS:
                sizes = dict(q_block_size=qbs, kv_block_size=kbs)
                got = builders.from_mask_mod(mod, None, None, q_len, kv_len, xp=cp, **sizes)
                want = builders.from_mask_mod(mod, None, None, q_len, kv_len, xp=np, **sizes)
                for field in differences(got, want):
                    print(f"DIFFERS: {name} {q_len}x{kv_len} blocks {qbs}x{kbs}: {field}")
                    wrong += 1
                built += 1
    cp.cuda.Device().synchronize()
    print(f"pieces builds checked: {built}, differing arrays: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
