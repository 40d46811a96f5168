"""BlockMask: the block-sparse metadata the kernel walks (docs/design.md, "Block mask metadata"; flex-attention layout).

A BlockMask lists, for every (batch, head, q block), which kv blocks to visit and how much masking
each needs: CAUSAL (element rule ``q_idx >= kv_idx``), FULL (none) or PARTIAL (a bit-packed
element mask from a deduplicated pool). Blocks not listed are skipped without a load.

A BlockMask owns what it validated and cannot change afterwards: arrays passed in are copied; host
arrays are frozen on immutable memory (frozen.py: ``flags.writeable = True`` is refused, on them and
on every array they view), device arrays stay private (reading a public one gives a copy), public
attributes cannot be reassigned (MaskError), and the upload (``device_metadata``) checks that the
validated arrays are still the ones held. Validation runs where the arrays
live (NumPy or CuPy: one reduction and one small transfer back) and also yields a summary (block
counts per type, the work of each q block) that inspection and the launch order read without
touching the metadata again. Inspection (``repr``, ``sparsity``, ``to_string``) takes memory in
proportion to the listed blocks, never to the nQB x nKVB grid. This module knows the layout and
its rules; the builders (builders.py) know how masks become metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import MaskError
from . import display, registry
from .frozen import freeze
from .metadata_checks import MaskSummary, causal_band, validate_metadata
from .constructors import BuilderMethods
from .types import (KV_BLOCK_MULTIPLE, PARTIAL_WORD_BITS, Q_BLOCK_MULTIPLE, WORK_WEIGHTS, BlockType, MaskFeatures,
                    cdiv, max_length)

#: ``block_grid`` and ``to_dense`` build dense arrays; past these sizes they refuse.
MAX_GRID_ENTRIES = 1 << 28
MAX_DENSE_ELEMENTS = 1 << 31


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


@dataclass(frozen=True)
class RowRuns:
    """The listed blocks as runs, when a builder knows them (host, O(runs)): run i is ``length[i]``
    blocks of type ``kind[i]`` from kv block ``kv[i]`` on, in row ``row[i]`` of the stored grid
    ``[Bs, Hs, nQB]`` (flattened). Inspection reads these instead of the metadata's slots."""

    grid: tuple[int, int, int]
    row: np.ndarray
    kv: np.ndarray
    length: np.ndarray
    kind: np.ndarray

    def of(self, batch: int, head: int) -> tuple[np.ndarray, ...]:
        """(q block, kv, length, kind) of the rows of (batch, head) (broadcast dims: their one row)."""
        bs, hs, nqb = self.grid
        first = ((batch if bs > 1 else 0) * hs + (head if hs > 1 else 0)) * nqb
        lo, hi = np.searchsorted(self.row, [first, first + nqb])
        return self.row[lo:hi] - first, self.kv[lo:hi], self.length[lo:hi], self.kind[lo:hi]


def _check_positive_int(value: Any, name: str, multiple: int = 1) -> int:
    return check_int(value, name, minimum=1, multiple=multiple, error=MaskError)


def check_sizes(q_len: Any, kv_len: Any, q_block_size: Any = 128, kv_block_size: Any = 128) -> tuple[int, int, int, int]:
    """Lengths and block sizes as ints, checked against what the kernels can index (before any
    allocation: a length the int32 metadata cannot hold is refused here, not by a MemoryError)."""
    qbs = _check_positive_int(q_block_size, "q_block_size", Q_BLOCK_MULTIPLE)
    kbs = _check_positive_int(kv_block_size, "kv_block_size", KV_BLOCK_MULTIPLE)
    lengths = []
    for name, value, block, block_name in (("q_len", q_len, qbs, "q_block_size"), ("kv_len", kv_len, kbs, "kv_block_size")):
        n = _check_positive_int(value, name)
        if n > max_length(block):
            raise MaskError(f"{name}={n} is too long: positions are 32-bit ints in the kernels and the block metadata, "
                            f"so with {block_name}={block} {name} can be at most {max_length(block)} (2**31 less two "
                            "blocks)")
        lengths.append(n)
    return lengths[0], lengths[1], qbs, kbs


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


def owned_copy(a: Any):
    """A copy of ``a`` that nobody else holds (NumPy: frozen, see frozen.py). Dims broadcast by a zero stride
    stay broadcast: their one stored row is copied, not the broadcast."""
    if a is None:
        return None
    xp = arrays.array_namespace(a)
    stored = tuple(slice(0, 1) if n > 1 and s == 0 else slice(None) for n, s in zip(a.shape, a.strides))
    compact = xp.array(a[stored], copy=True)
    if xp is np:
        compact = freeze(compact)
    return compact if compact.shape == a.shape else xp.broadcast_to(compact, a.shape)


def _pointer(a: Any) -> int:
    return int(a.data.ptr) if arrays.is_cupy(a) else int(a.__array_interface__["data"][0])


#: Attributes fixed once a BlockMask is validated (besides every public name).
_SEALED = frozenset({"_kv_num_blocks", "_kv_indices", "_block_mask_types", "_partial_block_mask_indices",
                     "_partial_block_masks", "_runs", "_fingerprint", "_sealed", "_device_cache"})


class BlockMask(BuilderMethods):
    """Block-sparse attention mask in flex-attention's layout plus a per-block type.

    Parameters mirror docs/design.md, "Block mask metadata". ``Bm`` and ``Hm`` (the first two dims) may be 1 to broadcast
    over batch and heads. ``mask_mod``, when known, is remembered so the reference and fused
    kernels can use the element rule directly. The arrays are copied (see the module's docstring).

    ``q_block_work`` (``[nQB]`` int64 NumPy, read-only) is the estimated cost of each q block,
    known without reading the metadata back from the device.
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
        _summary: Optional[MaskSummary] = None,
        _runs: Optional[RowRuns] = None,
        _rule: Optional[str] = None,
    ) -> None:
        self.q_len, self.kv_len, self.q_block_size, self.kv_block_size = check_sizes(q_len, kv_len, q_block_size,
                                                                                     kv_block_size)
        given = [
            _as_index_array(kv_num_blocks, "kv_num_blocks", 3),
            _as_index_array(kv_indices, "kv_indices", 4),
            _as_index_array(block_mask_types, "block_mask_types", 4),
            None if partial_block_mask_indices is None
            else _as_index_array(partial_block_mask_indices, "partial_block_mask_indices", 4),
            None if partial_block_masks is None
            else _as_index_array(partial_block_masks, "partial_block_masks", 3, unsigned=True),
        ]
        trusted = _features is not None and _summary is not None  # made by a builder, for this mask only
        if not trusted:
            given = [owned_copy(a) for a in given]
        given = [freeze(a) for a in given]  # builders' arrays too: read-only is not enough (frozen.py)
        (self._kv_num_blocks, self._kv_indices, self._block_mask_types, self._partial_block_mask_indices,
         self._partial_block_masks) = given
        self.mask_mod = mask_mod
        self._runs = _runs if trusted else None
        self._device_cache: dict[int, DeviceMetadata] = {}
        self._tile_orders: dict = {}  # dispatch/schedule.launch_order per tile height, device copies
        self._recipes = None  # ops/recall.py: its RecipeStore (steady-state launches), made on first use
        self._backward_index: dict = {}  # ops/backward_index.py: the transposed index, per device
        #: A built-in rule ("full", "causal": top-left) when a builder made this mask from one: the
        #: same element mask exists at every block size (builders.reblocked); None otherwise.
        self.rule: Optional[str] = _rule if trusted else None
        self._reblocked: dict = {}  # builders.reblocked: this mask at other q block sizes
        self._check_shapes()
        if trusted:
            self.features, self.summary = _features, _summary
        else:
            self.features, self.summary = validate_metadata(*given, q_len=self.q_len, kv_len=self.kv_len,
                                                            q_block_size=self.q_block_size,
                                                            kv_block_size=self.kv_block_size)
        self.q_block_work = freeze(np.array(self.summary.q_block_work, dtype=np.int64))
        #: This mask's process-unique serial (mask/registry.py), the plain string by which a compiled
        #: graph (omnicupy.torch) names it; sealed with the rest.
        self.serial: str = registry.enroll(self)
        self._fingerprint = self._metadata_fingerprint()
        self._sealed = True

    # -------------------------------------------------------- immutability
    # Validation vouches for the arrays it read: they are frozen (NumPy) or private (CuPy: each
    # read of a public array gives a copy), the public attributes cannot be reassigned, and the
    # upload (device_metadata) checks that the validated arrays are still the ones held.
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed") and (name in _SEALED or not name.startswith("_")):
            raise MaskError(f"BlockMask.{name} cannot be changed after validation; build a new BlockMask")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise MaskError(f"BlockMask.{name} cannot be deleted")

    def _metadata_fingerprint(self) -> tuple:
        return tuple(None if a is None else (id(a), _pointer(a), tuple(a.shape), tuple(a.strides))
                     for a in self._metadata())

    def _metadata(self) -> tuple:
        return (self._kv_num_blocks, self._kv_indices, self._block_mask_types, self._partial_block_mask_indices,
                self._partial_block_masks)

    def _public(self, a: Any) -> Any:
        return a.copy() if a is not None and arrays.is_cupy(a) else a

    @property
    def kv_num_blocks(self) -> Any:
        """[Bm, Hm, nQB] int32 (NumPy: frozen; CuPy: a copy on each read)."""
        return self._public(self._kv_num_blocks)

    @property
    def kv_indices(self) -> Any:
        """[Bm, Hm, nQB, maxB] int32 (NumPy: frozen; CuPy: a copy on each read)."""
        return self._public(self._kv_indices)

    @property
    def block_mask_types(self) -> Any:
        """[Bm, Hm, nQB, maxB] int32 BlockType values (NumPy: frozen; CuPy: a copy on each read)."""
        return self._public(self._block_mask_types)

    @property
    def partial_block_mask_indices(self) -> Any:
        """[Bm, Hm, nQB, maxB] int32 or None (NumPy: frozen; CuPy: a copy on each read)."""
        return self._public(self._partial_block_mask_indices)

    @property
    def partial_block_masks(self) -> Any:
        """[P, q_block_size, kv_block_size / 32] uint32 or None (NumPy: frozen; CuPy: a copy on each read)."""
        return self._public(self._partial_block_masks)

    # ------------------------------------------------------------------ shape
    @property
    def num_q_blocks(self) -> int:
        return cdiv(self.q_len, self.q_block_size)

    @property
    def num_kv_blocks(self) -> int:
        return cdiv(self.kv_len, self.kv_block_size)

    @property
    def max_blocks(self) -> int:
        return int(self._kv_indices.shape[3])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, q_len, kv_len), like flex's ``BlockMask.shape``."""
        bm, hm = self._kv_num_blocks.shape[:2]
        return int(bm), int(hm), self.q_len, self.kv_len

    @property
    def block_size(self) -> tuple[int, int]:
        return self.q_block_size, self.kv_block_size

    @property
    def on_device(self) -> bool:
        return arrays.is_cupy(self._kv_indices)

    # ------------------------------------------------------------- validation
    def _check_shapes(self) -> None:
        nb, idx, types = self._kv_num_blocks, self._kv_indices, self._block_mask_types
        pidx, pool = self._partial_block_mask_indices, self._partial_block_masks
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
            want = (self.q_block_size, self.kv_block_size // PARTIAL_WORD_BITS)
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

    # ----------------------------------------------------------------- device
    def device_metadata(self) -> DeviceMetadata:
        """Contiguous device copies of the metadata, cached per CUDA device."""
        if self._metadata_fingerprint() != self._fingerprint:
            raise MaskError("this BlockMask's metadata was replaced after validation; build a new BlockMask")
        cp = arrays.cupy_module()
        dev = cp.cuda.runtime.getDevice()
        cached = self._device_cache.get(dev)
        if cached is None:
            # A batch/head dim that every metadata array broadcasts by stride 0 (np.broadcast_to,
            # expand) is stored once: the kernel broadcasts size-1 dims itself.
            per_bh = [a for a in (self._kv_num_blocks, self._kv_indices, self._block_mask_types,
                                  self._partial_block_mask_indices) if a is not None]
            keep = tuple(slice(0, 1) if all(a.strides[d] == 0 for a in per_bh) else slice(None) for d in (0, 1))

            # Host metadata goes up without synchronizing (arrays.upload), also while a CUDA graph
            # is being captured.
            def dev_array(a, dtype=np.int32, per_batch_head=True):
                if a is None:
                    return None
                a = a[keep] if per_batch_head else a
                if not arrays.is_cupy(a):
                    # Host arrays may be strided views (the compact causal rows): made contiguous
                    # here, on the host, so that the device needs no copy kernel.
                    return arrays.upload(np.ascontiguousarray(a, dtype=dtype))
                return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))

            nb = dev_array(self._kv_num_blocks)
            stored_b, stored_h, nqb = (int(n) for n in nb.shape)
            cached = DeviceMetadata(
                nb,
                dev_array(self._kv_indices),
                dev_array(self._block_mask_types),
                dev_array(self._partial_block_mask_indices) if self.features.partial else None,
                dev_array(self._partial_block_masks, np.uint32, per_batch_head=False) if self.features.partial else None,
                row_stride_batch=stored_h * nqb if stored_b > 1 else 0,
                row_stride_head=nqb if stored_h > 1 else 0,
            )
            self._device_cache[dev] = cached
        return cached

    # ------------------------------------------------------------ inspection
    def _num_pairs(self) -> int:
        bm, hm = self.shape[:2]
        return bm * hm * self.num_q_blocks * self.num_kv_blocks

    def block_grid(self) -> np.ndarray:
        """Block types as a dense ``[Bm, Hm, nQB, nKVB]`` int8 NumPy grid (MASKED where unlisted).
        For small masks (tests, plots): refused past ``MAX_GRID_ENTRIES`` pairs."""
        if self._num_pairs() > MAX_GRID_ENTRIES:
            raise MaskError(f"block_grid() would hold {self._num_pairs()} entries (more than {MAX_GRID_ENTRIES}); "
                            "use sparsity(), to_string() or the metadata rows instead")
        nb = arrays.to_numpy(self._kv_num_blocks)
        idx = arrays.to_numpy(self._kv_indices)
        types = arrays.to_numpy(self._block_mask_types)
        bm, hm, nqb, maxb = idx.shape
        grid = np.zeros((bm, hm, nqb, self.num_kv_blocks), dtype=np.int8)
        active = np.arange(maxb)[None, None, None, :] < nb[..., None]
        b, h, q, e = np.nonzero(active)
        grid[b, h, q, idx[b, h, q, e]] = types[b, h, q, e]
        return grid

    def to_dense(self) -> np.ndarray:
        """The element-level mask ``[Bm, Hm, q_len, kv_len]`` (bool, NumPy) this metadata encodes.
        For small masks: refused past ``MAX_DENSE_ELEMENTS`` elements."""
        bm, hm = self.shape[:2]
        qbs, kbs = self.q_block_size, self.kv_block_size
        elements = bm * hm * self.num_q_blocks * qbs * self.num_kv_blocks * kbs
        if elements > MAX_DENSE_ELEMENTS:
            raise MaskError(f"to_dense() would hold {elements} elements (more than {MAX_DENSE_ELEMENTS}); it is for "
                            "small masks")
        nb = arrays.to_numpy(self._kv_num_blocks)
        idx = arrays.to_numpy(self._kv_indices)
        types = arrays.to_numpy(self._block_mask_types)
        pidx = None if self._partial_block_mask_indices is None else arrays.to_numpy(self._partial_block_mask_indices)
        pool = None if self._partial_block_masks is None else arrays.to_numpy(self._partial_block_masks)
        nqb, maxb = idx.shape[2:]
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
        return 100.0 * (1.0 - self.summary.visited / self._num_pairs())

    def to_string(self, batch: int = 0, head: int = 0, width: int = 64) -> str:
        """One character per block: '#' full, '\\' causal, '+' partial, '.' masked; when the grid is
        wider or taller than ``width`` blocks, one character per square of blocks (see
        ``display.picture``). Reads one (batch, head)'s rows a chunk at a time."""
        width = check_int(width, "width", minimum=1, error=MaskError)
        b = check_int(batch, "batch", minimum=0, maximum=self.shape[0] - 1, error=MaskError)  # the mask's own dims
        h = check_int(head, "head", minimum=0, maximum=self.shape[1] - 1, error=MaskError)
        runs = None if self._runs is None else self._runs.of(b, h)
        return display.picture(self._kv_num_blocks[b, h], self._kv_indices[b, h], self._block_mask_types[b, h],
                               self.num_kv_blocks, width, runs=runs)

    def __repr__(self) -> str:
        counts = dict(zip((t.name.lower() for t in BlockType), self.summary.counts))
        pool = 0 if self._partial_block_masks is None else int(self._partial_block_masks.shape[0])
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
        block's index into ``partial_block_masks``. For small grids (it sorts every row).
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


__all__ = ["BlockMask", "BlockType", "MaskFeatures", "MaskSummary", "RowRuns", "DeviceMetadata", "cdiv", "validate_metadata",
           "check_sizes", "causal_band", "owned_copy"]
