"""Framework adapters' shared parts: the registry of call options (specs.py) and the CuPy glue
that runs omnicupy on a framework's stream with the framework's memory (glue.py); the torch
custom operators (torch_ops.py) and the XLA FFI handler (xla_ffi.py).

Nothing here is imported by ``import omnicupy``; ``omnicupy.torch`` and ``omnicupy.jax`` (lazy
submodules) are the public entry points, and only they import torch or jax.
"""
