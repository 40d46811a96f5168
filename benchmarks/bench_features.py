"""Cost of the kernel features, side by side in one process (fp16, B=2, N=8192 by default):

- sliding window 1024 and document masks: fused CUDA expression vs stored bitmask in PARTIAL blocks;
- ALiBi and tanh soft-cap vs no score modifier (causal);
- GQA (Hq=32, Hkv=8) vs MHA (Hq=Hkv=32).

    PYTHONPATH=. python3 benchmarks/bench_features.py [--n 8192] [--head-dims 64,128] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout: the root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import omnicupy  # noqa: E402
from benchmarks._systems import cupy_time_ms as time_ms  # noqa: E402
from omnicupy import BlockMask, masks, score_mods  # noqa: E402


def document_mask(n: int, seed: int = 0):
    """Docs of 256-2048 tokens, causal inside: as a CUDA expression over a doc-id array."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(rng.integers(256, 2049)))
    doc = np.repeat(np.arange(len(lengths)), lengths)[:n].astype(np.int32)
    return omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", arrays={"doc": doc},
                              numpy_fn=lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), name="document")


def main(argv=None):
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    N, B = args.n, 2
    rows = []

    def record(group, label, D, ms, base=None):
        rows.append(dict(group=group, case=label, head_dim=D, ms=ms, ratio=None if base is None else ms / base))
        print(f"{group:>12} D={D:<4} {label:<28} {ms:8.3f} ms" + ("" if base is None else f"  x{ms / base:.3f}"),
              flush=True)

    for D in (int(d) for d in args.head_dims.split(",")):
        rng = cp.random.default_rng(D)

        def qkv(hq, hkv):
            return [rng.standard_normal((B, h, N, D), dtype=cp.float32).astype(cp.float16) for h in (hq, hkv, hkv)]

        q, k, v = qkv(16, 16)
        for name, mod in (("sliding_1024", masks.sliding_window(1024)), ("document", document_mask(N))):
            bm = BlockMask.from_mask_mod(mod, None, None, N, N)
            bits = time_ms(lambda: omnicupy.attention(q, k, v, bm, fuse_mask=False))
            fused = time_ms(lambda: omnicupy.attention(q, k, v, bm, fuse_mask=True))
            diff = float(cp.abs(omnicupy.attention(q, k, v, bm, fuse_mask=False).astype(cp.float32)
                                - omnicupy.attention(q, k, v, bm).astype(cp.float32)).max())
            record("mask", f"{name} bits", D, bits)
            record("mask", f"{name} fused (max diff {diff:g})", D, fused, bits)
        base = time_ms(lambda: omnicupy.attention(q, k, v, causal=True))
        record("score_mod", "causal, none", D, base)
        for label, mod in (("alibi", score_mods.alibi(16)), ("softcap 30", score_mods.softcap(30.0))):
            record("score_mod", f"causal, {label}", D, time_ms(lambda: omnicupy.attention(q, k, v, causal=True,
                                                                                        score_mod=mod)), base)
        q, k, v = qkv(32, 32)
        mha = time_ms(lambda: omnicupy.attention(q, k, v, causal=True))
        record("heads", "MHA Hq=Hkv=32", D, mha)
        q, k, v = qkv(32, 8)
        record("heads", "GQA Hq=32 Hkv=8", D, time_ms(lambda: omnicupy.attention(q, k, v, causal=True)), mha)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
