"""Head parallelism (Ulysses-style): one all-to-all gives each rank the whole sequence for a group of
heads, the single-GPU kernels run on it, and a second all-to-all brings the outputs back.

Knows: a ShardPlan's runs (which positions each rank's shard holds), a Communicator's grouped
sends and receives, and ``omnicupy.attention`` / ``attention_backward``. Does not know the sequence
plan's steps: a plan whose ``head_parallel`` equals the world size is executed here instead
(sharded_attention.py dispatches).

Rank p computes query heads ``[p Hq / W, (p + 1) Hq / W)`` and kv heads ``[p Hkv / W, ...)``; W
must divide Hkv (a kv head is never split, so GQA groups stay whole; the planner checks it). The
mask must broadcast over heads (one row of metadata for every head). Inputs and outputs are the
same shards as the sequence plan's, so the two are interchangeable for the caller. The backward
sends Q, K, V again (the API keeps no state between calls), dO, O and the LSE, and returns dQ,
dK, dV. Bytes: ``ShardPlan.bytes_sent`` counts exactly these messages (planner.head_bytes_sent).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import arrays
from ..errors import MaskError
from .comm import Communicator
from .planner import ShardPlan


def head_slice(heads: int, world: int, rank: int) -> slice:
    per = heads // world
    return slice(rank * per, (rank + 1) * per)


def _to_heads(plan: ShardPlan, comm: Communicator, shards: list, stream: Any) -> list:
    """Each shard ``[B, H, L, ...]`` (all heads, this rank's positions) -> ``[B, H / W, N, ...]``
    (this rank's heads, every position in sequence order), with one grouped exchange."""
    cp = arrays.cupy_module()
    world, me = plan.world_size, comm.rank
    outs, sends, recvs, places = [], [], [], []
    for x in shards:
        heads = x.shape[1]
        whole = cp.empty(x.shape[:1] + (heads // world, plan.seq_len) + x.shape[3:], dtype=x.dtype)
        outs.append(whole)
        for p in range(world):
            piece = cp.ascontiguousarray(x[:, head_slice(heads, world, p)])
            if p == me:
                _place(whole, piece, plan.runs(me))
                continue
            sends.append((piece, p))
            buf = cp.empty(x.shape[:1] + (heads // world, plan.local_len(p)) + x.shape[3:], dtype=x.dtype)
            recvs.append((buf, p))
            places.append((whole, buf, p))
    comm.exchange(sends, recvs, stream)
    for whole, buf, p in places:
        _place(whole, buf, plan.runs(p))
    return outs


def _place(whole: Any, shard: Any, runs) -> None:
    for start, local, n in runs:
        whole[:, :, start:start + n] = shard[:, :, local:local + n]


def _to_shards(plan: ShardPlan, comm: Communicator, wholes: list, stream: Any) -> list:
    """The inverse of ``_to_heads``: ``[B, H / W, N, ...]`` -> ``[B, H, L, ...]`` of this rank."""
    cp = arrays.cupy_module()
    world, me = plan.world_size, comm.rank
    mine = plan.local_len(me)
    outs, sends, recvs, places = [], [], [], []
    for whole in wholes:
        per = whole.shape[1]
        shard = cp.empty(whole.shape[:1] + (per * world, mine) + whole.shape[3:], dtype=whole.dtype)
        outs.append(shard)
        for p in range(world):
            piece = cp.concatenate([whole[:, :, s:s + n] for s, _, n in plan.runs(p)], axis=2)
            if p == me:
                shard[:, p * per:(p + 1) * per] = piece
                continue
            sends.append((cp.ascontiguousarray(piece), p))
            buf = cp.empty(whole.shape[:1] + (per, mine) + whole.shape[3:], dtype=whole.dtype)
            recvs.append((buf, p))
            places.append((shard, buf, p, per))
    comm.exchange(sends, recvs, stream)
    for shard, buf, p, per in places:
        shard[:, p * per:(p + 1) * per] = buf
    return outs


def check(plan: ShardPlan, q_heads: int, kv_heads: int) -> None:
    if kv_heads % plan.world_size or q_heads % plan.world_size:
        raise MaskError(f"head parallelism over {plan.world_size} ranks needs head counts it divides, got "
                        f"{q_heads} query and {kv_heads} kv heads")
    if plan.mask.shape[1] != 1:
        raise MaskError("head parallelism needs a mask shared by every head (head dim 1)")


def forward(q: Any, k: Any, v: Any, plan: ShardPlan, comm: Communicator, *, scale: Optional[float] = None,
            stages: Optional[int] = None) -> tuple[Any, Any]:
    """(out, lse) shards of this rank through two all-to-alls over heads."""
    import omnicupy

    cp = arrays.cupy_module()
    check(plan, q.shape[1], k.shape[1])
    stream = cp.cuda.get_current_stream()
    qh, kh, vh = _to_heads(plan, comm, [q, k, v], stream)
    out, lse = omnicupy.attention(qh, kh, vh, plan.mask, scale=scale, return_lse=True, stages=stages)
    out_r, lse_r = _to_shards(plan, comm, [out, cp.ascontiguousarray(lse)], stream)
    return out_r, lse_r


def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, plan: ShardPlan, comm: Communicator, bwd,
             options: dict) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) shards of this rank through two all-to-alls over heads."""
    cp = arrays.cupy_module()
    check(plan, q.shape[1], k.shape[1])
    stream = cp.cuda.get_current_stream()
    dh, qh, kh, vh, oh, lh = _to_heads(plan, comm, [dout, q, k, v, out, cp.ascontiguousarray(lse)], stream)
    dq, dk, dv = bwd(dh, qh, kh, vh, oh, lh, plan.mask, **options)
    return tuple(_to_shards(plan, comm, [dq, dk, dv], stream))


__all__ = ["forward", "backward", "head_slice", "check"]
