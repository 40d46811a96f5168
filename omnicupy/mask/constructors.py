"""The builders as class methods of BlockMask (``BlockMask.causal(...)``, ``BlockMask.from_mask_mod(...)``):
a base class of BlockMask whose methods import mask/builders.py when called (builders.py builds on
block_mask.py, which therefore cannot import it at load time), so that type checkers see every
builder with its signature. Knows the builders' signatures; nothing else.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from .block_mask import BlockMask


class BuilderMethods:
    @classmethod
    def full(cls, q_len: int, kv_len: int, *, q_block_size: int = 128, kv_block_size: int = 128) -> "BlockMask":
        """Every query attends to every key (builders.full)."""
        from .builders import full

        return full(q_len, kv_len, q_block_size=q_block_size, kv_block_size=kv_block_size)

    @classmethod
    def causal(cls, q_len: int, kv_len: int, *, bottom_right: bool = False, q_block_size: int = 128,
               kv_block_size: int = 128) -> "BlockMask":
        """``q_idx >= kv_idx``, or bottom-right aligned (builders.causal)."""
        from .builders import causal

        return causal(q_len, kv_len, bottom_right=bottom_right, q_block_size=q_block_size,
                      kv_block_size=kv_block_size)

    @classmethod
    def from_mask_mod(cls, mask_mod: Callable, B: Optional[int], H: Optional[int], q_len: int, kv_len: int, *,
                      q_block_size: int = 128, kv_block_size: int = 128, xp: Any = None, use_structure: bool = True,
                      mode: str = "auto") -> "BlockMask":
        """From a mask function ``mask_mod(b, h, q_idx, kv_idx)`` (builders.from_mask_mod)."""
        from .builders import from_mask_mod

        return from_mask_mod(mask_mod, B, H, q_len, kv_len, q_block_size=q_block_size, kv_block_size=kv_block_size,
                             xp=xp, use_structure=use_structure, mode=mode)

    @classmethod
    def from_dense(cls, mask: Any, *, q_block_size: int = 128, kv_block_size: int = 128) -> "BlockMask":
        """From a boolean mask ``[B|1, H|1, Nq, Nkv]`` (builders.from_dense)."""
        from .builders import from_dense

        return from_dense(mask, q_block_size=q_block_size, kv_block_size=kv_block_size)

    @classmethod
    def from_flex(cls, kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any = None,
                  full_kv_indices: Any = None, *, q_len: int, kv_len: int, q_block_size: int = 128,
                  kv_block_size: int = 128, mask_mod: Optional[Callable] = None, mode: str = "auto") -> "BlockMask":
        """From the arrays of torch's ``BlockMask.as_tuple()`` (builders.from_flex)."""
        from .builders import from_flex

        return from_flex(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_len=q_len, kv_len=kv_len,
                         q_block_size=q_block_size, kv_block_size=kv_block_size, mask_mod=mask_mod, mode=mode)

