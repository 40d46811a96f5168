"""Context-parallel attention: forward and backward over a sequence sharded by a ShardPlan.

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
from .checks import check_call
from .errors import BackwardUnavailableError, CommunicationError, DistributedError
from . import heads
from .exchange import KVExchange
from .merge import add_sink, merge_into, sink_gradient
from .planner import ShardPlan
from .steps import Part, RankProgram, program


# ------------------------------------------------------------------------------ checks
def _array(x: Any, name: str) -> Any:
    """NumPy and CuPy arrays as they are; DLPack / CUDA-array-interface objects as zero-copy CuPy views."""
    if x is None:
        raise ArgumentError(f"{name} is required")
    if arrays.is_numpy(x) or arrays.is_cupy(x):
        return x
    if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        return arrays.as_array(x, name)
    raise ArgumentError(f"{name} must be a NumPy/CuPy array or a DLPack object, got {type(x).__name__}")


def _shape(x: Any, name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def _check_dtype(x: Any, name: str) -> None:
    if np.dtype(x.dtype) not in arrays.DTYPE_NAMES:
        raise ArgumentError(f"{name} must be float16 or bfloat16, got {x.dtype}")


def _prepare(plan: ShardPlan, comm: Communicator, q: Any, k: Any, v: Any) -> RankProgram:
    """Every check that needs no GPU, before any transfer: the plan fits the communicator and the
    shards (arrays, see ``_array``) fit the plan."""
    if not isinstance(plan, ShardPlan):
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


def _run_guarded(comm: Communicator, timeout: Optional[float], what: str, fn):
    """``fn()`` (which posts transfers), then a bounded host wait for its work (``comm.wait``). Any
    failure once transfers may be posted aborts the communicator, so that this rank never leaves
    peers' operations pending on a live communicator; it is raised as CommunicationError (the cause
    chained) unless it already is one."""
    cp = arrays.cupy_module()
    try:
        result = fn()
        done = cp.cuda.Event(disable_timing=True)
        done.record(cp.cuda.get_current_stream())
    except CommunicationError:
        raise
    except Exception as exc:
        comm.abort()
        raise CommunicationError(f"rank {comm.rank}: {what} failed after its transfers were posted "
                                 f"({type(exc).__name__}: {exc}); the communicator is aborted") from exc
    comm.wait(done, timeout, what)
    return result


def _has_queries(prog: RankProgram) -> bool:
    return any(s.q_send is not None or s.q_recv is not None for s in prog.remote_steps)


def _host_result(host: bool, *results):
    return tuple(r.get() if host and r is not None else r for r in results)


# ------------------------------------------------------------------------------ rows
def _rows(x: Any, part: Part, shard_len: int, *, contiguous: bool = False) -> Any:
    """The part's rows of a shard ``[B, H, L, ...]`` (a view, or a contiguous copy when asked)."""
    if part.q_start == 0 and part.q_len == shard_len:
        return x
    view = x[:, :, part.q_start:part.q_start + part.q_len]
    return arrays.cupy_module().ascontiguousarray(view) if contiguous else view


def _gather_rows(x: Any, runs, length: int) -> Any:
    """float32 compact copy ``[B, H, length, ...]`` of the rows ``runs`` name (local, compact, n)."""
    cp = arrays.cupy_module()
    compact = cp.empty(x.shape[:2] + (length,) + x.shape[3:], dtype=np.float32)
    for local, at, n in runs:
        compact[:, :, at:at + n] = x[:, :, local:local + n]
    return compact


def _scatter_rows(x: Any, compact: Any, runs) -> None:
    """Write the compact float32 rows back into ``x`` (cast to its dtype)."""
    for local, at, n in runs:
        x[:, :, local:local + n] = compact[:, :, at:at + n]


# ----------------------------------------------------------------------------- forward
def forward_steps(q: Any, k: Any, v: Any, prog: RankProgram, exchange: Any, *, scale: Optional[float] = None,
                  stages: Optional[int] = None) -> tuple[Any, Any]:
    """The forward's step loop on device shards; ``exchange`` delivers the messages (a KVExchange,
    already started). Returns this rank's (out, lse)."""
    import omnicupy

    cp = arrays.cupy_module()
    local = prog.steps[0].parts
    if local:  # first: argument errors surface before any transfer is posted
        out, lse = omnicupy.attention(q, k, v, local[0].mask, scale=scale, return_lse=True, stages=stages)
    else:
        out = cp.zeros(q.shape, dtype=q.dtype)
        lse = cp.full(q.shape[:3], -np.inf, dtype=np.float32)
    exchange.post(1)
    # Rows that remote parts (or answers to travelling queries) touch are merged in float32.
    acc = _gather_rows(out, prog.touched, prog.touched_len) if prog.touched_len else None
    for step in prog.remote_steps:
        exchange.post(step.step + 1)
        if step.recv is not None:
            k_msg, v_msg = exchange.kv(step.step)
            for part in step.parts:
                o, part_lse = omnicupy.attention(_rows(q, part, prog.local_len), k_msg, v_msg, part.mask, scale=scale,
                                                 return_lse=True, stages=stages)
                merge_into(acc[:, :, part.acc_start:part.acc_start + part.q_len],
                           _rows(lse, part, prog.local_len), o, part_lse, cp)
        if step.q_recv is not None:  # another rank's queries against the local keys: answer (o, lse)
            (q_guest,) = exchange.guest(step.step)
            o, guest_lse = omnicupy.attention(q_guest, k, v, step.guest, scale=scale, return_lse=True, stages=stages)
            o_slot, lse_slot = exchange.answer_buffers(step.step)
            o_slot[...] = o
            lse_slot[...] = guest_lse
        if step.recv is not None or step.q_recv is not None:  # a rank with nothing here records nothing
            exchange.done(step.step)
        exchange.post_return(step.step)
    exchange.finish()
    for step in prog.remote_steps:  # answers to this rank's travelling queries, merged in step order
        if step.q_send is not None:
            o_ans, lse_ans = exchange.answers(step.step)
            for (own, at, n), (slot, _, _) in zip(step.q_send.runs, step.q_send.acc_runs):
                merge_into(acc[:, :, slot:slot + n], lse[:, :, own:own + n], o_ans[:, :, at:at + n],
                           lse_ans[:, :, at:at + n], cp)
    if acc is not None:
        _scatter_rows(out, acc, prog.touched)
    return out, lse


def _sinks(sinks: Any, heads: int, comm: Communicator) -> Any:
    """``sinks`` as a float32 [Hq] array on the communicator's device (None stays None)."""
    if sinks is None:
        return None
    s = _array(sinks, "sinks")
    if tuple(s.shape) != (heads,):
        raise ArgumentError(f"sinks must be one logit per query head, shape ({heads},), got {tuple(s.shape)}")
    return _device(s, "sinks", comm).astype(np.float32)


def attention(q: Any, k: Any, v: Any, plan: ShardPlan, comm: Communicator, *, scale: Optional[float] = None,
              return_lse: bool = False, stages: Optional[int] = None, sinks: Any = None,
              timeout: Optional[float] = None):
    """Attention of this rank's queries over the whole sharded sequence, under ``plan``'s mask.

    q ``[B, Hq, L, D]`` and k/v ``[B, Hkv, L, D]`` are this rank's shards (``shard(x, plan,
    comm.rank)``), float16 or bfloat16; GQA as in ``omnicupy.attention``. Every rank of ``comm``
    calls this with the same plan. Returns this rank's output shard (and, with ``return_lse``, its
    float32 LSE ``[B, Hq, L]``): ``unshard`` puts them back in sequence order. NumPy shards give
    NumPy results; others CuPy arrays on the current stream. ``sinks`` (float32 [Hq]): a logit per
    query head that joins every row's normalizer once (the returned LSE includes it). ``timeout``
    (seconds; default ``comm.timeout_s``, 0: return without waiting): the host waits that long at
    most for the call's work, then aborts the communicator and raises CommunicationTimeoutError;
    any other failure after transfers are posted aborts it and raises CommunicationError."""
    check_call(plan, comm, return_lse=return_lse)
    q, k, v = _array(q, "q"), _array(k, "k"), _array(v, "v")
    prog = _prepare(plan, comm, q, k, v)
    host = arrays.is_numpy(q)
    q = _device(q, "q", comm)
    k, v = _device(k, "k", comm, contiguous=True), _device(v, "v", comm, contiguous=True)
    sinks = _sinks(sinks, q.shape[1], comm)
    comm.check()

    def run():
        if plan.head_parallel > 1:
            return heads.forward(q, k, v, plan, comm, scale=scale, stages=stages)
        exchange = KVExchange(comm, prog, k, v, queries=(q,) if _has_queries(prog) else ())
        return forward_steps(q, k, v, prog, exchange, scale=scale, stages=stages)

    out, lse = _run_guarded(comm, timeout, "distributed.attention", run)
    if sinks is not None:  # once per row, at the row's owner, after every partial is in
        add_sink(out, lse, sinks, arrays.cupy_module())
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


def _message_gradients(bwd, parts, inputs, k_msg, v_msg, dk_msg, dv_msg, dq_acc, length, options) -> None:
    """One message's backward: dK/dV of the message into ``dk_msg``/``dv_msg`` (summed over the
    parts in float32 when there are several), each part's dQ added to its rows of ``dq_acc``."""
    cp = arrays.cupy_module()
    dout, q, out, lse = inputs
    sums = None
    for i, part in enumerate(parts):
        rows = [_rows(x, part, length, contiguous=True) for x in (dout, q, out, lse)]
        single = len(parts) == 1
        dq_p, dk_p, dv_p = bwd(rows[0], rows[1], k_msg, v_msg, rows[2], rows[3], part.mask,
                               dk=dk_msg if single else None, dv=dv_msg if single else None, **options)
        window = dq_acc[:, :, part.acc_start:part.acc_start + part.q_len]
        cp.add(window, dq_p.astype(np.float32), out=window)
        if single:
            for got, slot in ((dk_p, dk_msg), (dv_p, dv_msg)):
                if not _same_memory(got, slot):
                    slot[...] = got
        elif sums is None:
            sums = [dk_p.astype(np.float32), dv_p.astype(np.float32)]
        else:
            sums[0] += dk_p.astype(np.float32)
            sums[1] += dv_p.astype(np.float32)
    if not parts:  # nothing attends to the message here: its owner still expects partials
        dk_msg.fill(0)
        dv_msg.fill(0)
    elif sums is not None:
        dk_msg[...] = sums[0]
        dv_msg[...] = sums[1]


def backward_steps(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, prog: RankProgram, exchange: Any, bwd,
                   options: dict) -> tuple[Any, Any, Any]:
    """The backward's step loop on device shards; ``exchange`` delivers the messages and carries
    the partials back (a KVExchange with ``returns``, already started)."""
    cp = arrays.cupy_module()
    local = prog.steps[0].parts
    if local:  # first: argument errors surface before any transfer is posted
        dq, dk, dv = bwd(dout, q, k, v, out, lse, local[0].mask, **options)
    else:
        dq, dk, dv = (cp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    exchange.post(1)
    dq_acc = _gather_rows(dq, prog.touched, prog.touched_len) if prog.touched_len else None
    # dK/dV of other ranks' travelling queries against the local keys, summed in float32 in step order
    guests = [cp.zeros(x.shape, dtype=np.float32) for x in (k, v)] if prog.hosts_queries else None
    for step in prog.remote_steps:
        s = step.step
        exchange.post(s + 1)
        if step.recv is not None:
            k_msg, v_msg = exchange.kv(s)
            dk_msg, dv_msg = exchange.return_buffers(s)
            _message_gradients(bwd, step.parts, (dout, q, out, lse), k_msg, v_msg, dk_msg, dv_msg, dq_acc,
                               prog.local_len, options)
        if step.q_recv is not None:  # answer dQ; dK/dV stay here
            q_g, dout_g, out_g, lse_g = exchange.guest(s)
            (dq_slot,) = exchange.answer_buffers(s)
            _, dk_g, dv_g = bwd(dout_g, q_g, k, v, out_g, lse_g, step.guest, dq=dq_slot, **options)
            for total, part in zip(guests, (dk_g, dv_g)):
                cp.add(total, part.astype(np.float32), out=total)
        if step.recv is not None or step.q_recv is not None:
            exchange.done(s)
        exchange.post_return(s)
    exchange.finish()
    for step in prog.remote_steps:  # dQ answers to this rank's travelling queries, in step order
        if step.q_send is not None:
            (dq_ans,) = exchange.answers(step.step)
            for (own, at, n), (slot, _, _) in zip(step.q_send.runs, step.q_send.acc_runs):
                window = dq_acc[:, :, slot:slot + n]
                cp.add(window, dq_ans[:, :, at:at + n].astype(np.float32), out=window)
    if dq_acc is not None:
        _scatter_rows(dq, dq_acc, prog.touched)
    for i, (grad, returned) in enumerate(((dk, exchange.dk), (dv, exchange.dv))):
        # own partial + the travelling queries' (step order) + the ones sent back (step order)
        if guests is not None:
            total = guests[i]
            cp.add(total, grad.astype(np.float32), out=total)
            if returned is not None:
                for row, at, n in prog.returned:
                    window = total[:, :, row:row + n]
                    cp.add(window, returned[:, :, at:at + n], out=window)
            grad[...] = total
        elif returned is not None:
            total = _gather_rows(grad, prog.returned, prog.returned_len)
            total += returned
            _scatter_rows(grad, total, prog.returned)
    return dq, dk, dv


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, plan: ShardPlan, comm: Communicator, *,
                       scale: Optional[float] = None, deterministic: bool = False, sinks: Any = None,
                       timeout: Optional[float] = None):
    """Gradients ``(dq, dk, dv)`` of this rank's shards, from this rank's ``dout`` and the ``out`` and
    ``lse`` that ``attention(..., return_lse=True)`` returned for them. Every rank calls it with the
    same plan. dK/dV include the contributions of every rank's queries. Partial gradients are
    always summed in a fixed order (the program's step order, never arrival order), so the result
    does not depend on timing; ``deterministic`` is passed to the single-GPU backward.
    With ``sinks`` (the forward's), returns ``(dq, dk, dv, dsinks)``: the LSE already holds the
    sinks, so dq/dk/dv need nothing more, and dsinks [Hq] is summed over the ranks (all-reduce).
    ``timeout`` and failures as in ``attention``."""
    check_call(plan, comm, deterministic=deterministic)
    bwd = backward_function()
    dout, q, k, v, out, lse = (_array(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                                          (lse, "lse")))
    prog = _prepare(plan, comm, q, k, v)
    for name, x in (("dout", dout), ("out", out)):
        if _shape(x, name) != tuple(q.shape) or np.dtype(x.dtype) != np.dtype(q.dtype):
            raise ArgumentError(f"{name} must have q's shape {tuple(q.shape)} and dtype {q.dtype}, "
                                f"got {tuple(x.shape)} {x.dtype}")
    if _shape(lse, "lse") != tuple(q.shape[:3]) or np.dtype(lse.dtype) != np.float32:
        raise ArgumentError(f"lse must be float32 {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    host = arrays.is_numpy(q)
    q, dout, out, lse = (_device(x, n, comm) for x, n in ((q, "q"), (dout, "dout"), (out, "out"), (lse, "lse")))
    k, v = _device(k, "k", comm, contiguous=True), _device(v, "v", comm, contiguous=True)
    sinks = _sinks(sinks, q.shape[1], comm)
    comm.check()

    def run():
        if plan.head_parallel > 1:
            return heads.backward(dout, q, k, v, out, lse, plan, comm, bwd, dict(scale=scale, deterministic=deterministic))
        exchange = KVExchange(comm, prog, k, v, returns=True,
                              queries=(q, dout, out, lse) if _has_queries(prog) else ())
        return backward_steps(dout, q, k, v, out, lse, prog, exchange, bwd,
                              dict(scale=scale, deterministic=deterministic))

    grads = _run_guarded(comm, timeout, "distributed.attention_backward", run)
    if sinks is not None:
        dsinks = arrays.cupy_module().ascontiguousarray(sink_gradient(dout, out, lse, sinks, arrays.cupy_module()))
        grads = (*grads, comm.all_reduce(dsinks, "sum"))
    return _host_result(host, *grads)


__all__ = ["attention", "attention_backward", "backward_function", "forward_steps", "backward_steps"]
