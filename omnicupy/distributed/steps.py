"""What one rank does for one plan: the messages it sends and receives at each step, where their
tokens sit in the shards, and the sub-mask it computes each received message with.

Knows: the Plan (planner.py) and how to slice its BlockMask (submask.py). Does not know: GPUs or
NCCL; everything is host data, built once per (plan, rank) and cached on the plan, so the CPU
tests can replay a whole distributed call with NumPy.

A message is a rank's shard restricted to some units, laid end to end in increasing position: its
``runs`` say which slice of the owner's shard lands where in the message. The owner copies those
runs into the message (or sends its K/V as they are when the message is its whole shard), the
receiver computes its queries against the message, and in the backward pass sends the message's
dK/dV partials back, which the owner adds at the same runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..block_mask import BlockMask
from ..errors import ArgumentError
from .planner import Plan
from .submask import submask


@dataclass(frozen=True)
class Message:
    """One step's message: ``units`` of the owner's shard, ``length`` tokens; ``runs`` holds
    (offset in the owner's shard, offset in the message, length) of each contiguous piece."""

    step: int
    owner: int
    units: np.ndarray
    length: int
    runs: tuple[tuple[int, int, int], ...]
    whole_shard: bool  # the message is the owner's shard as it is: no copy needed


@dataclass(frozen=True)
class Step:
    """Step ``step``: send ``send`` to rank ``(rank + step) % W``, receive ``recv`` from rank
    ``(rank - step) % W`` and compute the local queries against it under ``mask`` (None: nothing)."""

    step: int
    dst: int
    src: int
    send: Optional[Message]
    recv: Optional[Message]
    mask: Optional[BlockMask]


@dataclass(frozen=True)
class RankProgram:
    """Everything rank ``rank`` does under ``plan``; ``steps[0]`` is the local step (no messages)."""

    rank: int
    world_size: int
    schedule: str
    local_len: int
    shard_lens: tuple[int, ...]  # every rank's shard length (the all-gather pads to the longest)
    steps: tuple[Step, ...]

    @property
    def remote_steps(self) -> tuple[Step, ...]:
        return self.steps[1:]

    @property
    def max_recv_len(self) -> int:
        return max((s.recv.length for s in self.remote_steps if s.recv), default=0)

    @property
    def max_send_len(self) -> int:
        return max((s.send.length for s in self.remote_steps if s.send), default=0)

    @property
    def max_packed_send_len(self) -> int:
        """Longest message that must be copied into a buffer before sending."""
        return max((s.send.length for s in self.remote_steps if s.send and not s.send.whole_shard), default=0)


def _message(plan: Plan, step: int, owner: int, units: np.ndarray) -> Optional[Message]:
    if not units.size:
        return None
    own = plan.rank_units(owner)
    # Offsets of the owner's units in its shard, then the runs of the message's units.
    shard_start = np.concatenate([[0], np.cumsum(plan.unit_tokens[own])])
    where = np.searchsorted(own, units)
    starts = np.zeros(plan.num_units + 1, dtype=np.int64)
    starts[own] = shard_start[:-1]
    runs, offset = [], 0
    # Consecutive units of the message that are also consecutive in the owner's shard form a run.
    breaks = np.flatnonzero(np.diff(where) != 1) + 1
    for group in np.split(units, breaks):
        length = int(plan.unit_tokens[group].sum())
        runs.append((int(starts[group[0]]), offset, length))
        offset += length
    whole = len(runs) == 1 and runs[0][0] == 0 and offset == int(shard_start[-1])
    return Message(step, owner, units, offset, tuple(runs), whole)


def build(plan: Plan, rank: int) -> RankProgram:
    """The program of ``rank`` (uncached; ``program`` caches it on the plan)."""
    world = plan.world_size
    own = plan.rank_units(rank)
    steps = [Step(0, rank, rank, None, None, submask(plan.mask, own, own, plan.unit))]
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        send = _message(plan, s, rank, plan.send_units(rank, s))
        recv = _message(plan, s, src, plan.recv_units(rank, s))
        mask = None if recv is None else submask(plan.mask, own, recv.units, plan.unit)
        steps.append(Step(s, dst, src, send, recv, mask))
    return RankProgram(rank, world, plan.schedule, plan.local_len(rank),
                       tuple(plan.local_len(r) for r in range(world)), tuple(steps))


def program(plan: Plan, rank: int) -> RankProgram:
    """The program of ``rank``, built on first use and cached on the plan."""
    if plan.mask is None:
        raise ArgumentError("this plan carries no BlockMask; build it with omnicupy.distributed.plan(block_mask, ...)")
    key = ("program", plan._check_rank(rank))
    if key not in plan._cache:
        plan._cache[key] = build(plan, rank)
    return plan._cache[key]


__all__ = ["Message", "Step", "RankProgram", "program", "build"]
