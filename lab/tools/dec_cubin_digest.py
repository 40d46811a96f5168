"""Compile check for decode-touching changes (issue 16). Groups (--ops): ``decode``, every shipped
decode and combine variant for sm_80 and sm_90 (the shipped tiles of each arch) and a
score-modifier decode variant per head dim; ``bwd_sync`` and ``bwd_wgmma``, the shipped backward
variants of each family (sm_80 / sm_90a; they share kernels/mma_tiles.cuh's tile products with the
decode). Compiled with NVRTC from the tree this runs in (no GPU needed); writes
{kernel-arch: [sha256 of the cubin, registers, spill bytes]}.

    PYTHONPATH=<tree> python lab/tools/dec_cubin_digest.py OUT.json [--ops decode,bwd_sync,bwd_wgmma] [--workers N]
    python lab/tools/dec_cubin_digest.py --compare BEFORE.json AFTER.json

Run once on the tree before a change and once after; --compare prints which kernels changed code,
registers or spills, and fails when any kernel spills or is missing."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor


def _targets(ops):
    from omnicupy import score_mods
    from omnicupy.dispatch import tiles
    from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS
    from omnicupy.ops import decode

    out = []
    if "decode" in ops:
        for arch in ("sm_80", "sm_90"):
            out += [(v, arch) for v in decode.shipped_variants(arch)]
            out += [(decode.decode_variant(hd, "fp16", 16, causal=True, partial=False,
                                           score_expr=score_mods.softcap(30.0).cuda.key, arch=arch), arch)
                    for hd in SUPPORTED_HEAD_DIMS]
    for family, arch in (("sync", "sm_80"), ("wgmma", "sm_90a")):
        if f"bwd_{family}" in ops:
            out += [(v, arch) for v in tiles.shipped_backward_variants() if v.family == family]
    return out


def _digest(item):
    from omnicupy.jit import env
    from omnicupy.jit.compiler import compile_cubin
    from omnicupy.jit.render import render_source

    variant, arch = item
    result = compile_cubin(render_source(variant), name=variant.name, arch=arch, include_dirs=[env.kernels_dir()])
    return f"{variant.name}-{arch}", hashlib.sha256(result.cubin).hexdigest(), result.registers, result.spill_bytes


def compare(before_path: str, after_path: str) -> int:
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    same = changed = 0
    bad = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            print(f"missing after: {name}")
            continue
        digest, regs, spill = after[name]
        if spill:
            bad.append(f"{name} spills {spill} bytes")
        if name not in before:
            print(f"new: {name} regs {regs} spill {spill}")
            continue
        if before[name][0] == digest:
            same += 1
        else:
            changed += 1
            print(f"changed: {name} regs {before[name][1]} -> {regs}, spill {before[name][2]} -> {spill}")
    print(f"{len(after)} kernels after ({len(before)} before): {same} byte-identical cubins, {changed} changed; "
          f"{len(bad)} spilling")
    for line in bad:
        print("SPILL", line)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--ops", default="decode", help="decode,bwd_sync,bwd_wgmma")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    targets = _targets(args.ops.split(","))
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_digest, targets, chunksize=4))
    with open(args.out, "w") as f:
        json.dump({name: [digest, regs, spill] for name, digest, regs, spill in rows}, f, indent=0, sort_keys=True)
    spills = [name for name, _, _, spill in rows if spill]
    print(f"{len(rows)} kernels -> {args.out}; spilling: {spills or 'none'}")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
