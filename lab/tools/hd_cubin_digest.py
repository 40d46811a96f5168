"""Throwaway check for task hd: sha256 of the cubin of every shipped kernel (forward of every
family, backward, decode, combine), compiled with NVRTC from the tree this runs in.

    PYTHONPATH=<tree> python lab/tools/hd_cubin_digest.py OUT.json [N_WORKERS]

Run once on the tree before the padded-head-dim change and once after, then compare the two
files: identical digests prove that the change leaves every existing kernel's code unchanged."""
from __future__ import annotations

import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor


def _targets():
    from omnicupy.cli.catalogue import shipped_variants
    out = []
    for v in shipped_variants(ops=("forward", "backward", "decode")):
        arch = "sm_90a" if v.family in ("wgmma", "tma") else "sm_80"
        out.append((v, arch))
    return out


def _digest(item):
    from omnicupy.jit import env
    from omnicupy.jit.compiler import compile_cubin
    from omnicupy.jit.render import render_source
    variant, arch = item
    result = compile_cubin(render_source(variant), name=variant.name, arch=arch, include_dirs=[env.kernels_dir()])
    return f"{variant.name}-{arch}", hashlib.sha256(result.cubin).hexdigest(), result.spill_bytes


def main() -> None:
    out_path = sys.argv[1]
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    targets = _targets()
    with ProcessPoolExecutor(workers) as pool:
        rows = list(pool.map(_digest, targets, chunksize=4))
    with open(out_path, "w") as f:
        json.dump({name: [digest, spill] for name, digest, spill in rows}, f, indent=0, sort_keys=True)
    print(f"{len(rows)} kernels -> {out_path}")


if __name__ == "__main__":
    main()
