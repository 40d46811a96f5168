"""Errors of omnicupy.distributed, under the package's OmnicupyError."""
from __future__ import annotations

from ..errors import OmnicupyError


class DistributedError(OmnicupyError, RuntimeError):
    """No usable communicator: NCCL missing, a launcher's environment incomplete, a rank mismatch."""


class BackwardUnavailableError(DistributedError, NotImplementedError):
    """The distributed backward needs ``omnicupy.attention_backward``, which this installation lacks."""


class CommunicationError(DistributedError):
    """A distributed call failed on this rank or a peer: an NCCL asynchronous error, a peer that
    aborted, or an error here after transfers were posted. The communicator has been aborted (make a
    new one to continue)."""


class CommunicationTimeoutError(CommunicationError, TimeoutError):
    """A distributed call did not finish within the communicator's timeout (a peer hung or died);
    the communicator has been aborted so that no rank waits forever."""


__all__ = ["DistributedError", "BackwardUnavailableError", "CommunicationError", "CommunicationTimeoutError"]
