"""NCCL communicators for context parallelism: set-up from a launcher, and the transfers used.

Knows: how a process learns its rank and how the NCCL unique id reaches every process, and how
to move byte buffers with NCCL (CuPy's ``cupy.cuda.nccl``) on a stream. Does not know attention,
plans or shapes beyond a buffer's bytes.

How the id travels, by launcher (nothing here carries bytes between processes itself):
- torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL's own bootstrap through
  ``NCCL_COMM_ID=<MASTER_ADDR>:<port>``: every rank derives the same id from that address and rank
  0's ``ncclCommInitRank`` listens there (the others retry for about a minute). The port is
  ``OMNICUPY_NCCL_PORT``, by default MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT).
  ``NCCL_COMM_ID`` is set only while the communicator is created, unless the user set it.
- mpirun: mpi4py broadcasts rank 0's id over MPI.COMM_WORLD (or the mpi4py communicator given).
- anything else: ``from_unique_id(uid, world_size, rank)`` with an id the caller distributed, or
  an existing ``cupy.cuda.nccl.NcclCommunicator`` passed to ``init``.
- no launcher at all: a communicator of one rank.
NVLink multicast (NVLS) is not used: ``NCCL_NVLS_ENABLE`` defaults to 0 before NCCL starts.

Failures. NCCL reports a peer's failure asynchronously (``ncclCommGetAsyncError``, CuPy's
``check_async_error``) and a rank that waits on a dead peer waits forever. ``Communicator.wait``
therefore never blocks: it polls the work's completion event and NCCL's asynchronous error, and on
an error or past ``timeout_s`` seconds it aborts the communicator (``ncclCommAbort``, which also
makes the peers' pending operations fail) and raises CommunicationError or
CommunicationTimeoutError. ``timeout_s`` defaults to ``OMNICUPY_DISTRIBUTED_TIMEOUT`` (seconds;
300 when unset; 0 turns the wait off, e.g. while capturing a CUDA graph).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from .. import arrays
from ..errors import ArgumentError, NoGPUError
from .errors import CommunicationError, CommunicationTimeoutError, DistributedError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Variables that MPI launchers set in every process they start (Open MPI, MPICH/Hydra, PMIx, MVAPICH).
MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
PORT_VARIABLE = "OMNICUPY_NCCL_PORT"
#: Clamped by CUDA to the device's highest priority: NCCL kernels get SMs as soon as any free up.
COMM_STREAM_PRIORITY = -100
TIMEOUT_VARIABLE = "OMNICUPY_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
#: Seconds between two polls of a pending wait (the completion event and NCCL's asynchronous error).
POLL_S = 0.0005


def default_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """``OMNICUPY_DISTRIBUTED_TIMEOUT`` in seconds (0: no wait), else DEFAULT_TIMEOUT_S."""
    environ = os.environ if environ is None else environ
    raw = environ.get(TIMEOUT_VARIABLE)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"{TIMEOUT_VARIABLE}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise DistributedError(f"{TIMEOUT_VARIABLE}={raw!r} is negative")
    return value


@dataclass(frozen=True)
class Launch:
    """What the environment says about this process: ``kind`` is torchrun, mpi or single; for
    torchrun, ``address`` is the host:port NCCL's bootstrap root listens on."""

    kind: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    address: Optional[str] = None


def _env_int(environ: Mapping[str, str], name: str) -> int:
    try:
        value = int(environ[name])
    except (KeyError, ValueError):
        raise DistributedError(f"environment variable {name}={environ.get(name)!r} is not an integer") from None
    if value < 0:
        raise DistributedError(f"environment variable {name}={value} is negative")
    return value


def detect_launch(environ: Optional[Mapping[str, str]] = None) -> Launch:
    """Which launcher started this process, from its environment (``os.environ`` by default)."""
    environ = os.environ if environ is None else environ
    if all(name in environ for name in TORCHRUN_VARS):
        rank, world = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
        if rank >= world:
            raise DistributedError(f"RANK={rank} is not below WORLD_SIZE={world}")
        local = _env_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
        port = _env_int(environ, PORT_VARIABLE) if PORT_VARIABLE in environ else _env_int(environ, "MASTER_PORT") + 1
        host = environ["MASTER_ADDR"]
        if ":" in host and not host.startswith("["):  # a bare IPv6 address
            host = f"[{host}]"
        return Launch("torchrun", rank, world, local, f"{host}:{port}")
    if any(name in environ for name in MPI_VARS):
        return Launch("mpi", rank=-1, world_size=-1, local_rank=-1)
    return Launch("single")


def nccl_module():
    """``cupy.cuda.nccl``, or a DistributedError saying what is missing."""
    cp = arrays.cupy_module()
    if cp is None:
        raise NoGPUError("omnicupy.distributed needs CuPy: pip install 'omnicupy[cuda12]' or 'omnicupy[cuda13]'")
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise DistributedError("CuPy cannot load NCCL (libnccl.so.2): pip install nvidia-nccl-cu12 (or -cu13)")
    return nccl


class Communicator:
    """One NCCL communicator bound to one GPU, and the high-priority stream its transfers run on.

    ``nccl`` is the ``cupy.cuda.nccl.NcclCommunicator``; ``rank``, ``size`` and ``device`` are
    read from it. ``keepalive`` holds objects whose lifetime must cover the communicator's.
    ``timeout_s``: how long ``wait`` lets a distributed call take (module docstring, "Failures")."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    aborted: bool = False

    def __init__(self, nccl_comm: Any, *, keepalive: Any = None) -> None:
        cp = arrays.cupy_module()
        self.nccl = nccl_comm
        self.rank = int(nccl_comm.rank_id())
        self.size = int(nccl_comm.size())
        self.device = int(nccl_comm.device_id())
        self._keepalive = keepalive
        self.timeout_s = default_timeout()
        self.aborted = False
        with cp.cuda.Device(self.device):
            self.stream = cp.cuda.Stream(non_blocking=True, priority=COMM_STREAM_PRIORITY)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, device={self.device})"

    # ------------------------------------------------------------ transfers
    def exchange(self, sends: Sequence[tuple[Any, int]], recvs: Sequence[tuple[Any, int]], stream: Any) -> None:
        """One NCCL group of sends ``(array, peer)`` and receives ``(array, peer)`` on ``stream``;
        contiguous device arrays, moved as bytes. Empty arrays are skipped (the peer skips its side
        too, since both follow the same plan). Several transfers between two ranks match in order."""
        nccl = nccl_module()
        ops = [(a, p, True) for a, p in sends if a.nbytes] + [(a, p, False) for a, p in recvs if a.nbytes]
        if not ops:
            return
        for a, peer, _ in ops:
            _check_buffer(a, peer, self.size)
        nccl.groupStart()
        try:
            for a, peer, is_send in ops:
                if is_send:
                    self.nccl.send(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, peer, stream.ptr)
                else:
                    self.nccl.recv(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, peer, stream.ptr)
        finally:
            nccl.groupEnd()

    def all_gather(self, buffer: Any, stream: Any) -> None:
        """In-place all-gather of ``buffer`` ``[size, ...]``: rank r's slice ``buffer[r]`` goes to every rank."""
        nccl = nccl_module()
        if buffer.shape[0] != self.size or not buffer.flags.c_contiguous:
            raise ArgumentError(f"all_gather needs a contiguous buffer [{self.size}, ...], got {tuple(buffer.shape)}")
        count = buffer.nbytes // self.size
        if count:
            self.nccl.allGather(buffer.data.ptr + self.rank * count, buffer.data.ptr, count, nccl.NCCL_UINT8,
                                stream.ptr)

    def all_reduce(self, array: Any, op: str = "sum", stream: Any = None) -> Any:
        """In-place all-reduce of a contiguous float32/float64/int32 device array (``sum`` or ``max``)."""
        nccl = nccl_module()
        cp = arrays.cupy_module()
        types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                 np.dtype(np.int32): nccl.NCCL_INT32}
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        if np.dtype(array.dtype) not in types or op not in ops or not array.flags.c_contiguous:
            raise ArgumentError(f"all_reduce takes a contiguous float32/float64/int32 array and sum/max/min, "
                                f"got {array.dtype} and {op!r}")
        stream = cp.cuda.get_current_stream() if stream is None else stream
        self.nccl.allReduce(array.data.ptr, array.data.ptr, array.size, types[np.dtype(array.dtype)], ops[op],
                            stream.ptr)
        return array

    def barrier(self) -> None:
        """Every rank gets here before any leaves (a one-element all-reduce, then a host wait)."""
        cp = arrays.cupy_module()
        with cp.cuda.Device(self.device):
            token = cp.zeros(1, dtype=np.int32)
            self.all_reduce(token)
            cp.cuda.get_current_stream().synchronize()

    # -------------------------------------------------------------- failures
    def check(self) -> None:
        """Raise CommunicationError (after aborting) if NCCL reports an asynchronous error or the
        communicator was aborted."""
        if self.aborted:
            raise CommunicationError(f"rank {self.rank}: the communicator was aborted by an earlier failure")
        try:
            if self.nccl is not None:
                self.nccl.check_async_error()
        except Exception as exc:  # noqa: BLE001 - NcclError, or a binding without the call
            self.abort()
            raise CommunicationError(f"rank {self.rank}: NCCL reported an asynchronous error ({exc}); "
                                     "the communicator is aborted") from exc

    def wait(self, event: Any, timeout_s: Optional[float] = None, what: str = "the distributed call") -> None:
        """Wait on the host until ``event`` (a recorded CUDA event) completes, polling NCCL's
        asynchronous error; past ``timeout_s`` (default ``self.timeout_s``; 0: do not wait at all)
        abort and raise CommunicationTimeoutError."""
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        if timeout_s <= 0:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if event.done:
                return
            if time.monotonic() > deadline:
                self.abort()
                raise CommunicationTimeoutError(
                    f"rank {self.rank}: {what} did not finish within {timeout_s:g} s (a peer hung or failed); "
                    f"the communicator is aborted (timeout: {TIMEOUT_VARIABLE} or Communicator.timeout_s)")
            time.sleep(POLL_S)

    def abort(self) -> None:
        """Abort the NCCL communicator (``ncclCommAbort``): this rank's pending operations stop and
        the peers' operations with it fail instead of waiting. Safe to call twice."""
        if self.aborted:
            return
        self.aborted = True
        if self.nccl is not None:
            try:
                self.nccl.abort()
            finally:
                self.nccl = None

    def close(self) -> None:
        """Destroy the NCCL communicator (after every transfer posted has finished)."""
        if self.nccl is not None:
            self.stream.synchronize()
            self.nccl.destroy()
            self.nccl = None


def _check_buffer(a: Any, peer: int, size: int) -> None:
    if not arrays.is_cupy(a) or not a.flags.c_contiguous:
        raise ArgumentError("NCCL transfers need contiguous CuPy arrays")
    if not 0 <= peer < size:
        raise ArgumentError(f"peer {peer} is outside the communicator of {size} ranks")


# ------------------------------------------------------------------------------- set-up
def _no_multicast() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _use_device(device: Optional[int], local_rank: int) -> int:
    cp = arrays.cupy_module()
    if not arrays.gpu_available():
        raise NoGPUError("omnicupy.distributed needs an NVIDIA GPU per rank; none is usable on this machine")
    count = cp.cuda.runtime.getDeviceCount()
    device = local_rank % count if device is None else int(device)
    if not 0 <= device < count:
        raise ArgumentError(f"device {device} is outside the {count} visible GPUs")
    cp.cuda.Device(device).use()
    return device


def from_unique_id(unique_id: Any, world_size: int, rank: int, *, device: Optional[int] = None,
                   local_rank: Optional[int] = None, keepalive: Any = None) -> Communicator:
    """A communicator from an NCCL unique id every rank was given (``cupy.cuda.nccl.get_unique_id()``
    on one process). The GPU is ``device``, else ``local_rank`` (else ``rank``) modulo the GPU count."""
    nccl = nccl_module()
    if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
        raise ArgumentError(f"rank ({rank}) must be an int in [0, world_size={world_size})")
    _no_multicast()
    _use_device(device, rank if local_rank is None else local_rank)
    return Communicator(nccl.NcclCommunicator(world_size, unique_id, rank), keepalive=keepalive)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _from_torchrun(launch: Launch, device: Optional[int]) -> Communicator:
    nccl = nccl_module()
    _no_multicast()
    own = "NCCL_COMM_ID" in os.environ  # a user's setting wins and stays
    with contextlib.nullcontext() if own else _environment("NCCL_COMM_ID", launch.address):
        unique_id = nccl.get_unique_id()  # the same on every rank: derived from NCCL_COMM_ID
        return from_unique_id(unique_id, launch.world_size, launch.rank, device=device, local_rank=launch.local_rank)


def _is_mpi_comm(comm: Any) -> bool:
    return type(comm).__module__.split(".")[0] == "mpi4py"


def _from_mpi(mpi_comm: Any, device: Optional[int]) -> Communicator:
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError("started by an MPI launcher, but mpi4py does not import: pip install mpi4py "
                               "(or launch with torchrun)") from None
    nccl = nccl_module()
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = node.Get_rank()
    node.Free()
    unique_id = nccl.get_unique_id() if rank == 0 else None
    unique_id = mpi_comm.bcast(unique_id, root=0)
    return from_unique_id(unique_id, size, rank, device=device, local_rank=local_rank, keepalive=mpi_comm)


def init(comm: Any = None, *, device: Optional[int] = None) -> Communicator:
    """The communicator of this process.

    ``comm`` may be a Communicator (returned as is), a ``cupy.cuda.nccl.NcclCommunicator`` or an
    mpi4py communicator; None reads the launcher from the environment (torchrun, then MPI), and a
    process started by neither gets a communicator of one rank. ``device`` picks the GPU (default:
    the local rank modulo the GPU count)."""
    if isinstance(comm, Communicator):
        return comm
    nccl = nccl_module()
    if comm is not None:
        if isinstance(comm, nccl.NcclCommunicator):
            return Communicator(comm)
        if _is_mpi_comm(comm):
            return _from_mpi(comm, device)
        raise ArgumentError("comm must be an omnicupy.distributed.Communicator, a cupy.cuda.nccl.NcclCommunicator "
                            f"or an mpi4py communicator, got {type(comm).__name__}")
    launch = detect_launch()
    if launch.kind == "torchrun":
        return _from_torchrun(launch, device)
    if launch.kind == "mpi":
        return _from_mpi(None, device)
    return from_unique_id(nccl.get_unique_id(), 1, 0, device=device)


__all__ = ["Communicator", "Launch", "init", "from_unique_id", "detect_launch", "nccl_module", "PORT_VARIABLE",
           "TIMEOUT_VARIABLE", "DEFAULT_TIMEOUT_S", "default_timeout"]
