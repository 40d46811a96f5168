"""Move arrays between sequence order and a plan's shards: ``shard``, ``unshard`` (NCCL all-gather)
and ``gather_shards`` (on one process, from every rank's shard; for tests and examples).

Knows: a ShardPlan's runs (which positions each rank owns, in which order). Does not know attention.
The sequence axis is ``axis`` (2 for ``[B, H, N, D]`` and for an LSE ``[B, H, N]``).
"""
from __future__ import annotations

from typing import Any, Sequence


from .. import arrays
from ..errors import ArgumentError
from .checks import check_shard_args, check_shards
from .comm import Communicator
from .planner import ShardPlan


def _axis(x: Any, axis: int) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ArgumentError(f"axis {axis} is outside an array of {x.ndim} dims")
    return axis % x.ndim


def _take(x: Any, axis: int, start: int, length: int) -> Any:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


def shard(x: Any, plan: ShardPlan, rank: int, axis: int = 2) -> Any:
    """Rank's shard of ``x`` (the whole sequence along ``axis``): its positions in shard order, as a
    new contiguous array of the same module (NumPy or CuPy)."""
    check_shard_args(x, plan, rank=rank, axis=axis)
    xp = arrays.array_namespace(x)
    axis = _axis(x, axis)
    if x.shape[axis] != plan.seq_len:
        raise ArgumentError(f"x has {x.shape[axis]} positions along axis {axis}; the plan has {plan.seq_len}")
    pieces = [_take(x, axis, start, n) for start, _, n in plan.runs(rank)]
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))


def _check_shard(x: Any, plan: ShardPlan, rank: int, axis: int) -> None:
    if x.shape[axis] != plan.local_len(rank):
        raise ArgumentError(f"rank {rank}'s shard holds {plan.local_len(rank)} positions, got {x.shape[axis]}")


def gather_shards(shards: Sequence[Any], plan: ShardPlan, axis: int = 2) -> Any:
    """The whole sequence from every rank's shard (``shards[r]`` is rank r's), on this process."""
    check_shards(shards, plan, axis)
    if len(shards) != plan.world_size:
        raise ArgumentError(f"need {plan.world_size} shards, got {len(shards)}")
    first = shards[0]
    xp = arrays.array_namespace(first)
    axis = _axis(first, axis)
    shape = list(first.shape)
    shape[axis] = plan.seq_len
    whole = xp.empty(tuple(shape), dtype=first.dtype)
    for rank, part in enumerate(shards):
        _check_shard(part, plan, rank, axis)
        for start, local, n in plan.runs(rank):
            _take(whole, axis, start, n)[...] = _take(part, axis, local, n)
    return whole


def unshard(x: Any, plan: ShardPlan, comm: Communicator, axis: int = 2) -> Any:
    """The whole sequence on every rank from each rank's shard ``x`` (one NCCL all-gather on the
    current stream; shards are padded to the longest). CuPy in, CuPy out."""
    check_shard_args(x, plan, comm=comm, axis=axis, needs_comm=True)
    cp = arrays.cupy_module()
    x = arrays.to_cupy(x, "x")
    axis = _axis(x, axis)
    _check_shard(x, plan, comm.rank, axis)
    longest = max(plan.local_len(r) for r in range(plan.world_size))
    moved = cp.moveaxis(x, axis, 0)  # the sequence first: a rank's slot is then [longest, ...]
    buffer = cp.empty((plan.world_size, longest) + moved.shape[1:], dtype=x.dtype)
    buffer[comm.rank, : moved.shape[0]] = moved
    comm.all_gather(buffer, cp.cuda.get_current_stream())
    whole = cp.empty((plan.seq_len,) + moved.shape[1:], dtype=x.dtype)
    for rank in range(plan.world_size):
        for start, local, n in plan.runs(rank):
            whole[start:start + n] = buffer[rank, local:local + n]
    return cp.ascontiguousarray(cp.moveaxis(whole, 0, axis))


__all__ = ["shard", "unshard", "gather_shards"]
