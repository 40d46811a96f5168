"""Deprecated name of ``omnicupy.torch`` (kept for one release): ``attention`` is
``omnicupy.torch.attention``, now torch custom operators that torch.compile traces."""
from __future__ import annotations

import warnings

from .torch import attention  # noqa: F401 - raises MissingDependencyError without torch

warnings.warn("omnicupy.torch_autograd is deprecated and will be removed in the next release; "
              "use omnicupy.torch (same attention())", DeprecationWarning, stacklevel=2)

__all__ = ["attention"]
