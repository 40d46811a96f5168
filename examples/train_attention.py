"""Training with omnicupy: one attention layer fitted by gradient descent, twice.

1. Plain CuPy: the forward (``omnicupy.attention(..., return_lse=True)``), the backward
   (``omnicupy.attention_backward``) and the chain rule through the projections by hand.
2. PyTorch (if installed): ``omnicupy.torch.attention`` inside an ``nn.Module``, trained
   with ``loss.backward()`` and an optimizer; tensors go to omnicupy zero-copy, on torch's stream.

Both learn to reproduce the output of a hidden "teacher" layer under a packed-documents mask
(causal attention inside each document), and print the loss as it falls.

    python examples/train_attention.py

Needs an NVIDIA GPU; without one it says so and exits. Runs in a few seconds.
"""
from __future__ import annotations

import importlib.util

import numpy as np

import omnicupy
from omnicupy import BlockMask, arrays, masks

B, N, C, H, D = 2, 1024, 128, 4, 32  # batch, tokens, model width, heads, head dim
STEPS = 60
DOCS = [300, 200, 124, 400]  # packed documents, 1024 tokens


def split_heads(x, xp):
    """[B, N, H*D] -> a [B, H, N, D] view (strided: no copy)."""
    return x.reshape(B, N, H, D).transpose(0, 2, 1, 3)


def merge_heads(x, xp):
    return xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B, N, H * D)


def with_cupy(bm: BlockMask) -> list[float]:
    """Fit Wq, Wk, Wv of one attention layer to a teacher's output with hand-written backprop."""
    import cupy as cp

    rng = cp.random.default_rng(0)
    x = rng.standard_normal((B, N, C), dtype=cp.float32)
    teacher = [rng.standard_normal((C, H * D), dtype=cp.float32) / np.sqrt(C) for _ in range(3)]
    weights = [rng.standard_normal((C, H * D), dtype=cp.float32) / np.sqrt(C) for _ in range(3)]

    def forward(ws):
        q, k, v = (split_heads(x @ w, cp).astype(cp.float16) for w in ws)
        out, lse = omnicupy.attention(q, k, v, bm, return_lse=True)
        return q, k, v, out, lse

    target = merge_heads(forward(teacher)[3], cp).astype(cp.float32)
    losses, lr = [], 1e-3
    for _ in range(STEPS):
        q, k, v, out, lse = forward(weights)
        diff = merge_heads(out, cp).astype(cp.float32) - target
        losses.append(float((diff ** 2).mean()))
        # The gradient of ½‖diff‖² with respect to out is diff (unscaled, so that it stays well
        # inside fp16's range); then the attention backward and the projections' chain rule.
        dout = split_heads(diff, cp).astype(cp.float16)
        dq, dk, dv = omnicupy.attention_backward(dout, q, k, v, out, lse, bm)
        xt = x.reshape(B * N, C).T
        for w, g in zip(weights, (dq, dk, dv)):
            w -= lr * (xt @ merge_heads(g, cp).astype(cp.float32).reshape(B * N, H * D))
    return losses


def with_torch(bm: BlockMask) -> list[float] | None:
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed, skipped")
        return None
    import torch

    if not torch.cuda.is_available():
        print("torch: installed without CUDA, skipped")
        return None
    from omnicupy.torch import attention

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(C, 3 * H * D, bias=False)
            self.out = torch.nn.Linear(H * D, C, bias=False)

        def forward(self, x):
            q, k, v = (t.reshape(B, N, H, D).transpose(1, 2).half() for t in self.qkv(x).chunk(3, dim=-1))
            o = attention(q, k, v, bm)  # differentiable; zero-copy on torch's current stream
            return self.out(o.transpose(1, 2).reshape(B, N, H * D).float())

    torch.manual_seed(0)
    student, teacher = Layer().cuda(), Layer().cuda()
    x = torch.randn(B, N, C, device="cuda")
    with torch.no_grad():
        target = teacher(x)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(student(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def show(label: str, losses: list[float]) -> None:
    marks = ", ".join(f"{losses[i]:.4f}" for i in range(0, len(losses), max(1, len(losses) // 6)))
    print(f"{label}: loss {marks}, ..., {losses[-1]:.4f} after {len(losses)} steps")


def main() -> int:
    if not arrays.gpu_available():
        # The mask and both plans (forward and backward) need no GPU.
        print("train_attention.py needs an NVIDIA GPU to train; none is usable here. Its mask and plans on sm_90:")
        bm = BlockMask.from_mask_mod(masks.document(masks.doc_ids_from_lengths(DOCS)), None, None, N, N)
        print(f"{bm!r}\n{bm.to_string()}")
        q = np.broadcast_to(np.zeros(D, np.float16), (B, H, N, D))
        print(omnicupy.plan(q, q, q, bm, arch="sm_90"))
        print(omnicupy.ops.backward.plan(q, q, q, bm, arch="sm_90"))
        return 0
    bm = BlockMask.from_mask_mod(masks.document(masks.doc_ids_from_lengths(DOCS)), None, None, N, N)
    print(f"mask: packed documents {DOCS}, {bm!r}")
    results = {"cupy": with_cupy(bm), "torch": with_torch(bm)}
    ok = True
    for label, losses in results.items():
        if losses is None:
            continue
        show(label, losses)
        ok &= bool(np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0])
    print("the loss fell in every run" if ok else "the loss did NOT fall as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
