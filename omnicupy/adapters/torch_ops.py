"""omnicupy's torch custom operators (``torch.ops.omnicupy.*``), their fake implementations and
the forward's registered autograd. Needs torch >= 2.4 (``torch.library.custom_op``,
``register_fake``, ``register_autograd``).

    attention_fwd(q, k, v, bias?, spec) -> (out, lse)
    attention_bwd(dout, q, k, v, out, lse, bias?, spec) -> (dq, dk, dv)
    decode(q, k, v, kv_lens?, bias?, spec) -> (out, lse)
    paged(q, k_pages, v_pages, page_table, kv_lens, spec) -> (out, lse)

``spec`` is a key of adapters/specs.py (mask, causal, scale, score modifier, ...). Every output is
allocated here with ``torch.empty*`` on the inputs' device, and every allocation omnicupy makes
inside a steady-state call (workspaces, its own LSE) comes from torch's caching allocator too
(glue.allocating_with; a signature's first call, which fills omnicupy's caches, uses CuPy's pool:
``torch_context``), on torch's current stream (glue.on_stream): no host synchronization and no
memory torch does not know of, so CUDA graphs (``mode="reduce-overhead"``) capture the calls. The
LSE omnicupy returns is copied into the op's own ``lse`` output (``[B, Hq, Nq]`` fp32: a few µs
against the attention's milliseconds), because ``attention()`` takes no LSE buffer.

Knows torch's operator registration and omnicupy's public calls; nothing of kernels.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..errors import ArgumentError
from ..ops.backward import attention_backward
from ..ops.forward import attention as _attention
from ..ops.paged import paged_attention as _paged_attention
from . import glue, specs

Tensor = torch.Tensor


#: Call signatures that ran once: their caches (a mask's device tables, launch orders, the decode's
#: counters) exist, so later calls allocate only transient memory.
_warm: set = set()


def signature(name: str, spec: int, *tensors: Optional[Tensor]) -> tuple:
    """What decides which of omnicupy's caches a call fills: the operator, the options and the
    tensors' device, shapes, strides and dtypes."""
    return (name, spec, *(None if t is None else (t.device, t.dtype, tuple(t.shape), t.stride()) for t in tensors))


@contextlib.contextmanager
def torch_context(device: torch.device, call: tuple) -> Iterator[None]:
    """omnicupy launches on torch's current stream of ``device``. A call signature's first call
    allocates from CuPy's pool: what omnicupy caches then (kept for the process) stays out of
    torch's memory, whose CUDA-graph pools may be rewound under it. Every later call of the
    signature only allocates memory it drops before returning: from torch's caching allocator,
    so that a CUDA graph captures nothing but torch memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)

    def alloc(size: int):
        block = torch.empty(size, dtype=torch.uint8, device=device)
        return block.data_ptr(), block  # the tensor is the owner: freed (stream-ordered) when CuPy drops it

    with glue.on_stream(index, stream.cuda_stream):
        if call not in _warm:
            yield
            _warm.add(call)
            return
        with glue.allocating_with(alloc, index):
            yield


def _cp(x: Optional[Tensor]):
    """A zero-copy CuPy view of a torch tensor (None stays None). Detached: DLPack refuses a
    tensor that requires grad."""
    if x is None:
        return None
    return glue.cupy().from_dlpack(x.detach())


def _lse_like(q: Tensor) -> Tensor:
    B, H, N = q.shape[0], q.shape[1], q.shape[2]
    return torch.empty((B, H, N), dtype=torch.float32, device=q.device)


def _take_lse(lse: Tensor, got) -> None:
    lse.copy_(torch.from_dlpack(got))


# ------------------------------------------------------------------------------ forward
@torch.library.custom_op("omnicupy::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], spec: int) -> tuple[Tensor, Tensor]:
    s = specs.lookup(spec)
    out, lse = torch.empty_like(q), _lse_like(q)
    with torch_context(q.device, signature("fwd", spec, q, k, v, bias)):
        _, got = _attention(_cp(q), _cp(k), _cp(v), s.block_mask, causal=s.causal, scale=s.scale, return_lse=True,
                            out=_cp(out), bias=_cp(bias), score_mod=s.score_mod, fuse_mask=s.fuse_mask)
        _take_lse(lse, got)
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, bias, spec):
    return torch.empty_like(q), _lse_like(q)


# ------------------------------------------------------------------------------ backward
@torch.library.custom_op("omnicupy::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
                  spec: int) -> tuple[Tensor, Tensor, Tensor]:
    s = specs.lookup(spec)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with torch_context(q.device, signature("bwd", spec, dout, q, k, v, out, bias)):
        attention_backward(_cp(dout), _cp(q), _cp(k), _cp(v), _cp(out), _cp(lse), s.block_mask, causal=s.causal,
                           scale=s.scale, bias=_cp(bias), score_mod=s.score_mod, deterministic=s.deterministic,
                           dq=_cp(dq), dk=_cp(dk), dv=_cp(dv), fuse_mask=s.fuse_mask)
    return dq, dk, dv


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, bias, spec):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, spec = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.spec = spec
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Optional[Tensor]):
    q, k, v, out, lse, bias = ctx.saved_tensors
    if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum(): the kernels want rows contiguous
        dout = dout.contiguous()
    dq, dk, dv = torch.ops.omnicupy.attention_bwd(dout, q, k, v, out, lse, bias, ctx.spec)
    return dq, dk, dv, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ decode and paged
@torch.library.custom_op("omnicupy::decode", mutates_args=(), device_types="cuda")
def decode(q: Tensor, k: Tensor, v: Tensor, kv_lens: Optional[Tensor], bias: Optional[Tensor],
           spec: int) -> tuple[Tensor, Tensor]:
    s = specs.lookup(spec)
    out, lse = torch.empty_like(q), _lse_like(q)
    with torch_context(q.device, signature("decode", spec, q, k, v, kv_lens, bias)):
        _, got = _attention(_cp(q), _cp(k), _cp(v), s.block_mask, causal=s.causal, scale=s.scale, return_lse=True,
                            out=_cp(out), bias=_cp(bias), score_mod=s.score_mod, kv_lens=_cp(kv_lens),
                            num_splits=s.num_splits)
        _take_lse(lse, got)
    return out, lse


@decode.register_fake
def _(q, k, v, kv_lens, bias, spec):
    return torch.empty_like(q), _lse_like(q)


@torch.library.custom_op("omnicupy::paged", mutates_args=(), device_types="cuda")
def paged(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, kv_lens: Tensor,
          spec: int) -> tuple[Tensor, Tensor]:
    s = specs.lookup(spec)
    out, lse = torch.empty_like(q), _lse_like(q)
    with torch_context(q.device, signature("paged", spec, q, k_pages, v_pages, page_table, kv_lens)):
        _, got = _paged_attention(_cp(q), _cp(k_pages), _cp(v_pages), _cp(page_table), _cp(kv_lens),
                                  causal=bool(s.causal), window=s.window, scale=s.scale, score_mod=s.score_mod,
                                  return_lse=True, out=_cp(out), layout=s.layout, num_splits=s.num_splits,
                                  validate=s.validate)
        _take_lse(lse, got)
    return out, lse


@paged.register_fake
def _(q, k_pages, v_pages, page_table, kv_lens, spec):
    return torch.empty_like(q), _lse_like(q)


def _no_grad_op(name: str):
    def backward(ctx, *grads):
        raise ArgumentError(f"omnicupy.torch: {name} has no backward (inference only); call it under "
                            "torch.no_grad() or on tensors that do not require grad")
    return backward


decode.register_autograd(_no_grad_op("decode attention"))
paged.register_autograd(_no_grad_op("paged attention"))

__all__ = ["attention_bwd", "attention_fwd", "decode", "paged", "torch_context"]
