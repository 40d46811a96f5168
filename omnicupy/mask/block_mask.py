"""BlockMask: the block-sparse metadata the kernel walks (docs/design.md, "Block mask metadata"; flex-attention layout).

A BlockMask lists, for every (batch, head, q block), which kv blocks to visit and how much masking
each needs: CAUSAL (element rule ``q_idx >= kv_idx``), FULL (none) or PARTIAL (a bit-packed
element mask from a deduplicated pool). Blocks not listed are skipped without a load.

Arrays may live on the host (NumPy) or the device (CuPy); validation runs where they live, and
``attention()`` keeps a cached contiguous int32 device copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import MaskError
from .types import BLOCK_CHARS, KV_BLOCK_MULTIPLE, Q_BLOCK_MULTIPLE, BlockType, MaskFeatures, cdiv


@dataclass(frozen=True)
class DeviceMetadata:
    """Contiguous int32/uint32 CuPy arrays in the exact form the kernel reads.

    The arrays hold each stored (batch, head) row once; a batch or head dim that the mask broadcasts
    is stored with size 1. Row ``(b, h, q_block)`` of the kernel's view is
    ``b * row_stride_batch + h * row_stride_head + q_block`` (strides in q-block rows, 0 where the
    mask broadcasts): this is the one place that says how broadcasting is stored."""

    kv_num_blocks: Any  # [Bm', Hm', nQB]
    kv_indices: Any  # [Bm', Hm', nQB, maxB]
    block_mask_types: Any  # [Bm', Hm', nQB, maxB]
    partial_block_mask_indices: Any  # [Bm', Hm', nQB, maxB] or None
    partial_block_masks: Any  # [P, QBS, KBS/32] uint32 or None
    row_stride_batch: int
    row_stride_head: int


def _check_positive_int(value: Any, name: str, multiple: int = 1) -> int:
    return check_int(value, name, minimum=1, multiple=multiple, error=MaskError)


def _as_index_array(x: Any, name: str, ndim: int, *, unsigned: bool = False):
    """Accept NumPy/CuPy/DLPack integer arrays; return NumPy or CuPy int32 (uint32) arrays."""
    if x is None:
        raise MaskError(f"{name} is required")
    x = arrays.as_array(x, name)
    if x.ndim != ndim:
        raise MaskError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    kind = np.dtype(x.dtype).kind
    if kind not in "iu":
        raise MaskError(f"{name} must be an integer array, got dtype {x.dtype}")
    target = np.uint32 if unsigned else np.int32
    if x.dtype != target:
        if unsigned and np.dtype(x.dtype).itemsize == 4:
            x = x.view(np.uint32)  # int32 bit patterns are fine for a bitmask
        else:
            xp = arrays.array_namespace(x)
            info = np.iinfo(target)
            if x.size and (int(x.min()) < info.min or int(x.max()) > info.max):
                raise MaskError(f"{name} has values outside the {np.dtype(target).name} range")
            x = xp.asarray(x, dtype=target)
    return x


class BlockMask:
    """Block-sparse attention mask in flex-attention's layout plus a per-block type.

    Parameters mirror docs/design.md, "Block mask metadata". ``Bm`` and ``Hm`` (the first two dims) may be 1 to broadcast
    over batch and heads. ``mask_mod``, when known, is remembered so the reference and fused
    kernels can use the element rule directly.
    """

    def __init__(
        self,
        kv_num_blocks: Any,
        kv_indices: Any,
        block_mask_types: Any,
        *,
        q_len: int,
        kv_len: int,
        q_block_size: int = 128,
        kv_block_size: int = 128,
        partial_block_mask_indices: Any = None,
        partial_block_masks: Any = None,
        mask_mod: Optional[Callable] = None,
        _features: Optional[MaskFeatures] = None,
    ) -> None:
        self.q_len = _check_positive_int(q_len, "q_len")
        self.kv_len = _check_positive_int(kv_len, "kv_len")
        self.q_block_size = _check_positive_int(q_block_size, "q_block_size", Q_BLOCK_MULTIPLE)
        self.kv_block_size = _check_positive_int(kv_block_size, "kv_block_size", KV_BLOCK_MULTIPLE)
        self.kv_num_blocks = _as_index_array(kv_num_blocks, "kv_num_blocks", 3)
        self.kv_indices = _as_index_array(kv_indices, "kv_indices", 4)
        self.block_mask_types = _as_index_array(block_mask_types, "block_mask_types", 4)
        self.partial_block_mask_indices = (
            None
            if partial_block_mask_indices is None
            else _as_index_array(partial_block_mask_indices, "partial_block_mask_indices", 4)
        )
        self.partial_block_masks = (
            None
            if partial_block_masks is None
            else _as_index_array(partial_block_masks, "partial_block_masks", 3, unsigned=True)
        )
        self.mask_mod = mask_mod
        self._device_cache: dict[int, DeviceMetadata] = {}
        self._tile_orders: dict = {}  # schedule.q_tile_order, per (device, tile rows)
        self._backward_index: dict = {}  # ops/backward_index.py: the transposed index, per device
        self.features = self._validate(_features)

    # ------------------------------------------------------------------ shape
    @property
    def num_q_blocks(self) -> int:
        return cdiv(self.q_len, self.q_block_size)

    @property
    def num_kv_blocks(self) -> int:
        return cdiv(self.kv_len, self.kv_block_size)

    @property
    def max_blocks(self) -> int:
        return int(self.kv_indices.shape[3])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, q_len, kv_len), like flex's ``BlockMask.shape``."""
        bm, hm = self.kv_num_blocks.shape[:2]
        return int(bm), int(hm), self.q_len, self.kv_len

    @property
    def block_size(self) -> tuple[int, int]:
        return self.q_block_size, self.kv_block_size

    @property
    def on_device(self) -> bool:
        return arrays.is_cupy(self.kv_indices)

    # ------------------------------------------------------------- validation
    def _validate(self, features: Optional[MaskFeatures] = None) -> MaskFeatures:
        """Shape checks, then value checks unless ``features`` is given: only the builders pass it,
        for metadata valid by construction, whose value checks would cost reductions and a sync."""
        nb, idx, types = self.kv_num_blocks, self.kv_indices, self.block_mask_types
        pidx, pool = self.partial_block_mask_indices, self.partial_block_masks
        bm, hm, nqb = (int(s) for s in nb.shape)
        if nqb != self.num_q_blocks:
            raise MaskError(
                f"kv_num_blocks has {nqb} q blocks but q_len={self.q_len} with "
                f"q_block_size={self.q_block_size} needs {self.num_q_blocks}"
            )
        if bm < 1 or hm < 1:
            raise MaskError(f"kv_num_blocks must have batch and head dims >= 1, got shape {tuple(nb.shape)}")
        if tuple(idx.shape[:3]) != (bm, hm, nqb):
            raise MaskError(f"kv_indices shape {tuple(idx.shape)} does not start with kv_num_blocks shape {(bm, hm, nqb)}")
        if tuple(types.shape) != tuple(idx.shape):
            raise MaskError(f"block_mask_types shape {tuple(types.shape)} must equal kv_indices shape {tuple(idx.shape)}")
        if pidx is not None and tuple(pidx.shape) != tuple(idx.shape):
            raise MaskError(
                f"partial_block_mask_indices shape {tuple(pidx.shape)} must equal kv_indices shape {tuple(idx.shape)}"
            )
        if pool is not None:
            want = (self.q_block_size, self.kv_block_size // 32)
            if tuple(pool.shape[1:]) != want:
                raise MaskError(
                    f"partial_block_masks must have shape [P, {want[0]}, {want[1]}] "
                    f"(q_block_size, kv_block_size/32), got {tuple(pool.shape)}"
                )
        if (pidx is None) != (pool is None):
            raise MaskError("partial_block_mask_indices and partial_block_masks must be given together")
        modules = {arrays.array_namespace(a).__name__ for a in (nb, idx, types, pidx, pool) if a is not None}
        if len(modules) > 1:
            raise MaskError("block mask arrays must all live on the host (NumPy) or all on the device (CuPy)")
        if features is not None:
            return features
        return validate_metadata(
            nb, idx, types, pidx, pool, num_kv_blocks=self.num_kv_blocks
        )

    # ----------------------------------------------------------------- device
    def device_metadata(self) -> DeviceMetadata:
        """Contiguous device copies of the metadata, cached per CUDA device."""
        cp = arrays.cupy_module()
        dev = cp.cuda.runtime.getDevice()
        cached = self._device_cache.get(dev)
        if cached is None:
            # A batch/head dim that every metadata array broadcasts by stride 0 (np.broadcast_to,
            # expand) is stored once: the kernel broadcasts size-1 dims itself.
            per_bh = [a for a in (self.kv_num_blocks, self.kv_indices, self.block_mask_types,
                                  self.partial_block_mask_indices) if a is not None]
            keep = tuple(slice(0, 1) if all(a.strides[d] == 0 for a in per_bh) else slice(None) for d in (0, 1))

            def dev_array(a, dtype=np.int32, per_batch_head=True):
                if a is None:
                    return None
                return cp.ascontiguousarray(cp.asarray(a[keep] if per_batch_head else a, dtype=dtype))

            nb = dev_array(self.kv_num_blocks)
            stored_b, stored_h, nqb = (int(n) for n in nb.shape)
            cached = DeviceMetadata(
                nb,
                dev_array(self.kv_indices),
                dev_array(self.block_mask_types),
                dev_array(self.partial_block_mask_indices) if self.features.partial else None,
                dev_array(self.partial_block_masks, np.uint32, per_batch_head=False) if self.features.partial else None,
                row_stride_batch=stored_h * nqb if stored_b > 1 else 0,
                row_stride_head=nqb if stored_h > 1 else 0,
            )
            self._device_cache[dev] = cached
        return cached

    # ------------------------------------------------------------ inspection
    def block_grid(self) -> np.ndarray:
        """Block types as a dense ``[Bm, Hm, nQB, nKVB]`` int8 NumPy grid (MASKED where unlisted)."""
        nb = arrays.to_numpy(self.kv_num_blocks)
        idx = arrays.to_numpy(self.kv_indices)
        types = arrays.to_numpy(self.block_mask_types)
        bm, hm, nqb, maxb = idx.shape
        grid = np.zeros((bm, hm, nqb, self.num_kv_blocks), dtype=np.int8)
        active = np.arange(maxb)[None, None, None, :] < nb[..., None]
        b, h, q, e = np.nonzero(active)
        grid[b, h, q, idx[b, h, q, e]] = types[b, h, q, e]
        return grid

    def to_dense(self) -> np.ndarray:
        """The element-level mask ``[Bm, Hm, q_len, kv_len]`` (bool, NumPy) this metadata encodes."""
        nb = arrays.to_numpy(self.kv_num_blocks)
        idx = arrays.to_numpy(self.kv_indices)
        types = arrays.to_numpy(self.block_mask_types)
        pidx = None if self.partial_block_mask_indices is None else arrays.to_numpy(self.partial_block_mask_indices)
        pool = None if self.partial_block_masks is None else arrays.to_numpy(self.partial_block_masks)
        qbs, kbs = self.q_block_size, self.kv_block_size
        bm, hm, nqb, maxb = idx.shape
        dense = np.zeros((bm, hm, nqb * qbs, self.num_kv_blocks * kbs), dtype=bool)
        q_local = np.arange(qbs)[:, None]
        kv_local = np.arange(kbs)[None, :]
        if pool is not None:
            # Unpack the pool once: [P, QBS, KBS] booleans, bit c of word w is column 32w + c.
            bits = (pool[..., None] >> np.arange(32, dtype=np.uint32)) & 1
            pool_dense = bits.reshape(pool.shape[0], qbs, kbs).astype(bool)
        for b, h, q in np.ndindex(bm, hm, nqb):
            for e in range(int(nb[b, h, q])):
                kv, t = int(idx[b, h, q, e]), int(types[b, h, q, e])
                rows = slice(q * qbs, (q + 1) * qbs)
                cols = slice(kv * kbs, (kv + 1) * kbs)
                if t == BlockType.FULL:
                    dense[b, h, rows, cols] = True
                elif t == BlockType.CAUSAL:
                    dense[b, h, rows, cols] |= (q * qbs + q_local) >= (kv * kbs + kv_local)
                elif t == BlockType.PARTIAL:
                    dense[b, h, rows, cols] |= pool_dense[int(pidx[b, h, q, e])]
        return dense[:, :, : self.q_len, : self.kv_len]

    def sparsity(self) -> float:
        """Percent of (q block, kv block) pairs skipped, flex-attention's definition."""
        grid = self.block_grid()
        return 100.0 * (1.0 - np.count_nonzero(grid) / grid.size)

    def to_string(self, batch: int = 0, head: int = 0, max_blocks: int = 64) -> str:
        """One character per block: '#' full, '\\' causal, '+' partial, '.' masked."""
        grid = self.block_grid()[min(batch, self.shape[0] - 1), min(head, self.shape[1] - 1)]
        shown = grid[:max_blocks, :max_blocks]
        lines = ["".join(BLOCK_CHARS[BlockType(int(t))] for t in row) for row in shown]
        if shown.shape != grid.shape:
            lines.append(f"(showing {shown.shape[0]}x{shown.shape[1]} of {grid.shape[0]}x{grid.shape[1]} blocks)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        grid = self.block_grid()
        counts = {t.name.lower(): int(np.count_nonzero(grid == t)) for t in BlockType if t != BlockType.MASKED}
        pool = 0 if self.partial_block_masks is None else int(self.partial_block_masks.shape[0])
        where = "cupy" if self.on_device else "numpy"
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
            f"sparsity={self.sparsity():.2f}%, full={counts['full']}, causal={counts['causal']}, "
            f"partial={counts['partial']}, pool={pool}, arrays={where})"
        )

    # ------------------------------------------------------------- builders
    @classmethod
    def from_block_types(cls, grid: Any, *, q_len: int, kv_len: int, q_block_size: int = 128,
                         kv_block_size: int = 128, partial_grid: Any = None, partial_block_masks: Any = None,
                         mask_mod: Optional[Callable] = None) -> "BlockMask":
        """Build from a dense block-type grid ``[Bm, Hm, nQB, nKVB]`` (values of BlockType).

        Non-masked blocks are listed in increasing kv order. ``partial_grid`` gives each PARTIAL
        block's index into ``partial_block_masks``.
        """
        grid = np.asarray(arrays.to_numpy(grid))
        if grid.ndim != 4:
            raise MaskError(f"block type grid must be 4-D [Bm, Hm, nQB, nKVB], got shape {grid.shape}")
        active = grid != BlockType.MASKED
        nb = active.sum(axis=-1).astype(np.int32)
        maxb = max(int(nb.max()) if nb.size else 0, 1)
        # Stable argsort puts active blocks first, in kv order.
        order = np.argsort(~active, axis=-1, kind="stable")[..., :maxb].astype(np.int32)
        types = np.take_along_axis(grid, order, axis=-1).astype(np.int32)
        slot_active = np.arange(maxb) < nb[..., None]
        types = np.where(slot_active, types, BlockType.MASKED).astype(np.int32)
        indices = np.where(slot_active, order, 0).astype(np.int32)
        pidx = None
        if partial_grid is not None:
            pidx = np.take_along_axis(np.asarray(arrays.to_numpy(partial_grid)), order, axis=-1)
            pidx = np.where(slot_active & (types == BlockType.PARTIAL), pidx, 0).astype(np.int32)
        return cls(nb, indices, types, q_len=q_len, kv_len=kv_len, q_block_size=q_block_size,
                   kv_block_size=kv_block_size, partial_block_mask_indices=pidx,
                   partial_block_masks=partial_block_masks, mask_mod=mask_mod)


def validate_metadata(nb, idx, types, pidx, pool, *, num_kv_blocks: int) -> MaskFeatures:
    """Value checks on the metadata, run where the arrays live (one small reduction on the device,
    a single transfer of a handful of flags back). Returns which block types occur."""
    xp = arrays.array_namespace(idx)
    # Plain ints: CuPy's ufuncs do not accept IntEnum operands.
    causal, partial = int(BlockType.CAUSAL), int(BlockType.PARTIAL)
    maxb = int(idx.shape[3])
    slots = xp.arange(maxb, dtype=np.int32)
    active = slots[None, None, None, :] < nb[..., None]
    is_partial = active & (types == partial)
    # Duplicates: give inactive slots distinct out-of-range values; rows that already increase
    # strictly (what the builders emit) have none, and only otherwise is each row sorted.
    keyed = xp.where(active, idx, num_kv_blocks + slots[None, None, None, :])
    if maxb > 1 and not bool(xp.all(xp.diff(keyed, axis=-1) > 0)):
        dup = xp.any(xp.diff(xp.sort(keyed, axis=-1), axis=-1) == 0)
    else:
        dup = xp.zeros((), dtype=bool)
    npool = 0 if pool is None else int(pool.shape[0])
    checks = [
        xp.any(nb < 0),
        xp.any(nb > maxb),
        xp.any(active & ((idx < 0) | (idx >= num_kv_blocks))),
        xp.any(active & ((types < 0) | (types > partial))),
        dup,
        xp.any(active & (types == causal)),
        xp.any(is_partial),
        xp.any(is_partial & ((pidx < 0) | (pidx >= npool))) if pidx is not None else xp.zeros((), dtype=bool),
    ]
    flags = arrays.to_numpy(xp.stack([xp.asarray(c) for c in checks]))
    nb_neg, nb_big, idx_bad, type_bad, dup, has_causal, has_partial, pidx_bad = (bool(f) for f in flags)
    if nb_neg:
        raise MaskError("kv_num_blocks has negative entries")
    if nb_big:
        raise MaskError(f"kv_num_blocks has entries larger than kv_indices' last dim ({maxb})")
    if idx_bad:
        raise MaskError(f"kv_indices has active entries outside [0, {num_kv_blocks}) (the number of kv blocks)")
    if type_bad:
        raise MaskError("block_mask_types has active entries outside {0 MASKED, 1 CAUSAL, 2 FULL, 3 PARTIAL}")
    if dup:
        raise MaskError("kv_indices lists the same kv block twice in one row; each block may appear once")
    if has_partial and pidx is None:
        raise MaskError("block_mask_types has PARTIAL blocks but no partial_block_mask_indices/partial_block_masks")
    if pidx_bad:
        raise MaskError(f"partial_block_mask_indices has PARTIAL entries outside [0, {npool}) (the pool size)")
    return MaskFeatures(causal=has_causal, partial=has_partial)


__all__ = ["BlockMask", "BlockType", "MaskFeatures", "DeviceMetadata", "cdiv", "validate_metadata"]
