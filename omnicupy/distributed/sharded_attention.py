"""Context-parallel attention: forward and backward over a sequence sharded by a Plan.

Knows: the per-rank program (steps.py), the transfers (exchange.py), the merge (merge.py) and
the single-GPU calls ``omnicupy.attention`` and ``omnicupy.attention_backward``. Does not know
how the plan was chosen or how the communicator was set up.

Forward, on each rank: the local queries against the local keys (step 0), then against each
received message; each partial ``(o, lse)`` is merged exactly through the LSEs in float32.

Backward (FlashAttention-2's decomposition): with the global ``out`` and ``lse`` of the local
queries, the gradients of one (queries, message) pair are exactly ``attention_backward`` on that
pair. dQ sums over the messages on this rank; the dK/dV partials of a message go back to its
owner, which sums them (and its own) in float32. K/V are sent again rather than kept from the
forward, so the forward holds no more than two messages at a time.

Inputs are this rank's shards (``shard``): q ``[B, Hq, L, D]``, k/v ``[B, Hkv, L, D]`` with L the
rank's shard length. Score modifiers and biases are not taken: they see positions, and a shard's
positions are not the sequence's.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import arrays
from ..errors import ArgumentError, MaskError
from .comm import Communicator
from .errors import BackwardUnavailableError, DistributedError
from .exchange import KVExchange
from .merge import PartialSum
from .planner import Plan
from .steps import RankProgram, program


# ------------------------------------------------------------------------------ checks
def _shape(x: Any, name: str) -> tuple[int, ...]:
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ArgumentError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(int(n) for n in x.shape)


def _check_dtype(x: Any, name: str) -> None:
    if np.dtype(x.dtype) not in arrays.DTYPE_NAMES:
        raise ArgumentError(f"{name} must be float16 or bfloat16, got {x.dtype}")


def _prepare(plan: Plan, comm: Communicator, q: Any, k: Any, v: Any) -> RankProgram:
    """Every check that needs no GPU, before any transfer: the plan fits the communicator and the
    shards fit the plan."""
    if not isinstance(plan, Plan):
        raise ArgumentError(f"plan must come from omnicupy.distributed.plan(), got {type(plan).__name__}")
    if not isinstance(comm, Communicator):
        raise ArgumentError(f"comm must be an omnicupy.distributed.Communicator (distributed.init()), "
                            f"got {type(comm).__name__}")
    if comm.size != plan.world_size:
        raise DistributedError(f"the plan is for {plan.world_size} ranks but the communicator has {comm.size}")
    qs, ks, vs = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) != 4:
            raise ArgumentError(f"{name} must be a 4-D shard [B, H, L, D], got shape {s}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(x, name)
    if not np.dtype(q.dtype) == np.dtype(k.dtype) == np.dtype(v.dtype):
        raise ArgumentError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if ks != vs:
        raise ArgumentError(f"k and v must have the same shape, got {ks} and {vs}")
    length = plan.local_len(comm.rank)
    if qs[2] != length or ks[2] != length:
        raise ArgumentError(f"rank {comm.rank}'s shards must hold {length} positions (plan.local_len), "
                            f"got q {qs[2]} and k {ks[2]}: shard them with omnicupy.distributed.shard")
    if qs[0] != ks[0] or qs[3] != ks[3]:
        raise ArgumentError(f"q {qs} and k {ks} must agree in batch and head_dim")
    if qs[1] % ks[1]:
        raise ArgumentError(f"q heads ({qs[1]}) must be a multiple of k/v heads ({ks[1]})")
    bm, hm = plan.mask.shape[:2]
    if bm not in (1, qs[0]) or hm not in (1, qs[1]):
        raise MaskError(f"the plan's mask has batch/head dims ({bm}, {hm}); q has ({qs[0]}, {qs[1]})")
    return program(plan, comm.rank)


def _device(x: Any, name: str, comm: Communicator, *, contiguous: bool = False):
    cp = arrays.cupy_module()
    if cp.cuda.runtime.getDevice() != comm.device:
        raise ArgumentError(f"the current device is {cp.cuda.runtime.getDevice()} but the communicator's is "
                            f"{comm.device}: call cupy.cuda.Device({comm.device}).use()")
    d = arrays.to_cupy(x, name)
    if d.device.id != comm.device:
        raise ArgumentError(f"{name} is on device {d.device.id}, the communicator on {comm.device}")
    return cp.ascontiguousarray(d) if contiguous else d


def _host_result(host: bool, *results):
    return tuple(r.get() if host and r is not None else r for r in results)


# ----------------------------------------------------------------------------- forward
def attention(q: Any, k: Any, v: Any, plan: Plan, comm: Communicator, *, scale: Optional[float] = None,
              return_lse: bool = False, stages: Optional[int] = None):
    """Attention of this rank's queries over the whole sharded sequence, under ``plan``'s mask.

    q ``[B, Hq, L, D]`` and k/v ``[B, Hkv, L, D]`` are this rank's shards (``shard(x, plan,
    comm.rank)``), float16 or bfloat16; GQA as in ``omnicupy.attention``. Every rank of ``comm``
    calls this with the same plan. Returns this rank's output shard (and, with ``return_lse``, its
    float32 LSE ``[B, Hq, L]``): ``unshard`` puts them back in sequence order. NumPy shards give
    NumPy results; others CuPy arrays on the current stream."""
    import omnicupy

    prog = _prepare(plan, comm, q, k, v)
    host = arrays.is_numpy(q)
    q = _device(q, "q", comm)
    k, v = _device(k, "k", comm, contiguous=True), _device(v, "v", comm, contiguous=True)
    exchange = KVExchange(comm, prog, k, v)
    parts = PartialSum()
    local = prog.steps[0]
    if local.mask is not None:  # first: argument errors surface before any transfer is posted
        parts.add(*omnicupy.attention(q, k, v, local.mask, scale=scale, return_lse=True, stages=stages))
    exchange.post(1)
    for step in prog.remote_steps:
        exchange.post(step.step + 1)
        if step.recv is None:
            continue
        k_msg, v_msg = exchange.kv(step.step)
        if step.mask is not None:
            parts.add(*omnicupy.attention(q, k_msg, v_msg, step.mask, scale=scale, return_lse=True, stages=stages))
        exchange.done(step.step)
    exchange.finish()
    cp = arrays.cupy_module()
    out, lse = parts.result(q.dtype, tuple(q.shape), tuple(q.shape[:3]), cp)
    out, lse = _host_result(host, out, lse)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------- backward
def backward_function():
    """``omnicupy.attention_backward``, or BackwardUnavailableError when this installation lacks it."""
    import omnicupy

    fn = getattr(omnicupy, "attention_backward", None)
    if fn is None:
        raise BackwardUnavailableError("omnicupy.distributed.attention_backward needs omnicupy.attention_backward "
                                       "(the single-GPU backward), which this installation does not have")
    return fn


def _same_memory(a: Any, b: Any) -> bool:
    return a.data.ptr == b.data.ptr and a.shape == b.shape


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, plan: Plan, comm: Communicator, *,
                       scale: Optional[float] = None, deterministic: bool = False):
    """Gradients ``(dq, dk, dv)`` of this rank's shards, from this rank's ``dout`` and the ``out`` and
    ``lse`` that ``attention(..., return_lse=True)`` returned for them. Every rank calls it with the
    same plan. dK/dV include the contributions of every rank's queries."""
    bwd = backward_function()
    prog = _prepare(plan, comm, q, k, v)
    for name, x in (("dout", dout), ("out", out)):
        if _shape(x, name) != tuple(q.shape):
            raise ArgumentError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    if _shape(lse, "lse") != tuple(q.shape[:3]) or np.dtype(lse.dtype) != np.float32:
        raise ArgumentError(f"lse must be float32 {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    host = arrays.is_numpy(q)
    cp = arrays.cupy_module()
    q, dout, out, lse = (_device(x, n, comm) for x, n in ((q, "q"), (dout, "dout"), (out, "out"), (lse, "lse")))
    k, v = _device(k, "k", comm, contiguous=True), _device(v, "v", comm, contiguous=True)
    options = dict(scale=scale, deterministic=deterministic)
    exchange = KVExchange(comm, prog, k, v, returns=True)
    local = prog.steps[0]
    if local.mask is not None:  # first: argument errors surface before any transfer is posted
        dq0, dk0, dv0 = bwd(dout, q, k, v, out, lse, local.mask, **options)
        dq = dq0.astype(np.float32)
    else:
        dq, dk0, dv0 = cp.zeros(q.shape, dtype=np.float32), None, None
    exchange.post(1)
    for step in prog.remote_steps:
        s = step.step
        exchange.post(s + 1)
        if step.recv is not None:
            k_msg, v_msg = exchange.kv(s)
            dk_msg, dv_msg = exchange.return_buffers(s)
            if step.mask is not None:
                dq_s, dk_s, dv_s = bwd(dout, q, k_msg, v_msg, out, lse, step.mask, dk=dk_msg, dv=dv_msg, **options)
                for got, slot in ((dk_s, dk_msg), (dv_s, dv_msg)):
                    if not _same_memory(got, slot):
                        slot[...] = got
                dq += dq_s.astype(np.float32)
            else:
                dk_msg.fill(0)
                dv_msg.fill(0)
            exchange.done(s)
        exchange.post_return(s)
    exchange.finish()
    dk, dv = exchange.dk, exchange.dv
    if dk0 is not None:
        dk += dk0.astype(np.float32)
        dv += dv0.astype(np.float32)
    dtype = q.dtype
    return _host_result(host, dq.astype(dtype), dk.astype(dtype), dv.astype(dtype))


__all__ = ["attention", "attention_backward", "backward_function"]
