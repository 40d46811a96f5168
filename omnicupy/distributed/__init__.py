"""Context parallelism: one attention over a sequence sharded across the GPUs of an NCCL communicator.

    from omnicupy import BlockMask, distributed as dist
    comm = dist.init()                                   # torchrun / mpirun environment, or a communicator
    plan = dist.plan(BlockMask.causal(N, N), comm.size)  # who owns which tokens, who needs which K/V
    q_r, k_r, v_r = (dist.shard(x, plan, comm.rank) for x in (q, k, v))
    out_r, lse_r = dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True)
    dq_r, dk_r, dv_r = dist.attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, plan, comm)
    out = dist.unshard(out_r, plan, comm)

Modules, each with one job: work (a mask's work per unit pair), assign (chunks to ranks), routing
(which queries travel to their keys instead of keys to queries), planner (who owns which tokens,
who sends what; NumPy), submask (a BlockMask sliced to some queries and one message's keys), steps
(what one rank sends, receives and computes), merge (exact LSE merging, sinks), comm (NCCL set-up,
transfers, failures), exchange (transfers overlapped with compute), sharded_attention (forward and
backward), heads (head parallelism), sharding (shard / unshard), model (the scaling model; ``python
-m omnicupy.distributed.model [--families]``), families (the issue's mask families at block level,
for the model). docs/context_parallel.md explains them.
"""
from __future__ import annotations

from .sharded_attention import attention, attention_backward
from .comm import Communicator, detect_launch, from_unique_id, init
from .errors import BackwardUnavailableError, CommunicationError, CommunicationTimeoutError, DistributedError
from .planner import BLOCK_WEIGHTS, ROUTES, ShardPlan, plan
from .steps import program
from .sharding import gather_shards, shard, unshard

__all__ = [
    "attention", "attention_backward", "Communicator", "init", "from_unique_id", "detect_launch", "plan", "ShardPlan",
    "program", "shard", "unshard", "gather_shards", "BLOCK_WEIGHTS", "ROUTES", "DistributedError",
    "BackwardUnavailableError", "CommunicationError", "CommunicationTimeoutError",
]
