"""Interleaved text/image attention, as in a vision-language model.

The sequence alternates text spans and image spans. A text token attends causally (to itself and
everything before it); the tokens of one image attend to each other in full, both ways, and to
everything before the image. omnicupy turns that rule into block metadata once, skips the blocks no
query needs, runs a mask-free path on blocks that are fully allowed, and computes exact attention.

    python examples/interleaved_vlm.py

Needs an NVIDIA GPU; without one it says so and exits. Runs in a few seconds.
"""
from __future__ import annotations

import sys

import numpy as np

import omnicupy
from omnicupy import arrays, reference

# (kind, length) spans: a prompt, two 24x24-patch images with text between them, a caption. The
# lengths are not multiples of the 128-token block, so image edges cut through blocks (PARTIAL blocks).
SEGMENTS = [("text", 200), ("image", 576), ("text", 120), ("image", 576), ("text", 376), ("image", 256),
            ("text", 200)]
N = sum(length for _, length in SEGMENTS)  # 2304 tokens
BATCH, HEADS, HEAD_DIM = 1, 8, 128


def main() -> int:
    if not arrays.gpu_available():
        # The mask and the plan need no GPU.
        print("interleaved_vlm.py needs an NVIDIA GPU to run; none is usable here. Its mask and plan on sm_90:")
        bm = omnicupy.BlockMask.from_mask_mod(omnicupy.masks.interleaved(SEGMENTS), None, None, N, N)
        print(f"{bm!r}\n{bm.to_string()}")
        q = np.broadcast_to(np.zeros(HEAD_DIM, np.float16), (BATCH, HEADS, N, HEAD_DIM))
        print(omnicupy.plan(q, q, q, bm, arch="sm_90"))
        return 0
    import cupy as cp

    # 1. The rule, as a mask_mod(b, h, q_idx, kv_idx) -> bool. It is evaluated on index arrays, so the
    #    block metadata for N tokens is built with a few vectorized NumPy calls. None, None: the same
    #    mask for every batch element and head (the metadata broadcasts).
    mask_mod = omnicupy.masks.interleaved(SEGMENTS)
    bm = omnicupy.BlockMask.from_mask_mod(mask_mod, None, None, N, N)

    # 2. Look at it: one character per 128x128 block. '#' full (no per-element work), '\' causal
    #    diagonal, '+' partial (a bitmask per element), '.' skipped entirely.
    print("segments:", ", ".join(f"{kind} {length}" for kind, length in SEGMENTS))
    print(bm.to_string())
    print(f"{bm.sparsity():.1f}% of the blocks are skipped")

    # 3. Attention on random unit-variance inputs, [B, H, N, D] fp16 on the GPU.
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((BATCH, HEADS, N, HEAD_DIM), dtype=cp.float32).astype(cp.float16)
               for _ in range(3))
    out = omnicupy.attention(q, k, v, bm)  # the first call compiles the kernel (or loads it from the cache)

    # 4. Check it against the float64 reference, which reads the element-level rule (the mask_mod), never
    #    the block metadata, so a metadata mistake would show up here.
    expected = reference.attention(q.get(), k.get(), v.get(), mask=bm.mask_mod or bm.to_dense())
    error = reference.relative_error(out, expected)
    print(f"relative error vs the float64 reference: {error:.2e} (fp16 tolerance 3e-3)")

    # 5. An image token sees the whole of its image, later tokens included; a text token never looks ahead.
    first_image = slice(200, 776)
    dense = bm.to_dense()[0, 0]
    print("first image token sees the last token of its image:", bool(dense[first_image.start, first_image.stop - 1]))
    print("a text token sees the next token:", bool(dense[100, 101]))
    return 0 if error <= 3e-3 else 1  # NaN fails too


if __name__ == "__main__":
    sys.exit(main())
