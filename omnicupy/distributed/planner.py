"""The sharding planner: which rank owns which part of the sequence, and which K/V each rank needs.

Knows: a BlockMask's host metadata (which (q block, kv block) pairs carry work, and of which type)
and the world size. Does not know: GPUs, NCCL, dtypes or head counts (bytes are reported per token
and scaled by the caller's shapes), nor how a step is executed (steps.py, sharded_attention.py).

Vocabulary:
- A **unit** is the smallest piece of the sequence the plan moves: ``lcm(q_block_size,
  kv_block_size)`` tokens, so every q block and every kv block lies inside one unit. The last unit
  may be shorter (the sequence tail).
- A **chunk** is a run of consecutive units owned by one rank; chunks differ by one unit at most.
  Every rank owns the same number of chunks (so about the same number of tokens: the layers around
  attention, which cost per token, stay balanced too). A rank's **shard** is its chunks' tokens in
  increasing position.
- **Work** is counted in blocks weighted by type (``BLOCK_WEIGHTS``): a rank's work is the work of
  its queries' rows, since the rank that owns a query computes everything that query attends to.
- **Need**: rank r needs unit u when some query of r attends to some key of u (any batch or head
  of the mask). Only needed units are ever sent, so the granularity of traffic is one unit, not
  one chunk: with a sliding window a rank receives the window before its first query, not the
  chunk that holds it.

Assignments tried (``STRATEGIES``): ``contiguous`` (one chunk per rank), ``zigzag`` (rank r owns
chunks r and 2W-1-r: exact for causal masks) and ``lpt`` (k chunks per rank, greedy longest
processing time first with a per-rank chunk quota, then swaps that shrink the load spread). Among
the candidates whose heaviest rank is within ``max_imbalance`` of the mean, the plan keeps the one
that sends the fewest bytes from its busiest sender; if none is, the best balanced one.

Schedule: at step s (1 <= s < W) rank r sends to rank (r + s) % W the units of its own that rank
needs and receives from rank (r - s) % W; step 0 is the local block. ``ring`` runs those steps
one after the other (each a direct exchange between the two ranks, in ring order), overlapping
each with the previous step's compute; ``allgather`` gathers
every shard at once (one NCCL all-gather), chosen by ``schedule="auto"`` only when every rank
needs every other rank's whole shard, so that skipping unneeded units would save nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from .. import BlockMask, BlockType
from ..checks import check_int, check_positive_float
from ..errors import ArgumentError, MaskError
from .submask import cdiv, host_metadata
from .checks import check_plan_args
from .summary import summary

#: Relative cost of one listed block by type: CAUSAL blocks compute about half their elements.
BLOCK_WEIGHTS: Mapping[BlockType, int] = {BlockType.MASKED: 0, BlockType.CAUSAL: 1, BlockType.FULL: 2,
                                          BlockType.PARTIAL: 2}
STRATEGIES = ("contiguous", "zigzag", "lpt")
SCHEDULES = ("auto", "ring", "allgather")
#: ``lpt`` candidates: chunks per rank. More chunks balance better and cost more pieces per message.
LPT_CHUNKS_PER_RANK = (2, 4, 8, 16, 32)
#: ``schedule="auto"`` gathers everything when at least this fraction of the remote tokens is needed.
ALLGATHER_MIN_FRACTION = 0.999
DEFAULT_MAX_IMBALANCE = 1.05
#: Swaps tried by the lpt refinement, per chunk.
REFINE_SWAPS_PER_CHUNK = 8


@dataclass(frozen=True)
class MaskWork:
    """The work of a BlockMask at unit granularity, summed over the mask's batch and head dims.

    ``q_unit``/``kv_unit``: one entry per distinct (q unit, kv unit) pair with a listed, non-MASKED
    block, ``pair_work`` its weighted block count; ``unit_work``: the same per q unit."""

    seq_len: int
    unit: int
    q_unit: np.ndarray  # [E] int64
    kv_unit: np.ndarray  # [E] int64
    pair_work: np.ndarray  # [E] float64
    unit_work: np.ndarray  # [U] float64
    unit_tokens: np.ndarray  # [U] int64

    @property
    def num_units(self) -> int:
        return len(self.unit_tokens)


@dataclass(frozen=True)
class Candidate:
    """One assignment of chunks to ranks and what it costs."""

    strategy: str
    chunks_per_rank: int
    chunk_of_unit: np.ndarray  # [U] chunk of each unit
    chunk_owner: np.ndarray  # [M] rank of each chunk
    unit_owner: np.ndarray  # [U]
    rank_work: np.ndarray  # [W]
    exchange_work: np.ndarray  # [W, W]: work of rank r's queries against rank s's keys
    need: np.ndarray  # [W, U] bool
    attends: np.ndarray  # [U, W] bool: some query of unit u attends some key of rank w
    tokens_sent: np.ndarray  # [W] forward tokens of K/V each rank sends (ring schedule)

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_work.mean())
        return float(self.rank_work.max()) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class ShardPlan:
    """Who owns which tokens and who sends what to whom, for one mask and one world size.

    Deterministic: every rank computes the same plan from the same mask, so nothing is exchanged.
    ``mask`` is kept (not compared) for the per-rank programs (steps.py)."""

    world_size: int
    seq_len: int
    q_block_size: int
    kv_block_size: int
    unit: int
    strategy: str
    chunks_per_rank: int
    chunk_of_unit: np.ndarray
    schedule: str
    chunk_owner: np.ndarray
    unit_owner: np.ndarray
    unit_tokens: np.ndarray
    unit_work: np.ndarray
    rank_work: np.ndarray
    exchange_work: np.ndarray  # [W, W]: block work of rank r's queries against rank s's keys
    need: np.ndarray
    attends: np.ndarray  # [U, W]: some query of unit u attends some key of rank w
    max_imbalance: float
    candidates: tuple = field(repr=False, compare=False, default=())
    mask: Optional[BlockMask] = field(repr=False, compare=False, default=None)
    _cache: dict = field(repr=False, compare=False, default_factory=dict)

    def __repr__(self) -> str:
        return summary(self)  # a few lines; the arrays stay readable as attributes

    # ------------------------------------------------------------------ shape
    @property
    def num_units(self) -> int:
        return len(self.unit_owner)

    @property
    def chunk_size(self) -> int:
        """Tokens of the longest chunk (chunks differ by at most one unit)."""
        return int(np.bincount(self.chunk_of_unit, weights=self.unit_tokens).max())

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_owner)

    @property
    def imbalance(self) -> float:
        """Heaviest rank's block work over the mean (1.0 is perfect)."""
        mean = float(self.rank_work.mean())
        return float(self.rank_work.max()) / mean if mean > 0 else 1.0

    def rank_units(self, rank: int) -> np.ndarray:
        """The units rank ``rank`` owns, in increasing position (its shard's order)."""
        rank = self._check_rank(rank)
        key = ("units", rank)
        if key not in self._cache:
            self._cache[key] = np.flatnonzero(self.unit_owner == rank)
        return self._cache[key]

    def unit_starts(self) -> np.ndarray:
        """[U + 1] token position where each unit starts, and the sequence length."""
        return np.concatenate([[0], np.cumsum(self.unit_tokens)])

    def positions(self, rank: int) -> np.ndarray:
        """Global token positions of rank's shard, in shard order."""
        return units_positions(self.rank_units(rank), self.unit_starts())

    def local_len(self, rank: int) -> int:
        return int(self.unit_tokens[self.rank_units(rank)].sum())

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """(global start, local start, length) of each run of consecutive positions of rank's shard."""
        return unit_runs(self.rank_units(rank), self.unit_starts())

    # --------------------------------------------------------------- messages
    def recv_units(self, rank: int, step: int) -> np.ndarray:
        """Units rank receives at ``step`` (from rank ``(rank - step) % W``), in increasing position.
        Under the allgather schedule every unit of the source's shard."""
        rank, step = self._check_rank(rank), self._check_step(step)
        src = (rank - step) % self.world_size
        owned = self.unit_owner == src
        if step and self.schedule == "allgather":
            return np.flatnonzero(owned)
        return np.flatnonzero(owned & self.need[rank])

    def send_units(self, rank: int, step: int) -> np.ndarray:
        """Units rank sends at ``step`` (to rank ``(rank + step) % W``)."""
        rank, step = self._check_rank(rank), self._check_step(step)
        return self.recv_units((rank + step) % self.world_size, step)

    def tokens_received(self, rank: int) -> int:
        return int(sum(self.unit_tokens[self.recv_units(rank, s)].sum() for s in range(1, self.world_size)))

    def tokens_sent(self, rank: int) -> int:
        """Tokens of K/V rank sends in the forward pass (padding of the all-gather included)."""
        if self.schedule == "allgather":
            return (self.world_size - 1) * max(self.local_len(r) for r in range(self.world_size))
        return int(sum(self.unit_tokens[self.send_units(rank, s)].sum() for s in range(1, self.world_size)))

    def bytes_sent(self, rank: int, *, batch: int, kv_heads: int, head_dim: int, itemsize: int,
                   backward: bool = False) -> int:
        """Bytes rank sends: K and V of the tokens it sends; with ``backward``, the backward pass's
        total (K and V sent again, plus the dK and dV partials of what it received, returned)."""
        per_token = 2 * batch * kv_heads * head_dim * itemsize
        tokens = self.tokens_sent(rank) + (self.tokens_received(rank) if backward else 0)
        return tokens * per_token

    def rows_attending(self, rank: int, source: int) -> int:
        """Tokens of rank's queries that attend some key of ``source``'s shard."""
        return int(self.unit_tokens[(self.unit_owner == rank) & self.attends[:, source]].sum())

    def tokens_needed(self, rank: int) -> int:
        """Tokens of other ranks' shards that rank's queries attend to."""
        return int(self.unit_tokens[self.need[rank] & (self.unit_owner != rank)].sum())

    def needed_fraction(self) -> float:
        """Of the tokens each rank could receive from the others, the fraction it needs."""
        return needed_fraction(self.need, self.unit_owner, self.unit_tokens)

    def summary(self) -> str:
        lines = [f"Plan: {self.world_size} ranks, N={self.seq_len}, unit {self.unit} tokens, "
                 f"{self.strategy} ({self.chunks_per_rank} chunk(s) of {self.chunk_size} tokens per rank), "
                 f"schedule {self.schedule}, imbalance {self.imbalance:.3f}, "
                 f"needed fraction {self.needed_fraction():.3f}"]
        for r in range(self.world_size):
            lines.append(f"  rank {r}: {self.local_len(r)} tokens, work {float(self.rank_work[r]):.0f}, "
                         f"sends {self.tokens_sent(r)} tokens of K/V")
        return "\n".join(lines)

    # ----------------------------------------------------------------- checks
    def _check_rank(self, rank: Any) -> int:
        rank = check_int(rank, "rank")
        if rank >= self.world_size:
            raise ArgumentError(f"rank {rank} is outside the plan's world of {self.world_size}")
        return rank

    def _check_step(self, step: Any) -> int:
        step = check_int(step, "step")
        if step >= self.world_size:
            raise ArgumentError(f"step {step} is outside [0, {self.world_size})")
        return step


# ------------------------------------------------------------------------------ helpers
def units_positions(units: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Token positions covered by ``units`` (in their order); ``starts`` from ``ShardPlan.unit_starts``."""
    units = np.asarray(units, dtype=np.int64)
    if not units.size:
        return np.zeros(0, dtype=np.int64)
    lengths = starts[units + 1] - starts[units]
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts[units], lengths) + offsets


def unit_runs(units: np.ndarray, starts: np.ndarray) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of the runs of consecutive units in ``units``, where the
    local position is the position in the concatenation of ``units``' tokens."""
    units = np.asarray(units, dtype=np.int64)
    runs, local = [], 0
    if not units.size:
        return runs
    breaks = np.flatnonzero(np.diff(units) != 1) + 1
    for group in np.split(units, breaks):
        start, end = int(starts[group[0]]), int(starts[group[-1] + 1])
        runs.append((start, local, end - start))
        local += end - start
    return runs


def needed_fraction(need: np.ndarray, unit_owner: np.ndarray, unit_tokens: np.ndarray) -> float:
    """Sum over ranks of the remote tokens each needs, over the sum of the remote tokens each could get."""
    world_size = need.shape[0]
    remote = unit_owner[None, :] != np.arange(world_size)[:, None]
    possible = float((remote * unit_tokens).sum())
    return float((need & remote).dot(unit_tokens).sum()) / possible if possible else 0.0


def _block_type(key: Any) -> BlockType:
    try:
        return BlockType[key] if isinstance(key, str) else BlockType(key)
    except (KeyError, ValueError):
        raise ArgumentError(f"weights: {key!r} is not a block type (MASKED, CAUSAL, FULL, PARTIAL or 0..3)") from None


def _weight_table(weights: Optional[Mapping]) -> np.ndarray:
    """Weights indexed by BlockType; ``weights`` (keys: BlockType, its name or value) override the defaults."""
    merged = dict(BLOCK_WEIGHTS)
    merged.update({_block_type(t): w for t, w in (weights or {}).items()})
    table = np.zeros(len(BlockType), dtype=np.float64)
    for t, w in merged.items():
        table[int(t)] = check_positive_float(w, f"weights[{t.name}]") if w else 0.0
    if table[BlockType.MASKED]:
        raise ArgumentError("weights[MASKED] must be 0: a masked block costs nothing")
    return table


def mask_work(bm: BlockMask, weights: Optional[Mapping] = None) -> MaskWork:
    """Unit-level work and (q unit, kv unit) pairs of ``bm`` (host copy of its metadata, O(listed
    entries)). Batch and head dims the metadata broadcasts by stride 0 are counted once and scaled.
    """
    if not isinstance(bm, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(bm).__name__}")
    if bm.q_len != bm.kv_len:
        raise MaskError(f"context parallelism shards one sequence: q_len ({bm.q_len}) must equal kv_len ({bm.kv_len})")
    table = _weight_table(weights)
    host = host_metadata(bm)
    nb, idx, types, scale = host.kv_num_blocks, host.kv_indices, host.block_mask_types, host.copies
    qbs, kbs = bm.q_block_size, bm.kv_block_size
    unit = qbs * kbs // math.gcd(qbs, kbs)
    n = bm.q_len
    num_units = cdiv(n, unit)
    listed = np.arange(idx.shape[3]) < nb[..., None]
    b, h, qb, slot = np.nonzero(listed & (types != BlockType.MASKED))
    kind = types[b, h, qb, slot]
    if np.any((kind < 0) | (kind >= len(BlockType))):
        raise MaskError("block_mask_types has listed entries outside 0..3")
    kvb = idx[b, h, qb, slot].astype(np.int64)
    q_unit = qb.astype(np.int64) * qbs // unit
    kv_unit = kvb * kbs // unit
    unit_work = np.bincount(q_unit, weights=table[kind], minlength=num_units) * scale
    pairs, which = np.unique(q_unit * num_units + kv_unit, return_inverse=True)
    pair_work = np.bincount(which.reshape(-1), weights=table[kind], minlength=len(pairs)) * scale
    unit_tokens = np.full(num_units, unit, dtype=np.int64)
    unit_tokens[-1] = n - unit * (num_units - 1)
    return MaskWork(n, unit, pairs // num_units, pairs % num_units, pair_work.astype(np.float64),
                    unit_work.astype(np.float64), unit_tokens)


# ---------------------------------------------------------------------------- assignments
def contiguous(num_chunks: int, world_size: int) -> np.ndarray:
    """Rank r owns chunks [r * k, (r + 1) * k), k = num_chunks / world_size."""
    return np.arange(num_chunks) // (num_chunks // world_size)


def zigzag(world_size: int) -> np.ndarray:
    """2W chunks; rank r owns chunks r and 2W - 1 - r (a causal mask's cheap and dear ends)."""
    first = np.arange(world_size)
    return np.concatenate([first, first[::-1]])


def lpt(work: np.ndarray, world_size: int) -> np.ndarray:
    """Chunks to ranks, ``len(work) / world_size`` each: heaviest chunk first onto the least
    loaded rank with room, then swaps between the heaviest rank and another that shrink the spread
    (each swap lowers the sum of squared loads, so the refinement ends)."""
    num_chunks = len(work)
    quota = num_chunks // world_size
    owner = np.full(num_chunks, -1, dtype=np.int64)
    load = np.zeros(world_size)
    count = np.zeros(world_size, dtype=np.int64)
    for c in np.argsort(-work, kind="stable"):
        open_ranks = np.flatnonzero(count < quota)
        r = open_ranks[np.argmin(load[open_ranks])]
        owner[c] = r
        load[r] += work[c]
        count[r] += 1
    for _ in range(REFINE_SWAPS_PER_CHUNK * num_chunks):
        if not _best_swap(owner, work, load):
            break
    return owner


def _best_swap(owner: np.ndarray, work: np.ndarray, load: np.ndarray) -> bool:
    """Apply the swap between the heaviest rank and another that most lowers the sum of squared
    loads: moving d = w_a - w_b from a rank to a lighter one by ``gap`` gains 2 d (gap - d)."""
    heavy = int(np.argmax(load))
    mine = np.flatnonzero(owner == heavy)
    best, best_gain = None, 1e-9 * max(float(load[heavy]), 1.0)
    for other in range(len(load)):
        gap = load[heavy] - load[other]
        if other == heavy or gap <= 0:
            continue
        theirs = np.flatnonzero(owner == other)
        d = work[mine][:, None] - work[theirs][None, :]
        gain = np.where((d > 0) & (d < gap), 2 * d * (gap - d), 0.0)
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] > best_gain:
            best, best_gain = (mine[i], theirs[j], other, float(d[i, j])), gain[i, j]
    if best is None:
        return False
    a, b, other, d = best
    owner[a], owner[b] = other, heavy
    load[heavy] -= d
    load[other] += d
    return True


def _candidate(mw: MaskWork, world_size: int, strategy: str, chunks_per_rank: int) -> Optional[Candidate]:
    """The candidate for one strategy and chunk count, or None when the sequence has too few units."""
    num_chunks = world_size * chunks_per_rank
    if mw.num_units < num_chunks:
        return None
    # Chunks of floor or ceil(U / M) units, so ranks' token counts differ by at most k units.
    chunk_of_unit = np.arange(mw.num_units) * num_chunks // mw.num_units
    chunk_work = np.bincount(chunk_of_unit, weights=mw.unit_work, minlength=num_chunks)
    if strategy == "contiguous":
        owner = contiguous(num_chunks, world_size)
    elif strategy == "zigzag":
        owner = zigzag(world_size)
    else:
        owner = lpt(chunk_work, world_size)
    unit_owner = owner[chunk_of_unit]
    rank_work = np.bincount(unit_owner, weights=mw.unit_work, minlength=world_size)
    exchange_work = np.bincount(unit_owner[mw.q_unit] * world_size + unit_owner[mw.kv_unit], weights=mw.pair_work,
                                minlength=world_size * world_size).reshape(world_size, world_size)
    need = np.zeros(world_size * mw.num_units, dtype=bool)
    need[unit_owner[mw.q_unit] * mw.num_units + mw.kv_unit] = True
    need = need.reshape(world_size, mw.num_units)
    attends = np.zeros(mw.num_units * world_size, dtype=bool)
    attends[mw.q_unit * world_size + unit_owner[mw.kv_unit]] = True
    attends = attends.reshape(mw.num_units, world_size)
    # Forward traffic of the ring: rank r sends every unit it owns once to each rank that needs it.
    remote = need & (unit_owner[None, :] != np.arange(world_size)[:, None])
    sent = np.bincount(unit_owner, weights=(remote.sum(axis=0) * mw.unit_tokens), minlength=world_size)
    return Candidate(strategy, chunks_per_rank, chunk_of_unit, owner.astype(np.int64), unit_owner.astype(np.int64),
                     rank_work, exchange_work, need, attends, sent.astype(np.int64))


def _candidates(mw: MaskWork, world_size: int, strategy: Optional[str],
                chunks_per_rank: Optional[int]) -> list[Candidate]:
    wanted = []
    for name in ([strategy] if strategy else STRATEGIES):
        if name == "contiguous":
            counts = [1] if chunks_per_rank is None else [chunks_per_rank]
        elif name == "zigzag":
            if chunks_per_rank not in (None, 2):
                raise ArgumentError(f"zigzag owns 2 chunks per rank, got chunks_per_rank={chunks_per_rank}")
            counts = [2]
        else:
            counts = LPT_CHUNKS_PER_RANK if chunks_per_rank is None else [chunks_per_rank]
        wanted += [(name, k) for k in counts]
    found = [c for name, k in wanted if (c := _candidate(mw, world_size, name, k)) is not None]
    if not found:
        raise ArgumentError(
            f"a sequence of {mw.seq_len} tokens ({mw.num_units} units of {mw.unit}) is too short for "
            f"{world_size} ranks with {', '.join(f'{n} x{k}' for n, k in wanted)} chunk(s) per rank")
    return found


def _choose(found: list[Candidate], max_imbalance: float) -> Candidate:
    """Fewest bytes from the busiest sender among the balanced candidates; else the best balanced."""
    balanced = [c for c in found if c.imbalance <= max_imbalance]
    if balanced:
        return min(balanced, key=lambda c: (int(c.tokens_sent.max()), c.imbalance, c.chunks_per_rank))
    return min(found, key=lambda c: (c.imbalance, int(c.tokens_sent.max())))


def plan(block_mask: BlockMask, world_size: int, *, strategy: Optional[str] = None,
         chunks_per_rank: Optional[int] = None, schedule: str = "auto",
         max_imbalance: float = DEFAULT_MAX_IMBALANCE, weights: Optional[Mapping] = None) -> ShardPlan:
    """Plan context-parallel attention of ``block_mask`` over ``world_size`` ranks.

    ``strategy`` (``contiguous``, ``zigzag``, ``lpt``; None tries all) and ``chunks_per_rank`` pin
    the assignment; ``schedule`` is ``auto``, ``ring`` or ``allgather``; ``weights`` overrides
    ``BLOCK_WEIGHTS`` per BlockType. Pure NumPy on a host copy of the metadata: no GPU needed."""
    check_plan_args(block_mask, weights)
    world_size = check_int(world_size, "world_size", minimum=1)
    if strategy is not None and strategy not in STRATEGIES:
        raise ArgumentError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")
    if chunks_per_rank is not None:
        chunks_per_rank = check_int(chunks_per_rank, "chunks_per_rank", minimum=1)
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    max_imbalance = check_positive_float(max_imbalance, "max_imbalance")
    mw = mask_work(block_mask, weights)
    found = _candidates(mw, world_size, strategy, chunks_per_rank)
    best = _choose(found, max_imbalance)
    if schedule == "auto":
        gather = world_size > 1 and needed_fraction(best.need, best.unit_owner, mw.unit_tokens) >= ALLGATHER_MIN_FRACTION
        schedule = "allgather" if gather else "ring"
    result = ShardPlan(world_size, mw.seq_len, block_mask.q_block_size, block_mask.kv_block_size, mw.unit, best.strategy,
                  best.chunks_per_rank, best.chunk_of_unit, schedule, best.chunk_owner, best.unit_owner,
                  mw.unit_tokens, mw.unit_work, best.rank_work, best.exchange_work, best.need, best.attends,
                  max_imbalance,
                  tuple(found), block_mask)
    return result


__all__ = ["ShardPlan", "Candidate", "MaskWork", "plan", "mask_work", "contiguous", "zigzag", "lpt", "units_positions",
           "unit_runs", "needed_fraction", "BLOCK_WEIGHTS", "STRATEGIES", "SCHEDULES", "ALLGATHER_MIN_FRACTION"]
