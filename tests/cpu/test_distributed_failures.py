"""Failures in omnicupy.distributed on the host: a rank that errors or hangs makes every rank raise a
named error within the communicator's timeout, and the communicator is aborted, never left waiting.

- ``Communicator.wait`` / ``check`` / ``abort`` against a stand-in for CuPy's NcclCommunicator
  (asynchronous error, an event that never completes, a timeout of 0).
- Three ranks on threads (tests/support/fake_devices.py): one rank's kernel fails in the middle of the
  step loop; it raises CommunicationError and aborts; its peers, whose transfers can no longer
  complete, raise CommunicationTimeoutError after the (short) timeout instead of hanging. The
  stand-in transfers are synchronous, so the receive itself enforces the timeout here; on a GPU
  the same bound comes from ``Communicator.wait`` (tests/gpu/test_distributed_gpu.py checks it).
"""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

import omnicupy
from omnicupy import arrays
from omnicupy.distributed import comm as comm_module
from omnicupy.distributed import merge, planner, sharded_attention, sharding, steps
from omnicupy.distributed.errors import CommunicationError, CommunicationTimeoutError, DistributedError

import fake_devices as fd
from distributed_cases import family_mask


class StubNccl:
    def __init__(self, error=None):
        self.error, self.aborted = error, False

    def check_async_error(self):
        if self.error:
            raise RuntimeError(self.error)

    def abort(self):
        self.aborted = True


class StubEvent:
    def __init__(self, done_after: float):
        self.at = time.monotonic() + done_after

    @property
    def done(self):  # cupy.cuda.Event.done
        return time.monotonic() >= self.at


def stub_comm(nccl, timeout_s=0.2):
    comm = object.__new__(comm_module.Communicator)
    comm.rank, comm.size, comm.device, comm.nccl, comm.timeout_s = 0, 2, 0, nccl, timeout_s
    return comm


def test_wait_returns_when_the_work_is_done():
    nccl = StubNccl()
    stub_comm(nccl).wait(StubEvent(0.01))
    assert not nccl.aborted


def test_wait_raises_on_an_asynchronous_error_and_aborts():
    nccl = StubNccl("remote process exited")
    comm = stub_comm(nccl)
    with pytest.raises(CommunicationError, match="asynchronous error"):
        comm.wait(StubEvent(10))
    assert nccl.aborted and comm.aborted and comm.nccl is None
    with pytest.raises(CommunicationError, match="aborted"):
        comm.check()  # later calls fail at once


def test_wait_times_out_and_aborts():
    nccl = StubNccl()
    comm = stub_comm(nccl, timeout_s=0.05)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError, match="0.05 s"):
        comm.wait(StubEvent(60))
    assert time.monotonic() - start < 5 and nccl.aborted


def test_timeout_zero_does_not_wait():
    stub_comm(StubNccl(), timeout_s=0).wait(StubEvent(60))


@pytest.mark.parametrize("raw,want", [(None, comm_module.DEFAULT_TIMEOUT_S), ("12.5", 12.5), ("0", 0.0)])
def test_default_timeout_from_the_environment(raw, want):
    environ = {} if raw is None else {comm_module.TIMEOUT_VARIABLE: raw}
    assert comm_module.default_timeout(environ) == want


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_bad_timeout_variable(raw):
    with pytest.raises(DistributedError):
        comm_module.default_timeout({comm_module.TIMEOUT_VARIABLE: raw})


class BoundedComm(fd.FakeComm):
    """A stand-in communicator whose receives give up after ``timeout_s`` like ``Communicator.wait``."""

    timeout_s = 0.5

    def exchange(self, sends, recvs, stream):
        for a, peer in sends:
            if a.nbytes:
                self.world.boxes[(self.rank, peer)].put(np.array(a, copy=True))
        for a, peer in recvs:
            if a.nbytes:
                try:
                    got = self.world.boxes[(peer, self.rank)].get(timeout=self.timeout_s)
                except queue.Empty:
                    self.abort()
                    raise CommunicationTimeoutError(f"rank {self.rank}: nothing from rank {peer}") from None
                a[...] = got.reshape(a.shape)


@pytest.mark.parametrize("route", ["keys", "queries"])
def test_a_failing_rank_makes_every_rank_raise(monkeypatch, route):
    n, world = 1024, 3
    bm = family_mask("global_window", n, block=64)
    plan = planner.plan(bm, world, route=route)
    for r in range(world):
        steps.program(plan, r)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float16) for _ in range(3))
    cp = fd.FakeCupy()
    monkeypatch.setattr(arrays, "cupy_module", lambda: cp)
    monkeypatch.setitem(merge._fused, "failed", True)
    monkeypatch.setattr(fd.FakeEvent, "done", property(lambda self: self.recorded), raising=False)
    import threading

    calls = {}

    def failing_attention(q_, k_, v_, block_mask=None, **kw):
        me = threading.current_thread().name
        calls[me] = calls.get(me, 0) + 1
        if me == "rank-1":  # rank 1 fails at its first kernel, before posting anything
            raise RuntimeError("injected kernel failure")
        return fd.fake_attention(q_, k_, v_, block_mask, **kw)

    monkeypatch.setattr(omnicupy, "attention", failing_attention)
    shared = fd.World(world)
    comms = [BoundedComm(shared, r) for r in range(world)]
    outcome = {}

    def rank_fn(rank):
        threading.current_thread().name = f"rank-{rank}"
        shards = [fd.fake(sharding.shard(x, plan, rank)) for x in (q, k, v)]
        start = time.monotonic()
        try:
            sharded_attention.attention(*shards, plan, comms[rank])
            outcome[rank] = ("ok", time.monotonic() - start)
        except CommunicationError as exc:
            outcome[rank] = (type(exc).__name__, time.monotonic() - start)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert outcome[1][0] == "CommunicationError" and comms[1].aborted, outcome
    # every peer that waits on rank 1 raises within the timeout (plus the compute it had left)
    for r in (0, 2):  # both wait on rank 1's keys (rank 0: the global rows; rank 2: its window)
        assert outcome[r][0] == "CommunicationTimeoutError" and outcome[r][1] < 10, outcome
