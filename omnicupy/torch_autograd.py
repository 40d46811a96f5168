"""PyTorch autograd for omnicupy attention: a differentiable ``attention`` on torch tensors.

    import torch
    from omnicupy import BlockMask, masks
    from omnicupy.torch_autograd import attention

    bm = BlockMask.from_mask_mod(masks.sliding_window(256), None, None, N, N)
    out = attention(q, k, v, bm)          # q [B, Hq, N, D], k/v [B, Hkv, N, D], fp16/bf16 CUDA tensors
    out.float().pow(2).mean().backward()  # q.grad, k.grad, v.grad from omnicupy.attention_backward

Tensors reach omnicupy zero-copy through DLPack, and its results come back to torch the same way
(``torch.from_dlpack``), so nothing is copied. Both passes run on torch's current CUDA stream
(wrapped as a CuPy ExternalStream), so they are ordered with the surrounding torch work without
any synchronization. The forward saves ``out`` and the LSE; the backward recomputes P from them.

This is the only omnicupy module that imports torch; ``import omnicupy`` never does.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from . import arrays
from .errors import ArgumentError
from .mask import BlockMask
from .ops.backward import attention_backward
from .ops.forward import attention as _attention


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """CuPy's current device and stream become the tensor's device and torch's current stream there."""
    cp = arrays.cupy_module()
    with cp.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = torch.cuda.current_stream(device)
        with cp.cuda.ExternalStream(stream.cuda_stream):
            yield


def _to_torch(x: Any) -> torch.Tensor:
    return torch.from_dlpack(x)


class _OmnicupyAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, causal, scale, bias, score_mod, deterministic, fuse_mask):
        with _on_torch_stream(q.device):
            out, lse = _attention(q.detach(), k.detach(), v.detach(), block_mask, causal=causal, scale=scale,
                                  return_lse=True, bias=bias, score_mod=score_mod, fuse_mask=fuse_mask)
        out_t, lse_t = _to_torch(out), _to_torch(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.options = (block_mask, causal, scale, bias, score_mod, deterministic, fuse_mask)
        return out_t

    @staticmethod
    def backward(ctx, dout):
        # DLPack refuses tensors that require grad: hand omnicupy detached views (no copies).
        q, k, v, out, lse = (t.detach() for t in ctx.saved_tensors)
        block_mask, causal, scale, bias, score_mod, deterministic, fuse_mask = ctx.options
        dout = dout.detach()
        if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum(): omnicupy wants the last dim contiguous
            dout = dout.contiguous()
        with _on_torch_stream(q.device):
            dq, dk, dv = attention_backward(dout, q, k, v, out, lse, block_mask,
                                            causal=causal, scale=scale, bias=bias, score_mod=score_mod,
                                            deterministic=deterministic, fuse_mask=fuse_mask)
        return _to_torch(dq), _to_torch(dk), _to_torch(dv), None, None, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Optional[BlockMask] = None, *,
              causal: Any = False, scale: Optional[float] = None, bias: Optional[torch.Tensor] = None,
              score_mod: Any = None, deterministic: bool = False, fuse_mask: bool = False) -> torch.Tensor:
    """``omnicupy.attention`` on torch CUDA tensors with a working ``.backward()``.

    Arguments as in ``omnicupy.attention`` / ``attention_backward``: q ``[B, Hq, Nq, D]``, k/v
    ``[B, Hkv, Nkv, D]`` (fp16 or bf16, last dim contiguous, other strides free), an omnicupy
    ``BlockMask`` or ``causal``, ``scale``, ``bias`` (a constant: it gets no gradient, so a bias
    that requires one is refused), ``score_mod`` (with its derivative), ``deterministic`` dQ.
    Returns the output tensor (same dtype as q); gradients flow to q, k and v.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise ArgumentError(f"{name} must be a CUDA torch.Tensor, got {type(x).__name__}"
                                + ("" if not isinstance(x, torch.Tensor) else f" on {x.device}"))
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        raise ArgumentError("bias requires grad, but omnicupy treats bias as a constant (no dbias); "
                            "pass bias.detach() to train without its gradient")
    return _OmnicupyAttention.apply(q, k, v, block_mask, causal, scale, bias, score_mod, deterministic, fuse_mask)


__all__ = ["attention"]
