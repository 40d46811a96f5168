"""What the benchmark measures: its masks, shapes and cases, and the arithmetic behind the numbers.

Pure Python and NumPy (CuPy only when handed CuPy arrays); nothing here needs torch or a GPU.

Every benchmark mask is defined once, here, as a *rule* written with operators and table lookups
only, so that the same code evaluates on NumPy, CuPy and torch index tensors:

    rule(q_idx, kv_idx, *tables) -> bool array

``MaskCase.array_mod()`` binds NumPy/CuPy tables (for the reference, the density count and, when
omnicupy.masks has no equivalent, omnicupy's builder); ``MaskCase.torch_mod(device)`` binds torch
tables for flex_attention's ``create_block_mask``. Every system therefore sees one mask.

The random block-sparse masks are the exception for flex: Inductor cannot fit its flex template
with their rule inlined (two table lookups plus a hash: "out of resource: shared memory, Required:
262144" at D=128). flex gets them the standard way for an arbitrary mask instead, as a lookup into
a dense bool ``[N, N]`` tensor that ``MaskCase.dense()`` evaluates from the same rule (NumPy,
once per mask and N; ``dense_mod`` makes the mask_mod). ``MaskCase.flex_dense`` marks these masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

#: Token budget per batch: B = max(1, TOKENS // N), so B·N stays near 16k.
TOKENS = 16384
HEADS = 16
BLOCK = 128  # q and kv block size of every block mask (omnicupy's and flex's default)
SEED = 20261121

MASK_NAMES = ("full", "causal", "sliding_window", "document", "prefix_lm", "interleaved", "random_50", "random_10")
HEAD_DIMS = (64, 128, 256)
SEQ_LENS = (1024, 4096, 8192, 16384)
DTYPES = ("fp16", "bf16")
DEFAULT_SEQ_LENS = (8192,)

OMNICUPY = "omnicupy"
FLEX = "flex"
SDPA_FLASH = "sdpa_flash"
SDPA_CUDNN = "sdpa_cudnn"
SYSTEMS = ("omnicupy_stage1", "omnicupy_stage2", OMNICUPY, FLEX, SDPA_FLASH, SDPA_CUDNN)
#: Systems run only when named in --systems: omnicupy's backward with deterministic=True.
OMNICUPY_DETERMINISTIC = "omnicupy_det"
EXTRA_SYSTEMS = (OMNICUPY_DETERMINISTIC,)

#: What a run times (--pass) and its FLOPs in units of the forward's 4·B·H·pairs·D: the backward
#: counts 2.5 times the forward (five matrix products to the forward's two), forward+backward 3.5.
PASSES = ("fwd", "bwd", "fwdbwd")
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

#: Masks SDPA can express (is_causal=True or nothing).
SDPA_MASKS = ("full", "causal")
#: flex_attention is not benchmarked at head dims above this (it handles 256 poorly).
FLEX_MAX_HEAD_DIM = 128

WINDOW = 1024
DOC_MIN, DOC_MAX = 256, 2048
TEXT_LEN, IMAGE_LEN = 512, 576
RANDOM_PARTIAL_FRACTION = 0.25

# Block kinds in the random block-sparse table.
_SKIP, _FULL, _PARTIAL = 0, 1, 2


# --------------------------------------------------------------------------- rules
# Operators and indexing only: each must give identical answers on NumPy, CuPy and torch integer
# tensors (int32 or int64), so intermediate values stay below 2**31.

def _rule_full(q, kv):
    return (q >= 0) & (kv >= 0)


def _rule_causal(q, kv):
    return q >= kv


def _sliding_rule(window: int) -> Callable:
    def rule(q, kv):
        """Causal window: ``0 <= q - kv < window`` (each query sees at most ``window`` keys)."""
        return (q >= kv) & (q - kv < window)
    return rule


def _prefix_rule(prefix: int) -> Callable:
    def rule(q, kv):
        """Bidirectional prefix, causal after it: ``kv < prefix or q >= kv``."""
        return (kv < prefix) | (q >= kv)
    return rule


def _rule_document(q, kv, doc):
    """Causal inside each document: ``doc[q] == doc[kv] and q >= kv``."""
    return (doc[q] == doc[kv]) & (q >= kv)


def _interleaved_rule(text: int, image: int) -> Callable:
    period = text + image

    def rule(q, kv):
        """Repeating [text | image] spans. Text: causal. Image: everything before the image's end."""
        r = q % period
        image_end = q - r + period
        return (kv <= q) | ((r >= text) & (kv < image_end))
    return rule


def hash_bit(q, kv, seed):
    """A pseudo-random 0/1 per element of a block, from block-local coordinates and a block seed.

    Stays below 2**31 for seed < 4096, so int32 and int64 arithmetic agree."""
    x = (q % BLOCK) * 151 + (kv % BLOCK) * 2753 + seed * 977
    x = x ^ (x >> 7)
    x = (x * 37) & 0xFFFFFF
    x = x ^ (x >> 11)
    return (x >> 3) & 1


def _random_rule(num_blocks: int) -> Callable:
    def rule(q, kv, kinds, seeds):
        """Random block grid: SKIP, FULL or PARTIAL (a hashed element pattern) per 128x128 block.
        The tables are flat (``[qb * num_blocks + kb]``): one-index lookups, as flex handles best."""
        block = (q // BLOCK) * num_blocks + kv // BLOCK
        kind = kinds[block]
        return (kind == _FULL) | ((kind == _PARTIAL) & (hash_bit(q, kv, seeds[block]) == 1))
    return rule


# --------------------------------------------------------------------------- tables
def document_ids(seq_len: int, seed: int = SEED) -> np.ndarray:
    """Per-token document id: lengths uniform in [DOC_MIN, DOC_MAX], the last one cut to fit."""
    rng = np.random.default_rng([seed, seq_len])
    ids = np.empty(seq_len, dtype=np.int32)
    start, doc = 0, 0
    while start < seq_len:
        length = int(rng.integers(DOC_MIN, DOC_MAX + 1))
        ids[start:start + length] = doc
        start += length
        doc += 1
    return ids


def interleaved_segments(seq_len: int, text: int = TEXT_LEN, image: int = IMAGE_LEN) -> list[tuple[str, int]]:
    """[("text", 512), ("image", 576), ...] covering exactly ``seq_len`` tokens."""
    segments, used = [], 0
    while used < seq_len:
        for kind, n in (("text", text), ("image", image)):
            take = min(n, seq_len - used)
            if take > 0:
                segments.append((kind, take))
                used += take
    return segments


def random_block_tables(seq_len: int, density: float, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(kinds, seeds), each a flat ``[nB * nB]`` int32 table (row-major: q block, then kv block).

    Every q-block row keeps round(density·nB) blocks, always including its diagonal block (kept
    FULL so no row is empty); a quarter of the others are PARTIAL with a hashed element pattern."""
    nb = math.ceil(seq_len / BLOCK)
    rng = np.random.default_rng([seed, seq_len, int(round(density * 1000))])
    kinds = np.zeros((nb, nb), dtype=np.int32)
    keep = max(1, min(nb, int(round(density * nb))))
    for row in range(nb):
        others = np.delete(np.arange(nb), row)
        chosen = rng.choice(others, size=keep - 1, replace=False) if keep > 1 else np.empty(0, dtype=np.int64)
        partial = rng.random(chosen.size) < RANDOM_PARTIAL_FRACTION
        kinds[row, chosen] = np.where(partial, _PARTIAL, _FULL)
        kinds[row, row] = _FULL
    seeds = rng.integers(0, 4096, size=(nb, nb), dtype=np.int32)
    return kinds.reshape(-1), seeds.reshape(-1)


# --------------------------------------------------------------------------- mask cases
@dataclass
class MaskCase:
    """One benchmark mask at one sequence length (broadcast over batch and heads)."""

    name: str
    seq_len: int
    label: str
    rule: Callable
    tables: tuple = ()
    #: ``factory(omnicupy.masks)`` -> that module's mask_mod for this mask, and how it was called.
    product: Optional[Callable[[Any], Callable]] = None
    product_call: str = ""
    #: flex gets this mask as ``dense[q, kv]`` (``dense_mod(dense())``) rather than as the rule.
    flex_dense: bool = False
    _xp_tables: dict = field(default_factory=dict, repr=False)

    def _tables_for(self, xp) -> tuple:
        key = xp.__name__
        if key not in self._xp_tables:
            self._xp_tables[key] = tuple(xp.asarray(t) for t in self.tables)
        return self._xp_tables[key]

    def array_mod(self) -> Callable:
        """mask_mod(b, h, q_idx, kv_idx) for NumPy or CuPy index arrays (tables follow the inputs)."""
        def mask_mod(b, h, q_idx, kv_idx):
            xp = _namespace(q_idx, kv_idx)
            return self.rule(q_idx, kv_idx, *self._tables_for(xp))
        mask_mod.__name__ = self.name
        return mask_mod

    def torch_mod(self, device: str = "cuda") -> Callable:
        """mask_mod for flex_attention, with the tables as torch tensors on ``device``."""
        import torch

        tables = tuple(torch.as_tensor(t, device=device) for t in self.tables)
        rule = self.rule

        def mask_mod(b, h, q_idx, kv_idx):
            return rule(q_idx, kv_idx, *tables)
        mask_mod.__name__ = self.name
        return mask_mod

    def dense(self, chunk_elems: int = 1 << 22) -> np.ndarray:
        """The whole element mask as a NumPy bool array ``[P, P]``, P = N rounded up to whole blocks
        (``P == N`` for every benchmark N); padding rows and columns are False.

        Evaluated from the rule itself, in row chunks on int32 indices (as flex's are; the rules are
        exact in int32), so it equals the mask every other system gets. N = 16384 gives 256 MiB."""
        n = self.seq_len
        padded = -(-n // BLOCK) * BLOCK
        out = np.zeros((padded, padded), dtype=bool)
        mod = self.array_mod()
        rows = max(1, chunk_elems // n)
        kv = np.arange(n, dtype=np.int32)[None, :]
        for start in range(0, n, rows):
            q = np.arange(start, min(start + rows, n), dtype=np.int32)[:, None]
            out[start:start + q.shape[0], :n] = np.asarray(mod(0, 0, q, kv), dtype=bool)
        return out

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The element mask for the given query rows: bool ``[len(rows), seq_len]`` (NumPy)."""
        q = np.asarray(rows, dtype=np.int64)[:, None]
        kv = np.arange(self.seq_len, dtype=np.int64)[None, :]
        return np.broadcast_to(np.asarray(self.array_mod()(0, 0, q, kv), dtype=bool), (q.shape[0], self.seq_len))


def dense_mod(table: Any, name: str = "dense") -> Callable:
    """``mask_mod(b, h, q, kv) = table[q, kv]`` for a bool ``[N, N]`` table (torch, NumPy or CuPy):
    the usual flex_attention form of an arbitrary mask; create_block_mask and flex_attention both
    take it."""
    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]
    mask_mod.__name__ = name
    return mask_mod


def _namespace(*xs):
    for x in xs:
        if type(x).__module__.split(".")[0] == "cupy":
            import cupy

            return cupy
    return np


def make_mask(name: str, seq_len: int) -> MaskCase:
    """The benchmark mask ``name`` at ``seq_len`` tokens."""
    n = seq_len
    if name == "full":
        return MaskCase(name, n, "full", _rule_full)
    if name == "causal":
        return MaskCase(name, n, "causal", _rule_causal, product=lambda m: m.causal(), product_call="masks.causal()")
    if name == "sliding_window":
        return MaskCase(name, n, f"sliding window {WINDOW}", _sliding_rule(WINDOW),
                        product=lambda m: m.sliding_window(WINDOW), product_call=f"masks.sliding_window({WINDOW})")
    if name == "document":
        ids = document_ids(n)
        # The table is padded to whole blocks (id -1) in case a kernel looks past the last token.
        padded = np.concatenate([ids, np.full(-n % BLOCK, -1, dtype=np.int32)])
        return MaskCase(name, n, f"document ({DOC_MIN}-{DOC_MAX}, causal)", _rule_document, (padded,),
                        product=lambda m: m.document(ids, causal=True),
                        product_call="masks.document(doc_ids, causal=True)")
    if name == "prefix_lm":
        prefix = n // 4
        return MaskCase(name, n, "prefix-LM N/4", _prefix_rule(prefix),
                        product=lambda m: m.prefix_lm(prefix), product_call=f"masks.prefix_lm({prefix})")
    if name == "interleaved":
        segments = interleaved_segments(n)
        return MaskCase(name, n, f"interleaved {TEXT_LEN} text / {IMAGE_LEN} image",
                        _interleaved_rule(TEXT_LEN, IMAGE_LEN), product=lambda m: m.interleaved(segments), product_call="masks.interleaved(segments)")
    if name.startswith("random_"):
        density = int(name.split("_", 1)[1]) / 100.0
        kinds, seeds = random_block_tables(n, density)
        return MaskCase(name, n, f"random blocks {density:.0%} (+partial)", _random_rule(math.ceil(n / BLOCK)),
                        (kinds, seeds), flex_dense=True)
    raise ValueError(f"unknown mask {name!r} (known: {', '.join(MASK_NAMES)})")


def masks_module():
    """omnicupy.masks, or None when it does not import."""
    try:
        from omnicupy import masks
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    return masks


def sample_rows(seq_len: int, count: int = 256, seed: int = SEED) -> np.ndarray:
    """Sorted query rows for spot checks: the first, the last and random others."""
    rng = np.random.default_rng([seed, seq_len])
    picks = rng.choice(seq_len, size=min(seq_len, max(0, count - 2)), replace=False)
    return np.unique(np.concatenate([[0, seq_len - 1], picks]))


def resolve_product_mod(mask: MaskCase, masks=None) -> tuple[Callable, str, Optional[str]]:
    """The mask_mod omnicupy should build from: ``(mod, source, note)``.

    omnicupy.masks' own callable when it exists and agrees with the benchmark's rule on sampled
    rows; otherwise the benchmark's rule, with ``note`` saying why. Either way every system gets
    the same mask."""
    fallback = mask.array_mod()
    if mask.product is None:
        return fallback, "benchmark rule", None
    if masks is None:
        return fallback, "benchmark rule", "omnicupy.masks is not importable"
    try:
        mod = mask.product(masks)
        rows = sample_rows(mask.seq_len)
        q = rows.astype(np.int64)[:, None]
        kv = np.arange(mask.seq_len, dtype=np.int64)[None, :]
        got = np.broadcast_to(np.asarray(mod(0, 0, q, kv), dtype=bool), (rows.size, mask.seq_len))
        want = mask.rows(rows)
    except Exception as exc:  # noqa: BLE001 - report and fall back
        return fallback, "benchmark rule", f"{mask.product_call} failed: {type(exc).__name__}: {exc}"
    diff = int(np.count_nonzero(got != want))
    if diff:
        return fallback, "benchmark rule", (f"{mask.product_call} disagrees with the benchmark's rule on {diff} of "
                                            f"{want.size} sampled pairs")
    return mod, mask.product_call, None


# --------------------------------------------------------------------------- arithmetic
def count_pairs(mask_mod: Callable, seq_len: int, xp=np, chunk_elems: int = 1 << 22) -> int:
    """Exact number of allowed (q, kv) pairs of one (b, h), evaluating ``mask_mod`` in row chunks
    so that no N x N array is ever built. Indices are int32 (as flex's are; the rules stay exact)."""
    rows = max(1, chunk_elems // seq_len)
    kv = xp.arange(seq_len, dtype=xp.int32)[None, :]
    total = 0
    for start in range(0, seq_len, rows):
        q = xp.arange(start, min(start + rows, seq_len), dtype=xp.int32)[:, None]
        allowed = xp.broadcast_to(xp.asarray(mask_mod(0, 0, q, kv), dtype=bool), (q.shape[0], seq_len))
        total += int(xp.count_nonzero(allowed))
    return total


def density(pairs: int, seq_len: int) -> float:
    return pairs / float(seq_len * seq_len)


def batch_for(seq_len: int) -> int:
    return max(1, TOKENS // seq_len)


def attention_flops(batch: int, heads: int, pairs_per_head: int, head_dim: int) -> int:
    """Forward FLOPs that count: 2 for QKᵀ and 2 for PV per allowed pair and head-dim element."""
    return 4 * batch * heads * pairs_per_head * head_dim


def tflops(flops: int, ms: Optional[float]) -> Optional[float]:
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Case:
    mask: str
    seq_len: int
    head_dim: int
    dtype: str
    batch: int
    heads: int = HEADS
    pass_name: str = "fwd"  # one of PASSES

    @property
    def key(self) -> str:
        key = f"{self.mask} D={self.head_dim} N={self.seq_len} {self.dtype} B={self.batch} H={self.heads}"
        return key if self.pass_name == "fwd" else f"{key} {self.pass_name}"


def skip_reason(system: str, case: Case) -> Optional[str]:
    """Why ``system`` does not run ``case`` (None when it does)."""
    if system == OMNICUPY_DETERMINISTIC and case.pass_name == "fwd":
        return "deterministic changes only the backward"
    if system.startswith("omnicupy_stage") and case.pass_name == "bwd":
        return "stages pick the forward's pipeline; the backward alone is the omnicupy column"
    if system in (SDPA_FLASH, SDPA_CUDNN) and case.mask not in SDPA_MASKS:
        return "SDPA has no block-sparse masks"
    if system == FLEX and case.head_dim > FLEX_MAX_HEAD_DIM:
        return f"flex is not benchmarked at head_dim > {FLEX_MAX_HEAD_DIM}"
    return None


def plan(masks, head_dims, seq_lens, dtypes, pass_name: str = "fwd") -> list[Case]:
    """Cases in run order: dtype, head dim, sequence length, then mask (inputs are shared per shape)."""
    return [Case(m, n, d, t, batch_for(n), pass_name=pass_name)
            for t in dtypes for d in head_dims for n in seq_lens for m in masks]


__all__ = [
    "MaskCase", "Case", "make_mask", "count_pairs", "density", "batch_for", "attention_flops", "tflops", "plan",
    "PASSES", "PASS_FLOPS", "EXTRA_SYSTEMS", "OMNICUPY_DETERMINISTIC",
    "skip_reason", "resolve_product_mod", "masks_module", "sample_rows", "document_ids", "interleaved_segments",
    "random_block_tables", "hash_bit", "dense_mod",
    "MASK_NAMES", "HEAD_DIMS", "SEQ_LENS", "DTYPES", "SYSTEMS", "DEFAULT_SEQ_LENS", "HEADS", "TOKENS", "BLOCK",
]
