"""The forward at D = 64, full, N = 8192 (the 192-row tma tile) of the tree under test and of
omnicupy_base, twice each, for ncu: the A/B's one case outside 3 % (lab/notes/forward.md).

    ncu --kernel-name regex:omni_fwd --section ... python lab/ab/ncu_fwd64.py
"""
import cupy as cp

import omnicupy
import omnicupy_base

rng = cp.random.default_rng(7)
q, k, v = (rng.standard_normal((2, 16, 8192, 64), dtype=cp.float32).astype(cp.float16) for _ in range(3))
for pkg in (omnicupy_base, omnicupy):
    for _ in range(2):
        pkg.attention(q, k, v)
cp.cuda.Device().synchronize()
print("kernels:", omnicupy.plan(q, k, v).kernel, omnicupy_base.plan(q, k, v).kernel)
