"""One small call of each padded kernel kind, for compute-sanitizer (lab/tools/hd.sh):

    compute-sanitizer --tool memcheck python3 tests/sanitize/sanitize_head_dims.py

A padded forward (D = 40, document mask, odd length) on every family the device has, a padded
backward (D = 80 document, D = 192 causal), split-KV decode through the combine (D = 40) and a paged
decode (D = 192). Every buffer is its own allocation (CuPy's pool off), so that a load or store past
a row of D columns is an out-of-bounds access memcheck sees. Each result is checked against the
float64 reference; exits 1 if any is wrong. Prints its seed (--seed replays).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import omnicupy
from omnicupy import BlockMask, jit, reference
from omnicupy.dispatch.arch import has_wgmma
from omnicupy.ops import decode, tma

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helpers import TOLERANCE, random_qkv  # noqa: E402


def document(n: int):
    ids = omnicupy.masks.doc_ids_from_lengths([n // 3, n // 3, n - 2 * (n // 3)])
    mod = omnicupy.masks.document(ids, causal=True)
    return BlockMask.from_mask_mod(mod, None, None, n, n), reference.dense_mask_from_mod(mod, 1, 1, n, n)


def check(label: str, got, want) -> bool:
    err = reference.relative_error(np.asarray(got.get() if hasattr(got, "get") else got, np.float64), want)
    ok = bool(np.isfinite(err) and err <= TOLERANCE["fp16"])
    print(f"{'ok   ' if ok else 'WRONG'} {label}: relative error {err:.2e}")
    return ok


def main() -> int:
    import cupy as cp

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    cp.cuda.set_allocator(None)
    ok = True
    n = 201

    families = ["sync"]
    if has_wgmma(jit.device_arch()):
        families += ["wgmma"] + (["tma"] if tma.available() else [])
    bm, dense = document(n)
    q, k, v = random_qkv(rng, 1, 2, n, 40, "fp16")
    want = reference.attention(q, k, v, dense)
    for family in families:
        os.environ["OMNICUPY_MMA"] = family
        got = omnicupy.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), bm)
        ok &= check(f"forward D=40 {family} ({omnicupy.plan(q, k, v, bm).kernel})", got, want)
    os.environ["OMNICUPY_MMA"] = "auto"

    for D, kind in ((80, "document"), (192, "causal")):
        q, k, v = random_qkv(rng, 1, 2, n, D, "fp16")
        dout = rng.standard_normal(q.shape).astype(q.dtype)
        mask, causal, dm = (bm, False, dense) if kind == "document" else (None, True, np.tril(np.ones((n, n), bool)))
        qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
        out, lse = omnicupy.attention(qd, kd, vd, mask, causal=causal, return_lse=True)
        got = omnicupy.attention_backward(dod, qd, kd, vd, out, lse, mask, causal=causal)
        want = reference.attention_backward(dout, q, k, v, dm)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            ok &= check(f"backward D={D} {kind} {name}", g, w)

    q, k, v = random_qkv(rng, 2, 4, 1, 40, "fp16", Hkv=2, Nkv=333)
    lens = np.array([333, 17], np.int32)
    got = decode.decode_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), kv_lens=cp.asarray(lens), num_splits=3,
                                  causal=True)
    ok &= check("decode D=40, 3 splits + combine", got, reference.decode_attention(q, k, v, lens, causal="bottom_right"))

    from decode_cases import paged_from_contiguous  # noqa: E402

    q, k, v = random_qkv(rng, 2, 4, 2, 192, "fp16", Hkv=2, Nkv=333)
    kp, vp, table = paged_from_contiguous(rng, k, v, 16, "NHD", lens)
    got = omnicupy.paged_attention(*(cp.asarray(x) for x in (q, kp, vp, table, lens)), causal=True, num_splits=2)
    ok &= check("paged D=192, 2 splits", got, reference.paged_attention(q, kp, vp, table, lens, causal=True))
    print("all correct" if ok else "WRONG results")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
