"""Precompile what lab/tools/dec.sh runs, in parallel, for this GPU's arch: the decode tiles (shipped
and the tuning candidates of lab/bench/tune_decode.py), the combines, and the D 64/128 forward
variants the varlen and prefill steps use. Prints one line per failure and a count."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor


def build(args):
    from omnicupy import jit

    variant, arch = args
    try:
        jit.build(variant, arch)
        return None
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on (the step that needs it fails)
        return f"{variant.name}: {type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
    from omnicupy import jit
    from omnicupy.dispatch import tiles
    from omnicupy.dispatch.variant import Variant
    from omnicupy.ops import decode

    arch = jit.device_arch()
    variants = list(decode.shipped_variants(arch))
    for br, warps, stages in ((16, 4, 2), (16, 2, 3), (16, 3, 2), (16, 1, 4), (64, 4, 3), (64, 4, 4), (64, 8, 2)):
        # tune_decode.py's tile candidates
        variants.append(Variant(128, "fp16", br, decode.DECODE_BC, warps, stages, True, False, operation="decode"))
    variants += [v for v in tiles.shipped_variants(head_dims=(64, 128)) if v.runs_on(arch)]
    jobs = min(16, os.cpu_count() or 4)
    with ProcessPoolExecutor(jobs) as pool:
        failures = [f for f in pool.map(build, [(v, arch) for v in variants]) if f]
    for f in failures:
        print("precompile FAILED", f)
    print(f"precompiled {len(variants) - len(failures)} / {len(variants)} variants for {arch} ({jobs} processes)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
