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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from .. import BlockMask
from ..checks import check_int, check_positive_float
from ..errors import ArgumentError
from .assign import contiguous, lpt, zigzag
from . import routing
from .routing import TokenCosts, Traffic
from .work import BLOCK_WEIGHTS, MaskWork, mask_work, unit_runs, units_positions
from .checks import check_plan_args

STRATEGIES = ("contiguous", "zigzag", "lpt")
SCHEDULES = ("auto", "ring", "allgather")
#: ``keys``: K/V always travel to the queries; ``auto``: per q unit, whichever moves fewer bytes (routing.py);
#: ``queries``: every remote pair's queries travel (for tests and measurements).
ROUTES = ("auto", "keys", "queries")
#: ``lpt`` candidates: chunks per rank. More chunks balance better and cost more pieces per message.
LPT_CHUNKS_PER_RANK = (2, 4, 8, 16, 32)
#: ``schedule="auto"`` gathers everything when at least this fraction of the remote tokens is needed.
ALLGATHER_MIN_FRACTION = 0.999
DEFAULT_MAX_IMBALANCE = 1.05


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
    need: np.ndarray  # [W, U] bool: rank w receives unit u's K/V
    attends: np.ndarray  # [U, W] bool: some query of unit u attends some key of rank w
    moved: np.ndarray  # [U, W] bool: unit u's queries travel to rank w (routing.py)
    traffic: Traffic

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_work.mean())
        return float(self.rank_work.max()) / mean if mean > 0 else 1.0


@dataclass(frozen=True, repr=False)
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
    exchange_work: np.ndarray  # [W, W]: block work rank r computes at the step that pairs it with rank s
    need: np.ndarray  # [W, U]: rank w receives unit u's K/V
    attends: np.ndarray  # [U, W]: some query of unit u attends some key of rank w
    max_imbalance: float
    moved: Optional[np.ndarray] = field(compare=False, default=None)  # [U, W]: unit u's queries travel to rank w
    traffic: Optional[Traffic] = field(compare=False, default=None)
    route: str = "keys"
    head_parallel: int = 1  # W: heads.py runs the call (all-to-alls over heads), not the steps
    candidates: tuple = field(repr=False, compare=False, default=())
    mask: Optional[BlockMask] = field(repr=False, compare=False, default=None)
    _cache: dict = field(repr=False, compare=False, default_factory=dict)

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

    def q_send_units(self, rank: int, step: int) -> np.ndarray:
        """Units of rank's queries that travel at ``step`` to rank ``(rank + step) % W`` (its keys'
        rank), in increasing position; none at step 0."""
        rank, step = self._check_rank(rank), self._check_step(step)
        if not step or self.moved is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero((self.unit_owner == rank) & self.moved[:, (rank + step) % self.world_size])

    def q_recv_units(self, rank: int, step: int) -> np.ndarray:
        """Units of rank ``(rank - step) % W``'s queries that rank computes at ``step`` against its keys."""
        rank, step = self._check_rank(rank), self._check_step(step)
        return self.q_send_units((rank - step) % self.world_size, step)

    def tokens_received(self, rank: int) -> int:
        return int(sum(self.unit_tokens[self.recv_units(rank, s)].sum() for s in range(1, self.world_size)))

    def tokens_sent(self, rank: int) -> int:
        """Tokens of K/V rank sends in the forward pass (padding of the all-gather included)."""
        if self.schedule == "allgather":
            return (self.world_size - 1) * max(self.local_len(r) for r in range(self.world_size))
        return int(sum(self.unit_tokens[self.send_units(rank, s)].sum() for s in range(1, self.world_size)))

    def bytes_sent(self, rank: int, *, batch: int, kv_heads: int, head_dim: int, itemsize: int,
                   backward: bool = False, q_heads: Optional[int] = None) -> int:
        """Every byte rank sends in one pass. Forward: K and V of the tokens it sends, Q of its
        queries that travel, and the partial output and float32 LSE of the queries it hosts.
        ``backward``: the backward pass alone: K and V sent again, the dK/dV partials of what it
        received, Q, dO, O and LSE of its travelling queries, and the dQ partials of those it hosts.
        ``q_heads`` defaults to ``kv_heads``."""
        rank = self._check_rank(rank)
        q_heads = kv_heads if q_heads is None else q_heads
        if self.head_parallel > 1:
            return head_bytes_sent(self, rank, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                   itemsize=itemsize, backward=backward)
        if self.schedule == "allgather" or self.traffic is None:
            per_token = 2 * batch * kv_heads * head_dim * itemsize
            tokens = self.tokens_sent(rank) + (self.tokens_received(rank) if backward else 0)
            return tokens * per_token
        return self.traffic.bytes_sent(rank, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                       itemsize=itemsize, backward=backward)

    def queries_sent(self, rank: int) -> int:
        """Tokens of rank's queries that travel to other ranks' keys (each destination counted)."""
        return 0 if self.traffic is None else int(self.traffic.q_sent[self._check_rank(rank)])

    def rows_attending(self, rank: int, source: int) -> int:
        """Tokens of rank's queries that attend some key of ``source``'s shard."""
        return int(self.unit_tokens[(self.unit_owner == rank) & self.attends[:, source]].sum())

    def tokens_needed(self, rank: int) -> int:
        """Tokens of other ranks' shards that rank's queries attend to."""
        return int(self.unit_tokens[self.need[rank] & (self.unit_owner != rank)].sum())

    def needed_fraction(self) -> float:
        """Of the tokens each rank could receive from the others, the fraction it needs."""
        return needed_fraction(self.need, self.unit_owner, self.unit_tokens)

    def headline(self) -> str:
        """One line: world, assignment, schedule, balance and the busiest sender."""
        if self.head_parallel > 1:
            return (f"ShardPlan: {self.world_size} ranks, N={self.seq_len}, head parallel x{self.head_parallel} "
                    f"(all-to-all over heads; shards {self.strategy} x{self.chunks_per_rank})")
        sent = [self.tokens_sent(r) for r in range(self.world_size)]
        moved = [self.queries_sent(r) for r in range(self.world_size)]
        return (f"ShardPlan: {self.world_size} ranks, N={self.seq_len}, {self.strategy} x{self.chunks_per_rank}, "
                f"schedule {self.schedule}, route {self.route}, imbalance {self.imbalance:.3f}, "
                f"needed fraction {self.needed_fraction():.3f}, busiest sender {max(sent)} K/V + "
                f"{max(moved)} query tokens")

    def __repr__(self) -> str:  # print(plan) and the REPL: one line, not the arrays
        return f"<{self.headline()}>"

    def __str__(self) -> str:
        return self.headline()

    def summary(self, max_ranks: int = 8) -> str:
        """The headline and one line per rank (the first ``max_ranks`` and the last)."""
        lines = [self.headline()]
        shown = list(range(min(self.world_size, max_ranks)))
        if self.world_size > max_ranks:
            shown.append(self.world_size - 1)
        for r in shown:
            if r == self.world_size - 1 and self.world_size > max_ranks + 1:
                lines.append("  ...")
            lines.append(f"  rank {r}: {self.local_len(r)} tokens, work {float(self.rank_work[r]):.0f}, "
                         f"sends {self.tokens_sent(r)} tokens of K/V and {self.queries_sent(r)} of queries")
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
def head_bytes_sent(plan: ShardPlan, rank: int, *, batch: int, q_heads: int, kv_heads: int, head_dim: int,
                    itemsize: int, backward: bool) -> int:
    """Bytes ``rank`` sends in one pass under head parallelism (heads.py): Q, K, V of its positions
    for the other ranks' heads and the outputs of its heads for the others' positions; backward:
    dO, Q, K, V, O and LSE out, dQ, dK, dV back."""
    world = plan.world_size
    mine = plan.local_len(rank)
    others = plan.seq_len - mine
    q_row = batch * (q_heads // world) * head_dim * itemsize
    kv_row = batch * (kv_heads // world) * head_dim * itemsize
    lse = batch * (q_heads // world) * 4
    if not backward:
        return (world - 1) * mine * (q_row + 2 * kv_row) + others * (q_row + lse)
    return (world - 1) * mine * (3 * q_row + lse + 2 * kv_row) + others * (q_row + 2 * kv_row)


def _choose_heads(result: ShardPlan, option: Any, heads: Optional[tuple[int, int]]) -> int:
    """The head-parallel degree: W when asked (``True``), or with ``"auto"`` when the head counts are
    known, W divides the kv heads, the mask is the same for every head and the all-to-alls move fewer
    bytes (forward + backward, busiest rank) than the sequence plan; else 1."""
    world = result.world_size
    if option is False or option == "never" or world == 1:
        return 1
    if option not in (True, "auto"):
        raise ArgumentError(f"head_parallel must be 'auto', True or False, got {option!r}")
    possible = heads is not None and heads[1] % world == 0 and result.mask.shape[1] == 1
    if option is True:
        if not possible:
            raise ArgumentError(f"head parallelism over {world} ranks needs heads=(q_heads, kv_heads) with kv_heads "
                                f"divisible by {world} (a kv head is never split) and a mask shared by every head")
        return world
    if not possible:
        return 1
    shapes = dict(batch=1, q_heads=heads[0], kv_heads=heads[1], head_dim=128, itemsize=2)
    both = lambda r, f: f(r, backward=False) + f(r, backward=True)  # noqa: E731
    seq = max(both(r, lambda r_, backward: result.bytes_sent(r_, **{**shapes, "backward": backward}))
              for r in range(world))
    head = max(both(r, lambda r_, backward: head_bytes_sent(result, r_, **shapes, backward=backward))
               for r in range(world))
    return world if head < seq else 1


def needed_fraction(need: np.ndarray, unit_owner: np.ndarray, unit_tokens: np.ndarray) -> float:
    """Sum over ranks of the remote tokens each needs, over the sum of the remote tokens each could get."""
    world_size = need.shape[0]
    remote = unit_owner[None, :] != np.arange(world_size)[:, None]
    possible = float((remote * unit_tokens).sum())
    return float((need & remote).dot(unit_tokens).sum()) / possible if possible else 0.0


def _owners(strategy: str, chunk_work: np.ndarray, world_size: int) -> np.ndarray:
    if strategy == "contiguous":
        return contiguous(len(chunk_work), world_size)
    if strategy == "zigzag":
        return zigzag(world_size)
    return lpt(chunk_work, world_size)


def _routed(mw: MaskWork, unit_owner: np.ndarray, world_size: int, costs: Optional[TokenCosts]):
    """(moved [U, W], need [W, U], exchange_work [W, W], executed work per unit [U]) of one assignment;
    ``costs`` None: keys always travel."""
    moved = (np.zeros((mw.num_units, world_size), dtype=bool) if costs is None else
             routing.route(mw.q_unit, mw.kv_unit, unit_owner, mw.unit_tokens, world_size, costs))
    q_rank, kv_rank = unit_owner[mw.q_unit], unit_owner[mw.kv_unit]
    travels = moved[mw.q_unit, kv_rank]  # pair computed on the keys' rank
    at = np.where(travels, kv_rank, q_rank)
    partner = np.where(travels, q_rank, kv_rank)
    exchange_work = np.bincount(at * world_size + partner, weights=mw.pair_work,
                                minlength=world_size * world_size).reshape(world_size, world_size)
    need = np.zeros(world_size * mw.num_units, dtype=bool)
    need[q_rank[~travels] * mw.num_units + mw.kv_unit[~travels]] = True
    executed = np.bincount(np.where(travels, mw.kv_unit, mw.q_unit), weights=mw.pair_work, minlength=mw.num_units)
    return moved, need.reshape(world_size, mw.num_units), exchange_work, executed


def _candidate(mw: MaskWork, world_size: int, strategy: str, chunks_per_rank: int,
               costs: Optional[TokenCosts] = None) -> Optional[Candidate]:
    """The candidate for one strategy and chunk count, or None when the sequence has too few units.
    With ``costs``, queries travel where that moves fewer bytes (routing.py); lpt then assigns the
    chunks again by the work each unit's rank really computes (a travelling row's work lands on its
    keys' rank) and routes once more."""
    num_chunks = world_size * chunks_per_rank
    if mw.num_units < num_chunks:
        return None
    # Chunks of floor or ceil(U / M) units, so ranks' token counts differ by at most k units.
    chunk_of_unit = np.arange(mw.num_units) * num_chunks // mw.num_units
    owner = _owners(strategy, np.bincount(chunk_of_unit, weights=mw.unit_work, minlength=num_chunks), world_size)
    moved, need, exchange_work, executed = _routed(mw, owner[chunk_of_unit], world_size, costs)
    if costs is not None and strategy == "lpt" and moved.any():
        owner = _owners(strategy, np.bincount(chunk_of_unit, weights=executed, minlength=num_chunks), world_size)
        moved, need, exchange_work, executed = _routed(mw, owner[chunk_of_unit], world_size, costs)
    unit_owner = owner[chunk_of_unit]
    attends = np.zeros(mw.num_units * world_size, dtype=bool)
    attends[mw.q_unit * world_size + unit_owner[mw.kv_unit]] = True
    attends = attends.reshape(mw.num_units, world_size)
    traffic = Traffic.of(need, moved, unit_owner, mw.unit_tokens)
    return Candidate(strategy, chunks_per_rank, chunk_of_unit, owner.astype(np.int64), unit_owner.astype(np.int64),
                     exchange_work.sum(axis=1), exchange_work, need, attends, moved, traffic)


def _candidates(mw: MaskWork, world_size: int, strategy: Optional[str], chunks_per_rank: Optional[int],
                costs: Optional[TokenCosts], keys_too: bool = True) -> list[Candidate]:
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
    # Each assignment with keys only and, with ``costs``, routed: moving queries moves their work too,
    # so a routed candidate may lose on balance what it wins on bytes (causal masks do).
    options = [None] if costs is None else ([None, costs] if keys_too else [costs])
    found = [c for name, k in wanted for cst in options
             if (c := _candidate(mw, world_size, name, k, cst)) is not None
             and (cst is None or c.moved.any() or not keys_too)]
    if not found:
        raise ArgumentError(
            f"a sequence of {mw.seq_len} tokens ({mw.num_units} units of {mw.unit}) is too short for "
            f"{world_size} ranks with {', '.join(f'{n} x{k}' for n, k in wanted)} chunk(s) per rank")
    return found


def _choose(found: list[Candidate], max_imbalance: float, costs: TokenCosts) -> Candidate:
    """Fewest bytes from the busiest sender (forward and backward, every kind of message) among the
    balanced candidates; else the best balanced."""
    sent = {id(c): float(c.traffic.cost(costs).max()) for c in found}
    balanced = [c for c in found if c.imbalance <= max_imbalance]
    if balanced:
        return min(balanced, key=lambda c: (sent[id(c)], c.imbalance, c.chunks_per_rank))
    return min(found, key=lambda c: (c.imbalance, sent[id(c)]))


def _heads(heads: Any) -> tuple[int, int]:
    """(q heads, kv heads) for the routing's byte counts; None: equal counts (their ratio is what matters)."""
    if heads is None:
        return 1, 1
    if not isinstance(heads, (tuple, list)) or len(heads) != 2:
        raise ArgumentError(f"heads must be (q_heads, kv_heads), got {heads!r}")
    q_heads, kv_heads = (check_int(h, name, minimum=1) for h, name in zip(heads, ("q_heads", "kv_heads")))
    if q_heads % kv_heads:
        raise ArgumentError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    return q_heads, kv_heads


def plan(block_mask: BlockMask, world_size: int, *, strategy: Optional[str] = None,
         chunks_per_rank: Optional[int] = None, schedule: str = "auto",
         max_imbalance: float = DEFAULT_MAX_IMBALANCE, weights: Optional[Mapping] = None, route: str = "auto",
         heads: Optional[tuple[int, int]] = None, head_parallel: Any = False) -> ShardPlan:
    """Plan context-parallel attention of ``block_mask`` over ``world_size`` ranks.

    ``strategy`` (``contiguous``, ``zigzag``, ``lpt``; None tries all) and ``chunks_per_rank`` pin
    the assignment; ``schedule`` is ``auto``, ``ring`` or ``allgather``; ``weights`` overrides
    ``BLOCK_WEIGHTS`` per BlockType (measured costs, say). ``route``: ``auto`` lets queries travel
    to their keys where that moves fewer bytes (routing.py), ``keys`` always moves K/V,
    ``queries`` moves the queries of every remote pair (tests, measurements). ``heads``:
    ``(q_heads, kv_heads)``, for the byte counts that decide (default equal). ``head_parallel``:
    True runs the call as all-to-alls over heads (heads.py); ``"auto"`` does so when ``heads`` is
    given, the kv heads divide among the ranks and that moves fewer bytes (the all-to-alls do not
    overlap compute, the ring does: ``model.best_layout`` compares predicted times instead);
    False (default) never. Pure NumPy on a host copy of the metadata: no GPU needed."""
    check_plan_args(block_mask, weights)
    world_size = check_int(world_size, "world_size", minimum=1)
    if strategy is not None and strategy not in STRATEGIES:
        raise ArgumentError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")
    if chunks_per_rank is not None:
        chunks_per_rank = check_int(chunks_per_rank, "chunks_per_rank", minimum=1)
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if route not in ROUTES:
        raise ArgumentError(f"route must be one of {ROUTES}, got {route!r}")
    max_imbalance = check_positive_float(max_imbalance, "max_imbalance")
    costs = TokenCosts.of(*_heads(heads))
    mw = mask_work(block_mask, weights)
    if route == "queries" and schedule == "allgather":
        raise ArgumentError("route='queries' needs the ring schedule (the all-gather moves keys only)")
    routing_costs = {"auto": costs, "keys": None, "queries": routing.ALL_QUERIES}[route]
    found = _candidates(mw, world_size, strategy, chunks_per_rank,
                        None if schedule == "allgather" else routing_costs, keys_too=route != "queries")
    best = _choose(found, max_imbalance, costs)
    if schedule == "auto":
        gather = (world_size > 1 and not best.moved.any()
                  and needed_fraction(best.need, best.unit_owner, mw.unit_tokens) >= ALLGATHER_MIN_FRACTION)
        schedule = "allgather" if gather else "ring"
    result = ShardPlan(world_size, mw.seq_len, block_mask.q_block_size, block_mask.kv_block_size, mw.unit, best.strategy,
                     best.chunks_per_rank, best.chunk_of_unit, schedule, best.chunk_owner, best.unit_owner,
                     mw.unit_tokens, mw.unit_work, best.rank_work, best.exchange_work, best.need, best.attends,
                     max_imbalance, moved=best.moved, traffic=best.traffic, candidates=tuple(found), mask=block_mask,
                     route=route if best.moved.any() else "keys")
    degree = _choose_heads(result, head_parallel, None if heads is None else _heads(heads))
    return result if degree == 1 else dataclasses.replace(result, head_parallel=degree, _cache={})


__all__ = ["ShardPlan", "Candidate", "MaskWork", "plan", "mask_work", "contiguous", "zigzag", "lpt", "units_positions",
           "unit_runs", "needed_fraction", "BLOCK_WEIGHTS", "STRATEGIES", "SCHEDULES", "ROUTES",
           "ALLGATHER_MIN_FRACTION", "head_bytes_sent"]
