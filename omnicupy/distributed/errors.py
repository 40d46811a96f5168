"""Errors of omnicupy.distributed, under the package's OmnicupyError."""
from __future__ import annotations

from ..errors import OmnicupyError


class DistributedError(OmnicupyError, RuntimeError):
    """No usable communicator: NCCL missing, a launcher's environment incomplete, a rank mismatch."""


class BackwardUnavailableError(DistributedError, NotImplementedError):
    """The distributed backward needs ``omnicupy.attention_backward``, which this installation lacks."""


__all__ = ["DistributedError", "BackwardUnavailableError"]
