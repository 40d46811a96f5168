"""The built-in mask_mods (``omnicupy.masks``): the public face of ``omnicupy.mask.zoo``.

    bm = BlockMask.from_mask_mod(masks.sliding_window(1024), None, None, N, N)
"""
from __future__ import annotations

from .mask.mask_mod import EVALUATE, MaskMod
from .mask.zoo import *  # noqa: F401,F403 - the zoo is this module's content
from .mask.zoo import __all__ as _zoo_all
from .mask import families  # noqa: F401 - the attention-gym mask families as plain mask_mods (compile_mask)

__all__ = sorted(set(_zoo_all) | {"MaskMod", "EVALUATE", "families"})
