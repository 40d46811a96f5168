"""omnicupy in JAX: ``attention`` usable inside ``jax.jit``, differentiable with ``jax.grad``.

    import jax, omnicupy.jax as oj
    from omnicupy import BlockMask, masks

    bm = BlockMask.from_mask_mod(masks.document(doc_ids), None, None, N, N)
    loss = lambda q, k, v: oj.attention(q, k, v, bm, layout="BNHD").astype(jnp.float32).sum()
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)   # q [B, N, Hq, D], k/v [B, N, Hkv, D]

Mechanism: XLA's typed FFI. ``jax.ffi.ffi_call`` puts a custom call into the program; its target
is a handler that omnicupy registers with ``jax.ffi.register_ffi_target(..., platform="CUDA",
api_version=1)``: a ctypes callback implementing the FFI C ABI (adapters/xla_ffi.py), because
omnicupy has no compiled extension. At each execution XLA hands it the argument and result
buffers, its stream and its allocator; the handler runs omnicupy's forward or backward on them
(adapters/jax_exec.py): zero-copy views, launches on XLA's stream, no host synchronization,
outputs written into XLA's result buffers, workspaces from XLA's allocator. ``jax.custom_vjp``
ties the backward to the forward (the forward keeps out and the LSE as residuals).
The mask, scale and other options are a key of a registry (adapters/specs.py) passed as the
custom call's ``spec`` attribute, fixed when the function is traced.

Why not the alternatives: the legacy custom-call ABI (``void(stream, buffers, opaque, len)``) is
deprecated in JAX and gives no allocator; jaxlib's kernel-call target for compiled GPU kernels
takes a kernel whose arguments are the buffers themselves, while omnicupy's kernels take one
parameter struct that holds the pointers (and, for the TMA kernels, tensor maps encoded from the
pointers), which must be rewritten for every execution; ``pure_callback`` copies through the host.

Per-call host work: the handler's Python (tens of µs) and, for the TMA kernels, tensor-map
encoding whenever XLA hands a buffer at an address not seen before (cached per address; XLA
usually reuses its addresses from step to step). Needs jax >= 0.5 (``jax.ffi`` with ``vmap_method``); tested with
0.10 (CPU) and 0.11 (GPU).

Only this module imports jax; ``import omnicupy`` never does.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Optional

import numpy as np

from .errors import ArgumentError, MissingDependencyError

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test without jax
    raise MissingDependencyError("omnicupy.jax needs JAX with CUDA: pip install 'omnicupy[jax]' "
                                 "(with omnicupy[cuda12] or omnicupy[cuda13])") from exc

if not hasattr(jax, "ffi"):  # pragma: no cover
    raise MissingDependencyError(f"omnicupy.jax needs jax >= 0.5 (jax.ffi), found {jax.__version__}: "
                                 "pip install -U 'omnicupy[jax]'")

from . import arrays
from .adapters import jax_exec, specs, xla_ffi
from .mask import BlockMask
from .ops.forward import resolve_mask
from .ops.inputs import Inputs, check_scale, check_score_mod

LAYOUTS = ("BNHD", "BHND")
DTYPES = (np.dtype(np.float16), arrays.BFLOAT16)
#: How a vmap over a leading axis reaches the handler: every input gets the axis (an unbatched one
#: is broadcast), and the handler folds it into the batch (adapters/jax_exec.bhnd).
VMAP_METHOD = "broadcast_all"

_registered: list = []
_register_lock = threading.Lock()


def register_targets() -> None:
    """Registers the forward and backward handlers with XLA for CUDA (once per process)."""
    with _register_lock:
        if _registered:
            return
        for name, execute in ((jax_exec.FORWARD_TARGET, jax_exec.forward),
                              (jax_exec.BACKWARD_TARGET, jax_exec.backward)):
            callback, capsule = xla_ffi.make_handler(execute)
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", api_version=1)
            _registered.append(callback)  # XLA keeps the address: the callback must outlive every call


def _sizes(q: Any, k: Any, v: Any, layout: str) -> Inputs:
    """Shapes and dtypes checked at trace time; an Inputs without arrays (sizes only)."""
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ArgumentError(f"{name} must be a jax array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ArgumentError(f"{name} must be 4-D [{', '.join(layout)}], got shape {tuple(x.shape)} (vmap over "
                                "a leading axis instead of passing a 5-D array)")
        if np.dtype(x.dtype) not in DTYPES:
            raise ArgumentError(f"{name} must be float16 or bfloat16, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ArgumentError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    bhnd = (lambda s: (s[0], s[2], s[1], s[3])) if layout == "BNHD" else (lambda s: tuple(s))
    (B, Hq, Nq, D), (Bk, Hkv, Nkv, Dk) = bhnd(q.shape), bhnd(k.shape)
    if tuple(k.shape) != tuple(v.shape) or Bk != B or Dk != D:
        raise ArgumentError(f"k and v must have one shape with q's batch and head dim ({layout}): q {tuple(q.shape)}, "
                            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hq % Hkv:
        raise ArgumentError(f"q heads ({Hq}) must be a multiple of kv heads ({Hkv}) (GQA/MQA)")
    return Inputs(None, None, None, "bf16" if np.dtype(q.dtype) == arrays.BFLOAT16 else "fp16", B, Hq, Hkv, Nq, Nkv, D)


def _forward_call(q, k, v, key: int):
    register_targets()
    B_H_N = (q.shape[0], q.shape[2], q.shape[1]) if specs.lookup(key).layout == "BNHD" else q.shape[:3]
    call = jax.ffi.ffi_call(jax_exec.FORWARD_TARGET,
                            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(B_H_N, jnp.float32)),
                            vmap_method=VMAP_METHOD)
    return call(q, k, v, spec=np.int64(key))


def _backward_call(dout, q, k, v, out, lse, key: int):
    register_targets()
    call = jax.ffi.ffi_call(jax_exec.BACKWARD_TARGET,
                            tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
                            vmap_method=VMAP_METHOD)
    return call(dout, q, k, v, out, lse, spec=np.int64(key))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend(q, k, v, key: int):
    return _forward_call(q, k, v, key)[0]


def _attend_fwd(q, k, v, key: int):
    out, lse = _forward_call(q, k, v, key)
    return out, (q, k, v, out, lse)


def _attend_bwd(key: int, residuals, dout):
    q, k, v, out, lse = residuals
    return tuple(_backward_call(dout.astype(q.dtype), q, k, v, out, lse, key))


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend_with_lse(q, k, v, key: int):
    return tuple(_forward_call(q, k, v, key))


def _attend_with_lse_fwd(q, k, v, key: int):
    out, lse = _forward_call(q, k, v, key)
    return (out, lse), (q, k, v, out, lse)


def _attend_with_lse_bwd(key: int, residuals, cotangents):
    dout, _dlse = cotangents  # the LSE gets no gradient (attention() stops it)
    return _attend_bwd(key, residuals, dout)


_attend_with_lse.defvjp(_attend_with_lse_fwd, _attend_with_lse_bwd)


def attention(q: Any, k: Any, v: Any, block_mask: Optional[BlockMask] = None, *, causal: Any = False,
              scale: Optional[float] = None, score_mod: Any = None, layout: str = "BNHD",
              deterministic: bool = False, fuse_mask: bool = False, return_lse: bool = False):
    """omnicupy attention on jax arrays, inside or outside ``jax.jit``; ``jax.grad`` gives dq, dk, dv
    from omnicupy's backward.

    ``layout="BNHD"`` (JAX's usual ``[batch, seq, heads, head_dim]``, as ``jax.nn.dot_product_attention``)
    or ``"BHND"``; k/v have Hkv heads, a divisor of q's (GQA/MQA); fp16 or bf16. ``block_mask`` (an
    omnicupy.BlockMask, fixed at trace time: close over it or pass it as a static argument) or
    ``causal``, ``scale``, ``score_mod`` (with its derivative for the backward), ``deterministic``
    and ``fuse_mask`` as in ``omnicupy.attention``. The output has q's layout and dtype; with
    ``return_lse``, ``(out, lse)``, lse float32 ``[B, Hq, Nq]`` (no gradient flows through it).
    ``jax.vmap`` over a leading axis is supported (folded into the batch; a mask with a batch dim
    of its own then no longer matches, which the call reports)."""
    inp = _sizes(q, k, v, layout)
    bm = resolve_mask(block_mask, causal, inp)  # MaskError / ArgumentError now, not at execution
    check_scale(scale, inp.head_dim)
    check_score_mod(score_mod)
    key = specs.register(specs.CallSpec(block_mask, causal, scale, score_mod, bool(deterministic), bool(fuse_mask),
                                        layout=layout))
    _prepare(bm)
    if return_lse:
        out, lse = _attend_with_lse(q, k, v, key)
        return out, jax.lax.stop_gradient(lse)
    return _attend(q, k, v, key)


def _prepare(bm: BlockMask) -> None:
    """Builds the mask's device metadata now, in CuPy's own pool, when a GPU is here (tracing runs
    on the host: the handler then finds it cached instead of building it inside XLA's call)."""
    if arrays.gpu_available():
        bm.device_metadata()


__all__ = ["LAYOUTS", "attention", "register_targets"]
