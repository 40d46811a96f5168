"""Zero-copy interop: the same attention call on CuPy arrays, NumPy arrays and (if installed) PyTorch tensors.

omnicupy takes anything that speaks DLPack or the CUDA array interface and reads it in place: no
copy, whatever the strides, as long as the last dim (head_dim) is contiguous. It returns CuPy arrays
(NumPy for NumPy inputs), and ``torch.from_dlpack(out)`` turns the result into a tensor on the same
memory. PyTorch is optional and only imported when present.

    python examples/zero_copy_interop.py

Needs an NVIDIA GPU; without one it says so and exits. Runs in a few seconds.
"""
from __future__ import annotations

import importlib.util
import sys

import numpy as np

import omnicupy
from omnicupy import arrays, reference

B, N, H, D = 2, 1024, 8, 64


def with_cupy() -> float:
    import cupy as cp

    # Many models keep activations as [B, N, H, D]; the [B, H, N, D] view omnicupy wants is a transpose,
    # which only changes strides.
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, N, H, D), dtype=cp.float32).astype(cp.float16).transpose(0, 2, 1, 3)
               for _ in range(3))
    out = omnicupy.attention(q, k, v, causal=True)
    print(f"cupy:  in {type(q).__name__} {q.shape} strides {q.strides} -> out {type(out).__name__} {out.shape}")
    expected = reference.attention(q.get(), k.get(), v.get(), mask=lambda b, h, i, j: i >= j)
    return reference.relative_error(out, expected)


def with_numpy() -> float:
    # Host arrays work too: copied to the GPU and back, and the result is a NumPy array.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float16) for _ in range(3))
    out = omnicupy.attention(q, k, v)
    print(f"numpy: in {type(q).__name__} -> out {type(out).__name__} {out.shape} {out.dtype}")
    return reference.relative_error(out, reference.attention(q, k, v))


def with_torch() -> float | None:
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed, skipped")
        return None
    import cupy as cp
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("torch: installed without CUDA, skipped")
        return None
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    # Run on PyTorch's current stream, so the call is ordered with the surrounding torch work and no
    # synchronization is needed.
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        out = omnicupy.attention(q, k, v, causal=True)  # a CuPy array
    out_t = torch.from_dlpack(out)  # a tensor on the same memory
    same_input = cp.from_dlpack(q).data.ptr == q.data_ptr()
    same_output = out_t.data_ptr() == out.data.ptr
    print(f"torch: in {tuple(q.shape)} {q.dtype} (zero-copy: {same_input}) -> out {type(out).__name__} "
          f"-> torch.from_dlpack {tuple(out_t.shape)} {out_t.dtype} (zero-copy: {same_output})")
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return float(torch.linalg.norm(out_t.float() - expected) / torch.linalg.norm(expected))


def main() -> int:
    if not arrays.gpu_available():
        # Strided views need no copy: a [B, N, H, D] buffer seen as [B, H, N, D] passes every check
        # and is planned as it is (no GPU needed for either).
        print("zero_copy_interop.py needs an NVIDIA GPU to run; none is usable here. What it checks on the CPU:")
        bnhd = np.zeros((B, N, H, D), np.float16)
        q = bnhd.transpose(0, 2, 1, 3)  # [B, H, N, D] view, strides only
        print(f"[B, N, H, D] buffer viewed as {q.shape}, strides {q.strides} bytes, shares memory: "
              f"{np.shares_memory(q, bnhd)}")
        print(omnicupy.plan(q, q, q, causal=True, arch="sm_90"))
        return 0
    errors = {"cupy fp16": (with_cupy(), 3e-3), "numpy fp16": (with_numpy(), 3e-3)}
    torch_error = with_torch()
    if torch_error is not None:
        errors["torch bf16 vs SDPA"] = (torch_error, 2e-2)
    for name, (error, tolerance) in errors.items():
        print(f"{name}: relative error {error:.2e} (tolerance {tolerance:.0e})")
    return 0 if all(error <= tolerance for error, tolerance in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
