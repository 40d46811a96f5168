"""Mask-aware dispatch: for each pair of ranks, which queries travel to the keys instead of the keys to the queries.

Knows: the (q unit, kv unit) pairs of a mask (planner.MaskWork's arrays), which rank owns each
unit, and the bytes one token costs when its K/V travel versus when its queries travel. Does not
know GPUs, steps or the BlockMask itself: everything is NumPy on unit indices.

Two ways to compute the pairs between rank r's queries and rank w's keys:
- **keys travel** (the ring of planner.py): w sends r every unit of its K/V some query of r
  attends to; r computes; in the backward the dK/dV partials go back to w.
- **queries travel**: r sends w the q units (Q; in the backward also dO, O and the LSE), w
  computes them against its own K/V and sends back the partial output and LSE (merged exactly at
  r, merge.py) or, in the backward, the dQ partial (dK/dV stay on w).

The choice is made per q unit: ``moved[u, w]`` says that all the pairs of unit u with w's keys are
computed on w. Within one pair of ranks, moving the q units with the most keys first is what pays
(a global-token row reads the whole shard; a window row reads a few units), so the candidates are
the prefixes of r's q units sorted by how many of w's key tokens each reads, and the union of the
K/V still needed by the others shrinks as the prefix grows. Each prefix costs ``q_cost`` per moved
query token plus ``kv_cost`` per key token still needed; the cheapest prefix wins (the empty
prefix is today's plan, so routing never sends more than keys alone). One pass per pair of ranks,
O(pairs) in all: for each key unit, the position of the last q unit (in that order) that needs it
says for which prefixes it still travels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Bytes per token and head at D = 128, fp16, forward plus backward (the planner only compares them):
#: keys travel: K, V forward; K, V again and dK, dV back in the backward = 6 rows of D.
KV_ROWS_PER_HEAD = 6
#: queries travel: Q forward, O back (+ LSE); Q, dO, O (+ LSE) in the backward, dQ back = 6 rows of D + 2 LSEs.
Q_ROWS_PER_HEAD = 6
LSE_ROWS_PER_HEAD = 2 * 4 / (128 * 2)


@dataclass(frozen=True)
class TokenCosts:
    """Relative cost of moving one token's K/V (``kv``) or one token's queries and their returns (``q``)."""

    kv: float
    q: float

    @classmethod
    def of(cls, q_heads: int, kv_heads: int) -> "TokenCosts":
        return cls(kv=KV_ROWS_PER_HEAD * kv_heads, q=(Q_ROWS_PER_HEAD + LSE_ROWS_PER_HEAD) * q_heads)


#: Costs under which every remote pair's queries travel (free queries): ``plan(route="queries")``.
ALL_QUERIES = TokenCosts(kv=1.0, q=0.0)


def route(q_unit: np.ndarray, kv_unit: np.ndarray, unit_owner: np.ndarray, unit_tokens: np.ndarray,
          world_size: int, costs: TokenCosts) -> np.ndarray:
    """``moved [U, W]`` bool: q unit u's pairs with rank w's keys are computed on w (never its own rank).

    ``q_unit``/``kv_unit``: the distinct (q unit, kv unit) pairs that carry work."""
    num_units = len(unit_owner)
    moved = np.zeros((num_units, world_size), dtype=bool)
    q_rank, kv_rank = unit_owner[q_unit], unit_owner[kv_unit]
    remote = q_rank != kv_rank
    if not remote.any():
        return moved
    qu, ku, qr, kr = q_unit[remote], kv_unit[remote], q_rank[remote], kv_rank[remote]
    order = np.lexsort((ku, qu, kr, qr))  # grouped by (query rank, key rank)
    qu, ku, qr, kr = qu[order], ku[order], qr[order], kr[order]
    group = qr * world_size + kr
    bounds = np.flatnonzero(np.diff(group)) + 1
    for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(group)]])):
        chosen = _best_prefix(qu[lo:hi], ku[lo:hi], unit_tokens, costs)
        moved[chosen, kr[lo]] = True
    return moved


def _best_prefix(qu: np.ndarray, ku: np.ndarray, unit_tokens: np.ndarray, costs: TokenCosts) -> np.ndarray:
    """The q units of one pair of ranks to move: the cheapest prefix of the units sorted by the key
    tokens each reads (most first; ties by position, so the plan is deterministic)."""
    units, which = np.unique(qu, return_inverse=True)
    reads = np.bincount(which, weights=unit_tokens[ku], minlength=len(units))
    rank_of = np.empty(len(units), dtype=np.int64)
    rank_of[np.lexsort((units, -reads))] = np.arange(len(units))
    pos = rank_of[which]  # each pair's q unit, as its position in the moving order
    keys, key_which = np.unique(ku, return_inverse=True)
    last = np.full(len(keys), -1, dtype=np.int64)
    np.maximum.at(last, key_which, pos)
    # A key unit still travels for prefixes m <= last (some unit at position >= m needs it).
    kv_tokens = np.bincount(last, weights=unit_tokens[keys], minlength=len(units))[::-1].cumsum()[::-1]
    kv_left = np.concatenate([kv_tokens, [0.0]])  # m = 0 .. len(units)
    moved_tokens = np.concatenate([[0.0], np.cumsum(unit_tokens[units][np.argsort(rank_of)])])
    cost = costs.kv * kv_left + costs.q * moved_tokens
    best = int(np.argmin(cost))  # the first minimum: fewest moved units among equals
    return units[rank_of < best]


@dataclass(frozen=True)
class Traffic:
    """Tokens each rank moves under the ring: K/V it sends and receives (``kv_sent``,
    ``kv_received``), queries it sends to other ranks' keys (``q_sent``) and queries of others it
    computes and answers (``q_hosted``); all [W] int64, counted once per (unit, destination)."""

    kv_sent: np.ndarray
    kv_received: np.ndarray
    q_sent: np.ndarray
    q_hosted: np.ndarray

    @classmethod
    def of(cls, need: np.ndarray, moved: np.ndarray, unit_owner: np.ndarray, unit_tokens: np.ndarray) -> "Traffic":
        world = need.shape[0]
        remote = need & (unit_owner[None, :] != np.arange(world)[:, None])
        kv_sent = np.bincount(unit_owner, weights=remote.sum(axis=0) * unit_tokens, minlength=world)
        kv_received = remote.astype(np.int64) @ unit_tokens
        q_sent = np.bincount(unit_owner, weights=moved.sum(axis=1) * unit_tokens, minlength=world)
        q_hosted = moved.T.astype(np.int64) @ unit_tokens
        return cls(*(np.asarray(a, dtype=np.int64) for a in (kv_sent, kv_received, q_sent, q_hosted)))

    def bytes_sent(self, rank: int, *, batch: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int,
                   backward: bool) -> int:
        """Every byte ``rank`` sends in one pass (see ShardPlan.bytes_sent)."""
        kv_row = 2 * batch * kv_heads * head_dim * itemsize  # K and V of one token
        q_row = batch * q_heads * head_dim * itemsize  # one token's Q (or O, dO, dQ)
        lse = batch * q_heads * 4
        kv_s, kv_r, q_s, q_h = (int(a[rank]) for a in (self.kv_sent, self.kv_received, self.q_sent, self.q_hosted))
        if not backward:  # K/V out; Q out; partial O and LSE of hosted queries back
            return kv_s * kv_row + q_s * q_row + q_h * (q_row + lse)
        # K/V again and dK/dV of what it received back; Q, dO, O and LSE out; dQ of hosted queries back
        return kv_s * kv_row + kv_r * kv_row + q_s * (3 * q_row + lse) + q_h * q_row

    def cost(self, costs: TokenCosts) -> np.ndarray:
        """[W] relative forward+backward bytes each rank sends (the planner compares candidates by the max)."""
        kv = costs.kv / 3  # K and V of one token, in the same unit as costs.q / 6 for one Q row
        q = costs.q / 6
        return 2 * kv * self.kv_sent + kv * self.kv_received + 4 * q * self.q_sent + 2 * q * self.q_hosted


__all__ = ["route", "TokenCosts", "Traffic", "KV_ROWS_PER_HEAD", "Q_ROWS_PER_HEAD"]
