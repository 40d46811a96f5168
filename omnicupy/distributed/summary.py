"""A distributed plan in a few lines: what ``print(plan)`` shows (the arrays behind it stay on the
object: ``plan.unit_owner``, ``plan.exchange_work``, ...). Knows ShardPlan's fields by name only."""
from __future__ import annotations

from typing import Any

import numpy as np

#: Ranks listed one per line up to this world size; past it, the least and most loaded.
MAX_RANK_LINES = 8


def summary(plan: Any) -> str:
    """A short, fixed-size description of a ShardPlan."""
    work = np.asarray(plan.rank_work, dtype=np.float64)
    mean = float(work.mean()) if work.size else 0.0
    lines = [f"ShardPlan: {plan.seq_len} tokens over {plan.world_size} ranks, strategy {plan.strategy} "
             f"({plan.chunks_per_rank} chunks per rank, units of {plan.unit} tokens), schedule {plan.schedule}",
             f"  blocks {plan.q_block_size} x {plan.kv_block_size}; work imbalance {plan.imbalance:.3f} "
             f"(max / mean, limit {plan.max_imbalance:g})"]
    ranks = list(range(plan.world_size))
    if len(ranks) > MAX_RANK_LINES:
        order = np.argsort(work, kind="stable")
        ranks = sorted({int(order[0]), int(order[-1])})
        lines.append(f"  {plan.world_size} ranks; the least and the most loaded:")
    for r in ranks:
        share = work[r] / mean if mean > 0 else 1.0
        lines.append(f"  rank {r}: {plan.local_len(r)} tokens, work {share:.2f} x mean, "
                     f"receives {plan.tokens_received(r)} K/V tokens")
    return "\n".join(lines)


__all__ = ["summary", "MAX_RANK_LINES"]
