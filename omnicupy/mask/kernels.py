"""The builders' GPU kernels, as omnicupy kernels: rendered and NVRTC-compiled through ``omnicupy.jit``
(so they live in omnicupy's cache and ``omnicupy precompile`` covers them: ``precompile_specs()``).

A build on the GPU launches only these (plus, when a mask_mod must be evaluated element by element,
the CuPy operations of that mask_mod itself): ``indices`` (the index arrays a mask_mod is called
with), ``classify`` (bit-pack, type and hash blocks of boolean elements), ``gather``/``compare``
(the pool from the blocks, and the check of equal hashes), ``layout`` (flex's layout from the
segments of layout.py), and ``pieces_scan``/``pieces_layout`` (a whole build from a MaskMod's
pieces: pieces_build.py). Each is one small ``MaskKernel`` spec; a kernel compiled at first use says so
once through the ``omnicupy.mask`` logger.

``Backend`` is what the builders call on a device: ``KernelBackend`` runs the kernels on CuPy arrays;
``EmulatedBackend`` is the same contract in NumPy (the reference the GPU tests compare the kernels
with, and what lets the CPU tests run the device path's bookkeeping). This module knows launches
and the kernels' contracts; the builders know what to ask.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import VariantError
from . import blocks, patterns
from .blocks import PARTIAL, block_types, hash_multipliers
from .mask_mod import CAUSAL, FULL, MASKED
from .pieces import Pieces
from .types import PARTIAL_WORD_BITS, cdiv, cpp_enum

logger = logging.getLogger("omnicupy.mask")

TEMPLATES = {
    "classify": "mask_classify.cu.jinja",
    "layout": "mask_layout.cu.jinja",
    "gather": "mask_blocks.cu.jinja",
    "compare": "mask_blocks.cu.jinja",
    "indices": "mask_indices.cu.jinja",
    "pieces_scan": "mask_pieces.cu.jinja",
    "pieces_layout": "mask_pieces.cu.jinja",
}
CLASSIFY_WARPS = 8
THREADS = 256
#: The layout kernel loops over slots: at most this many CTAs.
MAX_LAYOUT_CTAS = 4096


@dataclass(frozen=True, order=True)
class MaskKernel:
    """One builder kernel: what ``omnicupy.jit`` needs (name, template, values, arch)."""

    operation: str

    def __post_init__(self) -> None:
        if self.operation not in TEMPLATES:
            raise VariantError(f"unknown mask kernel {self.operation!r}; known: {sorted(TEMPLATES)}")

    @property
    def name(self) -> str:
        return f"omni_mask_{self.operation}"

    @property
    def template(self) -> str:
        return TEMPLATES[self.operation]

    @property
    def smem_bytes(self) -> int:
        return 0

    def template_params(self) -> dict[str, Any]:
        return {"kernel_name": self.name, "operation": self.operation, "block_type_enum": cpp_enum(),
                "warps": CLASSIFY_WARPS}

    def target_arch(self, arch: str) -> str:
        """Plain CUDA: sm_90a devices run the sm_90 binary."""
        return arch[:-1] if arch.endswith("a") else arch


def precompile_specs() -> list[MaskKernel]:
    """Every builder kernel, for ``omnicupy precompile`` (one binary per arch each)."""
    return [MaskKernel(op) for op in sorted(TEMPLATES)]


_ready: set = set()
_compiled_once = False


def load(spec: MaskKernel):
    """The loaded kernel on the current device; a compile (a cache miss) is logged."""
    global _compiled_once
    from .. import jit

    if spec not in _ready:
        arch = jit.device_arch()
        started = time.perf_counter()
        _, built = jit.build(spec, arch)
        if built:  # said once on stderr (WARNING), then at INFO
            level = logging.INFO if _compiled_once else logging.WARNING
            _compiled_once = True
            logger.log(level, "compiled the block-mask kernel %s for %s in %.1f s at its first use; "
                       "`omnicupy precompile` builds the mask kernels ahead of time", spec.name, arch,
                       time.perf_counter() - started)
        _ready.add(spec)
    return jit.get_kernel(spec)


class Backend:
    """What the device path of the builders asks of a device (see the module docstring)."""

    xp: Any

    def upload(self, a: np.ndarray):
        raise NotImplementedError

    def download(self, a) -> np.ndarray:
        raise NotImplementedError

    def block_indices(self, coords, q_block_size: int, kv_block_size: int, q_len: int, kv_len: int):
        """``(q [K, qbs], kv [K, kbs])`` int64: block k's positions from its coords, clamped to the ends."""
        raise NotImplementedError

    def classify(self, elements, positional: bool, coords, q_block_size: int, kv_block_size: int, q_len: int,
                 kv_len: int):
        """``(bits [K, qbs, W] uint32, summary [2K] uint64)`` (see templates/mask_classify.cu.jinja)."""
        raise NotImplementedError

    def gather_blocks(self, src, src_index: np.ndarray, dst=None, dst_index: Optional[np.ndarray] = None):
        """``dst[dst_index[j]] = src[src_index[j]]`` (host indices); a new array when ``dst`` is None."""
        raise NotImplementedError

    def blocks_differ(self, a, a_index: np.ndarray, b, b_index: np.ndarray) -> bool:
        """Whether some ``a[a_index[j]]`` differs from ``b[b_index[j]]`` (waits for the device)."""
        raise NotImplementedError

    def layout(self, table: np.ndarray, rows: int, max_blocks: int, segments: int, with_partial: bool):
        """``(counts [rows], indices, types, partial or None [rows, max_blocks])`` int32 from a
        ``layout.device_table``."""
        raise NotImplementedError

    def stream(self) -> Any:
        """A context in which a build that waits for the device runs (see ``KernelBackend.stream``)."""
        return contextlib.nullcontext()

    def device_id(self) -> int:
        """The device the arrays go to (what device copies are cached per)."""
        return -1

    def pieces_scan(self, pieces, piece_count: int, sizes: tuple[int, int, int, int], capacity: int) -> np.ndarray:
        """The first pass of a build from pieces (templates/mask_pieces.cu.jinja, ``pieces_scan``), read
        back (it waits): host int64 ``[2 + 4 nQB + 2 capacity]``: the PARTIAL blocks' count, the collision
        flag, per q block stats, the records. ``pieces``: the uploaded ``pieces_build.table``;
        ``sizes``: q_len, kv_len, qbs, kbs."""
        raise NotImplementedError

    def pieces_layout(self, pieces, piece_count: int, sizes: tuple[int, int, int, int], lookup: np.ndarray,
                      unique: int, max_blocks: int):
        """The second pass, nothing read back: (counts [nQB], indices, types, pool indices or None
        [nQB, max_blocks], the pool [unique, qbs, kbs / 32] or None). ``lookup``: the pool's hashes
        (ascending, as int64 bits), then a representative block of each (q block * nKVB + kv block)."""
        raise NotImplementedError


class KernelBackend(Backend):
    """The builder kernels on CuPy arrays, on the current device and stream."""

    def __init__(self, cp) -> None:
        self.xp = cp

    def upload(self, a):
        return self.xp.asarray(a)

    def download(self, a):
        return self.xp.asnumpy(a)

    def block_indices(self, coords, q_block_size, kv_block_size, q_len, kv_len):
        cp = self.xp
        k = int(coords.shape[0])
        q = cp.empty((k, q_block_size), dtype=np.int64)
        kv = cp.empty((k, kv_block_size), dtype=np.int64)
        if k:
            load(MaskKernel("indices"))((k,), (128,), (coords, np.int32(q_block_size), np.int32(kv_block_size),
                                                      np.int32(q_len), np.int32(kv_len), q, kv))
        return q, kv

    def classify(self, elements, positional, coords, q_block_size, kv_block_size, q_len, kv_len):
        cp = self.xp
        k = int(coords.shape[0])
        words = kv_block_size // PARTIAL_WORD_BITS
        bits = cp.empty((k, q_block_size, words), dtype=np.uint32)
        summary = cp.empty(2 * k, dtype=np.uint64)
        if not k:
            return bits, summary
        strides = [int(s) for s in elements.strides]  # bytes: one per bool
        if positional:  # a [B, H, Nq, Nkv] mask
            s_block, (s_b, s_h, s_q, s_kv) = 0, strides
        else:  # an evaluated [K, qbs, kbs] grid
            (s_block, s_q, s_kv), s_b, s_h = strides, 0, 0
        multipliers = _device_multipliers(cp, q_block_size * words)
        load(MaskKernel("classify"))(
            (k,), (CLASSIFY_WARPS * 32,),
            (elements, np.int64(s_block), np.int64(s_b), np.int64(s_h), np.int64(s_q), np.int64(s_kv),
             np.int32(1 if positional else 0), coords, np.int32(k), np.int32(q_block_size), np.int32(kv_block_size),
             np.int32(q_len), np.int32(kv_len), multipliers, bits, summary))
        return bits, summary

    def gather_blocks(self, src, src_index, dst=None, dst_index=None):
        cp = self.xp
        n = len(src_index)
        if dst is None:
            dst = cp.empty((n,) + tuple(src.shape[1:]), dtype=src.dtype)
            dst_index = np.arange(n)
        if n:
            pairs = cp.asarray(np.stack([src_index, dst_index], axis=1).astype(np.int64))
            words = int(np.prod(src.shape[1:]))
            load(MaskKernel("gather"))((min(n, 65535),), (128,), (src, dst, pairs, np.int32(words), np.int32(n)))
        return dst

    def blocks_differ(self, a, a_index, b, b_index):
        cp = self.xp
        n = len(a_index)
        if not n:
            return False
        pairs = cp.asarray(np.stack([a_index, b_index], axis=1).astype(np.int64))
        differ = cp.zeros(1, dtype=np.int32)
        words = int(np.prod(a.shape[1:]))
        load(MaskKernel("compare"))((min(n, 65535),), (128,), (a, b, pairs, np.int32(words), np.int32(n), differ))
        return bool(int(differ.get()[0]))

    def layout(self, table, rows, max_blocks, segments, with_partial):
        cp = self.xp
        table = cp.asarray(table)
        counts = cp.empty(rows, dtype=np.int32)
        idx = cp.empty((rows, max_blocks), dtype=np.int32)
        types = cp.empty((rows, max_blocks), dtype=np.int32)
        pidx = cp.empty((rows, max_blocks), dtype=np.int32) if with_partial else cp.empty(1, dtype=np.int32)
        slots = rows * max_blocks
        ctas = max(1, min(cdiv(slots, THREADS), MAX_LAYOUT_CTAS))
        load(MaskKernel("layout"))((ctas,), (THREADS,), (table, np.int64(rows), np.int32(max_blocks),
                                                         np.int32(segments), np.int32(1 if with_partial else 0),
                                                         counts, idx, types, pidx))
        return counts, idx, types, pidx if with_partial else None

    def device_id(self):
        return self.xp.cuda.runtime.getDevice()

    def stream(self):
        """A non-blocking stream of this device's own: a build that reads results back waits for
        its own kernels only, not behind work queued on the caller's stream."""
        device = self.device_id()
        if device not in _build_streams:
            _build_streams[device] = self.xp.cuda.Stream(non_blocking=True)
        return _build_streams[device]

    def pieces_scan(self, pieces, piece_count, sizes, capacity):
        cp = self.xp
        q_len, kv_len, qbs, kbs = sizes
        nqb = cdiv(q_len, qbs)
        slots = 1 << (2 * capacity - 1).bit_length()  # a power of two, over twice the claims
        read = 2 + 4 * nqb + 2 * capacity
        out = cp.zeros(read + 2 * slots, dtype=np.int64)  # what is read back, then the hash table
        multipliers = _device_multipliers(cp, qbs * kbs // PARTIAL_WORD_BITS)
        load(MaskKernel("pieces_scan"))((nqb,), (pieces_threads(qbs),),
                                        (pieces, np.int32(piece_count), np.int32(q_len), np.int32(kv_len),
                                         np.int32(qbs), np.int32(kbs), multipliers, out, np.int32(capacity),
                                         np.int32(slots)))
        return out[:read].get()

    def pieces_layout(self, pieces, piece_count, sizes, lookup, unique, max_blocks):
        cp = self.xp
        q_len, kv_len, qbs, kbs = sizes
        nqb = cdiv(q_len, qbs)
        slots = nqb * max_blocks
        arrays = 3 if unique else 2
        out = cp.empty(nqb + arrays * slots, dtype=np.int32)  # one allocation, viewed as the arrays
        counts, idx, types = out[:nqb], out[nqb:nqb + slots], out[nqb + slots:nqb + 2 * slots]
        pidx = out[nqb + 2 * slots:] if unique else None
        pool = cp.empty((unique, qbs, kbs // PARTIAL_WORD_BITS), dtype=np.uint32) if unique else None
        load(MaskKernel("pieces_layout"))(
            (nqb + unique,), (pieces_threads(qbs),),
            (pieces, np.int32(piece_count), np.int32(q_len), np.int32(kv_len), np.int32(qbs), np.int32(kbs),
             _device_multipliers(cp, qbs * kbs // PARTIAL_WORD_BITS), cp.asarray(lookup), np.int32(unique),
             np.int32(max_blocks), counts, idx, types,
             np.intp(0) if pidx is None else pidx, np.intp(0) if pool is None else pool))
        shape = (nqb, max_blocks)
        return counts, idx.reshape(shape), types.reshape(shape), None if pidx is None else pidx.reshape(shape), pool


#: A build's own stream per device (KernelBackend.stream).
_build_streams: dict = {}
_device_tables: dict = {}


def pieces_threads(q_block_size: int) -> int:
    """Threads of a pieces kernel's CTA: one per row of the q block, in whole warps."""
    return cdiv(q_block_size, 32) * 32


def _device_multipliers(cp, n_words: int):
    key = (cp.cuda.runtime.getDevice(), n_words)
    if key not in _device_tables:
        _device_tables[key] = cp.asarray(hash_multipliers(n_words))
    return _device_tables[key]


class EmulatedBackend(Backend):
    """The kernels' contracts in NumPy: the reference for the GPU tests, and the device path's
    bookkeeping on the CPU. ``xp`` must behave as NumPy."""

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp

    def upload(self, a):
        return np.array(a)

    def download(self, a):
        return np.array(a)

    def block_indices(self, coords, q_block_size, kv_block_size, q_len, kv_len):
        q = np.minimum(coords[:, 2, None] + np.arange(q_block_size), q_len - 1)
        kv = np.minimum(coords[:, 3, None] + np.arange(kv_block_size), kv_len - 1)
        return q.astype(np.int64), kv.astype(np.int64)

    def classify(self, elements, positional, coords, q_block_size, kv_block_size, q_len, kv_len):
        k = len(coords)
        b, h, q0, kv0 = (coords[:, i] for i in range(4))
        rows = np.arange(q_block_size)
        cols = np.arange(kv_block_size)
        real = ((rows < (q_len - q0)[:, None])[:, :, None] & (cols < (kv_len - kv0)[:, None])[:, None, :])
        if positional:
            q = np.minimum(q0[:, None, None] + rows[None, :, None], q_len - 1)
            kv = np.minimum(kv0[:, None, None] + cols[None, None, :], kv_len - 1)
            values = elements[b[:, None, None], h[:, None, None], q, kv]
        else:
            values = np.broadcast_to(elements, (k, q_block_size, kv_block_size))
        values = np.asarray(values, dtype=bool) & real
        bits = np.packbits(values, axis=-1, bitorder="little").view(np.uint32).reshape(
            k, q_block_size, kv_block_size // PARTIAL_WORD_BITS).copy()
        types = block_types(bits, q0, kv0, q_len, kv_len)
        summary = np.concatenate([blocks.block_hashes(bits), types.astype(np.uint64)]) if k else np.zeros(0, np.uint64)
        return bits, summary

    def gather_blocks(self, src, src_index, dst=None, dst_index=None):
        if dst is None:
            return src[np.asarray(src_index, dtype=np.int64)].copy()
        dst[np.asarray(dst_index, dtype=np.int64)] = src[np.asarray(src_index, dtype=np.int64)]
        return dst

    def blocks_differ(self, a, a_index, b, b_index):
        return bool(len(a_index)) and not np.array_equal(a[np.asarray(a_index)], b[np.asarray(b_index)])

    def layout(self, table, rows, max_blocks, segments, with_partial):
        counts = table[:rows]
        starts, offsets, kinds, pool = (table[rows + i * segments: rows + (i + 1) * segments] for i in range(4))
        slot = np.arange(rows * max_blocks, dtype=np.int64)
        active = (slot % max_blocks) < np.repeat(counts, max_blocks)
        seg = np.searchsorted(starts, slot, side="right") - 1
        seg = np.where(active, seg, 0)
        pick = (lambda v: np.where(active, v[seg], 0)) if segments else (lambda v: np.zeros(len(slot), np.int64))
        shape = (rows, max_blocks)
        idx = np.where(active, slot + (offsets[seg] if segments else 0), 0)
        return (counts.astype(np.int32), idx.astype(np.int32).reshape(shape), pick(kinds).astype(np.int32).reshape(shape),
                pick(pool).astype(np.int32).reshape(shape) if with_partial else None)

    def pieces_scan(self, pieces, piece_count, sizes, capacity):
        q_len, kv_len, qbs, kbs = sizes
        nqb = cdiv(q_len, qbs)
        block, kv_block, types, codes = _pieces_blocks(np.asarray(pieces), piece_count, sizes)
        partial = types == PARTIAL
        stats = np.zeros((nqb, 4), dtype=np.int64)
        for column, kind in ((1, FULL), (2, CAUSAL), (3, PARTIAL)):
            stats[:, column] = np.bincount(block[types == kind], minlength=nqb)
        stats[:, 0] = stats[:, 1:].sum(axis=1)
        flat = block[partial] * cdiv(kv_len, kbs) + kv_block[partial]
        hashes = (blocks.block_hashes(patterns.packed_bits(codes[partial], kbs)) if partial.any()
                  else np.zeros(0, np.uint64))
        records = np.stack([flat, hashes.view(np.int64)], axis=1)[::-1][:capacity]  # in no order, as the atomics
        _, first, group = np.unique(hashes, return_index=True, return_inverse=True)
        # The kernel's check: every block has the bits of the first block with its hash (a hash of 0
        # cannot be claimed: also a collision).
        same = np.array_equal(codes[partial], codes[partial][first[group.reshape(-1)]])
        collision = not same or bool(np.any(hashes == 0))
        out = np.zeros(2 + 4 * nqb + 2 * capacity, dtype=np.int64)
        out[0], out[1] = len(flat), collision
        out[2:2 + 4 * nqb] = stats.reshape(-1)
        out[2 + 4 * nqb:2 + 4 * nqb + records.size] = records.reshape(-1)
        return out

    def pieces_layout(self, pieces, piece_count, sizes, lookup, unique, max_blocks):
        q_len, kv_len, qbs, kbs = sizes
        nqb, nkvb = cdiv(q_len, qbs), cdiv(kv_len, kbs)
        block, kv_block, types, codes = _pieces_blocks(np.asarray(pieces), piece_count, sizes)
        listed = types != MASKED
        block, kv_block, types, codes = block[listed], kv_block[listed], types[listed], codes[listed]
        counts = np.bincount(block, minlength=nqb).astype(np.int32)
        slot = np.arange(len(block)) - np.repeat(np.cumsum(counts) - counts, counts)
        idx, kinds, pidx = (np.zeros((nqb, max_blocks), dtype=np.int32) for _ in range(3))
        idx[block, slot], kinds[block, slot] = kv_block, types
        partial = np.flatnonzero(types == PARTIAL)
        pool_hash = np.asarray(lookup[:unique]).view(np.uint64)
        if partial.size:
            hashes = blocks.block_hashes(patterns.packed_bits(codes[partial], kbs))
            pidx[block[partial], slot[partial]] = np.searchsorted(pool_hash, hashes)
        where = np.searchsorted(block * nkvb + kv_block, lookup[unique:2 * unique])  # representatives are listed
        pool = patterns.packed_bits(codes[where], kbs) if unique else None
        return counts, idx, kinds, pidx if unique else None, pool


def _pieces_blocks(pieces: np.ndarray, piece_count: int, sizes: tuple[int, int, int, int]):
    """(q block, kv block, type, row codes) of every block between the first and the last kv block that
    the rows of a q block reach, in (q block, kv block) order: each classified from its rows, with no
    FULL shortcut (the emulation: small sizes only)."""
    q_len, kv_len, qbs, kbs = sizes
    nqb = cdiv(q_len, qbs)
    first, last = (np.clip(a, 0, kv_len).reshape(nqb, qbs)
                   for a in Pieces(*pieces.reshape(5, piece_count)).rows(nqb * qbs))
    allows = (first < last) & (np.arange(nqb * qbs) < q_len).reshape(nqb, qbs)
    big = np.iinfo(np.int64).max
    lo = np.where(allows, first, big).min(axis=1) // kbs  # [lo, hi): the kv blocks some row reaches, and
    hi = -(-np.where(allows, last, 0).max(axis=1) // kbs)  # between two reached ones (MASKED, if any)
    kv = np.arange(cdiv(kv_len, kbs))
    block, kv_block = np.nonzero((kv >= lo[:, None]) & (kv < hi[:, None]))
    types, codes = patterns.cut_blocks(first[block], last[block], block * qbs, kv_block * kbs, q_len, kv_len, kbs)
    return block, kv_block, types, codes


def backend_for(xp: Any) -> Optional[Backend]:
    """The device backend for the array module ``xp``: None for NumPy (the host path), the kernels for
    CuPy, the emulation for anything else that behaves as NumPy (tests)."""
    if xp is np:
        return None
    if getattr(xp, "__name__", "") == "cupy":
        return KernelBackend(xp)
    return EmulatedBackend(xp)


__all__ = ["MaskKernel", "precompile_specs", "load", "Backend", "KernelBackend", "EmulatedBackend", "backend_for",
           "TEMPLATES", "logger"]
