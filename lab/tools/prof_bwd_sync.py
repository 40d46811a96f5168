"""One mma.sync backward and one SDPA flash (FA2) backward on the same inputs, for ncu (GPU, torch).

    ncu --clock-control none -k "regex:omni_bwd_fp16_hd128_br64_bc128_w8_st2_qp2$|flash_bwd_dq_dk_dv" -c 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --csv --page details \\
        python3 lab/tools/prof_bwd_sync.py 128

fp16, B 2, H 16, N 8192, full mask, head dim from argv (64 or 128). lab/notes/backward.md#s39 and
lab/results/ncu_bwd_sync_vs_fa2_h200.txt read its profile; lab/notes/backward.md#s40 and
lab/results/ncu_bwd_sync_vs_fa2_h200_2107.txt the two-part kernels' (kernel names ending in _qp2).
"""
import os
import sys

os.environ["OMNICUPY_BWD"] = "sync"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy as cp  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import omnicupy  # noqa: E402


def main() -> None:
    B, H, N = 2, 16, 8192
    D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    out, lse = omnicupy.attention(q, k, v, return_lse=True)
    omnicupy.attention_backward(do, q, k, v, out, lse)
    cp.cuda.Device().synchronize()
    tq, tk, tv = (torch.from_dlpack(x).clone().requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(torch.from_dlpack(do).clone())
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
