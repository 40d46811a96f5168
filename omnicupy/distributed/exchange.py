"""The K/V messages of one distributed call, moved on the communicator's stream while the caller's
stream computes: buffers, events and the order in which transfers are posted.

Knows: a RankProgram (steps.py) and a Communicator (comm.py). Does not know attention: the
caller computes and says when it is done with a message (``done``) or has written the dK/dV
partials of one (``post_return``).

Streams. The caller's current stream is the compute stream; transfers (and the copies and
additions that belong to them) run on ``comm.stream``. Dependencies are events, never host waits:
- the transfer stream starts after the inputs are ready (an event recorded at construction);
- the compute of step s waits for step s's receive (``kv``);
- two receive slots alternate (one when a single message arrives): the receive of step s + 2
  waits until the compute of step s has read its slot (``done``); the same for the slots the
  backward's partials are written to;
- ``finish`` makes the compute stream wait for every transfer, so buffers are freed (to the
  compute stream's memory pool, where they were allocated) only after their last use.

Order. Every rank posts the same sequence of labels (K/V of step 1, then per step s the K/V of
step s + 1 and the return of step s), skipping its empty halves; the peer of each half posts the
matching half under the same label, so NCCL's in-order matching per pair of ranks never blocks.
The all-gather schedule replaces the K/V transfers by one all-gather posted at step 1.

Travelling queries (steps.py's ``q_send``/``q_recv``) ride in the same groups: the K/V group of
step s also carries this rank's queries for rank r + s (packed from the shard's runs: Q, and in
the backward dO and O, plus the float32 LSE) and receives rank r - s's; the return group of step
s sends the answer to r - s (partial O and LSE, or the dQ partial) and receives the answer for
the queries sent at step s into a buffer of its own per step, which the caller merges after
``finish`` in step order (a fixed order: deterministic). The forward posts return groups too.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import arrays
from .comm import Communicator
from .steps import RankProgram


def _event(stream: Any) -> Any:
    cp = arrays.cupy_module()
    event = cp.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


class KVExchange:
    """K/V circulation (and, with ``returns``, the return of dK/dV partials) for one call.

    ``k``/``v``: this rank's contiguous shards ``[B, Hkv, L, D]`` on the communicator's device."""

    def __init__(self, comm: Communicator, prog: RankProgram, k: Any, v: Any, *, returns: bool = False,
                 queries: tuple = ()) -> None:
        cp = arrays.cupy_module()
        self.comm, self.prog, self.k, self.v = comm, prog, k, v
        self.compute = cp.cuda.get_current_stream()
        self.stream = comm.stream
        batch, kv_heads, _, head_dim = k.shape
        self._rows = (batch, kv_heads)
        self._head_dim = head_dim
        dtype = k.dtype
        # Two slots let step s + 1 arrive while step s computes; one is enough for one message.
        receives = sum(1 for step in prog.remote_steps if step.recv is not None or step.q_recv is not None)
        self._slots = 2 if receives > 1 else 1
        # Every buffer is allocated here, on the compute stream, before the start event below.
        self.gathered = None
        self.recv_slots: list = []
        self.send_buffer = None
        if prog.schedule == "allgather" and prog.world_size > 1:
            longest = max(prog.shard_lens)
            self.gathered = cp.empty((prog.world_size, 2, batch, kv_heads, longest, head_dim), dtype=dtype)
        else:
            if prog.max_recv_len:
                self.recv_slots = [cp.empty(self._elements(prog.max_recv_len), dtype=dtype) for _ in range(self._slots)]
            if prog.max_packed_send_len:
                self.send_buffer = cp.empty(self._elements(prog.max_packed_send_len), dtype=dtype)
        self.returns = returns
        self.dk = self.dv = None
        if returns:
            # Returned partials, summed in float32 on the transfer stream, for the returned rows only.
            if prog.returned_len:
                shape = (batch, kv_heads, prog.returned_len, head_dim)
                self.dk = cp.zeros(shape, dtype=np.float32)
                self.dv = cp.zeros(shape, dtype=np.float32)
            self.return_slots = ([cp.empty(self._elements(prog.max_recv_len), dtype=dtype) for _ in range(self._slots)]
                                 if prog.max_recv_len else [])
            self.returned = (cp.empty(self._elements(prog.max_send_len), dtype=dtype) if prog.max_send_len else None)
        self.queries = QueryBuffers(prog, queries, self._slots, backward=returns) if queries else None
        self._slot_read: list[Optional[Any]] = [None, None]  # compute finished reading receive slot i
        self._return_sent: list[Optional[Any]] = [None, None]  # transfer stream finished sending return slot i
        self._answer_sent: list[Optional[Any]] = [None, None]  # the same for the answer slots
        self._arrived: dict[int, Any] = {}
        self._gather_arrived = None
        self.stream.wait_event(_event(self.compute))

    # ------------------------------------------------------------------ helpers
    def _elements(self, length: int) -> int:
        batch, kv_heads = self._rows
        return 2 * batch * kv_heads * length * self._head_dim

    def _pair(self, flat: Any, length: int) -> Any:
        """``[2, B, Hkv, length, D]`` view at the start of a flat buffer (K at [0], V at [1])."""
        return flat[: self._elements(length)].reshape((2,) + self._rows + (length, self._head_dim))

    def _step(self, s: int):
        return self.prog.steps[s]

    def _slot(self, s: int) -> int:
        return s % self._slots

    # --------------------------------------------------------------- K/V flow
    def post(self, s: int) -> None:
        """Post step s's K/V transfer (nothing for s outside 1..W-1)."""
        if not 1 <= s < self.prog.world_size:
            return
        if self.gathered is not None:
            if s == 1:
                self._post_gather()
            return
        step = self._step(s)
        sends, recvs = [], []
        if step.send is not None:
            if step.send.whole_shard:
                sends = [(self.k, step.dst), (self.v, step.dst)]
            else:
                message = self._pair(self.send_buffer, step.send.length)
                with self.stream:
                    for own, at, n in step.send.runs:
                        message[0, :, :, at:at + n] = self.k[:, :, own:own + n]
                        message[1, :, :, at:at + n] = self.v[:, :, own:own + n]
                sends = [(message[0], step.dst), (message[1], step.dst)]
        slot = self._slot(s)
        if (step.recv is not None or step.q_recv is not None) and self._slot_read[slot] is not None:
            self.stream.wait_event(self._slot_read[slot])
            self._slot_read[slot] = None
        if step.recv is not None:
            message = self._pair(self.recv_slots[slot], step.recv.length)
            recvs = [(message[0], step.src), (message[1], step.src)]
        if self.queries is not None:
            q_sends, q_recvs = self.queries.transfers(step, slot, self.stream)
            sends, recvs = sends + q_sends, recvs + q_recvs
        self.comm.exchange(sends, recvs, self.stream)
        if step.recv is not None or step.q_recv is not None:
            self._arrived[s] = _event(self.stream)

    def _post_gather(self) -> None:
        rank, n = self.prog.rank, self.prog.local_len
        with self.stream:
            self.gathered[rank, 0, :, :, :n] = self.k
            self.gathered[rank, 1, :, :, :n] = self.v
        self.comm.all_gather(self.gathered, self.stream)
        self._gather_arrived = _event(self.stream)

    def kv(self, s: int) -> tuple[Any, Any]:
        """Step s's received K and V ``[B, Hkv, n, D]``; the compute stream waits for them."""
        step = self._step(s)
        if self.gathered is not None:
            if self._gather_arrived is not None:
                self.compute.wait_event(self._gather_arrived)
                self._gather_arrived = None
            n = step.recv.length
            return self.gathered[step.src, 0, :, :, :n], self.gathered[step.src, 1, :, :, :n]
        self._wait_arrival(s)
        message = self._pair(self.recv_slots[self._slot(s)], step.recv.length)
        return message[0], message[1]

    def _wait_arrival(self, s: int) -> None:
        event = self._arrived.pop(s, None)
        if event is not None:
            self.compute.wait_event(event)

    def guest(self, s: int) -> tuple:
        """Step s's received queries: ``(q,)`` in the forward, ``(q, dout, out, lse)`` in the
        backward, each ``[B, Hq, n, ...]``; the compute stream waits for them."""
        self._wait_arrival(s)
        assert self.queries is not None, "no travelling queries in this call"
        return self.queries.received(self._step(s), self._slot(s))

    def answer_buffers(self, s: int) -> tuple:
        """Where the compute stream writes its answer to step s's guests: ``(o, lse)`` forward,
        ``(dq,)`` backward; it first waits until the slot's previous answer has been sent."""
        slot = self._slot(s)
        if self._answer_sent[slot] is not None:
            self.compute.wait_event(self._answer_sent[slot])
            self._answer_sent[slot] = None
        assert self.queries is not None, "no travelling queries in this call"
        return self.queries.answer(self._step(s), slot)

    def answers(self, s: int) -> tuple:
        """The answer for the queries this rank sent at step s (valid after ``finish``)."""
        assert self.queries is not None, "no travelling queries in this call"
        return self.queries.answered[s]

    def done(self, s: int) -> None:
        """The compute stream has enqueued everything that reads step s's K/V."""
        if self.gathered is None:
            self._slot_read[self._slot(s)] = _event(self.compute)

    # ----------------------------------------------------------- dK/dV return
    def return_buffers(self, s: int) -> tuple[Any, Any]:
        """Where the compute stream writes the dK, dV partials of step s's message ``[B, Hkv, n, D]``
        (contiguous); it first waits until the slot's previous return has been sent."""
        slot = self._slot(s)
        if self._return_sent[slot] is not None:
            self.compute.wait_event(self._return_sent[slot])
            self._return_sent[slot] = None
        message = self._pair(self.return_slots[slot], self._step(s).recv.length)
        return message[0], message[1]

    def post_return(self, s: int) -> None:
        """Send step s's partials (written to ``return_buffers(s)``) back to the message's owner and
        receive the partials of what this rank sent at step s, adding them to ``dk``/``dv`` (compact:
        the rows ``prog.returned`` names)."""
        cp = arrays.cupy_module()
        step = self._step(s)
        sends, recvs = [], []
        returns_kv = self.returns
        if step.recv is not None and returns_kv or step.q_recv is not None:
            self.stream.wait_event(_event(self.compute))
        if step.recv is not None and returns_kv:
            partial = self._pair(self.return_slots[self._slot(s)], step.recv.length)
            sends = [(partial[0], step.src), (partial[1], step.src)]
        if step.send is not None and returns_kv:
            back = self._pair(self.returned, step.send.length)
            recvs = [(back[0], step.dst), (back[1], step.dst)]
        q_sends, q_recvs = self.queries.answer_transfers(step, self._slot(s)) if self.queries else ([], [])
        self.comm.exchange(sends + q_sends, recvs + q_recvs, self.stream)
        if sends:
            self._return_sent[self._slot(s)] = _event(self.stream)
        if q_sends:
            self._answer_sent[self._slot(s)] = _event(self.stream)
        if recvs:
            with self.stream:
                for acc, at, n in step.send.acc_runs:
                    for total, part in ((self.dk, back[0]), (self.dv, back[1])):
                        window = total[:, :, acc:acc + n]
                        cp.add(window, part[:, :, at:at + n].astype(np.float32), out=window)

    def finish(self) -> None:
        """The compute stream waits for every transfer posted so far."""
        self.compute.wait_event(_event(self.stream))


class QueryBuffers:
    """The buffers of travelling queries for one call: what this rank packs and sends, the two
    receive slots of guests and of their answers, and one answer buffer per step it sent queries at.
    Buffers are flat; a message of n rows is ``[count, B, Hq, n, D]`` at the start of one, so that
    each of its arrays is contiguous.

    ``queries``: this rank's shards ``(q,)`` (forward) or ``(q, dout, out, lse)`` (backward)."""

    def __init__(self, prog: RankProgram, queries: tuple, slots: int, *, backward: bool) -> None:
        cp = arrays.cupy_module()
        self.prog, self.rows, self.backward = prog, queries[:3] if backward else queries[:1], backward
        self.lse = queries[3] if backward else None
        q = queries[0]
        self.batch, self.heads, _, self.head_dim = (int(n) for n in q.shape)
        self.dtype = q.dtype
        longest_send = max((s.q_send.length for s in prog.remote_steps if s.q_send), default=0)
        longest_recv = prog.max_q_recv_len
        count = len(self.rows)
        self.send_flat = cp.empty(count * self._size(longest_send), dtype=q.dtype)
        self.send_lse = cp.empty(self._size(longest_send, 1), dtype=np.float32) if backward else None
        used = slots if longest_recv else 0
        self.recv_flat = [cp.empty(count * self._size(longest_recv), dtype=q.dtype) for _ in range(used)]
        self.recv_lse = [cp.empty(self._size(longest_recv, 1), dtype=np.float32) for _ in range(used if backward else 0)]
        # Answers: forward (o, lse), backward (dq,), for guests (slots) and for the queries sent (per step).
        self.answer_slots = [self._answer_flats(longest_recv) for _ in range(used)]
        self.answered = {s.step: self._answer(self._answer_flats(s.q_send.length), s.q_send.length)
                         for s in prog.remote_steps if s.q_send}

    def _size(self, length: int, head_dim: Optional[int] = None) -> int:
        return self.batch * self.heads * length * (self.head_dim if head_dim is None else head_dim)

    def _view(self, flat: Any, n: int, count: int = 1, lse: bool = False) -> Any:
        shape = (self.batch, self.heads, n) + (() if lse else (self.head_dim,))
        return flat[: count * self._size(n, 1 if lse else None)].reshape((count,) + shape)

    def _answer_flats(self, length: int) -> tuple:
        cp = arrays.cupy_module()
        rows = cp.empty(self._size(length), dtype=self.dtype)
        return (rows,) if self.backward else (rows, cp.empty(self._size(length, 1), dtype=np.float32))

    def _answer(self, flats: tuple, n: int) -> tuple:
        return (self._view(flats[0], n)[0],) + (() if self.backward else (self._view(flats[1], n, lse=True)[0],))

    def transfers(self, step, slot: int, stream: Any) -> tuple[list, list]:
        """(sends, receives) of step's queries; packs this rank's rows on ``stream`` first."""
        sends, recvs = [], []
        if step.q_send is not None:
            n = step.q_send.length
            packed = self._view(self.send_flat, n, len(self.rows))
            lse = self._view(self.send_lse, n, lse=True)[0] if self.backward else None
            with stream:
                for own, at, length in step.q_send.runs:
                    for i, src in enumerate(self.rows):
                        packed[i, :, :, at:at + length] = src[:, :, own:own + length]
                    if lse is not None:
                        lse[:, :, at:at + length] = self.lse[:, :, own:own + length]
            sends = [(packed[i], step.dst) for i in range(len(self.rows))] + ([(lse, step.dst)] if lse is not None
                                                                             else [])
        if step.q_recv is not None:
            recvs = [(x, step.src) for x in self.received(step, slot)]
        return sends, recvs

    def received(self, step, slot: int) -> tuple:
        """``(q,)`` or ``(q, dout, out, lse)`` of step's guests, in receive slot ``slot``."""
        n = step.q_recv.length
        rows = self._view(self.recv_flat[slot], n, len(self.rows))
        lse = (self._view(self.recv_lse[slot], n, lse=True)[0],) if self.backward else ()
        return tuple(rows[i] for i in range(len(self.rows))) + lse

    def answer(self, step, slot: int) -> tuple:
        return self._answer(self.answer_slots[slot], step.q_recv.length)

    def answer_transfers(self, step, slot: int) -> tuple[list, list]:
        sends = [(a, step.src) for a in self.answer(step, slot)] if step.q_recv is not None else []
        recvs = [(a, step.dst) for a in self.answered[step.step]] if step.q_send is not None else []
        return sends, recvs


__all__ = ["KVExchange", "QueryBuffers"]
