"""Stand-ins that let omnicupy.distributed's device path run on the CPU, one thread per rank.

- ``FakeCupy``: NumPy behind CuPy's names (arrays are ``FakeArray``, a NumPy array with CuPy's
  ``.device``, ``.data.ptr`` and ``.get()``); streams and events record nothing: every operation
  runs at once, in host order, so these tests check what is sent where and what is computed with
  it, not the event ordering (which only a GPU can exercise).
- ``FakeComm``: a Communicator whose transfers go through in-process queues; a receive checks that
  the matching send has exactly its byte count, like NCCL.
- ``fake_attention`` / ``fake_attention_backward``: the float64 reference on the sub-mask's dense
  form, in the signatures of ``omnicupy.attention`` and ``omnicupy.attention_backward``.
"""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np

from omnicupy import reference
from omnicupy.distributed.comm import Communicator

TIMEOUT_S = 60


class FakeArray(np.ndarray):
    @property
    def device(self):
        return SimpleNamespace(id=0)

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self):
        return np.array(self)


def fake(x):
    return x.view(FakeArray) if isinstance(x, np.ndarray) and not isinstance(x, FakeArray) else x


class FakeStream:
    ptr = 0

    def wait_event(self, event):
        assert isinstance(event, FakeEvent) and event.recorded, "waiting on an event never recorded"

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.recorded = False

    def record(self, stream=None):
        assert isinstance(stream, FakeStream), "an event recorded without a stream goes to the null stream"
        self.recorded = True

    def synchronize(self):
        assert self.recorded


class FakeCupy:
    """NumPy under CuPy's names; functions return FakeArray."""

    ndarray = FakeArray
    float32, float64, float16 = np.float32, np.float64, np.float16

    def __init__(self):
        self._stream = FakeStream()
        self.cuda = SimpleNamespace(
            get_current_stream=lambda: self._stream, Event=FakeEvent, Stream=lambda **kw: FakeStream(),
            get_elapsed_time=lambda start, end: 1.0,
            runtime=SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1), Device=lambda i: FakeStream())

    def __getattr__(self, name):
        fn = getattr(np, name)
        if not callable(fn):
            return fn

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            return tuple(fake(o) for o in out) if isinstance(out, tuple) else fake(out)

        return wrapped


class World:
    """Shared state of the ranks: one queue per (sender, receiver), and a barrier."""

    def __init__(self, size: int):
        self.size = size
        self.boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.gathered: dict = {}


class FakeComm(Communicator):
    def __init__(self, world: World, rank: int):  # noqa: D401 - no NCCL behind it
        self.world, self.rank, self.size, self.device = world, rank, world.size, 0
        self.nccl, self.stream = None, FakeStream()
        self.sent_bytes = 0

    def exchange(self, sends, recvs, stream):
        assert isinstance(stream, FakeStream)
        for a, peer in sends:
            assert a.flags.c_contiguous and peer != self.rank
            if a.nbytes:
                self.world.boxes[(self.rank, peer)].put(np.array(a, copy=True))
                self.sent_bytes += a.nbytes
        for a, peer in recvs:
            assert a.flags.c_contiguous and peer != self.rank
            if a.nbytes:
                got = self.world.boxes[(peer, self.rank)].get(timeout=TIMEOUT_S)
                assert got.nbytes == a.nbytes and got.dtype == a.dtype, (got.shape, a.shape)
                a[...] = got.reshape(a.shape)

    def all_gather(self, buffer, stream):
        assert buffer.flags.c_contiguous and buffer.shape[0] == self.size
        self.world.gathered[self.rank] = np.array(buffer[self.rank], copy=True)
        self.sent_bytes += buffer[self.rank].nbytes * (self.size - 1)
        self.world.barrier.wait()
        for r in range(self.size):
            buffer[r] = self.world.gathered[r]
        self.world.barrier.wait()

    def barrier(self):
        self.world.barrier.wait()

    def all_reduce(self, array, op="sum", stream=None):
        self.world.gathered[self.rank] = np.array(array, copy=True)
        self.world.barrier.wait()
        parts = [self.world.gathered[r] for r in range(self.size)]
        self.world.barrier.wait()
        array[...] = {"sum": np.sum, "max": np.max, "min": np.min}[op](np.stack(parts), axis=0)
        return array


def fake_attention(q, k, v, block_mask=None, *, scale=None, return_lse=False, stages=None, **unused):
    assert not unused, unused
    o, lse = reference.attention(np.asarray(q), np.asarray(k), np.asarray(v), block_mask.to_dense(), scale=scale,
                                 return_lse=True)
    o, lse = fake(o.astype(q.dtype)), fake(lse.astype(np.float32))
    return (o, lse) if return_lse else o


def pair_gradients(q, k, v, dout, out, lse, dense, scale):
    """float64 gradients of one (queries, keys) pair given the queries' global out and lse."""
    B, Hq, _, D = q.shape
    group = Hq // k.shape[1]
    q, k, v, dout, out = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout, out))
    lse = np.asarray(lse, dtype=np.float64)
    scale = 1 / np.sqrt(D) if scale is None else scale
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scale * (q @ kk.swapaxes(-1, -2))
    allowed = np.broadcast_to(dense, s.shape)
    lse_safe = np.where(np.isfinite(lse), lse, 0)[..., None]
    p = np.where(allowed, np.exp(np.where(allowed, s, 0) - lse_safe), 0)
    ds = p * (dout @ vv.swapaxes(-1, -2) - (dout * out).sum(-1, keepdims=True))
    dq = scale * (ds @ kk)
    dk = (scale * (ds.swapaxes(-1, -2) @ q)).reshape(B, -1, group, *k.shape[2:]).sum(axis=2)
    dv = (p.swapaxes(-1, -2) @ dout).reshape(B, -1, group, *k.shape[2:]).sum(axis=2)
    return dq, dk, dv


def fake_attention_backward(dout, q, k, v, out, lse, block_mask=None, *, causal=False, scale=None, bias=None,
                            score_mod=None, deterministic=False, dq=None, dk=None, dv=None):
    grads = pair_gradients(q, k, v, dout, out, lse, block_mask.to_dense(), scale)
    results = []
    for g, given, like in zip(grads, (dq, dk, dv), (q, k, v)):
        g = g.astype(like.dtype)
        if given is not None:
            given[...] = g
            results.append(given)
        else:
            results.append(fake(g))
    return tuple(results)


def run_ranks(size: int, fn):
    """``fn(rank)`` on one thread per rank; returns the results in rank order, re-raising any error."""
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append((rank, exc))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * TIMEOUT_S)
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
    assert all(not t.is_alive() for t in threads), "a rank hung"
    return results
