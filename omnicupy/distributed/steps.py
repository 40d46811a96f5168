"""What one rank does for one plan: the messages it sends and receives at each step, where their
tokens sit in the shards, and which of its queries it computes each message with, under which
sub-mask.

Knows: the ShardPlan (planner.py) and how to slice its BlockMask (submask.py). Does not know: GPUs or
NCCL; everything is host data, built once per (plan, rank) and cached on the plan, so the CPU
tests can replay a whole distributed call with NumPy.

A message is a rank's shard restricted to some units, laid end to end in increasing position: its
``runs`` say which slice of the owner's shard lands where in the message. The owner copies those
runs into the message (or sends its K/V as they are when the message is its whole shard), the
receiver computes its queries against the message, and in the backward pass sends the message's
dK/dV partials back, which the owner adds at the same runs.

Rows. The local step computes every local query (its result is the base). A remote step computes
only the queries that attend to the message, as ``parts``: runs of consecutive local units, each
with its own sub-mask, so a sliding window's message costs the window's rows, not the shard's.
The rows some remote step touches (``touched``) are the only ones merged in float32: they get a
compact accumulator, ``acc`` offsets map each part into it. The same for the rows of this rank's
K/V that come back as dK/dV partials (``returned``, with each message's ``acc_runs``).

Travelling queries (routing.py). At step s a rank may also send some of its q units to rank
``(rank + s) % W`` (``q_send``: cut from its shard by runs, like K/V) and receive some of rank
``(rank - s) % W``'s (``q_recv``), which it computes against its whole local K/V under ``guest``
(the sub-mask of those queries against its own units) and answers in the same step: the partial
output and LSE in the forward, the dQ partial in the backward (dK/dV stay). The rows of ``q_send``
are part of ``touched`` (their answers merge into the same float32 accumulator, ``acc_runs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import BlockMask
from ..errors import ArgumentError, InternalError
from .planner import ShardPlan
from .submask import HostMetadata, host_metadata, submask

Run = tuple[int, int, int]  # (offset in a shard or buffer, offset in another, length)


@dataclass(frozen=True)
class Message:
    """One step's message: ``units`` of the owner's shard, ``length`` tokens; ``runs`` holds
    (offset in the owner's shard, offset in the message, length) of each contiguous piece, and
    ``acc_runs`` (offset in the owner's compact dK/dV accumulator, offset in the message, length)."""

    step: int
    owner: int
    units: np.ndarray
    length: int
    runs: tuple[Run, ...]
    whole_shard: bool  # the message is the owner's shard as it is: no copy needed
    acc_runs: tuple[Run, ...] = ()


@dataclass(frozen=True)
class Part:
    """Local queries ``[q_start, q_start + q_len)`` against one step's keys under ``mask``;
    ``acc_start`` is where those rows sit in the compact accumulator (-1 for the local step)."""

    q_start: int
    q_len: int
    mask: BlockMask
    acc_start: int = -1


@dataclass(frozen=True)
class Step:
    """Step ``step``: send ``send`` to rank ``(rank + step) % W``, receive ``recv`` from rank
    ``(rank - step) % W`` and compute ``parts`` of the local queries against it (none: nothing).
    Queries: send ``q_send`` to the same ``dst``; compute ``q_recv`` from ``src`` against the local
    keys under ``guest`` and answer ``src``."""

    step: int
    dst: int
    src: int
    send: Optional[Message]
    recv: Optional[Message]
    parts: tuple[Part, ...]
    q_send: Optional[Message] = None
    q_recv: Optional[Message] = None
    guest: Optional[BlockMask] = None


@dataclass(frozen=True)
class RankProgram:
    """Everything rank ``rank`` does under ``plan``; ``steps[0]`` is the local step (no messages).

    ``touched``: (local offset, accumulator offset, length) of the rows some remote part computes;
    ``returned``: the same for the rows of this rank's K/V whose partials come back."""

    rank: int
    world_size: int
    schedule: str
    local_len: int
    shard_lens: tuple[int, ...]  # every rank's shard length (the all-gather pads to the longest)
    steps: tuple[Step, ...]
    touched: tuple[Run, ...]
    returned: tuple[Run, ...]

    @property
    def remote_steps(self) -> tuple[Step, ...]:
        return self.steps[1:]

    @property
    def touched_len(self) -> int:
        return sum(n for _, _, n in self.touched)

    @property
    def returned_len(self) -> int:
        return sum(n for _, _, n in self.returned)

    @property
    def max_recv_len(self) -> int:
        return max((s.recv.length for s in self.remote_steps if s.recv), default=0)

    @property
    def max_send_len(self) -> int:
        return max((s.send.length for s in self.remote_steps if s.send), default=0)

    @property
    def max_q_recv_len(self) -> int:
        return max((s.q_recv.length for s in self.remote_steps if s.q_recv), default=0)

    @property
    def q_sent_len(self) -> int:
        """Rows of this rank's queries that travel, summed over the steps (one answer buffer each)."""
        return sum(s.q_send.length for s in self.remote_steps if s.q_send)

    @property
    def hosts_queries(self) -> bool:
        return any(s.q_recv is not None for s in self.remote_steps)

    @property
    def max_packed_send_len(self) -> int:
        """Longest message that must be copied into a buffer before sending."""
        return max((s.send.length for s in self.remote_steps if s.send and not s.send.whole_shard), default=0)


# ------------------------------------------------------------------------------ helpers
def _shard_offsets(plan: ShardPlan, owner: int) -> np.ndarray:
    """[U] offset of each of ``owner``'s units in its shard (other units: -1)."""
    offsets = np.full(plan.num_units, -1, dtype=np.int64)
    own = plan.rank_units(owner)
    offsets[own] = np.concatenate([[0], np.cumsum(plan.unit_tokens[own])[:-1]])
    return offsets


def _runs_of(units: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> tuple[Run, ...]:
    """Runs (shard offset, offset in the concatenation, length) of ``units`` laid end to end;
    ``offsets[u]`` is unit u's offset in the shard, and units adjacent there merge into one run."""
    runs, at = [], 0
    breaks = np.flatnonzero(offsets[units[1:]] != offsets[units[:-1]] + tokens[units[:-1]]) + 1
    for group in np.split(units, breaks):
        length = int(tokens[group].sum())
        runs.append((int(offsets[group[0]]), at, length))
        at += length
    return tuple(runs)


def _union(ranges: list[tuple[int, int]]) -> tuple[Run, ...]:
    """Disjoint sorted runs (start, compact offset, length) covering the given [start, end) ranges."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    runs, offset = [], 0
    for start, end in merged:
        runs.append((start, offset, end - start))
        offset += end - start
    return tuple(runs)


def _compact(runs: tuple[Run, ...], start: int) -> int:
    """Compact offset of local position ``start``, which lies inside one of ``runs``."""
    for local, acc, n in runs:
        if local <= start < local + n:
            return acc + start - local
    raise InternalError(f"position {start} is in no run")  # the runs are built to cover it


def _with_acc_runs(message: Message, compact: tuple[Run, ...]) -> Message:
    """``message`` with the offsets of its runs in the compact buffer that ``compact`` describes."""
    acc_runs = tuple((_compact(compact, o), at, n) for o, at, n in message.runs)
    return Message(message.step, message.owner, message.units, message.length, message.runs, message.whole_shard,
                   acc_runs)


def _message(plan: ShardPlan, step: int, owner: int, units: np.ndarray) -> Optional[Message]:
    if not units.size:
        return None
    runs = _runs_of(units, _shard_offsets(plan, owner), plan.unit_tokens)
    length = sum(n for _, _, n in runs)
    whole = len(runs) == 1 and runs[0][0] == 0 and length == plan.local_len(owner)
    return Message(step, owner, units, length, runs, whole)


def _host(plan: ShardPlan) -> HostMetadata:
    """The plan's mask metadata on the host, fetched once per plan."""
    if "host" not in plan._cache:
        plan._cache["host"] = host_metadata(plan.mask)
    return plan._cache["host"]


def _parts(plan: ShardPlan, own: np.ndarray, kv_units: np.ndarray, src: int) -> list[tuple[int, int, BlockMask]]:
    """(q start, q length, sub-mask) of each run of consecutive local units that attends to
    ``kv_units`` (rank ``src``'s), leaving out the units whose queries travel to ``src`` instead."""
    whole = submask(plan.mask, own, kv_units, plan.unit, _host(plan))
    if whole is None:
        return []
    counts = np.asarray(whole.kv_num_blocks).reshape(-1, whole.num_q_blocks).max(axis=0)
    active_blocks = np.flatnonzero(counts > 0)
    active = np.unique(active_blocks * plan.q_block_size // plan.unit)  # local unit indices
    if plan.moved is not None:
        active = active[~plan.moved[own[active], src]]
    if not active.size:
        return []
    starts = np.concatenate([[0], np.cumsum(plan.unit_tokens[own])])
    parts = []
    for group in np.split(active, np.flatnonzero(np.diff(active) != 1) + 1):
        lo, hi = int(group[0]), int(group[-1]) + 1
        mask = whole if (lo, hi) == (0, len(own)) else submask(plan.mask, own[lo:hi], kv_units, plan.unit, _host(plan))
        parts.append((int(starts[lo]), int(starts[hi] - starts[lo]), mask))
    return parts


def build(plan: ShardPlan, rank: int) -> RankProgram:
    """The program of ``rank`` (uncached; ``program`` caches it on the plan)."""
    world = plan.world_size
    own = plan.rank_units(rank)
    local_len = plan.local_len(rank)
    local = submask(plan.mask, own, own, plan.unit, _host(plan))
    raw, queries = [], []
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        send = _message(plan, s, rank, plan.send_units(rank, s))
        recv = _message(plan, s, src, plan.recv_units(rank, s))
        raw.append((s, dst, src, send, recv, [] if recv is None else _parts(plan, own, recv.units, src)))
        q_send = _message(plan, s, rank, plan.q_send_units(rank, s))
        q_recv = _message(plan, s, src, plan.q_recv_units(rank, s))
        guest = None if q_recv is None else submask(plan.mask, q_recv.units, own, plan.unit, _host(plan))
        queries.append((q_send, q_recv, guest))
    touched = _union([(a, a + n) for *_, parts in raw for a, n, _ in parts]
                     + [(o, o + n) for q_send, _, _ in queries if q_send for o, _, n in q_send.runs])
    returned = _union([(o, o + n) for _, _, _, send, _, _ in raw if send for o, _, n in send.runs])
    steps = [Step(0, rank, rank, None, None, () if local is None else (Part(0, local_len, local),))]
    for (s, dst, src, send, recv, parts), (q_send, q_recv, guest) in zip(raw, queries):
        if send is not None:
            send = _with_acc_runs(send, returned)
        if q_send is not None:
            q_send = _with_acc_runs(q_send, touched)
        steps.append(Step(s, dst, src, send, recv, tuple(Part(a, n, m, _compact(touched, a)) for a, n, m in parts),
                          q_send, q_recv, guest))
    return RankProgram(rank, world, plan.schedule, local_len, tuple(plan.local_len(r) for r in range(world)),
                       tuple(steps), touched, returned)


def program(plan: ShardPlan, rank: int) -> RankProgram:
    """The program of ``rank``, built on first use and cached on the plan."""
    if plan.mask is None:
        raise ArgumentError("this plan carries no BlockMask; build it with omnicupy.distributed.plan(block_mask, ...)")
    key = ("program", plan._check_rank(rank))
    if key not in plan._cache:
        plan._cache[key] = build(plan, rank)
    return plan._cache[key]


__all__ = ["Message", "Part", "Step", "RankProgram", "program", "build"]
