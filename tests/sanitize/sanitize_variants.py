"""Run every shipped variant once on a small shape, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 tests/sanitize/sanitize_variants.py [--head-dims 64] [--families wgmma]
    compute-sanitizer --tool racecheck python3 tests/sanitize/sanitize_variants.py

Each variant gets a mask with exactly its features (plain: full; causal: causal; partial: random
full/partial blocks; both: a random mix) at odd lengths, so tails and every mask path run; then
the feature variants (bias + score modifier, a fused mask reading a device array, bottom-right
causal) for each head dim and stage.
Exits 1 if any output is wrong.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from omnicupy.dispatch.arch import has_wgmma
import omnicupy
from omnicupy import BlockMask, reference
from omnicupy.dispatch import tiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from helpers import TOLERANCE, random_block_mask, random_qkv  # noqa: E402


def mask_with(features, rng, n, rule=True, q_block_size=128):
    """A mask with exactly these features; without PARTIAL blocks a built-in rule mask (``rule``:
    the planner re-blocks those for tiles.TMA_RULE_TILES) or the same mask from its dense form; with
    them random blocks of ``q_block_size`` rows (192: tiles.TMA_BLOCK_TILES)."""
    causal, partial = features
    if not partial:
        bm = BlockMask.causal(n, n) if causal else BlockMask.full(n, n)
        return (bm if rule else BlockMask.from_dense(bm.to_dense())), bm.to_dense()
    probs = (0.2, 0.3, 0.2, 0.3) if causal else (0.2, 0.0, 0.4, 0.4)
    return random_block_mask(rng, 1, 2, n, n, q_block_size, 128, probs=probs, empty_q_blocks=0)


def main(argv=None) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="32,64,96,128,256")
    ap.add_argument("--n", type=int, default=261)
    ap.add_argument("--families", default="sync,wgmma", help="kernel families (wgmma and tma run on sm_90 only)")
    ap.add_argument("--ctas", type=int, default=0,
                    help="plan persistent tma launches with this many CTAs (small: each CTA loops over tiles)")
    args = ap.parse_args(argv)
    if args.ctas:
        from omnicupy.dispatch import plan as plan_module

        plan_module.sm_count = lambda: args.ctas
    head_dims = tuple(int(h) for h in args.head_dims.split(","))
    families = tuple(args.families.split(","))
    if not has_wgmma(omnicupy.jit.device_arch()):
        families = tuple(f for f in families if f not in ("wgmma", "tma"))
    rng = np.random.default_rng(0)
    failures = 0
    # Small shapes: every rule tile from any length, so that the 192-row kernels run here too.
    tiles.TMA_RULE_TILES = {key: dataclasses.replace(e, min_kv_len=0) for key, e in tiles.TMA_RULE_TILES.items()}
    for variant in tiles.shipped_variants(head_dims=head_dims, families=families):
        os.environ["OMNICUPY_MMA"] = variant.family  # attention() picks this family's tuned tile
        rule = variant.family == "tma" and variant.br == 192  # the 192-row tile: rule masks or 192-row blocks
        qbs = 192 if rule else 128
        bm, dense = mask_with((variant.causal, variant.partial), rng, args.n, rule, qbs)
        for _ in range(20):  # resample degenerate draws (a random mask without the block type asked for)
            if (bm.features.causal, bm.features.partial) == (variant.causal, variant.partial):
                break
            bm, dense = mask_with((variant.causal, variant.partial), rng, args.n, rule, qbs)
        q, k, v = random_qkv(rng, 1, 2, args.n, variant.head_dim, variant.dtype)
        qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        planned = omnicupy.plan(qd, kd, vd, bm, stages=variant.stages).variant
        if planned != variant:
            print(f"WRONG {variant.name}: the call plans {planned.name}", flush=True)
            failures += 1
            continue
        out = omnicupy.attention(qd, kd, vd, bm, stages=variant.stages)
        failures += report(variant.name, out, reference.attention(q, k, v, dense), variant.dtype)
    for family in families:
        os.environ["OMNICUPY_MMA"] = family
        failures += run_feature_variants(rng, head_dims, args.n, family)
    return 1 if failures else 0


def run_feature_variants(rng, head_dims, n, family) -> int:
    """Bias + score modifier, a fused mask reading a device array, bottom-right causal."""
    import cupy as cp

    from omnicupy import score_mods

    doc = (np.arange(n) // 37).astype(np.int32)
    fused = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", arrays={"doc": doc},
                               numpy_fn=lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k))
    bm_doc = BlockMask.from_mask_mod(fused, None, None, n, n)
    failures = 0
    for hd in head_dims:
        for stages in (1, 2):
            if family in ("wgmma", "tma") and (hd, stages) not in {"wgmma": tiles.WGMMA_TUNED,
                                                                    "tma": tiles.TMA_TUNED}[family]:
                continue
            q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16", Nkv=n + 5)
            bias = rng.standard_normal((1, 2, n, n + 5)).astype(np.float32)
            cases = [
                ("bias+softcap", dict(causal=True, bias=bias, score_mod=score_mods.softcap(5.0)),
                 dict(mask=(np.arange(n)[:, None] >= np.arange(n + 5)[None, :]), bias=bias,
                      score_mod=score_mods.softcap(5.0))),
                ("bottom-right", dict(causal="bottom_right"),
                 dict(mask=(np.arange(n)[:, None] + 5 >= np.arange(n + 5)[None, :]))),
            ]
            for name, kw, ref_kw in cases:
                out = omnicupy.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), stages=stages, **kw)
                failures += report(f"{family} hd{hd} st{stages} {name}", out, reference.attention(q, k, v, **ref_kw), "fp16")
            q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16")
            out = omnicupy.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), bm_doc, stages=stages, fuse_mask=True)
            failures += report(f"{family} hd{hd} st{stages} fused-document", out, reference.attention(q, k, v, fused), "fp16")
    return failures


def report(label, out, want, dtype) -> int:
    import cupy as cp

    cp.cuda.runtime.deviceSynchronize()
    err = reference.relative_error(out.get(), want)
    ok = err <= TOLERANCE[dtype]
    print(f"{label}: err={err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
